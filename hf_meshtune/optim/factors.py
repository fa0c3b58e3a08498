"""The anchor's side of ``anchor_payload="factors"``: it keeps M_anc itself (``AnchorMomentum``) and sends
only its top-r factors (U_r, s_r, V_r), r·(m+n+1) numbers per matrix instead of m·n; the fast optimizer
takes them in ``SpectralAdamW.update_anchor_factors`` and holds no [m, n] momentum."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import Tensor

from .._validation import require
from .basis import _anchor_dtype, _basis_seed, anchor_basis, factor_shapes

__all__ = ["AnchorMomentum", "anchor_momentum"]

logger = logging.getLogger(__name__)


class AnchorMomentum:
    """The anchor's side of ``anchor_payload="factors"``: M_anc per matrix and its top-r factors.

    ``fold(grads)`` does what ``SpectralAdamW.update_anchor`` does to M_anc, M ← β·M + (1-β)·G (float32 at
    least), and returns each matrix's (U_r, s_r, V_r) from ``anchor_basis`` with the test matrix seeded by
    (seed, the matrix's position in ``grads``, folds so far). A delivery with a non-finite value is refused
    whole (M_anc unchanged) and comes back as NaN factors, which the fast optimizer rejects and counts as
    ``anchor/rejected_non_finite``; a matrix whose SVD fails comes back as NaN factors alone (its basis is
    dropped there, ``spectral/svd_fallbacks``).
    """

    def __init__(self, beta: float, rank: int, svd_niter: int = 2, svd_oversample: int = 8, seed: int = 0) -> None:
        require(0 <= beta <= 1, "anchor_beta", beta, "lie in [0, 1]")
        ok_rank = isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1
        require(ok_rank, "spectral_rank", rank, "be an int >= 1 with anchor_payload='factors'")
        self.beta, self.rank, self.seed = beta, rank, seed
        self.svd_niter, self.svd_oversample = svd_niter, svd_oversample
        self.momenta: list[Tensor | None] = []
        self.folds = 0
        self.refused = 0

    @torch.no_grad()
    def fold(self, grads: Sequence[Tensor]) -> list[tuple[Tensor, Tensor, Tensor]]:
        """Fold one dense gradient per matrix into M_anc; the factors to send, in ``grads``' order."""
        if not self.momenta:
            self.momenta = [None] * len(grads)
        require(len(grads) == len(self.momenta), "anchor gradients", len(grads), f"number {len(self.momenta)} matrices")
        if not all(bool(torch.isfinite(g).all()) for g in grads):
            self.refused += 1
            logger.warning("anchor gradient refused: non-finite values; M_anc unchanged, NaN factors sent")
            return [_nan_factors(g.shape, self.rank, g.device, _anchor_dtype(g)) for g in grads]
        out = []
        for index, grad in enumerate(grads):
            dtype = _anchor_dtype(grad)
            momentum = self.momenta[index]
            if momentum is None:
                momentum = self.momenta[index] = torch.zeros(grad.shape, dtype=dtype, device=grad.device)
            momentum.mul_(self.beta).add_(grad.to(dtype), alpha=1 - self.beta)
            seed = _basis_seed(self.seed, index, self.folds)
            try:
                out.append(anchor_basis(momentum, self.rank, self.svd_niter, self.svd_oversample, seed))
            except RuntimeError as err:
                logger.warning("SVD of the anchor momentum %s failed (%s): NaN factors sent", tuple(grad.shape), err)
                out.append(_nan_factors(grad.shape, self.rank, grad.device, dtype))
        self.folds += 1
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"momenta": [None if m is None else m.clone() for m in self.momenta], "folds": self.folds,
                "refused": self.refused}  # fmt: skip

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.momenta = [None if m is None else m.clone() for m in state["momenta"]]
        self.folds, self.refused = int(state["folds"]), int(state.get("refused", 0))


def _nan_factors(shape, rank: int, device, dtype) -> tuple[Tensor, Tensor, Tensor]:
    u, s, v = (torch.full(sh, float("nan"), device=device, dtype=dtype) for sh in factor_shapes(shape, rank))
    return u, s, v


def anchor_momentum(knobs: Any) -> AnchorMomentum | None:
    """The anchor's M_anc for ``anchor_payload="factors"`` (rank ``spectral_rank``, β_anc, the basis seed and
    the SVD settings ``SpectralAdamW`` uses), or None when the anchor sends its gradient or does not feed."""
    if knobs.anchor_payload != "factors" or not knobs.anchor:
        return None
    return AnchorMomentum(knobs.anchor_beta, knobs.spectral_rank, seed=knobs.mask_seed)
