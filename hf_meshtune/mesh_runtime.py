"""One process of the distributed X × Y mesh: a fast masked stage or an anchor stage.

Every process holds the full model (it loads the same checkpoint) and runs one pipeline stage of
one replica (``pipeline.StageModule``; memory for the other stages' weights is not reclaimed yet).

Fast replica r, stage s (``FastWorker``), per step:
  1. its replica's 1F1B pipeline over the step's microbatches, compact [B, T, K] boundaries;
  2. gradient clipping over the whole replica (one scalar all-reduce over the PP group);
  3. drain the anchor inbox: every dense gradient that has arrived goes into ``SpectralAdamW``'s
     anchor momentum (the staleness, fast steps between its snapshot and now, is recorded);
  4. the inner optimizer step; Streaming DiLoCo (``dp_sync``) hooks it and syncs one fragment with
     stage s of the other fast replicas every ``dp_sync_every / dp_fragments`` steps.
  Replica 0 forwards every committed outer update (in its compressed wire form) to the anchor.

Anchor stage s (``AnchorWorker``) keeps θ_global by replaying those outer updates (``OuterFollower``),
and in rounds: on the freshest snapshot at least ``anchor_every`` fast steps after the previous one,
its dense pipeline computes ∂L/∂θ on its own batch and sends the 2-D gradients to stage s of every
fast replica. Anchor stage 0 picks each round's snapshot and tells the other anchor stages, so all
stages of a round use the same one.

The anchor never holds up a fast step: fast ranks receive on a background thread and only look at
what has already arrived; what they send to the anchor goes through a background thread too.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

from ._validation import require
from .config import MeshConfig, require_saved_knobs
from .fills import FILLS
from .masking import BoundaryMask
from .mesh import MeshTopology
from .mesh_checkpoint import read_rank_state, save_rank_state
from .pipeline import MeshStage, StageModule, build_schedule, causal_lm_loss, stage_parameter_names
from .wire import Wire

__all__ = ["AnchorWorker", "FastWorker", "MeshResult", "RunSettings", "require_mesh_supported", "run_worker", "stage_fragments"]

logger = logging.getLogger(__name__)

STOP, DATA = 0, 1
TAG_UPDATE, TAG_UPDATE_PAYLOAD, TAG_GRAD, TAG_GRAD_PAYLOAD, TAG_ROUND = 101, 102, 201, 202, 301

Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass
class RunSettings:
    """Everything a mesh process needs besides the model and its data."""

    config: MeshConfig
    microbatch_size: int
    microbatches: int
    seq_len: int
    max_steps: int
    lr: float = 2e-5
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0
    scheduler: Callable | None = None  # optimizer → LR scheduler (stepped once per fast step)
    anchor_microbatches: int | None = None
    lighthouse: str | None = None
    dp_timeout_s: float = 60.0
    log: Callable[[dict], None] | None = None  # called on the logging rank with per-step metrics
    log_every: int = 1
    record_parameters: bool = False  # return final and θ_global parameters in the MeshResult (tests)
    # DP sync of the fast replicas: Streaming DiLoCo (+ PowerSGD per config), or a per-step peer
    # (``dp_baselines``: "allreduce" = plain DDP averaging, "powersgd_hook" = torch's PowerSGD hook)
    dp_mode: str = "streaming_diloco"
    # seconds a pipeline send/receive may wait (the PP groups' timeout, given to build_groups by the
    # caller); a step past it fails naming the neighbours; None = the process group's default
    link_timeout_s: float | None = None
    on_step: Callable[[int, FastWorker], None] | None = None  # every fast rank, after each step (benchmarks)
    # mesh checkpoints (``mesh_checkpoint``): every fast rank writes its state to
    # checkpoint_dir/checkpoint-N/mesh/ after every checkpoint_every-th step, keeping checkpoint_keep
    # complete ones (None = all); resume_from = a checkpoint-N folder to continue from
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int | None = None
    resume_from: str | None = None

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "microbatches", "seq_len", "max_steps", "log_every"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, value, "be an int >= 1")
        require_mesh_supported(self.config)
        from .dp_baselines import DP_MODES

        require(self.dp_mode in DP_MODES, "dp_mode", self.dp_mode, f"be one of {list(DP_MODES)}")
        require(self.dp_mode == "streaming_diloco" or not self.config.anchor, "dp_mode", self.dp_mode,
                "be 'streaming_diloco' when anchor=True (the anchor replica follows θ by replaying DiLoCo's outer updates)")
        every = self.checkpoint_every
        require(every is None or (isinstance(every, int) and every >= 1), "checkpoint_every", every, "be None or an int >= 1")
        require(every is None or self.checkpoint_dir is not None, "checkpoint_dir", self.checkpoint_dir,
                "be set when checkpoint_every is (the folder the checkpoint-N folders go to)")
        keep = self.checkpoint_keep
        require(keep is None or (isinstance(keep, int) and keep >= 1), "checkpoint_keep", keep, "be None or an int >= 1")
        if every is not None or self.resume_from is not None:
            require(self.dp_mode != "powersgd_hook", "dp_mode", self.dp_mode,
                    "be 'streaming_diloco' or 'allreduce' with mesh checkpoints (torch's PowerSGD hook state is not saved)")
        period = self.config.dp_sync_every // self.config.dp_fragments
        require(every is None or self.dp_mode != "streaming_diloco" or every % period == 0, "checkpoint_every", every,
                f"be a multiple of dp_sync_every / dp_fragments = {period} (a checkpoint is taken between DiLoCo syncs)")


def require_mesh_supported(cfg) -> None:
    """The knobs the distributed mesh does not run (yet), refused by every rank before any collective."""
    require(cfg.mask_fill in ("zeros", "mean"), "mask_fill", cfg.mask_fill,
            "be 'zeros' or 'mean' on the distributed mesh (the 'gaussian' fill needs the anchor's dense "
            "activations on every receiving stage, which the mesh does not send)")
    require(cfg.mask_protect_dims == 0, "mask_protect_dims", cfg.mask_protect_dims,
            "be 0 on the distributed mesh (choosing the dims needs a dense forward of the whole model)")
    require(cfg.anchor_payload == "gradient", "anchor_payload", cfg.anchor_payload,
            "be 'gradient' on the distributed mesh (the anchor sends its dense gradient)")


@dataclass
class MeshResult:
    """What one process did: role, losses (last stages), wire bytes, syncs, anchor traffic."""

    rank: int
    replica: int
    stage: int
    role: str
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    wire: dict = field(default_factory=dict)
    dp_syncs: int = 0
    dp_sync_bytes: list[float] = field(default_factory=list)
    dp_participants: list[int] = field(default_factory=list)  # replicas averaged by every committed DiLoCo sync
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (fast step on arrival, snapshot step)
    anchor_rounds: list[int] = field(default_factory=list)  # snapshot step of every round (anchor)
    heals: list[tuple[int, int]] = field(default_factory=list)  # (own step, peer's step) of every heal
    first_step: int = 0  # the step this process started from (a resumed run's checkpoint step)
    anchor_lost_at: int | None = None  # fast step at which the anchor link broke (fast ranks; None: it held)
    params: dict[str, torch.Tensor] | None = None
    global_params: list[torch.Tensor] | None = None  # θ_global of every fragment, flattened (fast: DiLoCo's; anchor: its own)


# --------------------------------------------------------------------------------------------
# Pieces shared by both roles
# --------------------------------------------------------------------------------------------
class _ParamSet(nn.Module):
    """A DiLoCo fragment: some of a stage's trainable parameters (shared, not copied)."""

    def __init__(self, params: Sequence[nn.Parameter]) -> None:
        super().__init__()
        self.params = nn.ParameterList(list(params))


