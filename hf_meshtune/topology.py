"""The X × Y mesh: who is who, validated once, passed to everything that needs it.

X data-parallel replicas, each a pipeline of Y stages, one process per (replica, stage), global rank
``replica · Y + stage``. With the anchor on, replica X-1 is the dense anchor and replicas 0..X-2 form
the fast masked circuit; without it all X replicas are fast. Groups:

* PP group of replica r: its Y ranks, in stage order (the pipeline's sends and receives);
* DP group of stage s: stage s of every *fast* replica (Streaming DiLoCo syncs only with its peers);
* anchor peers of stage s: the anchor's stage s and stage s of every fast replica.

Replica jobs (``MESHTUNE_REPLICA=r``, what ``meshtune launch --max-restarts`` starts): each replica is
a job of its own, its Y processes one torch.distributed world (process rank = stage), so a replica that
dies can be restarted and rejoin without the others noticing more than a missed DiLoCo sync. Replicas
then meet through torchft (the lighthouse and its cross-replica groups) and, with the anchor on,
through the restartable anchor link (``comm.pairlink``: one gloo pair per anchor stage and fast stage,
rebuilt when either restarts). ``MeshTopology.job_replica`` is r there, and mesh ranks
(``replica · Y + stage``) are what every other part of the library speaks.

``MeshTopology.validate`` runs before any collective, from facts every rank already has (world size,
mesh shape, number of decoder layers), so an impossible mesh fails on every rank with the same
message instead of hanging in a rendezvous.
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch.distributed as dist

from ._validation import require
from .boundary.hooks import split_stages

__all__ = [
    "LOCAL_BOUNDARIES_ENV",
    "MESH_ENV",
    "STAGE_LAYERS_ENV",
    "REPLICA_ENV",
    "MeshGroups",
    "MeshTopology",
    "in_replica_zero_job",
    "launched_stage_layers",
    "launched_stages",
    "parse_mesh",
]

MESH_ENV = "MESHTUNE_MESH"
REPLICA_ENV = "MESHTUNE_REPLICA"
LOCAL_BOUNDARIES_ENV = "MESHTUNE_LOCAL_BOUNDARIES"
STAGE_LAYERS_ENV = "MESHTUNE_STAGE_LAYERS"
_MESH_RE = re.compile(r"^\s*(\d+)\s*[xX×]\s*(\d+)\s*$")


def _local_boundaries(text: str, stages: int) -> tuple[int, ...]:
    """``$MESHTUNE_LOCAL_BOUNDARIES`` ("0,2") → (0, 2): boundaries in [0, Y-1), each once."""
    parts = [p.strip() for p in text.split(",") if p.strip()]
    ok = all(p.isdigit() and int(p) < stages - 1 for p in parts) and len(set(parts)) == len(parts)
    require(
        ok,
        LOCAL_BOUNDARIES_ENV,
        text,
        f"be comma-separated boundaries in [0, {stages - 1}) (b: stage b to b+1 on one host), each once",
    )
    return tuple(sorted(int(p) for p in parts))


def in_replica_zero_job() -> bool:
    """False only in a replica job of a replica other than 0 (``$MESHTUNE_REPLICA``): what keeps
    replicas that are worlds of their own from all writing as their world's process 0."""
    return os.environ.get(REPLICA_ENV, "0") == "0"


def parse_mesh(text: str, field: str = "mesh") -> tuple[int, int]:
    """ "XxY" → (X, Y): X replicas (the anchor's included) of Y pipeline stages each."""
    match = _MESH_RE.match(str(text))
    require(match is not None, field, text, "look like XxY, e.g. 3x2 (X replicas, Y stages)")
    assert match is not None
    replicas, stages = int(match.group(1)), int(match.group(2))
    require(replicas >= 1 and stages >= 1, field, text, "have X >= 1 replicas and Y >= 1 stages")
    return replicas, stages


def launched_stages() -> int | None:
    """Y of the mesh this process was launched on (``$MESHTUNE_MESH``, set by ``meshtune launch``), or None."""
    spec = os.environ.get(MESH_ENV)
    return parse_mesh(spec, MESH_ENV)[1] if spec else None


