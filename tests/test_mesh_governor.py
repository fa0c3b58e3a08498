"""The fidelity governor on the distributed mesh (``anchor.mesh_governor``).

- A pipeline whose boundaries switch ladder levels mid-run (new payload widths, the stages rebuilt at the
  same step) equals the single-process governed model run at the same level schedule (Y = 2 and 4).
- A governed 3x2 mesh (lockstep anchor): the anchor's probes through its pipeline measure the same
  fidelity as the single-process probe on the same snapshot, batch and geometry; its decisions reach
  both sides of every boundary, which switch at the same step (the round's snapshot for the first round,
  snapshot + anchor_delay after); each fast replica's losses equal a one-process replay at the same level
  schedule; and the boundary payload on the wire has the width of the level in use. Resumed from a
  checkpoint, it continues bit for bit.
- The pieces alone: the cosine rule (sending stage, or the stages after it when it trains nothing),
  the fast side's lockstep wait and its refusals, a checkpoint's state.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hf_meshtune.anchor.circuit import AnchorCircuit
from hf_meshtune.anchor.fidelity import stage_parameter_groups
from hf_meshtune.anchor.mesh_governor import SUMS, FastLevelLink, SendProbe, _fidelity, levels_message
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.comm.messages import LEVELS
from hf_meshtune.comm.wire import Wire
from hf_meshtune.pipeline.messages import HEADER_VALUES, carried_lengths
from hf_meshtune.pipeline.schedule import MeshStage, build_schedule, run_schedule
from hf_meshtune.pipeline.stage import StageModule, causal_lm_loss, stage_parameter_names, untie_embeddings
from hf_meshtune.topology import MeshTopology
from tests.distributed import mesh_launch
from tests.test_pipeline import BATCH, HIDDEN, LAYERS, MICRO, SEQ, _batch
from tests.tiny import tiny_llama

REPO = Path(__file__).resolve().parents[1]
LADDER = "outliers4+int3x8,outliers4+int4x8,outliers4+int8"
SPECS = [parse_codec(level) for level in LADDER.split(",")]
SEED = 7


# --- a pipeline that switches levels equals the single-process model at the same schedule ---------
def _governed(num_stages: int):
    """The tiny model with the governed ladder attached and every level fitted on one dense batch."""
    model = tiny_llama(seed=0, layers=LAYERS, hidden=HIDDEN)
    handle = attach_composed(model, num_stages, SPECS[-1], seed=SEED, ladder=SPECS)
    handle.calibrate(model, {"input_ids": _batch(99)})
    return model, handle


def _reference(num_stages: int, schedule: list[list[int]]) -> tuple[list[float], dict[str, torch.Tensor]]:
    model, handle = _governed(num_stages)
    losses = []
    for step, levels in enumerate(schedule):
        handle.set_levels(levels)
        model.zero_grad()
        handle.set_step(step)
        chunks = _batch(step).chunk(BATCH // MICRO)
        total = 0.0
        for chunk in chunks:
            loss = model(input_ids=chunk, labels=chunk).loss / len(chunks)
            loss.backward()
            total += loss.item()
        losses.append(total)
    return losses, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _switching_worker(rank: int, world: int, schedule: list[list[int]]) -> dict:
    groups = MeshTopology(replicas=1, stages=world, anchor=False).build_groups()
    model, handle = _governed(world)
    handle.remove()  # the stages apply the codecs themselves
    stage, ladders = groups.stage, handle.ladders
    module = StageModule(
        model,
        stage,
        world,
        None,
        None,
        ladder_in=ladders[stage - 1] if stage > 0 else None,
        ladder_out=ladders[stage] if stage < world - 1 else None,
    )
    wire, losses, widths, pipe, current = Wire(), [], [], None, None
    for step, levels in enumerate(schedule):
        if levels != current:  # new widths somewhere: every stage builds a new pipeline stage (torch's start-up
            current = levels  # handshake runs again between all neighbours, changed or not)
            module.set_levels(levels[stage - 1] if stage > 0 else None, levels[stage] if stage < world - 1 else None)
            pipe = MeshStage(
                module,
                group=groups.pp_group,
                device=torch.device("cpu"),
                microbatch_size=MICRO,
                seq_len=SEQ,
                dtype=torch.float32,
                wire=wire,
            )
            runner = build_schedule(pipe, BATCH // MICRO, causal_lm_loss(model))
        model.zero_grad()
        module.step = step
        ids = _batch(step)
        before = wire.sent["pp_fwd"]
        losses.append(run_schedule(runner, module, ids, ids, carried_lengths(ids)))  # every position labelled
        headers = (BATCH // MICRO) * HEADER_VALUES * 8 if stage < world - 1 else 0
        widths.append((wire.sent["pp_fwd"] - before - headers) / (BATCH * SEQ * 4))
    grads = {n: p.grad.clone() for n, p in stage_parameter_names(model, module).items() if p.grad is not None}
    return {"losses": losses, "grads": grads, "widths": widths}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("stages", "schedule"),
    [
        (2, [[2], [0], [0], [1], [2]]),
        (4, [[2, 2, 2], [0, 2, 1], [0, 0, 1], [1, 0, 2]]),
    ],
)
def test_a_pipeline_switching_levels_equals_the_single_process_model_at_the_same_schedule(launcher, stages, schedule):
    results = launcher(_switching_worker, stages, schedule, timeout=240)
    ref_losses, ref_grads = _reference(stages, schedule)
    assert results[-1]["losses"] == pytest.approx(ref_losses, rel=1e-5, abs=1e-6)
    for result in results:
        for name, grad in result["grads"].items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-4, atol=1e-6, msg=name)
    # the level changes reached the wire: each stage's forward payload has its level's width
    for stage, result in enumerate(results[:-1]):
        expected = [SPECS[levels[stage]].message_bytes(HIDDEN, 4) / 4 for levels in schedule]
        assert result["widths"] == expected
    assert len({w for r in results[:-1] for w in r["widths"]}) >= 2  # the schedule changed the widths


# --- a governed 3x2 mesh -----------------------------------------------------------------------
CONFIG = {
    "anchor": True,
    "anchor_every": 2,
    "anchor_delay": 1,
    "anchor_lockstep": True,
    "spectral_tau": 1e-3,
    "mask_ratio": 0.0,
    "boundary_codec": "governed",
    "codec_ladder": LADDER,
    # no DiLoCo sync and no geometry refit within the run: θ_global stays the start, so one process can
    # replay a fast replica exactly (its anchor gradients are dense gradients of the start)
    "dp_sync_every": 32,
    "codec_refit_every": 0,
}
SCRIPT = [[0, [0]], [4, [1]]]  # the levels the anchor decides: [0] at rounds 0 and 2, [1] from round 4 on
STEPS = 9


def _one_process_replica(replica: int, switches: list, arrivals: list) -> list[float]:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as every mesh process runs: the same kernels' summation order
    try:
        return _replay(replica, switches, arrivals)
    finally:
        torch.set_num_threads(threads)


def _replay(replica: int, switches: list, arrivals: list) -> list[float]:
    """Fast replica ``replica`` of the 3x2 run below, replayed on one process: the governed model (every level
    calibrated on the replica's first batch, as its pipeline does) at the run's level schedule, SpectralAdamW
    fed the anchor's gradients where the run applied them (each the dense gradient of the start on the
    anchor's batch of that round: θ_global never moves here), the replica's clipping and optimizer."""
    from hf_meshtune.config import MeshConfig
    from hf_meshtune.optim.spectral import SpectralAdamW, spectral_options
    from hf_meshtune.runtime.settings import RunSettings
    from tests.scripts.mesh_run import CONFIG as RUN_CONFIG
    from tests.scripts.mesh_run import MICROBATCHES, batches

    cfg = MeshConfig(num_stages=2, **{**RUN_CONFIG, **CONFIG})
    defaults = RunSettings.__dataclass_fields__
    model, start = (untie_embeddings_of(tiny_llama(seed=0, layers=4, hidden=64)) for _ in range(2))
    draw, anchor_draw = batches(replica), batches(99)
    handle = attach_composed(model, 2, SPECS[-1], seed=cfg.mask_seed, ladder=SPECS)
    handle.calibrate(model, {"input_ids": draw(0)[0]})
    trainable = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": defaults["weight_decay"].default},
        {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
    ]
    betas, eps = defaults["betas"].default, defaults["eps"].default
    optimizer = SpectralAdamW(groups, lr=3e-3, betas=betas, eps=eps, **spectral_options(cfg))
    matrices = [(n, p) for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2]
    named = dict(model.named_parameters())
    by_stage = [
        [named[n] for n in names]
        for names in stage_parameter_groups(list(named), "model.layers", [range(0, 2), range(2, 4)])
    ]
    reference = dict(start.named_parameters())
    changes, delivered = {step: levels for step, _, levels in switches}, dict(arrivals)
    losses = []
    for step in range(STEPS):
        model.zero_grad()
        handle.set_step(step)
        ids, _ = draw(step)
        total = 0.0
        for chunk in ids.chunk(MICROBATCHES):
            loss = model(input_ids=chunk, labels=chunk).loss / MICROBATCHES
            loss.backward()
            total += loss.item()
        losses.append(total)
        # the clipping norm as the replica sums it: per stage, then the stages' sums added (the all-reduce)
        parts = [
            torch.stack([p.grad.float().pow(2).sum() for p in stage if p.grad is not None]).sum() for stage in by_stage
        ]
        norm = float(torch.stack(parts).sum().sqrt())
        if norm > defaults["max_grad_norm"].default:
            for p in trainable:
                if p.grad is not None:
                    p.grad.mul_(defaults["max_grad_norm"].default / (norm + 1e-6))
        if step in delivered:
            snapshot = delivered[step]
            start.zero_grad()
            anchor_ids, _ = anchor_draw(snapshot // CONFIG["anchor_every"])
            for chunk in anchor_ids.chunk(MICROBATCHES):
                (start(input_ids=chunk, labels=chunk).loss / MICROBATCHES).backward()
            optimizer.update_anchor({p: reference[n].grad.clone() for n, p in matrices}, staleness=step - snapshot)
        optimizer.step()
        if step in changes:
            handle.set_levels(changes[step])
    return losses


def _gap(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def untie_embeddings_of(model):
    untie_embeddings(model)
    return model


def _single_process_fidelity() -> list[dict[str, float]]:
    """The anchor's round 0 measured on one process: the snapshot is the initial model, the batch the anchor's
    round-0 batch (``mesh_run.batches(99)(0)``), the geometry fitted on that batch's dense pass."""
    from tests.scripts.mesh_run import MICROBATCHES, batches

    model = tiny_llama(seed=0, layers=4, hidden=64)
    untie_embeddings(model)  # as the mesh's stages hold them
    ids, _ = batches(99)(0)
    handle = attach_composed(model, 2, SPECS[-1], ladder=SPECS)
    handle.calibrate(model, {"input_ids": ids})
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim >= 2}
    circuit = AnchorCircuit(
        model,
        params,
        handle,
        every=1,
        delay=0,
        batches=lambda _: [{"input_ids": c, "labels": c} for c in ids.chunk(MICROBATCHES)],
        loss_fn=lambda m, b: m(**b).loss,
    )
    return circuit.measure_ladder(0)[0]


