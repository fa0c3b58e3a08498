"""The restartable anchor link of replica jobs (``comm.pairlink``), with both ends in this process.

Each end is a ``PairLinks`` on its own client of one TCPStore (as every process of a mesh holds its
own client of the launcher's store); a restart is a new ``PairLinks`` of the same rank with the next
incarnation, as ``meshtune launch --max-restarts`` starts one. The real thing, with processes killed
by PID, is ``tests/test_anchor_restart.py``.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
import torch.distributed as dist

from hf_meshtune.comm.errors import LinkDown, is_link_error
from hf_meshtune.comm.mailbox import Receiver, Sender
from hf_meshtune.comm.messages import DATA, STOP, UPDATES, HeaderRules
from hf_meshtune.comm.pairlink import FIRST_PAIR, PairLinks
from hf_meshtune.comm.wire import Wire


@pytest.fixture
def store():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = server.port
    yield lambda: dist.TCPStore("127.0.0.1", port, is_master=False)
    del server


def _pair(store, incarnations=(0, 0), ranks=(0, 5)) -> tuple[PairLinks, PairLinks]:
    """Both ends, built at once (each constructor waits for the first pair on a first start)."""
    ends: dict[int, PairLinks] = {}

    def make(rank: int, peer: int, incarnation: int) -> None:
        ends[rank] = PairLinks(store(), rank, incarnation, [peer], timeout_s=5)

    threads = [
        threading.Thread(target=make, args=(ranks[0], ranks[1], incarnations[0])),
        threading.Thread(target=make, args=(ranks[1], ranks[0], incarnations[1])),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return ends[ranks[0]], ends[ranks[1]]


def _exchange(sender: PairLinks, receiver: PairLinks, value: float, tag: int = 7) -> torch.Tensor:
    work = sender.isend(torch.full((3,), value), receiver.rank, tag)
    got = torch.zeros(3)
    receiver.recv(got, sender.rank, tag)
    work.wait()
    return got


def _wait_for(condition, limit_s: float = 10.0) -> None:
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_the_first_pair_carries_messages_both_ways(store):
    a, b = _pair(store)
    assert a.generation(5) == b.generation(0) == 1
    assert a.key(5) == b.key(0) == FIRST_PAIR  # nothing can have been lost: fast replica 0 sends no SYNC
    assert torch.equal(_exchange(a, b, 1.5), torch.full((3,), 1.5))
    assert torch.equal(_exchange(b, a, -2.0), torch.full((3,), -2.0))
    a.shutdown()
    b.shutdown()


def test_a_restarted_peer_gets_a_new_pair_and_the_survivor_follows(store):
    a, b = _pair(store)
    b.shutdown()  # b's process dies; its replica is restarted as incarnation 1
    b1 = PairLinks(store(), 5, 1, [0], timeout_s=5)
    _wait_for(lambda: a.generation(5) == 2 and b1.generation(0) == 1)
    assert a.key(5) == b1.key(0) == (0, 1, 0)  # not the first pair: replica 0 begins it with a SYNC
    assert a.rebuilds == 1
    assert torch.equal(_exchange(b1, a, 3.0), torch.full((3,), 3.0))
    a.shutdown()
    b1.shutdown()


def test_a_broken_pair_is_rebuilt_by_both_sides_without_a_restart(store):
    a, b = _pair(store)
    a.broken(5, a.generation(5))  # a saw it fail (a link cut): the break count moves
    assert a.generation(5) == 0
    with pytest.raises(LinkDown):  # nothing to send over until the next pair is up
        a.send(torch.zeros(1), 5, 1)
    _wait_for(lambda: a.generation(5) == 2 and b.generation(0) == 2)
    assert a.key(5) == b.key(0) == (0, 0, 1)
    a.broken(5, 1)  # a late report about the old pair changes nothing
    assert a.generation(5) == 2
    assert torch.equal(_exchange(a, b, 4.0), torch.full((3,), 4.0))
    a.shutdown()
    b.shutdown()


def test_without_a_peer_sends_fail_at_once_and_a_finished_peer_ends_the_wait(store):
    lonely = PairLinks(store(), 0, 1, [5], timeout_s=5)  # a restart: it does not wait in its constructor
    with pytest.raises(LinkDown) as failure:
        lonely.isend(torch.zeros(2), 5, 1)
    assert is_link_error(failure.value)  # what the anchor link treats as a lost peer, not a bug
    with pytest.raises(LinkDown):
        lonely.pinned(5, timeout_s=0.2)
    finished = PairLinks(store(), 5, 0, [], timeout_s=5)  # the peer's run ended (no pair of its own left)
    finished.finish()
    started = time.monotonic()
    with pytest.raises(LinkDown, match="finished its run"):
        lonely.pinned(5)
    assert time.monotonic() - started < 3.0
    with pytest.raises(ValueError, match="peer=3 is invalid"):
        lonely.send(torch.zeros(1), 3, 1)
    lonely.shutdown()


def test_the_mailbox_threads_go_on_over_the_next_pair(store):
    a, b = _pair(store)
    wire = Wire()
    rules = HeaderRules(100, lambda header: header.numel)
    inbox = Receiver(wire, a, 5, UPDATES, rules)
    outbox = Sender(wire, b, "anchor")

    def put(sender: Sender, step: int, generation: int) -> None:
        sender.put(0, UPDATES.header_tag, UPDATES.encode(DATA, step, 0, 2), generation)
        sender.put(0, UPDATES.payload_tag, torch.full((2,), float(step)), generation)

    put(outbox, 1, b.generation(0))
    assert inbox.next()[0].step == 1
    stale = b.generation(0)
    b.broken(0, stale)  # the pair fails under a's receive: both ends build the next one
    _wait_for(lambda: b.generation(0) == 2 and a.generation(5) == 2)
    put(outbox, 2, stale)  # queued for the pair that is gone: dropped, never half-sent on the new one
    put(outbox, 3, b.generation(0))
    header, payload = inbox.next()
    assert (header.step, payload.tolist()) == (3, [3.0, 3.0])
    outbox.put(0, UPDATES.header_tag, UPDATES.encode(STOP, 4, -1, 0), b.generation(0))
    outbox.close()
    assert inbox.next() is None
    inbox.join()
    assert outbox.dropped == 2  # header and payload of step 2
    assert inbox.relinks == 1  # its receive on the old pair failed; it waited for the new one
    a.shutdown()
    b.shutdown()


def test_updates_committed_before_the_first_pair_is_up_make_it_start_with_a_sync(store):
    from hf_meshtune.anchor.link import FastAnchorLink
    from hf_meshtune.dp.outer import OuterUpdate

    fast = PairLinks(store(), 1, 0, [5], timeout_s=5, wait_s=0)  # the anchor is not up yet
    link = FastAnchorLink(Wire(), fast, 5, [], forwards=True, who="rank 1", max_staleness=None, max_step=100)
    update = OuterUpdate(fragment=0, step=1, tensors=[torch.ones(2)], rank=None)
    state = lambda: [torch.full((2,), 7.0)]  # noqa: E731 - θ_global and momentum, as DiLoCo gives them
    link.forward([update], 2, state)  # no pair: the update cannot go
    anchor = PairLinks(store(), 5, 0, [1], timeout_s=5, wait_s=0)
    _wait_for(lambda: fast.generation(5) == 1 and anchor.generation(1) == 1)
    assert fast.key(5) == FIRST_PAIR  # the run's first pair, yet the anchor missed an update
    link.forward([update], 4, state)
    assert link.syncs == [4]
    got = torch.zeros(4, dtype=torch.long)
    anchor.recv(got, 1, UPDATES.header_tag)
    assert UPDATES.decode(got)[:2] == (3, 4)  # SYNC at step 4, its payload next
    link.forward([update], 6, state)  # then updates as usual
    assert link.syncs == [4]
    fast.shutdown()
    anchor.shutdown()


def test_links_from_the_environment_need_the_launchers_store_and_a_restart_count(store, monkeypatch):
    monkeypatch.delenv("MESHTUNE_JOB_STORE", raising=False)
    with pytest.raises(ValueError, match=r"MESHTUNE_JOB_STORE=None is invalid: it must be set \(host:port"):
        PairLinks.from_environment(0, [5])
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    monkeypatch.setenv("MESHTUNE_JOB_STORE", f"127.0.0.1:{server.port}")
    monkeypatch.setenv("MESHTUNE_RESTART", "-1")
    with pytest.raises(ValueError, match="MESHTUNE_RESTART='-1' is invalid: it must be an integer >= 0"):
        PairLinks.from_environment(0, [5])
    with pytest.raises(ValueError, match="incarnation=-1 is invalid: it must be >= 0"):
        PairLinks(store(), 0, -1, [5])
    del server
