"""The outer step of DiLoCo (Douillard et al. 2023, arXiv 2311.08105) and a committed sync in wire form.

Every fast replica applies the averaged pseudo-gradient with the same outer Nesterov SGD; an
``OuterUpdate`` is what a committed fragment sync averaged, exactly as it travelled, so an observer
outside the DiLoCo group (the anchor replica, ``anchor.follower``) can replay the same outer step.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import nn

from .._validation import require
from .powersgd import PowerSGD, decode, orth_factor
from .quantize import Int8Codes

__all__ = ["OuterUpdate", "apply_outer_step", "check_outer", "outer_optimizer"]


def outer_optimizer(params, lr: float, momentum: float) -> torch.optim.SGD:
    """The outer optimizer of one fragment: Nesterov SGD (η_out, μ_out), as in the DiLoCo paper.

    ``foreach=False``: the foreach path adds the momentum into ``p.grad`` in place, which would change
    a pseudo-gradient an ``OuterUpdate`` still holds; the per-tensor path also makes replicas and
    followers run the very same kernels.
    """
    # μ_out = 0 is plain SGD on the averaged pseudo-gradient (η_out = 1: parameter averaging); torch refuses
    # Nesterov without momentum, so it is asked for only with one
    return torch.optim.SGD(params, lr=lr, momentum=momentum, nesterov=momentum > 0, foreach=False)


@dataclass
class OuterUpdate:
    """A committed fragment sync in wire form: enough for an observer to replay the outer step.

    ``step`` is the torchft manager step after the commit (``manager.current_step()``), i.e. how many
    syncs of this stage have committed so far, this one included; fragment ``(step-1) % F`` is the one
    synced. ``tensors`` follow the fragment's parameter order: (P orthonormalised, Q averaged) for a
    compressed parameter, the averaged pseudo-gradient for a dense one. ``rank`` is r (None: no
    compression). ``codes``: with int8 codes (``dp.quantize``), the sync as it travelled, a quarter of
    the tensors' bytes: what the anchor is sent (``from_codes`` rebuilds the tensors from it).
    """

    fragment: int
    step: int
    tensors: list[torch.Tensor]
    rank: int | None = None
    codes: Int8Codes | None = None

    @classmethod
    def from_codes(
        cls, fragment: int, step: int, codes: Int8Codes, shapes: Sequence[Sequence[int]], rank: int | None
    ) -> OuterUpdate:
        """The update the replicas committed, rebuilt from its int8 codes with their arithmetic: the first
        round decoded (P̄ and the dense averages), P̄ orthonormalised (``powersgd.orth_factor``), the
        second round decoded (Q̄). Bitwise the replicas' tensors on the same kernels, in float32."""
        codec = PowerSGD(rank) if rank is not None else None
        squeezed = [codec is not None and codec.compresses(shape) for shape in shapes]
        first = codes.average(0, [(s[0], rank) if c else tuple(s) for s, c in zip(shapes, squeezed)])
        factors = [(s[1], rank) for s, c in zip(shapes, squeezed) if c]
        second = iter(codes.average(1, factors) if factors else [])
        tensors: list[torch.Tensor] = []
        for average, compressed in zip(first, squeezed):
            if compressed:
                orth = orth_factor(average)
                tensors += [orth, next(second).to(orth.dtype)]
            else:
                tensors.append(average)
        return cls(fragment, step, tensors, rank, codes)

    def pseudo_gradients(self, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """The averaged pseudo-gradient Δ̄ of each parameter, exactly as the replicas applied it.

        The replicas decode through this very method, so the result is bitwise theirs on the same
        kernels (dense entries are returned as they are, not copied).
        """
        codec = PowerSGD(self.rank) if self.rank is not None else None
        grads, i = [], 0
        for shape in shapes:
            if codec is not None and codec.compresses(shape):
                grads.append(decode(self.tensors[i], self.tensors[i + 1]))
                i += 2
            else:
                grads.append(self.tensors[i])
                i += 1
        require(
            i == len(self.tensors),
            "shapes",
            [tuple(s) for s in shapes],
            f"describe all {len(self.tensors)} tensors of the update (consumed {i})",
        )
        return grads


def apply_outer_step(params: list[nn.Parameter], grads: list[torch.Tensor], optimizer) -> None:
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def check_outer(lr: float, momentum: float) -> None:
    require(isinstance(lr, (int, float)) and lr > 0, "outer_lr", lr, "be > 0")
    require(isinstance(momentum, (int, float)) and 0 <= momentum < 1, "outer_momentum", momentum, "lie in [0, 1)")
