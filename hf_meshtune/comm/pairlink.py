"""The anchor link in replica jobs: one gloo pair per (anchor process, fast process), rebuilt on restart.

When every replica is a job of its own (``meshtune launch --max-restarts``), no torch.distributed world
spans the anchor replica and the fast ones, and any of them may die and come back as a new process.
``PairLinks`` gives a process one two-process gloo group per peer across the link, rendezvoused
through the launcher's store (``$MESHTUNE_JOB_STORE``) under a key made of both processes'
incarnations (``$MESHTUNE_RESTART``) and the pair's break count:

* every process publishes its incarnation; a watcher thread per peer builds the pair as soon as both
  sides want the same key, and builds it again when the peer's incarnation changes (it restarted) or
  the break count moves (either side saw the pair fail: ``broken``), so a link cut heals too;
* a pair is built only once both sides have said they are building it (a ready key each), so neither
  waits out gloo's rendezvous timeout for a peer that is still importing;
* sends and receives to a peer of the own replica go through the replica's pipeline group instead,
  so the anchor's stages talk to each other as they do in one world.

``send``/``isend``/``recv`` raise ``LinkDown`` (a link error) when no pair is up or the pair fails;
``pinned(peer)`` waits for a pair and returns a view bound to it, so that a message's header and
payload never straddle two pairs (a receiver pins once per message, a sender drops what was queued
for a pair that is gone). ``generation(peer)`` counts the pairs built so far and ``key(peer)`` says
whether the current one is the run's very first (no restart, no break: nothing can have been lost).
"""

from __future__ import annotations

import atexit
import logging
import os
import threading
import time
import weakref
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from .._validation import require
from .errors import LinkDown, is_link_error
from .jobs import JOB_STORE_ENV, RESTART_ENV, job_store
from .wire import isend_tensor, on_cpu, receive_staged, recv_tensor, send_tensor

__all__ = ["FIRST_PAIR", "PairLinks", "PinnedPair"]

logger = logging.getLogger(__name__)

PREFIX = "hf_meshtune/pair"
FIRST_PAIR = (0, 0, 0)  # (incarnation of the lower rank, of the higher rank, breaks): the run's first pair
POLL_S = 0.05  # waits inside a build, and for a pair
WATCH_S = 0.2  # how often a watcher reads the store for a peer's restart or a break (a few small gets)


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _shutdown_all() -> None:
    """A process leaving with links still up (an error before the run's end) releases them first: a gloo
    group whose threads outlive the interpreter aborts the process (exit 134 instead of its own code)."""
    for links in list(_LIVE):
        links.shutdown()


@dataclass
class _Pair:
    pg: dist.ProcessGroupGloo | None = None  # the two-process gloo group, None while down
    key: tuple[int, int, int] | None = None
    generation: int = 0  # pairs built so far (0: none yet)


class _FailingWork:
    """A posted send's work whose failure marks the pair broken and reads as ``LinkDown``."""

    def __init__(self, work, on_error) -> None:
        self.work, self.on_error = work, on_error

    def wait(self, *args) -> bool:
        try:
            return self.work.wait(*args)
        except RuntimeError as err:
            raise self.on_error(err) from err


class PinnedPair:
    """One pair of ``PairLinks`` at one generation: what a message's header and payload go over."""

    routes_by_mesh_rank = True  # the Wire hands it mesh ranks (``comm.wire``)

    def __init__(self, links: PairLinks, peer: int, pair: _Pair) -> None:
        assert pair.pg is not None  # PairLinks pins only a pair that is up
        self.links, self.peer, self.pg, self.generation = links, peer, pair.pg, pair.generation
        self.key = pair.key
        self.peer_rank = 1 if links.rank < peer else 0

    def _failed(self, err: BaseException) -> LinkDown:
        self.links.broken(self.peer, self.generation)
        return LinkDown(f"the anchor link to mesh rank {self.peer} broke: {type(err).__name__}: {err}")

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        self.isend(tensor, peer, tag).wait()

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        require(peer == self.peer, "dst", peer, f"be mesh rank {self.peer}, the peer this pair links to")
        try:
            work = self.pg.send([on_cpu(tensor)], self.peer_rank, tag)  # type: ignore[attr-defined]  # stub lacks send
        except RuntimeError as err:
            raise self._failed(err) from err
        return _FailingWork(work, self._failed)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        require(peer == self.peer, "src", peer, f"be mesh rank {self.peer}, the peer this pair links to")

        def receive(buffer: torch.Tensor) -> None:
            self.pg.recv([buffer], self.peer_rank, tag).wait()  # type: ignore[attr-defined]  # stub lacks recv

        try:
            receive_staged(tensor, receive)
        except RuntimeError as err:
            raise self._failed(err) from err


