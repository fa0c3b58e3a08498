"""Shared-seed activation masks for pipeline boundaries (paper §"in-graph masking").

At boundary ℓ the hidden state h ∈ R^{B×T×H} is replaced by h̃ = h ⊙ m where every token keeps
exactly K = round((1-p)·H) of its H dims. The keep-set is a pure function

    m = g(ℓ, step, microbatch, T, H, seed)

so the sender and the receiver of a boundary compute the same indices locally and only the
[B, T, K] kept values travel: no index ever crosses the wire. Because the mask is applied inside
the autograd graph (a gather on the sending side, a scatter on the receiving side), the gradient of
the loss w.r.t. h is (∂L/∂h̃) ⊙ m: the backward payload is [B, T, K] with the same indices.

Indices come from a private ``torch.Generator`` seeded by a hash of the arguments, so they do not
depend on (nor disturb) torch's global RNG, and they are identical on every process and machine
(they are always drawn on the CPU; move them to the activation's device afterwards).
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch

from .._validation import require
from .fills import Fill, ZeroFill
from .gather import compact, expand

__all__ = [
    "BoundaryMask",
    "compact",
    "expand",
    "keep_count",
    "keep_indices",
    "mask_seed",
    "private_rng",
    "stable_seed",
]


@contextlib.contextmanager
def private_rng(device: torch.device) -> Iterator[None]:
    """Draw random numbers (e.g. dropout in the anchor's forward) without moving torch's global RNG."""
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices):
        yield


def keep_count(hidden_size: int, mask_ratio: float) -> int:
    """K = round((1 - p) · H): dims kept per token for ``mask_ratio`` (p) at ``hidden_size`` (H)."""
    require(0.0 <= mask_ratio < 1.0, "mask_ratio", mask_ratio, "lie in [0, 1)")
    keep = int(round((1.0 - mask_ratio) * hidden_size))
    require(
        keep >= 1,
        "mask_ratio",
        mask_ratio,
        f"keep at least one of hidden_size={hidden_size} dims per token (K = round((1-p)·H) = 0)",
    )
    return keep


def stable_seed(tag: bytes, *values: int) -> int:
    """A 63-bit seed from integers, the same on every process, machine and Python version.

    A cryptographic hash (not Python's ``hash``, which is salted per process) also decorrelates
    neighbouring inputs such as consecutive steps.
    """
    packed = struct.pack(f"<{len(values)}q", *values)
    digest = hashlib.blake2b(packed, digest_size=8, person=tag[:16]).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def mask_seed(boundary: int, step: int, microbatch: int, seq_len: int, hidden_size: int, seed: int) -> int:
    """The seed of g(ℓ, step, microbatch, T, H, base seed)."""
    return stable_seed(b"meshtune-mask", boundary, step, microbatch, seq_len, hidden_size, seed)


def keep_indices(
    boundary: int,
    step: int,
    microbatch: int,
    seq_len: int,
    hidden_size: int,
    keep: int,
    seed: int,
    protected: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted keep-indices [T, K] (int64, CPU): each token position keeps ``keep`` distinct dims.

    Every row is a uniformly random K-subset of range(H) (top-K of i.i.d. uniforms), so each dim is
    kept with probability K/H. The mask is shared by all rows of the microbatch. ``protected`` dims
    (a fixed set both sides hold, so still no per-step index) are always among the K; the other
    K - m are a uniformly random subset of the remaining dims.
    """
    require(1 <= keep <= hidden_size, "keep", keep, f"lie in [1, hidden_size={hidden_size}]")
    gen = torch.Generator(device="cpu")
    gen.manual_seed(mask_seed(boundary, step, microbatch, seq_len, hidden_size, seed))
    scores = torch.rand(seq_len, hidden_size, generator=gen)
    if protected is not None and protected.numel():
        require(
            protected.numel() < keep, "mask_protect_dims", protected.numel(), f"be < K={keep}, the dims kept per token"
        )
        scores[:, protected] = 2.0  # above every uniform draw
    idx = scores.topk(keep, dim=-1, sorted=False).indices
    return idx.sort(dim=-1).values


@dataclass
class BoundaryMask:
    """The mask of one boundary ℓ: ``apply(h, step, microbatch)`` = expand(compact(h)) in one process.

    Args:
        boundary: ℓ, the boundary index (0 for the boundary after stage 0).
        mask_ratio: p, fraction of dims dropped per token.
        seed: base seed shared by every process of the mesh.
        rescale: multiply kept values by 1/P(kept): H/K, or (H-P)/(K-P) beside P protected dims
            (which stay unscaled); the exact form of dropout's 1/(1-p), off by default
            because the paper's formula is plain h ⊙ m.
        fill: receiver-side value of dropped dims (``ZeroFill`` = the paper).
        protected: dims every token always keeps (e.g. a model's massive-activation dims), a
            fixed set agreed once; None = the paper's uniform mask.
    """

    boundary: int
    mask_ratio: float
    seed: int = 0
    rescale: bool = False
    fill: Fill = field(default_factory=ZeroFill)
    protected: torch.Tensor | None = None

    def __post_init__(self) -> None:
        require(0.0 <= self.mask_ratio < 1.0, "mask_ratio", self.mask_ratio, "lie in [0, 1)")
        if self.fill is None:  # an explicit None is the default too
            self.fill = ZeroFill()
        self._cached: tuple[tuple, torch.Tensor] | None = None

    def indices(
        self, step: int, microbatch: int, seq_len: int, hidden_size: int, device: torch.device | str = "cpu"
    ) -> torch.Tensor:
        """g(ℓ, step, microbatch, T, H, seed) on ``device``; the last one is cached, so a
        gradient-checkpointing recompute (or the receiving side) does not draw it again."""
        protected = None if self.protected is None else tuple(self.protected.tolist())
        key = (step, microbatch, seq_len, hidden_size, str(device), protected)
        if self._cached is None or self._cached[0] != key:
            keep = keep_count(hidden_size, self.mask_ratio)
            idx = keep_indices(self.boundary, step, microbatch, seq_len, hidden_size, keep, self.seed, self.protected)
            self._cached = (key, idx.to(device))
        return self._cached[1]

    def send(self, h: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
        """What crosses the wire: the [B, T, K] kept values (rescaled when asked)."""
        kept = compact(h, idx)
        if self.rescale:
            kept = kept * self._inverse_keep_probability(idx, h.shape[-1]).to(kept.dtype)
        return kept

    def _inverse_keep_probability(self, idx: torch.Tensor, hidden_size: int) -> torch.Tensor:
        """1 / P(dim kept) per kept position ([T, K]): H/K, or, with P protected dims, 1 for them
        and (H-P)/(K-P) for the rest, so that E[h̃] = h holds for every dim (dropout's rule)."""
        keep = idx.shape[-1]
        if self.protected is None or not self.protected.numel():
            return torch.full(idx.shape, hidden_size / keep, dtype=torch.float64, device=idx.device)
        count = self.protected.numel()
        is_protected = torch.isin(idx, self.protected.to(idx.device))
        scale = torch.full(idx.shape, (hidden_size - count) / (keep - count), dtype=torch.float64, device=idx.device)
        return scale.masked_fill(is_protected, 1.0)

    def receive(self, kept: torch.Tensor, idx: torch.Tensor, hidden_size: int) -> torch.Tensor:
        """Rebuild [B, T, H] on the receiving stage from the kept values and the local fill."""
        out = self.fill.rebuild(kept, idx, hidden_size)
        self.fill.observe(kept, idx, hidden_size)
        return out

    def apply(self, h: torch.Tensor, step: int, microbatch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Single-process boundary: returns (h̃, the [B, T, K] payload that would travel)."""
        idx = self.indices(step, microbatch, h.shape[-2], h.shape[-1], h.device)
        kept = self.send(h, idx)
        return self.receive(kept, idx, h.shape[-1]), kept
