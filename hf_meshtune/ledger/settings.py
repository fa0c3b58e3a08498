"""What the ledger is told and what it says: ``LedgerSettings`` (mesh, masking, DP sync and anchor, validated;
``settings_from_knobs`` maps the mesh knobs onto it) and ``Ledger`` (bytes per fast token by circuit)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from .._validation import require
from ..boundary.compose.grammar import parse_codec
from ..comm.wire import CIRCUITS
from ..config import ANCHOR_PAYLOADS, DP_QUANTIZERS, codec_refit_every, composed_codec

__all__ = ["DTYPE_BYTES", "Ledger", "LedgerSettings", "measured_ratios", "settings_from_knobs"]

DTYPE_BYTES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "fp32": 4,
    "float16": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
}
"""Bytes per element of every dtype name the ledger accepts (torch names plus short aliases)."""


def _require_int(field: str, value: Any, minimum: int, rule: str | None = None) -> None:
    ok = isinstance(value, int) and not isinstance(value, bool) and value >= minimum
    require(ok, field, value, rule or f"be an integer >= {minimum}")


@dataclass(frozen=True)
class LedgerSettings:
    """Everything the ledger needs besides the model: mesh, masking, DP sync and anchor knobs.

    Paper symbols beside the code names: ``num_replicas`` (X, counts the anchor replica when
    ``anchor``), ``num_stages`` (Y), ``mask_ratio`` (p), ``tokens_per_step`` (T, tokens per fast
    replica per optimizer step), ``sync_every`` (S, DiLoCo outer period), ``powersgd_rank`` (r),
    ``anchor_every`` (A, fast steps per anchor round), ``anchor_rank`` (rank of the anchor's
    factors), ``anchor_tokens_per_round`` (T_anc, defaults to T). ``grad_dtype`` sizes DP payloads
    and anchor gradients (b_dp, b_grad); ``param_dtype`` (b_param) sizes the parameter snapshot the
    anchor pulls when DP is a plain all-reduce. Invalid values raise ``ValueError`` naming the field.
    """

    num_replicas: int = 8
    num_stages: int = 4
    mask_ratio: float = 0.95
    tokens_per_step: int = 32 * 2048 // 7
    activation_dtype: str = "bfloat16"
    grad_dtype: str = "bfloat16"
    sync_every: int = 1
    powersgd_rank: int | None = None
    anchor: bool = True
    anchor_every: int = 20
    anchor_payload: str = "gradient"
    anchor_rank: int = 8
    anchor_tokens_per_round: int | None = None
    param_dtype: str = "bfloat16"  # after the fields above, so positional construction of them still works
    boundary_codec: str | None = None  # a composed codec (compose.spec) instead of the mask p
    codec_refit_every: int = 0  # anchor rounds between refits of the codec's geometry (0: never)
    dp_quantize: str | None = None  # "int8": every DP all-reduce as int8 codes + a float32 max per block
    # bytes before / after the codec's lossless coder (+zstd), one for both directions or (forward, backward):
    # measured (a run's mesh_summary, benchmarks/wire); None books a coded codec's records uncoded, and the
    # ledger says so (``LedgerSettings.coding``)
    coding_ratio: float | tuple[float, float] | None = None

    def __post_init__(self) -> None:
        _require_int("num_replicas", self.num_replicas, 1)
        if self.anchor:
            _require_int("num_replicas", self.num_replicas, 2, "be >= 2 when anchor=True (replica X-1 is the anchor)")
        _require_int("num_stages", self.num_stages, 1)
        p = self.mask_ratio
        require(
            isinstance(p, (int, float)) and not isinstance(p, bool) and 0.0 <= p < 1.0, "mask_ratio", p, "lie in [0, 1)"
        )
        _require_int("tokens_per_step", self.tokens_per_step, 1)
        for field in ("activation_dtype", "grad_dtype", "param_dtype"):
            value = getattr(self, field)
            require(value in DTYPE_BYTES, field, value, f"be one of {sorted(DTYPE_BYTES)}")
        _require_int("sync_every", self.sync_every, 1)
        if self.powersgd_rank is not None:
            _require_int("powersgd_rank", self.powersgd_rank, 1, "be None or an integer >= 1")
        require(isinstance(self.anchor, bool), "anchor", self.anchor, "be True or False")
        _require_int("anchor_every", self.anchor_every, 1)
        require(
            self.anchor_payload in ANCHOR_PAYLOADS,
            "anchor_payload",
            self.anchor_payload,
            f"be one of {list(ANCHOR_PAYLOADS)}",
        )
        _require_int("anchor_rank", self.anchor_rank, 1)
        if self.anchor_tokens_per_round is not None:
            _require_int("anchor_tokens_per_round", self.anchor_tokens_per_round, 1, "be None or an integer >= 1")
        _require_int("codec_refit_every", self.codec_refit_every, 0)
        require(
            self.dp_quantize in (None, *DP_QUANTIZERS),
            "dp_quantize",
            self.dp_quantize,
            f"be None or one of {list(DP_QUANTIZERS)}",
        )
        if self.boundary_codec is not None:
            require(
                not parse_codec(self.boundary_codec).is_mask,
                "boundary_codec",
                self.boundary_codec,
                "be a composed codec (a mask is mask_ratio)",
            )
        if self.coding_ratio is not None:
            ratio = self.coding_ratio
            values = list(ratio) if isinstance(ratio, (tuple, list)) else [ratio]
            require(
                len(values) in (1, 2)
                and all(
                    isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0
                    for v in values
                ),
                "coding_ratio",
                ratio,
                "be None, a finite number > 0 or a (forward, backward) pair of them (bytes before the coder / "
                "bytes after, as a run measured them)",
            )

    @property
    def coding_ratios(self) -> tuple[float, float]:
        """(forward, backward) ratio the ledger divides a coded codec's records by (1, 1 without one)."""
        ratio = self.coding_ratio
        if ratio is None:
            return 1.0, 1.0
        if isinstance(ratio, (tuple, list)):
            return float(ratio[0]), float(ratio[1])
        return float(ratio), float(ratio)

    @property
    def coding(self) -> str:
        """How the ledger books the boundary's lossless coder: "none" (the codec has no coder), "measured
        ratio R" (``coding_ratio``), or "not counted" (a coder without a measured ratio: records uncoded)."""
        coder = parse_codec(self.boundary_codec).entropy if self.boundary_codec is not None else None
        if coder is None:
            return "none"
        if self.coding_ratio is None:
            return "not counted"
        forward, backward = self.coding_ratios
        return f"{coder} at measured ratios {forward:.3f} (forward), {backward:.3f} (backward)"

    @property
    def fast_replicas(self) -> int:
        """X_f: replicas in the fast circuit (X-1 with the anchor, X without)."""
        return self.num_replicas - 1 if self.anchor else self.num_replicas

    @property
    def dp_compressed(self) -> bool:
        """True in DiLoCo/PowerSGD mode; False for a plain dense all-reduce every step (S=1, no r)."""
        return self.sync_every > 1 or self.powersgd_rank is not None

    @property
    def anchor_tokens(self) -> int:
        """T_anc: tokens the anchor processes per round (``anchor_tokens_per_round`` or T)."""
        return self.anchor_tokens_per_round or self.tokens_per_step


