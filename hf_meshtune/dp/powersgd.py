"""PowerSGD (Vogels et al. 2019, arXiv 1905.13727): the math and the per-parameter state.

A [m, n] pseudo-gradient travels as its rank-r factors P [m, r] and Q [n, r], r·(m+n) numbers instead
of m·n, with error feedback so that what the low-rank approximation left out is sent later.
"""

from __future__ import annotations

import math
import zlib
from collections.abc import Callable, Sequence
from typing import Any

import torch

from .._validation import require
from ..ledger import dp_payload_numel

__all__ = ["PowerSGD", "decode", "is_int", "power_iteration"]


def is_int(value: Any, minimum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= minimum


def _orthonormalise(p: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of P's column space (reduced QR; the sign convention cancels in P·Pᵀ)."""
    return torch.linalg.qr(p, mode="reduced").Q


def power_iteration(
    m: torch.Tensor, q: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
) -> tuple[torch.Tensor, torch.Tensor]:
    """One PowerSGD power iteration of M [m, n] from Q [n, r]: P = orth(avg(M·Q)), Q' = avg(Mᵀ·P).

    ``all_reduce`` averages across replicas (identity in one process). ``decode(P, Q')`` = P·P̄ᵀ·M̄ is
    the rank-r approximation; with r ≥ rank(M) it reconstructs M (one process).
    """
    p = _orthonormalise(all_reduce(m @ q))
    return p, all_reduce(m.T @ p)


def orth_factor(p_avg: torch.Tensor) -> torch.Tensor:
    """orth(P̄) in P̄'s dtype, computed in float32: the P every replica (and the anchor) decodes with."""
    return _orthonormalise(p_avg.float()).to(p_avg.dtype)


def decode(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """P·Qᵀ in float32, returned in the factors' dtype: the rank-r pseudo-gradient every replica applies."""
    return (p.float() @ q.float().T).to(p.dtype)


class PowerSGD:
    """Rank-``rank`` (r) PowerSGD state of one process: error feedback e and warm-start Q per parameter.

    A parameter of shape [m, n] is compressed when r·(m+n) < m·n (``hf_meshtune.ledger.dp_payload_numel``);
    everything else travels dense. A round on a compressed parameter with pseudo-gradient Δ:
    M = Δ + e; P = M·Q (all-reduce); P ← orth(P); Q = Mᵀ·P (all-reduce); Δ̂ = P·Qᵀ; e ← M − Δ̂;
    and Q is kept to warm-start the next round. The first Q of parameter ``key`` is drawn from ``seed`` and
    ``key``, so every replica starts with the same Q. Factors travel in Δ's dtype; M, e and Q are
    float32. The rounds are split in three calls (``p_factor``, ``q_factor``, ``commit``) so the
    all-reduces can sit between them; ``round`` runs all three with a given all-reduce.
    """

    def __init__(self, rank: int, seed: int = 0) -> None:
        require(is_int(rank, 1), "powersgd_rank", rank, "be an integer >= 1")
        require(is_int(seed, 0), "seed", seed, "be an integer >= 0")
        self.rank, self.seed = rank, seed
        self.q: dict[str, torch.Tensor] = {}
        self.error: dict[str, torch.Tensor] = {}
        self._m: dict[str, torch.Tensor] = {}  # M of the round in flight

    def compresses(self, shape: Sequence[int]) -> bool:
        return len(shape) == 2 and dp_payload_numel(tuple(shape), self.rank) < math.prod(shape)

    def factor_q(self, key: str, shape: Sequence[int]) -> torch.Tensor:
        """The Q [n, r] the next round of ``key`` starts from (drawn from seed and key the first time)."""
        if key not in self.q:
            gen = torch.Generator().manual_seed(self.seed * 2**32 + zlib.crc32(key.encode()))
            self.q[key] = torch.randn(shape[1], self.rank, generator=gen)
        return self.q[key]

    def p_factor(self, key: str, grad: torch.Tensor, consume: bool = False) -> torch.Tensor:
        """Start a round: M = Δ + e, returns P = M·Q (to all-reduce). ``consume``: Δ is a temporary of the
        caller's (torchft's pseudo-gradient), so a float32 Δ becomes M in place instead of being copied
        (the same values; one copy of the stage fewer at every sync)."""
        delta = grad.detach()
        if consume and delta.dtype == torch.float32:
            m = delta.add_(self.error[key]) if key in self.error else delta
        else:
            m = delta.float() + self.error.get(key, 0.0)
        self._m[key] = m
        return (m @ self.factor_q(key, grad.shape).to(m.device)).to(grad.dtype)

    def q_factor(self, key: str, p_avg: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """From the averaged P: (orth(P), Q = Mᵀ·orth(P)); Q goes to the second all-reduce."""
        p = orth_factor(p_avg)
        return p, (self._m[key].T @ p.float()).to(p_avg.dtype)

    def commit(self, key: str, approx: torch.Tensor, q_avg: torch.Tensor) -> None:
        """Close a round that was applied: e ← M − Δ̂ and Q ← averaged Q (warm start)."""
        m = self._m.pop(key)
        self.error.pop(key, None)  # the old e goes before the new one is made: never two of them at once
        self.error[key] = m.sub_(approx.float())  # M is this round's own tensor: e ← M − Δ̂ in place
        self.q[key] = q_avg.detach().float().clone()

    def discard(self) -> None:
        """Drop rounds that were not applied (failed commit): e and Q stay as they were."""
        self._m.clear()

    def round(
        self, key: str, grad: torch.Tensor, all_reduce: Callable[[torch.Tensor], torch.Tensor] = lambda t: t
    ) -> torch.Tensor:
        """A whole round of ``key``; returns Δ̂ (``grad`` itself when the shape is not compressed)."""
        if not self.compresses(grad.shape):
            return all_reduce(grad)
        p, q = self.q_factor(key, all_reduce(self.p_factor(key, grad)))
        q = all_reduce(q)
        approx = decode(p, q)
        self.commit(key, approx, q)
        return approx
