"""Stage s of the anchor replica on the mesh: follow θ_global, and in rounds send dense gradients.

It keeps θ_global by replaying the outer updates fast replica 0 forwards (``OuterFollower``), and in
rounds: on the freshest snapshot at least ``anchor_every`` fast steps after the previous one, its
dense pipeline computes ∂L/∂θ on its own batch and sends the 2-D gradients to stage s of every fast
replica. Anchor stage 0 picks each round's snapshot and tells the other anchor stages (``ROUNDS``),
so all stages of a round use the same one. With ``anchor_lockstep`` the snapshots are every multiple
of ``anchor_every`` instead (θ_global as of the TICK fast replica 0 sends after that step), none
skipped: the rounds, their batches and their gradients are then a function of the fast run alone.

Governed (``boundary_codec="governed"``), each round also runs the fidelity probes through the anchor's
pipeline and sends the governor's decision to the fast stages (``anchor.mesh_governor``).
With ``anchor_payload="factors"`` the stage keeps M_anc of its matrices (``optim.factors.AnchorMomentum``),
folds each round's gradient into it and sends its top-r factors instead of the gradient.

In replica jobs the link is restartable (``comm.pairlink``): a fast stage that is gone is skipped
until its pair is back, a SYNC from fast replica 0 replaces the follower's state, and a restarted
anchor stage waits for that SYNC before its first round (it rejoins the running mesh: no resume).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator

import torch
from torch import nn

from .._validation import require
from ..anchor.circuit import rng_state, set_rng_state
from ..anchor.follower import OuterFollower, read_update, sync_shapes, update_numel
from ..anchor.geometry import refit_message
from ..anchor.governor import FidelityGovernor
from ..anchor.link import first_lockstep_snapshot
from ..anchor.mesh_governor import MeshGovernor, SendProbe, levels_message, reduce_over
from ..boundary.compose.codec import ComposedCodec
from ..boundary.masking import private_rng
from ..comm.errors import LinkDown
from ..comm.mailbox import Receiver
from ..comm.messages import (
    DATA,
    GEOMETRY,
    GRADIENTS,
    LEVELS,
    ROUNDS,
    STOP,
    SYNC,
    TICK,
    UPDATES,
    HeaderRules,
    MalformedHeader,
    flatten,
    unflatten,
)
from ..comm.pacing import chunks, pace_for
from ..comm.pairlink import PairLinks
from ..config import codec_ladder, codec_refit_every, composed_codec, is_governed, require_saved_knobs
from ..optim.factors import anchor_momentum
from ..topology import MeshGroups
from .checkpoint import read_rank_state
from .results import MeshResult
from .settings import Batches, RunSettings
from .stage import StageWorker

__all__ = ["AnchorWorker"]


class AnchorWorker(StageWorker):
    """Stage ``stage`` of the anchor replica: replays outer updates, computes dense gradients."""

    role = "anchor"

    def __init__(self, model: nn.Module, groups: MeshGroups, settings: RunSettings, batches: Batches) -> None:
        super().__init__(model, groups, settings, batches)
        cfg = settings.config
        self.fragment_shapes = [[p.shape for p in f.parameters()] for f in self.fragments]
        self.follower = OuterFollower(self.fragments, outer_lr=cfg.dp_outer_lr, outer_momentum=cfg.dp_outer_momentum)
        self.source = self.topology.rank(0, self.stage)  # fast replica 0 forwards the outer updates
        rules = HeaderRules(settings.max_steps, self._update_numel)
        self.inbox = Receiver(self.wire, groups.link_group, self.source, UPDATES, rules)
        self.applied_step = 0  # fast steps reflected in this stage's parameters
        self.ticked = 0  # lockstep: θ_global is complete up to this fast step (the last TICK)
        self.first_round = 0
        self.stopped = False
        self.links = groups.link_group if isinstance(groups.link_group, PairLinks) else None
        # a restarted anchor stage rejoins the running mesh: θ_global comes with fast replica 0's SYNC
        self.rejoins = self.links is not None and self.links.incarnation > 0
        self.awaits_sync = self.rejoins
        self.syncs: list[int] = []  # steps of the SYNCs loaded
        self.skipped: list[tuple[int, int]] = []  # (snapshot, fast rank) of deliveries a down link dropped
        self.refit_every = codec_refit_every(cfg)
        self.pace: dict | None = None if cfg.anchor_rate_mbit is None else {}  # fast rank → its pair's Pace
        self.factors = anchor_momentum(cfg)  # M_anc here, factors on the wire (None: the gradient)
        spec, last = composed_codec(cfg), self.stage == self.topology.stages - 1
        self.refit_codecs = None  # fit boundary `stage` (this stage's output) on each refit round
        self.governor: MeshGovernor | None = None
        specs = codec_ladder(cfg) if is_governed(cfg) else [spec] if spec is not None else []  # refits need one
        wanted = not last and (self.refit_every or is_governed(cfg))
        codecs = (
            [ComposedCodec(s, self.stage, self.module.hidden_size, cfg.mask_seed) for s in specs] if wanted else None
        )
        if self.refit_every and not last:
            self.refit_codecs = codecs
        if is_governed(cfg):  # the probes code with the same codecs (and the geometry this stage fits)
            policy = FidelityGovernor(len(specs), cfg.fidelity_target, cfg.fidelity_hysteresis)
            reduce = reduce_over(self.wire, groups.pp_group, self.topology.stages, self.device)
            names = [level.text for level in specs]
            self.governor = MeshGovernor(self.stage, self.topology.stages, codecs, names, policy, self.matrices, reduce)
        if settings.resume_from is not None:
            self._resume(settings.resume_from)

    def _state_bytes(self) -> dict[str, int]:
        return {**super()._state_bytes(), "anchor": self.follower.state_bytes()}

    def _resume(self, checkpoint: str) -> None:
        """θ_global and the outer momentum from fast replica 0's state of this stage: the anchor goes on
        from the checkpoint's step (its rounds draw batches from step / anchor_every on)."""
        state = read_rank_state(checkpoint, self.topology.rank(0, self.stage), self.topology)
        require_saved_knobs(state["config"], self.settings.config, context=f"to resume from {checkpoint}")
        self.follower.load_state(state["diloco"]["fragments"])
        self.applied_step = self.ticked = int(state["step"])
        levels = state.get("governor")
        if self.governor is not None and levels is not None:  # the newest decision the fast side holds
            self.governor.decided = list(levels["decided"])
        self.first_round = self.applied_step // self.settings.config.anchor_every

    def _update_numel(self, header) -> int:
        """What an admitted UPDATES header carries: nothing for a TICK; for fragment f, the values of its
        outer update (PowerSGD's factors or the dense deltas) as this stage's shapes give them."""
        if header.kind == TICK:
            return 0
        if header.kind == SYNC:
            return sum(math.prod(shape) for shape in sync_shapes(self.fragment_shapes))
        if not 0 <= header.fragment < len(self.fragment_shapes):
            raise MalformedHeader(
                f"updates header fragment={header.fragment} is invalid: it must lie in [0, {len(self.fragment_shapes)})"
            )
        cfg = self.settings.config
        return update_numel(self.fragment_shapes[header.fragment], cfg.dp_powersgd_rank, cfg.dp_quantize)

    def _apply(self, message) -> None:
        header, payload = message
        if header.kind == TICK:
            self.ticked = header.step
            return
        if header.kind == SYNC:
            self.follower.load_sync(unflatten(payload, sync_shapes(self.fragment_shapes)))
            self.applied_step = self.ticked = header.step
            self.awaits_sync = False
            self.syncs.append(header.step)
            return
        cfg = self.settings.config
        shapes = self.fragment_shapes[header.fragment]
        self.follower.apply(
            read_update(payload, header.fragment, header.step, shapes, cfg.dp_powersgd_rank, cfg.dp_quantize)
        )
        self.applied_step = header.step

    def _advance_to(self, target: int) -> None:
        """Apply queued outer updates until this stage's parameters reflect fast step ``target``
        (lockstep: up to the TICK of ``target``, so no update of a later step is in them)."""
        while (self.ticked if self.settings.config.anchor_lockstep else self.applied_step) < target:
            message = self.inbox.next()
            require(
                message is not None,
                "anchor round",
                target,
                "name a snapshot the fast circuit reached before it stopped",
            )
            self._apply(message)

    def _choose_round(self, previous: int | None) -> int | None:
        """Stage 0: the snapshot of the next round (None = the fast circuit has stopped)."""
        every = self.settings.config.anchor_every
        if self.settings.config.anchor_lockstep:
            return self._lockstep_round(previous, every)
        while previous is None and self.awaits_sync:  # a restarted stage: θ_global first
            message = self.inbox.next()
            if message is None:
                self.stopped = True
                return None
            self._apply(message)
        if previous is None:
            return self.applied_step  # 0, the step a resumed run starts from, or a restart's SYNC
        due = previous + every
        while self.applied_step < due:  # wait for a snapshot far enough ahead
            message = self.inbox.next()
            if message is None:
                self.stopped = True
                return None
            self._apply(message)
        for message in self.inbox.ready():  # then take the freshest one already here
            if message is None:
                self.stopped = True
                break
            self._apply(message)
        return self.applied_step

    def _lockstep_round(self, previous: int | None, every: int) -> int | None:
        """Stage 0, lockstep: the next multiple of ``anchor_every`` (the first at or after the start),
        once its TICK is here (None = the fast circuit stopped first)."""
        due = first_lockstep_snapshot(self.applied_step, every) if previous is None else previous + every
        while self.ticked < due:
            message = self.inbox.next()
            if message is None:
                self.stopped = True
                return None
            self._apply(message)
        return due

    def _next_round(self, previous: int | None) -> int | None:
        """Every anchor stage agrees on the next round's snapshot: stage 0 chooses, the others follow."""
        link, stages = self.groups.link_group, self.topology.stages
        first = self.topology.rank(self.replica, 0)
        if self.stage == 0:
            target = None if self.stopped else self._choose_round(previous)
            message = ROUNDS.encode(-1 if target is None else target)
            for stage in range(1, stages):
                self.wire.send(
                    "anchor", message, self.topology.rank(self.replica, stage), group=link, tag=ROUNDS.header_tag
                )
            return target
        message = ROUNDS.empty()
        self.wire.recv("anchor", message, first, group=link, tag=ROUNDS.header_tag)
        snapshot = ROUNDS.decode(message).snapshot
        if snapshot < 0:
            return None
        self._advance_to(snapshot)
        return snapshot

    def run(self) -> MeshResult:
        previous: int | None = None
        round_index = self.first_round
        lockstep, every = self.settings.config.anchor_lockstep, self.settings.config.anchor_every
        while (target := self._next_round(previous)) is not None:
            # lockstep: every round is done, so its index follows from its snapshot; so does a restarted
            # stage's first (every stage of it sees the same snapshot)
            if lockstep or (previous is None and self.rejoins):
                round_index = target // every
            self._round(round_index, target)
            previous, round_index = target, round_index + 1
        return self._finish_anchor()

    def _geometry_targets(self) -> list[int]:
        """The fast ranks that use boundary ``stage``'s geometry: stages s and s+1 of every fast replica."""
        return [self.topology.rank(r, s) for r in self.topology.fast_replicas for s in (self.stage, self.stage + 1)]

    def _round(self, round_index: int, snapshot: int) -> None:
        self.model.zero_grad(set_to_none=True)
        self.module.step = round_index
        refit = self.refit_codecs is not None and round_index % self.refit_every == 0
        governor, last = self.governor, self.stage == self.topology.stages - 1
        ladder = governor.ladder if governor is not None else None
        fit = ladder is not None and not all(c.ready for c in ladder)  # the probes' first geometry
        self.module.record = [] if refit or fit else None
        dense_probe = SendProbe() if governor is not None and not last else None
        self.module.probe = dense_probe
        rng = rng_state(self.device)
        ids, labels = (t.to(self.device) for t in self.batches(round_index))
        try:
            loss = self.pipeline_step(ids, labels)
        finally:
            recorded, self.module.record, self.module.probe = self.module.record, None, None
        if loss is not None:
            self.result.losses.append(loss)
        posts = []
        if refit:  # the geometry first: it is small, and the fast side waits for it with the gradient
            assert self.refit_codecs is not None and recorded is not None  # a refit round records
            header, geometry, digest, geometries = refit_message(self.refit_codecs, snapshot, torch.cat(recorded))
            if ladder is not None:  # the probes' codecs take the geometry this stage fitted
                for codec, fitted in zip(ladder, geometries):
                    codec.load_geometry(fitted)
            for dst in self._geometry_targets():
                posts += self._post(dst, snapshot, GEOMETRY, header, geometry)
            self.result.geometry.append((snapshot, digest))
        elif fit:
            assert ladder is not None and recorded is not None  # a first fit records
            for codec in ladder:
                codec.fit(torch.cat(recorded))
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for _, p in self.matrices]
        if self.factors is None:
            payload = flatten(grads)
        else:
            payload = flatten([t for triple in self.factors.fold(grads) for t in triple])
        header = GRADIENTS.encode(DATA, snapshot)
        # to every fast replica at once: the anchor's uplink is shared among them, so no fast node's
        # downlink gets the whole gradient at the anchor's full rate (one delivery after another
        # would fill that node's queue and hold up its pipeline and DP traffic behind it)
        for replica in self.topology.fast_replicas:
            dst = self.topology.rank(replica, self.stage)
            posts += self._post(dst, snapshot, GRADIENTS, header, payload)
        if governor is not None:
            posts += self._govern(snapshot, [g.detach().clone() for g in grads], dense_probe, rng, ids, labels)
        started = time.perf_counter()
        self._deliver(snapshot, posts)
        self.result.delivery_seconds.append(time.perf_counter() - started)
        self.result.anchor_rounds.append(snapshot)
        self.model.zero_grad(set_to_none=True)

    def _govern(self, snapshot: int, dense: list, dense_probe: SendProbe | None, rng, ids, labels) -> list:
        """The round's fidelity probes (each replaying the dense pass's RNG; the run's stream goes on as if
        none had run), the decision, and the ``LEVELS`` message to stage s of every fast replica."""
        governor = self.governor
        assert governor is not None  # called only when governed

        def run_pass() -> None:
            self.model.zero_grad(set_to_none=True)
            set_rng_state(self.device, rng)
            self.pipeline_step(ids, labels)

        first = governor.decided is None
        with private_rng(self.device):  # the run's own stream goes on from where the dense pass left it
            levels = governor.round(self.module, dense, dense_probe or SendProbe(), run_pass, snapshot)
        # lockstep: where the round's gradient is applied; asynchronous: as soon as the replica's stages hold it
        # (the gradient, too, is applied on arrival there)
        lockstep = self.settings.config.anchor_lockstep
        counts_after = snapshot + self.settings.config.anchor_delay if lockstep and not first else snapshot
        self.result.levels.append((snapshot, counts_after, list(levels)))
        self.result.fidelity.append(governor.entries[-1])
        header, payload = levels_message(snapshot, counts_after, levels)
        posts = []
        for replica in self.topology.fast_replicas:
            posts += self._post(self.topology.rank(replica, self.stage), snapshot, LEVELS, header, payload)
        return posts

    def _post(self, dst: int, snapshot: int, channel, header, payload) -> list:
        """One message (header, payload) for fast rank ``dst``, to go out with the round's others
        (``_deliver``): [(dst, group, channel, header, payload)]; on the restartable link, nothing for a
        fast stage whose pair is down (it is restarting: ``skipped``)."""
        with self._unless_restarting(dst, snapshot):
            # header and payload over one pair
            group = self.links.pinned(dst, timeout_s=0) if self.links is not None else self.groups.link_group
            return [(dst, group, channel, header, payload)]
        return []

    def _deliver(self, snapshot: int, posts: list) -> None:
        """Send the round's messages and wait until they are out: every header, then the payloads chunk
        by chunk (``comm.pacing``), in turn over the messages, each pair capped at ``anchor_rate_mbit``.
        A fast stage whose pair goes down meanwhile gets nothing more (restartable link: ``skipped``)."""
        works: list = []
        down: set[int] = set()

        def post(dst: int, tensor: torch.Tensor, group, tag: int) -> None:
            with self._unless_restarting(dst, snapshot):
                works.append((dst, self.wire.isend("anchor", tensor, dst, group=group, tag=tag)))
                return
            down.add(dst)

        for dst, group, channel, header, _ in posts:
            if dst not in down:
                post(dst, header, group, channel.header_tag)
        pieces = [(dst, group, channel.payload_tag, list(chunks(payload))) for dst, group, channel, _, payload in posts]
        for index in range(max((len(parts) for *_, parts in pieces), default=0)):
            for dst, group, tag, parts in pieces:
                if index < len(parts) and dst not in down:
                    if self.pace is not None:
                        if dst not in self.pace:
                            self.pace[dst] = pace_for(self.settings.config.anchor_rate_mbit)
                        self.pace[dst].wait(parts[index].numel() * parts[index].element_size())
                    post(dst, parts[index], group, tag)
        for dst, work in works:
            with self._unless_restarting(dst, snapshot):
                work.wait()

    def _send_stop(self, dst: int, message, tag: int) -> None:
        """A STOP to fast rank ``dst`` (on the restartable link: unless its pair is down)."""
        with self._unless_restarting(dst, None):
            self.wire.send("anchor", message, dst, group=self.groups.link_group, tag=tag)

    @contextlib.contextmanager
    def _unless_restarting(self, dst: int, snapshot: int | None) -> Iterator[None]:
        """On the restartable link a fast stage whose pair is down is restarting: what the block sends it
        is dropped (a delivery of ``snapshot`` counts in ``skipped``); on a fixed link that is an error."""
        try:
            yield
        except LinkDown:
            if self.links is None:
                raise
            if snapshot is not None:
                self.skipped.append((snapshot, dst))

    def _finish_anchor(self) -> MeshResult:
        # the updates after the last round too: the anchor ends on θ_global, like the fast replicas
        while not self.stopped and (message := self.inbox.next()) is not None:
            self._apply(message)
        try:
            self.inbox.join()
        except RuntimeError as err:  # restartable link: replica 0 finished while its pair was down
            if self.links is None or not isinstance(err.__cause__, LinkDown):
                raise
        fast = [self.topology.rank(replica, self.stage) for replica in self.topology.fast_replicas]
        for dst in fast:
            self._send_stop(dst, GRADIENTS.encode(STOP, -1), GRADIENTS.header_tag)
        if self.governor is not None:
            for dst in fast:
                self._send_stop(dst, LEVELS.encode(STOP, -1, -1, 0), LEVELS.header_tag)
        if self.refit_codecs is not None:
            for dst in self._geometry_targets():
                self._send_stop(dst, GEOMETRY.encode(STOP, -1, -1, 0), GEOMETRY.header_tag)
        if self.links is not None:
            self.links.shutdown()
        self.result.anchor_syncs, self.result.anchor_skipped = self.syncs, self.skipped
        return self._finish(self.applied_step)
