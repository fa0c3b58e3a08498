"""The private torchft internals ``hf_meshtune/dp/diloco/`` relies on still exist in the installed torchft.

torchft has no compressor hook, so the DiLoCo adapter reaches into ``_StreamingDiLoCoFragment`` and
``DiLoCo``/``HTTPTransport`` attributes (``TORCHFT_INTERNALS`` lists every one). A torchft release that
moves one must fail here, naming it, instead of silently syncing uncompressed or not at all.
"""

from __future__ import annotations

from datetime import timedelta
from unittest.mock import create_autospec

import pytest
import torch
from torch import nn
from torchft import Manager
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment

from hf_meshtune.dp.diloco import TORCHFT_INTERNALS, require_torchft_internals


def _diloco() -> DiLoCo:
    """A real torchft DiLoCo on a mock Manager (construction talks to no server)."""
    manager = create_autospec(Manager, instance=True)
    manager._use_async_quorum = False
    fragment = nn.Linear(4, 4)
    return DiLoCo(
        manager,
        [fragment],
        torch.optim.AdamW(fragment.parameters()),
        [torch.optim.SGD(fragment.parameters(), lr=0.7)],
        sync_every=2,
    )


def test_every_private_torchft_attribute_the_adapter_uses_exists():
    transport = HTTPTransport(timeout=timedelta(seconds=5), num_chunks=0)
    try:
        require_torchft_internals(_diloco(), transport)
    finally:
        transport.shutdown()
    owners = {owner for owner, _, _ in TORCHFT_INTERNALS}
    assert owners == {"torchft.local_sgd", "_StreamingDiLoCoFragment", "fragment", "DiLoCo", "HTTPTransport"}


@pytest.mark.parametrize(
    ("owner", "attribute"),
    [("_StreamingDiLoCoFragment", "_average_grads"), ("fragment", "_allreduce_work"), ("DiLoCo", "_local_step")],
)
def test_a_moved_attribute_fails_loudly_naming_it(monkeypatch, owner, attribute):
    diloco = _diloco()
    if owner == "_StreamingDiLoCoFragment":
        monkeypatch.delattr(_StreamingDiLoCoFragment, attribute)
    elif owner == "fragment":
        delattr(diloco._fragments[0], attribute)
    else:
        delattr(diloco, attribute)
    with pytest.raises(RuntimeError, match=rf"torchft \S+ has no {owner}\.{attribute} \("):
        require_torchft_internals(diloco)
