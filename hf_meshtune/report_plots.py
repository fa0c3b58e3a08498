"""The plots of ``meshtune report``: training loss (and reward) per run, bytes per token by circuit, and
(for runs whose anchor measured it) the boundary codecs' fidelity vs step, one panel per boundary.

Drawn on a bare ``matplotlib.figure.Figure`` (Agg), so no pyplot state or GUI backend is touched,
even when this runs inside a notebook. ``RunFiles`` and the rows come from ``report``.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .comm.wire import CIRCUITS

if TYPE_CHECKING:
    from .report import RunFiles

__all__ = ["bar_series", "draw_bytes", "draw_fidelity", "draw_loss", "fidelity_series"]

_COS = re.compile(r"^fidelity/b(\d+)/(.+)/cos$")
_LEVEL = re.compile(r"^governor/b(\d+)/level$")


def bar_series(rows: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """``{"<run> analytic" | "<run> wire": {circuit: bytes per token}}``: the bars to draw (wire: what a
    distributed mesh put on its links, measured sends plus booked all-reduces)."""
    series: dict[str, dict[str, float]] = {}
    for row in rows:
        for kind, values in (("analytic", row["bytes_per_token"]), ("wire", row["wire_bytes_per_token"])):
            if values:
                series[f"{row['run']} {kind}"] = {c: float(values[c]) for c in CIRCUITS if values.get(c) is not None}
    return series


def draw_loss(runs: list[RunFiles], rows: list[dict[str, Any]], path: Path) -> None:
    """Training loss vs step, one line per run; eval losses as crosses of the run's colour. When runs
    log a reward (GRPO/GSPO, whose loss hovers near 0 by construction), a second panel plots it."""
    rewards = [_points(run.log_history, "reward") for run in runs]
    with_reward = any(steps for steps, _ in rewards)
    fig, ax = _figure((12.0, 4.5) if with_reward else (7.0, 4.5), ncols=2 if with_reward else 1)
    from matplotlib.ticker import MaxNLocator  # after _figure, which explains a missing matplotlib

    if with_reward:
        ax, reward_ax = ax
        for index, (run, (steps, values)) in enumerate(zip(runs, rewards)):
            if steps:
                reward_ax.plot(steps, values, marker="o", markersize=3, color=f"C{index % 10}", label=run.name)
        reward_ax.set(xlabel="step", ylabel="mean reward of the step's rollouts", title="Reward (RL runs)")
        reward_ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        reward_ax.grid(alpha=0.3)
        reward_ax.legend(fontsize="small")

    drawn = False
    for index, (run, row) in enumerate(zip(runs, rows)):
        color = f"C{index % 10}"
        steps, losses = _points(run.log_history, "loss")
        if not steps and row["steps"] is not None and row["last_train_loss"] is not None:
            steps, losses = [row["steps"]], [row["last_train_loss"]]  # a summary gives only the last loss
        if steps:
            ax.plot(steps, losses, marker="o", markersize=3, color=color, label=run.name)
        eval_steps, eval_losses = _points(run.log_history, "eval_loss")
        if eval_steps:
            ax.scatter(eval_steps, eval_losses, marker="x", s=40, color=color, label=f"{run.name} eval")
        drawn = drawn or bool(steps or eval_steps)
    if drawn:
        ax.legend(fontsize="small")
    else:
        ax.text(0.5, 0.5, "no loss logged", ha="center", va="center", transform=ax.transAxes)
    ax.set(xlabel="step", ylabel="loss", title="Training loss")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole numbers
    ax.grid(alpha=0.3)
    _save(fig, path)


def _points(history: list[dict[str, Any]], key: str) -> tuple[list[float], list[float]]:
    pairs = [(entry["step"], entry[key]) for entry in history if key in entry and "step" in entry]
    return [step for step, _ in pairs], [value for _, value in pairs]


def draw_bytes(series: dict[str, dict[str, float]], path: Path) -> None:
    """Grouped bars: one group per circuit, one bar per run and kind (the mesh's wire bytes hatched), log y.

    A log axis has no zero: a circuit that sends nothing (no anchor, one stage) gets a "0" instead of a bar.
    """
    fig, ax = _figure((max(7.0, 2.0 + 0.45 * len(series) * len(CIRCUITS)), 4.5))
    width = 0.8 / max(len(series), 1)
    runs = list(dict.fromkeys(label.rsplit(" ", 1)[0] for label in series))  # one colour per run
    for index, (label, values) in enumerate(series.items()):
        xs = [c + (index - (len(series) - 1) / 2) * width for c in range(len(CIRCUITS))]
        heights = [values.get(c, math.nan) for c in CIRCUITS]
        ax.bar(
            xs,
            [h if h > 0 else math.nan for h in heights],
            width,
            label=label,
            color=f"C{runs.index(label.rsplit(' ', 1)[0]) % 10}",
            edgecolor="black",
            linewidth=0.5,
            hatch="//" if label.endswith(" wire") else None,
        )
        for x, height in zip(xs, heights):
            if height == 0:
                ax.annotate("0", (x, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom", fontsize="small")
    if any(v > 0 for values in series.values() for v in values.values()):
        ax.set_yscale("log")
    ax.set_xticks(range(len(CIRCUITS)), CIRCUITS)
    ax.set(ylabel="bytes per token", title="Bytes per fast-circuit token, by circuit")
    ax.grid(axis="y", alpha=0.3, which="both")
    if series:
        ax.legend(fontsize="small")
    _save(fig, path)


def fidelity_series(runs: list[RunFiles]) -> dict[int, dict[str, list[tuple[float, float]]]]:
    """``{boundary: {"<run> <codec>": [(snapshot step, cos), ...], "<run> level": [(step, level), ...]}}`` from
    the anchor's logged rounds: ``fidelity/b<k>/<codec>/cos`` at ``fidelity/step`` (each round once), and the
    governor's level in use at each training log (``governor/b<k>/level``, 0 = the ladder's cheapest). A demo
    summary's ``governor.fidelity`` counts when the run has no trainer state."""
    series: dict[int, dict[str, list[tuple[float, float]]]] = {}
    for run in runs:
        entries = run.log_history or ((run.demo or {}).get("governor") or {}).get("fidelity") or []
        seen: set[float] = set()
        for entry in entries:
            for key, value in entry.items():
                level = _LEVEL.match(key)
                if level and "step" in entry:
                    series.setdefault(int(level[1]), {}).setdefault(f"{run.name} level", []).append(
                        (float(entry["step"]), float(value))
                    )
            step = entry.get("fidelity/step")
            if step is None or step in seen:  # a round stays the newest until the next one: draw it once
                continue
            seen.add(step)
            for key, value in entry.items():
                match = _COS.match(key)
                if match:
                    series.setdefault(int(match[1]), {}).setdefault(f"{run.name} {match[2]}", []).append(
                        (float(step), float(value))
                    )
    return series


