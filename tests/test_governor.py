"""The fidelity signal, the governor and the adaptive anchor cadence (one process)."""

from __future__ import annotations

import math

import pytest
import torch

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from hf_meshtune.anchor.batches import AnchorBatches
from hf_meshtune.anchor.circuit import AnchorCircuit
from hf_meshtune.anchor.fidelity import FidelityProbe, ProbeRecord, gradient_cosine, stage_parameter_groups
from hf_meshtune.anchor.governor import AnchorCadence, FidelityGovernor, candidate_levels, mean_level_bytes
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.optim.basis import subspace_drift
from tests.tiny import GOVERNED_TINY, pattern_dataset, tiny_llama

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


# --- the fidelity signal ---------------------------------------------------------------------------
class _Identity:
    def apply(self, hidden, step, microbatch):
        return hidden, hidden


class _Zero:
    def apply(self, hidden, step, microbatch):
        return hidden * 0.0, hidden


class _KeepGradientDims(torch.autograd.Function):
    """Forward: identity. Backward: only the first ``keep`` dims of dL/dh get through."""

    @staticmethod
    def forward(ctx, hidden, keep):
        ctx.keep = keep
        return hidden.clone()

    @staticmethod
    def backward(ctx, grad):
        out = torch.zeros_like(grad)
        out[..., : ctx.keep] = grad[..., : ctx.keep]
        return out, None


class _GradientProjection:
    def __init__(self, keep: int) -> None:
        self.keep = keep

    def apply(self, hidden, step, microbatch):
        return _KeepGradientDims.apply(hidden, self.keep), hidden


def _circuit(model, handle, **kwargs) -> AnchorCircuit:
    data = pattern_dataset(n=16)
    batches = AnchorBatches(data, _collate, 4, 2, seed=0)
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2}
    return AnchorCircuit(model, params, handle, 1, 0, batches, lambda m, b: m(**b).loss, feed=False, **kwargs)


def _collate(rows):
    ids = torch.tensor([r["input_ids"] for r in rows])
    return {"input_ids": ids, "labels": ids.clone()}


def test_identity_codec_keeps_everything_and_zero_codec_nothing():
    model = tiny_llama(layers=4)
    handle = attach_composed(model, 2, "int8")
    circuit = _circuit(model, handle)
    [[identity, zero]] = circuit.measure(0, [[_Identity(), _Zero()]])
    assert identity == {"cos": pytest.approx(1.0, abs=1e-12), "act_err": 0.0, "grad_err": 0.0}
    # nothing reaches the stage before the boundary: its gradient is 0, so is the cosine
    assert zero["cos"] == 0.0 and zero["act_err"] == pytest.approx(1.0) and zero["grad_err"] == pytest.approx(1.0)


def test_gradient_projection_codec_gives_the_reference_cosine():
    """A codec passing only the first k dims of dL/dh: the cosine on stage 0's matrices equals a
    float64 reference computed with a plain tensor hook that does the same projection."""
    model = tiny_llama(layers=4).double()
    handle = attach_composed(model, 2, "int8")
    circuit = _circuit(model, handle)
    [[measured]] = circuit.measure(0, [[_GradientProjection(keep=20)]])

    layers = model.model.layers
    stage0 = [n for n in stage_parameter_groups(list(circuit.params), "model.layers", handle.stages)[0]]
    batches = circuit.batches(0)

    def reference(project: bool) -> list[torch.Tensor]:
        def hook(module, args, output):
            h = output[0] if isinstance(output, tuple) else output
            if project:
                h.register_hook(lambda g: torch.cat([g[..., :20], torch.zeros_like(g[..., 20:])], -1))

        handle_hook = layers[handle.boundary_layers[0]].register_forward_hook(hook)
        try:
            with handle.disabled():
                params = [circuit.params[n] for n in stage0]
                total = [torch.zeros_like(p) for p in params]
                for batch in batches:
                    grads = torch.autograd.grad(model(**batch).loss / len(batches), params)
                    for acc, g in zip(total, grads):
                        acc += g
        finally:
            handle_hook.remove()
        return total

    expected = gradient_cosine(reference(True), reference(False))
    assert 0.2 < expected < 0.99  # a real loss of direction, not a trivial case
    assert measured["cos"] == pytest.approx(expected, rel=1e-9)
    assert measured["act_err"] == 0.0


