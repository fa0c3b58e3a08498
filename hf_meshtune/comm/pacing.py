"""The anchor link's payloads go in chunks, and a rate cap spaces the chunks out.

Every payload on the anchor link (the anchor's deliveries, the outer updates and SYNCs fast replica 0
forwards) travels as consecutive chunks of at most ``CHUNK_BYTES`` bytes, sent and received with the
same tag in the same order, so both ends cut a payload the same way without being told (``chunks``).

With ``anchor_rate_mbit`` set, a ``Pace`` spaces the chunks so that one pair of the link never carries
more than that rate on average, and never more than one chunk at the link's own speed: a delivery
that would otherwise arrive as one burst and sit in front of a fast node's pipeline and DP traffic in
its link's queue trickles in beside it instead. The anchor is asynchronous, so a slower delivery costs
staleness, not fast steps. Pacing is a cap, not a priority: traffic under the cap still shares the
link with the fast circuits on equal terms.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import torch

from .._validation import require

__all__ = ["CHUNK_BYTES", "Pace", "chunks", "pace_for"]

# 64 KiB: at a few Mbit/s one chunk holds a link for ~0.1 s, and a chunk costs one more gloo message
CHUNK_BYTES = 1 << 16


def chunks(tensor: torch.Tensor) -> Iterator[torch.Tensor]:
    """Consecutive views of ``tensor`` (contiguous, flattened) of at most ``CHUNK_BYTES`` bytes each;
    an empty tensor has none."""
    require(tensor.is_contiguous(), "tensor", "not contiguous", "be contiguous to travel in chunks")
    flat = tensor.view(-1)
    step = max(1, CHUNK_BYTES // flat.element_size())
    for start in range(0, flat.numel(), step):
        yield flat[start : start + step]


class Pace:
    """A cap of ``rate_bytes_s`` on one sender: ``wait(nbytes)`` returns once ``nbytes`` more may go
    without the average rate since the first send exceeding the cap (the first chunk goes at once).

    ``clock`` and ``sleep`` are injectable for tests (``time.monotonic`` and ``time.sleep``).
    """

    def __init__(
        self,
        rate_bytes_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], None] = time.sleep,
    ) -> None:
        require(rate_bytes_s > 0, "rate_bytes_s", rate_bytes_s, "be > 0")
        self.rate, self.clock, self.sleep = float(rate_bytes_s), clock, sleep
        self.free_at: float | None = None  # when the link is free of what was already let go

    def wait(self, nbytes: int) -> None:
        now = self.clock()
        if self.free_at is not None and self.free_at > now:
            self.sleep(self.free_at - now)
            now = self.free_at
        self.free_at = now + nbytes / self.rate


def pace_for(rate_mbit: float | None) -> Pace | None:
    """A ``Pace`` for a cap of ``rate_mbit`` Mbit/s (None: unpaced)."""
    return None if rate_mbit is None else Pace(rate_mbit * 1e6 / 8)
