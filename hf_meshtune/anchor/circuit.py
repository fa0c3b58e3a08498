"""The anchor circuit on one machine: dense gradients of parameter snapshots, delivered Δ steps late.

In the mesh the anchor replica takes a snapshot θ_s of the fast circuit at step s, runs a dense
(unmasked) forward/backward on its own data and its gradient G_anc lands Δ fast steps later, where
it updates the anchor momentum M_anc inside ``SpectralAdamW.update_anchor``. Here the same numerics
run inline: at step s the current parameters *are* θ_s, so the gradient is computed right away (no
copy of the model) and held until step s + Δ. The result does not depend on timing, and the fast
circuit's RNG stream is untouched (the anchor forward runs inside ``torch.random.fork_rng``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._validation import require
from ..boundary.compose.handle import ComposedHandle
from ..boundary.hooks import BoundaryHandle
from ..boundary.masking import private_rng

__all__ = ["AnchorCircuit", "PendingGradient"]

Batch = Mapping[str, torch.Tensor]


@dataclass
class PendingGradient:
    """A dense gradient in flight: taken at ``snapshot_step``, applied at ``deliver_step``; with a codec
    refit, the boundary geometry fitted on the same dense pass travels with it (``geometry``)."""

    snapshot_step: int
    deliver_step: int
    grads: dict[str, torch.Tensor]
    geometry: list[dict] | None = None


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

    def on_step(self, step: int, optimizer) -> list[int]:
        """Before optimizer step ``step``: snapshot if due, then deliver what has arrived.

        Returns the snapshot steps delivered now (staleness = step - snapshot step).
        """
        if step % self.every == 0:
            round_index = step // self.every
            refit = self.refit_every > 0 and round_index % self.refit_every == 0
            with self.boundaries.recording() if refit else contextlib.nullcontext():
                grads = self.dense_gradient(round_index)
            geometry = self.boundaries.refit_geometry() if refit else None
            self.pending.append(PendingGradient(step, step + self.delay, grads, geometry))
        due = [p for p in self.pending if p.deliver_step <= step]
        self.pending = [p for p in self.pending if p.deliver_step > step]
        for arrival in due:
            if arrival.geometry is not None:  # this step's forward ran on the old one; the next uses it
                self.boundaries.load_geometries(arrival.geometry)
                self.refits += 1
            optimizer.update_anchor(
                {self.params[name]: grad for name, grad in arrival.grads.items()},
                staleness=step - arrival.snapshot_step,
            )
            self.last_staleness = step - arrival.snapshot_step
        return [arrival.snapshot_step for arrival in due]

    def dense_gradient(self, round_index: int) -> dict[str, torch.Tensor]:
        """∂L/∂θ of the dense model at the current parameters on the anchor batches of a round."""
        names, tensors = list(self.params), list(self.params.values())
        microbatches = list(self.batches(round_index))
        require(len(microbatches) > 0, "anchor batches", 0, "be at least one microbatch per round")
        total = [torch.zeros_like(t, dtype=torch.float32) for t in tensors]
        guard = self.boundaries.disabled() if self.boundaries is not None else contextlib.nullcontext()
        with guard, private_rng(tensors[0].device):
            for batch in microbatches:
                loss = self.loss_fn(self.model, batch) / len(microbatches)
                grads = torch.autograd.grad(loss, tensors, allow_unused=True)
                for acc, grad in zip(total, grads):
                    if grad is not None:
                        acc.add_(grad.float())
        self.rounds_done = round_index + 1
        return dict(zip(names, total))

    def state_dict(self) -> dict:
        return {
            "pending": [(p.snapshot_step, p.deliver_step, p.grads, p.geometry) for p in self.pending],
            "last_staleness": self.last_staleness,
            "rounds_done": self.rounds_done,
            "refits": self.refits,
        }

    def load_state_dict(self, state: dict) -> None:
        unknown = {name for _, _, grads, *_ in state["pending"] for name in grads} - set(self.params)
        require(
            not unknown, "anchor state", sorted(unknown)[:3], "only name parameters of this model's spectral matrices"
        )
        self.pending = [PendingGradient(*entry) for entry in state["pending"]]  # (s, d, g[, geometry])
        self.last_staleness = state["last_staleness"]
        self.rounds_done = state["rounds_done"]
        self.refits = state.get("refits", 0)
