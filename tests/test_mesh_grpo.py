"""GRPO/GSPO on the distributed mesh (``rl.rollouts``, ``MeshGRPOTrainer`` launched on X·Y processes).

The pieces have their own equivalence tests: generation through the stages against ``generate()``
(``test_generate``), the policy loss against TRL's (``test_rl_loss``). Here: the advantages against TRL's
own computation, one mesh step against single-process TRL on the same completions, and a 3×2 run with the
anchor whose reward rises.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM
from trl import GRPOTrainer

from hf_meshtune import MeshGRPOTrainer, MeshGSPOConfig
from hf_meshtune.pipeline.generate import RolloutSettings
from hf_meshtune.rl.rollouts import AdvantageSettings, MeshRollouts, completion_mask, group_advantages
from tests.distributed import mesh_launch
from tests.scripts.mesh_grpo import LORA, MAX_COMPLETION, fixed_completion, low_ids_reward, prompts
from tests.tiny import make_tiny_causal_lm, tiny_word_tokenizer

pytestmark = pytest.mark.usefixtures("single_thread_torch")

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "tests", "scripts", "mesh_grpo.py")
STEP = dict(
    per_device_train_batch_size=4,
    gradient_accumulation_steps=2,
    num_generations=4,
    max_completion_length=MAX_COMPLETION,
    logging_steps=1,
    report_to="none",
    use_cpu=True,
    save_strategy="no",
    seed=0,
)


def _flags(values: dict) -> list[str]:
    return [part for name, value in values.items() for part in (f"--{name}", str(value))]


def _fixed_generation(self, prompt_ids, images, multimodal_fields, num_generations, has_tool_images=False):
    """TRL's ``_generate_single_turn`` replaced: the completions the mesh test script gives its stages."""
    return [fixed_completion(list(p), i % self.num_generations) for i, p in enumerate(prompt_ids)], None


# --- advantages -------------------------------------------------------------------------------------
def _trl_advantages(tmp_path, rewards: list[list[float | None]], **knobs) -> torch.Tensor:
    """TRL's ``_generate_and_score_completions`` on 2 prompts × 4 known completions, the reward functions
    returning ``rewards`` (one column per function); its advantages."""
    columns = list(zip(*rewards))
    funcs = [lambda completions, _c=c, **kw: list(_c) for c in columns]
    for i, func in enumerate(funcs):
        func.__name__ = f"r{i}"
    args = MeshGSPOConfig(str(tmp_path / "trl"), anchor=False, mask_ratio=0.0, optim="adamw_torch", **STEP, **knobs)
    trainer = MeshGRPOTrainer(
        model=make_tiny_causal_lm("llama"),
        reward_funcs=funcs,
        args=args,
        train_dataset=prompts(2),
        processing_class=tiny_word_tokenizer(),
    )
    inputs = [dict(row) for row in prompts(2) for _ in range(4)]
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOTrainer, "_generate_single_turn", _fixed_generation)
        trainer.model.eval()
        return trainer._generate_and_score_completions(inputs)["advantages"].float()


ADVANTAGE_CASES = [
    dict(),
    dict(scale_rewards="batch"),
    dict(scale_rewards="none"),
    dict(multi_objective_aggregation="normalize_then_sum", reward_weights=[1.0, 0.5]),
    dict(reward_weights=[2.0, -1.0]),
]


@pytest.mark.parametrize(
    "knobs", ADVANTAGE_CASES, ids=lambda k: ",".join(f"{a}={b}" for a, b in k.items()) or "default"
)
def test_group_advantages_are_trls(tmp_path, knobs):
    """Two reward functions over two groups of four, one row unscored by both and one by one of them."""
    rewards = [[1.0, 0.2], [0.0, None], [0.5, 0.7], [None, None], [2.0, 1.0], [2.0, 1.0], [2.0, 1.0], [0.0, 3.0]]
    want = _trl_advantages(tmp_path, rewards, **knobs)
    per_func = torch.tensor([[torch.nan if v is None else v for v in row] for row in rewards])
    settings = AdvantageSettings(
        num_generations=4,
        weights=tuple(knobs.get("reward_weights", [1.0, 1.0])),
        scale_rewards=knobs.get("scale_rewards", "group"),
        multi_objective_aggregation=knobs.get("multi_objective_aggregation", "sum_then_normalize"),
    )
    got, _ = group_advantages(per_func, settings)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    assert got.abs().max() > 0.1