def launched_stage_layers(given: Sequence[int] | None) -> Sequence[int] | None:
    """The split this process's launcher placed (``$MESHTUNE_STAGE_LAYERS``, from a hosts file's
    ``stage_layers``) when ``given`` is None; ``given`` itself when it agrees or no launcher set one."""
    text = os.environ.get(STAGE_LAYERS_ENV, "").strip()
    if not text:
        return given  # as given: the knobs' own type check names a wrong type
    parts = [p.strip() for p in text.split(",")]
    require(
        all(p.isdigit() for p in parts), STAGE_LAYERS_ENV, text, "be comma-separated decoder-layer counts, e.g. 20,10"
    )
    placed = [int(p) for p in parts]
    require(
        given is None or (isinstance(given, (list, tuple)) and list(given) == placed),
        "stage_layers",
        None if given is None else list(given),
        f"equal the launcher's {STAGE_LAYERS_ENV}={text} (the hosts file's split), or be left unset",
    )
    return placed


@dataclass(frozen=True)
class MeshTopology:
    """X replicas × Y stages; replica X-1 is the anchor when ``anchor``.

    Example:
        >>> mesh = MeshTopology(replicas=3, stages=2, anchor=True)
        >>> mesh.coords(5), mesh.fast_replicas, mesh.dp_ranks(1), mesh.anchor_rank(1)
        ((2, 1), [0, 1], [1, 3], 5)
    """

    replicas: int
    stages: int
    anchor: bool = True
    job_replica: int | None = None  # r: this process's job (torch.distributed world) is replica r alone
    stage_layers: tuple[int, ...] | None = None  # decoder layers per stage (uneven); None = balanced
    # boundaries b (stage b → b+1) of this process's replica whose two stages share a host: dense, no codec,
    # booked on the ``local`` circuit (what ``meshtune launch --hosts`` exports as $MESHTUNE_LOCAL_BOUNDARIES)
    local_boundaries: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        require(isinstance(self.replicas, int) and self.replicas >= 1, "replicas", self.replicas, "be an int >= 1 (X)")
        require(isinstance(self.stages, int) and self.stages >= 1, "stages", self.stages, "be an int >= 1 (Y)")
        if self.anchor:
            require(
                self.replicas >= 2,
                "replicas",
                self.replicas,
                "be >= 2 when the anchor is on (replica X-1 is the anchor, at least one replica must be fast)",
            )
        if self.job_replica is not None:
            require(
                isinstance(self.job_replica, int) and 0 <= self.job_replica < self.replicas,
                REPLICA_ENV,
                self.job_replica,
                f"lie in [0, {self.replicas}) (a replica of the {self.replicas}x{self.stages} mesh)",
            )

    @classmethod
    def from_environment(
        cls,
        world_size: int,
        num_stages: int,
        anchor: bool,
        num_layers: int,
        mesh: str | None = None,
        stage_layers: Sequence[int] | None = None,
    ) -> MeshTopology:
        """The topology of this job: ``mesh`` ("XxY", default ``$MESHTUNE_MESH``) or X = world / Y.

        Raises ``ValueError`` (the same on every rank) for a mesh that cannot run: world size ≠ X·Y,
        a Y that differs from ``num_stages``, X < 2 with the anchor on, Y > number of layers, a ``stage_layers``
        that is not one positive count per stage summing to ``num_layers``.
        """
        spec = mesh if mesh is not None else os.environ.get(MESH_ENV)
        job = os.environ.get(REPLICA_ENV)
        if job is not None:
            require(
                bool(spec),
                MESH_ENV,
                spec,
                f"be set (XxY) when {REPLICA_ENV} is: a replica job needs the whole mesh's shape",
            )
            require(job.strip().isdigit(), REPLICA_ENV, job, "be a replica index (an integer >= 0)")
        if spec:
            replicas, stages = parse_mesh(spec, MESH_ENV if mesh is None else "mesh")
            require(
                stages == num_stages,
                "num_stages",
                num_stages,
                f"equal Y = {stages} of the mesh {spec} (one pipeline stage per process of a replica)",
            )
        else:
            require(
                world_size % num_stages == 0,
                "num_stages",
                num_stages,
                f"divide the world size {world_size} (X = world size / Y replicas of Y stages)",
            )
            replicas, stages = world_size // num_stages, num_stages
        split = None if stage_layers is None else tuple(stage_layers)
        local = _local_boundaries(os.environ.get(LOCAL_BOUNDARIES_ENV, ""), stages)
        topology = cls(replicas, stages, anchor, None if job is None else int(job), split, local)
        topology.validate(world_size, num_layers)
        return topology

    def validate(self, world_size: int, num_layers: int) -> None:
        if self.job_replica is not None:
            require(
                world_size == self.stages,
                "world_size",
                world_size,
                f"equal Y = {self.stages} in a replica job (one process per stage of replica {self.job_replica})",
            )
        require(
            self.job_replica is not None or world_size == self.world_size,
            "world_size",
            world_size,
            f"equal X·Y = {self.replicas}·{self.stages} = {self.world_size} (one process per replica and stage)",
        )
        require(
            self.stages <= num_layers,
            "num_stages",
            self.stages,
            f"be <= the model's {num_layers} decoder layers (every stage holds at least one)",
        )
        split_stages(num_layers, self.stages, self.stage_layers)  # one positive count per stage, summing right

    # --- ranks -------------------------------------------------------------------------------
    @property
    def world_size(self) -> int:
        """Processes of the whole mesh, X·Y."""
        return self.replicas * self.stages

    @property
    def job_world_size(self) -> int:
        """Processes of this process's torch.distributed world: Y in a replica job, else X·Y."""
        return self.stages if self.job_replica is not None else self.world_size

    def mesh_rank(self, process_rank: int) -> int:
        """This job's process rank → mesh rank (the same in a job spanning the mesh)."""
        return process_rank if self.job_replica is None else self.rank(self.job_replica, process_rank)

    def process_rank(self, mesh_rank: int) -> int:
        """Mesh rank of a process in this job → its torch.distributed rank."""
        if self.job_replica is None:
            return mesh_rank
        replica, stage = self.coords(mesh_rank)
        require(replica == self.job_replica, "rank", mesh_rank, f"belong to this job's replica {self.job_replica}")
        return stage

    def rank(self, replica: int, stage: int) -> int:
        require(0 <= replica < self.replicas, "replica", replica, f"lie in [0, {self.replicas})")
        require(0 <= stage < self.stages, "stage", stage, f"lie in [0, {self.stages})")
        return replica * self.stages + stage

    def coords(self, rank: int) -> tuple[int, int]:
        """Global rank → (replica, stage)."""
        require(0 <= rank < self.world_size, "rank", rank, f"lie in [0, {self.world_size})")
        return divmod(rank, self.stages)

    @property
    def anchor_replica(self) -> int | None:
        return self.replicas - 1 if self.anchor else None

    @property
    def fast_replicas(self) -> list[int]:
        return list(range(self.replicas - 1 if self.anchor else self.replicas))

    def is_anchor(self, rank: int) -> bool:
        return self.anchor and self.coords(rank)[0] == self.replicas - 1

    def pp_ranks(self, replica: int) -> list[int]:
        return [self.rank(replica, s) for s in range(self.stages)]

    def dp_ranks(self, stage: int) -> list[int]:
        return [self.rank(r, stage) for r in self.fast_replicas]

    def anchor_rank(self, stage: int) -> int | None:
        return None if not self.anchor else self.rank(self.replicas - 1, stage)

    def describe(self) -> str:
        fast = len(self.fast_replicas)
        anchor = f" + 1 anchor replica (replica {self.replicas - 1})" if self.anchor else ""
        return f"{self.replicas}x{self.stages} mesh: {fast} fast replica(s){anchor}, {self.stages} stage(s) each"

    # --- process groups ----------------------------------------------------------------------
    def build_groups(self, timeout_s: float | None = None, *, dp_peers: bool = False) -> MeshGroups:
        """Create every process group of the mesh: the one place they are built (a collective: every
        rank of the job calls it, in the same order).

        * PP group of every replica (``timeout_s`` bounds every pipeline send/receive; default: the
          default process group's timeout, 30 min for gloo; past it the stage raises instead of
          waiting on a dead link);
        * the anchor link (with the anchor on): every process of the job, gloo (CPU tensors); in a replica
          job the restartable pairs of ``comm.pairlink`` instead (the anchor's stage s with stage s of
          every fast replica);
        * the fast ranks alone (with the anchor on, in one world): how the run ends when the anchor
          replica was lost;
        * ``dp_peers``: stage s of every fast replica, for a per-step DP peer (``dp.baselines``).
        The fast replicas' Streaming DiLoCo groups are torchft's (``dp.ft``), not built here.
        """
        require(timeout_s is None or timeout_s > 0, "timeout_s", timeout_s, "be > 0 seconds (or None for the default)")
        require(
            not dp_peers or self.job_replica is None,
            "dp_peers",
            dp_peers,
            "be False when every replica is a job of its own (the per-step peers need one world)",
        )
        require(
            dist.is_initialized(),
            "torch.distributed",
            "not initialized",
            "be initialized before building the mesh's groups",
        )
        require(
            dist.get_world_size() == self.job_world_size,
            "world_size",
            dist.get_world_size(),
            f"equal {self.job_world_size} (this job's processes)",
        )
        timeout = None if timeout_s is None else timedelta(seconds=timeout_s)
        jobs = range(self.replicas) if self.job_replica is None else [self.job_replica]
        pp = {r: dist.new_group([self.process_rank(g) for g in self.pp_ranks(r)], timeout=timeout) for r in jobs}
        rank = self.mesh_rank(dist.get_rank())
        replica, stage = self.coords(rank)
        link = fast = peers = None
        if self.anchor and self.job_replica is not None:
            from .comm.pairlink import PairLinks

            if self.is_anchor(rank):
                across = [self.rank(r, stage) for r in self.fast_replicas]
            else:
                anchor_rank = self.anchor_rank(stage)
                assert anchor_rank is not None  # a mesh with an anchor
                across = [anchor_rank]
            local = (pp[replica], {self.rank(replica, s): s for s in range(self.stages)})
            link = PairLinks.from_environment(rank, across, local=local, timeout_s=timeout_s or 1800.0)
        elif self.anchor:
            link = dist.new_group(list(range(self.job_world_size)), backend="gloo", timeout=timeout)
            if self.job_replica is None:
                fast = dist.new_group(
                    [self.process_rank(self.rank(r, s)) for r in self.fast_replicas for s in range(self.stages)]
                )
        if dp_peers:
            built = {s: dist.new_group(self.dp_ranks(s)) for s in range(self.stages)}
            peers = built[stage] if not self.is_anchor(rank) else None
        return MeshGroups(self, rank, replica, stage, pp[replica], link, fast, peers)


@dataclass(frozen=True)
class MeshGroups:
    """This process's place in the mesh and its process groups (``MeshTopology.build_groups``).

    ``pp_group``: its replica's pipeline; ``link_group``: the anchor link (None without the anchor);
    ``fast_group``: the fast ranks alone (None unless the anchor is on in one world);
    ``dp_peer_group``: stage s of every fast replica (per-step DP peers only).
    """

    topology: MeshTopology
    rank: int
    replica: int
    stage: int
    pp_group: dist.ProcessGroup
    link_group: object = None  # a ProcessGroup, or comm.pairlink.PairLinks in replica jobs
    fast_group: dist.ProcessGroup | None = None
    dp_peer_group: dist.ProcessGroup | None = None

    @property
    def is_anchor(self) -> bool:
        return self.topology.is_anchor(self.rank)

    @property
    def is_first_stage(self) -> bool:
        return self.stage == 0

    @property
    def is_last_stage(self) -> bool:
        return self.stage == self.topology.stages - 1
