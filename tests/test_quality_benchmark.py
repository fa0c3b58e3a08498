"""The quality benchmark's pipeline end to end on a tiny random Llama: every kind of row (dense, masked
with the anchor, a codec that the anchor-side refit touches) trains through MeshTrainer, is scored
with the real metrics, and lands in the report. Also the metric helpers against simple references."""

from __future__ import annotations

import json
import math

import pytest
import torch

from benchmarks.quality import evaluate, report, run
from benchmarks.quality.pretrain import _train_tokenizer
from benchmarks.quality.tasks import Example, Task
from tests.tiny import make_tiny_causal_lm

TEXT = " ".join(
    f"Question: {a} plus {b}? Answer: {a + b} #### {a + b}. SELECT name FROM t;" for a in range(40) for b in range(5)
)


@pytest.fixture(scope="module")
def tokenizer():
    return _train_tokenizer(TEXT, 300)


def _load(tokenizer):
    def load():
        eos = tokenizer.eos_token_id
        model = make_tiny_causal_lm(
            "llama",
            hidden=32,
            layers=4,
            vocab_size=len(tokenizer),
            max_position_embeddings=256,
            eos_token_id=eos,
            pad_token_id=eos,
            bos_token_id=eos,
        )
        return model, tokenizer

    return load


MODE = run.Mode(steps=3, batch_size=4, seq_len=160, eval_every=1, n_train=16, n_eval=6, seeds=(0,))


@pytest.mark.parametrize(
    "table,row,knobs,codec",
    [
        ("table1", "Dense", run.DENSE, None),
        ("table1", "M95+AP", dict(mask_ratio=0.9, anchor_every=1), None),
        ("codecs", "pca", run.DENSE, dict(codec="pca", rank=3)),
    ],
)
def test_run_one_trains_scores_and_reports(tokenizer, tmp_path, table, row, knobs, codec, monkeypatch):
    monkeypatch.setattr(run, "CodecRefit", _counting(run.CodecRefit))
    scored = []  # (the model's weights, the metric) of every task_metric call

    def spy(model, *args):
        metric = run_task_metric(model, *args)
        scored.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, metric))
        return metric

    run_task_metric = run.task_metric
    monkeypatch.setattr(run, "task_metric", spy)
    spec = run.RunSpec(table, row, "arithmetic", 0, dict(knobs), codec)
    result = run_one_small(spec, tokenizer)
    # the reported metric is the trained model's score: the first call, on weights that moved from the
    # initial model's (then one call per pruned share, where the table prunes)
    weights, metric = scored[0]
    assert result["metric"] == metric and len(scored) == 1 + len(result.get("pruned", {}))
    initial = _load(tokenizer)()[0].state_dict()
    assert any(not torch.equal(weights[k], initial[k]) for k in initial)
    assert result["metric"]["exact_match"] * MODE.n_eval == round(result["metric"]["exact_match"] * MODE.n_eval)
    evals = [h["eval_loss"] for h in result["log_history"] if "eval_loss" in h]
    assert len(evals) == MODE.steps and all(math.isfinite(e) for e in evals)
    assert result["timing"]["steps"] == MODE.steps
    if row == "M95+AP":
        assert result["timing"]["anchor_s"] > 0 and result["timing"]["optimizer_s"] > 0
        assert set(result["pruned"]) == {"0.3", "0.5", "0.7"}
    if codec:
        wire = result["codec_wire_bytes_per_token"]
        assert wire["fwd"] == wire["bwd"] == 2 * 3 and wire["dense"] == 2 * 32
        # booked (tokens × formula: the baseline codecs build no message), so this checks that the run booked
        # every token once, not traffic; the formula against real packed messages: tests/test_codecs.py
        assert wire["booked_fwd"] == pytest.approx(wire["fwd"])
    (tmp_path / "quick").mkdir()
    (tmp_path / "quick" / f"{spec.run_id}.json").write_text(json.dumps(result, default=str))
    report.write_report(tmp_path)
    text = (tmp_path / "quick" / "results.md").read_text()
    assert row in text and (tmp_path / "quick" / f"{table}_eval_loss.png").exists()


