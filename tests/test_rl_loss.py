"""TRL's GRPO/GSPO policy loss on the pipeline's last stage (hf_meshtune.rl.loss) against TRL itself:
``GRPOTrainer._compute_loss`` on the same rollouts gives the same loss and gradients, in one process
and through a 2-stage pipeline over gloo (codec off), for the loss types and options the mesh takes."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from datasets import Dataset
from transformers import AutoTokenizer
from trl import GRPOConfig, GRPOTrainer

from hf_meshtune.apps.assets import smollm2_checkpoint
from hf_meshtune.pipeline.stage import untie_embeddings
from hf_meshtune.rl import PolicyLoss, PolicyLossSettings, pack_rollouts
from tests.tiny import make_tiny_causal_lm

B, P, C, SEQ = 4, 5, 6, 16

pytestmark = pytest.mark.usefixtures("single_thread_torch")

CASES = [
    dict(loss_type="grpo", importance_sampling_level="sequence"),  # GSPO
    dict(),  # TRL's defaults: dapo, token-level ratios, no KL
    dict(loss_type="grpo", beta=0.1),
    dict(loss_type="bnpo", epsilon_high=0.28, temperature=0.7),
    dict(loss_type="dr_grpo", delta=1.5, beta=0.05),
    dict(loss_type="luspo", importance_sampling_level="sequence", use_bias_correction_kl=True, beta=0.02),
]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(smollm2_checkpoint())


def _tiny(vocab: int, pad: int):
    model = make_tiny_causal_lm("llama", hidden=32, layers=2, seed=0, vocab_size=vocab, pad_token_id=pad)
    untie_embeddings(model)
    return model


def _rollouts(pad: int, old: bool = True) -> dict:
    """Four rollouts: prompts left-padded by 0, 2, 0 and 1; completions ending after 4, 6, 2 and 6
    tokens; log-probabilities of π_old and π_ref a few nats from the random model's (≈ -ln 49152),
    so both clip sides and the KL are active."""
    g = torch.Generator().manual_seed(0)
    prompt_mask = torch.ones(B, P, dtype=torch.long)
    prompt_mask[1, :2] = 0
    prompt_mask[3, :1] = 0
    completion_mask = torch.ones(B, C, dtype=torch.long)
    completion_mask[0, 4:] = 0
    completion_mask[2, 2:] = 0
    return dict(
        prompt_ids=torch.randint(10, 1000, (B, P), generator=g).masked_fill(prompt_mask == 0, pad),
        prompt_mask=prompt_mask,
        completion_ids=torch.randint(10, 1000, (B, C), generator=g),
        completion_mask=completion_mask,
        advantages=torch.randn(B, generator=g),
        old_per_token_logps=(-torch.rand(B, C, generator=g) * 3 - 9.3) if old else None,
        ref_per_token_logps=-torch.rand(B, C, generator=g) * 3 - 9.3,
    )


def _trl(tokenizer, tmp_path, case: dict, accumulation: int = 1):
    """TRL's trainer for ``case`` (β set after construction: TRL would load a reference model by name)."""
    knobs = dict(case)
    beta = knobs.pop("beta", 0.0)
    args = GRPOConfig(
        str(tmp_path / "trl"),
        per_device_train_batch_size=4,
        num_generations=4,
        max_completion_length=C,
        gradient_accumulation_steps=accumulation,
        steps_per_generation=accumulation,
        use_cpu=True,
        bf16=False,
        report_to="none",
        **knobs,
    )
    trainer = GRPOTrainer(
        model=_tiny(len(tokenizer), tokenizer.pad_token_id),
        reward_funcs=lambda completions, **_: [0.0] * len(completions),
        args=args,
        train_dataset=Dataset.from_dict({"prompt": ["a b c"] * 8}),
        processing_class=tokenizer,
    )
    trainer.beta, trainer.current_gradient_accumulation_steps = beta, accumulation
    trainer.model.train()
    return trainer, dataclasses.replace(PolicyLossSettings.from_grpo_config(args), beta=beta)


