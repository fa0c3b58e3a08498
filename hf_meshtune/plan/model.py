"""Predict one fast step of a mesh before renting it: compute per stage, the schedule on the links, DiLoCo.

``predict_step(config, shape, placement)`` is a model, labelled so everywhere it is printed: per-stage
work from ``plan.flops`` at each host's declared speed (TFLOP/s it sustains on this work), the boundary
messages' bytes from the byte ledger (per real token and boundary, the codec's records over its coding
ratio), the 1F1B schedule on the links (``plan.schedule``), and the Streaming DiLoCo sync's ring
all-reduce on each rank's link, hidden behind ``dp_sync_delay`` steps of compute where it fits. Not
modelled: the optimizer step and other per-step work outside the schedule, the anchor replica (not in the shape),
links shared by several of a host's processes (each boundary gets its link to itself).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from .._validation import require
from .flops import stage_flops
from .schedule import LinkSpec, StageCost, simulate_step

__all__ = ["Placement", "StepPrediction", "TrainingShape", "predict_step"]

MBIT = 1e6 / 8  # bytes per second in one Mbit/s


@dataclass(frozen=True)
class TrainingShape:
    """What one fast replica trains per step, and how."""

    num_replicas: int  # X (fast replicas: the anchor is not modelled)
    num_stages: int  # Y
    microbatch_size: int
    microbatches: int
    seq_len: int  # real tokens per row (what the wire carries)
    stage_layers: tuple[int, ...] | None = None
    lora: bool = False
    gradient_checkpointing: bool = False
    boundary_codec: str | None = "outliers8+int8+zstd"
    coding_ratio: float | tuple[float, float] | None = None
    activation_dtype: str = "bfloat16"
    dp_sync_every: int = 20
    dp_fragments: int = 1
    dp_sync_delay: int = 0
    dp_powersgd_rank: int | None = 4
    dp_quantize: str | None = "int8"

    @property
    def tokens_per_step(self) -> int:
        return self.microbatch_size * self.microbatches * self.seq_len


@dataclass(frozen=True)
class Placement:
    """Where replica 0's stages run: per stage its host's TFLOP/s; per boundary its link (None: local)."""

    stage_tflops: tuple[float, ...]
    links: tuple[tuple[float, float] | None, ...]  # per boundary: (Mbit/s, RTT ms), None on one host
    dp_link: tuple[float, float]  # each rank's link for the DiLoCo sync: (Mbit/s, RTT ms)
    local_gbytes_per_s: float = 2.0  # a local boundary's rate (gloo on the host's own address)

    @classmethod
    def uniform(cls, num_stages: int, tflops: float, rate_mbit: float, rtt_ms: float) -> Placement:
        """Every stage on a host of its own, every link alike."""
        link = (rate_mbit, rtt_ms)
        return cls((tflops,) * num_stages, (link,) * (num_stages - 1), link)


@dataclass
class StepPrediction:
    """A model's prediction of one fast step (not a measurement)."""

    step_s: float
    pipeline_s: float
    dp_s: float  # the DiLoCo sync's time per step that compute does not hide
    compute_s: list[float]  # per stage
    wait_s: list[float]  # per stage: the pipeline step minus its compute
    link_busy_s: list[tuple[float, float]]  # per boundary: forward, backward
    boundary_bytes: list[tuple[float, float]]  # per boundary and microbatch: forward, backward
    tokens_per_s: float  # all fast replicas
    bottleneck: str
    kind: str = field(default="model")

    def as_dict(self) -> dict:
        return asdict(self)


