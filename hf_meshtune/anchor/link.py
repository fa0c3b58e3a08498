"""The fast side of the anchor link: dense gradients in, committed outer updates out, and losing the anchor.

Stage s of every fast replica receives the anchor's dense gradients G_anc of stage s on a background
thread (``comm.mailbox.Receiver``) and, once per fast step, ``drain`` hands whatever has arrived to
``SpectralAdamW.update_anchor`` with its staleness (fast steps between its snapshot and now). With
``anchor_payload="factors"`` the anchor sends its momentum's top-r factors (U_r, s_r, V_r) per matrix
instead, and they go to ``SpectralAdamW.update_anchor_factors``. Fast
replica 0 also ``forward``s every committed DiLoCo sync to the anchor's stage s, which replays it
(``anchor.follower``). Nothing here ever waits for the anchor during a step, except with
``anchor_lockstep``: then the gradient of snapshot s (every multiple of ``anchor_every``) is applied
at exactly fast step s + ``anchor_delay``, waited for if it is late, and fast replica 0 ``tick``s the
anchor after each such step so it knows θ_global of s is complete. A broken link means the
anchor replica is gone (``meshtune launch --optional-replica``): the fast side warns once and trains on.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

from torch import nn

from .._validation import require
from ..comm.errors import is_link_error
from ..comm.mailbox import Receiver, Sender
from ..comm.messages import DATA, GRADIENTS, STOP, SYNC, TICK, UPDATES, HeaderRules, flatten, unflatten
from ..comm.pacing import pace_for
from ..comm.pairlink import FIRST_PAIR, PairLinks
from ..comm.wire import Wire
from ..dp.outer import OuterUpdate
from ..optim.basis import factor_shapes
from ..pipeline.stage import StageModule, stage_parameter_names

__all__ = ["FastAnchorLink", "anchor_matrices", "first_lockstep_snapshot"]

logger = logging.getLogger(__name__)


def first_lockstep_snapshot(step: int, every: int) -> int:
    """Lockstep: the first round's snapshot of a run starting at fast step ``step`` (0, or a resume's
    step): the first multiple of ``anchor_every`` at or after it. Both ends of the link use this."""
    return -(-step // every) * every


def anchor_matrices(model: nn.Module, module: StageModule) -> list[tuple[str, nn.Parameter]]:
    """The stage's trainable 2-D parameters, in a fixed order both ends of the anchor link share."""
    return [(n, p) for n, p in stage_parameter_names(model, module).items() if p.requires_grad and p.ndim == 2]