def stage_fragments(module: StageModule, count: int) -> list[nn.Module]:
    """Split a stage's trainable parameters into ``count`` contiguous fragments (model order).

    Embeddings go with the first layers, the final norm and the head with the last ones; every
    fragment gets at least one parameter tensor and they are balanced by element count.
    """
    params = [p for p in module.parameters() if p.requires_grad]
    require(len(params) >= count, "dp_fragments", count,
            f"be <= the {len(params)} trainable parameter tensors of stage {module.stage}")
    total = sum(p.numel() for p in params)
    fragments: list[list[nn.Parameter]] = [[] for _ in range(count)]
    seen, index = 0, 0
    for i, p in enumerate(params):
        left_params, left_frags = len(params) - i, count - index
        if fragments[index] and (seen >= total * (index + 1) / count or left_params <= left_frags - 1):
            index += 1
        fragments[index].append(p)
        seen += p.numel()
    return [_ParamSet(f) for f in fragments]


def _stage_module(model: nn.Module, stage: int, num_stages: int, cfg: MeshConfig, masked: bool) -> StageModule:
    def mask(boundary: int) -> BoundaryMask | None:
        if not masked or boundary < 0 or boundary >= num_stages - 1:
            return None
        return BoundaryMask(boundary, cfg.mask_ratio, cfg.mask_seed, cfg.mask_rescale, FILLS[cfg.mask_fill]())

    return StageModule(model, stage, num_stages, mask(stage - 1), mask(stage))


def _anchor_matrices(model: nn.Module, module: StageModule) -> list[tuple[str, nn.Parameter]]:
    """The stage's trainable 2-D parameters, in a fixed order both ends of the anchor link share."""
    return [(n, p) for n, p in stage_parameter_names(model, module).items() if p.requires_grad and p.ndim == 2]


def _host_key(rank: int) -> str:
    return f"hf_meshtune/host/{rank}"


def _neighbour_ranks(topology: MeshTopology, rank: int) -> list[int]:
    replica, stage = topology.coords(rank)
    return [topology.rank(replica, other) for other in (stage - 1, stage + 1) if 0 <= other < topology.stages]


_LINK_ERRORS = ("gloo/transport", "Timed out waiting", "Connection reset", "Connection closed", "Broken pipe")


