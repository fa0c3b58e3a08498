"""Per-sample change coding at a boundary: a row seen before sends only how its activation changed.

Both sides of a boundary keep, per training row (its index in the training dataset, ``ROW_ID``), the
last reconstruction h̄ of that row's boundary activation at its real tokens, with a digest of those
tokens. When the row comes back with the same tokens (a **revisit**) the sender codes the change
h − h̄ with the change codec (``boundary_change_codec``, ``ChangeSpec``) and the receiver rebuilds
h̃ = h̄ + D(message); a **first visit** (an id not held, or tokens that differ: truncation, packing,
augmentation) sends the boundary codec's own message. Both sides then set h̄ ← h̃ from the same message
with the same arithmetic (on the same kind of device), so their caches never drift
(``ChangeCache.digest``). Only the forward is change-coded; the gradient message is the boundary
codec's backward for every row. The idea is AQ-SGD's (Wang et al., NeurIPS 2022): from one epoch to the
next an activation moves as little as the weights did. Unlike AQ-SGD's low-bit codes of the change at its
own scale, the change is rounded on a fixed grid set by h̄ (the step int<bits> would use on the value), so
the error stays that of a <bits>-bit code of h while a small change costs only what its mostly-zero codes
cost after a lossless coder.

``encode_change`` is the sender's side (it decodes its own message to keep the same h̄), ``decode_change``
the receiver's; one process runs the sender's alone, whose cache is then the receiver's too.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field

import torch
from torch import Tensor

from ..._validation import require
from .entropy import require_coder
from .rotation import Rotation
from .spec import ROTATION_BLOCK

__all__ = [
    "ROW_ID",
    "ChangeCache",
    "ChangeCodec",
    "ChangeSpec",
    "change_records",
    "change_spec",
    "decode_change",
    "encode_change",
    "row_digest",
]

ROW_ID = "meshtune_row_id"  # the batch key that carries each row's index in the training dataset
FIELD = "boundary_change_codec"
_PATTERN = re.compile(r"^(?:rot(\d+)?\+)?delta(\d)(?:g(\d+))?\+(\w+)$")
_CODE_LIMIT = 127  # codes travel as int8
_FLOOR = 2.0**-10  # a group of h̄ near zero steps at this fraction of its row's largest value


@dataclass(frozen=True)
class ChangeSpec:
    """A parsed ``boundary_change_codec``: ``rot[<b>]+delta<bits>[g<G>]+<coder>``. The change h − h̄ (rotated
    in blocks of b where asked) is rounded on a grid whose step in each group of G values is the step int<bits>
    would use on h̄ there: absmax(h̄ group) / (2^(bits-1) - 1), which both sides know, so no scale travels. The
    error is at most half a step (the step of int<bits> on the value itself) while the change stays within 127
    steps, and the codes (int8) of a small change are mostly zeros, which the lossless coder (required) packs.
    The boundary codec's outlier dims are not in the grid: they travel as they are, as in its own message."""

    text: str
    rotation: int | None
    bits: int
    group: int
    coder: str

    def width(self, coded: int) -> int:
        """Codes per token for ``coded`` values (H less the boundary codec's outlier dims), padded to whole
        rotation blocks."""
        return -(-coded // self.rotation) * self.rotation if self.rotation else coded

    def record_bytes(self, width: int, outliers: int = 0, dtype_bytes: int = 4) -> int:
        """Bytes per token of a change message before lossless coding: the outlier dims' values in the model
        dtype, then one int8 code per other value (``width`` of them, padded to whole rotation blocks)."""
        return outliers * dtype_bytes + self.width(width)

    def validate(self, width: int) -> None:
        """``width``: the values a token's change codes (H less the boundary codec's outlier dims)."""
        padded = self.width(width)
        require(
            padded % self.group == 0,
            FIELD,
            self.text,
            f"use a group size g{self.group} that divides the {padded} values a token codes (its {width} non-outlier "
            "values" + (f", padded to whole blocks of {self.rotation})" if self.rotation else ")"),
        )


def change_spec(text: str) -> ChangeSpec:
    """Parse a ``boundary_change_codec`` string (see ``ChangeSpec``)."""
    require(isinstance(text, str) and text != "", FIELD, text, "be a string such as 'rot+delta5g64+zstd'")
    match = _PATTERN.match(text)
    require(
        match is not None,
        FIELD,
        text,
        "be [rot[<b>]+]delta<bits>[g<G>]+<coder>: the change rounded on the step int<bits> would use on the cached "
        "value (bits 2..8), in groups of G values (default 64), then a lossless coder (zstd/zlib), e.g. "
        "'rot+delta5g64+zstd'",
    )
    assert match is not None
    block = int(match.group(1)) if match.group(1) else ROTATION_BLOCK if text.startswith("rot") else None
    bits, group, coder = int(match.group(2)), int(match.group(3) or 64), match.group(4)
    require(2 <= bits <= 8, FIELD, text, f"use delta<bits> with bits in 2..8 (not {bits})")
    require(group >= 1, FIELD, text, "use a group size g<G> >= 1")
    require(block is None or (block >= 2 and block & (block - 1) == 0), FIELD, text, "rotate in blocks of a power of 2")
    require_coder(coder, text, FIELD)
    return ChangeSpec(text, block, bits, group, coder)


class ChangeCodec:
    """Boundary ``boundary``'s change codec (``ChangeSpec``) for ``width`` values a token (H less the
    boundary codec's outlier dims, which travel as they are: a massive dim rotated into a block would set
    its grid): ``encode(h̄, h)`` → int8 codes [L, W], ``decode(h̄, codes)`` → h̃ [L, width] in h̄'s dtype. Both
    run in float32 on the tensors' device."""

    def __init__(self, spec: ChangeSpec, boundary: int, width: int, seed: int = 0) -> None:
        spec.validate(width)
        self.spec, self.hidden_size = spec, width
        self.rotation = Rotation(width, spec.rotation, boundary, "fwd", seed) if spec.rotation else None
        self.levels = 2 ** (spec.bits - 1) - 1

    def _rotate(self, values: Tensor) -> Tensor:
        return self.rotation.forward(values) if self.rotation is not None else values

    def steps(self, previous: Tensor) -> Tensor:
        """The grid step per group of h̄ [L, H] → [L, W / G, 1]: absmax / levels, floored where a group is near 0."""
        rotated = self._rotate(previous.float())
        groups = rotated.reshape(*rotated.shape[:-1], -1, self.spec.group)
        absmax = groups.abs().amax(-1, keepdim=True)
        row = absmax.amax(-2, keepdim=True)
        floor = torch.where(row > 0, row * _FLOOR, torch.ones_like(row))
        return torch.maximum(absmax, floor) / self.levels

    def encode(self, previous: Tensor, hidden: Tensor) -> Tensor:
        change = self._rotate(hidden.float() - previous.float())
        groups = change.reshape(*change.shape[:-1], -1, self.spec.group)
        codes = torch.round(groups / self.steps(previous)).clamp(-_CODE_LIMIT, _CODE_LIMIT)
        return codes.reshape(change.shape).to(torch.int8)

    def decode(self, previous: Tensor, codes: Tensor) -> Tensor:
        groups = codes.float().reshape(*codes.shape[:-1], -1, self.spec.group)
        change = (groups * self.steps(previous)).reshape(codes.shape)
        if self.rotation is not None:
            change = self.rotation.inverse(change)
        return (previous.float() + change).to(previous.dtype)


def row_digest(tokens: Tensor) -> bytes:
    """8 bytes that change when a row's real tokens do (its int64 token ids, in order)."""
    data = tokens.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return hashlib.blake2b(data, digest_size=8).digest()


@dataclass
class ChangeCache:
    """One side's h̄ per row: row id → (digest of its tokens, h̃ [L, H] at its L real tokens, on CPU in the
    boundary's dtype)."""

    rows: dict[int, tuple[bytes, Tensor]] = field(default_factory=dict)

    def get(self, row: int, digest: bytes) -> Tensor | None:
        """h̄ of ``row`` if held for the same tokens (a revisit), else None (a first visit)."""
        held = self.rows.get(row)
        return held[1] if held is not None and held[0] == digest else None

    def put(self, row: int, digest: bytes, values: Tensor) -> None:
        self.rows[row] = (digest, values.detach().to("cpu").clone())

    @property
    def nbytes(self) -> int:
        return sum(values.numel() * values.element_size() for _, values in self.rows.values())

    def digest(self) -> str:
        """A hash of every row's id, token digest and exact h̄ (two sides must agree on it)."""
        out = hashlib.blake2b(digest_size=8)
        for row in sorted(self.rows):
            tokens, values = self.rows[row]
            out.update(row.to_bytes(8, "little", signed=True) + tokens)
            out.update(values.contiguous().view(torch.uint8).numpy().tobytes())
        return out.hexdigest()

    def state_dict(self) -> dict:
        ids = sorted(self.rows)
        return {
            "ids": torch.tensor(ids, dtype=torch.int64),
            "digests": torch.tensor([list(self.rows[row][0]) for row in ids], dtype=torch.uint8).reshape(-1, 8),
            "values": [self.rows[row][1] for row in ids],
        }

    def load_state_dict(self, state: dict) -> None:
        ids = [int(row) for row in state["ids"]]
        require(
            len(ids) == len(state["digests"]) == len(state["values"]),
            "change cache state",
            (len(ids), len(state["digests"]), len(state["values"])),
            "hold one token digest and one h̄ per row id",
        )
        self.rows = {
            row: (bytes(d.tolist()), v.detach().to("cpu").clone())
            for row, d, v in zip(ids, state["digests"], state["values"])
        }


Dims = tuple[Tensor, Tensor]  # (the boundary codec's outlier dims, the other dims): the change codes the other


def _sides(hidden_size: int, dims: Dims | None, device: torch.device) -> Dims:
    if dims is None:
        return torch.empty(0, dtype=torch.int64, device=device), torch.arange(hidden_size, device=device)
    return dims[0].to(device), dims[1].to(device)


def _rebuilt(previous: Tensor, outliers: Tensor, rest: Tensor, dims: Dims) -> Tensor:
    rebuilt = previous.clone()
    rebuilt[..., dims[0]] = outliers.to(previous.dtype)
    rebuilt[..., dims[1]] = rest
    return rebuilt


def change_records(message: tuple[Tensor, Tensor]) -> Tensor:
    """A change message's bytes per token, [L, record]: the outlier values, then the int8 codes."""
    outliers, codes = message
    return torch.cat([outliers.contiguous().view(torch.uint8), codes.view(torch.uint8)], dim=-1)


@torch.no_grad()
def encode_change(
    change: ChangeCodec, cache: ChangeCache, row: int, digest: bytes, hidden: Tensor, dims: Dims | None = None
) -> tuple[tuple[Tensor, Tensor], Tensor] | None:
    """The sender's side for one row's real tokens ``hidden`` [L, H]: None on a first visit (the boundary
    codec's message goes instead, and the caller stores its h̃ with ``cache.put``); on a revisit (the message:
    the outlier dims' values [L, N] and the other dims' change as int8 codes [L, W]; h̃ [L, H]), with h̃
    already stored as the new h̄. ``dims``: the boundary codec's (outlier dims, other dims); None: no outliers."""
    previous = cache.get(row, digest)
    if previous is None:
        return None
    require(
        previous.shape == hidden.shape,
        "change cache",
        f"row {row}: held {tuple(previous.shape)}, now {tuple(hidden.shape)}",
        "hold h̄ of the same real tokens as the row it is keyed by (same tokens, same digest)",
    )
    previous = previous.to(hidden.device, hidden.dtype)
    sides = _sides(hidden.shape[-1], dims, hidden.device)
    outliers, held = hidden[..., sides[0]], previous[..., sides[1]]
    codes = change.encode(held, hidden[..., sides[1]])
    rebuilt = _rebuilt(previous, outliers, change.decode(held, codes), sides)  # the receiver's h̃: the new h̄
    cache.put(row, digest, rebuilt)
    return (outliers.contiguous(), codes), rebuilt


@torch.no_grad()
def decode_change(
    change: ChangeCodec,
    cache: ChangeCache,
    row: int,
    digest: bytes,
    message: tuple[Tensor, Tensor],
    dims: Dims | None = None,
) -> Tensor:
    """The receiver's side of a revisit: h̃ (outlier dims as sent, the others h̄ + D(codes)), stored as the new
    h̄. A row the receiver does not hold for these tokens is refused (it would decode against a cache the
    sender does not have)."""
    previous = cache.get(row, digest)
    require(
        previous is not None,
        "change cache",
        f"row {row}",
        "be held by the receiver for the same tokens when the sender codes it as a revisit",
    )
    assert previous is not None
    outliers, codes = message
    previous = previous.to(codes.device)
    sides = _sides(previous.shape[-1], dims, codes.device)
    rebuilt = _rebuilt(previous, outliers, change.decode(previous[..., sides[1]], codes), sides)
    cache.put(row, digest, rebuilt)
    return rebuilt
