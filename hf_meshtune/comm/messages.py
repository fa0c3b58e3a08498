"""The anchor link's messages: one schema that sender and receiver both read.

Every message is an int64 header on its channel's header tag, followed (for a DATA header) by one
float32 payload on the channel's payload tag. Five channels cross the anchor link:

* ``UPDATES`` (fast replica 0, stage s → anchor stage s): a committed DiLoCo sync in wire form,
  ``[kind, step, fragment, numel]``, ``step`` = the fast step after which it was committed, the
  payload its ``numel`` values (``dp.outer.OuterUpdate.tensors``, flattened); with ``anchor_lockstep`` a
  TICK header ``[TICK, step, -1, 0]`` (no payload) follows the last update of every ``step`` that is a
  multiple of ``anchor_every``: θ_global after that many fast steps is complete; on a rebuilt link of
  replica jobs (``comm.pairlink``) a SYNC header ``[SYNC, step, -1, numel]`` comes first, its payload
  θ_global and the outer momentum of every fragment after fast step ``step`` (``OuterFollower.sync_shapes``),
  which the anchor loads instead of replaying what it missed;
* ``GRADIENTS`` (anchor stage s → stage s of every fast replica): ``[kind, snapshot]`` and the
  stage's 2-D dense gradients of that snapshot, flattened in ``anchor_matrices`` order;
* ``ROUNDS`` (anchor stage 0 → the other anchor stages): ``[snapshot]`` of the next round, -1 when
  there are no more rounds (no payload);
* ``GEOMETRY`` (anchor stage s → stages s and s+1 of every fast replica, with ``codec_refit_every``):
  ``[kind, snapshot, boundary, numel]`` and boundary s's codec geometry fitted on that round's dense
  activations (``compose.codec.geometry_to_flat``; governed, every level of the ladder's in turn);
* ``LEVELS`` (anchor stage s → stage s of every fast replica, ``boundary_codec="governed"``):
  ``[kind, snapshot, counts_after, numel]`` and the ladder level of every boundary (``numel`` = Y-1
  values) the governor chose from that round's fidelity probes, in use from the forward after fast
  step ``counts_after``.

A STOP header ends a channel. Tensors travel as float32 on the CPU (the link is a gloo group,
whatever the pipeline's backend).

A receiver trusts no header: ``admit`` checks every field against the channel's kinds and the receiver's
``HeaderRules`` (steps within the run, indices within the model, the payload size exactly what the model's
shapes give) before anything is allocated for the payload, and a header that breaks one is rejected
(``MalformedHeader``, naming the field, value and rule) while the receiver keeps running.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch

from .._validation import require

__all__ = [
    "DATA",
    "GEOMETRY",
    "GRADIENTS",
    "LEVELS",
    "ROUNDS",
    "STOP",
    "SYNC",
    "TICK",
    "UPDATES",
    "Channel",
    "GeometryHeader",
    "GradientHeader",
    "HeaderRules",
    "LevelsHeader",
    "MalformedHeader",
    "RoundHeader",
    "UpdateHeader",
    "admit",
    "flatten",
    "unflatten",
]

STOP, DATA, TICK, SYNC = 0, 1, 2, 3


class UpdateHeader(NamedTuple):
    kind: int
    step: int
    fragment: int
    numel: int


class GradientHeader(NamedTuple):
    kind: int
    snapshot: int


class RoundHeader(NamedTuple):
    snapshot: int


class GeometryHeader(NamedTuple):
    kind: int
    snapshot: int
    boundary: int
    numel: int


class LevelsHeader(NamedTuple):
    kind: int
    snapshot: int
    counts_after: int
    numel: int


@dataclass(frozen=True)
class Channel:
    """One direction of the anchor link: its header layout and the tags its two parts travel on."""

    name: str
    header: type[Any]  # a NamedTuple of ints
    header_tag: int
    payload_tag: int | None
    kinds: tuple[int, ...] = (STOP, DATA)  # the kinds a sender may put in the header's ``kind`` field

    @property
    def data_tag(self) -> int:
        """``payload_tag`` of a channel whose DATA headers carry a payload (every one but ``ROUNDS``)."""
        assert self.payload_tag is not None, f"the {self.name} channel carries no payload"
        return self.payload_tag

    @property
    def header_len(self) -> int:
        return len(self.header._fields)

    def encode(self, *values: int) -> torch.Tensor:
        """The header tensor of ``self.header(*values)`` (int64, CPU)."""
        return torch.tensor(list(self.header(*values)), dtype=torch.long)

    def empty(self) -> torch.Tensor:
        """A buffer to receive one header into."""
        return torch.zeros(self.header_len, dtype=torch.long)

    def decode(self, tensor: torch.Tensor):
        """A received header as ``self.header`` (a NamedTuple of ints)."""
        return self.header(*tensor.tolist())


UPDATES = Channel("updates", UpdateHeader, header_tag=101, payload_tag=102, kinds=(STOP, DATA, TICK, SYNC))
GRADIENTS = Channel("gradients", GradientHeader, header_tag=201, payload_tag=202)
ROUNDS = Channel("rounds", RoundHeader, header_tag=301, payload_tag=None)
GEOMETRY = Channel("geometry", GeometryHeader, header_tag=401, payload_tag=402)
LEVELS = Channel("levels", LevelsHeader, header_tag=501, payload_tag=502)


class MalformedHeader(ValueError):
    """A received header that breaks its channel's rules: rejected before anything is allocated for it."""