def _is_link_error(err: BaseException) -> bool:
    """A backend's network failure (gloo raises a plain RuntimeError from its transport), not a bug in the step."""
    return isinstance(err, dist.DistError) or (isinstance(err, RuntimeError) and any(m in str(err) for m in _LINK_ERRORS))


def _pipeline_step(worker: _StageWorker, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
    """One pipeline step; a send/receive that fails or times out names the neighbours it waited on."""
    rank = worker.topology.rank(worker.replica, worker.stage)
    with _pipeline_link(worker, "a message to or from", _neighbour_ranks(worker.topology, rank)):
        return _run_schedule(worker.schedule, worker.module, ids, labels)


@contextlib.contextmanager
def _pipeline_link(worker: _StageWorker, what: str, peers: Sequence[int]):
    """Re-raise a network failure inside the block (gloo's transport error or timeout) as a message
    naming this process, the step and the peers with their addresses; other errors pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        if not _is_link_error(err):
            raise
        topology = worker.topology
        rank = topology.rank(worker.replica, worker.stage)
        named = ", ".join(f"rank {peer} (replica {topology.coords(peer)[0]}, stage {topology.coords(peer)[1]}) at "
                          f"{worker.peer_hosts.get(peer, 'an unknown address')}" for peer in peers)
        raise RuntimeError(
            f"rank {rank} ({worker.role} replica {worker.replica}, stage {worker.stage}) lost its pipeline link at "
            f"step {worker.module.step}: {what} {named} did not complete (timeout "
            f"{worker.settings.link_timeout_s} s: TrainingArguments.ddp_timeout, RunSettings.link_timeout_s): "
            f"{type(err).__name__}: {err}") from err


def _run_schedule(schedule, module: StageModule, ids: torch.Tensor, labels: torch.Tensor) -> float | None:
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


class _Sender:
    """Blocking point-to-point sends on a background thread: ``put`` never waits for the peer."""

    def __init__(self, wire: Wire, group, circuit: str) -> None:
        self.wire, self.group, self.circuit = wire, group, circuit
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-sender")
        self.thread.start()

    def put(self, dst: int, tag: int, tensor: torch.Tensor) -> None:
        if self.error is None:  # after a failed send nothing more goes out (close() reports it)
            self.queue.put((dst, tag, tensor))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            dst, tag, tensor = item
            try:
                self.wire.send(self.circuit, tensor, dst, group=self.group, tag=tag)
            except BaseException as error:  # noqa: BLE001 - reported by close()
                self.error = error
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"sending to the anchor link failed: {self.error}") from self.error


class _Receiver:
    """Receives (header, payload) messages from one peer on a background thread into a queue.

    ``header_len`` int64 header, first value DATA or STOP; ``payload_numel(header)`` says how many
    float32 values follow a DATA header (0 = none). The thread ends after a STOP.
    """

    def __init__(self, wire: Wire, group, src: int, tags: tuple[int, int], header_len: int,
                 payload_numel: Callable[[list[int]], int], circuit: str = "anchor") -> None:
        self.wire, self.group, self.src, self.tags = wire, group, src, tags
        self.header_len, self.payload_numel, self.circuit = header_len, payload_numel, circuit
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-receiver")
        self.thread.start()

    def _loop(self) -> None:
        try:
            while True:
                header = torch.zeros(self.header_len, dtype=torch.long)
                self.wire.recv(self.circuit, header, self.src, group=self.group, tag=self.tags[0])
                values = header.tolist()
                if values[0] == STOP:
                    self.queue.put(None)
                    return
                payload = torch.empty(self.payload_numel(values), dtype=torch.float32)
                if payload.numel():
                    self.wire.recv(self.circuit, payload, self.src, group=self.group, tag=self.tags[1])
                self.queue.put((values, payload))
        except BaseException as error:  # noqa: BLE001 - surfaced to the main thread
            self.error = error
            self.queue.put(None)

    def ready(self) -> list:
        """Every message that has arrived, without waiting (a STOP shows as None)."""
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def next(self):
        """The next message, waiting for it (None after STOP)."""
        return self.queue.get()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"receiving on the anchor link failed: {self.error}") from self.error


def _flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 CPU tensor (the anchor link is a gloo group, whatever the pipeline's backend)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def _unflatten(flat: torch.Tensor, shapes: Sequence[torch.Size]) -> list[torch.Tensor]:
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(shape))
        offset += n
    require(offset == flat.numel(), "anchor message size", flat.numel(), f"equal the expected {offset} values")
    return out


class _StageWorker:
    """What both roles share: this process's stage of its replica's pipeline, on the Wire."""

    role = "fast"

    def __init__(self, model: nn.Module, topology: MeshTopology, pp_group, link_group, settings: RunSettings,
                 batches: Batches, rank: int) -> None:
        anchor = self.role == "anchor"
        self.topology, self.settings, self.batches = topology, settings, batches
        self.replica, self.stage = topology.coords(rank)
        self.pp_group, self.link_group = pp_group, link_group
        self.wire = Wire()
        self.model = model
        masked = not anchor and settings.config.mask_ratio > 0
        self.module = _stage_module(model, self.stage, topology.stages, settings.config, masked=masked)
        microbatches = (settings.anchor_microbatches or settings.microbatches) if anchor else settings.microbatches
        self.device = next(model.parameters()).device
        self.pipe = MeshStage(self.module, group=pp_group, device=self.device, microbatch_size=settings.microbatch_size,
                              seq_len=settings.seq_len, dtype=next(model.parameters()).dtype, wire=self.wire, anchor=anchor)
        self.schedule = build_schedule(self.pipe, microbatches, causal_lm_loss(model))
        self.fragments = stage_fragments(self.module, settings.config.dp_fragments)
        self.matrices = _anchor_matrices(model, self.module)
        self.result = MeshResult(rank, self.replica, self.stage, self.role)
        self.peer_hosts: dict[int, str] = {}  # pipeline neighbours' addresses (run_worker fills it)

    def _record(self, global_params: Callable[[], list[torch.Tensor]]) -> None:
        self.result.wire = self.wire.to_dict()
        if self.settings.record_parameters:
            self.result.params = {n: p.detach().clone() for n, p in stage_parameter_names(self.model, self.module).items()}
            self.result.global_params = global_params()


# --------------------------------------------------------------------------------------------
# Fast replica stage
# --------------------------------------------------------------------------------------------
class FastWorker(_StageWorker):
    """Stage ``stage`` of fast replica ``replica``: masked pipeline, DiLoCo sync, anchor inbox."""

    def __init__(self, model: nn.Module, topology: MeshTopology, pp_group, link_group, settings: RunSettings,
                 batches: Batches, rank: int) -> None:
        from .dp_sync import StreamingDiLoCo, host_replica_store, make_manager
        from .optim.spectral import SpectralAdamW

        super().__init__(model, topology, pp_group, link_group, settings, batches, rank)
        cfg = settings.config
        trainable = [p for p in self.module.parameters() if p.requires_grad]
        decay = [p for p in trainable if p.ndim >= 2]
        no_decay = [p for p in trainable if p.ndim < 2]
        groups = [{"params": decay, "weight_decay": settings.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
        groups = [g for g in groups if g["params"]]
        if cfg.anchor:
            self.optimizer = SpectralAdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps,
                                           alpha=cfg.spectral_alpha, tau=cfg.spectral_tau, anchor_beta=cfg.anchor_beta,
                                           rank=cfg.spectral_rank, relative_tau=cfg.spectral_relative_tau, seed=cfg.mask_seed,
                                           max_staleness=cfg.anchor_max_staleness)
        else:
            self.optimizer = torch.optim.AdamW(groups, lr=settings.lr, betas=settings.betas, eps=settings.eps)
        self.scheduler = settings.scheduler(self.optimizer) if settings.scheduler else None
        self.manager = self.gradient_sync = None
        if settings.dp_mode == "streaming_diloco":
            self.replica_store = host_replica_store(self.replica, self.stage, timeout_s=settings.dp_timeout_s)
            self.manager = make_manager(replica=self.replica, stage=self.stage, num_stages=topology.stages,
                                        lighthouse_addr=settings.lighthouse, store_addr=self.replica_store.addr,
                                        store_port=self.replica_store.port, timeout_s=settings.dp_timeout_s)
            self.diloco = StreamingDiLoCo(
                self.manager, self.fragments, self.optimizer, sync_every=cfg.dp_sync_every,
                fragment_sync_delay=cfg.dp_sync_delay, outer_lr=cfg.dp_outer_lr, outer_momentum=cfg.dp_outer_momentum,
                powersgd_rank=cfg.dp_powersgd_rank, wire=self.wire, on_outer_update=self._on_outer_update, seed=cfg.mask_seed,
            )
        else:
            from .dp_baselines import GradientSync

            peers = [topology.rank(r, self.stage) for r in topology.fast_replicas]
            group = dist.new_group(peers, use_local_synchronization=True)
            self.gradient_sync = GradientSync(settings.dp_mode, trainable, group, len(peers), self.wire,
                                              powersgd_rank=cfg.dp_powersgd_rank or 4, seed=cfg.mask_seed)
            self.diloco = contextlib.nullcontext()
        self.anchor_rank = topology.anchor_rank(self.stage)
        self.inbox = self.outbox = None
        if cfg.anchor:
            numel = sum(p.numel() for _, p in self.matrices)
            self.inbox = _Receiver(self.wire, link_group, self.anchor_rank, (TAG_GRAD, TAG_GRAD_PAYLOAD), 2,
                                   lambda header: numel)
            if self.replica == 0:
                self.outbox = _Sender(self.wire, link_group, "anchor")
        self._step = 0
        self._dp_bytes_at_last_sync = 0.0
        if self.manager is not None:  # a restarted replica heals this stage's whole state from a peer
            self.manager.register_state_dict_fn("mesh_stage", self._load_stage_state, self._stage_state)
        if settings.resume_from is not None:
            self._resume(settings.resume_from)

    def _stage_state(self) -> dict:
        """What a peer's stage s gives a restarted replica's stage s when it heals (torchft reads it in
        DiLoCo's step post-hook, during the quorum: the inner step of ``self._step`` is done; its
        scheduler step is not). DiLoCo's fragments (θ_global, outer momentum) and PowerSGD's Q heal
        under their own keys."""
        return {"step": self._step,
                "params": {n: p.detach() for n, p in stage_parameter_names(self.model, self.module).items() if p.requires_grad},
                "optimizer": self.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None}

    def _load_stage_state(self, state: dict) -> None:
        """Heal: take the peer's local parameters, inner optimizer, scheduler and step; the loop goes
        on from the peer's step (its data and masks are pure functions of the step)."""
        own = self._step
        self._restore_stage(state)
        self.result.heals.append((own, self._step))

    def checkpoint_state(self) -> dict:
        """This process's part of a mesh checkpoint (``mesh_checkpoint``): the healing state plus the
        knobs, the RNG and DiLoCo's state (θ_global, outer momentum, PowerSGD, manager step)."""
        return {**self._stage_state(), "config": dataclasses.asdict(self.settings.config),
                "rng": torch.get_rng_state(), "diloco": self.diloco.state_dict() if self.manager is not None else None}

    def _resume(self, checkpoint: str) -> None:
        state = read_rank_state(checkpoint, self.topology.rank(self.replica, self.stage), self.topology)
        require_saved_knobs(state["config"], self.settings.config, context=f"to resume from {checkpoint}")
        self._restore_stage(state)
        if self.manager is not None:
            self.diloco.load_state_dict(state["diloco"])
        torch.set_rng_state(state["rng"])
        self.result.first_step = self._step

    def _save_checkpoint(self) -> None:
        s = self.settings
        save_rank_state(s.checkpoint_dir, self._step, self.topology.rank(self.replica, self.stage), self.checkpoint_state(),
                        self.topology, s.checkpoint_keep)

    def _restore_stage(self, state: dict) -> None:
        params = stage_parameter_names(self.model, self.module)
        require(set(state["params"]) == {n for n, p in params.items() if p.requires_grad}, "healing state",
                sorted(state["params"])[:3], "hold this stage's trainable parameters (a peer with another model or stage split)")
        with torch.no_grad():
            for name, value in state["params"].items():
                params[name].copy_(value)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self._step = int(state["step"])

    def _count_dp_sync(self) -> None:
        """Record one DP sync and the ``dp`` bytes this process sent for it."""
        self.result.dp_syncs += 1
        sent = self.wire.sent["dp"]
        self.result.dp_sync_bytes.append(sent - self._dp_bytes_at_last_sync)
        self._dp_bytes_at_last_sync = sent
        if self.manager is not None:
            self.result.dp_participants.append(self.manager.num_participants())

    def _on_outer_update(self, update) -> None:
        """A committed fragment sync: count it, and (replica 0) forward it to the anchor."""
        self._count_dp_sync()
        if self.outbox is not None:
            payload = _flatten(update.tensors)
            header = torch.tensor([DATA, self._step + 1, update.fragment, payload.numel()], dtype=torch.long)
            self.outbox.put(self.anchor_rank, TAG_UPDATE, header)
            self.outbox.put(self.anchor_rank, TAG_UPDATE_PAYLOAD, payload)

    def _unless_anchor_lost(self, close: Callable[[], None]) -> None:
        """Close one direction of the anchor link; a link that broke means the anchor is gone, not a bug."""
        try:
            close()
        except RuntimeError as err:
            cause = err.__cause__ if err.__cause__ is not None else err
            if not _is_link_error(cause):
                raise
            self._anchor_lost(cause)

    def _sync_gradients(self) -> None:
        """A per-step DP peer (``dp_mode`` allreduce / powersgd_hook): average the gradients now."""
        self.gradient_sync.sync()
        self._count_dp_sync()

    def _clip(self) -> None:
        max_norm = self.settings.max_grad_norm
        if not max_norm:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        total = local.reshape(1).clone()
        if self.topology.stages > 1:
            rank = self.topology.rank(self.replica, self.stage)
            with _pipeline_link(self, "the gradient-norm all-reduce with", [p for p in self.topology.pp_ranks(self.replica) if p != rank]):
                self.wire.all_reduce("pp_bwd", total, self.topology.stages, lambda t: dist.all_reduce(t, group=self.pp_group))
        norm = float(total.sqrt())
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))

    def _anchor_lost(self, error: BaseException) -> None:
        """The anchor link broke (its process died or its link is gone): train on without it, once warned."""
        if self.result.anchor_lost_at is not None:
            return
        self.result.anchor_lost_at = self._step
        staleness = self.settings.config.anchor_max_staleness
        logger.warning("rank %d (fast replica %d, stage %d) lost the anchor link at step %d (%s: %s); training goes on "
                       "without anchor gradients: SpectralAdamW keeps its last bases%s", self.topology.rank(self.replica, self.stage),
                       self.replica, self.stage, self._step, type(error).__name__, str(error).splitlines()[0][:200],
                       f" and fades them out after anchor_max_staleness={staleness} steps" if staleness is not None else
                       " (anchor_max_staleness=None: for the rest of the run)")

    def _drain_anchor(self) -> None:
        if self.inbox is None:
            return
        for message in self.inbox.ready():
            if message is None:
                if self.inbox.error is not None and _is_link_error(self.inbox.error):
                    self._anchor_lost(self.inbox.error)
                continue
            header, payload = message
            grads = _unflatten(payload, [p.shape for _, p in self.matrices])
            self.optimizer.update_anchor({p: g.to(p.device, p.dtype) for (_, p), g in zip(self.matrices, grads)},
                                         staleness=self._step - header[1])
            self.result.arrivals.append((self._step, header[1]))

    def run(self) -> MeshResult:
        s = self.settings
        tokens_per_step = s.microbatch_size * s.microbatches * s.seq_len
        logging = self.stage == self.topology.stages - 1 and self.replica == 0
        with self.diloco:
            while self._step < s.max_steps:
                step = self._step
                start = time.perf_counter()
                self.module.step = step
                ids, labels = (t.to(self.device) for t in self.batches(step))
                loss = _pipeline_step(self, ids, labels)
                if self.gradient_sync is not None:
                    self._sync_gradients()
                self._clip()
                self._drain_anchor()
                self.optimizer.step()  # DiLoCo's sync runs in its post-hook: a heal moves self._step
                step = self._step
                if self.scheduler is not None:
                    self.scheduler.step()
                self.optimizer.zero_grad(set_to_none=True)
                self.result.step_seconds.append(time.perf_counter() - start)
                self.result.steps += 1
                self.result.tokens += tokens_per_step
                if loss is not None:
                    self.result.losses.append(loss)
                    if logging and s.log is not None and (step + 1) % s.log_every == 0:
                        s.log({"step": step + 1, "loss": loss, "lr": self.optimizer.param_groups[0]["lr"],
                               "step_seconds": self.result.step_seconds[-1]})
                self._step = step + 1
                if s.checkpoint_every and self._step % s.checkpoint_every == 0:
                    self._save_checkpoint()
                if s.on_step is not None:
                    s.on_step(self._step, self)
        self._finish()
        return self.result

    def _finish(self) -> None:
        if self.outbox is not None:
            self.outbox.put(self.anchor_rank, TAG_UPDATE, torch.tensor([STOP, self._step + 1, -1, 0], dtype=torch.long))
            self._unless_anchor_lost(self.outbox.close)
        if self.inbox is not None:  # the anchor answers our STOP with its own once its round is done
            self._unless_anchor_lost(self.inbox.join)
            self._step = self.settings.max_steps
            self._drain_anchor()
        if self.manager is None:  # per-step sync: the replicas' parameters are the global ones
            self._record(lambda: [_flatten([p.detach() for p in f.parameters()]) for f in self.fragments])
            return
        self._record(lambda: [_flatten(self.diloco.global_parameters(i)) for i in range(len(self.fragments))])
        self.manager.shutdown(wait=False)