@pytest.mark.slow
def test_a_governed_mesh_measures_like_one_process_and_switches_both_sides_at_the_same_step(tmp_path):
    proc = subprocess.run(
        [*mesh_launch("3x2"), "tests/scripts/mesh_run.py", str(tmp_path), str(STEPS), json.dumps(CONFIG)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "GOVERNOR_SCRIPT": json.dumps(SCRIPT)},
        text=True,
        capture_output=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False).result for r in range(6)]
    anchors = [r for r in results if r.role == "anchor"]
    # the probes: every level at the first round, the current level and its neighbours later; both
    # anchor stages reached the same numbers (one all-reduce) and the same decisions
    assert anchors[0].fidelity == anchors[1].fidelity and anchors[0].levels == anchors[1].levels
    first = anchors[0].fidelity[0]
    measured = [first[f"fidelity/b0/{spec.text}/cos"] for spec in SPECS]
    assert measured[0] < measured[1] < measured[2] <= 1.0
    reference = _single_process_fidelity()
    for spec, mine, ref in zip(SPECS, measured, reference):
        assert mine == pytest.approx(ref["cos"], abs=1e-5), spec.text
        for key in ("act_err", "grad_err"):
            assert first[f"fidelity/b0/{spec.text}/{key}"] == pytest.approx(ref[key], rel=1e-4), (spec.text, key)
    assert first["fidelity/probe_passes"] == 3 and anchors[0].fidelity[1]["fidelity/probe_passes"] == 3 + 2
    # the decisions: the first counts from its own snapshot, later ones after snapshot + anchor_delay
    rounds = [s for s in range(0, STEPS + 1, 2)]
    expected = [(s, s if s == 0 else s + 1, [0] if s < 4 else [1]) for s in rounds]
    assert anchors[0].levels == expected
    # both sides of the boundary switch at the same step to the decided levels, on every replica
    switches = [(0, 0, [0]), (5, 4, [1])]  # (step after which, snapshot, levels); round 2 kept [0]
    for replica in (0, 1):
        sender, receiver = (r for r in results if r.role == "fast" and r.replica == replica)
        assert sender.levels == receiver.levels == switches
    # each fast replica's losses equal its one-process replay at the run's level schedule. The first two steps
    # to float reassociation (1e-6); after that Adam's first steps turn last-bit differences of near-zero
    # gradients into whole-lr moves (a 1e-7 relative change of the start weights moves the loss of step 8 by
    # up to 2e-3 here), so the later steps are held to 2e-3 and to being several times closer than the replays
    # with the level switch, or the anchor's gradients, one step late (measured here, on the same losses)
    for replica in (0, 1):
        last = next(r for r in results if r.role == "fast" and r.replica == replica and r.stage == 1)
        assert last.arrivals == [(s + 1, s) for s in range(0, STEPS, 2)]  # round 8: after the last step
        replay = _one_process_replica(replica, switches, last.arrivals)
        assert last.losses[:2] == pytest.approx(replay[:2], rel=1e-6)
        right = _gap(last.losses, replay)
        late_switch = _gap(
            last.losses, _one_process_replica(replica, [(s + 1, n, lv) for s, n, lv in switches], last.arrivals)
        )
        late_anchor = _gap(last.losses, _one_process_replica(replica, switches, [(s + 1, n) for s, n in last.arrivals]))
        assert right < 2e-3 and 3 * right < min(late_switch, late_anchor), (right, late_switch, late_anchor)
    # the wire: the forward records of each step have the size of the level its forward used, each of the step's
    # 2 microbatch messages with its 24-byte header (every position of mesh_run's rows is labelled)
    widths = {lv: SPECS[lv].message_bytes(64, 4) for lv in range(3)}
    per_step = [2] + [0] * 5 + [1] * 3  # step 0 at the richest level, 1-5 at level 0, 6-8 at level 1
    tokens = 2 * 2 * 16  # MICRO × MICROBATCHES × SEQ of mesh_run
    for replica in (0, 1):
        sender = next(r for r in results if r.role == "fast" and r.replica == replica and r.stage == 0)
        sent = sender.wire["sent"]["pp_fwd"] - sender.calibration_bytes
        assert sent == sum(tokens * widths[lv] + 2 * HEADER_VALUES * 8 for lv in per_step)


