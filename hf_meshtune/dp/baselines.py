"""The per-step data-parallel syncs a user would otherwise pick, for side-by-side comparisons.

The mesh's own DP sync is Streaming DiLoCo + PowerSGD (``dp.diloco``). ``RunSettings.dp_mode`` can
instead sync every fast step, as plain data parallelism does:

* ``"allreduce"``: average the gradients of stage s over the fast replicas with one all-reduce per
  step (what DDP does, bucket by bucket);
* ``"powersgd_hook"``: torch's own PowerSGD DDP communication hook
  (``torch.distributed.algorithms.ddp_comm_hooks.powerSGD_hook``, error feedback and warm start on),
  called on one bucket holding the stage's gradients, as DDP would call it.

DDP itself cannot wrap a pipeline stage here (the stage module carries per-step state that a DDP
wrapper would hide), so ``GradientSync`` plays the reducer: it flattens the gradients into one bucket,
hands it to the same hook DDP would, and copies the averaged bucket back. Every all-reduce is booked on
the ``Wire``'s ``dp`` circuit: the hook's calls are intercepted where the hook modules call
``dist.all_reduce``, so what is booked is exactly what the hook sends.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any, cast

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook

from .._validation import require
from ..comm.wire import Wire
from ..memory import tensor_bytes

__all__ = ["DP_MODES", "GradientSync"]

DP_MODES = ("streaming_diloco", "allreduce", "powersgd_hook")


class _Bucket:
    """What a DDP communication hook reads from ``dist.GradBucket``, for one bucket of all gradients."""

    def __init__(self, buffer: torch.Tensor, params: Sequence[nn.Parameter]) -> None:
        self._buffer, self._params = buffer, list(params)
        self._views, offset = [], 0
        for p in self._params:
            self._views.append(buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()

    def index(self) -> int:
        return 0

    def is_last(self) -> bool:
        return True

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def gradients(self) -> list[torch.Tensor]:
        return self._views

    def parameters(self) -> list[nn.Parameter]:
        return self._params


class _BookingDist:
    """``torch.distributed`` as the hook modules see it while a sync runs: ``all_reduce`` is booked."""

    def __init__(self, wire: Wire, participants: int) -> None:
        self._wire, self._participants = wire, participants

    def all_reduce(self, tensor, *args, **kwargs):
        self._wire.record_all_reduce("dp", tensor, self._participants)
        return dist.all_reduce(tensor, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(dist, name)


@contextlib.contextmanager
def _booked(wire: Wire, participants: int) -> Iterator[None]:
    proxy: Any = _BookingDist(wire, participants)  # stands in for the torch.distributed module
    saved = powerSGD_hook.dist, default_hooks.dist
    powerSGD_hook.dist = default_hooks.dist = proxy
    try:
        yield
    finally:
        powerSGD_hook.dist, default_hooks.dist = saved


class GradientSync:
    """Average the gradients of ``params`` over ``group`` every step (``mode``: allreduce | powersgd_hook).

    ``group``: stage s of every fast replica (``participants`` processes). ``powersgd_rank``: the
    hook's ``matrix_approximation_rank``; ``start_iter``: steps of plain all-reduce before PowerSGD
    starts (torch requires >= 2 with error feedback). Call ``sync()`` after backward, before clipping.
    """

    def __init__(
        self,
        mode: str,
        params: Sequence[nn.Parameter],
        group,
        participants: int,
        wire: Wire,
        *,
        powersgd_rank: int = 4,
        start_iter: int = 2,
        seed: int = 0,
    ) -> None:
        require(mode in DP_MODES[1:], "dp_mode", mode, f"be one of {list(DP_MODES[1:])} for a per-step sync")
        require(participants >= 1, "participants", participants, "be >= 1")
        # DDP's reducer lays a bucket out in reverse registration order (the order backward produces
        # gradients); the hook draws its random Q factors in bucket order, so the layout must match
        self.mode, self.params, self.group, self.participants, self.wire = (
            mode,
            list(params)[::-1],
            group,
            participants,
            wire,
        )
        self.state = None
        if mode == "powersgd_hook":
            require(
                isinstance(powersgd_rank, int) and powersgd_rank >= 1,
                "dp_powersgd_rank",
                powersgd_rank,
                "be an integer >= 1 with dp_mode='powersgd_hook'",
            )
            self.state = powerSGD_hook.PowerSGDState(
                process_group=group,
                matrix_approximation_rank=powersgd_rank,
                start_powerSGD_iter=start_iter,
                random_seed=seed,
            )

    def state_bytes(self) -> int:
        """Bytes of torch's PowerSGD hook state (error feedback, P and Q memories; ``memory``)."""
        if self.state is None:
            return 0
        state = self.state
        return tensor_bytes([state.error_dict, state.p_memory_dict, state.q_memory_dict])

    def sync(self) -> None:
        """Replace every gradient by its average over the group (a missing gradient counts as zero)."""
        grads = []
        for p in self.params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
            grads.append(p.grad)
        flat = torch.cat([grad.reshape(-1) for grad in grads])
        if self.mode == "allreduce":
            self.wire.all_reduce("dp", flat, self.participants, lambda t: dist.all_reduce(t, group=self.group))
            flat.div_(self.participants)
        else:
            assert self.state is not None  # built with mode="powersgd_hook"
            bucket = cast(dist.GradBucket, _Bucket(flat, self.params))  # a stand-in with what the hook reads
            with _booked(self.wire, self.participants):
                flat = powerSGD_hook.powerSGD_hook(self.state, bucket).wait()
        offset = 0
        for p, grad in zip(self.params, grads):
            grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
