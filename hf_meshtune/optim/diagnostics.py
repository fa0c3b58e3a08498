"""What ``SpectralAdamW`` reports after a step: how much of the dense anchor direction the masked gradient G
and the filtered G_proj carry (their cosines with M_anc) and the mean filter value d, summed on the device
and read back once per step."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

__all__: list[str] = []


@dataclass
class _Diagnostics:
    """Per-matrix <G,M>, <G_proj,M>, |G|², |G_proj|², |M|² and mean d, summed once per step."""

    rows: list[Tensor] = field(default_factory=list)
    stale: int = 0  # matrices whose basis is past max_staleness this step

    def add(self, grad: Tensor, proj: Tensor, momentum: Tensor, d: Tensor) -> None:
        # dot products of flat views: one read of each operand, no [m, n] temporaries
        g, p, m = (t.to(momentum.dtype).reshape(-1) for t in (grad, proj, momentum))
        terms = [torch.dot(g, m), torch.dot(p, m), torch.dot(g, g), torch.dot(p, p), torch.dot(m, m)]
        terms.append(d.mean() if d.numel() else d.new_zeros(()))
        self.rows.append(torch.stack(terms))  # stays on device: one host sync per step, in as_dict

    def add_factors(self, grad: Tensor, proj: Tensor, u: Tensor, s: Tensor, v: Tensor, d: Tensor) -> None:
        """``add`` against M = U diag(s) Vᵀ (orthonormal U, V): <X, M> = Σ s_i·u_iᵀ X v_i, |M|² = Σ s_i²."""
        g, p = grad.to(u.dtype), proj.to(u.dtype)
        g_uv = ((u.mT @ g) * v.mT).sum(1)  # diag(Uᵀ G V) without the [r, r] product
        p_uv = ((u.mT @ p) * v.mT).sum(1)
        terms = [torch.dot(s, g_uv), torch.dot(s, p_uv), torch.dot(g.reshape(-1), g.reshape(-1))]
        terms += [torch.dot(p.reshape(-1), p.reshape(-1)), torch.dot(s, s)]
        terms.append(d.mean() if d.numel() else d.new_zeros(()))
        self.rows.append(torch.stack(terms))

    def as_dict(self) -> dict[str, float]:
        if not self.rows:
            return {}
        device = self.rows[0].device
        rows = [row.to(device, torch.float64) for row in self.rows]
        gm, pm, gg, pp, mm, d_sum = torch.stack(rows).sum(0).tolist()
        count = len(self.rows)

        def cos(dot: float, a: float, b: float) -> float:
            return dot / (a * b) ** 0.5 if a > 0 and b > 0 else 0.0

        return {
            "spectral/cos_masked_vs_anchor": cos(gm, gg, mm),
            "spectral/cos_filtered_vs_anchor": cos(pm, pp, mm),
            "spectral/filter_mean_d": d_sum / count,
            "spectral/matrices_filtered": float(count),
        }
