"""The anchor circuit on one machine: dense gradients of parameter snapshots, delivered Δ steps late.

In the mesh the anchor replica takes a snapshot θ_s of the fast circuit at step s, runs a dense
(unmasked) forward/backward on its own data and its gradient G_anc lands Δ fast steps later, where
it updates the anchor momentum M_anc inside ``SpectralAdamW.update_anchor``. Here the same numerics
run inline: at step s the current parameters *are* θ_s, so the gradient is computed right away (no
copy of the model) and held until step s + Δ. The result does not depend on timing, and the fast
circuit's RNG stream is untouched (the anchor forward runs inside ``torch.random.fork_rng``).

Governed (``boundary_codec="governed"``), each round also measures the fidelity of the codec levels
around every boundary's current one on the round's batch (``anchor.fidelity``) and the governor's
choice travels with the round's gradient: the boundaries switch after the step that applies it. The
circuit then runs even without the anchor prior (``feed=False``: no gradient reaches the optimizer).
The first round (at the first step) measures every level and picks the start, which counts at once,
from the second step's forward: one calibration wait, like the codec's own calibration, instead of
``delay`` steps at the ladder's richest level.
With an adaptive cadence (``anchor.governor.AnchorCadence``) the next round's step follows from the
newest drift of the anchor momentum's subspace instead of ``every``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import cast

import torch
from torch import nn

from .._validation import require
from ..boundary.compose.handle import ComposedHandle
from ..boundary.hooks import BoundaryHandle
from ..boundary.masking import private_rng
from .fidelity import FidelityProbe, ProbeRecord, stage_parameter_groups
from .governor import AnchorCadence, FidelityGovernor, candidate_levels

__all__ = ["AnchorCircuit", "PendingGradient", "rng_state", "set_rng_state"]

Batch = Mapping[str, torch.Tensor]


@dataclass
class PendingGradient:
    """A dense gradient in flight: taken at ``snapshot_step``, applied at ``deliver_step``; with a codec
    refit, the boundary geometry fitted on the same dense pass travels with it (``geometry``)."""

    snapshot_step: int
    deliver_step: int
    grads: dict[str, torch.Tensor]  # name → dense gradient, or (U_r, s_r, V_r) with the factors payload
    geometry: list[dict] | None = None
    levels: list[int] | None = None  # governed: the boundaries' levels the round chose


class AnchorCircuit:
    """Dense-gradient producer for the spectral filter (paper: slow anchor circuit).

    Args:
        model: the fast model (boundaries attached); its current parameters are the snapshot.
        params: name → parameter for every matrix the spectral optimizer filters.
        boundaries: disabled while the anchor runs, so its forward/backward is dense.
        every: fast steps between snapshots (``anchor_every``).
        delay: Δ, fast steps from snapshot to delivery (``anchor_delay``).
        batches: ``round → list of microbatches`` for the anchor's own data.
        loss_fn: ``(model, batch) → scalar loss``.
        refit_every: every that many rounds (0: never) the composed codecs' geometry is refitted on the
            round's dense boundary activations and used from the step after its delivery on.
        governor: with a governed codec ladder on the boundaries, the policy that picks their levels.
        cadence: the adaptive cadence (None: a round every ``every`` steps).
        feed: whether the gradients go into the optimizer's anchor momentum (False: the circuit runs for
            the governor only).
        factors: the anchor's M_anc for ``anchor_payload="factors"`` (None: deliver the gradient).
    """

    def __init__(
        self,
        model: nn.Module,
        params: Mapping[str, nn.Parameter],
        boundaries: BoundaryHandle | ComposedHandle | None,
        every: int,
        delay: int,
        batches: Callable[[int], Sequence[Batch]],
        loss_fn: Callable[[nn.Module, Batch], torch.Tensor],
        refit_every: int = 0,
        governor: FidelityGovernor | None = None,
        cadence: AnchorCadence | None = None,
        feed: bool = True,
        factors=None,
    ) -> None:
        require(every >= 1, "anchor_every", every, "be >= 1")
        require(delay >= 0, "anchor_delay", delay, "be >= 0")
        require(len(params) > 0, "anchor params", len(params), "include at least one matrix (2-D trainable parameter)")
        self.model, self.params, self.boundaries = model, dict(params), boundaries
        self.every, self.delay = every, delay
        self.batches, self.loss_fn = batches, loss_fn
        require(
            refit_every == 0 or hasattr(boundaries, "refit_geometry"),
            "codec_refit_every",
            refit_every,
            "be 0 unless the boundaries are a composed codec (masks have no geometry to refit)",
        )
        self.refit_every = refit_every
        self.refits = 0  # geometries delivered (and loaded)
        self.pending: list[PendingGradient] = []
        self.last_staleness: int | None = None
        self.rounds_done = 0
        require(
            governor is None or getattr(boundaries, "ladders", None) is not None,
            "boundary_codec",
            getattr(getattr(boundaries, "spec", None), "text", None),
            "be 'governed' (a codec ladder on the boundaries) for the fidelity governor",
        )
        self.governor, self.cadence, self.feed = governor, cadence, feed
        self.factors = factors  # optim.factors.AnchorMomentum, or None for the gradient payload
        self.decided: list[int] | None = None  # governed: the newest levels chosen (maybe still in flight)
        self.switches: list[tuple[int, int, list[int]]] = []  # level changes: (step applied, snapshot, levels)
        self.fidelity: dict[str, float] = {}  # the newest round's fidelity/* and governor/* log entries
        self.probe_passes = 0  # probe forward/backward passes so far (each costs one dense round's pass)
        self.gap, self.next_round = every, 0  # adaptive cadence: gap to the next round, its step
        self.last_drift: float | None = None
        self.cadence_log: list[dict[str, float]] = []  # per round: step, drift, staleness, gap chosen

    def on_step(self, step: int, optimizer) -> list[int]:
        """Before optimizer step ``step``: snapshot if due, then deliver what has arrived.

        Returns the snapshot steps delivered now (staleness = step - snapshot step).
        """
        if self._round_due(step):
            round_index = step // self.every if self.cadence is None else self.rounds_done
            refit = self.refit_every > 0 and round_index % self.refit_every == 0
            record = ProbeRecord(None) if self.governor is not None else None
            rng = rng_state(self._device)
            with (
                self._composed.recording() if refit else contextlib.nullcontext(),
                self._composed.probing(record) if record is not None else contextlib.nullcontext(),
            ):
                grads = self.dense_gradient(round_index)
            geometry = self._composed.refit_geometry() if refit else None
            start = record is not None and self.decided is None
            levels = self._govern(step, round_index, grads, record, rng) if record is not None else None
            if start:  # the start levels count at once (a one-time wait on a mesh), not after anchor_delay steps
                assert levels is not None  # start implies a governor, which chose them
                self._switch(step, step, levels)
                levels = None
            payload = grads
            if self.factors is not None and self.feed:  # the anchor folds at its snapshot and sends factors
                payload = dict(zip(grads, self.factors.fold(list(grads.values()))))
            self.pending.append(PendingGradient(step, step + self.delay, payload, geometry, levels))
            if self.cadence is not None:
                self.gap = self.cadence.next_gap(self.gap, self.last_drift, self.last_staleness)
                self.next_round = step + self.gap
                self.cadence_log.append(
                    {
                        "step": float(step),
                        "drift": _or_nan(self.last_drift),
                        "staleness": _or_nan(self.last_staleness),
                        "gap": float(self.gap),
                    }
                )
        due = [p for p in self.pending if p.deliver_step <= step]
        self.pending = [p for p in self.pending if p.deliver_step > step]
        for arrival in due:
            if arrival.geometry is not None:  # this step's forward ran on the old one; the next uses it
                self._composed.load_geometries(arrival.geometry)
                self.refits += 1
            if arrival.levels is not None:
                self._switch(step, arrival.snapshot_step, arrival.levels)
            if self.feed:
                deliver = optimizer.update_anchor if self.factors is None else optimizer.update_anchor_factors
                deliver(
                    {self.params[name]: grad for name, grad in arrival.grads.items()},
                    staleness=step - arrival.snapshot_step,
                )
                drift = getattr(optimizer, "last_drift", None)
                self.last_drift = drift if drift is not None else self.last_drift
            self.last_staleness = step - arrival.snapshot_step
        return [arrival.snapshot_step for arrival in due]

    def _switch(self, step: int, snapshot: int, levels: list[int]) -> None:
        """Governed: run the boundaries at ``levels`` from the forward after optimizer step ``step`` on."""
        if levels != self._composed.levels:
            self._composed.set_levels(levels)
            self.switches.append((step, snapshot, list(levels)))

    @property
    def _composed(self) -> ComposedHandle:
        """The boundaries as composed codecs: what a refit and the governor run on (``__init__`` requires them
        there). A cast, not a check, so that anything shaped like a ``ComposedHandle`` still serves."""
        return cast(ComposedHandle, self.boundaries)

    def _round_due(self, step: int) -> bool:
        if self.cadence is None:
            return step % self.every == 0
        return step >= self.next_round

    @property
    def _device(self) -> torch.device:
        return next(iter(self.params.values())).device

    def _gradient(self, microbatches: Sequence[Batch]) -> list[torch.Tensor]:
        """Σ over ``microbatches`` of ∂(loss / n)/∂θ (float32) for the anchor's matrices."""
        tensors = list(self.params.values())
        total = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        for batch in microbatches:
            loss = self.loss_fn(self.model, batch) / len(microbatches)
            grads = torch.autograd.grad(loss, tensors, allow_unused=True)
            for acc, grad in zip(total, grads):
                if grad is not None:
                    acc.add_(grad.float())
        return total

    def dense_gradient(self, round_index: int) -> dict[str, torch.Tensor]:
        """∂L/∂θ of the dense model at the current parameters on the anchor batches of a round."""
        microbatches = list(self.batches(round_index))
        require(len(microbatches) > 0, "anchor batches", 0, "be at least one microbatch per round")
        guard = self.boundaries.disabled() if self.boundaries is not None else contextlib.nullcontext()
        with guard, private_rng(self._device):
            total = self._gradient(microbatches)
        self.rounds_done = round_index + 1
        return dict(zip(self.params, total))

    # --- the governor -----------------------------------------------------------------------------
    def _probe(self, round_index: int, grads: Mapping[str, torch.Tensor], record: ProbeRecord, rng) -> FidelityProbe:
        """A fidelity probe on the round's batches, replaying the dense pass's RNG on every probe pass."""
        microbatches = list(self.batches(round_index))
        handle = self._composed

        def run_pass(probe_record: ProbeRecord) -> dict[str, torch.Tensor]:
            self.probe_passes += 1
            with handle.disabled(), handle.probing(probe_record), private_rng(self._device):
                set_rng_state(self._device, rng)
                return dict(zip(self.params, self._gradient(microbatches)))

        groups = stage_parameter_groups(list(self.params), handle.layers_name, handle.stages)
        probe = FidelityProbe(run_pass, groups)
        probe.reference(grads, record)
        return probe

    def measure(self, round_index: int, codecs: Sequence[Sequence]) -> list[list[dict[str, float]]]:
        """Fidelity of ``codecs[b]`` (any objects with ``apply(h, step, microbatch) → (h̃, message)``) at
        boundary b, on round ``round_index``'s batches at the current parameters: ``[b][i] → {cos,
        act_err, grad_err}``. Changes nothing the run uses (its RNG, rounds, levels)."""
        record, rng = ProbeRecord(None), rng_state(self._device)
        done = self.rounds_done
        with self._composed.probing(record):
            grads = self.dense_gradient(round_index)
        self.rounds_done = done
        probe = self._probe(round_index, grads, record, rng)
        return [[probe.measure(b, codec) for codec in group] for b, group in enumerate(codecs)]

    def measure_ladder(self, round_index: int) -> list[list[dict[str, float]]]:
        """``measure`` of every level of every boundary's ladder: ``[boundary][level]``."""
        ladders = self._composed.ladders
        assert ladders is not None  # governed
        return self.measure(round_index, ladders)

    def _govern(self, step: int, round_index: int, grads, record: ProbeRecord, rng) -> list[int]:
        """Measure the candidate levels of every boundary on this round's batch and choose the next ones;
        the first round measures every level and starts where the governor's ``initial`` says."""
        ladders, levels_now = self._composed.ladders, self._composed.levels
        assert ladders is not None and levels_now is not None and self.governor is not None  # governed
        first = self.decided is None
        current = list(levels_now) if self.decided is None else self.decided
        probe = self._probe(round_index, grads, record, rng)
        chosen, entries = [], {}
        for boundary, ladder in enumerate(ladders):
            levels = range(len(ladder)) if first else candidate_levels(current[boundary], len(ladder))
            cos = {}
            for level in levels:
                measured = probe.measure(boundary, ladder[level])
                cos[level] = measured["cos"]
                for key, value in measured.items():
                    entries[f"fidelity/b{boundary}/{ladder[level].spec.text}/{key}"] = value
            if first:
                chosen.append(self.governor.initial([cos[level] for level in range(len(ladder))]))
            else:
                chosen.append(self.governor.decide(current[boundary], cos))
            entries[f"governor/b{boundary}/decided"] = float(chosen[-1])
        self.decided = chosen
        self.fidelity = {**entries, "fidelity/probe_passes": float(self.probe_passes), "fidelity/step": float(step)}
        return chosen

    def state_dict(self) -> dict:
        return {
            "pending": [(p.snapshot_step, p.deliver_step, p.grads, p.geometry, p.levels) for p in self.pending],
            "last_staleness": self.last_staleness,
            "rounds_done": self.rounds_done,
            "refits": self.refits,
            "decided": self.decided,
            "switches": self.switches,
            "cadence": {"gap": self.gap, "next_round": self.next_round, "last_drift": self.last_drift},
            "probe_passes": self.probe_passes,
            "factors": self.factors.state_dict() if self.factors is not None else None,
        }

    def load_state_dict(self, state: dict) -> None:
        unknown = {name for _, _, grads, *_ in state["pending"] for name in grads} - set(self.params)
        require(
            not unknown, "anchor state", sorted(unknown)[:3], "only name parameters of this model's spectral matrices"
        )
        self.pending = [PendingGradient(*entry) for entry in state["pending"]]  # (s, d, g[, geometry[, levels]])
        self.last_staleness = state["last_staleness"]
        self.rounds_done = state["rounds_done"]
        self.refits = state.get("refits", 0)
        self.decided = state.get("decided")
        self.switches = [tuple(entry) for entry in state.get("switches", [])]
        cadence = state.get("cadence") or {}
        self.gap = cadence.get("gap", self.every)
        self.next_round = cadence.get("next_round", 0)
        self.last_drift = cadence.get("last_drift")
        self.probe_passes = state.get("probe_passes", 0)
        saved = state.get("factors")
        require(
            (saved is None) == (self.factors is None),
            "anchor state factors",
            "present" if saved is not None else "absent",
            f"match this run's anchor_payload ({'factors' if self.factors is not None else 'gradient'})",
        )
        if saved is not None:
            self.factors.load_state_dict(saved)


def _or_nan(value: float | None) -> float:
    return float("nan") if value is None else float(value)


def rng_state(device: torch.device) -> tuple:
    """The RNG state a pass starts from (CPU, and the device's on CUDA)."""
    return torch.get_rng_state(), torch.cuda.get_rng_state(device) if device.type == "cuda" else None


def set_rng_state(device: torch.device, state: tuple) -> None:
    cpu, cuda = state
    torch.set_rng_state(cpu)
    if cuda is not None:
        torch.cuda.set_rng_state(cuda, device)
