"""MeshTrainer end to end on a tiny Llama: learning, logs, save/load, exact resume, equivalences."""

from __future__ import annotations

import math
import os

import pytest
import torch
import transformers

from hf_meshtune import MeshTrainer, MeshTrainingArguments, SpectralAdamW
from hf_meshtune.trainer import MESH_STATE_NAME
from tests.tiny import pattern_dataset, tiny_llama

BASE = dict(
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    logging_steps=1,
    report_to=[],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
    seed=0,
    lr_scheduler_type="constant",
)
MESH = dict(preset="paper", num_stages=2, mask_ratio=0.5, anchor_every=2, anchor_delay=1)


def make_trainer(tmp_path, model=None, trainer_cls=MeshTrainer, **overrides) -> MeshTrainer:
    kwargs = {**BASE, **MESH, "output_dir": str(tmp_path / "out"), "max_steps": 8, **overrides}
    args = MeshTrainingArguments(**kwargs)
    data = pattern_dataset()
    return trainer_cls(model=model or tiny_llama(), args=args, train_dataset=data, eval_dataset=data.select(range(16)))


def train_losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_loss_falls_and_dense_eval_improves(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=40, learning_rate=1e-2)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    losses = train_losses(trainer)
    after = trainer.evaluate()["eval_loss"]
    assert sum(losses[-4:]) / 4 < sum(losses[:4]) / 4 - 1.0, losses
    assert after < before - 1.0


def test_logs_carry_ledger_diagnostics_and_staleness(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=6)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    # every circuit carries bytes here (masked boundaries, DiLoCo, the anchor) and the total is their sum
    parts = [last[f"comm/{key}_bytes_per_token"] for key in ("pp_fwd", "pp_bwd", "dp", "anchor")]
    assert min(parts) > 0 and last["comm/total_bytes_per_token"] == pytest.approx(sum(parts), rel=1e-12)
    # every parameter trains, so each boundary's backward payload exists and equals the forward
    k, boundaries, fp32 = 32, 1, 4
    assert last["comm/measured_pp_fwd_bytes_per_token"] == boundaries * k * fp32
    assert last["comm/measured_pp_bwd_bytes_per_token"] == boundaries * k * fp32
    assert last["comm/pp_fwd_bytes_per_token"] == boundaries * k * fp32
    assert last["anchor/staleness_steps"] == 1.0
    # the filter projects the masked gradient onto the anchor momentum's spectrum: closer to it than before
    masked, filtered = last["spectral/cos_masked_vs_anchor"], last["spectral/cos_filtered_vs_anchor"]
    assert -1.0 <= masked < filtered <= 1.0, (masked, filtered)
    trained_matrices = sum(p.ndim == 2 and p.requires_grad for p in trainer.model.parameters())
    assert last["spectral/matrices_filtered"] == trained_matrices


def test_anchor_with_alpha_one_leaves_fast_circuit_identical_to_adamw(tmp_path):
    """α = 1 ignores the filter: the anchor (its data, forward, RNG) must not perturb the fast run."""
    with_anchor = make_trainer(tmp_path / "a", spectral_alpha=1.0, weight_decay=0.01)
    plain = make_trainer(tmp_path / "b", anchor=False, optim="adamw_torch", weight_decay=0.01)
    with_anchor.train()
    plain.train()
    assert with_anchor.mesh_anchor.rounds_done == 4
    assert train_losses(with_anchor) == train_losses(plain)


def test_filter_changes_training_when_alpha_below_one(tmp_path):
    filtered = make_trainer(tmp_path / "a", spectral_alpha=0.3)
    unfiltered = make_trainer(tmp_path / "b", spectral_alpha=1.0)
    filtered.train()
    unfiltered.train()
    assert train_losses(filtered)[:2] == train_losses(unfiltered)[:2]  # no basis before step 1
    assert train_losses(filtered)[3:] != train_losses(unfiltered)[3:]


def test_evaluation_is_dense(tmp_path):
    trainer = make_trainer(tmp_path)
    mesh_eval = trainer.evaluate()["eval_loss"]
    trainer.mesh_boundaries.remove()
    plain = transformers.Trainer(
        model=trainer.model,
        args=transformers.TrainingArguments(output_dir=str(tmp_path / "plain"), report_to=[], use_cpu=True),
        eval_dataset=trainer.eval_dataset,
    )
    assert mesh_eval == plain.evaluate()["eval_loss"]


