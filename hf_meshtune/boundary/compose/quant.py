"""The composed codec's quantisers and bit packing (float32 arithmetic, bytes out).

``int<b>``: symmetric with a zero level, L = 2^(b-1) - 1, code q + L ∈ [0, 2L] for q = round(x / s)
∈ [-L, L], with s = absmax / L per contiguous group of values, stored as bfloat16 and rounded *up* so that
|x / s| <= L always holds (no clipping, so stochastic rounding stays exactly unbiased); or as ``e8m0``, one
byte holding the exponent of the power of two at or above absmax / L (the OCP microscaling format: half the
bytes of a bf16 scale, up to 2× coarser steps). ``fp8``: x / s cast to float8 e4m3 with s = absmax / 448.
Codes of b bits are packed 8 to b bytes.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["dequantize", "int_levels", "pack_bits", "quantize", "scale_values", "unpack_bits"]

FP8_MAX = 448.0  # the largest finite float8 e4m3fn value
_SCALE_MARGIN = 1.0 + 2.0**-7  # > bfloat16's rounding error (2^-8): the stored scale is never below absmax / L


def int_levels(bits: int) -> int:
    """L: the largest code magnitude of a b-bit quantiser with a zero level."""
    return 2 ** (bits - 1) - 1


def pack_bits(codes: Tensor, bits: int) -> Tensor:
    """uint8 codes [..., D] (each < 2^b) → [..., ⌈D/8⌉·b] bytes: every 8 codes fill b bytes."""
    if bits == 8:
        return codes.to(torch.uint8)
    width = codes.shape[-1]
    pad = (-width) % 8
    work = torch.nn.functional.pad(codes.to(torch.int64), (0, pad)).reshape(*codes.shape[:-1], -1, 8)
    shifts = torch.arange(8, device=codes.device, dtype=torch.int64) * bits
    word = (work << shifts).sum(-1, keepdim=True)  # 8·b <= 64 bits
    byte_shifts = torch.arange(bits, device=codes.device, dtype=torch.int64) * 8
    packed = (word >> byte_shifts) & 0xFF
    return packed.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_bits(packed: Tensor, bits: int, width: int) -> Tensor:
    """Inverse of ``pack_bits``: [..., ⌈D/8⌉·b] bytes → int64 codes [..., D]."""
    if bits == 8:
        return packed.to(torch.int64)
    work = packed.to(torch.int64).reshape(*packed.shape[:-1], -1, bits)
    byte_shifts = torch.arange(bits, device=packed.device, dtype=torch.int64) * 8
    word = (work << byte_shifts).sum(-1, keepdim=True)
    shifts = torch.arange(8, device=packed.device, dtype=torch.int64) * bits
    codes = (word >> shifts) & ((1 << bits) - 1)
    return codes.reshape(*packed.shape[:-1], -1)[..., :width]


def _grouped(values: Tensor, groups: int) -> Tensor:
    """[..., D] → [..., groups, ⌈D/groups⌉]: contiguous groups whose sizes differ by at most one (the first
    D mod groups are the longer ones, as ``torch.tensor_split`` cuts); a shorter group is padded with one zero,
    which changes neither its absmax nor its codes."""
    width = values.shape[-1]
    size, short = -(-width // groups), (-width) % groups
    long_part = values[..., : (groups - short) * size].reshape(*values.shape[:-1], groups - short, size)
    if not short:
        return long_part
    short_part = values[..., (groups - short) * size :].reshape(*values.shape[:-1], short, size - 1)
    return torch.cat([long_part, torch.nn.functional.pad(short_part, (0, 1))], dim=-2)


def _ungrouped(grouped: Tensor, width: int) -> Tensor:
    """Inverse of ``_grouped``: [..., groups, ⌈D/groups⌉] → [..., D] (the padding dropped)."""
    groups, size = grouped.shape[-2:]
    short = groups * size - width
    flat = grouped[..., : groups - short, :].reshape(*grouped.shape[:-2], -1)
    if not short:
        return flat
    return torch.cat([flat, grouped[..., groups - short :, : size - 1].reshape(*grouped.shape[:-2], -1)], dim=-1)


def _scales(grouped: Tensor, top: float, form: str) -> Tensor:
    """Scales [..., groups] of absmax / top, rounded up, 1 where a group is all zero: bfloat16, or ``e8m0``
    uint8 exponents e (the scale is 2^(e - 127), e in [0, 254])."""
    absmax = grouped.abs().amax(-1).float()
    if form == "e8m0":
        exponent = torch.ceil(torch.log2(absmax / top)).clamp(-127, 127)
        return torch.where(absmax > 0, exponent + 127, torch.full_like(exponent, 127)).to(torch.uint8)
    scale = (absmax / top * _SCALE_MARGIN).to(torch.bfloat16)
    return torch.where(absmax > 0, scale, torch.ones_like(scale))


def scale_values(scales: Tensor) -> Tensor:
    """Stored scales (bf16, or e8m0 uint8 exponents) → float32."""
    if scales.dtype == torch.uint8:
        return torch.exp2(scales.float() - 127.0)
    return scales.float()


def quantize(
    values: Tensor, quant: str, bits: int, groups: int, noise: Tensor | None = None, scales_form: str = "bf16"
) -> tuple[Tensor, Tensor]:
    """values [..., D] → (scales [..., groups]: bf16, or uint8 with ``scales_form="e8m0"``; packed uint8 codes
    [..., code bytes]); one scale per contiguous group (``_grouped``; groups = 1: per token). ``noise``
    (uniform [0, 1), the values' shape) turns round-to-nearest into stochastic rounding (int only)."""
    grouped = _grouped(values.float(), groups)
    if quant == "fp8":
        scales = _scales(grouped, FP8_MAX, scales_form)
        unit = grouped / scale_values(scales).unsqueeze(-1)
        codes = unit.to(torch.float8_e4m3fn).view(torch.uint8)
        return scales, _ungrouped(codes, values.shape[-1])
    levels = int_levels(bits)
    scales = _scales(grouped, float(levels), scales_form)
    unit = grouped / scale_values(scales).unsqueeze(-1)
    if noise is None:
        q = torch.round(unit)
    else:
        q = torch.floor(unit + _grouped(noise.float(), groups))
    codes = _ungrouped((q.clamp_(-levels, levels) + levels).to(torch.uint8), values.shape[-1])
    return scales, pack_bits(codes, bits)


def dequantize(scales: Tensor, codes: Tensor, quant: str, bits: int, groups: int, width: int) -> Tensor:
    """Inverse of ``quantize`` (float32 [..., D])."""
    if quant == "fp8":
        unit = codes.view(torch.float8_e4m3fn).float()
    else:
        unit = (unpack_bits(codes, bits, width) - int_levels(bits)).float()
    return _ungrouped(_grouped(unit, groups) * scale_values(scales).unsqueeze(-1), width)