# --------------------------------------------------------------------------------------------
# Anchor replica stage
# --------------------------------------------------------------------------------------------
class AnchorWorker(_StageWorker):
    """Stage ``stage`` of the anchor replica: replays outer updates, computes dense gradients."""

    role = "anchor"

    def __init__(self, model: nn.Module, topology: MeshTopology, pp_group, link_group, settings: RunSettings,
                 batches: Batches, rank: int) -> None:
        from .dp_sync import OuterFollower

        super().__init__(model, topology, pp_group, link_group, settings, batches, rank)
        cfg = settings.config
        self.fragment_shapes = [[p.shape for p in f.parameters()] for f in self.fragments]
        self.follower = OuterFollower(self.fragments, outer_lr=cfg.dp_outer_lr, outer_momentum=cfg.dp_outer_momentum)
        self.source = topology.rank(0, self.stage)  # fast replica 0 forwards the outer updates
        self.inbox = _Receiver(self.wire, link_group, self.source, (TAG_UPDATE, TAG_UPDATE_PAYLOAD), 4,
                               lambda header: header[3])
        self.applied_step = 0  # fast steps reflected in this stage's parameters
        self.first_round = 0
        self.stopped = False
        if settings.resume_from is not None:
            self._resume(settings.resume_from)

    def _resume(self, checkpoint: str) -> None:
        """θ_global and the outer momentum from fast replica 0's state of this stage: the anchor goes on
        from the checkpoint's step (its rounds draw batches from step / anchor_every on)."""
        state = read_rank_state(checkpoint, self.topology.rank(0, self.stage), self.topology)
        require_saved_knobs(state["config"], self.settings.config, context=f"to resume from {checkpoint}")
        with torch.no_grad():
            for fragment, saved in zip(self.fragments, state["diloco"]["fragments"]):
                for name, param in fragment.named_parameters():
                    param.copy_(saved["original"][name])
        for optimizer, saved in zip(self.follower._optimizers, state["diloco"]["fragments"]):
            optimizer.load_state_dict(saved["outer"])
        self.applied_step = int(state["step"])
        self.first_round = self.applied_step // self.settings.config.anchor_every

    def _apply(self, message) -> None:
        from .dp_sync import OuterUpdate

        header, payload = message
        step, fragment = header[1], header[2]
        rank = self.settings.config.dp_powersgd_rank
        tensors = _unflatten(payload, update_shapes(self.fragment_shapes[fragment], rank))
        self.follower.apply(OuterUpdate(fragment=fragment, step=step, tensors=tensors, rank=rank))
        self.applied_step = step

    def _advance_to(self, target: int) -> None:
        """Apply queued outer updates until this stage's parameters reflect fast step ``target``."""
        while self.applied_step < target:
            message = self.inbox.next()
            require(message is not None, "anchor round", target, "name a snapshot the fast circuit reached before it stopped")
            self._apply(message)

    def _choose_round(self, previous: int | None) -> int | None:
        """Stage 0: the snapshot of the next round (None = the fast circuit has stopped)."""
        if previous is None:
            return self.applied_step  # 0, or the step a resumed run starts from
        due = previous + self.settings.config.anchor_every
        while self.applied_step < due:  # wait for a snapshot far enough ahead
            message = self.inbox.next()
            if message is None:
                self.stopped = True
                return None
            self._apply(message)
        for message in self.inbox.ready():  # then take the freshest one already here
            if message is None:
                self.stopped = True
                break
            self._apply(message)
        return self.applied_step

    def run(self) -> MeshResult:
        stages = self.topology.stages
        anchor_ranks = [self.topology.rank(self.replica, s) for s in range(stages)]
        previous: int | None = None
        round_index = self.first_round
        while True:
            if self.stage == 0:
                target = None if self.stopped else self._choose_round(previous)
                message = torch.tensor([-1 if target is None else target], dtype=torch.long)
                for dst in anchor_ranks[1:]:
                    self.wire.send("anchor", message, dst, group=self.link_group, tag=TAG_ROUND)
            else:
                message = torch.zeros(1, dtype=torch.long)
                self.wire.recv("anchor", message, anchor_ranks[0], group=self.link_group, tag=TAG_ROUND)
                target = None if message.item() < 0 else int(message.item())
                if target is not None:
                    self._advance_to(target)
            if target is None:
                break
            self._round(round_index, target)
            previous, round_index = target, round_index + 1
        self._finish()
        return self.result

    def _round(self, round_index: int, snapshot: int) -> None:
        self.model.zero_grad(set_to_none=True)
        self.module.step = round_index
        ids, labels = (t.to(self.device) for t in self.batches(round_index))
        loss = _pipeline_step(self, ids, labels)
        if loss is not None:
            self.result.losses.append(loss)
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.matrices]
        payload = _flatten(grads)
        header = torch.tensor([DATA, snapshot], dtype=torch.long)
        # to every fast replica at once: the anchor's uplink is shared among them, so no fast node's
        # downlink gets the whole gradient at the anchor's full rate (one delivery after another
        # would fill that node's queue and hold up its pipeline and DP traffic behind it)
        works = []
        for replica in self.topology.fast_replicas:
            dst = self.topology.rank(replica, self.stage)
            works.append(self.wire.isend("anchor", header, dst, group=self.link_group, tag=TAG_GRAD))
            works.append(self.wire.isend("anchor", payload, dst, group=self.link_group, tag=TAG_GRAD_PAYLOAD))
        for work in works:
            work.wait()
        self.result.anchor_rounds.append(snapshot)
        self.model.zero_grad(set_to_none=True)

    def _finish(self) -> None:
        while not self.stopped and self.inbox.next() is not None:  # updates after the last round
            pass
        self.inbox.join()
        for replica in self.topology.fast_replicas:
            self.wire.send("anchor", torch.tensor([STOP, -1], dtype=torch.long), self.topology.rank(replica, self.stage),
                           group=self.link_group, tag=TAG_GRAD)
        self._record(lambda: [_flatten(list(f.parameters())) for f in self.fragments])