def test_the_composed_table_trains_through_the_codec_and_reports_its_bytes_beside_dense(tokenizer, tmp_path):
    (tmp_path / "quick").mkdir()
    for row, knobs in (
        ("Dense", run.DENSE),
        ("outliers2+int4x3", dict(boundary_codec="outliers2+int4x3", anchor=False)),
    ):
        spec = run.RunSpec("composed", row, "arithmetic", 0, dict(knobs))
        result = run_one_small(spec, tokenizer)
        fwd = [h["comm/measured_pp_fwd_bytes_per_token"] for h in result["log_history"] if "loss" in h][0]
        # fp32 run, 3 boundaries: 2 outliers (8 B) + 3 scales (6 B) + ⌈30/8⌉·4 codes (16 B) = 30 B a real token and
        # boundary (bf16: 4 + 6 + 16 = 26 B, 2.5× of 64)
        assert fwd == (3 * 30 if row != "Dense" else 3 * 4 * 32)
        (tmp_path / "quick" / f"{spec.run_id}.json").write_text(json.dumps(result, default=str))
    report.write_report(tmp_path)
    text = (tmp_path / "quick" / "results.md").read_text()
    line = next(x for x in text.splitlines() if x.startswith("| `outliers2+int4x3`"))
    assert "| 0 | 26 | 2.5× |" in line and line.count("%") == 2  # the metric and the eval loss, each with its gap
    assert (tmp_path / "quick" / "composed_pareto.png").exists()


def _counting(cls):
    class Counting(cls):
        def on_step_begin(self, args, state, control, **kwargs):
            before = self.handle.codecs[0].basis.clone()
            super().on_step_begin(args, state, control, **kwargs)
            refit = state.global_step % self.every == 0 and state.global_step > 0
            assert refit != torch.equal(before, self.handle.codecs[0].basis)

    return Counting


def run_one_small(spec, tokenizer):
    return run.run_one(spec, MODE, load=_load(tokenizer))


def test_prompts_longer_than_seq_len_are_rejected_by_name(tokenizer):
    spec = run.RunSpec("table1", "Dense", "arithmetic", 0, dict(run.DENSE))
    with pytest.raises(ValueError, match=r"seq_len=8 is invalid: it must leave answer tokens"):
        run.run_one(spec, run.Mode(**{**MODE.__dict__, "seq_len": 8}), load=_load(tokenizer))


def test_sft_row_masks_the_prompt(tokenizer):
    row = evaluate.sft_row(tokenizer, "Question: 1 plus 2?", " 3", 64)
    prompt_len = len(tokenizer("Question: 1 plus 2?")["input_ids"])
    assert row["labels"][:prompt_len] == [-100] * prompt_len
    assert row["labels"][prompt_len:] == row["input_ids"][prompt_len:]
    assert row["input_ids"][-1] == tokenizer.eos_token_id


def test_continuation_logprobs_match_a_one_by_one_reference(tokenizer):
    model, _ = _load(tokenizer)()
    pairs = [("Question: 3 plus 4?", " 7"), ("Answer:", " 12 #### 12"), ("SELECT", " name FROM t;")]
    batched = evaluate.continuation_logprobs(model, tokenizer, pairs)
    for (prompt, cont), got in zip(pairs, batched):
        p = tokenizer(prompt)["input_ids"]
        c = tokenizer(cont)["input_ids"]
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=torch.tensor([p + c])).logits[0].double(), -1)
        expected = sum(float(logp[len(p) - 1 + i, tok]) for i, tok in enumerate(c))
        assert got == pytest.approx(expected, abs=1e-4)


def test_perplexity_matches_mean_token_nll(tokenizer):
    model, _ = _load(tokenizer)()
    docs = ["Question: 5 plus 1? Answer: 6", "SELECT name FROM t;"]
    got = evaluate.perplexity(model, tokenizer, docs, seq_len=64)
    nll, count = 0.0, 0
    for doc in docs:
        ids = torch.tensor([tokenizer(doc)["input_ids"]])
        with torch.no_grad():
            loss = model(input_ids=ids, labels=ids).loss
        nll, count = nll + loss.item() * (ids.shape[1] - 1), count + ids.shape[1] - 1
    assert got == pytest.approx(math.exp(nll / count), rel=1e-5)


