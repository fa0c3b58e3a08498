"""The one place every byte of the mesh goes through on its way to a communication backend.

``Wire`` wraps point-to-point sends/receives and all-reduces and counts, per circuit (the training circuits
``pp_fwd``, ``pp_bwd``, ``dp``, ``anchor``; ``rollout``: RL generation through the pipeline; ``local``: boundaries
between two stages on one host, which never reach a WAN link), what this process puts on its links, in two kinds
that are never mixed up:

- ``sent``, **measured**: the bytes of the tensors handed to a point-to-point send (the payload; the
  transport's headers come on top).
- ``booked``, **booked by formula**: for an all-reduce the backend moves more than the tensor and the
  Wire cannot see how much, so it books a ring all-reduce's traffic, 2·(n-1)/n·P per participant for
  P bytes over n participants (what the ledger assumes). The tensor bytes themselves are measured
  (``handed``); the factor is an assumption, checked against the kernel's byte counters by the WAN
  test of the dense row (``tests/test_wan_netns.py``).

Summed over all processes, ``sent + booked`` of the training circuits is the mesh's training traffic,
the counterpart of the analytic ``ledger``; ``rollout`` (generation's traffic) is counted apart from it.

The mesh's links are gloo's, whose point-to-point calls take CPU tensors only: ``send_tensor``,
``isend_tensor`` and ``recv_tensor`` (which the Wire calls) stage a GPU tensor through a CPU copy.
Gloo's all-reduces and broadcasts take GPU tensors themselves.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from .._validation import require

__all__ = [
    "CIRCUITS",
    "LOCAL",
    "ROLLOUT",
    "WIRE_CIRCUITS",
    "Wire",
    "isend_tensor",
    "nbytes",
    "on_cpu",
    "receive_staged",
    "recv_tensor",
    "send_tensor",
]

CIRCUITS = ("pp_fwd", "pp_bwd", "dp", "anchor")  # the training circuits (the ledger's)
ROLLOUT = "rollout"  # generation through the pipeline (pipeline.generate)
LOCAL = "local"  # boundaries between two stages on one host (MeshTopology.local_boundaries): no codec, no WAN
WIRE_CIRCUITS = (*CIRCUITS, ROLLOUT, LOCAL)


def nbytes(tensor: torch.Tensor) -> int:
    """Bytes of a tensor's elements (what a backend sends for it)."""
    return tensor.numel() * tensor.element_size()


def on_cpu(tensor: torch.Tensor) -> torch.Tensor:
    return tensor if tensor.device.type == "cpu" else tensor.cpu()


def _routed(group) -> bool:
    """The restartable anchor link of replica jobs (``comm.pairlink``): it routes by mesh rank itself."""
    return getattr(group, "routes_by_mesh_rank", False)