def test_the_completion_mask_keeps_each_row_to_its_first_eos():
    ids = torch.tensor([[5, 2, 7, 2], [5, 6, 7, 8], [2, 0, 0, 0]])
    assert completion_mask(ids, [2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]]
    assert completion_mask(ids, [7, 2]).tolist() == [[1, 1, 0, 0], [1, 1, 1, 0], [1, 0, 0, 0]]


# --- one step: the mesh against single-process TRL ------------------------------------------------------
def _single_process_step(tmp_path, model_dir, knobs: dict, lora: bool) -> tuple[torch.nn.Module, dict]:
    from peft import LoraConfig

    args = MeshGSPOConfig(str(tmp_path / "single"), **{**STEP, **knobs})
    trainer = MeshGRPOTrainer(
        model=AutoModelForCausalLM.from_pretrained(model_dir),
        reward_funcs=low_ids_reward,
        args=args,
        train_dataset=prompts(2),
        processing_class=tiny_word_tokenizer(),
        peft_config=LoraConfig(**LORA) if lora else None,
    )
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(GRPOTrainer, "_generate_single_turn", _fixed_generation)
        trainer.train()
    return trainer.model, [e for e in trainer.state.log_history if "reward" in e]


def _trained(out, model_dir, lora: bool) -> dict[str, torch.Tensor]:
    """What the mesh saved, by the names the single-process model has (a LoRA adapter on its base)."""
    if not lora:
        return AutoModelForCausalLM.from_pretrained(out).state_dict()
    from peft import PeftModel

    return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out).state_dict()


STEP_CASES = [
    pytest.param("grpo", 0.0, False, id="gspo"),
    pytest.param("dapo", 0.0, False, id="dapo-token"),
    pytest.param("grpo", 0.1, False, id="gspo-kl-reference-model"),
    pytest.param("grpo", 0.1, True, id="gspo-kl-lora-adapter-off"),
]


@pytest.mark.slow
@pytest.mark.parametrize(("loss_type", "beta", "lora"), STEP_CASES)
def test_one_step_on_a_two_stage_mesh_is_single_process_trls_on_the_same_rollouts(tmp_path, loss_type, beta, lora):
    """Y = 2, one fast replica, codec off, the same known completions on both sides: the mesh's rewards,
    losses and updated parameters equal single-process MeshGRPOTrainer's (TRL's loop) over two steps, for
    GSPO and token-level DAPO, and with β > 0 for π_ref from TRL's reference model (each stage holding its
    own layers of it) and from the LoRA policy with its adapter off (at the second step the policy has left
    π_ref, so the KL term and its gradient are not zero). Adam's ε = 1 makes each update ≈ lr·m̂/√v̂ smooth in
    the gradients (not lr·sign(g)), so equal parameters mean equal gradients; tolerance 1e-7 on parameters
    moved by up to ~1e-3."""
    knobs = dict(
        max_steps=2,
        learning_rate=1e-2,
        adam_epsilon=1.0,
        max_grad_norm=0.0,
        weight_decay=0.0,
        lr_scheduler_type="constant",
        anchor=False,
        mask_ratio=0.0,
        optim="adamw_torch",
        num_stages=2,
        loss_type=loss_type,
        importance_sampling_level="sequence" if loss_type == "grpo" else "token",
        beta=beta,
    )
    model_dir = tmp_path / "policy"
    make_tiny_causal_lm("llama", hidden=32, layers=4).save_pretrained(model_dir)
    out = tmp_path / "mesh"
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn", "MESHTUNE_TEST_FIXED_COMPLETIONS": "1"}
    env.update({"MESHTUNE_TEST_MODEL": str(model_dir), **({"MESHTUNE_TEST_LORA": "1"} if lora else {})})
    command = [*mesh_launch("1x2"), SCRIPT, "--output_dir", str(out), *_flags({**STEP, **knobs})]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    mesh = _trained(out, model_dir, lora)
    mesh_logs = [e for e in json.loads((out / "trainer_state.json").read_text())["log_history"] if "reward" in e]

    single, single_logs = _single_process_step(tmp_path, model_dir, knobs, lora)
    start = AutoModelForCausalLM.from_pretrained(model_dir).state_dict()
    moved = 0.0
    for name, param in single.state_dict().items():
        torch.testing.assert_close(mesh[name], param, rtol=0, atol=1e-7, msg=name)
        base = start.get(name.replace("base_model.model.", "").replace(".base_layer", ""))
        moved = max(moved, float((param - (base if base is not None else 0)).abs().max()))
    assert moved > 1e-4  # the step did move the parameters
    assert len(mesh_logs) == len(single_logs) == 2
    for mesh_log, single_log in zip(mesh_logs, single_logs):
        assert mesh_log["reward"] == pytest.approx(single_log["reward"], abs=1e-6)
        assert mesh_log["loss"] == pytest.approx(single_log["loss"], abs=1e-5)
        assert mesh_log["completions/mean_length"] == pytest.approx(single_log["completions/mean_length"])
        if beta:  # a mean of per-slice means, and TRL shuffles the rows into its slices: close, not equal
            assert mesh_log["kl"] == pytest.approx(single_log["kl"], rel=0.2, abs=1e-9)
    if beta:
        assert mesh_logs[1]["kl"] > 1e-6  # the second step's policy is not π_ref


