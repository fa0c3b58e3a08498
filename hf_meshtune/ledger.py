"""Analytic byte ledger: bytes per fast-circuit token, by circuit, summed over every link of the mesh.

The mesh is ``num_replicas`` (X) data-parallel replicas × ``num_stages`` (Y) pipeline stages. With the
anchor on, replica X-1 is the dense anchor and X_f = X-1 replicas form the fast circuit (X_f = X
without it). Four circuits carry bytes:

* ``pp_fwd`` / ``pp_bwd``: the masked stage boundaries. A fast token crosses Y-1 boundaries, carrying
  only its K = round((1-p)·H) kept values each way; the keep-set is a shared-seed function, so no
  index travels.
* ``dp``: the fast replicas' data-parallel sync (ring all-reduce; DiLoCo period S, PowerSGD rank r).
* ``anchor``: the anchor's own dense pipeline, keeping its parameters current, and delivering its
  gradient (or low-rank factors) to every fast replica.

Everything is derived from real parameter shapes and dtype sizes; no weights are allocated
(``ledger_for_config`` builds the model on the meta device). ``docs/ledger.md`` states the formulas.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import transformers

from ._validation import require
from .boundary.compose.spec import parse_codec
from .boundary.masking import keep_count
from .comm.wire import CIRCUITS
from .config import ANCHOR_PAYLOADS, DP_QUANT_BLOCK, DP_QUANTIZERS, codec_refit_every, composed_codec

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
            "settings": dataclasses.asdict(self.settings),
        }

    def log_dict(self, prefix: str = "comm/") -> dict[str, float]:
        """Flat float metrics with unit-bearing keys, e.g. ``comm/pp_fwd_bytes_per_token``."""
        out = {f"{prefix}{name}_bytes_per_token": float(getattr(self, name)) for name in CIRCUITS}
        out[f"{prefix}total_bytes_per_token"] = float(self.total)
        if self.compression is not None:
            out[f"{prefix}compression_vs_dense_ratio"] = float(self.compression)
        return out


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
    if s.boundary_codec is not None:  # the codec's message, padded to whole values: K = its width
        keep = parse_codec(s.boundary_codec).payload_bytes(hidden_size, value_bytes) // value_bytes
    else:
        keep = keep_count(hidden_size, s.mask_ratio)  # the wire's own K; raises naming mask_ratio if 0
    boundary = (s.num_stages - 1) * keep * value_bytes
    fast = s.fast_replicas
    payload = sum(dp_payload_numel(sh, s.powersgd_rank) for sh in shapes)
    # Ring all-reduce: each of X_f replicas sends 2·(X_f-1)/X_f of the payload, 2·(X_f-1)·P in all.
    dp = 2 * (fast - 1) * payload * _dp_value_bytes(s) / (fast * s.tokens_per_step * s.sync_every)
    anchor = _anchor_bytes_per_token(shapes, hidden_size, s, payload) if s.anchor else 0.0
    return float(boundary), float(boundary), float(dp), float(anchor), keep


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


def settings_from_knobs(knobs: Any, *, dtype: str, tokens_per_step: int, **overrides: Any) -> LedgerSettings:
    """The ledger's settings for the mesh the knobs (``config.MeshArguments``) describe, at
    ``tokens_per_step`` tokens per fast replica step in ``dtype``; ``overrides`` replace fields (a mesh
    run puts its real shape and anchor pace there). The one mapping from knobs to ledger settings."""
    fields = {
        "num_replicas": knobs.num_replicas,
        "num_stages": knobs.num_stages,
        "mask_ratio": knobs.mask_ratio,
        # governed: the ladder's richest level, the most a boundary costs (what it sent is measured)
        "boundary_codec": None if composed_codec(knobs) is None else composed_codec(knobs).text,
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


PRESETS: dict[str, transformers.PretrainedConfig] = {
    "llama-3.2-1b": transformers.LlamaConfig(
        hidden_size=2048,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        intermediate_size=8192,
        vocab_size=128256,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 32.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "smollm2-135m": transformers.LlamaConfig(
        hidden_size=576,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        intermediate_size=1536,
        vocab_size=49152,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        max_position_embeddings=8192,
        rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
    ),
}
"""Offline model configs (shapes only; no weights) by name."""

PAPER_SYNC_EVERY = 20
"""DiLoCo outer period S used by the DP-compressed standard rows unless the caller overrides it."""
PAPER_POWERSGD_RANK = 4
"""PowerSGD rank r used by the DP-compressed standard rows unless the caller overrides it."""

_DILOCO = {"sync_every": PAPER_SYNC_EVERY, "powersgd_rank": PAPER_POWERSGD_RANK}
STANDARD_ROWS: dict[str, dict[str, Any]] = {
    "Dense": {"mask_ratio": 0.0, "anchor": False, "sync_every": 1, "powersgd_rank": None, "dp_quantize": None},
    "+DP": {"mask_ratio": 0.0, "anchor": False, **_DILOCO},
    "M95": {"mask_ratio": 0.95, "anchor": False, **_DILOCO},
    "M90+AP": {"mask_ratio": 0.90, "anchor": True, **_DILOCO},
    "M95+AP": {"mask_ratio": 0.95, "anchor": True, **_DILOCO},
}
"""The paper's table columns as ``LedgerSettings`` overrides (mask_ratio (p), anchor, S, r)."""

