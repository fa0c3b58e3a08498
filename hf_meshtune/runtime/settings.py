"""What a mesh process runs with besides its model and data (``RunSettings``), and what it lets a caller see.

``RunSettings`` validates its own fields; the mesh knobs (``config.MeshConfig``) and the rules of
what the distributed mesh does not run yet are in ``config``. ``StageCallback`` is how a caller
(a benchmark, a test, a user's own script) watches a process's steps without reaching into it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .._validation import require
from ..config import MeshConfig, require_mesh_supported
from ..dp.baselines import DP_MODES

__all__ = ["Batches", "RunSettings", "StageCallback", "StageView"]

# step → (input ids, target) of a replica's step. Every stage of the replica calls it at the same point of
# the step, so it may itself talk to the other stages (RL's rollouts do); one with ``bind(worker)`` is given
# the stage's worker first, and one with ``pop_metrics()`` adds its metrics to the last stage's step log
Batches = Callable[[int], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class StageView:
    """A read-only look at one mesh process, given to ``StageCallback`` hooks.

    ``step`` is the number of fast steps done; ``loss`` the last step's mean microbatch loss (last
    stage only); ``parameters()`` the stage's parameters by their names in the full model (detached
    clones); ``global_parameters()`` θ_global of every DiLoCo fragment, flattened (fast: DiLoCo's,
    anchor: the one it follows; the replicas' own parameters with a per-step DP peer).
    """

    rank: int
    replica: int
    stage: int
    role: str
    step: int
    loss: float | None
    parameters: Callable[[], dict[str, torch.Tensor]]
    global_parameters: Callable[[], list[torch.Tensor]]


class StageCallback:
    """Hooks into a mesh process's run (``RunSettings.callbacks``): subclass and override what you need."""

    def on_step_end(self, view: StageView) -> None:
        """Fast ranks, after every optimizer step (and its DiLoCo sync, if one landed)."""

    def on_train_end(self, view: StageView) -> None:
        """Every rank, after its last step, before the results are gathered."""


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
    # seconds a DP quorum or all-reduce waits for the other replicas; None = the config's dp_timeout_s
    dp_timeout_s: float | None = None
    log: Callable[[dict], None] | None = None  # called on the logging rank with per-step metrics
    log_every: int = 1
    # DP sync of the fast replicas: Streaming DiLoCo (+ PowerSGD per config), or a per-step peer
    # (``dp.baselines``: "allreduce" = plain DDP averaging, "powersgd_hook" = torch's PowerSGD hook)
    dp_mode: str = "streaming_diloco"
    # seconds a pipeline send/receive may wait (the PP groups' timeout, given to build_groups by the
    # caller); a step past it fails naming the neighbours; None = the process group's default
    link_timeout_s: float | None = None
    callbacks: Sequence[StageCallback] = ()  # what the caller wants to see of every step and the end
    # mesh checkpoints (``runtime.checkpoint``): every fast rank writes its state to
    # checkpoint_dir/checkpoint-N/mesh/ after every checkpoint_every-th step, keeping checkpoint_keep
    # complete ones (None = all); resume_from = a checkpoint-N folder to continue from
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = None
    checkpoint_keep: int | None = None
    resume_from: str | None = None
    # the last stage's loss of a step of ``microbatches``: (model, microbatches) → loss(output, target);
    # None = the causal LM loss on labels. RL gives ``rl.loss.PolicyLoss`` (its target is the packed rollouts)
    loss: Callable[[object, int], Callable] | None = None

    def __post_init__(self) -> None:
        for name in ("microbatch_size", "microbatches", "seq_len", "max_steps", "log_every"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, value, "be an int >= 1")
        require_mesh_supported(self.config)
        if self.dp_timeout_s is None:
            self.dp_timeout_s = self.config.dp_timeout_s
        require(self.dp_timeout_s > 0, "dp_timeout_s", self.dp_timeout_s, "be > 0 (seconds)")
        require(self.dp_mode in DP_MODES, "dp_mode", self.dp_mode, f"be one of {list(DP_MODES)}")
        require(
            self.dp_mode == "streaming_diloco" or not self.config.anchor,
            "dp_mode",
            self.dp_mode,
            "be 'streaming_diloco' when anchor=True (the anchor replica follows θ by replaying DiLoCo's outer updates)",
        )
        every = self.checkpoint_every
        require(
            every is None or (isinstance(every, int) and every >= 1),
            "checkpoint_every",
            every,
            "be None or an int >= 1",
        )
        require(
            every is None or self.checkpoint_dir is not None,
            "checkpoint_dir",
            self.checkpoint_dir,
            "be set when checkpoint_every is (the folder the checkpoint-N folders go to)",
        )
        keep = self.checkpoint_keep
        require(
            keep is None or (isinstance(keep, int) and keep >= 1), "checkpoint_keep", keep, "be None or an int >= 1"
        )
        if every is not None or self.resume_from is not None:
            require(
                self.dp_mode != "powersgd_hook",
                "dp_mode",
                self.dp_mode,
                "be 'streaming_diloco' or 'allreduce' with mesh checkpoints (torch's PowerSGD hook state is not saved)",
            )
        require(
            self.resume_from is None or self.config.anchor_payload != "factors" or not self.config.anchor,
            "anchor_payload",
            self.config.anchor_payload,
            "be 'gradient' to resume a mesh run with the anchor (with 'factors' the anchor replica holds M_anc, "
            "and anchor processes write no checkpoint: the resumed run would not continue exactly)",
        )
        period = self.config.dp_sync_every // self.config.dp_fragments
        require(
            every is None or self.dp_mode != "streaming_diloco" or every % period == 0,
            "checkpoint_every",
            every,
            f"be a multiple of dp_sync_every / dp_fragments = {period} (a checkpoint is taken between DiLoCo syncs)",
        )
