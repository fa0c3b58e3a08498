"""The fidelity governor on the distributed mesh: probes through the anchor's pipeline, levels to the fast stages.

Anchor side (``MeshGovernor``, one per anchor stage). After a round's dense pass, the anchor replica
runs the round's batch through its pipeline once more per probe (boundary b, ladder level L): anchor
stage b codes its outgoing hidden state with L's codec on the way out (``SendProbe``, the decoded h̃
travels dense, so the anchor's pipeline keeps its widths), every other boundary stays dense, and every
stage replays the dense pass's RNG. Each stage compares its own gradients with the dense pass's, in
float64 sums (dot, both squared norms), and stage b adds the activation error of h̃ and the error of
dL/dh arriving back at it; one SUM all-reduce over the anchor's pipeline group gives every anchor stage
every stage's sums, so all of them compute the same cosines and the same decision
(``FidelityGovernor``; the cosine is taken on stage b's matrices, or on the stages after b where b
trains none, as in ``anchor.fidelity``). The probes measure the anchor's own geometry: fitted on its
first round's dense pass and refitted with every geometry refit it sends (``anchor.geometry``).

The decision (every boundary's level) goes to stage s of every fast replica as a ``LEVELS`` message with
the fast step after which it counts: with ``anchor_lockstep`` the first round's after its ``snapshot`` (the
start: one wait, like the codec's own calibration) and a later round's after ``snapshot + anchor_delay``,
where its gradient is applied; with the asynchronous anchor after its ``snapshot``, i.e. as soon as the
replica's stages all hold it (its gradient, too, is applied on arrival there).

Fast side (``FastLevelLink``): after each fast step, the replica's stages agree (``agree_min``, with the
geometry's proposal when both run) on the newest decision all of them hold that may count now
(lockstep: each waited for at its step, so runs repeat exactly), and at a new level every stage sets its
sides' codecs and rebuilds its pipeline stage for the new payload widths, all at the same step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.distributed as dist

from .._validation import require
from ..boundary.compose.codec import ComposedCodec
from ..comm.errors import is_link_error
from ..comm.mailbox import Receiver
from ..comm.messages import DATA, LEVELS, HeaderRules
from ..comm.wire import Wire
from .governor import FidelityGovernor, candidate_levels
from .link import first_lockstep_snapshot

__all__ = ["FastLevelLink", "MeshGovernor", "SendProbe", "levels_message", "reduce_over"]

# the float64 sums each anchor stage contributes per probe: dot(ĝ, g), ‖ĝ‖², ‖g‖², matrices held,
# ‖h̃ − h‖², ‖h‖², ‖dL/dh̃ − dL/dh‖², ‖dL/dh‖² (the last four on the boundary's sending stage only)
SUMS = 8


class SendProbe:
    """What anchor stage b's ``StageModule.send`` does with its outgoing hidden state during a round.

    ``codec`` None (the dense pass): h passes unchanged and dL/dh is kept per microbatch. Else h goes
    through ``codec`` (encode then decode, both ways in autograd, as on a fast boundary) and the probe
    sums the activation error and keeps the dL/dh the codec hands back."""

    def __init__(self, codec: ComposedCodec | None = None) -> None:
        self.codec = codec
        self.act_num = self.act_den = 0.0
        self.grads: dict[int, torch.Tensor] = {}  # microbatch → dL/dh on the sending side

    def __call__(self, hidden: torch.Tensor, step: int, microbatch: int) -> torch.Tensor:
        if self.codec is not None:
            rebuilt, _ = self.codec.apply(hidden, step, microbatch)
            dense = hidden.detach().double()
            self.act_num += float((rebuilt.detach().double() - dense).pow(2).sum())
            self.act_den += float(dense.pow(2).sum())
        else:
            rebuilt = hidden
        if hidden.requires_grad:

            def keep(grad: torch.Tensor, microbatch: int = microbatch) -> None:
                self.grads[microbatch] = grad.detach().double().clone()

            hidden.register_hook(keep)
        return rebuilt


def levels_message(snapshot: int, counts_after: int, levels: Sequence[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """A ``LEVELS`` message: (header, payload)."""
    payload = torch.tensor([float(lv) for lv in levels], dtype=torch.float32)
    return LEVELS.encode(DATA, snapshot, counts_after, payload.numel()), payload


class MeshGovernor:
    """Anchor stage ``stage`` of ``stages``: the probes of its outgoing boundary and the shared decision.

    Args:
        ladder: this stage's codecs of its outgoing boundary, one per level (None on the last stage).
        names: the ladder's levels as codec strings (the log keys).
        governor: the policy.
        matrices: this stage's (name, parameter) the anchor sends gradients of.
        reduce: ``reduce(tensor)`` sums a float64 tensor over the anchor's pipeline group in place.
    """

    def __init__(
        self,
        stage: int,
        stages: int,
        ladder: list[ComposedCodec] | None,
        names: list[str],
        governor: FidelityGovernor,
        matrices: list,
        reduce: Callable[[torch.Tensor], None],
    ) -> None:
        self.stage, self.stages, self.ladder, self.names = stage, stages, ladder, names
        self.levels, self.governor, self.matrices, self.reduce = len(names), governor, matrices, reduce
        self.decided: list[int] | None = None  # the newest levels chosen (None: no round yet)
        self.probe_passes = 0
        self.entries: list[dict[str, float]] = []  # per round: the fidelity/* and governor/* entries

    @property
    def boundaries(self) -> int:
        return self.stages - 1

    def probes(self) -> list[tuple[int, int]]:
        """(boundary, level) of this round's probes: every level at the first round, then the current
        level and its neighbours (the same list on every anchor stage)."""
        out = []
        for boundary in range(self.boundaries):
            levels: Sequence[int]
            if self.decided is None:
                levels = range(self.levels)
            else:
                levels = candidate_levels(self.decided[boundary], self.levels)
            out += [(boundary, level) for level in levels]
        return out

    def _sums(self, probe: SendProbe | None, dense: list[torch.Tensor], dense_probe: SendProbe) -> torch.Tensor:
        row = torch.zeros(SUMS, dtype=torch.float64)
        grads = [p.grad for _, p in self.matrices]
        for g, d in zip(grads, dense):
            if g is None:
                continue
            g64, d64 = g.detach().double(), d.double()
            row[0] += float((g64 * d64).sum())
            row[1] += float(g64.pow(2).sum())
            row[2] += float(d64.pow(2).sum())
        row[3] = float(len(self.matrices))
        if probe is not None:
            row[4], row[5] = probe.act_num, probe.act_den
            for microbatch, grad in probe.grads.items():
                reference = dense_probe.grads.get(microbatch)
                if reference is not None:
                    row[6] += float((grad - reference).pow(2).sum())
                    row[7] += float(reference.pow(2).sum())
        return row

    def round(
        self,
        module,
        dense: list[torch.Tensor],
        dense_probe: SendProbe,
        run_pass: Callable[[], None],
        step: int,
    ) -> list[int]:
        """After the round's dense pass (its gradients ``dense``, its ``dense_probe``): run every probe
        pass, share the sums, decide. ``run_pass()`` runs one pipeline pass of the round's batch from the
        dense pass's RNG state, leaving this stage's gradients in ``matrices`` (every anchor stage calls it
        for every probe, in the same order)."""
        probes = self.probes()
        sums = torch.zeros(len(probes), self.stages, SUMS, dtype=torch.float64)
        for index, (boundary, level) in enumerate(probes):
            probe = None
            if boundary == self.stage:  # this stage's outgoing boundary, whose ladder it holds
                assert self.ladder is not None
                probe = SendProbe(self.ladder[level])
            module.probe = probe
            try:
                run_pass()
            finally:
                module.probe = None
            self.probe_passes += 1
            sums[index, self.stage] = self._sums(probe, dense, dense_probe)
        self.reduce(sums)
        decided = self.decided
        chosen, entries = [], {}
        for boundary in range(self.boundaries):
            cos = {}
            for index, (b, level) in enumerate(probes):
                if b != boundary:
                    continue
                measured = _fidelity(sums[index], boundary)
                cos[level] = measured["cos"]
                name = self.names[level]
                for key, value in measured.items():
                    entries[f"fidelity/b{boundary}/{name}/{key}"] = value
            if decided is None:  # the first round
                chosen.append(self.governor.initial([cos[level] for level in range(self.levels)]))
            else:
                chosen.append(self.governor.decide(decided[boundary], cos))
            entries[f"governor/b{boundary}/decided"] = float(chosen[-1])
        self.decided = chosen
        entries["fidelity/probe_passes"] = float(self.probe_passes)
        entries["fidelity/step"] = float(step)
        self.entries.append(entries)
        return chosen


def _fidelity(sums: torch.Tensor, boundary: int) -> dict[str, float]:
    """cos, act_err, grad_err of one probe from every stage's sums [stages, SUMS]: the cosine on the
    sending stage's matrices, or on the stages after it where it holds none."""
    rows = sums[boundary : boundary + 1] if sums[boundary, 3] > 0 else sums[boundary + 1 :]
    dot, na, nb = (float(rows[:, i].sum()) for i in range(3))
    held = float(rows[:, 3].sum()) > 0
    cos = dot / math.sqrt(na * nb) if held and na > 0 and nb > 0 else (0.0 if held else math.nan)
    own = sums[boundary]
    act = math.sqrt(own[4] / own[5]) if own[5] > 0 else math.nan
    grad = math.sqrt(own[6] / own[7]) if own[7] > 0 else math.nan
    return {"cos": cos, "act_err": act, "grad_err": grad}


