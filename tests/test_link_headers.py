"""No header on the anchor link is trusted: ``messages.admit`` checks it before anything is allocated,
and a receiver rejects a malformed or hostile one, logs why and keeps running."""

from __future__ import annotations

import re

import pytest
import torch
import torch.distributed as dist

from hf_meshtune.comm.mailbox import Receiver
from hf_meshtune.comm.messages import (
    DATA,
    GEOMETRY,
    GRADIENTS,
    LEVELS,
    STOP,
    TICK,
    UPDATES,
    HeaderRules,
    MalformedHeader,
    admit,
)
from hf_meshtune.comm.wire import Wire
from tests.distributed import launch

FRAGMENT_NUMEL = 6


def _update_numel(header) -> int:
    if header.kind == TICK:
        return 0
    if header.fragment != 0:
        raise MalformedHeader(f"updates header fragment={header.fragment} is invalid: it must lie in [0, 1)")
    return FRAGMENT_NUMEL


UPDATE_RULES = HeaderRules(max_step=10, numel=_update_numel)

BAD_UPDATES = [
    ((DATA, 1, 0, 2**60), "updates header numel=1152921504606846976 is invalid: it must equal 6"),
    ((7, 1, 0, 6), "updates header kind=7 is invalid: it must be one of [0, 1, 2, 3]"),
    ((DATA, -5, 0, 6), "updates header step=-5 is invalid: it must lie in [0, 10] (the run's steps)"),
    ((DATA, 11, 0, 6), "updates header step=11 is invalid: it must lie in [0, 10]"),
    ((DATA, 1, 3, 6), "updates header fragment=3 is invalid: it must lie in [0, 1)"),
    ((TICK, 4, -1, 5), "updates header numel=5 is invalid: it must equal 0"),
]


@pytest.mark.parametrize(("values", "message"), BAD_UPDATES, ids=[m.split(" is")[0] for _, m in BAD_UPDATES])
def test_a_malformed_update_header_is_refused_naming_the_field(values, message):
    with pytest.raises(MalformedHeader, match=re.escape(message)):
        admit(UPDATES, UPDATES.decode(torch.tensor(values)), UPDATE_RULES)


def test_well_formed_headers_are_admitted_with_their_payload_size():
    assert admit(UPDATES, UPDATES.decode(UPDATES.encode(DATA, 3, 0, 6)), UPDATE_RULES) == 6
    assert admit(UPDATES, UPDATES.decode(UPDATES.encode(TICK, 10, -1, 0)), UPDATE_RULES) == 0
    assert admit(UPDATES, UPDATES.decode(UPDATES.encode(STOP, -1, -1, 0)), UPDATE_RULES) == 0
    fixed = HeaderRules(max_step=10, numel=lambda header: 12)
    assert admit(GRADIENTS, GRADIENTS.decode(GRADIENTS.encode(DATA, 4)), fixed) == 12  # no numel field: fixed size
    with pytest.raises(MalformedHeader, match="gradients header kind=2 is invalid"):
        admit(GRADIENTS, GRADIENTS.decode(GRADIENTS.encode(TICK, 4)), fixed)
    levels = HeaderRules(max_step=12, numel=lambda header: 3)
    with pytest.raises(MalformedHeader, match="levels header counts_after=13 is invalid"):
        admit(LEVELS, LEVELS.decode(LEVELS.encode(DATA, 2, 13, 3)), levels)
    geometry = HeaderRules(max_step=10, numel=lambda header: header.numel, fields={"boundary": [1]})
    with pytest.raises(MalformedHeader, match=r"geometry header boundary=0 is invalid: it must be one of \[1\]"):
        admit(GEOMETRY, GEOMETRY.decode(GEOMETRY.encode(DATA, 2, 0, 5)), geometry)


def _hostile_sender_worker(rank: int, world: int) -> dict | None:
    """Rank 0 sends every malformed header of BAD_UPDATES, then one good update and STOP; rank 1 receives."""
    wire = Wire()
    if rank == 0:
        for values, _ in BAD_UPDATES:
            wire.send("anchor", torch.tensor(values, dtype=torch.long), 1, tag=UPDATES.header_tag)
        wire.send("anchor", UPDATES.encode(DATA, 2, 0, FRAGMENT_NUMEL), 1, tag=UPDATES.header_tag)
        wire.send("anchor", torch.arange(FRAGMENT_NUMEL, dtype=torch.float32), 1, tag=UPDATES.payload_tag)
        wire.send("anchor", UPDATES.encode(STOP, -1, -1, 0), 1, tag=UPDATES.header_tag)
        dist.barrier()
        return None
    receiver = Receiver(wire, None, 0, UPDATES, UPDATE_RULES)
    header, payload = receiver.next()
    end = receiver.next()
    receiver.join()
    dist.barrier()
    return {"header": tuple(header), "payload": payload.tolist(), "end": end, "rejected": receiver.rejected}


def test_a_receiver_rejects_hostile_headers_and_keeps_receiving():
    """Over gloo: a header announcing 2^60 values, a wrong kind, steps out of range, a fragment the model
    does not have. Each is rejected before any allocation (2^60 floats would fail the process) and logged;
    the good update after them arrives whole and the STOP ends the channel."""
    _, received = launch(_hostile_sender_worker, 2, timeout=120)
    assert received["header"] == (DATA, 2, 0, FRAGMENT_NUMEL)
    assert received["payload"] == [float(i) for i in range(FRAGMENT_NUMEL)]
    assert received["end"] is None
    assert [header for header, _ in received["rejected"]] == [values for values, _ in BAD_UPDATES]
    for (_, reason), (_, message) in zip(received["rejected"], BAD_UPDATES):
        assert reason.startswith(message)
