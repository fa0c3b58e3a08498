"""Parsing a ``boundary_codec`` string into a ``CodecSpec`` (the grammar is ``compose.spec``'s docstring).

Every rule a string can break is a ``ValueError`` naming the field, the string and the rule.
"""

from __future__ import annotations

import re

from ..fills import FILLS
from .entropy import CODERS, require_coder
from .spec import FIELD, QUANT_BITS, ROTATION_BLOCK, CodecSpec

__all__ = ["parse_codec"]

_OUTLIERS = re.compile(r"outliers(\d+)")
_PROJECTION = re.compile(r"(s?pca)(\d+)")
_ROTATION = re.compile(r"rot(\d+)?")
_INT = re.compile(r"int(\d+)(?:g(\d+)|x(\d+))?(e8m0)?(sr)?")
_FP8 = re.compile(r"fp8(?:g(\d+)|x(\d+))?(e8m0)?")
_MASK = re.compile(r"mask(\d+(?:\.\d*)?|\.\d+)")

KIND_WORDS = {
    "outliers": "outliers<N> stage",
    "projection": "projection (pca/spca)",
    "rotation": "rotation (rot)",
    "quant": "quantiser (int/fp8)",
}
_ORDER = ("outliers", "projection", "rotation", "quant")
_STAGES = (
    "outliers<N>, pca<r>/spca<r>, rot[<b>], int<b>[g<G>|x<K>][e8m0][sr], fp8[g<G>|x<K>][e8m0], "
    f"then optionally /<backward> and a coder ({'/'.join(CODERS)}), or mask<p>[+fill]"
)


def _bad(text: str, rule: str) -> ValueError:
    return ValueError(f"{FIELD}={text!r} is invalid: it must {rule}")


def _grouping(size: str | None, count: str | None) -> dict:
    """The quantiser's ``g<G>`` / ``x<K>`` suffix as CodecSpec fields."""
    if size is not None:
        return {"group": int(size)}
    return {} if count is None else {"group_count": int(count)}


def _stage(text: str, part: str) -> tuple[str, dict]:
    """One ``+``-joined stage → (its kind, its CodecSpec fields)."""
    if part in FILLS:
        raise _bad(text, f"use the fill {part!r} only after mask<p> (a fill rebuilds the dims a mask dropped)")
    if _MASK.fullmatch(part):
        raise _bad(text, "start with mask<p> if it has one (a mask composes with nothing but a fill yet)")
    if part in CODERS:
        raise _bad(text, f"end with the coder {part!r}: lossless coding is the last stage (it codes the bytes)")
    if m := _OUTLIERS.fullmatch(part):
        if int(m.group(1)) < 1:
            raise _bad(text, "keep at least 1 outlier dim (outliers<N>, N >= 1)")
        return "outliers", {"outliers": int(m.group(1))}
    if m := _PROJECTION.fullmatch(part):
        if int(m.group(2)) < 1:
            raise _bad(text, "project on at least 1 direction (pca<r>, r >= 1)")
        return "projection", {"projection": m.group(1), "rank": int(m.group(2))}
    if m := _ROTATION.fullmatch(part):
        block = int(m.group(1)) if m.group(1) else ROTATION_BLOCK
        if block < 2 or block & (block - 1):
            raise _bad(text, f"rotate in blocks of a power of 2 >= 2 (rot{block} is not: a Hadamard block)")
        return "rotation", {"rotation": block}
    if m := _INT.fullmatch(part):
        bits = int(m.group(1))
        if bits not in QUANT_BITS:
            raise _bad(text, f"quantise to one of {list(QUANT_BITS)} bits (int{bits} is not supported)")
        fields = dict(quant="int", bits=bits, stochastic=m.group(5) is not None, scales=m.group(4) or "bf16")
        return "quant", {**fields, **_grouping(m.group(2), m.group(3))}
    if m := _FP8.fullmatch(part):
        return "quant", {"quant": "fp8", "bits": 8, "scales": m.group(3) or "bf16", **_grouping(m.group(1), m.group(2))}
    raise _bad(text, f"be stages joined by '+' from {_STAGES} ({part!r} is none of them)")