def predict_step(config, shape: TrainingShape, placement: Placement) -> StepPrediction:
    """One fast step of ``shape`` on ``placement`` (module docstring): a model's prediction."""
    y = shape.num_stages
    require(len(placement.stage_tflops) == y, "stage_tflops", placement.stage_tflops, f"give one speed per stage ({y})")
    require(len(placement.links) == y - 1, "links", placement.links, f"give one link per boundary ({y - 1})")
    for speed in placement.stage_tflops:
        require(speed > 0, "tflops", speed, "be > 0 (TFLOP/s a host sustains)")
    for link in [*placement.links, placement.dp_link]:
        if link is not None:
            require(link[0] > 0, "rate_mbit", link[0], "be > 0 (Mbit/s)")
            require(link[1] >= 0, "rtt_ms", link[1], "be >= 0 (the link's round trip)")
    flops = stage_flops(config, y, shape.seq_len, shape.stage_layers, lora=shape.lora,
                        checkpointing=shape.gradient_checkpointing)  # fmt: skip
    tokens = shape.microbatch_size * shape.seq_len  # per microbatch
    costs = [
        StageCost(f.forward * tokens / (t * 1e12), f.backward * tokens / (t * 1e12))
        for f, t in zip(flops, placement.stage_tflops)
    ]
    fwd, bwd, dp_bytes_per_rank = _bytes(config, shape)
    links = [
        LinkSpec(placement.local_gbytes_per_s * 1e9) if link is None else LinkSpec(link[0] * MBIT, link[1] / 2000)
        for link in placement.links
    ]
    result = simulate_step(costs, links, shape.microbatches, [fwd * tokens] * (y - 1), [bwd * tokens] * (y - 1))
    dp_rate, dp_rtt = placement.dp_link
    per_sync = dp_bytes_per_rank * shape.dp_sync_every / max(shape.dp_fragments, 1)  # one fragment's bytes
    sync_s = per_sync / (dp_rate * MBIT) + 2 * (shape.num_replicas - 1) * dp_rtt / 2000
    syncs_per_step = max(shape.dp_fragments, 1) / shape.dp_sync_every if shape.num_replicas > 1 else 0.0
    hidden = shape.dp_sync_delay * result.step_s
    dp_s = max(0.0, sync_s - hidden) * syncs_per_step
    step = result.step_s + dp_s
    busiest = max(range(y - 1), key=lambda b: sum(result.link_busy_s[b])) if y > 1 else None
    link_s = sum(result.link_busy_s[busiest]) if busiest is not None else 0.0
    top = max(range(y), key=lambda s: result.compute_s[s])
    candidates = {
        f"stage {top} compute": result.compute_s[top],
        **({f"boundary {busiest} link": link_s} if busiest is not None else {}),
        "DiLoCo sync": dp_s,
    }
    return StepPrediction(
        step_s=step,
        pipeline_s=result.step_s,
        dp_s=dp_s,
        compute_s=result.compute_s,
        wait_s=result.wait_s,
        link_busy_s=result.link_busy_s,
        boundary_bytes=[(fwd * tokens, bwd * tokens)] * (y - 1),
        tokens_per_s=shape.tokens_per_step * shape.num_replicas / step,
        bottleneck=max(candidates, key=lambda k: candidates[k]),
    )


def _bytes(config, shape: TrainingShape) -> tuple[float, float, float]:
    """(forward, backward) bytes per real token and boundary, and each rank's DiLoCo bytes per step."""
    from ..ledger import LedgerSettings, ledger_for_config

    settings = LedgerSettings(
        num_replicas=max(shape.num_replicas, 1),
        num_stages=shape.num_stages,
        mask_ratio=0.0,
        tokens_per_step=shape.tokens_per_step,
        activation_dtype=shape.activation_dtype,
        grad_dtype=shape.activation_dtype,
        param_dtype=shape.activation_dtype,
        sync_every=shape.dp_sync_every,
        powersgd_rank=shape.dp_powersgd_rank,
        anchor=False,
        boundary_codec=shape.boundary_codec,
        dp_quantize=shape.dp_quantize,
        coding_ratio=shape.coding_ratio,
    )
    ledger = ledger_for_config(config, settings)
    boundaries = max(shape.num_stages - 1, 1)
    ranks = shape.num_replicas * shape.num_stages
    dp_per_rank = ledger.dp * shape.tokens_per_step * shape.num_replicas / ranks  # bytes per step per rank
    return ledger.pp_fwd / boundaries, ledger.pp_bwd / boundaries, dp_per_rank