def test_magnitude_pruned_zeroes_the_smallest_share_and_restores(tokenizer):
    model, _ = _load(tokenizer)()
    weight = model.model.layers[0].mlp.up_proj.weight
    original = weight.detach().clone()
    embed = model.model.embed_tokens.weight.detach().clone()
    with evaluate.magnitude_pruned(model, 0.5):
        zeros = int((weight == 0).sum())
        assert zeros == weight.numel() // 2
        kept = weight[weight != 0].abs().min()
        assert kept >= original.abs().flatten().kthvalue(weight.numel() // 2).values
        assert torch.equal(model.model.embed_tokens.weight, embed)
    assert torch.equal(weight, original)


def test_task_metric_scores_generations_with_the_task(tokenizer):
    model, _ = _load(tokenizer)()
    task = Task(
        "t",
        "generate",
        [Example("Q", " 1")],
        [Example("Question: 1 plus 1?\nAnswer:", " 2 #### 2")],
        max_new_tokens=4,
        scorer=lambda item, text: True,
    )
    assert evaluate.task_metric(model, tokenizer, task, 32)["exact_match"] == 1.0
    task.scorer = lambda item, text: False
    assert evaluate.task_metric(model, tokenizer, task, 32)["exact_match"] == 0.0


def test_delta_codec_rows_see_samples_again_and_send_less(tokenizer):
    """AQ-SGD only compresses a sample it has seen: the runner pads its rows to one shape so that a
    sample's key is stable across epochs, and the measured forward bytes fall below dense."""
    spec = run.RunSpec("codecs", "delta_quant2", "arithmetic", 0, dict(run.DENSE), dict(codec="delta_quant", bits=2))
    mode = run.Mode(**{**MODE.__dict__, "steps": 6, "n_train": 8})
    wire = run.run_one(spec, mode, load=_load(tokenizer))["codec_wire_bytes_per_token"]
    # 24 rows over 8 samples: the first epoch at 2 bytes/value, the next two at 2 bits + scale
    assert wire["fwd"] < wire["booked_fwd"] < 0.5 * wire["dense"]


def test_gradient_probe_cosine_is_one_for_a_lossless_scheme_and_lower_for_masks(tokenizer, monkeypatch):
    from benchmarks.quality import gradient_probe

    monkeypatch.setattr(
        gradient_probe,
        "SCHEMES",
        {
            "quant8": dict(codec=dict(codec="quant4", bits=8)),
            "M75": dict(mask=dict(mask_ratio=0.75)),
            "M75 gaussian fill": dict(mask=dict(mask_ratio=0.75, fill="gaussian")),
        },
    )
    model, _ = _load(tokenizer)()
    rows = [evaluate.sft_row(tokenizer, f"Question: {a} plus 1?", f" {a + 1}", 32) for a in range(8)]
    width = max(len(r["input_ids"]) for r in rows)
    batch = {
        key: torch.tensor([r[key] + [pad] * (width - len(r[key])) for r in rows])
        for key, pad in (("input_ids", 0), ("attention_mask", 0), ("labels", -100))
    }
    result = gradient_probe.probe(model, batch, {k: v for k, v in batch.items() if k != "labels"})
    assert result["Dense"]["cos"] == 1.0
    assert result["quant8"]["cos"] > 0.99 and abs(result["quant8"]["loss"] - result["Dense"]["loss"]) < 0.05
    assert result["M75"]["cos"] < 0.95 and result["M75"]["loss"] != result["Dense"]["loss"]
    # noise where the mask dropped values: a gradient of its own, not zero fill's, and still lossy
    gaussian = result["M75 gaussian fill"]
    assert gaussian["cos"] != result["M75"]["cos"] and gaussian["loss"] != result["M75"]["loss"]
    assert -1.0 <= gaussian["cos"] < result["quant8"]["cos"]


def test_the_composed_table_compares_each_row_with_dense_of_its_own_seeds_and_base():
    def fake(row, seed, before, loss, em):
        spec = {"table": "composed", "row": row, "task": "arithmetic", "seed": seed, "knobs": {}}
        return {
            "spec": spec,
            "metric": {"exact_match": em},
            "eval_loss_before": before,
            "log_history": [{"eval_loss": loss}],
            "ledger": {"hidden_size": 32},
        }

    dense = [fake("Dense", 0, 6.0, 1.0, 0.5), fake("Dense", 1, 6.0, 2.0, 0.5)]
    paired = fake("outliers2+int4x3", 1, 6.0, 2.02, 0.5)  # seed 1 only: against Dense seed 1 (2.0), not the mean
    other = fake("outliers2+int8", 0, 6.1, 1.0, 0.5)  # fine-tuned from another base model
    assert report.paired_dense([paired], dense) == [dense[1]]
    assert report.paired_dense([other], dense) is None
    lines = report.composed([*dense, paired, other])
    row = next(x for x in lines if x.startswith("| `outliers2+int4x3`"))
    assert "2.020 (+1.0 %)" in row
    row = next(x for x in lines if x.startswith("| `outliers2+int8`"))
    assert row.count("(other base)") == 2 and "%" not in row
