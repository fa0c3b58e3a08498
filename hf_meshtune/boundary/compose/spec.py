"""The boundary codec knob: one validated string that spells what crosses a pipeline boundary.

Grammar (stages joined by ``+``, in this order; each optional, at least one lossy stage)::

    outliers<N>            N fixed dims (the largest-RMS ones of dense activations) sent in the model dtype
    pca<r> | spca<r>       project the other dims on r principal directions (spca: of the standardised dims)
    int<b>[g<G>|x<K>][sr]  b ∈ {2, 3, 4, 8} bits with a zero level, one bf16 scale per G values, or per each of
                           K contiguous groups of sizes that differ by at most one (valid at any width; default:
                           one scale per token); ``sr``: stochastic rounding on the backward (unbiased)
    fp8[g<G>|x<K>]         float8 e4m3 values, scales as for int

    mask<p>[+zeros|+mean|+gaussian]   the paper's shared-seed mask (``mask0.95`` = the paper), alone

The same stages run forward (activation) and backward (activation gradient), so both messages have
the same size. ``mask`` specs are the ``mask_*`` knobs spelled as a string and run on the mask path
(``boundary.masking``); every other spec runs on the composed codec (``compose.codec``).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

from ..._validation import require
from ..fills import FILLS

__all__ = ["CodecSpec", "QUANT_BITS", "code_bytes", "parse_codec"]

QUANT_BITS = (2, 3, 4, 8)
SCALE_BYTES = 2  # every quantisation scale travels as one bfloat16
FIELD = "boundary_codec"

_OUTLIERS = re.compile(r"outliers(\d+)")
_PROJECTION = re.compile(r"(s?pca)(\d+)")
_INT = re.compile(r"int(\d+)(?:g(\d+)|x(\d+))?(sr)?")
_FP8 = re.compile(r"fp8(?:g(\d+)|x(\d+))?")
_MASK = re.compile(r"mask(\d+(?:\.\d*)?|\.\d+)")


@dataclass(frozen=True)
class CodecSpec:
    """A parsed ``boundary_codec`` string (see the module docstring). ``quant`` is "int", "fp8" or None
    (values in the model dtype); ``group`` (G values per scale) and ``group_count`` (K groups) both None means
    one scale per token; ``mask_ratio`` is set only
    for mask specs (then every other field is unused)."""

    text: str
    outliers: int = 0
    projection: str | None = None  # "pca" | "spca"
    rank: int | None = None
    quant: str | None = None  # "int" | "fp8"
    bits: int | None = None
    group: int | None = None
    group_count: int | None = None
    stochastic: bool = False
    mask_ratio: float | None = None
    fill: str = "zeros"

    @property
    def is_mask(self) -> bool:
        return self.mask_ratio is not None

    @property
    def needs_fit(self) -> bool:
        """Whether the codec learns geometry (outlier dims, a basis) from dense activations."""
        return self.outliers > 0 or self.projection is not None

    def geometry_numel(self, hidden_size: int) -> int:
        """Values of the fitted geometry both sides hold (``codec.geometry_layout``): outlier and other
        dims, then with a projection μ (and σ for spca) and the H-N × r basis; 0 without a fit."""
        if not self.needs_fit:
            return 0
        rest = hidden_size - self.outliers
        if self.projection is None:
            return hidden_size
        assert self.rank is not None  # parse_codec gives every projection its rank
        return hidden_size + rest * (2 if self.projection == "spca" else 1) + rest * self.rank

    def coded_width(self, hidden_size: int) -> int:
        """D: the values per token the quantiser sees (r with a projection, else H - N)."""
        if self.projection:
            assert self.rank is not None  # parse_codec gives every projection its rank
            return self.rank
        return hidden_size - self.outliers

    def groups(self, hidden_size: int) -> int:
        width = self.coded_width(hidden_size)
        if self.quant is None:
            return 1
        return self.group_count or width // (self.group or width)

    def payload_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        """Bytes per token of one message (forward and backward alike), padding to ``dtype_bytes`` included.

        N·e (outliers, model dtype) + groups·2 (bf16 scales) + codes: ⌈D/8⌉·b (int b < 8), D (int8, fp8), or D·e
        (no quantiser); the sum rounded up to a multiple of e so the message travels as model-dtype words.
        """
        self.validate(hidden_size)
        codes = code_bytes(self.quant, self.bits, self.coded_width(hidden_size), dtype_bytes)
        scales = SCALE_BYTES * self.groups(hidden_size) if self.quant else 0
        raw = self.outliers * dtype_bytes + scales + codes
        return math.ceil(raw / dtype_bytes) * dtype_bytes

    def validate(self, hidden_size: int) -> None:
        """The rules that need H: N < H, r < H - N, G dividing D, K <= D."""
        if self.is_mask:
            return
        require(
            self.outliers < hidden_size,
            FIELD,
            self.text,
            f"keep fewer outlier dims than hidden_size={hidden_size} (outliers{self.outliers})",
        )
        rest = hidden_size - self.outliers
        if self.projection:
            assert self.rank is not None  # parse_codec gives every projection its rank
            require(
                self.rank < rest,
                FIELD,
                self.text,
                f"project on fewer than the {rest} non-outlier dims ({self.projection}{self.rank} at H={hidden_size})",
            )
        width = self.coded_width(hidden_size)
        if self.group is not None:
            require(
                width % self.group == 0,
                FIELD,
                self.text,
                f"use a group size that divides the {width} coded values per token (g{self.group} does not; "
                f"H={hidden_size}, outliers={self.outliers}, rank={self.rank})",
            )
        if self.group_count is not None:
            require(
                self.group_count <= width,
                FIELD,
                self.text,
                f"split the {width} coded values per token into at most {width} groups (x{self.group_count} has "
                f"more; H={hidden_size}, outliers={self.outliers}, rank={self.rank})",
            )


def code_bytes(quant: str | None, bits: int | None, width: int, dtype_bytes: int) -> int:
    """Bytes of one token's D codes: ⌈D/8⌉·b (int b < 8: 8 codes fill b bytes), D (int8, fp8), D·e (values
    in the model dtype)."""
    if quant == "int":
        assert bits is not None  # parse_codec gives every int quantiser its bits
        if bits < 8:
            return math.ceil(width / 8) * bits
    return width if quant in ("int", "fp8") else width * dtype_bytes


KIND_WORDS = {"outliers": "outliers<N> stage", "projection": "projection (pca/spca)", "quant": "quantiser (int/fp8)"}


def _bad(text: str, rule: str) -> ValueError:
    return ValueError(f"{FIELD}={text!r} is invalid: it must {rule}")


def _grouping(size: str | None, count: str | None) -> dict:
    """The quantiser's ``g<G>`` / ``x<K>`` suffix as CodecSpec fields."""
    if size is not None:
        return {"group": int(size)}
    return {} if count is None else {"group_count": int(count)}