def _stages(text: str, parts: list[str], allowed: tuple[str, ...]) -> tuple[dict, list[str]]:
    """The fields of a run of stages, checking each kind once, in order, and allowed here."""
    fields: dict = {}
    seen: list[str] = []
    for part in parts:
        kind, found = _stage(text, part)
        if kind not in allowed:
            raise _bad(
                text,
                f"spell only a rotation and a quantiser after '/' (the backward shares the forward's "
                f"outliers and projection; {part!r} is the forward part's {KIND_WORDS[kind]})",
            )
        if kind in seen:
            raise _bad(text, f"have at most one {KIND_WORDS[kind]}")
        if seen and _ORDER.index(kind) < _ORDER.index(seen[-1]):
            raise _bad(
                text,
                f"order its stages as outliers, then a projection, then a rotation, then a quantiser "
                f"({part!r} comes too late)",
            )
        seen.append(kind)
        fields.update(found)
    for key, rule in (
        ("group", "use a group size >= 1"),
        ("group_count", "split into at least 1 group (x<K>, K >= 1)"),
    ):
        if fields.get(key) is not None and fields[key] < 1:
            raise _bad(text, rule)
    if "rotation" in seen and "quant" not in seen:
        raise _bad(text, "follow a rotation with a quantiser (rot only spreads values for one to code)")
    return fields, seen


def _mask(text: str, parts: list[str]) -> CodecSpec:
    ratio = float(parts[0][4:])
    if not 0.0 <= ratio < 1.0:
        raise _bad(text, "give a mask ratio p in [0, 1) (mask0.95 = the paper)")
    rest = parts[1:]
    if len(rest) > 1 or (rest and rest[0] not in FILLS):
        raise _bad(
            text,
            f"follow mask<p> with at most one fill, one of {sorted(FILLS)} (a mask composes with nothing else yet)",
        )
    return CodecSpec(text, mask_ratio=ratio, fill=rest[0] if rest else "zeros")


def parse_codec(text: str) -> CodecSpec:
    """Parse and validate a ``boundary_codec`` string (rules that need H wait for ``CodecSpec.validate``):
    the string → a ``CodecSpec``, or the ValueError of the rule it breaks.

    Example:
        >>> parse_codec("outliers8+int4g71").payload_bytes(576, 2)
        316
        >>> parse_codec("outliers8+rot+int4g64e8m0/rot+int6g64+zstd").round_trip_bytes(576, 2)
        779
    """
    if not isinstance(text, str) or not text.strip():
        raise ValueError(f"{FIELD}={text!r} is invalid: it must be a non-empty string such as 'outliers8+int4'")
    text = text.strip()
    forward_text, slash, backward_text = text.partition("/")
    if _MASK.fullmatch(forward_text.split("+")[0]):
        if slash:
            raise _bad(text, "not spell a backward part on a mask (its gradient has the mask's support: no codec)")
        return _mask(text, forward_text.split("+"))
    tail = (backward_text if slash else forward_text).split("+")
    entropy = tail.pop() if tail[-1] in CODERS else None
    if entropy is not None:
        require_coder(entropy, text)
    forward_parts = tail if not slash else forward_text.split("+")
    fields, seen = _stages(text, forward_parts, _ORDER)
    if not seen:
        raise _bad(text, f"code something before the coder: stages from {_STAGES}")
    if seen == ["outliers"]:
        raise _bad(text, "compress the non-outlier dims too: follow outliers<N> with a projection or a quantiser")
    spec = CodecSpec(text, entropy=entropy, **fields)
    if not slash:
        return spec
    if spec.stochastic:
        raise _bad(text, "put 'sr' on the backward part: stochastic rounding codes the backward message")
    backward_fields, backward_seen = _stages(text, tail, ("rotation", "quant"))
    if "quant" not in backward_seen:
        raise _bad(text, "end the backward part with a quantiser (int<b>... or fp8...)")
    return CodecSpec(
        text, entropy=entropy, **fields, backward=spec.backward_of(text + " (backward)", **backward_fields)
    )
