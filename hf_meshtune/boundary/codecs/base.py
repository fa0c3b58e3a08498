"""The codec interface and the quantiser the codecs share."""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
from torch import Tensor, nn

from ..._validation import require

CODECS_ATTR = "boundary_codecs"  # where attach_codec registers the codecs on the model
SCALE_BYTES = 2  # a per-token quantisation scale travels as one 16-bit float


def quantize_per_token(x: Tensor, bits: int) -> Tensor:
    """b-bit per-token symmetric absmax quantisation with a zero level, returned dequantised (the receiver's view).

    Each token (last dim) travels as its absmax a and H codes q ∈ {-L, …, L}, L = 2^(b-1) - 1, on the grid
    q·a/L: zero is a level, so the many near-zero entries of a residual stream stay zero instead of
    being pushed to ±a/(2^b - 1) (a grid without a zero level wrecked SmolLM2's forward pass at 4 bits,
    benchmarks/quality). The error is at most a/(2L). Computed in at least float32; returned in x's dtype.
    """
    levels = 2 ** (bits - 1) - 1
    work = x.to(torch.promote_types(x.dtype, torch.float32))
    step = work.abs().amax(dim=-1, keepdim=True) / levels
    safe = torch.where(step > 0, step, torch.ones_like(step))  # an all-zero token stays zero
    return (torch.round(work / safe).clamp_(-levels, levels) * step).to(x.dtype)


def _quantized_bytes(hidden_size: int, bits: int) -> int:
    """One quantised token on the wire: H b-bit codes packed into bytes, plus its 2-byte scale."""
    return math.ceil(hidden_size * bits / 8) + SCALE_BYTES


def _check_bits(name: str, bits: Any) -> None:
    require(
        isinstance(bits, int) and 2 <= bits <= 8,
        name,
        bits,
        "be an int in [2, 8] (b bits: 2^(b-1) - 1 levels each side of 0)",
    )


def _check_width(name: str, width: Any, hidden_size: int) -> int:
    """k or K: between one value and H − 1 (keeping all H is no compression)."""
    require(
        isinstance(width, int) and 1 <= width <= hidden_size - 1,
        name,
        width,
        f"be an int in [1, hidden_size - 1 = {hidden_size - 1}]",
    )
    return width


class _Rebuilt(torch.autograd.Function):
    """Forward: the receiver's rebuild; backward: the gradient quantised to ``grad_bits``.

    A quantiser's own derivative is zero almost everywhere, so the gradient passes straight through
    it (dh̃/dh taken as I); what the sender receives is the b-bit gradient message.
    """

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, rebuilt: Tensor, grad_bits: int) -> Tensor:
        ctx.grad_bits = grad_bits
        return rebuilt.clone()

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return quantize_per_token(grad, ctx.grad_bits), None, None


class BoundaryCodec(nn.Module):
    """One boundary's codec: ``forward(h, keys)`` maps h [B, T, H] to the receiver's rebuild h̃.

    Class attributes say what a codec needs: ``needs_fit`` (learns from dense activations through
    ``fit``) and ``needs_keys`` (keeps per-sample history, one bytes key per batch row). Every forward
    records ``last_wire_bytes``: the (forward, backward) bytes of that call's messages, values counted
    at ``dtype_bytes`` each plus every index and scale, which ``CodecHandle`` adds to its counter.

    These baseline codecs simulate their wire (the rebuild is computed directly, no message tensor is
    built), so their bytes are **booked by formula**: tokens × ``wire_bytes_per_token`` (``DeltaQuantCodec``
    books each row's choice, full or delta). The formulas of ``int<b>`` and ``pca<r>`` are checked
    against the packed messages of the composed codec (``boundary/compose``), which the trainer and
    the mesh use and whose counter counts the bytes of the message tensors themselves.
    """

    name: ClassVar[str]
    needs_fit: ClassVar[bool] = False
    needs_keys: ClassVar[bool] = False

    def __init__(self, hidden_size: int, dtype_bytes: int = 2) -> None:
        super().__init__()
        require(isinstance(hidden_size, int) and hidden_size >= 2, "hidden_size", hidden_size, "be an int >= 2")
        require(isinstance(dtype_bytes, int) and dtype_bytes >= 1, "dtype_bytes", dtype_bytes, "be an int >= 1")
        self.hidden_size, self.dtype_bytes = hidden_size, dtype_bytes
        self.last_wire_bytes: tuple[int, int] = (0, 0)

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        raise NotImplementedError

    def wire_bytes_per_token(self, hidden_size: int, dtype_bytes: int = 2) -> tuple[float, float]:
        """(forward, backward) bytes per token on the wire, every index and scale included."""
        raise NotImplementedError

    def fit(self, hidden: Tensor) -> None:
        """Learn from dense boundary activations [..., H] (only codecs with ``needs_fit``)."""

    def codec_state(self) -> dict:
        """Non-parameter state to checkpoint (parameters travel with the model)."""
        return {}

    def load_codec_state(self, state: dict) -> None:
        """Restore ``codec_state()``; stateless codecs have nothing to restore."""

    def _same_width(self, hidden_size: int) -> None:
        require(
            hidden_size == self.hidden_size,
            "hidden_size",
            hidden_size,
            f"equal the codec's hidden_size={self.hidden_size}",
        )

    def _record(self, hidden: Tensor) -> None:
        """Fixed-size messages, booked: tokens × ``wire_bytes_per_token``."""
        self._same_width(hidden.shape[-1])
        tokens = hidden.numel() // hidden.shape[-1]
        fwd, bwd = self.wire_bytes_per_token(self.hidden_size, self.dtype_bytes)
        self.last_wire_bytes = (int(fwd) * tokens, int(bwd) * tokens)