class FastAnchorLink:
    """Stage ``stage`` of fast replica ``replica``'s end of the anchor link (``forwards``: replica 0).

    ``arrivals`` lists (fast step on arrival, snapshot step) of every gradient applied; ``lost_at``
    the fast step at which the link broke (None while it holds). ``lockstep`` = (``anchor_every``,
    ``anchor_delay``) for the lockstep schedule, None for the paper's (apply what has arrived).
    ``factor_rank``: the rank r of the factors the anchor sends (None: it sends its gradient).
    ``rate_mbit``: the cap on what replica 0 forwards (``anchor_rate_mbit``; None: no cap).
    """

    def __init__(
        self,
        wire: Wire,
        group,
        anchor_rank: int,
        matrices: list[tuple[str, nn.Parameter]],
        *,
        forwards: bool,
        who: str,
        max_staleness: int | None,
        lockstep: tuple[int, int] | None = None,
        factor_rank: int | None = None,
        max_step: int,
        close_timeout_s: float | None = None,
        rate_mbit: float | None = None,
    ) -> None:
        self.factor_rank = factor_rank
        self.shapes = [
            shape
            for _, p in matrices
            for shape in ([tuple(p.shape)] if factor_rank is None else factor_shapes(p.shape, factor_rank))
        ]
        numel = sum(math.prod(shape) for shape in self.shapes)
        self.matrices, self.anchor_rank, self.who, self.max_staleness = matrices, anchor_rank, who, max_staleness
        self.inbox = Receiver(wire, group, anchor_rank, GRADIENTS, HeaderRules(max_step, lambda header: numel))
        self.outbox = Sender(wire, group, "anchor", pace_for(rate_mbit)) if forwards else None
        self.arrivals: list[tuple[int, int]] = []
        self.lost_at: int | None = None
        self.lockstep = lockstep
        self.expected: int | None = None  # lockstep: the next snapshot whose gradient is due
        self.ended = False  # lockstep: the inbox ended early (nothing more to wait for; close() says why)
        self.links = group if isinstance(group, PairLinks) else None  # the restartable link of replica jobs
        self.synced = 0  # restartable link: the pair generation the anchor's follower is whole on
        self.syncs: list[int] = []  # restartable link: steps of the SYNCs sent (replica 0)
        self.missed = False  # restartable link: updates were committed while no pair was up (SYNC next)
        self.close_timeout_s = close_timeout_s

    def drain(self, optimizer, step: int, *, final: bool = False) -> None:
        """Every gradient that has arrived goes into the optimizer's anchor momentum (never waits).
        Lockstep: exactly the gradients due by ``step``, waiting for each (``final``: all that came)."""
        if self.lockstep is None or final:
            for message in self.inbox.ready():
                self._take(message, optimizer, step)
            return
        every, delay = self.lockstep
        if self.expected is None:  # the first step of this run (0, or the step a resumed run starts from)
            self.expected = first_lockstep_snapshot(step, every)
        while not self.ended and self.lost_at is None and self.expected + delay <= step:
            message = self.inbox.next()
            if message is None:  # the link broke (a STOP only comes after ours, at the end)
                self.ended = True
                self._take(message, optimizer, step)
                return
            require(
                message[0].snapshot == self.expected,
                "anchor gradient snapshot",
                message[0].snapshot,
                f"be the lockstep schedule's next one, {self.expected} (anchor_every={every})",
            )
            self._take(message, optimizer, step)
            self.expected += every

    def _take(self, message, optimizer, step: int) -> None:
        if message is None:
            if self.inbox.error is not None and is_link_error(self.inbox.error):
                self._lost(self.inbox.error, step)
            return
        header, payload = message
        tensors = unflatten(payload, self.shapes)
        if self.factor_rank is None:
            optimizer.update_anchor(
                {p: g.to(p.device, p.dtype) for (_, p), g in zip(self.matrices, tensors)},
                staleness=step - header.snapshot,
            )
        else:  # (U_r, s_r, V_r) per matrix, in the same order
            triples = [tuple(tensors[3 * i : 3 * i + 3]) for i in range(len(self.matrices))]
            optimizer.update_anchor_factors(
                {p: triple for (_, p), triple in zip(self.matrices, triples)}, staleness=step - header.snapshot
            )
        self.arrivals.append((step, header.snapshot))

    def tick(self, step: int) -> None:
        """Replica 0, lockstep: θ_global after fast step ``step`` (a multiple of ``anchor_every``) is
        complete: every update committed by then is queued ahead of this."""
        if self.outbox is not None:
            self.outbox.put(self.anchor_rank, UPDATES.header_tag, UPDATES.encode(TICK, step, -1, 0))

    def forward(self, updates: list[OuterUpdate], step: int, state: Callable[[], list] | None = None) -> None:
        """Replica 0: queue the syncs committed in fast step ``step - 1`` for the anchor's stage; on a
        new pair of the restartable link, ``state()`` (θ_global and the outer momentum, which already
        hold them) as a SYNC instead."""
        if self.outbox is None or not updates:
            return
        generation = None
        if self.links is not None:
            generation = self.links.generation(self.anchor_rank)
            if generation == 0:  # no pair now: the next one starts with a SYNC
                self.missed = True
                return
            first = self.links.key(self.anchor_rank) == FIRST_PAIR and not self.missed
            if generation != self.synced and not first:
                assert state is not None  # the restartable link's forward always passes it
                payload = flatten(state())
                header = UPDATES.encode(SYNC, step, -1, payload.numel())
                self.outbox.put(self.anchor_rank, UPDATES.header_tag, header, generation)
                self.outbox.put(self.anchor_rank, UPDATES.data_tag, payload, generation)
                self.synced, self.missed = generation, False
                self.syncs.append(step)
                return
            self.synced = generation
        for update in updates:  # int8 syncs go as they travelled: their codes, a quarter of the bytes
            payload = update.codes.pack() if update.codes is not None else flatten(update.tensors)
            header = UPDATES.encode(DATA, step, update.fragment, payload.numel())
            self.outbox.put(self.anchor_rank, UPDATES.header_tag, header, generation)
            self.outbox.put(self.anchor_rank, UPDATES.data_tag, payload, generation)

    def close(self, step: int) -> None:
        """The end of the run at fast step ``step``: STOP to the anchor and wait for its STOP back (what
        arrived meanwhile stays queued for a last ``drain``); a link that broke means the anchor is gone,
        not a bug."""
        if self.outbox is not None:
            generation = None if self.links is None else self.links.generation(self.anchor_rank)
            self.outbox.put(self.anchor_rank, UPDATES.header_tag, UPDATES.encode(STOP, step + 1, -1, 0), generation)
            self._unless_lost(self.outbox.close, step)
            if self.links is not None:  # an anchor that is down now will not wait for our STOP
                self.links.finish()
        # the anchor answers our STOP with its own once its round is done
        self._unless_lost(lambda: self.inbox.join(self.close_timeout_s if self.links is not None else None), step)
        if self.links is not None:
            self.links.shutdown()

    def _unless_lost(self, close: Callable[[], None], step: int) -> None:
        try:
            close()
        except RuntimeError as err:
            cause = err.__cause__ if err.__cause__ is not None else err
            if not is_link_error(cause):
                raise
            self._lost(cause, step)

    def _lost(self, error: BaseException, step: int) -> None:
        """The anchor link broke (its process died or its link is gone): train on without it, once warned."""
        if self.lost_at is not None:
            return
        self.lost_at = step
        staleness = self.max_staleness
        logger.warning(
            "%s lost the anchor link at step %d (%s: %s); training goes on without anchor gradients: "
            "SpectralAdamW keeps its last bases%s",
            self.who,
            step,
            type(error).__name__,
            str(error).splitlines()[0][:200],
            f" and fades them out after anchor_max_staleness={staleness} steps"
            if staleness is not None
            else " (anchor_max_staleness=None: for the rest of the run)",
        )
