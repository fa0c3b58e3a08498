"""A fast mesh process: stage s of fast replica r, and its step loop.

One fast step, top to bottom (``FastWorker.run``):
  1. the replica's 1F1B pipeline over the step's microbatches, compact [B, T, K] boundaries
     (``pipeline.schedule``, every payload booked on the ``Wire``);
  2. with a per-step DP peer (``dp_mode`` allreduce / powersgd_hook): average the gradients now
     (``dp.baselines``);
  3. gradient clipping over the whole replica (one scalar all-reduce over the PP group);
  4. the anchor's dense gradients that have arrived go into ``SpectralAdamW``'s anchor momentum
     (``anchor.link``, never waiting);
  5. the inner optimizer step; Streaming DiLoCo (``dp.diloco``) hooks it and syncs one fragment with
     stage s of the other fast replicas every ``dp_sync_every / dp_fragments`` steps;
  6. after it, this loop reads what the step did: a heal (a restarted replica took a peer's state:
     the loop goes on from the peer's step) and the committed syncs, which it counts and (replica 0)
     forwards to the anchor (``anchor.link``); with ``codec_refit_every`` the replica's stages agree on
     the newest codec geometry the anchor sent them all and switch to it together (``anchor.geometry``),
     and governed on the newest levels the anchor's governor chose (``anchor.mesh_governor``), in the
     same one all-reduce;
  7. the LR scheduler, logs, a mesh checkpoint when due (``runtime.checkpoint``), the callbacks.
"""

from __future__ import annotations

import contextlib
import time
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torch import nn

from ..anchor.geometry import FastGeometryLink, agree_min
from ..anchor.link import FastAnchorLink
from ..anchor.mesh_governor import FastLevelLink
from ..comm.messages import flatten
from ..comm.wire import LOCAL
from ..config import codec_ladder, codec_refit_every, is_governed
from ..dp.baselines import GradientSync
from ..dp.diloco import StreamingDiLoCo
from ..dp.ft import host_replica_store, make_manager
from ..memory import tensor_bytes
from ..optim.spectral import SpectralAdamW, spectral_options
from ..topology import MeshGroups
from . import fast_state
from .checkpoint import save_rank_state
from .console import step_rates
from .results import MeshResult
from .settings import Batches, RunSettings
from .stage import StageWorker

if TYPE_CHECKING:
    from torchft import Manager

__all__ = ["FastWorker"]