def _trl_step(trainer, rollouts: dict, rows: list[slice]) -> tuple[float, dict]:
    """TRL's loss summed over accumulation slices ``rows`` (each divided by their number, as TRL does),
    and the gradients it leaves."""
    trainer.model.zero_grad()
    total = 0.0
    for part in rows:
        inputs = {k: (v[part] if v is not None else None) for k, v in rollouts.items()}
        inputs = {k: v for k, v in inputs.items() if v is not None}
        inputs["num_items_in_batch"] = rollouts["completion_mask"].sum()  # TRL: the generation batch's tokens
        loss = trainer._compute_loss(trainer.model, inputs)
        loss.backward()
        total += float(loss.detach())
    return total, {n: p.grad.clone() for n, p in trainer.model.named_parameters()}


def _packed(rollouts: dict, pad: int):
    return pack_rollouts(
        rollouts["prompt_ids"],
        rollouts["prompt_mask"],
        rollouts["completion_ids"],
        rollouts["completion_mask"],
        rollouts["advantages"],
        SEQ,
        pad,
        rollouts["old_per_token_logps"],
        rollouts["ref_per_token_logps"],
    )


def _assert_grads_close(got: dict, want: dict) -> None:
    for name, grad in want.items():
        torch.testing.assert_close(got[name], grad, rtol=1e-4, atol=1e-7, msg=name)


def _ours_against_trls(tokenizer, tmp_path, case: dict, rollouts: dict) -> tuple[float, PolicyLoss]:
    """``PolicyLoss`` on the packed ``rollouts`` vs TRL's ``_compute_loss`` on them, one slice: the same
    loss (1e-5 relative) and gradients (``_assert_grads_close``). Returns our loss and loss function."""
    trainer, settings = _trl(tokenizer, tmp_path, case)
    want_loss, want = _trl_step(trainer, rollouts, [slice(0, B)])
    trainer.model.zero_grad()
    ids, target = _packed(rollouts, tokenizer.pad_token_id)
    loss_fn = PolicyLoss(settings)
    loss = loss_fn(trainer.model(input_ids=ids).logits, target)
    loss.backward()
    assert float(loss) == pytest.approx(want_loss, rel=1e-5)
    _assert_grads_close({n: p.grad for n, p in trainer.model.named_parameters()}, want)
    return float(loss.detach()), loss_fn


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_the_policy_loss_is_trls_on_the_same_rollouts(tokenizer, tmp_path, case):
    """Loss and every gradient as TRL's ``_compute_loss`` (float32: within 1e-4 relative), with the
    rollouts left-aligned in one [B, 16] batch instead of TRL's left-padded prompts."""
    _, loss_fn = _ours_against_trls(tokenizer, tmp_path, case, _rollouts(tokenizer.pad_token_id))
    metrics = loss_fn.pop_metrics()
    assert metrics["clip_ratio/region_mean"] > 0  # the rollouts do reach the clipped region
    assert ("kl" in metrics) == (case.get("beta", 0.0) != 0.0) and loss_fn.pop_metrics() == {}


def test_without_old_log_probs_the_ratio_is_one_and_the_loss_is_trls(tokenizer, tmp_path):
    """TRL's single-iteration case (no π_old: the detached current log-probabilities)."""
    rollouts = _rollouts(tokenizer.pad_token_id, old=False)
    case = dict(loss_type="grpo", importance_sampling_level="sequence")
    loss, loss_fn = _ours_against_trls(tokenizer, tmp_path, case, rollouts)
    # ratio 1: the loss is minus the mean advantage
    assert loss == pytest.approx(-float(rollouts["advantages"].mean()), rel=1e-5)
    assert loss_fn.pop_metrics()["clip_ratio/region_mean"] == 0