@dataclass(frozen=True)
class Ledger:
    """Bytes per fast-circuit training token, by circuit, summed over every link of the mesh.

    ``keep`` is K (kept dims per token per boundary), ``hidden_size`` is H. ``dense_total`` is the
    total of ``dense_reference(settings)`` (same mesh and global batch, p = 0, no anchor, S = 1, no
    PowerSGD) when ``compute_ledger`` built the ledger; ``compression`` = dense_total / total.
    """

    pp_fwd: float
    pp_bwd: float
    dp: float
    anchor: float
    keep: int
    hidden_size: int
    settings: LedgerSettings
    dense_total: float | None = None

    @property
    def total(self) -> float:
        """Sum of the four circuits, bytes per token."""
        return self.pp_fwd + self.pp_bwd + self.dp + self.anchor

    @property
    def compression(self) -> float | None:
        """How many times fewer bytes per token than the dense reference (None if unknown)."""
        if self.dense_total is None:
            return None
        return self.dense_total / self.total if self.total > 0 else math.inf

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready dict: ``<circuit>_bytes_per_token`` keys, total, compression, K, H, settings."""
        return {
            **{f"{name}_bytes_per_token": getattr(self, name) for name in CIRCUITS},
            "total_bytes_per_token": self.total,
            "compression_vs_dense": self.compression,
            "keep": self.keep,
            "hidden_size": self.hidden_size,
            "boundary_coding": self.settings.coding,
            "settings": dataclasses.asdict(self.settings),
        }

    def log_dict(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat float metrics with unit-bearing keys, e.g. ``comm/pp_fwd_bytes_per_token``."""
        out = {f"{prefix}{name}_bytes_per_token": float(getattr(self, name)) for name in CIRCUITS}
        out[f"{prefix}total_bytes_per_token"] = float(self.total)
        if self.compression is not None:
            out[f"{prefix}compression_vs_dense_ratio"] = float(self.compression)
        return out


def measured_ratios(fwd_before: float, fwd_after: float, bwd_before: float, bwd_after: float) -> tuple[float, float]:
    """(forward, backward) coding ratios from bytes measured before and after a coder; a direction that carried
    nothing takes the other's (what both carried, where neither did: 1)."""
    both = (fwd_before + bwd_before) / (fwd_after + bwd_after) if fwd_after + bwd_after else 1.0
    forward = fwd_before / fwd_after if fwd_after else both
    backward = bwd_before / bwd_after if bwd_after else both
    return forward, backward


def settings_from_knobs(knobs: Any, *, dtype: str, tokens_per_step: int, **overrides: Any) -> LedgerSettings:
    """The ledger's settings for the mesh the knobs (``config.MeshArguments``) describe, at
    ``tokens_per_step`` tokens per fast replica step in ``dtype``; ``overrides`` replace fields (a mesh
    run puts its real shape and anchor pace there). The one mapping from knobs to ledger settings."""
    codec = composed_codec(knobs)
    fields = {
        "num_replicas": knobs.num_replicas,
        "num_stages": knobs.num_stages,
        "mask_ratio": knobs.mask_ratio,
        # governed: the ladder's richest level, the most a boundary costs (what it sent is measured)
        "boundary_codec": None if codec is None else codec.text,
        "codec_refit_every": codec_refit_every(knobs),
        "tokens_per_step": tokens_per_step,
        "activation_dtype": dtype,
        "grad_dtype": dtype,
        "param_dtype": dtype,
        "sync_every": knobs.dp_sync_every,
        "powersgd_rank": knobs.dp_powersgd_rank,
        "dp_quantize": knobs.dp_quantize,
        "anchor": knobs.anchor,
        "anchor_every": knobs.anchor_every,
        "anchor_payload": knobs.anchor_payload,
        "anchor_rank": knobs.spectral_rank or 8,
    }
    return LedgerSettings(**{**fields, **overrides})
