"""The fidelity governor and the adaptive anchor cadence: two policies, pure functions of what is logged.

``FidelityGovernor`` (``boundary_codec="governed"``) picks, per boundary, a level of the codec ladder
(``codec_ladder``, cheapest first) from the fidelity the anchor measured this round
(``anchor.fidelity``): the cheapest level whose gradient cosine meets ``fidelity_target``, moving one
level per round, with hysteresis so a level near the target does not flap:

- go one level cheaper when the cheaper level's cos ≥ target + hysteresis;
- else stay while the current level's cos ≥ target;
- else go one level richer (the richest level is the floor of what can be done).

At the start (``initial``) the whole ladder is measured once, by the first round, and the run moves at
once (from the second step) to the cheapest level meeting target + hysteresis (the richest if none
does). A later decision travels with the round's gradient and counts from the step after the one that
applies it, on both sides of the boundary.

``AnchorCadence`` (``anchor_cadence="adaptive"``) spaces anchor rounds by how fast the anchor momentum's
subspace moves: ``drift`` is the mean over matrices of sin θ_max, the largest principal angle between
the top-k left singular subspaces of M_anc before and after the newest delivery (``SpectralAdamW``).
The gap to the next round halves when the drift is above ``high``, doubles when it is below ``low``,
stays otherwise, within [``min_gap``, ``max_gap``]; it does not shrink while the measured staleness
exceeds twice the gap (the anchor is already behind). Both are replayable from the logs
(``governor/*``, ``fidelity/*``, ``anchor/drift``, ``anchor/staleness_steps``, ``anchor/gap``).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .._validation import require

__all__ = ["AnchorCadence", "FidelityGovernor", "candidate_levels", "mean_level_bytes"]


def candidate_levels(level: int, count: int) -> list[int]:
    """The levels a round measures for a boundary at ``level``: itself and its two neighbours."""
    return [lv for lv in (level - 1, level, level + 1) if 0 <= lv < count]


def mean_level_bytes(
    switches: Sequence[tuple[int, int, Sequence[int]]], sizes: Sequence[float], boundaries: int, steps: int
) -> float:
    """Payload bytes per token and boundary over a governed run of ``steps`` optimizer steps: each step at
    the levels in use for its forward, ``sizes[level]`` each. The run starts at the richest level; a switch
    ``(step, snapshot, levels)`` (``AnchorCircuit.switches``) is applied after the optimizer step of ``step``,
    so the forward of ``step + 1`` is the first to use it."""
    require(steps >= 1, "steps", steps, "be >= 1")
    require(boundaries >= 1, "boundaries", boundaries, "be >= 1")
    changes = {int(step): list(levels) for step, _, levels in switches}
    for step, levels in changes.items():
        require(len(levels) == boundaries, "switches", (step, levels), f"hold {boundaries} levels per switch")
        require(all(0 <= lv < len(sizes) for lv in levels), "switches", (step, levels), f"name levels < {len(sizes)}")
    levels, total = [len(sizes) - 1] * boundaries, 0.0
    for step in range(steps):
        total += sum(sizes[lv] for lv in levels) / boundaries
        levels = changes.get(step, levels)
    return total / steps


@dataclass(frozen=True)
class FidelityGovernor:
    """Per-boundary level choice from measured cosines (see the module docstring)."""

    levels: int
    target: float
    hysteresis: float = 0.0

    def __post_init__(self) -> None:
        require(self.levels >= 1, "codec_ladder", self.levels, "name at least one level")
        require(0.0 < self.target <= 1.0, "fidelity_target", self.target, "lie in (0, 1]")
        require(0.0 <= self.hysteresis < 1.0, "fidelity_hysteresis", self.hysteresis, "lie in [0, 1)")

    def initial(self, cos: Sequence[float]) -> int:
        """The start level from every level's cosine: the cheapest meeting target + hysteresis."""
        require(len(cos) == self.levels, "fidelity", len(cos), f"measure all {self.levels} levels at the start")
        for level, value in enumerate(cos):
            if _meets(value, self.target + self.hysteresis):
                return level
        return self.levels - 1

    def decide(self, level: int, cos: Mapping[int, float]) -> int:
        """The next level of a boundary at ``level`` given the cosines measured for ``candidate_levels``."""
        cheaper = cos.get(level - 1)
        if cheaper is not None and _meets(cheaper, self.target + self.hysteresis):
            return level - 1
        if _meets(cos[level], self.target):
            return level
        return min(level + 1, self.levels - 1)


def _meets(value: float, bar: float) -> bool:
    return not math.isnan(value) and value >= bar


@dataclass(frozen=True)
class AnchorCadence:
    """The gap (fast steps) to the next anchor round from the newest drift and staleness."""

    min_gap: int
    max_gap: int
    low: float = 0.05
    high: float = 0.3

    def __post_init__(self) -> None:
        require(self.min_gap >= 1, "anchor_every_min", self.min_gap, "be >= 1")
        require(
            self.max_gap >= self.min_gap,
            "anchor_every_max",
            self.max_gap,
            f"be >= anchor_every_min={self.min_gap}",
        )
        require(
            0.0 <= self.low < self.high, "anchor drift thresholds", (self.low, self.high), "satisfy 0 <= low < high"
        )

    def next_gap(self, gap: int, drift: float | None, staleness: int | None) -> int:
        """``gap`` after a round, given the newest drift (None: none measured yet) and staleness."""
        if drift is None or math.isnan(drift):
            new = gap
        elif drift > self.high:
            behind = staleness is not None and staleness > 2 * gap
            new = gap if behind else gap // 2
        elif drift < self.low:
            new = gap * 2
        else:
            new = gap
        return max(self.min_gap, min(self.max_gap, new))