class FastLevelLink:
    """A fast stage's end of the governor: ``LEVELS`` from anchor stage ``stage`` and the switch its
    replica agrees on (``propose`` / ``adopt``, with ``anchor.geometry.agree_min``).

    ``switch(levels)`` applies a new level vector to this stage (sets its sides' codecs, rebuilds its
    pipeline stage). ``switches`` lists (fast step after which it switched, snapshot, levels).
    ``lockstep`` = (``anchor_every``, ``anchor_delay``), None for the asynchronous anchor."""

    def __init__(
        self,
        wire: Wire,
        link_group,
        source: int,
        boundaries: int,
        levels: list[int],
        switch: Callable[[list[int]], None],
        *,
        lockstep: tuple[int, int] | None,
        start: int = 0,
        first: bool = True,
        max_step: int,
    ) -> None:
        self.boundaries, self.switch, self.lockstep = boundaries, switch, lockstep
        self.inbox = Receiver(wire, link_group, source, LEVELS, HeaderRules(max_step, lambda header: boundaries))
        self.held: dict[int, tuple[int, list[int]]] = {}  # snapshot → (counts_after, levels)
        self.ended = False
        self.levels = list(levels)
        self.current = -1  # the snapshot of the decision in use (-1: the start, the richest level)
        self.switches: list[tuple[int, int, list[int]]] = []
        self.first = first  # the next decision is the anchor's first (it counts at its own snapshot)
        self.next_due = first_lockstep_snapshot(start, lockstep[0]) if lockstep is not None else None

    def _take(self, message) -> None:
        if message is None:
            self.ended = True
            return
        header, payload = message
        require(
            header.numel == self.boundaries,
            "governed levels",
            header.numel,
            f"hold one level per boundary ({self.boundaries})",
        )
        self.held[header.snapshot] = (header.counts_after, [int(v) for v in payload.tolist()])

    def _wait_for(self, snapshot: int) -> None:
        while not self.ended and snapshot not in self.held:
            self._take(self.inbox.next())

    def propose(self, step: int) -> int:
        """The newest decision this stage holds that counts by fast step ``step`` (lockstep: every one
        due waited for first)."""
        if self.lockstep is not None:
            every, delay = self.lockstep
            assert self.next_due is not None  # set with lockstep
            while self.next_due + (0 if self.first else delay) <= step:
                self._wait_for(self.next_due)
                if self.next_due in self.held:
                    counts_after = self.held[self.next_due][0]
                    expected = self.next_due + (0 if self.first else delay)
                    require(
                        counts_after == expected,
                        "governed levels counts_after",
                        counts_after,
                        f"be {expected} (round {self.next_due}, anchor_delay {delay})",
                    )
                self.first, self.next_due = False, self.next_due + every
        else:
            for message in self.inbox.ready():
                self._take(message)
        due = [s for s, (counts_after, _) in self.held.items() if counts_after <= step]
        return max(due + [self.current])

    def adopt(self, step: int, snapshot: int) -> None:
        """The replica agreed on ``snapshot``'s decision: at new levels, switch from the next forward on."""
        if snapshot <= self.current:
            return
        levels = self.held[snapshot][1]
        for old in [s for s in self.held if s <= snapshot]:
            del self.held[old]
        self.current = snapshot
        if levels != self.levels:
            self.levels = list(levels)
            self.switch(self.levels)
            self.switches.append((step, snapshot, list(levels)))

    def state(self, step: int) -> dict:
        """What a checkpoint after ``step`` fast steps keeps: the levels in use and every decision held
        but not yet counting. Lockstep, the decisions of rounds before ``step`` (which a resumed anchor
        does not run again) are waited for first, so a resume continues exactly."""
        if self.lockstep is not None:
            every = self.lockstep[0]
            assert self.next_due is not None  # set with lockstep
            while self.next_due < step:
                self._wait_for(self.next_due)
                self.first, self.next_due = False, self.next_due + every
        newest = max(self.held, default=None)
        return {
            "levels": list(self.levels),
            "current": self.current,
            "held": {s: (c, list(lv)) for s, (c, lv) in self.held.items()},
            "first": self.first,
            "decided": list(self.held[newest][1]) if newest is not None else list(self.levels),
        }

    def load_state(self, state: dict, step: int) -> None:
        """Continue from a checkpoint after ``step`` fast steps (``state``)."""
        levels = [int(lv) for lv in state["levels"]]
        require(len(levels) == self.boundaries, "governor levels", levels, f"hold {self.boundaries} levels")
        if levels != self.levels:
            self.levels = levels
            self.switch(levels)
        self.current, self.first = int(state["current"]), bool(state["first"])
        self.held = {int(s): (int(c), [int(v) for v in lv]) for s, (c, lv) in state["held"].items()}
        if self.lockstep is not None:
            self.next_due = first_lockstep_snapshot(step, self.lockstep[0])

    def close(self) -> None:
        """The end of the run: the inbox drained and joined; a broken link means the anchor is gone."""
        while not self.ended:
            self._take(self.inbox.next())
        try:
            self.inbox.join()
        except RuntimeError as err:
            cause = err.__cause__ if err.__cause__ is not None else err
            if not is_link_error(cause):
                raise


def reduce_over(wire: Wire, group, stages: int, device: torch.device) -> Callable[[torch.Tensor], None]:
    """A SUM all-reduce over the anchor's pipeline group (on its ``device``), booked on the anchor circuit."""

    def reduce(tensor: torch.Tensor) -> None:
        if stages > 1:
            on_device = tensor.to(device)
            wire.all_reduce("anchor", on_device, stages, lambda t: dist.all_reduce(t, group=group))
            tensor.copy_(on_device.cpu())

    return reduce