def send_tensor(tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
    """``dist.send`` of ``tensor``, through a CPU copy when it lives on a GPU (gloo sends CPU memory)."""
    if _routed(group):
        group.send(tensor, dst, tag)
        return
    dist.send(on_cpu(tensor), dst, group=group, tag=tag)


def isend_tensor(tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
    """``dist.isend`` of ``tensor`` (a GPU tensor through a CPU copy, which the returned work keeps alive)."""
    if _routed(group):
        return group.isend(tensor, dst, tag)
    return dist.isend(on_cpu(tensor), dst, group=group, tag=tag)


def recv_tensor(tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
    """``dist.recv`` into ``tensor``; a GPU tensor receives into a CPU buffer first, then copies it."""
    if _routed(group):
        group.recv(tensor, src, tag)
        return
    receive_staged(tensor, lambda buffer: dist.recv(buffer, src, group=group, tag=tag))


def receive_staged(tensor: torch.Tensor, receive: Callable[[torch.Tensor], Any]) -> None:
    """``receive(buffer)`` into ``tensor``: the tensor itself on the CPU, a CPU buffer copied over on a GPU."""
    if tensor.device.type == "cpu":
        receive(tensor)
        return
    buffer = torch.empty(tensor.shape, dtype=tensor.dtype)
    receive(buffer)
    tensor.copy_(buffer)


def _zeros() -> dict[str, float]:
    return dict.fromkeys(WIRE_CIRCUITS, 0)


@dataclass
class Wire:
    """Byte counters of one process by circuit, and the wrapped backend calls that feed them.

    ``sent[c]``: measured payload bytes of this process's point-to-point sends for circuit c;
    ``booked[c]``: its all-reduces' ring traffic, 2·(n-1)/n × the tensor bytes (a formula);
    ``received[c]``: bytes of point-to-point messages it received; ``handed[c]``: tensor bytes given
    to the backend (sends and all-reduce inputs); ``messages[c]``: number of backend calls;
    ``uncoded[c]``: what the coded boundary messages among the sends held before their lossless coder
    (``coded[c]`` their bytes after it), so ``uncoded / coded`` is the coding ratio measured on the run.
    """

    sent: dict[str, float] = field(default_factory=_zeros)
    booked: dict[str, float] = field(default_factory=_zeros)
    received: dict[str, float] = field(default_factory=_zeros)
    handed: dict[str, float] = field(default_factory=_zeros)
    messages: dict[str, int] = field(default_factory=lambda: dict.fromkeys(WIRE_CIRCUITS, 0))
    uncoded: dict[str, float] = field(default_factory=_zeros)
    coded: dict[str, float] = field(default_factory=_zeros)
    _lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def _check(self, circuit: str) -> None:
        require(circuit in WIRE_CIRCUITS, "circuit", circuit, f"be one of {list(WIRE_CIRCUITS)}")

    def record_send(self, circuit: str, tensor: torch.Tensor) -> None:
        """Book a tensor handed to the backend for a point-to-point send."""
        self._check(circuit)
        with self._lock:  # mailbox threads book their sends too
            self.sent[circuit] += nbytes(tensor)
            self.handed[circuit] += nbytes(tensor)
            self.messages[circuit] += 1

    def record_coding(self, circuit: str, before: int, after: int) -> None:
        """Book a coded message's size before and after its lossless coder (its send is booked apart)."""
        self._check(circuit)
        with self._lock:
            self.uncoded[circuit] += before
            self.coded[circuit] += after

    def record_recv(self, circuit: str, tensor: torch.Tensor) -> None:
        self._check(circuit)
        with self._lock:
            self.received[circuit] += nbytes(tensor)

    def record_all_reduce(self, circuit: str, tensor: torch.Tensor, participants: int) -> None:
        """Book an all-reduce of ``tensor`` over ``participants`` processes (ring traffic)."""
        self._check(circuit)
        require(participants >= 1, "participants", participants, "be >= 1")
        with self._lock:
            self.handed[circuit] += nbytes(tensor)
            self.booked[circuit] += 2.0 * (participants - 1) / participants * nbytes(tensor)
            self.messages[circuit] += 1

    def send(self, circuit: str, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
        self.record_send(circuit, tensor)
        send_tensor(tensor, dst, group=group, tag=tag)

    def isend(self, circuit: str, tensor: torch.Tensor, dst: int, group=None, tag: int = 0):
        """Book, then post a non-blocking send; returns the backend's work (``.wait()`` on it)."""
        self.record_send(circuit, tensor)
        return isend_tensor(tensor, dst, group=group, tag=tag)

    def recv(self, circuit: str, tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> None:
        self.record_recv(circuit, tensor)
        recv_tensor(tensor, src, group=group, tag=tag)

    def all_reduce(
        self, circuit: str, tensor: torch.Tensor, participants: int, reduce: Callable[[torch.Tensor], Any]
    ) -> Any:
        """Book, then run ``reduce(tensor)`` (e.g. a torchft ``Manager.allreduce``); returns its result."""
        self.record_all_reduce(circuit, tensor, participants)
        return reduce(tensor)

    def on_wire(self, circuit: str) -> float:
        """This process's traffic for ``circuit``: measured sends plus booked all-reduces."""
        self._check(circuit)
        return self.sent[circuit] + self.booked[circuit]

    def moved(self) -> float:
        """Every byte this process's counters hold: sent, received and booked, all circuits."""
        with self._lock:
            return sum(self.sent.values()) + sum(self.received.values()) + sum(self.booked.values())

    def reset(self) -> None:
        for counters in (self.sent, self.booked, self.received, self.handed, self.messages, self.uncoded, self.coded):
            for key in counters:
                counters[key] = 0

    def to_dict(self) -> dict[str, dict[str, float]]:
        return {
            "sent": dict(self.sent),
            "booked": dict(self.booked),
            "received": dict(self.received),
            "handed": dict(self.handed),
            "messages": dict(self.messages),
            "uncoded": dict(self.uncoded),
            "coded": dict(self.coded),
        }