def update_shapes(shapes: Sequence[torch.Size], rank: int | None) -> list[tuple[int, ...]]:
    """Shapes of an outer update's wire tensors: PowerSGD's P [m, r] and Q [n, r] for a compressed
    [m, n] parameter, the parameter's own shape otherwise (``dp_sync.OuterUpdate`` order)."""
    from .dp_sync import PowerSGD

    codec = PowerSGD(rank) if rank is not None else None
    out: list[tuple[int, ...]] = []
    for shape in shapes:
        if codec is not None and codec.compresses(shape):
            out += [(shape[0], rank), (shape[1], rank)]
        else:
            out.append(tuple(shape))
    return out


def run_worker(model: nn.Module, topology: MeshTopology, pp_group, link_group, settings: RunSettings,
               batches: Batches, anchor_batches: Batches | None = None) -> MeshResult:
    """Run this process's part of the mesh (its role comes from its rank) and return what it did."""
    require(topology.job_replica is None or settings.dp_mode == "streaming_diloco", "dp_mode", settings.dp_mode,
            "be 'streaming_diloco' when every replica is a job of its own (the per-step peers need one world)")
    rank = topology.mesh_rank(dist.get_rank())
    from .dp_sync import advertised_host

    store = dist.distributed_c10d._get_default_store()
    store.set(_host_key(rank), advertised_host())  # every rank's address, for link errors
    shared = job_store(settings.dp_timeout_s) if topology.job_replica is not None else None
    _require_same_settings(store, topology, rank, settings, shared)
    if topology.is_anchor(rank):
        require(anchor_batches is not None, "anchor_batches", None, "be given on the anchor replica")
        worker = AnchorWorker(model, topology, pp_group, link_group, settings, anchor_batches, rank)
    else:
        worker = FastWorker(model, topology, pp_group, link_group, settings, batches, rank)
    # Every torchft Manager heartbeats before any replica asks for its first quorum, so the
    # lighthouse waits for all fast replicas instead of forming a quorum without a late starter.
    dist.barrier()
    _job_barrier(shared, topology, settings.dp_timeout_s)
    # read now, while the store is surely reachable: a link error later names its peers by address
    worker.peer_hosts = {peer: store.get(_host_key(peer)).decode() for peer in topology.pp_ranks(topology.coords(rank)[0])
                         if peer != rank}
    return worker.run()