class PairLinks:
    """This process's end of the restartable anchor link (see the module's docstring).

    The Wire hands it mesh ranks (``routes_by_mesh_rank``).

    Args:
        store: the launcher's store (a TCPStore client every process of the mesh reaches).
        rank: this process's mesh rank; ``incarnation``: how many times its replica was restarted.
        peers: the mesh ranks across the link (the anchor's stage s: stage s of every fast replica; a
            fast stage s: the anchor's stage s).
        local: (process group, mesh rank → process rank) of the own replica's pipeline, for messages
            between stages of one replica; None when there are none.
        timeout_s: gloo's timeout on every pair (a transfer that takes longer fails the pair).
        wait_s: how long the constructor waits for the first pairs on a first start (incarnation 0),
            so the run's first messages find them; a restarted process builds them in the background.
    """

    routes_by_mesh_rank = True

    def __init__(
        self,
        store,
        rank: int,
        incarnation: int,
        peers: list[int],
        *,
        local=None,
        timeout_s: float = 30.0,
        wait_s: float | None = None,
    ) -> None:
        require(incarnation >= 0, "incarnation", incarnation, "be >= 0 (times this replica was restarted)")
        self.store, self.rank, self.incarnation = store, rank, incarnation
        self.local = local
        self.timeout = timedelta(seconds=timeout_s)
        self._pairs = {peer: _Pair() for peer in peers}
        self._cv = threading.Condition()
        self._closed = False
        self.rebuilds = 0  # pairs built after the first one of each peer (restarts and breaks healed)
        store.set(self._incarnation_key(rank), str(incarnation))
        for peer in peers:
            store.compare_set(self._breaks_key(peer), "", "0")  # 0 unless a pair of these two broke before
        self._threads = [
            threading.Thread(target=self._watch, args=(peer,), daemon=True, name=f"pair-link-{peer}") for peer in peers
        ]
        for thread in self._threads:
            thread.start()
        _LIVE.add(self)
        if incarnation == 0:
            deadline = time.monotonic() + (timeout_s if wait_s is None else wait_s)
            with self._cv:
                while any(p.pg is None for p in self._pairs.values()) and time.monotonic() < deadline:
                    self._cv.wait(POLL_S)

    @classmethod
    def from_environment(cls, rank: int, peers: list[int], *, local=None, timeout_s: float = 30.0) -> PairLinks:
        """The links of a process started by ``meshtune launch --max-restarts`` (``$MESHTUNE_JOB_STORE``,
        ``$MESHTUNE_RESTART``)."""
        store = job_store(timeout_s)
        require(
            store is not None,
            JOB_STORE_ENV,
            None,
            "be set (host:port of the launcher's store) for the anchor link of replica jobs "
            "(meshtune launch --max-restarts sets it)",
        )
        restart = os.environ.get(RESTART_ENV, "0")
        require(restart.isdigit(), RESTART_ENV, restart, "be an integer >= 0")
        return cls(store, rank, int(restart), peers, local=local, timeout_s=timeout_s)

    # --- keys ---------------------------------------------------------------------------------------
    @staticmethod
    def _incarnation_key(rank: int) -> str:
        return f"{PREFIX}/incarnation/{rank}"

    def _between(self, peer: int) -> str:
        return f"{min(self.rank, peer)}-{max(self.rank, peer)}"

    def _breaks_key(self, peer: int) -> str:
        return f"{PREFIX}/breaks/{self._between(peer)}"

    def _read(self, key: str) -> int | None:
        if not self.store.check([key]):
            return None
        return int(self.store.get(key).decode() or 0)

    def _wanted(self, peer: int) -> tuple[int, int, int] | None:
        """The key of the pair both sides should hold now (None while the peer has never started)."""
        theirs = self._read(self._incarnation_key(peer))
        if theirs is None:
            return None
        breaks = self._read(self._breaks_key(peer)) or 0
        low, high = (self.incarnation, theirs) if self.rank < peer else (theirs, self.incarnation)
        return low, high, breaks

    # --- the watcher: build, rebuild ----------------------------------------------------------------
    def _watch(self, peer: int) -> None:
        while not self._closed:
            try:
                wanted = self._wanted(peer)
                if wanted is None or wanted == self._pairs[peer].key:
                    time.sleep(WATCH_S)
                    continue
                pg = self._build(peer, wanted)
            except Exception as err:  # noqa: BLE001 - the store or the peer went away: try again
                if self._closed:
                    return
                logger.debug("rank %d: building the pair with %d failed: %s", self.rank, peer, err)
                time.sleep(POLL_S)
                continue
            if pg is None:
                continue
            with self._cv:
                pair = self._pairs[peer]
                old, pair.pg, pair.key = pair.pg, pg, wanted
                pair.generation += 1
                self.rebuilds += pair.generation > 1
                self._cv.notify_all()
            if pair.generation > 1:
                logger.warning(
                    "rank %d: the anchor link to mesh rank %d is up again (pair %s)", self.rank, peer, wanted
                )
            _abort(old)

    def _build(self, peer: int, key: tuple[int, int, int]) -> dist.ProcessGroupGloo | None:
        """Both sides say they build the pair of ``key``, then build it (None: the wanted key moved on
        while waiting, or the links closed)."""
        prefix = f"{PREFIX}/{self._between(peer)}/{key[0]}.{key[1]}.{key[2]}"
        self.store.set(f"{prefix}/ready/{self.rank}", "1")
        while not self.store.check([f"{prefix}/ready/{peer}"]):
            if self._closed or self._wanted(peer) != key:
                return None
            time.sleep(POLL_S)
        pair_rank = 0 if self.rank < peer else 1
        return dist.ProcessGroupGloo(dist.PrefixStore(f"{prefix}/gloo", self.store), pair_rank, 2, self.timeout)

    # --- state --------------------------------------------------------------------------------------
    def broken(self, peer: int, generation: int) -> None:
        """The pair of ``generation`` with ``peer`` failed: drop it and move the break count, so both
        sides build a fresh one (unless the count already moved, or a newer pair is up)."""
        with self._cv:
            pair = self._pairs[peer]
            if pair.generation != generation or pair.pg is None:
                return
            old, pair.pg = pair.pg, None
            assert pair.key is not None  # set with every pair built
            breaks = pair.key[2]
        try:
            self.store.compare_set(self._breaks_key(peer), str(breaks), str(breaks + 1))
        except Exception as err:  # noqa: BLE001 - the store is gone too: the peer's restart will rebuild
            logger.debug("rank %d: could not count the break with %d: %s", self.rank, peer, err)
        _abort(old)

    def generation(self, peer: int) -> int:
        with self._cv:
            pair = self._pairs[peer]
            return pair.generation if pair.pg is not None else 0

    def key(self, peer: int) -> tuple[int, int, int] | None:
        with self._cv:
            return self._pairs[peer].key

    def pinned(self, peer: int, timeout_s: float | None = None) -> PinnedPair:
        """The current pair with ``peer``, waiting for one to be up (``LinkDown`` once the links are
        closed, once the peer has ``finish``ed, or after ``timeout_s``)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        checked = time.monotonic()
        with self._cv:
            while True:
                pair = self._pairs[peer]
                if pair.pg is not None:
                    return PinnedPair(self, peer, pair)
                if self._closed or (deadline is not None and time.monotonic() >= deadline):
                    raise LinkDown(f"no anchor link to mesh rank {peer} (its process is gone or restarting)")
                if time.monotonic() - checked > 1.0:
                    checked = time.monotonic()
                    if self.store.check([self._finished_key(peer)]):
                        raise LinkDown(f"mesh rank {peer} has finished its run: its anchor link will not come back")
                self._cv.wait(POLL_S)

    @staticmethod
    def _finished_key(rank: int) -> str:
        return f"{PREFIX}/finished/{rank}"

    def finish(self) -> None:
        """This process's run is over: a peer still waiting for a pair with it stops waiting."""
        self.store.set(self._finished_key(self.rank), "1")

    def current(self, peer: int, generation: int) -> PinnedPair | None:
        """The pair with ``peer`` if it is still the one of ``generation``, else None."""
        with self._cv:
            pair = self._pairs[peer]
            return PinnedPair(self, peer, pair) if pair.pg is not None and pair.generation == generation else None

    def close(self) -> None:
        """Stop rebuilding; whoever waits for a pair gets ``LinkDown``. Idempotent."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()

    def shutdown(self) -> None:
        """The end of the run: ``close``, then stop the watchers and release every pair, so no thread of
        a gloo group outlives the process's interpreter (an exit with one still running aborts it)."""
        self.close()
        for thread in self._threads:
            thread.join()
        with self._cv:
            pgs = [pair.pg for pair in self._pairs.values() if pair.pg is not None]
            for pair in self._pairs.values():
                pair.pg = None
        for pg in pgs:
            _quietly_abort(pg)

    # --- what the Wire calls ------------------------------------------------------------------------
    def _route(self, peer: int):
        if peer in self._pairs:
            return self.pinned(peer, timeout_s=0)
        require(
            self.local is not None and peer in self.local[1],
            "peer",
            peer,
            f"be a mesh rank this process links to ({sorted(self._pairs)}) or one of its own replica",
        )
        return None

    def send(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        pair = self._route(peer)
        if pair is None:
            send_tensor(tensor, self.local[1][peer], group=self.local[0], tag=tag)
            return
        pair.send(tensor, peer, tag)

    def isend(self, tensor: torch.Tensor, peer: int, tag: int):
        pair = self._route(peer)
        if pair is None:
            return isend_tensor(tensor, self.local[1][peer], group=self.local[0], tag=tag)
        return pair.isend(tensor, peer, tag)

    def recv(self, tensor: torch.Tensor, peer: int, tag: int) -> None:
        pair = self._route(peer)
        if pair is None:
            recv_tensor(tensor, self.local[1][peer], group=self.local[0], tag=tag)
            return
        pair.recv(tensor, peer, tag)


def _abort(pg) -> None:
    """Close a pair's connections so whatever still waits on it fails now (in a thread: abort may block)."""
    if pg is not None:
        threading.Thread(target=_quietly_abort, args=(pg,), daemon=True, name="abort-pair").start()


def _quietly_abort(pg) -> None:
    try:
        pg.abort()
    except Exception as err:  # noqa: BLE001 - already torn down
        if not is_link_error(err):
            logger.debug("aborting a pair: %s", err)