def test_saved_model_loads_in_plain_transformers_with_same_logits(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=4)
    trainer.train()
    trainer.save_model(str(tmp_path / "final"))
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "final"), output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ids = torch.tensor([pattern_dataset()[0]["input_ids"]])
    trainer.model.eval()
    loaded.eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, trainer.model(ids).logits, rtol=0, atol=0)
    from huggingface_hub import ModelCard

    card = ModelCard.load(tmp_path / "final" / "README.md")  # the model card names the mesh settings
    assert "hf_meshtune" in card.data.tags and "## Trained with hf_meshtune" in card.text
    cfg = trainer.mesh_config
    assert (
        f"| `mask_ratio` | {cfg.mask_ratio!r} |" in card.text and f"| `num_stages` | {cfg.num_stages!r} |" in card.text
    )
    logged = [e for e in trainer.state.log_history if "comm/pp_fwd_bytes_per_token" in e][-1]
    assert f"| pp_fwd | {logged['comm/pp_fwd_bytes_per_token']:,.1f} |" in card.text


def test_resume_reproduces_next_losses_exactly(tmp_path):
    """Checkpoint at step 4 holds a pending anchor gradient (every 2, Δ = 3), a mean fill and the
    protected dims chosen at the start (recalibrating on the resumed weights would differ)."""
    knobs = dict(
        max_steps=8,
        anchor_every=2,
        anchor_delay=3,
        mask_fill="mean",
        mask_protect_dims=4,
        save_strategy="steps",
        save_steps=4,
    )
    full = make_trainer(tmp_path / "full", **knobs)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-4"
    assert (checkpoint / MESH_STATE_NAME).is_file()
    state = torch.load(checkpoint / MESH_STATE_NAME, weights_only=True)
    assert [p[0] for p in state["anchor"]["pending"]] == [2]  # taken at step 2, lands at step 5
    assert [len(p) for p in state["boundaries"]["protected"]] == [4]
    resumed = make_trainer(tmp_path / "resumed", model=tiny_llama(seed=123), **knobs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after_resume = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 4]
    assert len(after_resume) == 4
    assert after_resume == train_losses(full)[4:]


def test_resume_with_changed_mask_knob_is_rejected(tmp_path):
    knobs = dict(max_steps=4, save_strategy="steps", save_steps=2)
    make_trainer(tmp_path / "a", **knobs).train()
    changed = make_trainer(tmp_path / "b", **{**knobs, "mask_seed": 7})
    with pytest.raises(ValueError, match=r"mask_seed=7 is invalid: it must equal the checkpoint's value 0"):
        changed.train(resume_from_checkpoint=str(tmp_path / "a" / "out" / "checkpoint-2"))


def test_resume_from_checkpoint_without_mesh_state_is_rejected(tmp_path):
    knobs = dict(max_steps=4, save_strategy="steps", save_steps=2)
    make_trainer(tmp_path / "a", **knobs).train()
    checkpoint = tmp_path / "a" / "out" / "checkpoint-2"
    os.remove(checkpoint / MESH_STATE_NAME)
    with pytest.raises(ValueError, match="resume_from_checkpoint=.* must contain mesh_state.pt"):
        make_trainer(tmp_path / "b", **knobs).train(resume_from_checkpoint=str(checkpoint))


def test_gradient_accumulation_advances_microbatch_and_step(tmp_path):
    seen = []
    trainer = make_trainer(tmp_path, max_steps=3, gradient_accumulation_steps=3)
    layer = trainer.model.model.layers[0]
    layer.register_forward_hook(
        lambda m, a, o: (
            seen.append((trainer.mesh_boundaries.step, trainer.mesh_boundaries.microbatch))
            if m.training and trainer.mesh_boundaries.enabled
            else None
        )
    )
    trainer.train()
    fast = [s for s in seen if s[1] >= 0]
    assert fast == [(0, 0), (0, 1), (0, 2), (1, 0), (1, 1), (1, 2), (2, 0), (2, 1), (2, 2)]


def test_optimizer_is_spectral_and_sees_anchor_bases(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=3)
    trainer.train()
    optimizer = trainer.spectral_optimizer
    assert isinstance(optimizer, SpectralAdamW)
    q_proj = trainer.model.model.layers[0].self_attn.q_proj.weight
    # snapshots at steps 0 and 2 (every 2); with Δ = 1 only the first has landed after steps 0..2
    assert optimizer.state[q_proj]["anchor_updates"] == 1
    assert [p.snapshot_step for p in trainer.mesh_anchor.pending] == [2]