# --- a real run -------------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_3x2_gspo_run_with_the_anchor_raises_its_reward(tmp_path):
    """Two fast replicas (the default codec, DiLoCo) and the anchor replica, 30 steps on the low-ids task
    with a small KL to a reference model: each replica samples its own rollouts through its pipeline and
    scores π_ref through its stages, the anchor does the same with its own, and the logged reward rises
    from about one half."""
    out = tmp_path / "gspo"
    knobs = dict(
        max_steps=30,
        learning_rate=1e-2,
        lr_scheduler_type="constant",
        num_stages=2,
        anchor=True,
        beta=0.01,
    )
    model_dir = tmp_path / "policy"
    make_tiny_causal_lm("llama", hidden=32, layers=4).save_pretrained(model_dir)
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn", "MESHTUNE_TEST_MODEL": str(model_dir)}
    command = [*mesh_launch("3x2"), SCRIPT, "--output_dir", str(out), *_flags({**STEP, **knobs})]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rewards = json.loads((out / "rewards.json").read_text())
    assert len(rewards) == 30
    first, last = sum(rewards[:5]) / 5, sum(rewards[-5:]) / 5
    assert first < 0.65 and last > first + 0.15, rewards
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["anchor_rounds"] >= 1 and summary["anchor_arrivals"] >= 1
    assert summary["rollout_bytes"]["fast"] > 0 and summary["rollout_bytes"]["anchor"] > 0
    # per decoded position and boundary: the new token's hidden state (H = 32 fp32) at least
    assert summary["rollout_bytes_per_decoded_token"] >= 32 * 4
    assert set(summary["step_time_split_s"]) == {"rollout", "pipeline", "update_and_sync"}
    # the policy loss reads any position, so every position of a row crosses; per token the boundary's bytes are
    # the ledger's (its record over the coder's ratio measured on this run) plus each message's 24-byte header
    measured, analytic = summary["measured_bytes_per_token"], summary["analytic_bytes_per_token"]
    assert analytic["pp_fwd"] <= measured["pp_fwd"] <= analytic["pp_fwd"] + 24, (measured, analytic)
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert all(e["kl"] >= 0 for e in history if "reward" in e) and history[-2]["kl"] > 0