# --- the pieces --------------------------------------------------------------------------------
def _sums(stage_rows: list[list[float]]) -> torch.Tensor:
    out = torch.zeros(len(stage_rows), SUMS, dtype=torch.float64)
    for s, row in enumerate(stage_rows):
        out[s, : len(row)] = torch.tensor(row, dtype=torch.float64)
    return out


def test_the_cosine_is_the_sending_stages_or_the_later_stages_where_it_trains_nothing():
    # stage 0 holds matrices: its sums alone (stage 1's are ignored)
    own = _fidelity(_sums([[3.0, 4.0, 9.0, 2, 1.0, 4.0, 9.0, 16.0], [-5.0, 1.0, 25.0, 3]]), 0)
    assert own["cos"] == pytest.approx(3.0 / math.sqrt(4.0 * 9.0))
    assert own["act_err"] == pytest.approx(0.5) and own["grad_err"] == pytest.approx(0.75)
    # stage 0 frozen (no matrices): stages 1 and 2 together
    frozen = _fidelity(_sums([[0, 0, 0, 0, 1.0, 1.0, 0, 0], [1.0, 1.0, 4.0, 1], [2.0, 3.0, 1.0, 2]]), 0)
    assert frozen["cos"] == pytest.approx(3.0 / math.sqrt(4.0 * 5.0))
    assert math.isnan(frozen["grad_err"])  # nothing upstream trains: no gradient crosses the boundary
    # nothing trains after the boundary either
    assert math.isnan(_fidelity(_sums([[0, 0, 0, 0], [0, 0, 0, 0]]), 0)["cos"])