def draw_fidelity(series: dict[int, dict[str, list[tuple[float, float]]]], path: Path) -> None:
    """Top row: cos(gradient through the codec, dense gradient) vs the anchor snapshot's step, one panel per
    boundary, one line per run and codec. Bottom row (governed runs): the level each boundary ran at."""
    boundaries = sorted(series)
    governed = any(label.endswith(" level") for lines in series.values() for label in lines)
    rows = 2 if governed else 1
    fig, grid = _figure((4.2 * len(boundaries) + 1.0, 3.6 * rows), ncols=len(boundaries), nrows=rows, squeeze=False)
    from matplotlib.ticker import MaxNLocator

    for column, boundary in enumerate(boundaries):
        cos_ax = grid[0][column]
        lines = series[boundary]
        for index, (label, points) in enumerate(
            sorted(item for item in lines.items() if not item[0].endswith(" level"))
        ):
            cos_ax.plot(*zip(*points), marker="o", markersize=3, color=f"C{index % 10}", label=label)
        cos_ax.set(xlabel="anchor snapshot step", ylabel="gradient cosine to dense", title=f"boundary {boundary}")
        cos_ax.legend(fontsize="x-small")
        if rows == 2:
            level_ax = grid[1][column]
            for index, (label, points) in enumerate(
                sorted(item for item in lines.items() if item[0].endswith(" level"))
            ):
                level_ax.step(*zip(*points), where="post", color=f"C{index % 10}", label=label)
            level_ax.set(xlabel="step", ylabel="level in use (0 = cheapest)")
            level_ax.yaxis.set_major_locator(MaxNLocator(integer=True))
            level_ax.legend(fontsize="x-small")
        for ax in (row[column] for row in grid):
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
            ax.grid(alpha=0.3)
    _save(fig, path)


def _figure(size: tuple[float, float], ncols: int = 1, nrows: int = 1, squeeze: bool = True) -> tuple[Any, Any]:
    try:
        from matplotlib.figure import Figure
    except ModuleNotFoundError as err:  # an optional extra: say which
        raise ModuleNotFoundError("meshtune report draws with matplotlib: pip install 'hf_meshtune[report]'") from err
    fig = Figure(figsize=size, layout="constrained")
    return fig, fig.subplots(nrows=nrows, ncols=ncols, squeeze=squeeze)


def _save(fig: Any, path: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    FigureCanvasAgg(fig).print_png(str(path))
