"""How much of the dense gradient a boundary's codec keeps, measured on the anchor's own batch.

Each anchor round already runs the dense model on a real batch. For a boundary b and a codec level L
the fidelity probe runs the same batch again (same RNG, so dropout agrees) with only boundary b
coded by L, every other boundary dense, and compares with the dense pass:

- ``cos``: cos(∇θ through the codec, dense ∇θ) on the trainable matrices of the stage that sends on
  the boundary (the one whose gradient crosses the codec both ways); where that stage trains nothing
  (frozen early layers), on the trainable matrices after the boundary, where the codec's forward error
  is all that reaches the update;
- ``act_err``: ‖h̃ − h‖ / ‖h‖, the decoded activation against the dense one, at the boundary;
- ``grad_err``: ‖ĝ − g‖ / ‖g‖, dL/dh on the sending side of the boundary against the dense pass's
  (NaN where nothing upstream trains: no gradient crosses that boundary).

The probe costs one forward/backward of the round's batch per (boundary, level): the anchor's
compute per round is (1 + probes) dense rounds, off the fast path. ``gradient_cosine`` and
``relative_error`` are the definitions, in float64.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from torch import Tensor

__all__ = ["FidelityProbe", "ProbeRecord", "gradient_cosine", "relative_error", "stage_parameter_groups"]


def gradient_cosine(a: Sequence[Tensor], b: Sequence[Tensor]) -> float:
    """cos(a, b) of two gradients given as matching lists of tensors, in float64; 0 when either is 0."""
    dot = sum(float((x.double() * y.double()).sum()) for x, y in zip(a, b, strict=True))
    na = math.sqrt(sum(float(x.double().pow(2).sum()) for x in a))
    nb = math.sqrt(sum(float(y.double().pow(2).sum()) for y in b))
    return dot / (na * nb) if na > 0 and nb > 0 else 0.0


def relative_error(approx: Sequence[Tensor], exact: Sequence[Tensor]) -> float:
    """‖approx − exact‖ / ‖exact‖ over matching lists of tensors, in float64; NaN for empty or zero ``exact``."""
    num = sum(float((x.double() - y.double()).pow(2).sum()) for x, y in zip(approx, exact, strict=True))
    den = sum(float(y.double().pow(2).sum()) for y in exact)
    return math.sqrt(num / den) if den > 0 else math.nan


def stage_parameter_groups(names: Sequence[str], layers_name: str, stages: Sequence[range]) -> list[list[str]]:
    """The trainable parameter names of each stage, in ``named_parameters`` order: a name inside
    ``<layers_name>.<i>.`` belongs to layer i's stage; one before the first layer (the embeddings) to
    stage 0, one after the layers (final norm, head) to the last stage."""
    owner = {layer: s for s, stage in enumerate(stages) for layer in stage}
    groups: list[list[str]] = [[] for _ in stages]
    marker, seen_layer = f"{layers_name}.", False
    for name in names:
        at = name.find(marker)
        rest = name[at + len(marker) :] if at >= 0 else ""
        index = rest.split(".", 1)[0]
        if at >= 0 and index.isdigit():
            seen_layer = True
            groups[owner[int(index)]].append(name)
        else:
            groups[-1 if seen_layer else 0].append(name)
    return groups


@dataclass
class ProbeRecord:
    """One probe pass: which boundary is coded and by what (``codec.apply(h, step, microbatch)`` →
    (h̃, message)), and what the pass left there: the decoded-vs-dense activation sums of squares and
    dL/dh per microbatch. The boundary hooks fill it (``ComposedHandle.probing``)."""

    boundary: int | None  # None: the dense reference pass (every boundary records its dL/dh)
    codec: object | None = None
    act_num: float = 0.0
    act_den: float = 0.0
    grads: dict[int, list[Tensor]] = field(default_factory=dict)


class FidelityProbe:
    """Fidelity of codecs at one model's boundaries, on the batches of one anchor round.

    Args:
        run_pass: ``run_pass(record) → {name: gradient}``: one forward/backward over the round's batches
            with ``record`` active (the boundary hooks consult it; see ``ComposedHandle.probing``),
            returning the gradient of every trainable matrix the anchor holds.
        groups: per stage, the names whose gradients belong to it (``stage_parameter_groups``).
    """

    def __init__(self, run_pass: Callable[[ProbeRecord], Mapping[str, Tensor]], groups: list[list[str]]) -> None:
        self.run_pass, self.groups = run_pass, groups
        self.dense: dict[str, Tensor] | None = None
        self.dense_record: ProbeRecord | None = None

    def reference(self, dense: Mapping[str, Tensor], record: ProbeRecord) -> None:
        """The round's dense gradient and the dense dL/dh its pass recorded at every boundary."""
        self.dense, self.dense_record = dict(dense), record

    def names_for(self, boundary: int) -> list[str]:
        """The parameters the cosine of ``boundary`` is taken on (see the module docstring)."""
        held = set(self.dense or {})
        upstream = [n for n in self.groups[boundary] if n in held]
        if upstream:
            return upstream
        return [n for group in self.groups[boundary + 1 :] for n in group if n in held]

    def measure(self, boundary: int, codec) -> dict[str, float]:
        """One probe pass with only ``boundary`` coded, by ``codec``."""
        assert self.dense is not None and self.dense_record is not None, "reference() first"
        record = ProbeRecord(boundary, codec)
        grads = self.run_pass(record)
        names = self.names_for(boundary)
        cos = gradient_cosine([grads[n] for n in names], [self.dense[n] for n in names]) if names else math.nan
        act = math.sqrt(record.act_num / record.act_den) if record.act_den > 0 else math.nan
        mine, dense = record.grads.get(boundary, []), self.dense_record.grads.get(boundary, [])
        grad = relative_error(mine, dense) if mine and len(mine) == len(dense) else math.nan
        return {"cos": cos, "act_err": act, "grad_err": grad}
