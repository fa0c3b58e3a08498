"""The two halves of a boundary: ``compact`` (sender: keep K of H values per token) and ``expand``
(receiver: put them back among H, the rest from a fill). Gather and scatter are each other's
autograd, so the backward payload is compact too."""

from __future__ import annotations

import torch

__all__ = ["compact", "expand"]


def compact(h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """Sending side: [B, T, H] → [B, T, K] kept values. Autograd of a gather is a scatter."""
    return h.gather(-1, idx.expand(*h.shape[:-1], idx.shape[-1]))


def expand(x: torch.Tensor, idx: torch.Tensor, hidden_size: int, fill: torch.Tensor | None = None) -> torch.Tensor:
    """Receiving side: [B, T, K] → [B, T, H], kept values at ``idx`` and ``fill`` (default 0) elsewhere.

    ``fill`` is a tensor broadcastable to [B, T, H] that never receives a gradient: whatever the
    receiver puts into dropped dims is its own local estimate, not something sent.
    """
    shape = (*x.shape[:-1], hidden_size)
    base = x.new_zeros(shape) if fill is None else fill.detach().to(x.device, x.dtype).expand(shape).clone()
    return base.scatter(-1, idx.expand_as(x), x)