def test_the_send_probe_codes_the_hidden_state_and_keeps_the_gradient_it_hands_back():
    from hf_meshtune.boundary.compose.codec import ComposedCodec

    hidden = torch.randn(2, 5, 16, requires_grad=True)
    dense = SendProbe()
    out = dense(hidden, 0, 1)
    assert out is hidden and dense.act_num == 0.0
    out.sum().backward()
    assert torch.equal(dense.grads[1], torch.ones(2, 5, 16, dtype=torch.float64))
    codec = ComposedCodec(parse_codec("int4"), 0, 16)
    coded = SendProbe(codec)
    h = hidden.detach().clone().requires_grad_(True)
    rebuilt = coded(h, 0, 0)
    expected, _ = codec.apply(hidden.detach(), 0, 0)
    torch.testing.assert_close(rebuilt.detach(), expected)
    assert coded.act_num == pytest.approx(float((expected.double() - hidden.detach().double()).pow(2).sum()))
    (rebuilt * 2).sum().backward()
    torch.testing.assert_close(coded.grads[0], h.grad.double())  # what the codec's backward handed the stage


class _Inbox:
    """Stands for the link's receiver: scripted messages, in order."""

    def __init__(self, messages) -> None:
        self.messages = list(messages)
        self.taken = 0

    def next(self):
        self.taken += 1
        return self.messages.pop(0) if self.messages else None

    def ready(self):
        out, self.messages = self.messages, []
        return out

    def join(self) -> None:
        pass