class FastWorker(StageWorker):
    """Stage ``stage`` of fast replica ``replica``: masked pipeline, DiLoCo sync, anchor inbox."""

    def __init__(self, model: nn.Module, groups: MeshGroups, settings: RunSettings, batches: Batches) -> None:
        super().__init__(model, groups, settings, batches)
        self.calibrate_codecs()
        self.optimizer = self._build_optimizer()
        self.scheduler = settings.scheduler(self.optimizer) if settings.scheduler else None
        self.manager: Manager | None = None  # torchft's, with dp_mode="streaming_diloco"
        self.gradient_sync: GradientSync | None = None  # with a per-step dp_mode
        self.diloco: StreamingDiLoCo | contextlib.nullcontext = contextlib.nullcontext()
        if settings.dp_mode == "streaming_diloco":
            self._setup_diloco()
        else:
            self._setup_gradient_sync()
        self.anchor = self._setup_anchor_link()
        self.geometry = self._setup_geometry_link()
        self.levels = self._setup_level_link()
        self._step = 0
        self._step_metrics: dict = {}
        self._healed_to: int | None = None
        self._dp_bytes_at_last_sync = 0.0
        if settings.resume_from is not None:
            self._resume(settings.resume_from)

    # --- set-up -------------------------------------------------------------------------------
    def _trainable(self) -> list[nn.Parameter]:
        return [p for p in self.module.parameters() if p.requires_grad]

    def _build_optimizer(self) -> torch.optim.Optimizer:
        s, cfg = self.settings, self.settings.config
        trainable = self._trainable()
        groups = [
            {"params": [p for p in trainable if p.ndim >= 2], "weight_decay": s.weight_decay},
            {"params": [p for p in trainable if p.ndim < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        if not cfg.anchor:
            return torch.optim.AdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps)
        # the mesh's logs carry no spectral/* cosines, so their per-step reductions are skipped; each step's
        # gradients are zeroed before the next backward, so step() may use them as scratch
        options = dict(diagnostics=False, overwrite_grads=True, **spectral_options(cfg))
        return SpectralAdamW(groups, lr=s.lr, betas=s.betas, eps=s.eps, **options)

    def _setup_diloco(self) -> None:
        s, cfg = self.settings, self.settings.config
        assert s.dp_timeout_s is not None  # RunSettings resolves it
        self.replica_store = host_replica_store(self.replica, self.stage, timeout_s=s.dp_timeout_s)
        self.manager = manager = make_manager(
            replica=self.replica,
            stage=self.stage,
            num_stages=self.topology.stages,
            lighthouse_addr=s.lighthouse,
            store_addr=self.replica_store.addr,
            store_port=self.replica_store.port,
            timeout_s=s.dp_timeout_s,
        )
        self.diloco = StreamingDiLoCo(
            self.manager,
            self.fragments,
            self.optimizer,
            sync_every=cfg.dp_sync_every,
            fragment_sync_delay=cfg.dp_sync_delay,
            keep_overlapped=cfg.dp_keep_overlapped,
            outer_lr=cfg.dp_outer_lr,
            outer_momentum=cfg.dp_outer_momentum,
            powersgd_rank=cfg.dp_powersgd_rank,
            quantize=cfg.dp_quantize,
            wire=self.wire,
            seed=cfg.mask_seed,
        )
        # a restarted replica heals this stage's whole state from a peer (DiLoCo's fragments and
        # PowerSGD's Q heal under their own keys)
        manager.register_state_dict_fn("mesh_stage", self._load_stage_state, self._stage_state)

    def _setup_gradient_sync(self) -> None:
        s, cfg = self.settings, self.settings.config
        peers = len(self.topology.fast_replicas)  # run_worker checked that dp_peer_group was built
        self.gradient_sync = GradientSync(
            s.dp_mode,
            self._trainable(),
            self.groups.dp_peer_group,
            peers,
            self.wire,
            powersgd_rank=cfg.dp_powersgd_rank or 4,
            seed=cfg.mask_seed,
        )

    @property
    def _streaming(self) -> StreamingDiLoCo:
        """``diloco`` with dp_mode="streaming_diloco" (``manager`` set), behind which every use of it sits."""
        return cast(StreamingDiLoCo, self.diloco)

    def _anchor_rank(self, stage: int) -> int:
        """The anchor replica's rank at ``stage``, on a mesh that has the anchor."""
        rank = self.topology.anchor_rank(stage)
        assert rank is not None  # called only with the anchor on
        return rank

    def _setup_anchor_link(self) -> FastAnchorLink | None:
        cfg = self.settings.config
        if not cfg.anchor:
            return None
        who = f"rank {self.rank} (fast replica {self.replica}, stage {self.stage})"
        return FastAnchorLink(
            self.wire,
            self.groups.link_group,
            self._anchor_rank(self.stage),
            self.matrices,
            forwards=self.replica == 0,
            who=who,
            max_staleness=cfg.anchor_max_staleness,
            lockstep=(cfg.anchor_every, cfg.anchor_delay) if cfg.anchor_lockstep else None,
            factor_rank=cfg.spectral_rank if cfg.anchor_payload == "factors" else None,
            max_step=self.settings.max_steps,
            close_timeout_s=self.settings.link_timeout_s or 1800.0,
            rate_mbit=cfg.anchor_rate_mbit,
        )

    def _setup_geometry_link(self) -> FastGeometryLink | None:
        cfg, module, topology = self.settings.config, self.module, self.topology
        refit = codec_refit_every(cfg)
        if not refit or self.anchor is None:
            return None
        sources = [
            (side, module.side_codecs(side), self._anchor_rank(boundary))
            for side, boundary in (("in", self.stage - 1), ("out", self.stage))
            if module.side_codecs(side)
        ]
        if not sources:  # Y = 1: no boundary
            return None
        return FastGeometryLink(
            self.wire,
            self.groups.link_group,
            self.groups.pp_group,
            topology.stages,
            sources,
            lockstep=(cfg.anchor_every, cfg.anchor_delay, refit) if cfg.anchor_lockstep else None,
            device=self.device,
            max_step=self.settings.max_steps,
        )

    def _setup_level_link(self) -> FastLevelLink | None:
        cfg, topology = self.settings.config, self.topology
        if not is_governed(cfg) or self.anchor is None or topology.stages < 2:
            return None
        richest = len(codec_ladder(cfg)) - 1
        return FastLevelLink(
            self.wire,
            self.groups.link_group,
            self._anchor_rank(self.stage),
            topology.stages - 1,
            [richest] * (topology.stages - 1),
            self._switch_levels,
            lockstep=(cfg.anchor_every, cfg.anchor_delay) if cfg.anchor_lockstep else None,
            max_step=self.settings.max_steps + cfg.anchor_delay,  # a decision counts from snapshot + delay on
        )

    def _switch_levels(self, levels: list[int]) -> None:
        """Governed: this stage's sides at ``levels`` (one per boundary) from the next forward on; the
        payload widths change, so the pipeline stage is rebuilt (every stage of the replica does, at the
        same step: the replica agreed on the switch)."""
        stage, stages = self.stage, self.topology.stages
        self.module.set_levels(levels[stage - 1] if stage > 0 else None, levels[stage] if stage < stages - 1 else None)
        self.build_pipe()

    def _agree(self, step: int) -> None:
        """After fast step ``step``: the replica's stages agree on the codec geometry and (governed) the
        levels to use next, in one all-reduce, and switch together."""
        links = [link for link in (self.geometry, self.levels) if link is not None]
        if not links:
            return
        agreed = agree_min(
            self.wire, self.groups.pp_group, self.topology.stages, [link.propose(step) for link in links], self.device
        )
        for link, snapshot in zip(links, agreed):
            link.adopt(step, snapshot)

    def _state_bytes(self) -> dict[str, int]:
        own = super()._state_bytes()
        state = [s for s in self.optimizer.state.values()]
        anchor = [{k: v for k, v in s.items() if k.startswith("anchor_")} for s in state]
        adam = [{k: v for k, v in s.items() if not k.startswith("anchor_")} for s in state]
        dp = self._streaming.state_bytes() if self.manager is not None else 0
        if self.gradient_sync is not None:
            dp = self.gradient_sync.state_bytes()
        return {**own, "optimizer": tensor_bytes(adam), "anchor": tensor_bytes(anchor), "dp": dp}

    # --- state: heals, checkpoints, resume (``runtime.fast_state``) ----------------------------------
    def _stage_state(self) -> dict:
        return fast_state.stage_state(self)

    def _load_stage_state(self, state: dict) -> None:
        """Heal (called by torchft inside the optimizer step): take the peer's local parameters, inner
        optimizer and scheduler now, as torchft's contract wants; the peer's step goes back to the loop."""
        self._healed_to = fast_state.restore_stage(self, state)

    def checkpoint_state(self) -> dict:
        return fast_state.checkpoint_state(self)

    def _resume(self, checkpoint: str) -> None:
        fast_state.resume(self, checkpoint)

    # --- one step -------------------------------------------------------------------------------
    def _clip(self) -> None:
        max_norm = self.settings.max_grad_norm
        if not max_norm:
            return
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        local = torch.stack([g.detach().float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        total = local.reshape(1).clone()
        if self.topology.stages > 1:
            mates = [p for p in self.topology.pp_ranks(self.replica) if p != self.rank]
            # within one host (every boundary of the replica local) it never reaches a WAN link
            one_host = len(self.topology.local_boundaries) == self.topology.stages - 1
            with self.naming_link_failure("the gradient-norm all-reduce with", mates):
                self.wire.all_reduce(
                    LOCAL if one_host else "pp_bwd",
                    total,
                    self.topology.stages,
                    lambda t: dist.all_reduce(t, group=self.groups.pp_group),
                )
        norm = float(total.sqrt())
        if norm > max_norm:
            for g in grads:
                g.mul_(max_norm / (norm + 1e-6))

    def _count_dp_sync(self) -> None:
        """Record one DP sync and the ``dp`` bytes this process put on its links for it (booked)."""
        self.result.dp_syncs += 1
        sent = self.wire.on_wire("dp")
        self.result.dp_sync_bytes.append(sent - self._dp_bytes_at_last_sync)
        self._dp_bytes_at_last_sync = sent
        if self.manager is not None:
            self.result.dp_participants.append(self.manager.num_participants())

    def _after_optimizer_step(self, step: int) -> int:
        """What the optimizer step did besides the update: a heal moves the loop to the peer's step;
        every committed sync is counted and forwarded to the anchor. Returns the step just finished."""
        if self._healed_to is not None:
            self.result.heals.append((step, self._healed_to))
            step, self._healed_to = self._healed_to, None
        if self.manager is not None:
            committed = self._streaming.take_committed()
            for _ in committed:
                self._count_dp_sync()
            if self.anchor is not None:
                self.anchor.forward(committed, step + 1, self._streaming.sync_tensors)
        return step

    def _train_step(self, step: int) -> tuple[int, float | None]:
        self.module.step = step
        start = time.perf_counter()
        ids, labels = (t.to(self.device) for t in self.batches(step))
        batched = time.perf_counter()
        loss = self.pipeline_step(ids, labels)
        trained = time.perf_counter()
        self.result.pipeline_seconds.append(trained - batched)
        self.result.compute_seconds.append(self.step_compute_s)
        if self.gradient_sync is not None:
            self.gradient_sync.sync()
            self._count_dp_sync()
        self._clip()
        if self.anchor is not None:
            self.anchor.drain(self.optimizer, step)
        self.optimizer.step()  # DiLoCo's sync runs in its post-hook
        step = self._after_optimizer_step(step)
        self._agree(step)
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._step_metrics = self._collect_metrics(batched - start, trained - batched, time.perf_counter() - trained)
        return step, loss

    def _collect_metrics(self, batches_s: float, pipeline_s: float, update_s: float) -> dict:
        """What the batches and the loss logged this step (RL: rewards, lengths, clip ratios; emptied on every
        stage), kept on the last stage with the step's time split: making the batches (RL: the rollouts),
        the pipeline's forward/backward, and the update (clipping, the anchor's gradients, the optimizer
        step with DiLoCo's sync in its hook)."""
        sources = [source for source in (self.batches, self.loss_fn) if hasattr(source, "pop_metrics")]
        metrics = {}
        for source in sources:
            metrics.update(source.pop_metrics())
        if not sources or self.stage != self.topology.stages - 1:
            return {}
        return {
            **metrics,
            "time/batches_s": batches_s,
            "time/pipeline_s": pipeline_s,
            "time/compute_s": self.step_compute_s,  # of the pipeline's: the rest of it waited on the neighbours
            "time/update_s": update_s,
        }

    def run(self) -> MeshResult:
        s, cfg = self.settings, self.settings.config
        logging = self.stage == self.topology.stages - 1 and self.replica == 0
        self._tokens_at_start, self._bytes_at_start = self.result.tokens, self.wire.moved()  # calibration aside
        with self.diloco:
            while self._step < s.max_steps:
                start = time.perf_counter()
                step, loss = self._train_step(self._step)
                self._step = step + 1
                if self.anchor is not None and cfg.anchor_lockstep and self._step % cfg.anchor_every == 0:
                    self.anchor.tick(self._step)
                self._record_step(time.perf_counter() - start, self.carried_tokens, loss, logging)
                if s.checkpoint_every and self._step % s.checkpoint_every == 0:
                    assert s.checkpoint_dir is not None  # RunSettings requires it with checkpoint_every
                    save_rank_state(
                        s.checkpoint_dir,
                        self._step,
                        self.rank,
                        self.checkpoint_state(),
                        self.topology,
                        s.checkpoint_keep,
                    )
                if s.callbacks:
                    view = self.view(self._step, loss)
                    for callback in s.callbacks:
                        callback.on_step_end(view)
        return self._finish_fast()

    def _record_step(self, seconds: float, tokens: int, loss: float | None, logging: bool) -> None:
        s = self.settings
        self.result.step_seconds.append(seconds)
        self.result.steps += 1
        self.result.tokens += tokens
        if loss is None:
            return
        self.result.losses.append(loss)
        if self._step_metrics:
            self.result.step_metrics.append(self._step_metrics)
        if logging and s.log is not None and self._step % s.log_every == 0:
            lr = self.optimizer.param_groups[0]["lr"]
            fast, done = len(self.topology.fast_replicas), self.result.tokens - self._tokens_at_start
            rates = step_rates(self.wire.moved() - self._bytes_at_start, done, tokens, fast, seconds)
            s.log({"step": self._step, "loss": loss, "lr": lr, "step_seconds": seconds, **rates, **self._step_metrics})

    def _finish_fast(self) -> MeshResult:
        if self.anchor is not None:
            self.anchor.close(self._step)
            self._step = self.settings.max_steps
            self.anchor.drain(self.optimizer, self._step, final=True)
            self.result.arrivals = self.anchor.arrivals
            self.result.anchor_lost_at = self.anchor.lost_at
            self.result.anchor_syncs = self.anchor.syncs
        if self.geometry is not None:
            self.geometry.close()
            self.result.geometry = self.geometry.switches
        if self.levels is not None:
            self.levels.close()
            self.result.levels = self.levels.switches
        result = self._finish(self._step)
        if self.manager is not None:
            self.manager.shutdown(wait=False)
        return result

    def _global_parameters(self) -> list[torch.Tensor]:
        if self.manager is None:  # per-step sync: the replicas' parameters are the global ones
            return super()._global_parameters()
        return [flatten(self._streaming.global_parameters(i)) for i in range(len(self.fragments))]