def test_probe_on_a_linear_chain_matches_the_closed_form():
    """h = W1 x, loss = cᵀ W2 h; a codec passing k dims of dL/dh gives cos = ‖P u‖/‖u‖ (u = W2ᵀ c) on W1."""
    torch.manual_seed(0)
    w1 = torch.randn(6, 4, dtype=torch.float64, requires_grad=True)
    w2 = torch.randn(3, 6, dtype=torch.float64, requires_grad=True)
    x, c = torch.randn(4, dtype=torch.float64), torch.randn(3, dtype=torch.float64)

    def run_pass(record: ProbeRecord) -> dict[str, torch.Tensor]:
        h = w1 @ x
        h.register_hook(lambda g: record.grads.setdefault(0, []).append(g))  # dL/dh on the sending side
        if record.boundary == 0:
            h, _ = record.codec.apply(h, 0, 0)
        g1, g2 = torch.autograd.grad(c @ (w2 @ h), [w1, w2])
        return {"w1": g1, "w2": g2}

    probe = FidelityProbe(run_pass, [["w1"], ["w2"]])
    dense_record = ProbeRecord(None)
    probe.reference(run_pass(dense_record), dense_record)
    result = probe.measure(0, _GradientProjection(keep=2))
    u = (w2.T @ c).detach()
    assert result["cos"] == pytest.approx(float(u[:2].norm() / u.norm()), rel=1e-12)
    assert result["grad_err"] == pytest.approx(float(u[2:].norm() / u.norm()), rel=1e-12)


def test_stage_groups_put_embeddings_first_and_the_head_last():
    names = ["emb.weight", "m.layers.0.w", "m.layers.1.w", "m.layers.2.w", "norm.weight", "lm_head.weight"]
    assert stage_parameter_groups(names, "m.layers", [range(0, 2), range(2, 3)]) == [
        ["emb.weight", "m.layers.0.w", "m.layers.1.w"],
        ["m.layers.2.w", "norm.weight", "lm_head.weight"],
    ]


# --- the policies ------------------------------------------------------------------------------------
def test_governor_moves_one_level_with_hysteresis():
    gov = FidelityGovernor(levels=3, target=0.95, hysteresis=0.02)
    assert candidate_levels(0, 3) == [0, 1] and candidate_levels(1, 3) == [0, 1, 2] and candidate_levels(2, 3) == [1, 2]
    assert gov.decide(2, {1: 0.98, 2: 0.999}) == 1  # the cheaper level clears target + hysteresis
    assert gov.decide(2, {1: 0.96, 2: 0.999}) == 2  # meets the target, not the margin: stay
    assert gov.decide(1, {0: 0.5, 1: 0.951, 2: 0.99}) == 1  # inside the band: no flapping
    assert gov.decide(1, {0: 0.5, 1: 0.94, 2: 0.99}) == 2  # below the target: one level richer
    assert gov.decide(2, {1: 0.5, 2: 0.9}) == 2  # the richest level is the floor
    assert gov.decide(1, {0: math.nan, 1: 0.96, 2: 1.0}) == 1  # an unmeasurable level never qualifies
    assert gov.initial([0.5, 0.965, 1.0]) == 2 and gov.initial([0.5, 0.971, 1.0]) == 1
    assert gov.initial([0.1, 0.2, 0.3]) == 2


