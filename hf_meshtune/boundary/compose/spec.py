"""The boundary codec knob: one validated string that spells what crosses a pipeline boundary.

Grammar (``compose.grammar.parse_codec`` parses it): a forward part, optionally ``/`` and a backward part, optionally
a lossless coder last. The forward part's stages are joined by ``+``, in this order, each optional, at
least one lossy stage::

    outliers<N>            N fixed dims (the largest-RMS ones of dense activations) sent in the model dtype
    pca<r> | spca<r>       project the other dims on r principal directions (spca: of the standardised dims)
    rot[<b>]               a randomized Hadamard rotation of the coded values in blocks of b (a power of 2,
                           default 64), after a seeded permutation; the values are zero-padded to a multiple
                           of b. Both sides derive it from the seed (no bytes); it needs a quantiser after it
    int<b>[g<G>|x<K>][e8m0][sr]
                           b ∈ {2, 3, 4, 5, 6, 8} bits with a zero level, one scale per G values, or per each of
                           K contiguous groups of sizes that differ by at most one (default: one scale per
                           token); scales are bf16, or with ``e8m0`` one byte (a power of two, rounded up);
                           ``sr``: stochastic rounding on the backward (unbiased)
    fp8[g<G>|x<K>][e8m0]   float8 e4m3 values, scales as for int

    /[rot[<b>]+]<quantiser>  the backward message's own rotation and quantiser (``sr`` there), e.g.
                           ``outliers8+rot+int4g64/rot+int6g64sr``; outliers and projection are shared.
                           Without it the backward is coded like the forward
    +zstd | +zlib          last: lossless coding of both messages' bytes (column-major, see
                           ``compose.entropy``); the wire carries the coded bytes

    mask<p>[+zeros|+mean|+gaussian]   the paper's shared-seed mask (``mask0.95`` = the paper), alone

``mask`` specs are the ``mask_*`` knobs spelled as a string and run on the mask path
(``boundary.masking``); every other spec runs on the composed codec (``compose.codec``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from ..._validation import require

__all__ = ["CodecSpec", "QUANT_BITS", "SCALE_BYTES", "code_bytes"]

QUANT_BITS = (2, 3, 4, 5, 6, 8)
SCALE_BYTES = {"bf16": 2, "e8m0": 1}
ROTATION_BLOCK = 64  # ``rot`` alone
FIELD = "boundary_codec"


@dataclass(frozen=True)
class CodecSpec:
    """A parsed ``boundary_codec`` string (see the module docstring). ``quant`` is "int", "fp8" or None
    (values in the model dtype); ``group`` (G values per scale) and ``group_count`` (K groups) both None means
    one scale per token; ``rotation`` is the Hadamard block size (None: no rotation); ``backward`` the spec
    of the backward message where it is spelled apart (its outliers and projection are the forward's);
    ``entropy`` the lossless coder of both messages; ``mask_ratio`` is set only for mask specs (then every
    other field is unused)."""

    text: str
    outliers: int = 0
    projection: str | None = None  # "pca" | "spca"
    rank: int | None = None
    rotation: int | None = None
    quant: str | None = None  # "int" | "fp8"
    bits: int | None = None
    group: int | None = None
    group_count: int | None = None
    scales: str = "bf16"
    stochastic: bool = False
    backward: CodecSpec | None = None
    entropy: str | None = None
    mask_ratio: float | None = None
    fill: str = "zeros"

    @property
    def is_mask(self) -> bool:
        return self.mask_ratio is not None

    @property
    def needs_fit(self) -> bool:
        """Whether the codec learns geometry (outlier dims, a basis) from dense activations."""
        return self.outliers > 0 or self.projection is not None

    def side(self, direction: str) -> CodecSpec:
        """The spec of one message: "fwd" (the activation: this spec) or "bwd" (the activation gradient:
        the backward part where one is spelled, else this spec)."""
        require(direction in ("fwd", "bwd"), "direction", direction, "be 'fwd' or 'bwd'")
        return self.backward if direction == "bwd" and self.backward is not None else self

    def backward_of(self, text: str, **fields) -> CodecSpec:
        """The backward message's spec: this spec's outliers and projection with its own rotation and
        quantiser (``fields``)."""
        cleared = dict(
            rotation=None, quant=None, bits=None, group=None, group_count=None, scales="bf16", stochastic=False
        )
        return replace(self, text=text, backward=None, **{**cleared, **fields})

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
        """D: the values per token the analysis gives (r with a projection, else H - N)."""
        if self.projection:
            assert self.rank is not None  # parse_codec gives every projection its rank
            return self.rank
        return hidden_size - self.outliers

    def quantised_width(self, hidden_size: int) -> int:
        """D': the values per token the quantiser sees: D, or with a rotation D rounded up to whole blocks."""
        width = self.coded_width(hidden_size)
        return width if self.rotation is None else -(-width // self.rotation) * self.rotation

    def groups(self, hidden_size: int) -> int:
        width = self.quantised_width(hidden_size)
        if self.quant is None:
            return 1
        return self.group_count or width // (self.group or width)

    def message_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        """Bytes per token of this spec's message before lossless coding: N·e (outliers, model dtype) +
        groups·(2 for bf16, 1 for e8m0 scales) + codes: ⌈D'/8⌉·b (int b < 8), D' (int8, fp8), or D'·e (no
        quantiser)."""
        self.validate(hidden_size)
        codes = code_bytes(self.quant, self.bits, self.quantised_width(hidden_size), dtype_bytes)
        scales = SCALE_BYTES[self.scales] * self.groups(hidden_size) if self.quant else 0
        return self.outliers * dtype_bytes + scales + codes

    def payload_bytes(self, hidden_size: int, dtype_bytes: int, direction: str = "fwd") -> int:
        """Bytes per token of one direction's message rounded up to a multiple of e (it travels inside
        the pipeline as model-dtype words; the variable-size wire sends ``message_bytes`` of real tokens)."""
        raw = self.side(direction).message_bytes(hidden_size, dtype_bytes)
        return math.ceil(raw / dtype_bytes) * dtype_bytes

    def round_trip_bytes(self, hidden_size: int, dtype_bytes: int) -> int:
        """Bytes per token of both messages, forward and backward, before lossless coding (formula)."""
        return sum(self.side(d).message_bytes(hidden_size, dtype_bytes) for d in ("fwd", "bwd"))

    def validate(self, hidden_size: int) -> None:
        """The rules that need H: N < H, r < H - N, G dividing D' (after rotation's padding), K <= D'."""
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
        width = self.quantised_width(hidden_size)
        padded = f", padded to whole rot{self.rotation} blocks" if self.rotation else ""
        if self.group is not None:
            require(
                width % self.group == 0,
                FIELD,
                self.text,
                f"use a group size that divides the {width} coded values per token (g{self.group} does not; "
                f"H={hidden_size}, outliers={self.outliers}, rank={self.rank}{padded})",
            )
        if self.group_count is not None:
            require(
                self.group_count <= width,
                FIELD,
                self.text,
                f"split the {width} coded values per token into at most {width} groups (x{self.group_count} has "
                f"more; H={hidden_size}, outliers={self.outliers}, rank={self.rank}{padded})",
            )
        if self.backward is not None:
            self.backward.validate(hidden_size)


def code_bytes(quant: str | None, bits: int | None, width: int, dtype_bytes: int) -> int:
    """Bytes of one token's D codes: ⌈D/8⌉·b (int b < 8: 8 codes fill b bytes), D (int8, fp8), D·e (values
    in the model dtype)."""
    if quant == "int":
        assert bits is not None  # parse_codec gives every int quantiser its bits
        if bits < 8:
            return math.ceil(width / 8) * bits
    return width if quant in ("int", "fp8") else width * dtype_bytes
