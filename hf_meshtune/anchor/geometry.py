"""Codec geometry from the anchor's dense passes, on the mesh: both sides of a boundary switch together.

With ``codec_refit_every`` (a composed codec that fits geometry, the anchor on), anchor stage s fits
boundary s's geometry (outlier dims, PCA basis, …) on the hidden states its dense round sends on, and
sends it (``GEOMETRY``) to the two fast stages of every replica that share boundary s: stage s
encodes with it, stage s+1 decodes with it. The two receive it independently, so neither may start
using it alone. After every fast step the stages of a replica therefore agree on the newest geometry
all of them hold — one int64 MIN all-reduce over the replica's pipeline group (booked on the anchor
circuit) — and switch to it together, for the next step's forward. With ``anchor_lockstep`` a round's
geometry counts only from the step that applied the round's gradient (snapshot + ``anchor_delay``),
each stage waiting for it there, so runs and resumes repeat bit for bit; otherwise a geometry counts
once every stage has it. Governed (``boundary_codec="governed"``), a side holds the whole ladder and
one message carries every level's geometry, fitted on the same activations, in ladder order.

``agree_min`` is the agreement: one MIN all-reduce of every link's proposal at once (the geometry's
and, governed, the levels', ``anchor.mesh_governor``), so a step pays for one however many agree.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .._validation import require
from ..boundary.compose.codec import ComposedCodec, geometry_digest, geometry_from_flat, geometry_to_flat
from ..comm.errors import is_link_error
from ..comm.mailbox import Receiver
from ..comm.messages import DATA, GEOMETRY, HeaderRules
from ..comm.wire import Wire
from .link import first_lockstep_snapshot

__all__ = ["FastGeometryLink", "agree_min", "ladder_from_flat", "refit_message"]


def refit_message(
    codecs: list[ComposedCodec], snapshot: int, hidden: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, str, list[dict]]:
    """The anchor's side: (header, payload, digest, geometries) of boundary b's geometry for each of
    ``codecs`` (one, or governed every level of b's ladder) fitted on the dense hidden states ``hidden``
    [..., H] of the round on ``snapshot``; the digest covers every level's (``geometry_digest`` of one)."""
    geometries = [codec.fitted(hidden) for codec in codecs]
    payload = torch.cat([geometry_to_flat(codec, g) for codec, g in zip(codecs, geometries)])
    header = GEOMETRY.encode(DATA, snapshot, codecs[0].boundary, payload.numel())
    return header, payload, _digest(geometries), geometries


def ladder_from_flat(codecs: list[ComposedCodec], flat: torch.Tensor) -> list[dict]:
    """Inverse of ``refit_message``'s payload: one geometry per codec; a ValueError unless the sizes add up."""
    sizes = [codec.spec.geometry_numel(codec.hidden_size) for codec in codecs]
    require(flat.numel() == sum(sizes), "codec geometry size", flat.numel(), f"equal the layouts' {sum(sizes)} values")
    return [geometry_from_flat(codec, part) for codec, part in zip(codecs, flat.split(sizes))]


def _digest(geometries: list[dict]) -> str:
    digests = [geometry_digest(g) for g in geometries]
    return digests[0] if len(digests) == 1 else "+".join(digests)


def agree_min(wire: Wire, pp_group, stages: int, proposals: list[int], device: torch.device | None = None) -> list[int]:
    """Every stage of a replica proposes a snapshot per link; all get the element-wise minimum (one int64
    all-reduce over the replica's pipeline group, on its ``device``, booked on the anchor circuit)."""
    agreed = torch.tensor(proposals, dtype=torch.long, device=device)
    if stages > 1:
        wire.all_reduce("anchor", agreed, stages, lambda t: dist.all_reduce(t, op=dist.ReduceOp.MIN, group=pp_group))
    return [int(v) for v in agreed.tolist()]


def _geometry_rules(codecs: list[ComposedCodec], max_step: int) -> HeaderRules:
    """A geometry message for this side: its boundary, and the values of every one of its codecs'
    geometries (``refit_message``: one codec, or governed every level of the ladder, concatenated)."""
    total = sum(codec.spec.geometry_numel(codec.hidden_size) for codec in codecs)
    return HeaderRules(max_step, lambda header: total, fields={"boundary": [codecs[0].boundary]})


class FastGeometryLink:
    """A fast stage's end: the geometry of its incoming (``codec_in``) and outgoing (``codec_out``)
    boundaries from the anchor stages that fit them, and the switch its replica agrees on. ``sources``:
    (side "in"/"out", the side's codecs — one, or governed the ladder —, the anchor rank that fits its
    boundary) per side of the stage.

    ``switches`` lists (fast step after which it switched, snapshot, digest in, digest out) per switch;
    ``current`` is the snapshot of the geometry in use (-1: the calibration at the start).
    ``lockstep`` = (``anchor_every``, ``anchor_delay``, ``codec_refit_every``), None for the paper's
    asynchronous anchor.
    """

    def __init__(
        self,
        wire: Wire,
        link_group,
        pp_group,
        stages: int,
        sources: list[tuple[str, list[ComposedCodec], int]],
        *,
        lockstep: tuple[int, int, int] | None,
        device: torch.device | None = None,
        max_step: int,
    ) -> None:
        self.wire, self.pp_group, self.stages, self.lockstep = wire, pp_group, stages, lockstep
        self.device = device
        self.sides = [side for side, _, _ in sources]  # "in" / "out"
        self.codecs = [codec for _, codec, _ in sources]
        self.inboxes = [
            Receiver(wire, link_group, src, GEOMETRY, _geometry_rules(codecs, max_step)) for _, codecs, src in sources
        ]
        self.held: list[dict[int, torch.Tensor]] = [{} for _ in sources]  # per side: snapshot → geometry payload
        self.ended = [False for _ in sources]  # that side's inbox ended (STOP, or the anchor was lost)
        self.current = -1
        self.next_due: int | None = None  # lockstep: the next refit round's snapshot
        self.switches: list[tuple[int, int, str, str]] = []

    def _take(self, side: int, message) -> None:
        if message is None:
            self.ended[side] = True
            return
        header, payload = message
        codec = self.codecs[side][0]
        require(
            header.boundary == codec.boundary,
            "codec geometry boundary",
            header.boundary,
            f"be {codec.boundary}, the boundary this stage's codec serves",
        )
        self.held[side][header.snapshot] = payload

    def _wait_for(self, snapshot: int) -> None:
        """Lockstep: every side's geometry of ``snapshot``, waited for (unless that side ended)."""
        for side, inbox in enumerate(self.inboxes):
            while not self.ended[side] and snapshot not in self.held[side]:
                self._take(side, inbox.next())

    def _due(self, step: int) -> int:
        """Lockstep: the newest refit snapshot whose gradient was applied by fast step ``step`` (after
        waiting for its geometry), or the one in use."""
        assert self.lockstep is not None  # called with lockstep only
        every, delay, refit_every = self.lockstep
        if self.next_due is None:
            self.next_due = first_lockstep_snapshot(step, every)
        newest = self.current
        while self.next_due + delay <= step:
            snapshot, self.next_due = self.next_due, self.next_due + every
            if (snapshot // every) % refit_every:
                continue
            self._wait_for(snapshot)
            if all(snapshot in held for held in self.held):
                newest = snapshot
        return newest

    def propose(self, step: int) -> int:
        """After fast step ``step``'s optimizer step: the newest geometry this stage holds on every side
        that may count now (lockstep: waited for); its replica agrees on the minimum (``agree_min``)."""
        if self.lockstep is not None:
            return self._due(step)
        for side, inbox in enumerate(self.inboxes):
            for message in inbox.ready():
                self._take(side, message)
        complete = set.intersection(*(set(held) for held in self.held))
        return max(complete | {self.current})

    def adopt(self, step: int, snapshot: int) -> None:
        """The replica agreed on ``snapshot``: if it is new, use its geometry from the next forward on."""
        if snapshot <= self.current:
            return
        digests = {}
        for side, codecs in enumerate(self.codecs):
            geometries = ladder_from_flat(codecs, self.held[side][snapshot])
            for codec, geometry in zip(codecs, geometries):
                codec.load_geometry(geometry)
            digests[self.sides[side]] = _digest(geometries)
        for held in self.held:
            for old in [s for s in held if s <= snapshot]:
                del held[old]
        self.current = snapshot
        self.switches.append((step, snapshot, digests.get("in", ""), digests.get("out", "")))

    def after_step(self, step: int) -> None:
        """``propose`` and ``adopt`` with this link's agreement alone."""
        (snapshot,) = agree_min(self.wire, self.pp_group, self.stages, [self.propose(step)], self.device)
        self.adopt(step, snapshot)

    def close(self) -> None:
        """The end of the run (after the anchor's STOP): every inbox drained and joined; a link that
        broke means the anchor is gone (the gradient link warns about it), not a bug."""
        for side, inbox in enumerate(self.inboxes):
            while not self.ended[side]:
                self._take(side, inbox.next())
            try:
                inbox.join()
            except RuntimeError as err:
                cause = err.__cause__ if err.__cause__ is not None else err
                if not is_link_error(cause):
                    raise