def _message(snapshot: int, counts_after: int, levels: list[int]):
    header, payload = levels_message(snapshot, counts_after, levels)
    return LEVELS.decode(header), payload


def _link(messages, lockstep=(2, 1)) -> tuple[FastLevelLink, list]:
    link = FastLevelLink.__new__(FastLevelLink)  # its logic alone, without a link to receive on
    switched: list = []
    link.boundaries, link.switch, link.lockstep = 1, switched.append, lockstep
    link.inbox, link.held, link.ended, link.levels, link.current = _Inbox(messages), {}, False, [2], -1
    link.switches, link.first, link.next_due = [], True, 0
    return link, switched


def test_lockstep_the_fast_side_waits_for_each_decision_at_the_step_it_counts():
    link, switched = _link([_message(0, 0, [0]), _message(2, 3, [0]), _message(4, 5, [1])])
    assert link.propose(0) == 0 and link.inbox.taken == 1  # the first round counts at its own snapshot
    link.adopt(0, 0)
    assert switched == [[0]] and link.switches == [(0, 0, [0])]
    assert link.propose(1) == 0 and link.propose(2) == 0 and link.inbox.taken == 1  # round 2 counts after 3
    assert link.propose(3) == 2 and link.inbox.taken == 2
    link.adopt(3, 2)
    assert switched == [[0]] and link.current == 2  # the same levels: nothing to rebuild
    state = link.state(4)  # a checkpoint after 4 steps: nothing before 4 is left to wait for
    assert state["levels"] == [0] and state["decided"] == [0] and link.inbox.taken == 2
    assert link.propose(5) == 4
    link.adopt(5, 4)
    assert switched == [[0], [1]] and link.switches[-1] == (5, 4, [1])


def test_a_decision_with_the_wrong_shape_or_timing_is_refused():
    link, _ = _link([_message(0, 0, [0, 1])])
    with pytest.raises(ValueError, match=r"governed levels=2 is invalid: it must hold one level per boundary \(1\)"):
        link.propose(0)
    link, _ = _link([_message(0, 0, [0]), _message(2, 2, [1])])
    link.propose(0)
    with pytest.raises(ValueError, match=r"governed levels counts_after=2 is invalid: it must be 3 \(round 2"):
        link.propose(3)


def test_a_checkpoint_waits_for_the_decisions_a_resumed_anchor_will_not_make_again():
    link, switched = _link([_message(0, 0, [1]), _message(2, 3, [0])])
    link.adopt(0, link.propose(0))
    state = link.state(3)  # round 2 (before step 3) counts after 3: a resumed anchor starts at round 4
    assert state["held"] == {2: (3, [0])} and state["decided"] == [0] and state["levels"] == [1]
    resumed, switched_again = _link([])
    resumed.load_state(state, 3)
    assert switched_again == [[1]] and resumed.next_due == 4 and not resumed.first
    assert resumed.propose(3) == 2
    resumed.adopt(3, 2)
    assert resumed.levels == [0] and switched_again == [[1], [0]]


