"""Running stages across processes: torch's ``PipelineStage`` on the ``Wire``, and the 1F1B schedule.

``MeshStage`` is torch's ``PipelineStage`` with two additions: it tells its module which microbatch
a forward belongs to (the mask's clock), and it books every activation and gradient it hands to
the backend on the ``Wire`` (``pp_fwd``/``pp_bwd``, or ``anchor`` on the anchor's pipeline).
Shapes are static (example tensors at construction), so no metadata inference runs a stray forward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
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

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        self.submod.microbatch = fwd_chunk_id
        return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        for op in ops:
            self.wire.record_send(self.fwd_circuit, op.tensor)
        return ops

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        for op in ops:
            self.wire.record_send(self.bwd_circuit, op.tensor)
        return ops


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
