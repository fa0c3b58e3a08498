"""The rotation stage (``rot<b>``): a randomized Hadamard transform both sides derive from the seed.

For coded values z ∈ R^D (after outliers and projection) and block size b (a power of 2)::

    R z = blockdiag(H_b, ..., H_b) / √b · diag(s) · P · pad(z)

pad(z) appends zeros up to D' = ⌈D/b⌉·b, P is a seeded permutation of the D' positions (so dims of unlike
spread share blocks), s a seeded ±1 vector, H_b the Sylvester Hadamard matrix. R is orthogonal on R^D', so
the inverse is Rᵀ followed by dropping the padding: what the quantiser rounds is spread evenly over a block
instead of sitting in its largest dims, and no byte travels for it. Seeds: (boundary, direction, seed), so
the forward and the backward message are rotated apart, each the same on both sides of the boundary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..masking import stable_seed

__all__ = ["DIRECTIONS", "Rotation", "hadamard"]

DIRECTIONS = ("fwd", "bwd")


def hadamard(block: int, dtype: torch.dtype = torch.float32) -> Tensor:
    """The Sylvester Hadamard matrix H_b (entries ±1, H Hᵀ = b·I) for b a power of 2."""
    matrix = torch.ones(1, 1, dtype=dtype)
    while matrix.shape[0] < block:
        matrix = torch.cat([torch.cat([matrix, matrix], 1), torch.cat([matrix, -matrix], 1)], 0)
    return matrix


class Rotation:
    """R for ``width`` values in blocks of ``block`` (see the module docstring); ``forward`` R z, ``inverse`` Rᵀ."""

    def __init__(self, width: int, block: int, boundary: int, direction: str, seed: int) -> None:
        self.width, self.block = width, block
        self.padded = -(-width // block) * block
        gen = torch.Generator().manual_seed(stable_seed(b"meshtune-rot", boundary, DIRECTIONS.index(direction), seed))
        self.permutation = torch.randperm(self.padded, generator=gen)
        self.inverse_permutation = torch.argsort(self.permutation)
        self.signs = torch.randint(0, 2, (self.padded,), generator=gen).float() * 2 - 1
        self.matrix = hadamard(block) / block**0.5  # symmetric and orthogonal
        self._cache: dict[str, tuple[Tensor, Tensor, Tensor, Tensor]] = {}

    def _on(self, device: torch.device) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        key = str(device)
        if key not in self._cache:
            parts = (self.permutation, self.inverse_permutation, self.signs, self.matrix)
            self._cache[key] = tuple(p.to(device) for p in parts)  # type: ignore[assignment]
        return self._cache[key]

    def forward(self, values: Tensor) -> Tensor:
        """z [..., D] (float32) → R z [..., D']."""
        permutation, _, signs, matrix = self._on(values.device)
        padded = torch.nn.functional.pad(values, (0, self.padded - self.width))
        mixed = padded[..., permutation] * signs
        blocks = mixed.reshape(*values.shape[:-1], self.padded // self.block, self.block) @ matrix
        return blocks.reshape(*values.shape[:-1], self.padded)

    def inverse(self, rotated: Tensor) -> Tensor:
        """Rᵀ y [..., D'] → [..., D] (the padding's values dropped)."""
        _, inverse_permutation, signs, matrix = self._on(rotated.device)
        blocks = rotated.reshape(*rotated.shape[:-1], self.padded // self.block, self.block) @ matrix
        mixed = blocks.reshape(*rotated.shape[:-1], self.padded) * signs
        return mixed[..., inverse_permutation][..., : self.width]
