"""The anchor's basis and the spectral filter: M_anc = U S Vᵀ (the full SVD, or a randomized rank-r one after
Halko, Martinsson & Tropp), the shapes of the factors the anchor may send instead, how far a basis moved
(``subspace_drift``), and the filter itself,

    d_i = s_i / (s_i + τ_p),      G_proj = α·G + (1-α)·U diag(d) Uᵀ G V diag(d) Vᵀ,

so directions the anchor's momentum supports pass, the rest are damped, and nothing is amplified
(0 <= d_i < 1). ``SpectralAdamW`` (``optim.spectral``) and ``AnchorMomentum`` (``optim.factors``) build on it.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from ..boundary.masking import stable_seed

__all__ = ["anchor_basis", "factor_shapes", "subspace_drift"]


def _anchor_dtype(param: Tensor) -> torch.dtype:
    """At least float32: a bf16 momentum/SVD would swamp the small singular values d resolves.

    float64 parameters keep float64 so that a float64 run can be checked against a reference.
    """
    return torch.promote_types(param.dtype, torch.float32)


def _basis_seed(seed: int, index: int, count: int) -> int:
    """Seed of the SVD test matrix for (seed, parameter index, anchor updates so far): the same on
    every rank and restart, and decorrelated between neighbouring parameters and updates."""
    return stable_seed(b"meshtune-svd", seed, index, count)


def _randomized_svd(matrix: Tensor, rank: int, niter: int, oversample: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """Rank-``rank`` truncated SVD (U [m, r], s [r], V [n, r]) after Halko, Martinsson & Tropp (2011).

    The Gaussian test matrix is drawn on the CPU from a private generator, so the basis does not
    depend on (or disturb) torch's global RNG and is the same on every device.
    """
    m, n = matrix.shape
    width = min(rank + oversample, m, n)
    gen = torch.Generator(device="cpu").manual_seed(seed)
    omega = torch.randn(n, width, generator=gen, dtype=matrix.dtype).to(matrix.device)
    q = torch.linalg.qr(matrix @ omega).Q
    for _ in range(niter):
        # Re-orthonormalise between the two half-iterations: raw powers of M lose the small
        # singular directions to rounding after a couple of iterations.
        z = torch.linalg.qr(matrix.mT @ q).Q
        q = torch.linalg.qr(matrix @ z).Q
    u_small, s, vh = torch.linalg.svd(q.mT @ matrix, full_matrices=False)
    return (q @ u_small[:, :rank]), s[:rank].clone(), vh[:rank].mT.contiguous()


def anchor_basis(
    momentum: Tensor, rank: int | None, niter: int, oversample: int, seed: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(U [m, r], s [r], V [n, r]) of M_anc: the full SVD when ``rank`` is None or >= min(m, n), else the
    randomized rank-``rank`` one (test matrix seeded by ``seed``). Raises RuntimeError when LAPACK fails."""
    if rank is None or rank >= min(momentum.shape):
        # LAPACK is several times slower on a wide matrix than on its transpose (same factors with U and V
        # swapped): decompose the tall orientation
        wide = momentum.shape[0] < momentum.shape[1]
        u, s, vh = torch.linalg.svd(momentum.mT if wide else momentum, full_matrices=False)
        return (vh.mT.contiguous(), s, u) if wide else (u, s, vh.mT.contiguous())
    return _randomized_svd(momentum, rank, niter, oversample, seed)


def factor_shapes(shape: Sequence[int], rank: int) -> list[tuple[int, ...]]:
    """Shapes of the factors the anchor sends for an [m, n] matrix: U [m, k], s [k], V [n, k], k = min(r, m, n)."""
    m, n = shape
    k = min(rank, m, n)
    return [(m, k), (k,), (n, k)]


def _factor_shapes_ok(shape: tuple[int, ...], got: tuple[tuple[int, ...], ...]) -> bool:
    """Whether ``got`` is (U [m, k], s [k], V [n, k]) for an [m, n] matrix with 1 <= k <= min(m, n)."""
    if len(shape) != 2 or len(got) != 3 or len(got[1]) != 1:
        return False
    m, n = shape
    k = got[1][0]
    return 1 <= k <= min(m, n) and got == ((m, k), (k,), (n, k))


def subspace_drift(old: Tensor, new: Tensor, k: int = 8) -> float:
    """sin θ_max: the largest principal angle between the spans of the first ``k`` columns of two
    orthonormal bases (0: the same subspace, 1: a direction of one is orthogonal to the other)."""
    k = min(k, old.shape[1], new.shape[1])
    cosines = torch.linalg.svdvals(old[:, :k].mT.double() @ new[:, :k].double())
    return float(torch.sqrt(torch.clamp(1.0 - cosines.min() ** 2, min=0.0)))


def _soft_filter(s: Tensor, tau: float, relative_tau: bool) -> Tensor:
    """d_i = s_i / (s_i + τ_eff), τ_eff = τ_p or τ_p·s_max; an all-zero spectrum gives d = 0."""
    s_max = float(s.max()) if s.numel() else 0.0
    if relative_tau and s_max == 0.0:
        return torch.zeros_like(s)
    tau_eff = tau * s_max if relative_tau else tau
    return s / (s + tau_eff)


def _filter_gradient(grad: Tensor, u: Tensor, d: Tensor, v: Tensor, alpha: float, in_place: bool = False) -> Tensor:
    """G_proj = α·G + (1-α)·U diag(d) (Uᵀ G V) diag(d) Vᵀ, in ``u``'s dtype; ``in_place`` writes it into
    ``grad`` (same dtype only) and saves the [m, n] allocation, which costs more than the GEMM on a CPU."""
    g = grad.to(u.dtype)
    x = u.mT @ g @ v
    x_f = d[:, None] * x * d[None, :]
    # α·G + (1-α)·U X_f Vᵀ as one GEMM accumulating into α·G: no [m, n] temporaries besides the result
    if in_place and g is grad:
        return grad.addmm_(u, x_f @ v.mT, beta=alpha, alpha=1 - alpha)
    return torch.addmm(g, u, x_f @ v.mT, beta=alpha, alpha=1 - alpha)