def test_the_mesh_log_history_carries_each_rounds_fidelity_and_the_level_each_forward_used():
    from hf_meshtune.runtime.results import MeshResult, log_history

    anchor = MeshResult(4, 2, 0, "anchor")
    names = [spec.text for spec in SPECS]
    anchor.fidelity = [
        {**{f"fidelity/b0/{n}/cos": 0.9 + i / 100 for i, n in enumerate(names)}, "fidelity/step": 0.0},
        {f"fidelity/b0/{names[0]}/cos": 0.91, "fidelity/step": 2.0},
    ]
    anchor.levels = [(0, 0, [0]), (2, 3, [1])]
    fast = [MeshResult(r, r // 2, r % 2, "fast") for r in range(4)]
    fast[0].levels = [(0, 0, [0]), (3, 2, [1])]
    for result in fast:
        result.losses = [1.0] * 5 if result.stage == 1 else []
    summary = {f"{kind}_bytes_per_token": {} for kind in ("measured", "booked", "wire")}
    history = log_history([*fast, anchor], summary)
    assert [line["governor/b0/level"] for line in history] == [2.0, 0.0, 0.0, 0.0, 1.0]
    assert history[0]["fidelity/step"] == 0.0 and history[2]["fidelity/step"] == 2.0
    assert history[2][f"fidelity/b0/{names[0]}/cos"] == 0.91 and "fidelity/step" not in history[1]


def _run(out: Path, config: dict, script: list, **env: str) -> list:
    proc = subprocess.run(
        [*mesh_launch("3x2"), "tests/scripts/mesh_run.py", str(out), str(STEPS), json.dumps(config)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "GOVERNOR_SCRIPT": json.dumps(script), **env},
        text=True,
        capture_output=True,
        timeout=400,
    )
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(6)]


@pytest.mark.slow
def test_a_resumed_governed_mesh_continues_exactly_with_its_levels(tmp_path):
    """A checkpoint after 4 steps (anchor_delay 0: the lockstep anchor's resumes are exact only then, as the
    gradients in flight are not checkpointed): the resumed run starts at the levels in use, its anchor at
    round 4 with the decision it had reached, and it repeats the uninterrupted run bit for bit: losses,
    parameters, θ_global, the anchor's decisions and the steps at which both sides switched."""
    config = {**CONFIG, "anchor_delay": 0, "dp_sync_every": 4, "codec_refit_every": 1}  # syncs and refits too
    script = [[0, [0]], [2, [1]], [4, [2]]]
    full = _run(tmp_path / "full", config, script, CHECKPOINT_EVERY="4")
    resumed = _run(tmp_path / "resumed", config, script, RESUME_FROM=str(tmp_path / "full" / "checkpoint-4"))
    for b, a in zip(full, resumed):
        if b.role == "anchor":
            assert a.levels == b.levels[2:] and [s for s, *_ in a.levels] == list(range(4, STEPS + 1, 2))
            # the same probes and numbers: around the decision the checkpoint held (probe_passes counts this
            # process's passes, so the resumed anchor's count starts again)
            drop = "fidelity/probe_passes"
            assert [{k: v for k, v in e.items() if k != drop} for e in a.fidelity] == [
                {k: v for k, v in e.items() if k != drop} for e in b.fidelity[2:]
            ]
            continue
        assert a.first_step == 4 and a.losses == b.losses[4:]
        assert b.levels == [(0, 0, [0]), (2, 2, [1]), (4, 4, [2])] and a.levels == b.levels[2:]
        for mine, theirs in zip(b.global_params, a.global_params):
            assert torch.equal(mine, theirs)
        assert all(torch.equal(b.params[n], a.params[n]) for n in b.params)


def test_without_lockstep_a_decision_counts_once_here_and_due_and_the_replica_takes_the_minimum():
    link, switched = _link([_message(0, 0, [1]), _message(4, 6, [0])], lockstep=None)
    assert link.propose(5) == 0  # round 4's decision is here but counts only after step 6
    link.adopt(5, 0)
    assert switched == [[1]]
    assert link.propose(6) == 4
    link.adopt(6, 0)  # another stage of the replica did not hold it yet: the agreed minimum keeps the levels
    assert switched == [[1]] and link.current == 0
    link.adopt(7, 4)
    assert switched == [[1], [0]] and link.switches == [(5, 0, [1]), (7, 4, [0])]
