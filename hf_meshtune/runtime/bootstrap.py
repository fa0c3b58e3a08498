"""How a mesh process starts: its role, the settings agreement, the first-start barrier, then its loop.

``run_worker`` is the entry point of every process of the mesh (``MeshTrainer.train()`` on several
processes calls it through ``runtime.job``; tests and benchmarks call it directly). Before any
training step every process publishes its address (so a link error later names peers by address)
and its settings, and fails the whole mesh with one message if any process runs with others.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from datetime import timedelta

import torch.distributed as dist
from torch import nn

from .._validation import require
from ..comm.gate import guard_launched_process
from ..comm.jobs import RESTART_ENV, job_store
from ..config import codec_refit_every, is_governed
from ..dp.ft import advertised_host
from ..topology import MeshGroups, MeshTopology
from .anchor_worker import AnchorWorker
from .results import MeshResult
from .settings import Batches, RunSettings
from .worker import FastWorker

__all__ = ["run_worker"]


def _host_key(rank: int) -> str:
    return f"hf_meshtune/host/{rank}"


def run_worker(
    model: nn.Module, groups: MeshGroups, settings: RunSettings, batches: Batches, anchor_batches: Batches | None = None
) -> MeshResult:
    """Run this process's part of the mesh (its role comes from its rank) and return what it did.

    ``groups``: this process's groups (``MeshTopology.build_groups``); ``batches(step)`` /
    ``anchor_batches(round)``: (input ids, labels) of this replica's step / the anchor's round.
    """
    topology, rank = groups.topology, groups.rank
    require(
        topology.job_replica is None or settings.dp_mode == "streaming_diloco",
        "dp_mode",
        settings.dp_mode,
        "be 'streaming_diloco' when every replica is a job of its own (the per-step peers need one world)",
    )
    require(
        settings.dp_mode == "streaming_diloco" or groups.dp_peer_group is not None,
        "dp_peer_group",
        None,
        f"be built (MeshTopology.build_groups(dp_peers=True)) for dp_mode={settings.dp_mode!r}",
    )
    if topology.job_replica is not None and topology.anchor:
        _require_restartable_anchor(settings)
    settings = _restart_heals(topology, rank, settings)
    assert settings.dp_timeout_s is not None  # RunSettings resolves it
    store = dist.distributed_c10d._get_default_store()
    store.set(_host_key(rank), advertised_host())  # every rank's address, for link errors
    shared = job_store(settings.dp_timeout_s) if topology.job_replica is not None else None
    _require_same_settings(store, topology, rank, settings, shared)
    if topology.is_anchor(rank):
        require(anchor_batches is not None, "anchor_batches", None, "be given on the anchor replica")
        assert anchor_batches is not None
        worker: AnchorWorker | FastWorker = AnchorWorker(model, groups, settings, anchor_batches)
    else:
        worker = FastWorker(model, groups, settings, batches)
    guard_launched_process()  # with a secret: guard the servers and gloo pairs just created, now
    # Every torchft Manager heartbeats before any replica asks for its first quorum, so the
    # lighthouse waits for all fast replicas instead of forming a quorum without a late starter.
    dist.barrier()
    _job_barrier(shared, topology, settings.dp_timeout_s)
    # read now, while the store is surely reachable: a link error later names its peers by address
    worker.peer_hosts = {
        peer: store.get(_host_key(peer)).decode() for peer in topology.pp_ranks(groups.replica) if peer != rank
    }
    return worker.run()


def _restart_heals(topology: MeshTopology, rank: int, settings: RunSettings) -> RunSettings:
    """A restarted replica job (``$MESHTUNE_RESTART`` > 0) joins the running mesh and heals from a peer
    (the anchor: from fast replica 0's SYNC), so it does not resume from the checkpoint its command line
    names: that one is behind the others, and may have been rotated away since."""
    restarted = topology.job_replica is not None and int(os.environ.get(RESTART_ENV, "0")) > 0
    if not restarted or settings.resume_from is None:
        return settings
    print(
        f"hf_meshtune: rank {rank} is a restart of replica {topology.job_replica}: it heals from the running "
        f"mesh instead of resuming from {settings.resume_from}",
        file=sys.stderr,
        flush=True,
    )
    return dataclasses.replace(settings, resume_from=None)


def _require_restartable_anchor(settings: RunSettings) -> None:
    """In replica jobs the anchor link is restartable (``comm.pairlink``) for what the anchor always sends
    (its gradients or factors, and fast replica 0's outer updates); the schedules and messages that
    assume a fixed link are refused."""
    cfg = settings.config
    rule = "be off when every replica is a job of its own with the anchor on (replica restarts: {})"
    require(
        not cfg.anchor_lockstep,
        "anchor_lockstep",
        cfg.anchor_lockstep,
        rule.format("a fast step cannot wait for an anchor that is restarting"),
    )
    require(
        not is_governed(cfg),
        "boundary_codec",
        cfg.boundary_codec,
        rule.format("the governor's levels travel over links that do not restart; pick a fixed codec"),
    )
    require(
        not codec_refit_every(cfg),
        "codec_refit_every",
        cfg.codec_refit_every,
        rule.format("the anchor's refitted geometry goes to two stages at once, over links that do not restart"),
    )


# What every process of a mesh must agree on besides its shape (which ``MeshTopology`` checks): the
# knobs (masks, anchor, DiLoCo, filter) and the step's shapes, schedule and optimizer.
_SHARED_SETTINGS = (
    "microbatch_size",
    "microbatches",
    "seq_len",
    "max_steps",
    "lr",
    "betas",
    "eps",
    "weight_decay",
    "max_grad_norm",
    "dp_mode",
    "checkpoint_every",
)


def _settings_of(settings: RunSettings) -> dict:
    values = {f"config.{k}": v for k, v in dataclasses.asdict(settings.config).items()}
    values.update({k: getattr(settings, k) for k in _SHARED_SETTINGS})
    return json.loads(json.dumps(values))  # tuples as lists, as they come back from the store


def _require_same_settings(store, topology: MeshTopology, rank: int, settings: RunSettings, shared=None) -> None:
    """Every process of a world reads every process's settings and compares them with the first one's,
    so a rank started with another mask_ratio, sync period or batch shape fails the whole world with
    one message naming the field, the rank and both values, instead of training something else. In
    replica jobs, ``shared`` (the launcher's store) also compares each process with mesh rank 0."""
    key = "hf_meshtune/settings/{}".format
    assert settings.dp_timeout_s is not None  # RunSettings resolves it
    timeout = timedelta(seconds=settings.dp_timeout_s)
    mine = _settings_of(settings)

    def require_agree(other: int, values: dict, reference: int, theirs: dict) -> None:
        for name, value in values.items():
            require(
                theirs.get(name) == value,
                f"{name} (rank {other})",
                value,
                f"equal rank {reference}'s {theirs.get(name)!r}: every process of the mesh runs with the same "
                "settings (check that rank's command line and environment)",
            )

    store.set(key(rank), json.dumps(mine))
    world = [topology.mesh_rank(r) for r in range(topology.job_world_size)]
    store.wait([key(r) for r in world], timeout)
    first = json.loads(store.get(key(world[0])))
    for other in world[1:]:
        require_agree(other, json.loads(store.get(key(other))), world[0], first)
    if shared is not None:
        shared.set(key(rank), json.dumps(mine))
        shared.wait([key(0)], timeout)
        require_agree(rank, mine, 0, json.loads(shared.get(key(0))))


def _job_barrier(store, topology: MeshTopology, timeout_s: float) -> None:
    """Replica jobs, first start only: wait until every process of the mesh is ready (its torchft
    Manager heartbeats), through the launcher's store ``$MESHTUNE_JOB_STORE``, so no replica's first
    quorum forms without a replica that is still loading. A restarted replica (``$MESHTUNE_RESTART``
    > 0) joins the running mesh without waiting; without the store, replicas start unaligned (a late
    one then heals at its first sync)."""
    if store is None or int(os.environ.get(RESTART_ENV, "0")) > 0:
        return
    key = "hf_meshtune/ready"
    ready = store.add(key, 1)
    deadline = time.monotonic() + timeout_s
    while ready < topology.world_size:
        require(
            time.monotonic() < deadline,
            "mesh start",
            f"{ready} of {topology.world_size} processes ready",
            f"complete within dp_timeout_s = {timeout_s} s (a replica job did not start)",
        )
        time.sleep(0.05)
        ready = store.add(key, 0)
