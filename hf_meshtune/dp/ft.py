"""torchft set-up for the fast replicas: the lighthouse, one store per replica group, one Manager per process.

Replica r of the mesh is the torchft replica group ``mesh_replica_{r}`` and stage s is its group
rank, so torchft's cross-replica process group joins stage s of every fast replica and nothing else
(stage j syncs only with stage j). Only public torchft API is used here, but for
``AbortingProcessGroupGloo._create_pg`` (torchft's own, transcribed with another gloo device: it reads the
group's quorum fields, and fails loudly if they are renamed); the rest that reaches into its internals is
in ``dp.diloco``.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, cast

import torch
import torch.distributed as dist
from torchft import Manager
from torchft.coordination import LighthouseServer
from torchft.process_group import ProcessGroupGloo

from .._validation import require
from ..comm.listen import (
    HOST_ENV,
    advertised_host,
    bind_spec,
    bound_store,
    dp_gloo_device,
    listen_address,
    manager_server_bound_to,
)
from .diloco import AdvertisedHTTPTransport
from .powersgd import is_int

if TYPE_CHECKING:
    from torch.distributed.distributed_c10d import GroupName

__all__ = [
    "HOST_ENV",
    "HEARTBEAT_TIMEOUT_MS",
    "JOIN_TIMEOUT_MS",
    "ReplicaStore",
    "advertised_host",
    "host_replica_store",
    "make_manager",
    "start_lighthouse",
]

JOIN_TIMEOUT_MS = 60_000
"""How long a lighthouse waits for every heartbeating replica to join a quorum before it forms one
without the stragglers (torchft's default is much shorter, so a replica a few steps slower than the
others would be left out of syncs it is healthy enough to join)."""


HEARTBEAT_TIMEOUT_MS = 2_000
"""How long a lighthouse hears no heartbeat from a replica (its manager beats every 100 ms) before the
next quorum leaves it out. When a replica dies, the survivors' next sync waits this long for the
quorum that drops it: torchft's default, 5 s, was the whole of a survivor's pause after a kill."""


def start_lighthouse(
    min_replicas: int = 1,
    host: str | None = None,
    *,
    join_timeout_ms: int | None = JOIN_TIMEOUT_MS,
    quorum_tick_ms: int | None = None,
    heartbeat_timeout_ms: int = HEARTBEAT_TIMEOUT_MS,
    port: int = 0,
) -> tuple[LighthouseServer, str]:
    """Start a torchft lighthouse on ``port`` (0: a free one); returns ``(server, "http://HOST:PORT")``.

    ``min_replicas``: fast replicas a quorum needs. ``host``: the address to listen on and hand out
    (``meshtune launch``: loopback by default); None: ``advertised_host()`` ($MESHTUNE_HOST, else the
    hostname), which it listens on (resolved, ``comm.listen``) and hands out, since torchft's own
    address names the hostname, which other machines or namespaces may not reach.
    Call ``server.shutdown()`` when done.
    """
    require(is_int(min_replicas, 1), "min_replicas", min_replicas, "be an integer >= 1")
    server = LighthouseServer(
        bind=bind_spec(listen_address(host), port),
        min_replicas=min_replicas,
        join_timeout_ms=join_timeout_ms,
        quorum_tick_ms=quorum_tick_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
    )
    port = server.address().rstrip("/").rsplit(":", 1)[1]
    return server, f"http://{host or advertised_host()}:{port}"


class AbortingProcessGroupGloo(ProcessGroupGloo):
    """torchft's gloo group, aborted as soon as one of its all-reduces fails.

    When a peer dies in the middle of a ring all-reduce, only its ring neighbours see the broken
    connection; a survivor waiting for data from one of those neighbours would wait out the whole
    collective timeout (30 s in the soak). Aborting the failed group closes its connections, so the
    survivors waiting on it fail at once and every replica goes on to the next quorum, which leaves
    the dead replica out (``HEARTBEAT_TIMEOUT_MS``). torchft reconfigures a fresh group there anyway.

    With ``$MESHTUNE_DP_HOST`` set, its pairs bind to that address (``comm.listen.dp_gloo_device``), else to
    gloo's default device as torchft's own group does."""

    def _create_pg(self, store, rank: int, world_size: int):
        device = dp_gloo_device()
        if device is None:
            return super()._create_pg(store, rank, world_size)
        # torchft's own _create_pg with one change: the gloo backend's device (its options) instead of the default
        options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # torch's stub lacks _Options
        options._devices = [device]
        options._threads = 2  # what torch's default constructor gives one device
        options._timeout = self._timeout
        backend = dist.ProcessGroupGloo(store, rank, world_size, options)
        backend._set_sequence_number_for_group()
        if self._global_ranks:
            backend.options.global_ranks_in_group = self._global_ranks
        if self._group_rank and self._group_world_size:
            backend.options.group_name = cast(
                "GroupName", f"torchft_quorum_{self._quorum_id}_rank_{self._group_rank % self._group_world_size}"
            )
        pg = dist.ProcessGroup(store, rank, world_size)
        pg._set_default_backend(dist.ProcessGroup.BackendType.GLOO)
        for kind in ("cpu", "cuda", "xpu"):
            if kind == "cpu" or getattr(torch, kind).is_available():
                pg._register_backend(torch.device(kind), dist.ProcessGroup.BackendType.GLOO, backend)
        return pg

    def allreduce(self, tensors, opts):
        work = super().allreduce(tensors, opts)

        def abort_on_error(future) -> None:
            try:
                future.value()
            except Exception:  # noqa: BLE001 - any failure of the collective: the group is broken
                threading.Thread(target=self.abort, daemon=True, name="abort-dp-group").start()

        work.get_future().add_done_callback(abort_on_error)
        return work


@dataclass
class ReplicaStore:
    """The TCPStore of one replica group: ``store`` is the server (stage 0 only, keep it alive)."""

    addr: str
    port: int
    store: dist.TCPStore | None = None


def host_replica_store(
    replica: int, stage: int, *, host: str | None = None, rendezvous: dist.Store | None = None, timeout_s: float = 60.0
) -> ReplicaStore:
    """Stage 0 of replica ``replica`` hosts a fresh TCPStore; every stage of the replica learns its address.

    Why a store per replica: torchft's Manager writes its server address under one fixed key of its
    store, so replica groups cannot share one (the job's default store would be overwritten by every
    replica). The address is published through ``rendezvous`` (default: the default process group's
    store, so ``dist.init_process_group`` must have run) under ``hf_meshtune/dp_store/{replica}``.
    ``host`` is the address other machines reach this one at (default: the hostname); the store must
    be reachable from *every* fast process, not only this replica's stages, because the quorum's
    primary store also hosts the rendezvous of the cross-replica process groups.
    """
    key = f"hf_meshtune/dp_store/{replica}"
    if rendezvous is None:
        rendezvous = dist.distributed_c10d._get_default_store()
    if stage == 0:
        host = host or advertised_host()
        server = bound_store(listen_address(host), timeout_s=timeout_s)  # not on every interface
        rendezvous.set(key, f"{host}:{server.port}")
        return ReplicaStore(host, server.port, server)
    addr, _, port = rendezvous.get(key).decode().rpartition(":")
    return ReplicaStore(addr, int(port))


def make_manager(
    *,
    replica: int,
    stage: int,
    num_stages: int,
    lighthouse_addr: str | None,
    store_addr: str,
    store_port: int,
    timeout_s: float = 60.0,
    quorum_timeout_s: float | None = None,
    hostname: str | None = None,
    init_sync: bool = False,
    min_replica_size: int = 1,
) -> Manager:
    """The torchft Manager of stage ``stage`` of fast replica ``replica`` (group rank = stage).

    Gloo process group; synchronous quorum (DiLoCo requires it). ``min_replica_size``: replicas a
    quorum needs before it commits (1: a single surviving replica still commits, and a replica that
    comes back heals from a peer). Healthy replicas are not left out of a quorum as long as the
    lighthouse's ``join_timeout_ms`` exceeds how far apart they reach a sync (``start_lighthouse``).
    ``lighthouse_addr`` None: torchft's ``$TORCHFT_LIGHTHOUSE``.
    ``store_addr``/``store_port``: this replica's own TCPStore,
    hosted before this call by one process of the replica (``host_replica_store``: stage 0) and
    reachable by every fast process. ``timeout_s`` bounds collectives, RPCs and connects;
    ``quorum_timeout_s`` (default ``timeout_s``) how long a quorum waits for the other replicas, so
    it must exceed the time between syncs. ``init_sync=False``: every replica loads the same
    weights, so no step-0 checkpoint transfer (a replica that restarts later still heals).
    """
    require(is_int(num_stages, 1), "num_stages", num_stages, "be an integer >= 1")
    require(is_int(stage, 0) and stage < num_stages, "stage", stage, f"lie in [0, {num_stages})")
    require(is_int(replica, 0), "replica", replica, "be an integer >= 0")
    require(timeout_s > 0, "timeout_s", timeout_s, "be > 0")
    require(is_int(min_replica_size, 1), "min_replica_size", min_replica_size, "be an integer >= 1")
    timeout = timedelta(seconds=timeout_s)
    hostname = hostname if hostname is not None else os.environ.get(HOST_ENV)
    kwargs = {"hostname": hostname} if hostname is not None else {}
    address = listen_address(hostname)  # its servers listen there only (comm.listen)
    with manager_server_bound_to(address):
        return Manager(
            pg=AbortingProcessGroupGloo(timeout=timeout),
            load_state_dict=None,
            state_dict=None,
            checkpoint_transport=AdvertisedHTTPTransport(hostname, timeout=timeout, num_chunks=0),
            min_replica_size=min_replica_size,
            use_async_quorum=False,
            timeout=timeout,
            quorum_timeout=timedelta(seconds=quorum_timeout_s or timeout_s),
            connect_timeout=timeout,
            rank=stage,
            world_size=num_stages,
            store_addr=store_addr,
            store_port=store_port,
            lighthouse_addr=lighthouse_addr,
            replica_id=f"mesh_replica_{replica}",
            init_sync=init_sync,
            **kwargs,
        )