@pytest.mark.slow
def test_a_gspo_mesh_resumes_from_a_checkpoint_exactly(tmp_path):
    """2×2, DiLoCo syncing every 2 steps, sampled rollouts: a run resumed from checkpoint-4 logs the
    uninterrupted run's rewards and losses at steps 5–8, bit for bit, and ends with its parameters (the
    prompts and the draws are functions of seed, replica and step)."""
    first, second = tmp_path / "first", tmp_path / "second"
    knobs = dict(
        max_steps=8,
        learning_rate=1e-2,
        num_stages=2,
        anchor=False,
        dp_sync_every=2,
        save_strategy="steps",
        save_steps=4,
    )
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    flags = _flags({**STEP, **knobs})
    for out, extra in ((first, []), (second, ["--resume_from_checkpoint", str(first / "checkpoint-4")])):
        command = [*mesh_launch("2x2"), SCRIPT, "--output_dir", str(out), *flags, *extra]
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    logs = [json.loads((out / "trainer_state.json").read_text())["log_history"] for out in (first, second)]
    uninterrupted = {e["step"]: e for e in logs[0] if "reward" in e}
    resumed = {e["step"]: e for e in logs[1] if "reward" in e}
    assert sorted(resumed) == [5, 6, 7, 8]
    for step, entry in resumed.items():
        assert (entry["reward"], entry["loss"]) == (uninterrupted[step]["reward"], uninterrupted[step]["loss"])
    assert len({e["reward"] for e in resumed.values()}) > 1  # the steps drew different rollouts
    a, b = (AutoModelForCausalLM.from_pretrained(out).state_dict() for out in (first, second))
    assert all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.slow
def test_the_same_gspo_script_runs_under_torchrun(tmp_path):
    """torchrun on 4 CPU processes, no MESHTUNE_MESH or TORCHFT_LIGHTHOUSE: Y from --num_stages, X = 2 from
    WORLD_SIZE, rank 0 starts the lighthouse; both replicas generate, score and train."""
    out = tmp_path / "torchrun"
    env = {key: value for key, value in os.environ.items() if key not in ("TORCHFT_LIGHTHOUSE", "MESHTUNE_MESH")}
    env.update({"PYTHONPATH": ROOT, "RUST_LOG": "warn", "ACCELERATE_USE_CPU": "true"})
    torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
    knobs = dict(max_steps=3, num_stages=2, anchor=False)
    command = [torchrun, "--nproc-per-node", "4", SCRIPT, "--output_dir", str(out), *_flags({**STEP, **knobs})]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["mesh"] == "2x2" and summary["mesh_env"] is None and summary["steps"] == 3
    assert summary["rollout_bytes"]["fast"] > 0
    assert len(json.loads((out / "rewards.json").read_text())) == 3


def _rollouts(reward_funcs, rows: int = 4) -> MeshRollouts:
    return MeshRollouts(
        prompts=lambda step: [],
        tokenize=lambda prompts: [],
        decode=lambda ids: [" ".join(map(str, row)) for row in ids],
        reward_funcs=reward_funcs,
        reward_names=[f.__name__ for f in reward_funcs],
        advantages=AdvantageSettings(num_generations=2, weights=(1.0,) * len(reward_funcs)),
        rollout=RolloutSettings(max_new_tokens=3, pad_token_id=0, eos_token_ids=(2,)),
        seq_len=8,
        rows=rows,
        seed=0,
        tag=0,
    )


def test_a_reward_function_that_miscounts_and_a_group_split_across_steps_are_refused():
    def one_reward(completions, **kwargs):
        return [1.0]

    with pytest.raises(ValueError, match="num_generations=2 is invalid: it must divide the rows a replica trains"):
        _rollouts([one_reward], rows=3)
    rollouts = _rollouts([one_reward])
    completions = torch.tensor([[5, 2, 0], [6, 7, 8], [5, 5, 2], [9, 2, 0]])
    full = completion_mask(completions, [2])
    ended = torch.tensor([True, False, True, True])
    rows = [{"prompt": "w3"}] * 4
    with pytest.raises(ValueError, match=r"reward function 'one_reward'='1 rewards' is invalid: it must return one "):
        rollouts._score(rows, completions, full, full, ended)
