"""The formulas (``docs/ledger.md``), circuit by circuit: the boundaries' payload, the DP ring all-reduce, the
anchor's pipeline, parameter refresh, delivery and codec refits; and the dense reference a ledger is
compared with. Shapes come from the real model, built on the meta device (no weights)."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch
import transformers

from ..boundary.compose.grammar import parse_codec
from ..boundary.masking import keep_count
from ..config import DP_QUANT_BLOCK
from .settings import DTYPE_BYTES, Ledger, LedgerSettings, _require_int

__all__ = [
    "anchor_payload_numel",
    "compute_ledger",
    "dense_reference",
    "dp_payload_numel",
    "ledger_for_config",
    "param_shapes_of",
]


def dp_payload_numel(shape: Sequence[int], rank: int | None) -> int:
    """Elements one replica contributes per DP sync for one parameter.

    PowerSGD rank r sends factors P [m, r] and Q [n, r] for a 2-D [m, n] parameter, r·(m+n), when
    that is smaller than m·n; anything else (no rank, 1-D params, tiny matrices) goes dense.
    """
    numel = math.prod(shape)
    if rank is None or len(shape) != 2:
        return numel
    return min(rank * (shape[0] + shape[1]), numel)


def anchor_payload_numel(shape: Sequence[int], payload: str, rank: int) -> int:
    """Elements the anchor delivers to one fast replica for one parameter per round.

    Only 2-D parameters get anchor gradients (the spectral optimizer filters matrices only). Payload
    "gradient": the full m·n gradient; "factors": U [m, k], s [k], V [n, k] = k·(m+n+1) with
    k = min(r, m, n), what ``optim.factors.AnchorMomentum`` sends (even where that exceeds m·n).
    """
    if len(shape) != 2:
        return 0
    m, n = shape
    if payload == "factors":
        return min(rank, m, n) * (m + n + 1)
    return m * n


def _anchor_bytes_per_token(
    shapes: Sequence[tuple[int, ...]], hidden_size: int, s: LedgerSettings, dp_payload: int
) -> float:
    """(i) anchor's dense pipeline + (ii) keeping its params current + (iii) gradient delivery."""
    fast, T = s.fast_replicas, s.tokens_per_step
    round_tokens = fast * T * s.anchor_every  # fast tokens processed per anchor round
    pipeline = s.anchor_tokens * 2 * (s.num_stages - 1) * hidden_size * DTYPE_BYTES[s.activation_dtype]
    if s.dp_compressed:  # it applies the reduced outer update: P·b_dp once per sync, coded as the ring's
        params = dp_payload * _dp_value_bytes(s) / (fast * T * s.sync_every)
    else:  # it pulls a full snapshot of the trainable params every round
        params = sum(math.prod(sh) for sh in shapes) * DTYPE_BYTES[s.param_dtype] / round_tokens
    per_replica = sum(anchor_payload_numel(sh, s.anchor_payload, s.anchor_rank) for sh in shapes)
    delivery = fast * per_replica * DTYPE_BYTES[s.grad_dtype]
    return pipeline / round_tokens + params + delivery / round_tokens + _refit_bytes_per_token(hidden_size, s)


def _refit_bytes_per_token(hidden_size: int, s: LedgerSettings) -> float:
    """Codec refits (``codec_refit_every``): every refit round, boundary b's geometry (float32) goes to
    stages b and b+1 of every fast replica; after every fast step each replica's Y stages agree on
    the geometry in use with a ring all-reduce of one int64 (2·(Y-1)·8 bytes per replica)."""
    if not s.codec_refit_every or s.boundary_codec is None or s.num_stages < 2:
        return 0.0
    spec = parse_codec(s.boundary_codec)
    if not spec.needs_fit:
        return 0.0
    fast, T = s.fast_replicas, s.tokens_per_step
    geometry = (s.num_stages - 1) * 2 * fast * spec.geometry_numel(hidden_size) * 4
    agree = 2 * (s.num_stages - 1) * 8 / T
    return geometry / (fast * T * s.anchor_every * s.codec_refit_every) + agree


