"""The anchor link's chunks and its rate cap (``comm.pacing``): both ends cut a payload the same way,
the cap's schedule is exact on a fake clock, and over gloo a capped sender takes at least the time the
cap allows while the payload arrives bit for bit."""

from __future__ import annotations

import time

import pytest
import torch

from hf_meshtune.comm.mailbox import Receiver, Sender
from hf_meshtune.comm.messages import DATA, STOP, UPDATES, HeaderRules
from hf_meshtune.comm.pacing import CHUNK_BYTES, Pace, chunks, pace_for
from hf_meshtune.comm.wire import Wire
from tests.distributed import launch


def test_chunks_are_views_that_cover_the_tensor_in_order():
    tensor = torch.randn(40_000)  # 160,000 bytes: two whole 64 KiB chunks and a rest
    parts = list(chunks(tensor))
    assert [p.numel() for p in parts] == [16_384, 16_384, 40_000 - 2 * 16_384]
    assert all(p.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() for p in parts)
    assert torch.equal(torch.cat(parts), tensor)
    assert [p.numel() for p in chunks(torch.zeros(3, 2, dtype=torch.bfloat16))] == [6]
    assert [p.numel() for p in chunks(torch.zeros(CHUNK_BYTES, dtype=torch.bfloat16))] == [CHUNK_BYTES // 2] * 2
    assert list(chunks(torch.empty(0))) == []
    with pytest.raises(ValueError, match="tensor='not contiguous' is invalid: it must be contiguous"):
        list(chunks(torch.zeros(4, 4).t()))


class FakeClock:
    def __init__(self) -> None:
        self.now, self.sleeps = 0.0, []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_the_pace_lets_the_first_chunk_go_and_spaces_the_rest_at_the_rate():
    clock = FakeClock()
    pace = Pace(1000.0, clock=clock, sleep=clock.sleep)  # 1,000 bytes/s
    pace.wait(500)  # at once
    pace.wait(500)  # the first 500 bytes hold the link for 0.5 s
    assert clock.sleeps == [0.5]
    clock.now += 0.2  # the sender did something else for 0.2 s
    pace.wait(100)
    assert clock.sleeps == [0.5, pytest.approx(0.3)]
    clock.now += 10.0  # idle: no credit piles up beyond the next chunk
    pace.wait(2000)
    pace.wait(10)
    assert clock.sleeps == [0.5, pytest.approx(0.3), pytest.approx(2.0)]
    assert pace_for(None) is None and pace_for(8.0).rate == 1e6
    with pytest.raises(ValueError, match="rate_bytes_s=0 is invalid: it must be > 0"):
        Pace(0)


NUMEL = 300_000  # 1.2 MB: 19 chunks
RATE_MBIT = 4.0  # 500 kB/s: the capped message takes >= (1.2 MB - 64 KiB) / 500 kB/s = 2.27 s


def _paced_worker(rank: int, world: int) -> dict | None:
    """Rank 0 sends one update (header and payload) and a STOP through an uncapped ``Sender``, then the
    same through one capped at ``RATE_MBIT``; rank 1 receives both."""
    wire = Wire()
    payload = torch.arange(NUMEL, dtype=torch.float32) * 0.5
    if rank == 0:
        results = {}
        for rate in (None, RATE_MBIT):
            sender = Sender(wire, None, "anchor", pace_for(rate))
            started = time.perf_counter()
            sender.put(1, UPDATES.header_tag, UPDATES.encode(DATA, 2, 0, NUMEL))
            sender.put(1, UPDATES.payload_tag, payload)
            sender.put(1, UPDATES.header_tag, UPDATES.encode(STOP, -1, -1, 0))
            sender.close()
            results[rate] = time.perf_counter() - started
        return {"seconds": results, "sent": wire.sent["anchor"], "messages": wire.messages["anchor"]}
    received = []
    for _ in range(2):
        receiver = Receiver(wire, None, 0, UPDATES, HeaderRules(max_step=10, numel=lambda header: header.numel))
        header, got = receiver.next()
        assert receiver.next() is None
        receiver.join()
        received.append((tuple(header), torch.equal(got, payload)))
    return {"received": received, "received_bytes": wire.received["anchor"]}


def test_a_capped_sender_keeps_to_its_rate_and_the_payload_arrives_whole():
    """Over gloo: the same update uncapped and capped at 4 Mbit/s arrives bit for bit both times, in
    chunks on both ends (the byte counts are the payload's), and the capped one cannot have gone faster
    than the cap allows after its first chunk."""
    sender, receiver = launch(_paced_worker, 2, timeout=120)
    assert receiver["received"] == [((DATA, 2, 0, NUMEL), True)] * 2
    header = UPDATES.encode(DATA, 2, 0, NUMEL)
    message = header.numel() * header.element_size() * 2 + NUMEL * 4  # header, payload, STOP
    assert sender["sent"] == receiver["received_bytes"] == 2 * message
    assert sender["messages"] == 2 * (1 + -(-NUMEL * 4 // CHUNK_BYTES) + 1)  # the payload went as 19 chunks
    floor = (NUMEL * 4 - CHUNK_BYTES) / (RATE_MBIT * 1e6 / 8)
    assert sender["seconds"][RATE_MBIT] >= floor


@pytest.mark.slow
def test_a_capped_anchor_link_changes_no_number_of_a_lockstep_mesh_and_keeps_to_its_rate(tmp_path):
    """3x2 lockstep mesh (the anchor's gradient every 2 steps, applied at once, so no result depends on
    timing): capped at 2 Mbit/s per pair, every fast rank trains bit for bit as uncapped, and each of the
    anchor's rounds took at least what the cap allows for one fast replica's payload after its first chunk."""
    from tests.test_anchor_factors import LOCKSTEP, _mesh

    rate = 2.0
    free = _mesh(tmp_path / "free", LOCKSTEP)
    capped = _mesh(tmp_path / "capped", {**LOCKSTEP, "anchor_rate_mbit": rate})
    for f, c in zip(free, capped):
        assert c.anchor_rounds == f.anchor_rounds and c.arrivals == f.arrivals and c.losses == f.losses
        assert all(torch.equal(f.params[n], c.params[n]) for n in f.params)
        assert c.wire["sent"] == f.wire["sent"]
        if c.role != "anchor":
            continue
        fast = next(r for r in free if r.role == "fast" and r.stage == c.stage)
        payload = 4 * sum(p.numel() for p in fast.params.values() if p.ndim == 2)
        assert payload > 4 * CHUNK_BYTES
        floor = (payload - CHUNK_BYTES) / (rate * 1e6 / 8)
        assert len(c.delivery_seconds) == len(c.anchor_rounds) and min(c.delivery_seconds) >= floor
        assert max(f.delivery_seconds) < floor  # uncapped, loopback: the cap is what made them slow