def test_single_stage_logs_the_ledger_without_boundary_payloads(tmp_path):
    trainer = make_trainer(tmp_path, max_steps=2, num_stages=1)
    trainer.train()
    last = [h for h in trainer.state.log_history if "loss" in h][-1]
    assert last["comm/pp_fwd_bytes_per_token"] == 0 and last["comm/dp_bytes_per_token"] > 0
    assert last["comm/anchor_bytes_per_token"] > 0
    assert "comm/measured_pp_fwd_bytes_per_token" not in last


def test_anchor_with_a_custom_non_spectral_optimizer_is_rejected(tmp_path):
    model = tiny_llama()
    custom = torch.optim.SGD(model.parameters(), lr=0.1)
    trainer = make_trainer(tmp_path, model=model)
    trainer.optimizer = custom
    with pytest.raises(
        ValueError, match=r"optimizers\[0\]='SGD' is invalid: it must be a SpectralAdamW when anchor=True"
    ):
        trainer.create_optimizer()


def test_a_lagging_anchor_past_max_staleness_is_rejected_and_reported(tmp_path):
    """Every delivery lands 3 steps after its snapshot, over anchor_max_staleness = 2: none is applied,
    each is counted in the logs, and training carries on with the plain masked gradient."""
    trainer = make_trainer(
        tmp_path, max_steps=6, anchor_every=1, anchor_delay=3, anchor_max_staleness=2, logging_steps=1
    )
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert all(math.isfinite(h["loss"]) for h in logs)
    assert [h.get("anchor/rejected_stale", 0) for h in logs] == [0, 0, 0, 1, 2, 3]  # deliveries from step 3 on
    optimizer = trainer.spectral_optimizer
    assert optimizer.max_staleness == 2 and not any(
        "anchor_momentum" in optimizer.state[p] for p in trainer.model.parameters()
    )


def test_a_process_killed_while_saving_leaves_the_previous_checkpoint_to_resume_from(tmp_path):
    """SIGKILL in the middle of writing checkpoint-4: no half checkpoint-4 appears, checkpoint-2 is
    what `resume_from_checkpoint=True` finds, and resuming from it gives an uninterrupted run's losses."""
    import subprocess
    import sys

    from transformers.trainer_utils import get_last_checkpoint

    from hf_meshtune.trainer import CHECKPOINT_STAGING

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "killed"
    proc = subprocess.run(
        [sys.executable, os.path.join(root, "tests", "scripts", "killed_save.py"), str(out)],
        env={**os.environ, "PYTHONPATH": root},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == -9, proc.stderr[-2000:]
    assert (out / CHECKPOINT_STAGING / "checkpoint-4" / "model.safetensors").is_file()  # the save was cut mid-way
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2"]
    assert get_last_checkpoint(str(out)) == str(out / "checkpoint-2")
    knobs = dict(max_steps=6, learning_rate=3e-3, mask_ratio=0.5, logging_steps=1, save_strategy="steps", save_steps=2)
    resumed = make_trainer(tmp_path / "resumed", model=tiny_llama(seed=5), **knobs)
    resumed.args.output_dir = str(out)
    resumed.train(resume_from_checkpoint=True)
    assert not (out / CHECKPOINT_STAGING).exists()  # cleared by the next save
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-4", "checkpoint-6"]
    full = make_trainer(tmp_path / "full", **knobs)
    full.train()
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 2] == train_losses(full)[2:]


def test_spectral_cosines_are_computed_for_the_logged_steps_only(tmp_path):
    """SpectralAdamW's diagnostics cost five reductions per matrix: MeshTrainer turns them on for the steps
    the Trainer will log (logging_steps=3, and the first with logging_first_step) and every log has them."""
    flags = []

    class Watch(transformers.TrainerCallback):
        def on_optimizer_step(self, args, state, control, **kwargs):
            flags.append(trainer.spectral_optimizer.diagnostics)

    trainer = make_trainer(tmp_path, max_steps=7, logging_steps=3, logging_first_step=True, anchor_delay=0)
    trainer.add_callback(Watch())
    trainer.train()
    assert flags == [True, False, True, False, False, True, False]  # steps 1..7: logged 1, 3, 6
    logged = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["step"] for h in logged] == [1, 3, 6]
    assert all("spectral/cos_filtered_vs_anchor" in h for h in logged)