def parse_codec(text: str) -> CodecSpec:
    """Parse and validate a ``boundary_codec`` string (rules that need H wait for ``validate``).

    Example:
        >>> parse_codec("outliers8+int4g71").payload_bytes(576, 2)
        316
    """
    require(isinstance(text, str) and text.strip() != "", FIELD, text, "be a non-empty string such as 'outliers8+int4'")
    parts = text.strip().split("+")
    mask = _MASK.fullmatch(parts[0])
    if mask:
        ratio = float(mask.group(1))
        require(0.0 <= ratio < 1.0, FIELD, text, "give a mask ratio p in [0, 1) (mask0.95 = the paper)")
        rest = parts[1:]
        if len(rest) > 1 or (rest and rest[0] not in FILLS):
            raise _bad(
                text,
                f"follow mask<p> with at most one fill, one of {sorted(FILLS)} (a mask composes with nothing else yet)",
            )
        return CodecSpec(text, mask_ratio=ratio, fill=rest[0] if rest else "zeros")
    fields: dict = {}
    order = ("outliers", "projection", "quant")
    seen: list[str] = []
    for part in parts:
        if part in FILLS:
            raise _bad(text, f"use the fill {part!r} only after mask<p> (a fill rebuilds the dims a mask dropped)")
        if _MASK.fullmatch(part):
            raise _bad(text, "start with mask<p> if it has one (a mask composes with nothing but a fill yet)")
        if m := _OUTLIERS.fullmatch(part):
            kind = "outliers"
            fields["outliers"] = int(m.group(1))
            if fields["outliers"] < 1:
                raise _bad(text, "keep at least 1 outlier dim (outliers<N>, N >= 1)")
        elif m := _PROJECTION.fullmatch(part):
            kind = "projection"
            fields["projection"], fields["rank"] = m.group(1), int(m.group(2))
            if fields["rank"] < 1:
                raise _bad(text, "project on at least 1 direction (pca<r>, r >= 1)")
        elif m := _INT.fullmatch(part):
            kind = "quant"
            bits = int(m.group(1))
            if bits not in QUANT_BITS:
                raise _bad(text, f"quantise to one of {list(QUANT_BITS)} bits (int{bits} is not supported)")
            fields.update(quant="int", bits=bits, stochastic=m.group(4) is not None)
            fields.update(_grouping(m.group(2), m.group(3)))
        elif m := _FP8.fullmatch(part):
            kind = "quant"
            fields.update(quant="fp8", bits=8)
            fields.update(_grouping(m.group(1), m.group(2)))
        else:
            raise _bad(
                text,
                f"be stages joined by '+' from outliers<N>, pca<r>/spca<r>, int<b>[g<G>|x<K>][sr], fp8[g<G>|x<K>], or "
                f"mask<p>[+fill] ({part!r} is none of them)",
            )
        if kind in seen:
            raise _bad(text, f"have at most one {KIND_WORDS[kind]}")
        if seen and order.index(kind) < order.index(seen[-1]):
            raise _bad(
                text, f"order its stages as outliers, then a projection, then a quantiser ({part!r} comes too late)"
            )
        seen.append(kind)
    if fields.get("group") is not None and fields["group"] < 1:
        raise _bad(text, "use a group size >= 1")
    if fields.get("group_count") is not None and fields["group_count"] < 1:
        raise _bad(text, "split into at least 1 group (x<K>, K >= 1)")
    if seen == ["outliers"]:
        raise _bad(text, "compress the non-outlier dims too: follow outliers<N> with a projection or a quantiser")
    return CodecSpec(text, **fields)