@dataclass(frozen=True)
class HeaderRules:
    """What one receiver accepts, besides its channel's kinds.

    ``max_step``: a header's ``step`` / ``snapshot`` / ``counts_after`` lie in [0, max_step] (the run's
    steps); ``numel(header)``: the exact payload size the model's shapes give for an accepted DATA (or
    TICK) header, raising ``MalformedHeader`` for a header it cannot serve (a fragment or boundary this
    receiver does not have); ``fields``: other integer fields and the values they may take.
    """

    max_step: int
    numel: Callable[[tuple], int]
    fields: Mapping[str, Sequence[int]] = field(default_factory=dict)


_STEP_FIELDS = ("step", "snapshot", "counts_after")


def admit(channel: Channel, header: tuple, rules: HeaderRules) -> int:
    """The payload size (float32 values) that follows ``header``, once every field is within ``rules``;
    ``MalformedHeader`` naming the field, value and rule otherwise. A STOP header is admitted as it is."""

    def reject(name: str, value: object, rule: str) -> None:
        raise MalformedHeader(f"{channel.name} header {name}={value!r} is invalid: it must {rule}")

    kind = getattr(header, "kind", DATA)
    if kind not in channel.kinds:
        reject("kind", kind, f"be one of {list(channel.kinds)}")
    if kind == STOP:
        return 0
    for name in _STEP_FIELDS:
        value = getattr(header, name, None)
        if value is not None and not 0 <= value <= rules.max_step:
            reject(name, value, f"lie in [0, {rules.max_step}] (the run's steps)")
    for name, allowed in rules.fields.items():
        if getattr(header, name) not in allowed:
            reject(name, getattr(header, name), f"be one of {list(allowed)}")
    expected = rules.numel(header)
    announced = getattr(header, "numel", expected)
    if announced != expected:
        reject("numel", announced, f"equal {expected}, the payload the model's shapes give")
    return expected


def flatten(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One float32 CPU tensor of every element, in order (a message's payload)."""
    if not tensors:
        return torch.zeros(0, dtype=torch.float32)
    return torch.cat([t.detach().reshape(-1).to("cpu", torch.float32) for t in tensors])


def unflatten(flat: torch.Tensor, shapes: Sequence[Sequence[int]]) -> list[torch.Tensor]:
    """Views of ``flat`` with ``shapes``; a ValueError unless the sizes add up exactly."""
    out, offset = [], 0
    for shape in shapes:
        n = math.prod(shape)
        out.append(flat[offset : offset + n].view(*shape))
        offset += n
    require(offset == flat.numel(), "anchor message size", flat.numel(), f"equal the expected {offset} values")
    return out