PAPER_BYTES_PER_TOKEN: dict[str, float] = {
    "Dense": 22_900,
    "+DP": 6_900,
    "M95": 370,
    "M90+AP": 790,
    "M95+AP": 446,
}
"""Bytes/token the paper reports for Llama-3.2-1B, 8 nodes (7 fast + 1 anchor), batch 32 × 2k."""


def settings_for_row(row: str, *, global_batch: int = 32, seq_len: int = 2048, **knobs: Any) -> LedgerSettings:
    """``LedgerSettings`` for a ``STANDARD_ROWS`` entry on a mesh given by ``knobs``.

    ``knobs`` are ``LedgerSettings`` fields (mesh, dtypes, anchor knobs, and the ``sync_every`` /
    ``powersgd_rank`` that DP-compressed rows use). T = global_batch · seq_len / X_f, so every row
    trains on the same global batch whatever its X_f.
    """
    require(row in STANDARD_ROWS, "rows", row, f"be one of {list(STANDARD_ROWS)}")
    _require_int("global_batch", global_batch, 1)
    _require_int("seq_len", seq_len, 1)
    overrides = dict(STANDARD_ROWS[row])
    for key in ("mask_ratio", "anchor"):  # what defines the row; silently overriding it would mislead
        require(
            key not in knobs,
            key,
            knobs.get(key),
            f"be left to the row {row!r}; change it with dataclasses.replace on the result",
        )
    if overrides["sync_every"] > 1 or overrides["powersgd_rank"] is not None:
        for key in ("sync_every", "powersgd_rank"):
            if key in knobs:
                overrides.pop(key)
    merged = {**knobs, **overrides}
    num_replicas = merged.get("num_replicas", LedgerSettings.num_replicas)
    fast = num_replicas - 1 if merged["anchor"] else num_replicas
    tokens = global_batch * seq_len // max(fast, 1)  # X_f < 1 is reported by LedgerSettings
    return LedgerSettings(**merged, tokens_per_step=tokens)


def _fmt(value: float) -> str:
    return f"{value:,.1f}"


def format_table(ledgers: Mapping[str, Ledger], reference: Mapping[str, float] | None = None) -> str:
    """Markdown table: one row per config, bytes/token per circuit, total, ratio vs the first row.

    ``reference`` (e.g. ``PAPER_BYTES_PER_TOKEN``) adds a column of externally reported totals.
    """
    require(len(ledgers) > 0, "ledgers", dict(ledgers), "hold at least one ledger")
    first_name, first = next(iter(ledgers.items()))
    header = ["config", "K/H", "pp_fwd", "pp_bwd", "dp", "anchor", "total (B/token)", f"vs {first_name}"]
    if reference is not None:
        header.append("paper (B/token)")
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join(["---"] + ["---:"] * (len(header) - 1)) + "|"]
    for name, led in ledgers.items():
        ratio = first.total / led.total if led.total > 0 else math.inf
        cells = [
            name,
            f"{led.keep}/{led.hidden_size}",
            *(_fmt(getattr(led, c)) for c in CIRCUITS),
            _fmt(led.total),
            f"{ratio:,.2f}×",
        ]
        if reference is not None:
            cells.append(_fmt(reference[name]) if name in reference else "—")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)
