"""The anchor replica keeps θ_global current by replaying DiLoCo's committed outer steps.

The anchor is outside the fast replicas' DiLoCo group: instead of pulling snapshots, every stage of
it receives each committed sync of its stage in wire form (``dp.outer.OuterUpdate``, forwarded by
fast replica 0) and applies the same outer Nesterov step, so its parameters equal the fast
replicas' θ_global after every sync, bitwise on the same kernels.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from .._validation import require
from ..comm.messages import unflatten
from ..dp.outer import OuterUpdate, apply_outer_step, check_outer, outer_optimizer
from ..dp.powersgd import PowerSGD
from ..dp.quantize import Int8Codes, coded_words
from ..memory import tensor_bytes

__all__ = ["OuterFollower", "read_update", "sync_shapes", "update_numel", "update_shapes"]


class OuterFollower:
    """Replays committed outer steps on a process outside the DiLoCo group (the mesh's anchor replica).

    It holds the same fragments (parameters starting equal to θ_global) and the same outer optimizer
    per fragment; ``apply`` every ``OuterUpdate`` of its stage, in commit order, and its parameters
    equal the fast replicas' θ_global after each sync. Gradients the process holds are kept.
    """

    def __init__(self, fragments: list[nn.Module], *, outer_lr: float, outer_momentum: float) -> None:
        require(len(fragments) >= 1, "fragments", len(fragments), "hold at least one module")
        check_outer(outer_lr, outer_momentum)
        self.fragments = fragments
        self._params = [list(f.parameters()) for f in fragments]
        self._optimizers = [outer_optimizer(ps, outer_lr, outer_momentum) for ps in self._params]

    def state_bytes(self) -> int:
        """Bytes of the outer momentum it replays (``memory``)."""
        return tensor_bytes([optimizer.state for optimizer in self._optimizers])

    def apply(self, update: OuterUpdate) -> None:
        require(
            0 <= update.fragment < len(self.fragments),
            "update.fragment",
            update.fragment,
            f"lie in [0, {len(self.fragments)})",
        )
        params = self._params[update.fragment]
        kept = [p.grad for p in params]
        grads = update.pseudo_gradients([p.shape for p in params])
        apply_outer_step(
            params, [g.to(p.device, p.dtype) for p, g in zip(params, grads)], self._optimizers[update.fragment]
        )
        for p, g in zip(params, kept):
            p.grad = g

    def load_state(self, fragments: Sequence[dict]) -> None:
        """θ_global and the outer momentum of every fragment from a fast replica's DiLoCo state
        (``StreamingDiLoCo.state_dict()["fragments"]``: a mesh checkpoint)."""
        with torch.no_grad():
            for fragment, saved, optimizer in zip(self.fragments, fragments, self._optimizers):
                for name, param in fragment.named_parameters():
                    param.copy_(saved["original"][name])
                optimizer.load_state_dict(saved["outer"])

    def load_sync(self, tensors: Sequence[torch.Tensor]) -> None:
        """θ_global and the outer momentum of every fragment from a fast replica's SYNC
        (``StreamingDiLoCo.sync_tensors`` order, ``sync_shapes``): the anchor's follower is whole again
        whatever updates it missed while its link was down."""
        at = 0
        with torch.no_grad():
            for params, optimizer in zip(self._params, self._optimizers):
                count = len(params)
                values, momenta = tensors[at : at + count], tensors[at + count : at + 2 * count]
                at += 2 * count
                for param, value, momentum in zip(params, values, momenta):
                    param.copy_(value)
                    optimizer.state[param]["momentum_buffer"] = momentum.to(param.device, param.dtype).clone()
        require(at == len(tensors), "sync tensors", len(tensors), f"be {at}: two per parameter of every fragment")


def sync_shapes(fragment_shapes: Sequence[Sequence[torch.Size]]) -> list[tuple[int, ...]]:
    """Shapes of a SYNC's tensors (``StreamingDiLoCo.sync_tensors``): per fragment its parameters, then
    their outer momentum."""
    return [tuple(shape) for shapes in fragment_shapes for shape in (*shapes, *shapes)]


def update_shapes(shapes: Sequence[torch.Size], rank: int | None) -> list[tuple[int, ...]]:
    """Shapes of an outer update's wire tensors: PowerSGD's P [m, r] and Q [n, r] for a compressed
    [m, n] parameter, the parameter's own shape otherwise (``OuterUpdate.tensors`` order)."""
    codec = PowerSGD(rank) if rank is not None else None
    out: list[tuple[int, ...]] = []
    for shape in shapes:
        if codec is not None and codec.compresses(shape):
            assert rank is not None  # codec is built from it
            out += [(shape[0], rank), (shape[1], rank)]
        else:
            out.append(tuple(shape))
    return out


def _rounds(shapes: Sequence[torch.Size], rank: int | None) -> list[int]:
    """Values of each int8 round of a sync (``dp.diloco``): the P factors with the dense tensors, then the Q
    factors."""
    codec = PowerSGD(rank) if rank is not None else None
    first = second = 0
    for shape in shapes:
        if codec is not None and codec.compresses(shape):
            assert rank is not None  # codec is built from it
            first, second = first + shape[0] * rank, second + shape[1] * rank
        else:
            first += math.prod(shape)
    return [first, second]


def update_numel(shapes: Sequence[torch.Size], rank: int | None, quantize: str | None) -> int:
    """Float32 words of a fragment's outer update on the anchor link: its wire tensors (``update_shapes``), or
    with int8 codes the packed codes (``dp.quantize.Int8Codes.pack``)."""
    if quantize is not None:
        return coded_words(_rounds(shapes, rank))
    return sum(math.prod(shape) for shape in update_shapes(shapes, rank))


def read_update(
    payload: torch.Tensor,
    fragment: int,
    step: int,
    shapes: Sequence[torch.Size],
    rank: int | None,
    quantize: str | None,
) -> OuterUpdate:
    """The ``OuterUpdate`` of fragment ``fragment`` from its anchor-link payload (``AnchorLink.forward``)."""
    if quantize is not None:
        codes = Int8Codes.unpack(payload, _rounds(shapes, rank))
        return OuterUpdate.from_codes(fragment, step, codes, shapes, rank)
    return OuterUpdate(fragment=fragment, step=step, tensors=unflatten(payload, update_shapes(shapes, rank)), rank=rank)
