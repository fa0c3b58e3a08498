"""Int8 pseudo-gradients with a shared scale and error feedback: a quarter of the bytes of a float32 sync.

A sync's dense pseudo-gradients travel as int8 codes, summed by the all-reduce itself (no all-gather, so
the ring's traffic is that of a float32 all-reduce divided by four, plus 4 bytes per ``BLOCK`` values).
Per sync, with n replicas taking part:

1. M = Δ + e for every tensor (e: what this replica's codes left out at its last committed sync),
   flattened and cut into blocks of ``BLOCK`` values; each block's max |M| is all-reduced with MAX, so
   every replica codes the block with the same scale s.
2. The codes q = round(M · L / s), L = ⌊127 / n⌋, lie in [−L, L], so the sum of n of them fits int8;
   they are all-reduced with SUM, in int8.
3. The average is Σq · s / (n · L); once the sync commits, e ← M − q · s / L.

Error feedback makes the rounding unbiased over syncs: what one sync rounds away is sent with the next.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .._validation import require
from ..config import DP_QUANT_BLOCK, DP_QUANTIZERS

__all__ = ["BLOCK", "QUANTIZERS", "Int8Codes", "Int8Sum", "coded_words"]

BLOCK = DP_QUANT_BLOCK  # values per shared scale: the scales add 4 / 256 bytes per value (1.6 % of the codes)
QUANTIZERS = DP_QUANTIZERS


def levels(participants: int) -> int:
    """L = ⌊127 / n⌋: the largest code, so that n codes sum inside int8."""
    require(1 <= participants <= 127, "participants", participants, "lie in [1, 127] for int8 pseudo-gradients")
    return 127 // participants


def average(summed: torch.Tensor, scales: torch.Tensor, participants: int, shapes, block: int = BLOCK) -> list:
    """The average Σq · s / (n · L) of summed codes (padded to whole blocks), as float32 tensors of ``shapes``."""
    n = participants
    flat = (summed.float().view(-1, block) * (scales.float().unsqueeze(1) / (n * levels(n)))).reshape(-1)
    out, start = [], 0
    for shape in shapes:
        size = math.prod(shape)
        out.append(flat[start : start + size].view(*shape))
        start += size
    return out


def _padded(numel: int, block: int) -> int:
    return -(-numel // block) * block


def coded_words(numels: Sequence[int], block: int = BLOCK) -> int:
    """Float32 words of ``Int8Codes.pack`` for rounds of ``numels`` values: the count of replicas, then per
    round its codes padded to whole blocks (4 to a word) and a word per block (its maximum)."""
    return 1 + sum(_padded(n, block) // 4 + _padded(n, block) // block for n in numels if n)


@dataclass
class Int8Codes:
    """A committed int8 sync as it travelled: per all-reduce round (the P factors with the dense tensors,
    then the Q factors if PowerSGD compresses any) its summed int8 codes and float32 block maxima, and the
    number of replicas n that coded it. An observer decodes it with the replicas' own arithmetic
    (``average``), so it needs a quarter of the bytes of the decoded float32 tensors."""

    participants: int
    rounds: list[tuple[torch.Tensor, torch.Tensor]]

    def average(self, round_index: int, shapes) -> list[torch.Tensor]:
        codes, scales = self.rounds[round_index]
        return average(codes, scales, self.participants, shapes, codes.numel() // scales.numel())

    def pack(self) -> torch.Tensor:
        """One float32 tensor of the sync (the anchor link's payload): n, then each round's codes (their
        bytes, 4 to a word) and block maxima. The code words are bytes, never arithmetic: they travel
        and are copied as they are."""
        parts = [torch.tensor([float(self.participants)])]
        for codes, scales in self.rounds:
            parts += [codes.contiguous().view(torch.float32), scales.float()]
        return torch.cat(parts)

    @classmethod
    def unpack(cls, words: torch.Tensor, numels: Sequence[int], block: int = BLOCK) -> Int8Codes:
        """The inverse of ``pack`` for rounds of ``numels`` values (a round of 0 values was not sent)."""
        require(
            words.numel() == coded_words(numels, block),
            "int8 sync size",
            words.numel(),
            f"equal {coded_words(numels, block)} words for rounds of {list(numels)} values",
        )
        participants = int(words[0].item())
        require(1 <= participants <= 127, "int8 sync participants", participants, "lie in [1, 127]")
        rounds, start = [], 1
        for n in numels:
            if not n:
                continue
            padded = _padded(n, block)
            codes = words[start : start + padded // 4].contiguous().view(torch.int8)
            start += padded // 4
            rounds.append((codes, words[start : start + padded // block]))
            start += padded // block
        return cls(participants, rounds)


class Int8Sum:
    """One process's int8 coding of its dense pseudo-gradients: error feedback per tensor and the round in
    flight. A round: ``start`` (→ block maxima to MAX-reduce), ``codes`` (→ int8 codes to SUM-reduce),
    ``decode`` (→ the averaged tensors), then ``commit`` if the sync was applied or ``discard``."""

    def __init__(self, block: int = BLOCK) -> None:
        self.block = block
        self.error: dict[str, torch.Tensor] = {}
        self._keys: list[str] = []
        self._shapes: list[torch.Size] = []
        self._m: torch.Tensor | None = None  # M of the round in flight, flat, padded to whole blocks
        self._new_error: torch.Tensor | None = None
        self._participants = 0
        self._without: set[str] = set()

    def start(self, items: Sequence[tuple[str, torch.Tensor]], without_feedback: Collection[str] = ()) -> torch.Tensor:
        """M = Δ + e of every (key, Δ); returns the float32 max |M| of each block (all-reduce it with MAX).
        Keys in ``without_feedback`` are coded without error feedback (PowerSGD's factors: PowerSGD's own
        error feedback, on the decoded approximation, takes in what their codes left out)."""
        self._keys = [key for key, _ in items]
        self._shapes = [delta.shape for _, delta in items]
        self._without = set(without_feedback)
        parts = []
        for key, delta in items:
            m = delta.detach().float().reshape(-1)
            parts.append(m + self.error[key].reshape(-1) if key in self.error and key not in self._without else m)
        flat = torch.cat(parts)
        self._m = F.pad(flat, (0, (-flat.numel()) % self.block))
        return self._m.view(-1, self.block).abs().amax(1)

    def codes(self, scales: torch.Tensor, participants: int) -> torch.Tensor:
        """The int8 codes of M under the shared block maxima ``scales`` (all-reduce them with SUM)."""
        top = levels(participants)
        assert self._m is not None  # start() came first
        blocks = self._m.view(-1, self.block)
        s = scales.float().unsqueeze(1)
        safe = torch.where(s > 0, s, torch.ones_like(s))  # an all-zero block codes as zeros
        q = torch.round(blocks * (top / safe)).clamp_(-top, top)
        self._new_error = (blocks - q * (safe / top)).reshape(-1)
        self._participants = participants
        return q.to(torch.int8).reshape(-1)

    def decode(self, summed: torch.Tensor, scales: torch.Tensor) -> list[torch.Tensor]:
        """The average Σq · s / (n · L), as float32 tensors of the started shapes."""
        return average(summed, scales, self._participants, self._shapes, self.block)

    def commit(self) -> None:
        """The sync was applied: e ← M − q · s / L for every tensor of the round with error feedback."""
        error, start = self._new_error, 0
        for key, shape in zip(self._keys, self._shapes):
            size = shape.numel()
            if key not in self._without:
                assert error is not None  # codes() came first
                self.error[key] = error[start : start + size].view(shape).clone()
            start += size
        self.discard()

    def discard(self) -> None:
        """Drop the round in flight (a failed sync): e stays as it was."""
        self._m = self._new_error = None
        self._keys, self._shapes = [], []

    def busy(self) -> bool:
        return self._m is not None
