"""A time model of one pipeline step: the mesh's 1F1B schedule played out on stages and links.

``simulate_step`` runs, event by event, the order in which ``build_schedule``'s torch schedule runs each
stage's chunks (``Schedule1F1B``: stage s first runs min(M, Y - s) forwards, then alternates one backward
and one forward, then the remaining backwards; ``ScheduleGPipe`` when M < Y: all forwards, then all
backwards), with:

* every chunk's compute taking its stage's ``forward_s`` / ``backward_s`` per microbatch;
* a chunk starting once its stage is free and its input has arrived (a forward's activations from the
  previous stage, a backward's gradient from the next; the first stage's inputs and the last stage's
  loss are local);
* every boundary message leaving when its chunk ends (sends do not block the sender, as ``MeshStage``
  fires them at once) and queueing on its link, one queue per direction: it starts when the link is free,
  takes ``bytes / rate`` on it, and arrives ``latency_s`` (half the round trip) after it leaves the link.

It is a model: its step time is ``max`` over stages of the end of their last chunk, and it knows nothing of
what a step does outside the schedule (the optimizer, DiLoCo, logging), which ``plan.model`` adds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .._validation import require

__all__ = ["LinkSpec", "ScheduleResult", "StageCost", "schedule_order", "simulate_step"]


@dataclass(frozen=True)
class StageCost:
    """Seconds one microbatch's forward and backward take on a stage."""

    forward_s: float
    backward_s: float

    def __post_init__(self) -> None:
        for name in ("forward_s", "backward_s"):
            value = getattr(self, name)
            require(isinstance(value, (int, float)) and value >= 0, name, value, "be a number of seconds >= 0")


@dataclass(frozen=True)
class LinkSpec:
    """One boundary's link, each direction its own queue: ``rate`` bytes per second, ``latency_s`` one way."""

    rate: float
    latency_s: float = 0.0

    def __post_init__(self) -> None:
        require(isinstance(self.rate, (int, float)) and self.rate > 0, "rate", self.rate, "be bytes per second > 0")
        require(self.latency_s >= 0, "latency_s", self.latency_s, "be seconds >= 0 (one way: half the RTT)")

    def transfer(self, free_at: float, ready_at: float, nbytes: float) -> tuple[float, float]:
        """(when the link is free again, when the message arrives) for ``nbytes`` ready at ``ready_at``."""
        start = max(free_at, ready_at)
        done = start + nbytes / self.rate
        return done, done + self.latency_s


@dataclass
class ScheduleResult:
    """The step as the model plays it: its time, and per stage its computing and its waiting."""

    step_s: float
    compute_s: list[float]  # per stage: the sum of its chunks
    wait_s: list[float]  # per stage: step_s minus its computing (bubble and boundary waits)
    link_busy_s: list[tuple[float, float]] = field(default_factory=list)  # per boundary: (forward, backward)

    @property
    def bottleneck_stage(self) -> int:
        return max(range(len(self.compute_s)), key=lambda s: self.compute_s[s])


def schedule_order(stage: int, stages: int, microbatches: int) -> list[tuple[str, int]]:
    """Stage ``stage``'s chunks in the order its schedule runs them: ("F"|"B", microbatch)."""
    require(0 <= stage < stages, "stage", stage, f"lie in [0, {stages})")
    require(microbatches >= 1, "microbatches", microbatches, "be >= 1")
    if microbatches < stages:  # build_schedule's GPipe
        return [("F", m) for m in range(microbatches)] + [("B", m) for m in range(microbatches)]
    warmup = min(microbatches, stages - stage)
    order = [("F", m) for m in range(warmup)]
    forward, backward = warmup, 0
    while True:
        order.append(("B", backward))
        backward += 1
        if forward == microbatches:
            break
        order.append(("F", forward))
        forward += 1
    order += [("B", m) for m in range(backward, microbatches)]
    return order


def simulate_step(
    costs: list[StageCost],
    links: list[LinkSpec],
    microbatches: int,
    forward_bytes: list[float],
    backward_bytes: list[float],
) -> ScheduleResult:
    """One step of Y = ``len(costs)`` stages over the Y-1 ``links`` (boundary b: stage b ↔ b+1), with
    ``forward_bytes[b]`` / ``backward_bytes[b]`` per microbatch message on boundary b (module docstring)."""
    stages = len(costs)
    require(stages >= 1, "costs", costs, "give one StageCost per stage")
    for name, per_boundary in (("links", links), ("forward_bytes", forward_bytes), ("backward_bytes", backward_bytes)):
        require(len(per_boundary) == stages - 1, name, per_boundary, f"have one entry per boundary ({stages - 1})")
    orders = [schedule_order(s, stages, microbatches) for s in range(stages)]
    arrived: dict[tuple[str, int, int], float] = {}  # (kind, stage, microbatch) → when its input is there
    for m in range(microbatches):
        arrived[("F", 0, m)] = 0.0
    link_free = [[0.0, 0.0] for _ in range(stages - 1)]  # per boundary: forward queue, backward queue
    busy = [[0.0, 0.0] for _ in range(stages - 1)]
    forward_done: dict[tuple[int, int], float] = {}
    position, free_at = [0] * stages, [0.0] * stages
    compute = [0.0] * stages
    remaining = sum(len(o) for o in orders)
    while remaining:
        progressed = False
        for s in range(stages):
            while position[s] < len(orders[s]):
                kind, m = orders[s][position[s]]
                ready = _input_ready(kind, s, m, stages, arrived, forward_done)
                if ready is None:
                    break
                start = max(free_at[s], ready)
                duration = costs[s].forward_s if kind == "F" else costs[s].backward_s
                end = free_at[s] = start + duration
                compute[s] += duration
                if kind == "F":
                    forward_done[(s, m)] = end
                    if s < stages - 1:
                        _send(link_free, busy, links, s, 0, end, forward_bytes[s], arrived, ("F", s + 1, m))
                elif s > 0:
                    _send(link_free, busy, links, s - 1, 1, end, backward_bytes[s - 1], arrived, ("B", s - 1, m))
                position[s] += 1
                remaining -= 1
                progressed = True
        require(progressed, "schedule", orders, "be runnable (a chunk waits on one that never runs)")
    step = max(free_at)
    return ScheduleResult(
        step_s=step,
        compute_s=compute,
        wait_s=[step - c for c in compute],
        link_busy_s=[(f, b) for f, b in busy],
    )


def _input_ready(kind, stage, m, stages, arrived, forward_done) -> float | None:
    if kind == "F":
        return arrived.get(("F", stage, m))
    if (stage, m) not in forward_done:  # a backward needs its own forward first
        return None
    if stage == stages - 1:  # the loss is here
        return forward_done[(stage, m)]
    return arrived.get(("B", stage, m))


def _send(link_free, busy, links, boundary, direction, ready, nbytes, arrived, key) -> None:
    link = links[boundary]
    free, arrival = link.transfer(link_free[boundary][direction], ready, nbytes)
    busy[boundary][direction] += nbytes / link.rate
    link_free[boundary][direction] = free
    arrived[key] = arrival
