"""Running stages across processes: torch's ``PipelineStage`` on the ``Wire``, and the 1F1B schedule.

``MeshStage`` is torch's ``PipelineStage`` with three additions: it tells its module which microbatch a forward
belongs to (the mask's clock); its boundary messages are variable-size (``pipeline.messages``): a send packs the
payload's carried positions (and codes them where the codec ends in a coder) into a header and a body, sent at once
and booked on the ``Wire`` (``pp_fwd``/``pp_bwd``, or ``anchor`` on the anchor's pipeline, or ``local`` over a
boundary whose two stages share a host); a receive reads the header first, then receives the body into a CPU buffer
of its size, which is decoded into the stage's padded buffer (on its device) before the chunk's forward or backward
reads it. Everything on the links is a CPU tensor, as the mesh's gloo links need. Inside a stage shapes are static
(example tensors at construction), so no metadata inference runs a stray forward.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from functools import partial
from typing import cast

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

from .._validation import require
from ..comm.wire import LOCAL, Wire
from .messages import HEADER_VALUES, WireFormat
from .stage import StageModule

__all__ = ["MeshStage", "build_schedule", "run_schedule"]


class MeshStage(PipelineStage):
    """A ``PipelineStage`` whose module learns the microbatch index and whose boundary messages travel
    variable-size (``pipeline.messages``) on the ``Wire``."""

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
        local: Sequence[int] = (),
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
        self.wire, self.dtype, self.microbatch_size = wire, dtype, microbatch_size
        fwd, bwd = ("anchor", "anchor") if anchor else ("pp_fwd", "pp_bwd")
        # a boundary whose two stages share a host (``local``) is booked apart: it never reaches a WAN link
        self.fwd_circuit = LOCAL if stage in local else fwd  # sends forward over boundary ``stage``
        self.bwd_circuit = LOCAL if stage - 1 in local else bwd  # sends backward over boundary ``stage - 1``
        self.lengths: torch.Tensor | None = None  # the step's carried lengths, every row (None: all positions)
        # per chunk, what lands in the stage's buffers once the schedule has waited for the receives
        self._landing_fwd: dict[int, list[Callable[[], None]]] = {}
        self._landing_bwd: dict[int, list[Callable[[], None]]] = {}
        self._sending: list = []  # the step's sends in flight (work handles and the tensors they read)
        # seconds this stage spent computing (its chunks' forwards and backwards, decoding what it received and
        # coding what it sends), cumulative: the rest of a step is waiting on its neighbours
        self.compute_seconds = 0.0

    def begin_step(self, lengths: torch.Tensor | None) -> None:
        """The step's carried lengths (``messages.carried_lengths`` of its labels; None: every position)."""
        self.lengths = None if lengths is None else lengths.to("cpu", torch.int64)

    def finish_step(self) -> None:
        """Wait for this step's sends (every peer has received them once its own step is done)."""
        for work, _ in self._sending:
            work.wait()
        self._sending.clear()

    def _chunk_lengths(self, chunk: int) -> torch.Tensor | None:
        if self.lengths is None:
            return None
        return self.lengths[chunk * self.microbatch_size : (chunk + 1) * self.microbatch_size]

    def forward_one_chunk(self, fwd_chunk_id: int, args, kwargs=None, save_forward_output: bool = True):
        start = time.perf_counter()
        cast(StageModule, self.submod).microbatch = fwd_chunk_id
        _land(self._landing_fwd.pop(fwd_chunk_id, []))
        try:
            return super().forward_one_chunk(fwd_chunk_id, args, kwargs, save_forward_output)
        finally:
            self.compute_seconds += time.perf_counter() - start

    def backward_one_chunk(self, bwd_chunk_id: int, *args, **kwargs):
        start = time.perf_counter()
        _land(self._landing_bwd.pop(bwd_chunk_id, []))
        try:
            return super().backward_one_chunk(bwd_chunk_id, *args, **kwargs)
        finally:
            self.compute_seconds += time.perf_counter() - start

    def _format(self, side: str, direction: str) -> WireFormat:
        return cast(StageModule, self.submod).wire_format(side, direction, self.dtype)

    def get_fwd_recv_ops(self, fwd_chunk_id: int):
        landing = self._landing_fwd.setdefault(fwd_chunk_id, [])
        return self._receive(super().get_fwd_recv_ops(fwd_chunk_id), self._format("in", "fwd"), fwd_chunk_id, landing)

    def get_bwd_recv_ops(self, bwd_chunk_id: int):
        landing = self._landing_bwd.setdefault(bwd_chunk_id, [])
        return self._receive(super().get_bwd_recv_ops(bwd_chunk_id), self._format("out", "bwd"), bwd_chunk_id, landing)

    def get_fwd_send_ops(self, fwd_chunk_id: int):
        ops = super().get_fwd_send_ops(fwd_chunk_id)
        return self._send(ops, self._format("out", "fwd"), fwd_chunk_id, self.fwd_circuit)

    def get_bwd_send_ops(self, bwd_chunk_id: int):
        ops = super().get_bwd_send_ops(bwd_chunk_id)
        return self._send(ops, self._format("in", "bwd"), bwd_chunk_id, self.bwd_circuit)

    def _send(self, ops: list[dist.P2POp], form: WireFormat, chunk: int, circuit: str) -> list[dist.P2POp]:
        """Send each op's payload now as header + body (booked on ``circuit``); nothing is left for the
        schedule to batch. Sending at once never waits longer than the schedule's own batching would: a
        receiver blocks on a header only where the schedule waits for that message anyway."""
        for op in ops:
            start = time.perf_counter()
            header, body = form.pack(op.tensor, self._chunk_lengths(chunk))
            self.compute_seconds += time.perf_counter() - start
            if form.coder is not None:
                self.wire.record_coding(circuit, int(header[1]) * int(header[2]), body.numel())
            for tensor in (header, body) if body.numel() else (header,):  # an empty body: the header says so
                self.wire.record_send(circuit, tensor)
                self._sending.append((dist.isend(tensor, op.peer, op.group, op.tag), tensor))
        return []

    def _receive(
        self, ops: list[dist.P2POp], form: WireFormat, chunk: int, landing: list[Callable[[], None]]
    ) -> list[dist.P2POp]:
        """For each receive of a padded buffer: its header now (it says the body's size), then a receive of
        the body for the schedule to wait on, which lands in the buffer before the chunk runs."""
        lengths = self._chunk_lengths(chunk)
        out = []
        for op in ops:
            header = torch.empty(HEADER_VALUES, dtype=torch.int64)
            dist.recv(header, op.peer, op.group, op.tag)
            body = torch.empty(form.expect(header, lengths, op.tensor.shape[0] * op.tensor.shape[1]), dtype=torch.uint8)
            if body.numel():  # no row of the microbatch carries a position: nothing follows the header
                out.append(dist.P2POp(dist.irecv, body, op.peer, op.group, op.tag))
            landing.append(partial(form.unpack, body, lengths, op.tensor))
        return out

    def _get_init_p2p_neighbors_ops(self):
        # torch's first step exchanges a scalar with each neighbour (NCCL warm-up) on the stage's device
        ops = super()._get_init_p2p_neighbors_ops()
        return [_staged_send(op) if op.op is dist.isend else _staged_recv(op) for op in ops]