def test_mean_level_bytes_counts_each_step_at_the_levels_of_its_forward():
    sizes = [10.0, 20.0, 40.0]
    assert mean_level_bytes([], sizes, 2, 4) == 40.0  # the richest level throughout
    # after step 0's optimizer step boundary 0 drops to level 0 and boundary 1 to level 1; back up after step 2
    switches = [(0, 0, [0, 1]), (2, 1, [2, 2])]
    assert mean_level_bytes(switches, sizes, 2, 4) == pytest.approx((40 + 15 + 15 + 40) / 4)
    with pytest.raises(ValueError, match=r"switches=\(1, \[3, 0\]\) is invalid: it must name levels < 3"):
        mean_level_bytes([(1, 0, [3, 0])], sizes, 2, 4)
    with pytest.raises(ValueError, match=r"switches=\(1, \[0\]\) is invalid: it must hold 2 levels per switch"):
        mean_level_bytes([(1, 0, [0])], sizes, 2, 4)
    with pytest.raises(ValueError, match="steps=0 is invalid: it must be >= 1"):
        mean_level_bytes([], sizes, 2, 0)
    with pytest.raises(ValueError, match="boundaries=0 is invalid: it must be >= 1"):
        mean_level_bytes([], sizes, 0, 4)


def test_cadence_halves_doubles_and_respects_bounds_and_staleness():
    cadence = AnchorCadence(min_gap=2, max_gap=16, low=0.05, high=0.3)
    assert cadence.next_gap(8, None, None) == 8
    assert cadence.next_gap(8, 0.5, 4) == 4  # fast drift: closer together
    assert cadence.next_gap(8, 0.5, 20) == 8  # ... unless the anchor is already behind (staleness > 2 gap)
    assert cadence.next_gap(8, 0.01, 4) == 16 and cadence.next_gap(16, 0.01, 4) == 16  # still: farther, capped
    assert cadence.next_gap(2, 0.9, 1) == 2 and cadence.next_gap(8, 0.1, 4) == 8


def test_subspace_drift_is_the_sine_of_the_largest_principal_angle():
    basis = torch.eye(4, dtype=torch.float64)[:, :2]
    assert subspace_drift(basis, basis) == 0.0
    turned = torch.tensor([[1.0, 0.0], [0.0, math.cos(0.3)], [0.0, math.sin(0.3)], [0.0, 0.0]], dtype=torch.float64)
    assert subspace_drift(basis, turned) == pytest.approx(math.sin(0.3), rel=1e-9)


# --- a governed run through MeshTrainer --------------------------------------------------------------
def _trainer(tmp_path, trainer_cls=MeshTrainer, **overrides) -> MeshTrainer:
    kwargs = {**BASE, **GOVERNED_TINY, "output_dir": str(tmp_path / "out"), "max_steps": 8, **overrides}
    data = pattern_dataset()
    return trainer_cls(model=tiny_llama(), args=MeshTrainingArguments(**kwargs), train_dataset=data)


def _losses(trainer) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class _Scheduled(MeshTrainer):
    """The same boundaries with no anchor circuit at all: levels set from a given schedule instead."""

    schedule: dict[int, list[int]] = {}

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        self.mesh_engine.anchor = None
        return optimizer

    def training_step(self, model, inputs, num_items_in_batch=None):
        levels = self.schedule.get(self.state.global_step)
        if levels is not None:
            self.mesh_boundaries.set_levels(levels)
        return super().training_step(model, inputs, num_items_in_batch)


def test_governed_run_switches_levels_and_equals_a_run_on_its_schedule(tmp_path):
    governed = _trainer(tmp_path / "g")
    governed.train()
    anchor = governed.mesh_anchor
    # round 0 measured int2/int4/int8 and chose int4 to start (cos ≥ 0.99, int2 far below): at once, after step 0
    assert anchor.switches and anchor.switches[0] == (0, 0, [1])
    logs = [h for h in governed.state.log_history if "loss" in h]
    assert {"fidelity/b0/int2/cos", "fidelity/b0/int4/cos", "fidelity/b0/int8/cos"} <= set(logs[0])
    assert logs[0]["fidelity/b0/int8/cos"] > logs[0]["fidelity/b0/int4/cos"] > logs[0]["fidelity/b0/int2/cos"]
    # the wire follows the level: int8 (H=64: 2 scale bytes + 64 codes = 66 B a token), then int4 (2 + 32 = 34)
    sent = [h["comm/measured_pp_fwd_bytes_per_token"] for h in logs]
    assert sent[0] == 66.0 and set(sent[1:]) == {34.0}, sent
    # the over-the-run average the benchmarks book from the switches is what the wire carried (int2, never used: NaN)
    assert mean_level_bytes(anchor.switches, [math.nan, 34.0, 66.0], 1, len(sent)) == pytest.approx(
        sum(sent) / len(sent)
    )

    _Scheduled.schedule = {step + 1: levels for step, _, levels in anchor.switches}
    scheduled = _trainer(tmp_path / "s", trainer_cls=_Scheduled)
    scheduled.train()
    assert scheduled.mesh_anchor is None
    assert _losses(scheduled) == _losses(governed)  # probing moved neither the fast RNG nor its state


