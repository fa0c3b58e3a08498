"""The RL entry points for real: recipes/gspo.py and the SFT → GSPO chain (examples/sft_to_gspo.py)
on a tiny Llama saved with SmolLM2's tokenizer, with and without LoRA."""

from __future__ import annotations

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_meshtune.apps.assets import smollm2_checkpoint
from tests.test_recipes import load_script
from tests.tiny import make_tiny_causal_lm

pytestmark = pytest.mark.usefixtures("single_thread_torch")

MESH = [
    "--preset",
    "paper",
    "--use_cpu",
    "--report_to",
    "none",
    "--num_stages",
    "2",
    "--anchor_every",
    "1",
    "--anchor_delay",
    "1",
    "--num_replicas",
    "3",
    "--logging_steps",
    "1",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    """A tiny random Llama with SmolLM2's tokenizer and chat template, saved like any local model."""
    path = tmp_path_factory.mktemp("tiny")
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    model = make_tiny_causal_lm(
        "llama",
        hidden=32,
        layers=4,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def test_gspo_recipe_trains_scores_and_saves_a_plain_checkpoint(tiny_dir, tmp_path, monkeypatch):
    from hf_meshtune.apps import arithmetic

    scored = []  # (weights, score) of every exact_match call: before training, then after

    def spy(model, *args, **kwargs):
        score = exact_match(model, *args, **kwargs)
        scored.append(({k: v.detach().clone() for k, v in model.state_dict().items()}, score))
        return score

    exact_match = arithmetic.exact_match
    monkeypatch.setattr(arithmetic, "exact_match", spy)
    out = tmp_path / "gspo"
    metrics = load_script("recipes/gspo.py").main(
        [
            "--output_dir",
            str(out),
            "--model_name_or_path",
            str(tiny_dir),
            "--max_steps",
            "2",
            "--num_generations",
            "4",
            "--per_device_train_batch_size",
            "4",
            "--max_completion_length",
            "8",
            "--eval_items",
            "4",
            "--save_strategy",
            "no",
            *MESH,
        ]
    )
    # before: the untouched model's score; after: the score of the weights that were saved. (The tiny random
    # policy earns no reward on arithmetic, so its advantages are 0 and the weights need not move here;
    # tests/test_trl.py trains GSPO with a graded reward and checks that they do.)
    (initial, before), (trained, after) = scored
    assert (metrics["eval_exact_match_before"], metrics["eval_exact_match_after"]) == (before, after)
    start = AutoModelForCausalLM.from_pretrained(tiny_dir).state_dict()
    saved = AutoModelForCausalLM.from_pretrained(out).state_dict()
    assert all(torch.equal(initial[k], start[k]) for k in start)
    assert all(torch.equal(trained[k], saved[k]) for k in saved)
    assert json.loads((out / "gspo_results.json").read_text()) == metrics
    args = json.loads((out / "trainer_state.json").read_text())
    assert args["global_step"] == 2 and any("comm/pp_fwd_bytes_per_token" in e for e in args["log_history"])
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    assert "## Trained with hf_meshtune" in (out / "README.md").read_text()
    from hf_meshtune.report import write_report  # an RL run's report carries its reward

    written = write_report(out)
    rewards = [e["reward"] for e in args["log_history"] if "reward" in e]
    (row,) = written["rows"]
    assert rewards and row["first_reward"] == rewards[0] and row["last_reward"] == rewards[-1]
    assert "| first reward | last reward |" in (out / "report.md").read_text()


def _lora_chain(tiny_dir, out, steps: int, *flags: str) -> dict:
    """``examples/sft_to_gspo.py`` with LoRA on the tiny model: ``steps`` SFT and GSPO steps, 4 generations,
    4 held-out problems; ``flags`` are the example's own, then ``--`` and the recipes'."""
    common = ["--output_dir", str(out), "--model_name_or_path", str(tiny_dir), "--use_peft"]
    common += ["--sft_steps", str(steps), "--gspo_steps", str(steps), "--num_generations", "4", "--eval_items", "4"]
    return load_script("examples/sft_to_gspo.py").main([*common, *flags])


def test_sft_then_gspo_with_lora_continues_from_the_saved_adapter(tiny_dir, tmp_path):
    from peft import PeftModel

    out = tmp_path / "chain"
    result = _lora_chain(tiny_dir, out, 2, "--", *MESH)
    assert set(result) >= {"exact_match_base", "exact_match_after_sft", "exact_match_after_gspo", "gspo_reward_last"}
    assert math.isfinite(result["sft_eval_loss"])
    assert json.loads((out / "chain.json").read_text())["exact_match_after_gspo"] == result["exact_match_after_gspo"]
    assert (out / "sft" / "adapter_config.json").is_file() and (out / "gspo" / "adapter_config.json").is_file()
    # GSPO's adapter sits on the SFT-merged base: base + SFT adapter merged, then the GSPO adapter
    from peft import AutoPeftModelForCausalLM

    merged = AutoPeftModelForCausalLM.from_pretrained(out / "sft").merge_and_unload()
    PeftModel.from_pretrained(merged, out / "gspo")


@pytest.mark.slow
def test_sft_then_gspo_with_lora_on_a_launched_3x2_mesh(tiny_dir, tmp_path):
    """The chain with ``--mesh 3x2``: SFT on the mesh → its adapter merged → GSPO on the same mesh, the anchor
    on; both recipes write what a single-process run writes, GSPO's rollouts through the pipelines."""
    from peft import AutoPeftModelForCausalLM, PeftModel

    out = tmp_path / "chain"
    flags = ("--use_cpu", "--report_to", "none", "--anchor", "true", "--logging_steps", "1")
    result = _lora_chain(tiny_dir, out, 3, "--mesh", "3x2", "--", *flags)
    assert all(isinstance(result[k], float) for k in ("exact_match_after_sft", "exact_match_after_gspo"))
    assert math.isfinite(result["sft_eval_loss"]) and result["gspo_reward_last"] is not None
    for phase in ("sft", "gspo"):
        summary = json.loads((out / phase / "mesh_summary.json").read_text())
        assert summary["mesh"] == "3x2" and summary["steps"] == 3 and summary["anchor_rounds"] >= 1
    gspo = json.loads((out / "gspo" / "mesh_summary.json").read_text())
    assert gspo["rollout_bytes"]["fast"] > 0 and gspo["rollout_bytes"]["anchor"] > 0
    history = json.loads((out / "gspo" / "trainer_state.json").read_text())["log_history"]
    assert [e["step"] for e in history if "reward" in e] == [1, 2, 3]
    merged = AutoPeftModelForCausalLM.from_pretrained(out / "sft").merge_and_unload()
    PeftModel.from_pretrained(merged, out / "gspo")  # GSPO's adapter sits on the SFT-merged base