JOB_STORE_ENV, RESTART_ENV = "MESHTUNE_JOB_STORE", "MESHTUNE_RESTART"

# What every process of a mesh must agree on besides its shape (which ``MeshTopology`` checks): the
# knobs (masks, anchor, DiLoCo, filter) and the step's shapes, schedule and optimizer.
_SHARED_SETTINGS = ("microbatch_size", "microbatches", "seq_len", "max_steps", "lr", "betas", "eps", "weight_decay",
                    "max_grad_norm", "dp_mode", "checkpoint_every")


def _settings_of(settings: RunSettings) -> dict:
    values = {f"config.{k}": v for k, v in dataclasses.asdict(settings.config).items()}
    values.update({k: getattr(settings, k) for k in _SHARED_SETTINGS})
    return json.loads(json.dumps(values))  # tuples as lists, as they come back from the store


def _require_same_settings(store, topology: MeshTopology, rank: int, settings: RunSettings, shared=None) -> None:
    """Every process of a world reads every process's settings and compares them with the first one's,
    so a rank started with another mask_ratio, sync period or batch shape fails the whole world with
    one message naming the field, the rank and both values, instead of training something else. In
    replica jobs, ``shared`` (the launcher's store) also compares each process with mesh rank 0."""
    key = "hf_meshtune/settings/{}".format
    timeout = timedelta(seconds=settings.dp_timeout_s)
    mine = _settings_of(settings)

    def require_agree(other: int, values: dict, reference: int, theirs: dict) -> None:
        for name, value in values.items():
            require(theirs.get(name) == value, f"{name} (rank {other})", value,
                    f"equal rank {reference}'s {theirs.get(name)!r}: every process of the mesh runs with the same "
                    "settings (check that rank's command line and environment)")

    store.set(key(rank), json.dumps(mine))
    world = [topology.mesh_rank(r) for r in range(topology.job_world_size)]
    store.wait([key(r) for r in world], timeout)
    first = json.loads(store.get(key(world[0])))
    for other in world[1:]:
        require_agree(other, json.loads(store.get(key(other))), world[0], first)
    if shared is not None:
        shared.set(key(rank), json.dumps(mine))
        shared.wait([key(0)], timeout)
        require_agree(rank, mine, 0, json.loads(shared.get(key(0))))