def _with_tensor(op: dist.P2POp, tensor: torch.Tensor) -> dist.P2POp:
    """A new ``op`` on ``tensor``, to the same peer (its global rank) in the same group with the same tag."""
    return dist.P2POp(op.op, tensor, op.peer, op.group, op.tag)


def _staged_send(op: dist.P2POp) -> dist.P2POp:
    """The send itself on a CPU stage; on a GPU, the same send of a CPU copy (gloo sends CPU memory)."""
    if op.tensor.device.type == "cpu":
        return op
    return _with_tensor(op, op.tensor.detach().cpu())


def _staged_recv(op: dist.P2POp) -> dist.P2POp:
    """The warm-up receive into a CPU buffer on a GPU stage (its value is never read)."""
    if op.tensor.device.type == "cpu":
        return op
    return _with_tensor(op, torch.empty(op.tensor.shape, dtype=op.tensor.dtype))


def _land(landing: list[Callable[[], None]]) -> None:
    """Decode the chunk's received bodies into the stage's buffers (the schedule has waited for them)."""
    for land in landing:
        land()


def build_schedule(stage: MeshStage, microbatches: int, loss_fn: Callable):
    """1F1B over ``microbatches`` (GPipe when there are fewer microbatches than stages, which 1F1B
    cannot schedule). Gradients are the mean over microbatches of each microbatch's mean loss."""
    require(microbatches >= 1, "microbatches", microbatches, "be >= 1")
    if microbatches >= stage.num_stages:
        return Schedule1F1B(stage, microbatches, loss_fn=loss_fn, scale_grads=True)
    return ScheduleGPipe(stage, microbatches, loss_fn=loss_fn, scale_grads=True)


def run_schedule(
    schedule, module: StageModule, ids: torch.Tensor, labels: torch.Tensor, lengths: torch.Tensor | None = None
) -> float | None:
    """One step of ``schedule``: the first stage feeds ``ids``, the last ``labels``; boundary messages carry
    the positions under ``lengths`` (``messages.carried_lengths``; None: every position). Returns the mean
    microbatch loss on the last stage (None elsewhere)."""
    stage = cast(MeshStage, schedule._stage)
    stage.begin_step(lengths)
    try:
        loss = _step(schedule, module, ids, labels)
    finally:
        stage.finish_step()
    return loss


def _step(schedule, module: StageModule, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
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
