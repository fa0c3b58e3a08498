"""Running stages across processes: torch's ``PipelineStage`` on the ``Wire``, and the 1F1B schedule.

``MeshStage`` is torch's ``PipelineStage`` with three additions: it tells its module which microbatch
a forward belongs to (the mask's clock); it books every activation and gradient it hands to the
backend on the ``Wire`` (``pp_fwd``/``pp_bwd``, or ``anchor`` on the anchor's pipeline); and on a GPU
it stages its point-to-point traffic through CPU memory, since the mesh's gloo links send and
receive CPU tensors only: a send goes out as a CPU copy, a receive lands in a CPU buffer that is
copied into the stage's device buffer before the chunk's forward or backward reads it.
Shapes are static (example tensors at construction), so no metadata inference runs a stray forward.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .._validation import require
from ..comm.wire import Wire
from .stage import StageModule

__all__ = ["MeshStage", "build_schedule", "run_schedule"]


class MeshStage(PipelineStage):
    """A ``PipelineStage`` whose module learns the microbatch index and whose sends go on the ``Wire``."""

    def __init__(
        self,
        module: StageModule,
        *,
        group,
        device: torch.device,
        microbatch_size: int,
        seq_len: int,
        dtype: torch.dtype,
        wire: Wire,
        anchor: bool = False,
    ) -> None:
        stage, num_stages = module.stage, module.num_stages

        def payload(side: str) -> torch.Tensor:  # requires_grad marks the payload as differentiable
            width = module.payload_width(side, dtype)
            return torch.zeros(microbatch_size, seq_len, width, dtype=dtype, device=device, requires_grad=True)

        if stage == 0:
            example_in = torch.zeros(microbatch_size, seq_len, dtype=torch.long, device=device)
        else:
            example_in = payload("in")
        if stage == num_stages - 1:
            vocab = module.config.get_text_config().vocab_size
            example_out = torch.zeros(microbatch_size, seq_len, vocab, dtype=dtype, device=device)
        else:
            example_out = payload("out")
        super().__init__(module, stage, num_stages, device, input_args=example_in, output_args=example_out, group=group)
        self.wire = wire
        self.fwd_circuit, self.bwd_circuit = ("anchor", "anchor") if anchor else ("pp_fwd", "pp_bwd")
        # GPU stages: per chunk, (device buffer, the CPU buffer its receive lands in) until the copy
        self._staged_fwd: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._staged_bwd: dict[int, list[tuple[torch.Tensor, torch.Tensor]]] = {}

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        cast(StageModule, self.submod).microbatch = fwd_chunk_id
        _land(self._staged_fwd.pop(fwd_chunk_id, []))
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        _land(self._staged_bwd.pop(bwd_chunk_id, []))
        return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        return _staged_recvs(super().get_fwd_recv_ops(fwd_chunk_id), self._staged_fwd.setdefault(fwd_chunk_id, []))

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        return _staged_recvs(super().get_bwd_recv_ops(bwd_chunk_id), self._staged_bwd.setdefault(bwd_chunk_id, []))

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        for op in ops:
            self.wire.record_send(self.fwd_circuit, op.tensor)
        return [_staged_send(op) for op in ops]

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        for op in ops:
            self.wire.record_send(self.bwd_circuit, op.tensor)
        return [_staged_send(op) for op in ops]

    def _get_init_p2p_neighbors_ops(self):
        # torch's first step exchanges a scalar with each neighbour (NCCL warm-up) on the stage's device
        ops = super()._get_init_p2p_neighbors_ops()
        return [_staged_send(op) if op.op is dist.isend else _staged_recvs([op], [])[0] for op in ops]


def _with_tensor(op: dist.P2POp, tensor: torch.Tensor) -> dist.P2POp:
    """A new ``op`` on ``tensor``, to the same peer (its global rank) in the same group with the same tag."""
    return dist.P2POp(op.op, tensor, op.peer, op.group, op.tag)


def _staged_send(op: dist.P2POp) -> dist.P2POp:
    """The send itself on a CPU stage; on a GPU, the same send of a CPU copy (gloo sends CPU memory)."""
    if op.tensor.device.type == "cpu":
        return op
    return _with_tensor(op, op.tensor.detach().cpu())


def _staged_recvs(ops: list[dist.P2POp], staged: list[tuple[torch.Tensor, torch.Tensor]]) -> list[dist.P2POp]:
    """Receives into CPU buffers for the GPU buffers of ``ops``, noting each pair in ``staged``."""
    out = []
    for op in ops:
        if op.tensor.device.type == "cpu":
            out.append(op)
            continue
        buffer = torch.empty(op.tensor.shape, dtype=op.tensor.dtype)
        staged.append((op.tensor, buffer))
        out.append(_with_tensor(op, buffer))
    return out


def _land(staged: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Copy received CPU buffers into the stage's device buffers (the schedule has waited for them)."""
    with torch.no_grad():
        for device_buffer, buffer in staged:
            device_buffer.copy_(buffer)


def build_schedule(stage: MeshStage, microbatches: int, loss_fn: Callable):
    """1F1B over ``microbatches`` (GPipe when there are fewer microbatches than stages, which 1F1B
    cannot schedule). Gradients are the mean over microbatches of each microbatch's mean loss."""
    require(microbatches >= 1, "microbatches", microbatches, "be >= 1")
    if microbatches >= stage.num_stages:
        return Schedule1F1B(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    return ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)


def run_schedule(schedule, module: StageModule, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
    """One step of ``schedule``: the first stage feeds ``ids``, the last ``labels``; returns the mean
    microbatch loss on the last stage (None elsewhere)."""
    losses: list[torch.Tensor] = []
    first, last = module.stage == 0, module.stage == module.num_stages - 1
    if first and last:
        schedule.step(ids, target=labels, losses=losses, return_outputs=False)
    elif first:
        schedule.step(ids, return_outputs=False)
    elif last:
        schedule.step(target=labels, losses=losses, return_outputs=False)
    else:
        schedule.step(return_outputs=False)
    return float(torch.stack([loss.detach() for loss in losses]).mean()) if losses else None
