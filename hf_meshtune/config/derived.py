"""What several knobs mean together, read by the rest of the library and by the rules: the composed
codec a boundary runs, the governed ladder, how often the codec's geometry is refitted, and the adaptive
cadence's bounds. Each takes any object with the knobs as attributes (a ``MeshArguments``, a TRL config)."""

from __future__ import annotations

from .._validation import require
from ..boundary.compose.grammar import parse_codec
from ..boundary.compose.spec import CodecSpec
from .presets import GOVERNED, GOVERNED_LADDER

__all__ = [
    "cadence_bounds",
    "codec_ladder",
    "codec_refit_every",
    "composed_codec",
    "is_governed",
    "require_ladder_order",
]


def composed_codec(cfg) -> CodecSpec | None:
    """The composed codec the knobs name (``boundary_codec`` other than a mask spec), else None. Governed:
    the ladder's richest level (what a boundary can cost at most)."""
    text = getattr(cfg, "boundary_codec", None)
    if text is None:
        return None
    if text == GOVERNED:
        return codec_ladder(cfg)[-1]
    spec = parse_codec(text)
    return None if spec.is_mask else spec


def is_governed(cfg) -> bool:
    """Whether the fidelity governor picks each boundary's codec (``boundary_codec="governed"``)."""
    return getattr(cfg, "boundary_codec", None) == GOVERNED


def codec_ladder(cfg) -> list[CodecSpec]:
    """The governed ladder's levels, cheapest first (``codec_ladder`` or ``GOVERNED_LADDER``)."""
    text = getattr(cfg, "codec_ladder", None) or GOVERNED_LADDER
    require(isinstance(text, str), "codec_ladder", text, "be a comma-separated string of composed codecs")
    levels = [part.strip() for part in text.split(",")]
    specs = []
    for level in levels:
        require(bool(level), "codec_ladder", text, "name a codec between every two commas")
        try:
            spec = parse_codec(level)
        except ValueError as err:
            raise ValueError(
                f"codec_ladder={text!r} is invalid: it must hold valid codecs (level {level!r}: {err})"
            ) from err
        require(not spec.is_mask, "codec_ladder", text, f"hold composed codecs only ({level!r} is a mask)")
        specs.append(spec)
    require(len(specs) >= 2, "codec_ladder", text, "name at least two levels for the governor to choose from")
    require(len(set(levels)) == len(levels), "codec_ladder", text, "name every level once")
    return specs


def require_ladder_order(cfg, hidden_size: int) -> None:
    """The governed ladder must get dearer level by level at this model's width: bf16 bytes per token of both
    messages before any lossless coder (a coder's ratio is known only once a run measured it)."""
    ladder = codec_ladder(cfg)
    sizes = [spec.round_trip_bytes(hidden_size, 2) for spec in ladder]
    require(
        all(a < b for a, b in zip(sizes, sizes[1:])),
        "codec_ladder",
        cfg.codec_ladder or GOVERNED_LADDER,
        f"list levels cheapest first, each dearer than the one before (bf16 bytes per token forward + backward at "
        f"H={hidden_size}: {sizes})",
    )


def codec_refit_every(cfg) -> int:
    """Anchor rounds between refits of the codec's geometry: ``codec_refit_every``, or when unset 1 with
    the anchor and a codec that fits geometry, else 0 (never)."""
    every = getattr(cfg, "codec_refit_every", None)
    if every is not None:
        return every
    spec = composed_codec(cfg)
    return 1 if getattr(cfg, "anchor", False) and spec is not None and spec.needs_fit else 0


def cadence_bounds(cfg) -> tuple[int, int]:
    """[min, max] gap of the adaptive cadence (defaults: anchor_every // 4 and 4 · anchor_every)."""
    low = cfg.anchor_every_min if cfg.anchor_every_min is not None else max(1, cfg.anchor_every // 4)
    high = cfg.anchor_every_max if cfg.anchor_every_max is not None else 4 * cfg.anchor_every
    return low, high