def _circuits(
    shapes: Sequence[tuple[int, ...]], hidden_size: int, s: LedgerSettings
) -> tuple[float, float, float, float, int]:
    value_bytes = DTYPE_BYTES[s.activation_dtype]
    if s.boundary_codec is not None:  # each direction's records (the wire sends them unpadded), over the coder
        spec = parse_codec(s.boundary_codec)
        keep = max(spec.payload_bytes(hidden_size, value_bytes, d) for d in ("fwd", "bwd")) // value_bytes
        ratios = s.coding_ratios if spec.entropy is not None else (1.0, 1.0)
        fwd, bwd = (spec.side(d).message_bytes(hidden_size, value_bytes) / r for d, r in zip(("fwd", "bwd"), ratios))
    else:
        keep = keep_count(hidden_size, s.mask_ratio)  # the wire's own K; raises naming mask_ratio if 0
        fwd = bwd = keep * value_bytes
    boundaries = s.num_stages - 1
    fast = s.fast_replicas
    payload = sum(dp_payload_numel(sh, s.powersgd_rank) for sh in shapes)
    # Ring all-reduce: each of X_f replicas sends 2·(X_f-1)/X_f of the payload, 2·(X_f-1)·P in all.
    dp = 2 * (fast - 1) * payload * _dp_value_bytes(s) / (fast * s.tokens_per_step * s.sync_every)
    anchor = _anchor_bytes_per_token(shapes, hidden_size, s, payload) if s.anchor else 0.0
    return float(boundaries * fwd), float(boundaries * bwd), float(dp), float(anchor), keep


def _dp_value_bytes(s: LedgerSettings) -> float:
    """Bytes per value of a DP all-reduce (PowerSGD's factors and the tensors that go dense alike):
    ``grad_dtype``'s, or with ``dp_quantize="int8"`` a byte plus a float32 maximum per ``DP_QUANT_BLOCK``
    values (the padding of each all-reduce to whole blocks is not counted: < 260 B a round). The anchor
    is forwarded each sync in the same codes (plus 4 bytes, the count of replicas, not counted either)."""
    return DTYPE_BYTES[s.grad_dtype] if s.dp_quantize is None else 1 + 4 / DP_QUANT_BLOCK


def dense_reference(settings: LedgerSettings) -> LedgerSettings:
    """The baseline a ledger is compared with: the same X × Y mesh trained densely.

    p = 0, no anchor, S = 1, no PowerSGD, and the same global batch: the X_f·T tokens a fast step
    processes are spread over all X replicas (T_ref = round(X_f·T / X)), as in the paper's Dense
    column (8 dense replicas vs 7 fast + 1 anchor, both at batch 32).
    """
    tokens = max(1, round(settings.fast_replicas * settings.tokens_per_step / settings.num_replicas))
    return dataclasses.replace(
        settings,
        mask_ratio=0.0,
        boundary_codec=None,
        anchor=False,
        sync_every=1,
        powersgd_rank=None,
        dp_quantize=None,
        tokens_per_step=tokens,
    )


def compute_ledger(param_shapes: Sequence[tuple[int, ...]], hidden_size: int, settings: LedgerSettings) -> Ledger:
    """Bytes per fast token by circuit for trainable params of ``param_shapes`` and hidden_size (H).

    Raises ``ValueError`` naming ``mask_ratio`` when K = round((1-p)·H) would be 0.
    """
    _require_int("hidden_size", hidden_size, 1)
    shapes = [tuple(int(d) for d in shape) for shape in param_shapes]
    pp_fwd, pp_bwd, dp, anchor, keep = _circuits(shapes, hidden_size, settings)
    dense_total = sum(_circuits(shapes, hidden_size, dense_reference(settings))[:4])
    return Ledger(pp_fwd, pp_bwd, dp, anchor, keep, hidden_size, settings, dense_total)


def param_shapes_of(model: torch.nn.Module, trainable_only: bool = True) -> list[tuple[int, ...]]:
    """Shapes of the model's parameters (only ``requires_grad`` ones by default); tied params once."""
    return [tuple(p.shape) for p in model.parameters() if p.requires_grad or not trainable_only]


def ledger_for_config(config: transformers.PretrainedConfig, settings: LedgerSettings) -> Ledger:
    """Ledger of the causal LM that ``config`` describes, built on the meta device (no weights)."""
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    hidden_size = config.get_text_config().hidden_size
    return compute_ledger(param_shapes_of(model), hidden_size, settings)