def job_store(timeout_s: float) -> dist.TCPStore | None:
    """A client of the launcher's store ``$MESHTUNE_JOB_STORE`` (replica jobs), or None without one."""
    address = os.environ.get(JOB_STORE_ENV)
    if not address:
        return None
    host, _, port = address.rpartition(":")
    require(bool(host) and port.isdigit(), JOB_STORE_ENV, address, "be host:port of the launcher's TCPStore")
    return dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))


def _job_barrier(store, topology: MeshTopology, timeout_s: float) -> None:
    """Replica jobs, first start only: wait until every process of the mesh is ready (its torchft
    Manager heartbeats), through the launcher's store ``$MESHTUNE_JOB_STORE``, so no replica's first
    quorum forms without a replica that is still loading. A restarted replica (``$MESHTUNE_RESTART``
    > 0) joins the running mesh without waiting; without the store, replicas start unaligned (a late
    one then heals at its first sync)."""
    if store is None or int(os.environ.get(RESTART_ENV, "0")) > 0:
        return
    key = "hf_meshtune/ready"
    ready = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while ready < topology.world_size:
        require(time.monotonic() < deadline, "mesh start", f"{ready} of {topology.world_size} processes ready",
                f"complete within dp_timeout_s = {timeout_s} s (a replica job did not start)")
        time.sleep(0.05)
        ready = store.add(key, 0)