def _mesh_step_worker(rank: int, world: int, vocab: int, pad: int, settings: PolicyLossSettings, rollouts: dict):
    """Stage ``rank`` of a 2-stage dense pipeline: one step of the policy loss over 2 microbatches."""
    from hf_meshtune.comm.wire import Wire
    from hf_meshtune.config import MeshConfig
    from hf_meshtune.pipeline.schedule import MeshStage, build_schedule, run_schedule
    from hf_meshtune.pipeline.stage import build_stage, stage_parameter_names
    from hf_meshtune.topology import MeshTopology

    groups = MeshTopology(replicas=1, stages=world, anchor=False).build_groups()
    model = _tiny(vocab, pad)
    module = build_stage(model, rank, world, MeshConfig(num_stages=world), masked=False)
    pipe = MeshStage(
        module,
        group=groups.pp_group,
        device=torch.device("cpu"),
        microbatch_size=B // 2,
        seq_len=SEQ,
        dtype=torch.float32,
        wire=Wire(),
    )
    loss_fn = PolicyLoss(settings, microbatches=2)
    schedule = build_schedule(pipe, 2, loss_fn)
    ids, target = _packed(rollouts, pad)
    loss = run_schedule(schedule, module, ids, target)
    grads = {name: p.grad.clone() for name, p in stage_parameter_names(model, module).items()}
    return {"loss": loss, "grads": grads, "metrics": loss_fn.pop_metrics()}


@pytest.mark.slow
@pytest.mark.parametrize("case", [CASES[0], CASES[1], CASES[4]], ids=["gspo", "dapo", "dr_grpo-kl"])
def test_a_step_through_a_two_stage_pipeline_is_trls_accumulated_step(tokenizer, tmp_path, launcher, case):
    """GSPO, TRL's default dapo and dr_grpo with the KL through 2 stages on 2 gloo processes, the batch
    in 2 microbatches: the mean microbatch loss and each stage's gradients equal TRL's step with 2
    accumulation slices."""
    trainer, settings = _trl(tokenizer, tmp_path, case, accumulation=2)
    rollouts = _rollouts(tokenizer.pad_token_id)
    want_loss, want = _trl_step(trainer, rollouts, [slice(0, B // 2), slice(B // 2, B)])
    results = launcher(_mesh_step_worker, 2, len(tokenizer), tokenizer.pad_token_id, settings, rollouts, timeout=180)
    assert results[0]["loss"] is None and results[1]["loss"] == pytest.approx(want_loss, rel=1e-5)
    got = {**results[0]["grads"], **results[1]["grads"]}
    assert set(got) == set(want)  # the two stages hold every parameter between them
    _assert_grads_close(got, want)
    assert results[1]["metrics"]["clip_ratio/region_mean"] > 0


def test_grpo_options_the_mesh_does_not_apply_are_refused():
    base = dict(output_dir="/tmp/unused", use_cpu=True, bf16=False, report_to="none")
    with pytest.raises(ValueError, match=r"loss_type='sapo' is invalid: it must be one of \['dapo', 'grpo', 'bnpo'"):
        PolicyLossSettings.from_grpo_config(GRPOConfig(**base, loss_type="sapo"))
    with pytest.raises(ValueError, match=r"top_entropy_quantile=0.2 is invalid: it must be 1.0 on the mesh"):
        PolicyLossSettings.from_grpo_config(GRPOConfig(**base, top_entropy_quantile=0.2))
    with pytest.raises(ValueError, match=r"entropy_coef=0.01 is invalid: it must be 0.0 on the mesh"):
        PolicyLossSettings.from_grpo_config(GRPOConfig(**base, entropy_coef=0.01))
    defaults = PolicyLossSettings.from_grpo_config(GRPOConfig(**base))
    assert (defaults.loss_type, defaults.epsilon_low, defaults.epsilon_high) == (GRPOConfig(**base).loss_type, 0.2, 0.2)
