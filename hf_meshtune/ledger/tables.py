"""What to run the ledger on and how to show it: offline model configs by name (``PRESETS``), the paper's
table columns (``STANDARD_ROWS``) with the totals it reports, and the Markdown table of ledgers."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import transformers

from .._validation import require
from ..comm.wire import CIRCUITS
from .settings import Ledger, LedgerSettings, _require_int

__all__ = [
    "PAPER_BYTES_PER_TOKEN",
    "PAPER_POWERSGD_RANK",
    "PAPER_SYNC_EVERY",
    "PRESETS",
    "STANDARD_ROWS",
    "format_table",
    "settings_for_row",
]

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
