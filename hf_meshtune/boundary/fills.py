"""Receiver-side fills: what a receiving stage puts into the dims a boundary mask dropped.

The wire is the same for every fill (K values per token, no indices); only the receiver's local
estimate of the H - K missing dims differs, so fills can be compared without touching the format.

- ``zeros``: the paper's h ⊙ m.
- ``mean``: a running per-dim mean of the values received (no extra traffic).
- ``gaussian``: the conditional mean E[h_dropped | h_kept] under a Gaussian model of h whose mean
  and covariance the anchor replica estimates from its own dense forward passes (it runs the dense
  model anyway) and broadcasts once per anchor round (H² + H numbers per boundary, not per token).
"""

from __future__ import annotations

from typing import Protocol

import torch

from .._validation import require
from .gather import expand

__all__ = ["FILLS", "Fill", "GaussianFill", "MeanFill", "ZeroFill", "require_fill"]


class Fill(Protocol):
    name: str

    def rebuild(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> torch.Tensor: ...
    def observe(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> None: ...
    def observe_dense(self, hidden: torch.Tensor) -> None: ...
    def advance(self) -> None: ...
    def state_dict(self) -> dict: ...
    def load_state_dict(self, state: dict) -> None: ...


class ZeroFill:
    """Dropped dims are zero: the paper's h ⊙ m."""

    name = "zeros"

    def value(self, hidden_size: int) -> torch.Tensor | None:
        return None

    def rebuild(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> torch.Tensor:
        """[B, T, K] kept values → [B, T, H] on the receiving stage."""
        return expand(kept, idx, hidden_size, self.value(hidden_size))

    def observe_dense(self, hidden: torch.Tensor) -> None:
        """Dense activations (the anchor's forward) teach this fill nothing."""

    def observe(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> None:
        """Nothing to learn."""

    def advance(self) -> None:
        """Nothing to fold."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        """Stateless."""


class MeanFill(ZeroFill):
    """Dropped dims take a running per-dim mean of the values the receiver has seen.

    The receiver sees each dim in K/H of the tokens, so it can track E[h_j] without extra traffic.
    Pretrained residual streams have a few huge-mean dims; zero-filling them is what wrecks the
    forward pass (benchmarks/quality), and a mean fill keeps them near their typical value.
    Statistics seen during a step are folded in by ``advance()`` at the next step, so the fill is
    constant within a step: a gradient-checkpointing recompute sees the same fill as the forward.
    """

    name = "mean"

    def __init__(self, momentum: float = 0.1) -> None:
        require(0.0 < momentum <= 1.0, "mask_fill_momentum", momentum, "lie in (0, 1]")
        self.momentum = momentum
        self.mean: torch.Tensor | None = None
        self._sums: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None

    def value(self, hidden_size: int) -> torch.Tensor | None:
        # dims never seen yet (NaN) fall back to the paper's zero
        return None if self.mean is None else torch.nan_to_num(self.mean, nan=0.0)

    @torch.no_grad()
    def observe(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> None:
        if self._sums is None or self._sums.device != kept.device:
            sums = torch.zeros(hidden_size, dtype=torch.float64, device=kept.device)
            counts = torch.zeros(hidden_size, dtype=torch.float64, device=kept.device)
            if self._sums is not None:  # e.g. a checkpoint loaded on the CPU, resumed on a GPU
                assert self._counts is not None  # sums and counts are set and cleared together
                sums += self._sums.to(kept.device)
                counts += self._counts.to(kept.device)
            self._sums, self._counts = sums, counts
        assert self._counts is not None
        flat_idx = idx.expand_as(kept).reshape(-1)
        self._sums.index_add_(0, flat_idx, kept.detach().reshape(-1).double())
        self._counts.index_add_(0, flat_idx, torch.ones_like(flat_idx, dtype=torch.float64))

    @torch.no_grad()
    def advance(self) -> None:
        """Fold the statistics of the finished step into the running mean."""
        if self._sums is None:
            return
        assert self._counts is not None  # sums and counts are set and cleared together
        seen = self._counts > 0
        batch_mean = (self._sums / self._counts.clamp_min(1.0)).float()
        previous = torch.full_like(batch_mean, float("nan")) if self.mean is None else self.mean.to(batch_mean.device)
        # a dim seen for the first time takes its batch mean; later ones move by `momentum`
        updated = torch.where(torch.isnan(previous), batch_mean, torch.lerp(previous, batch_mean, self.momentum))
        self.mean = torch.where(seen, updated, previous)
        self._sums = self._counts = None

    def state_dict(self) -> dict:
        return {
            key: None if value is None else value.clone()
            for key, value in (("mean", self.mean), ("sums", self._sums), ("counts", self._counts))
        }

    def load_state_dict(self, state: dict) -> None:
        self.mean, self._sums, self._counts = (
            None if state.get(key) is None else state[key].clone() for key in ("mean", "sums", "counts")
        )


class GaussianFill(ZeroFill):
    """Dropped dims take E[h_D | h_K] = μ_D + Σ_DK Σ_KK⁻¹ (h_K − μ_K), per token.

    μ and Σ are running estimates from dense activations (``observe_dense``: the anchor's dense
    forward, or a calibration pass before training). The map is linear in the kept values, so the
    backward stays compact: the gradient w.r.t. h_K is g_K + (Σ_DK Σ_KK⁻¹)ᵀ g_D, K values per
    token. A ridge of ``ridge``·mean(diag Σ) keeps Σ_KK invertible. Until the first dense
    observation it is the zero fill. Like ``MeanFill``, observations are folded in by ``advance()``
    at the next step, so a step sees one fixed fill. Cost per boundary and microbatch: a gather of
    T·H·K covariance entries and T solves of K×K systems.
    """

    name = "gaussian"

    def __init__(self, momentum: float = 0.5, ridge: float = 1e-3) -> None:
        require(0.0 < momentum <= 1.0, "mask_fill_momentum", momentum, "lie in (0, 1]")
        require(ridge > 0.0, "mask_fill_ridge", ridge, "be > 0")
        self.momentum, self.ridge = momentum, ridge
        self.mean: torch.Tensor | None = None
        self.cov: torch.Tensor | None = None
        self._pending: list[torch.Tensor] = []

    @torch.no_grad()
    def observe_dense(self, hidden: torch.Tensor) -> None:
        self._pending.append(hidden.detach().reshape(-1, hidden.shape[-1]).double().cpu())

    @torch.no_grad()
    def advance(self) -> None:
        """Fold the dense activations observed since the last step into μ and Σ."""
        if not self._pending:
            return
        tokens = torch.cat(self._pending)
        self._pending = []
        mean = tokens.mean(0)
        centered = tokens - mean
        cov = centered.T @ centered / max(1, tokens.shape[0] - 1)
        if self.mean is None:
            self.mean, self.cov = mean, cov
        else:
            assert self.cov is not None  # mean and cov are set together
            second = self.cov + torch.outer(self.mean, self.mean)
            second = torch.lerp(second, cov + torch.outer(mean, mean), self.momentum)
            self.mean = torch.lerp(self.mean, mean, self.momentum)
            self.cov = second - torch.outer(self.mean, self.mean)

    def rebuild(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> torch.Tensor:
        if self.mean is None:
            return expand(kept, idx, hidden_size)
        assert self.cov is not None  # mean and cov are set together
        work = torch.float64 if kept.dtype == torch.float64 else torch.float32
        mean, cov = self.mean.to(kept.device, work), self.cov.to(kept.device, work)
        ridge = self.ridge * cov.diagonal().mean()
        s_kk = cov[idx.unsqueeze(-1), idx.unsqueeze(-2)]  # [T, K, K]
        s_kk = s_kk + ridge * torch.eye(idx.shape[-1], device=kept.device, dtype=work)
        s_hk = cov[:, idx].permute(1, 0, 2)  # [T, H, K]
        centered = kept.to(work) - mean[idx]  # [B, T, K]
        weights = torch.linalg.solve(s_kk, centered.permute(1, 2, 0))  # [T, K, B]
        full = mean + torch.einsum("thk,tkb->bth", s_hk, weights)
        return full.to(kept.dtype).scatter(-1, idx.expand_as(kept), kept)  # kept dims exactly as sent

    def state_dict(self) -> dict:
        return {"mean": self.mean, "cov": self.cov, "pending": list(self._pending)}

    def load_state_dict(self, state: dict) -> None:
        self.mean, self.cov, self._pending = state["mean"], state["cov"], list(state["pending"])


FILLS = {"zeros": ZeroFill, "mean": MeanFill, "gaussian": GaussianFill}


def require_fill(fill: str, rescale: bool) -> None:
    """The receiver-fill rules (``mask_fill``, ``mask_rescale``), for the knobs and ``attach_boundaries`` alike."""
    require(fill in FILLS, "mask_fill", fill, f"be one of {sorted(FILLS)}")
    require(
        not (rescale and fill != "zeros"),
        "mask_fill",
        fill,
        "be 'zeros' when mask_rescale=True (a rescaled payload and a filled estimate would count the dropped dims "
        "twice)",
    )