def test_governed_run_resumes_exactly_with_its_levels(tmp_path):
    full = _trainer(tmp_path / "full")
    full.train()
    first = _trainer(tmp_path / "part", save_strategy="steps", save_steps=4)
    first.train()
    resumed = _trainer(tmp_path / "part", save_strategy="steps", save_steps=4)
    resumed.train(resume_from_checkpoint=str(tmp_path / "part" / "out" / "checkpoint-4"))
    assert _losses(resumed) == _losses(full)  # the first four come from the checkpoint's trainer state
    assert resumed.mesh_boundaries.levels == full.mesh_boundaries.levels == [1]


def test_adaptive_cadence_decisions_replay_from_the_logged_quantities(tmp_path):
    trainer = _trainer(
        tmp_path,
        boundary_codec=None,
        codec_ladder=None,
        preset="paper",
        mask_ratio=0.5,
        anchor_cadence="adaptive",
        anchor_every=4,
        anchor_every_min=1,
        anchor_every_max=8,
        max_steps=24,
    )
    trainer.train()
    anchor = trainer.mesh_anchor
    log = anchor.cadence_log
    assert len(log) >= 4 and len({entry["gap"] for entry in log}) > 1, log  # the gap did move
    policy = AnchorCadence(1, 8)
    gap = 4
    for entry in log:  # each decision from what was logged before it: the previous gap, drift, staleness
        drift = None if math.isnan(entry["drift"]) else entry["drift"]
        staleness = None if math.isnan(entry["staleness"]) else int(entry["staleness"])
        gap = policy.next_gap(gap, drift, staleness)
        assert gap == entry["gap"]
    steps = [int(entry["step"]) for entry in log]
    assert all(b - a == int(e["gap"]) for a, b, e in zip(steps, steps[1:], log))  # rounds where the gaps say
    logged = [h for h in trainer.state.log_history if "anchor/gap" in h]
    drifts = {entry["drift"] for entry in log if not math.isnan(entry["drift"])}
    assert drifts and {h["anchor/drift"] for h in logged if "anchor/drift" in h} >= drifts - {log[-1]["drift"]}


def test_governed_without_the_anchor_prior_keeps_the_users_optimizer(tmp_path):
    trainer = _trainer(tmp_path, optim="adamw_torch", max_steps=3)
    trainer.train()
    assert trainer.spectral_optimizer is None and trainer.mesh_anchor.feed is False
    assert trainer.mesh_anchor.rounds_done == 2


def test_the_wires_stages_join_a_governed_ladder(tmp_path):
    """Levels with a rotation, a backward of their own and a coder are ladder levels like any: the first round
    measures each, the governor picks one, and the counter books that level's coded records."""
    ladder = "int2,rot+int4g64e8m0+zstd,rot16+int3g16e8m0/rot16+int4g16+zstd,int8"
    trainer = _trainer(tmp_path, codec_ladder=ladder, max_steps=4)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    levels = ladder.split(",")
    assert {f"fidelity/b0/{level}/cos" for level in levels} <= set(logs[0])
    chosen = trainer.mesh_anchor.switches[0][2][0]
    assert levels[chosen] != "int8"  # a cheaper level met the target: the rotated levels are chosen from
    if "zstd" in levels[chosen]:  # coded: the bytes booked are below the level's records
        record = parse_codec(levels[chosen]).message_bytes(64, 4)
        assert logs[-1]["comm/measured_pp_fwd_bytes_per_token"] < record and logs[-1]["comm/pp_coding_ratio"] > 1
