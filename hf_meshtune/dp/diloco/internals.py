"""The private torchft names the DiLoCo adapter relies on, each with what it is for, and the check that
fails naming the first one a torchft release moved (``tests/test_torchft_contract.py`` runs it)."""

from __future__ import annotations

from importlib.metadata import version
from typing import Any

from torchft import local_sgd as torchft_local_sgd
from torchft.checkpointing.http_transport import HTTPTransport
from torchft.local_sgd import DiLoCo, _StreamingDiLoCoFragment

__all__ = ["TORCHFT_INTERNALS", "require_torchft_internals"]

# Every private torchft name this package relies on: (owner, attribute, what it is for).
TORCHFT_INTERNALS = (
    ("torchft.local_sgd", "_StreamingDiLoCoFragment", "the fragment class whose averaging PowerSGD replaces"),
    ("_StreamingDiLoCoFragment", "_average_grads", "issues the pseudo-gradient all-reduces"),
    ("_StreamingDiLoCoFragment", "_set_grads", "sets the averaged pseudo-gradients before the outer step"),
    ("_StreamingDiLoCoFragment", "perform_sync", "waits the all-reduces, commits, steps the outer optimizer"),
    ("_StreamingDiLoCoFragment", "prepare_sync", "takes the pseudo-gradients and starts their all-reduces"),
    ("_StreamingDiLoCoFragment", "_merge_parameters", "mixes θ_local back in after the outer step"),
    ("fragment", "_local_parameters", "θ_local as perform_sync found it (name → tensor)"),
    ("fragment", "_fragment_id", "the fragment's index"),
    ("fragment", "_model_fragment", "the fragment's module"),
    ("fragment", "_grads", "name → pseudo-gradient of the sync in flight"),
    ("fragment", "_allreduce_work", "the all-reduce works torchft waits in perform_sync"),
    ("fragment", "_manager", "the fragment's torchft Manager"),
    ("fragment", "_outer_optimizer", "the fragment's outer optimizer"),
    ("fragment", "original_parameters", "θ_global of the fragment (name → tensor)"),
    ("DiLoCo", "_fragments", "the fragments DiLoCo built"),
    ("DiLoCo", "_local_step", "inner steps since the last sync"),
    ("DiLoCo", "_manager", "DiLoCo's Manager"),
    ("HTTPTransport", "_server", "the checkpoint server's socket (its port)"),
)


def require_torchft_internals(diloco: DiLoCo | None = None, transport: HTTPTransport | None = None) -> None:
    """A RuntimeError naming the first private torchft attribute this module uses that is missing
    (on the classes, and on ``diloco``'s fragments / ``transport`` when given)."""
    owners: dict[str, list[Any]] = {
        "torchft.local_sgd": [torchft_local_sgd],
        "_StreamingDiLoCoFragment": [_StreamingDiLoCoFragment],
        "fragment": list(diloco._fragments) if diloco is not None and hasattr(diloco, "_fragments") else [],
        "DiLoCo": [diloco] if diloco is not None else [],
        "HTTPTransport": [transport] if transport is not None else [],
    }
    for owner, attribute, purpose in TORCHFT_INTERNALS:
        for obj in owners[owner]:
            if not hasattr(obj, attribute):
                raise RuntimeError(
                    f"torchft {version('torchft')} has no {owner}.{attribute} ({purpose}); hf_meshtune's "
                    "DiLoCo adapter (hf_meshtune/dp/diloco/) needs it: use torchft 0.2.x or update the adapter"
                )
