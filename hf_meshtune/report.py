"""``meshtune report``: every run in a folder → a loss plot, a bytes-per-token plot and ``report.md``.

A *run* is any folder (the folder given or one below it, at any depth) that holds what a run leaves:

- ``trainer_state.json`` (``Trainer.save_state()``; also inside every ``checkpoint-N``): the log
  history, whose training lines carry the analytic byte ledger (``comm/*_bytes_per_token``), the
  compression against dense and the anchor staleness. The run's own file wins; without one the
  newest checkpoint's is read, and a checkpoint folder is never a run of its own below its parent;
- ``mesh_summary.json`` (the distributed mesh, ``runtime.results.summarize``): the bytes each circuit really
  put on the wire, next to the analytic ledger, DP syncs, anchor rounds and staleness;
- ``summary.json`` (``meshtune demo``): first/last training loss, dense eval loss, the last log line.

One row per run (``run_row``) feeds everything: the table in ``report.md``, the bars and the tests.
The plots are drawn on a bare ``matplotlib.figure.Figure`` (Agg), so no pyplot state or GUI
backend is touched, even when this runs inside a notebook.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tqdm import tqdm
from transformers.trainer import TRAINER_STATE_NAME
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

from ._validation import require
from .comm.wire import CIRCUITS
from .memory import MEMORY_PARTS
from .report_plots import bar_series, draw_bytes, draw_fidelity, draw_loss, fidelity_series
from .runtime.job import SUMMARY_NAME as MESH_SUMMARY_NAME
from .runtime.results import wire_bytes_per_token

__all__ = [
    "BYTES_PLOT_NAME",
    "CIRCUITS",
    "DEMO_SUMMARY_NAME",
    "LOSS_PLOT_NAME",
    "MESH_SUMMARY_NAME",
    "REPORT_NAME",
    "RunFiles",
    "find_runs",
    "load_run",
    "run_row",
    "write_report",
]

DEMO_SUMMARY_NAME = "summary.json"  # what ``demo.run_demo`` writes (it names no constant)
REPORT_NAME, LOSS_PLOT_NAME, BYTES_PLOT_NAME = "report.md", "loss.png", "bytes_per_token.png"
FIDELITY_PLOT_NAME = "fidelity.png"  # drawn only when a run's anchor measured the boundary codecs' fidelity
_RUN_FILES = frozenset({TRAINER_STATE_NAME, MESH_SUMMARY_NAME, DEMO_SUMMARY_NAME})
_RUN_RULE = (
    f"contain at least one run: a folder with {TRAINER_STATE_NAME} (or {PREFIX_CHECKPOINT_DIR}-N/"
    f"{TRAINER_STATE_NAME}), {MESH_SUMMARY_NAME} or {DEMO_SUMMARY_NAME}"
)
_CHECKPOINT = re.compile(rf"{re.escape(PREFIX_CHECKPOINT_DIR)}-(\d+)")


@dataclass
class RunFiles:
    """What one run folder holds, each file read once. ``name`` is its path below the report's root."""

    name: str
    folder: Path
    sources: list[str]
    state: dict[str, Any] | None
    mesh: dict[str, Any] | None
    demo: dict[str, Any] | None

    @property
    def log_history(self) -> list[dict[str, Any]]:
        return self.state["log_history"] if self.state else []


def write_report(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> dict[str, Any]:
    """Find the runs under ``run_dir``; write ``loss.png``, ``bytes_per_token.png``, ``report.md`` and, when
    a run logged the anchor's fidelity rounds (``fidelity/*``, ``governor/*``), ``fidelity.png``.

    ``out_dir`` defaults to ``run_dir``. Returns ``{"report", "loss_plot", "bytes_plot"}`` (paths as
    strings; ``"fidelity_plot"`` too when drawn), ``"rows"`` (one ``run_row`` per run, in folder order),
    ``"bars"`` (the values drawn: ``{"<run> analytic" | "<run> wire": {circuit: bytes per token}}``) and
    ``"fidelity"`` (``report_plots.fidelity_series``).
    """
    root = Path(run_dir)
    require(root.is_dir(), "run_dir", str(run_dir), "be an existing folder")
    folders = find_runs(root)
    require(len(folders) > 0, "run_dir", str(run_dir), _RUN_RULE)
    out = Path(out_dir) if out_dir is not None else root
    require(not out.exists() or out.is_dir(), "out_dir", str(out), "be a folder (or not exist yet)")
    # every file is read (and rejected if corrupt) before anything is written
    runs = [load_run(root, folder) for folder in tqdm(folders, desc="meshtune report", unit="run", disable=None)]
    rows = [run_row(run) for run in runs]
    bars = bar_series(rows)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"report": out / REPORT_NAME, "loss_plot": out / LOSS_PLOT_NAME, "bytes_plot": out / BYTES_PLOT_NAME}
    fidelity = fidelity_series(runs)
    if fidelity:
        paths["fidelity_plot"] = out / FIDELITY_PLOT_NAME
        draw_fidelity(fidelity, paths["fidelity_plot"])
    draw_loss(runs, rows, paths["loss_plot"])
    draw_bytes(bars, paths["bytes_plot"])
    paths["report"].write_text(format_report(root, rows, fidelity=bool(fidelity)), encoding="utf-8")
    return {**{key: str(path) for key, path in paths.items()}, "rows": rows, "bars": bars, "fidelity": fidelity}


# ---------------------------------------------------------------------------------------------------
# Finding and reading runs
# ---------------------------------------------------------------------------------------------------


def find_runs(root: Path) -> list[Path]:
    """Every run folder under ``root`` (``root`` included), parents before children, names sorted.

    A ``checkpoint-N`` folder below ``root`` belongs to its parent: it makes the parent a run (a run
    stopped before ``save_state``) and is not searched further.
    """
    found = []
    for folder, subfolders, files in os.walk(root):
        checkpoints = [name for name in subfolders if _CHECKPOINT.fullmatch(name)]
        subfolders[:] = sorted(name for name in subfolders if name not in checkpoints)
        here = Path(folder)
        if _RUN_FILES & set(files) or any((here / name / TRAINER_STATE_NAME).is_file() for name in checkpoints):
            found.append(here)
    return found


def load_run(root: Path, folder: Path) -> RunFiles:
    """Read the run in ``folder``; a corrupt or malformed file is a ``ValueError`` naming it."""
    state_file = _state_file(folder)
    mesh_file, demo_file = folder / MESH_SUMMARY_NAME, folder / DEMO_SUMMARY_NAME
    present = [path for path in (state_file, mesh_file, demo_file) if path is not None and path.is_file()]
    state = _read_json(state_file) if state_file is not None else None
    if state is not None:
        history = state.get("log_history")
        require(
            isinstance(history, list) and all(isinstance(entry, dict) for entry in history),
            "file",
            str(state_file),
            "hold a log_history list of log dicts, as Trainer.save_state() writes it",
        )
    return RunFiles(
        name=_run_name(root, folder),
        folder=folder,
        sources=[path.relative_to(folder).as_posix() for path in present],
        state=state,
        mesh=_read_json(mesh_file) if mesh_file.is_file() else None,
        demo=_read_json(demo_file) if demo_file.is_file() else None,
    )


def _state_file(folder: Path) -> Path | None:
    """The run's own ``trainer_state.json``, else the one of its highest-numbered checkpoint."""
    own = folder / TRAINER_STATE_NAME
    if own.is_file():
        return own
    # numeric order: checkpoint-10 is newer than checkpoint-9, though it sorts before it as text
    numbered = [
        (int(match[1]), path)
        for path in folder.iterdir()
        if (match := _CHECKPOINT.fullmatch(path.name)) and (path / TRAINER_STATE_NAME).is_file()
    ]
    return max(numbered)[1] / TRAINER_STATE_NAME if numbered else None


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8", errors="replace"))
    except json.JSONDecodeError as err:
        # the same wording as require(); `from None`: the decoder's traceback adds nothing to it
        raise ValueError(f"file={str(path)!r} is invalid: it must hold valid JSON ({err})") from None
    require(isinstance(data, dict), "file", str(path), "hold a JSON object")
    return data


def _run_name(root: Path, folder: Path) -> str:
    relative = folder.relative_to(root).as_posix()
    return root.resolve().name if relative == "." else relative  # "." says nothing in a legend


# ---------------------------------------------------------------------------------------------------
# One row per run
# ---------------------------------------------------------------------------------------------------


def run_row(run: RunFiles) -> dict[str, Any]:
    """The numbers a report shows for one run; ``None`` where the run's files do not say.

    Training numbers come from the log history first, then from the mesh summary, then from the
    demo's summary. ``bytes_per_token`` is analytic (the ledger: ``pp_fwd``, ``pp_bwd``, ``dp``,
    ``anchor``, ``total``); from a distributed mesh, ``wire_bytes_per_token`` what it put on its links,
    the sum of ``measured_bytes_per_token`` (point-to-point payloads, counted) and
    ``booked_bytes_per_token`` (all-reduces at a ring's 2(n-1)/n, a formula; None in older summaries).
    """
    history, mesh, demo = run.log_history, run.mesh or {}, run.demo or {}
    last_log = demo.get("last_log")
    demo_log = last_log if isinstance(last_log, dict) else {}
    train = [entry for entry in history if "loss" in entry]
    evals = [entry for entry in history if "eval_loss" in entry]
    return {
        "run": run.name,
        "path": str(run.folder),
        "sources": run.sources,
        "steps": _first(run.state and run.state.get("global_step"), mesh.get("steps"), demo_log.get("step")),
        "first_train_loss": _first(train and train[0]["loss"], demo.get("masked_train_loss_first_log")),
        "last_train_loss": _first(
            train and train[-1]["loss"], mesh.get("final_loss"), demo.get("masked_train_loss_last_log")
        ),
        "last_eval_loss": _first(
            evals and evals[-1]["eval_loss"], mesh.get("eval_loss"), demo.get("dense_eval_loss_after")
        ),
        "bytes_per_token": _first(
            _logged_ledger(history), _logged_ledger([demo_log]), _circuit_dict(mesh.get("analytic_bytes_per_token"))
        ),
        "wire_bytes_per_token": _circuit_dict(wire_bytes_per_token(mesh)),
        "measured_bytes_per_token": _circuit_dict(mesh.get("measured_bytes_per_token"))
        if "wire_bytes_per_token" in mesh
        else None,
        "booked_bytes_per_token": _circuit_dict(mesh.get("booked_bytes_per_token")),
        "compression_vs_dense": _first(
            _last_logged(history, "comm/compression_vs_dense_ratio"),
            _last_logged([demo_log], "comm/compression_vs_dense_ratio"),
        ),
        "anchor_staleness_steps": _first(
            _last_logged(history, "anchor/staleness_steps"),
            _last_logged([demo_log], "anchor/staleness_steps"),
            mesh.get("anchor_staleness_mean"),
        ),
        # RL runs (TRL's GRPO/GSPO log the mean reward of each step's rollouts)
        "first_reward": _first_logged(history, "reward"),
        "last_reward": _last_logged(history, "reward"),
        "mesh": run.mesh,
    }


def _first(*values: Any) -> Any:
    """The first value that is neither None nor empty (``[]``, ``{}``); None if there is none."""
    return next((value for value in values if value is not None and value != [] and value != {}), None)


def _first_logged(history: list[dict[str, Any]], key: str) -> float | None:
    return next((entry[key] for entry in history if key in entry), None)


def _last_logged(history: list[dict[str, Any]], key: str) -> float | None:
    return next((entry[key] for entry in reversed(history) if key in entry), None)


def _logged_ledger(history: list[dict[str, Any]]) -> dict[str, float | None] | None:
    """The last logged ``comm/<circuit>_bytes_per_token`` of each circuit and the total; None if none."""
    ledger = {name: _last_logged(history, f"comm/{name}_bytes_per_token") for name in (*CIRCUITS, "total")}
    return ledger if any(value is not None for value in ledger.values()) else None


def _circuit_dict(values: Any) -> dict[str, float | None] | None:
    if not isinstance(values, dict):
        return None
    return {name: values.get(name) for name in (*CIRCUITS, "total")}


# ---------------------------------------------------------------------------------------------------
# report.md
# ---------------------------------------------------------------------------------------------------


def format_report(root: Path, rows: list[dict[str, Any]], fidelity: bool = False) -> str:
    """The Markdown report: a table of runs, the mesh's bytes on the wire if any, the plots (the fidelity
    plot when ``fidelity``)."""
    lines = [
        f"# Training report: `{root}`",
        "",
        f"{len(rows)} run{'s' if len(rows) != 1 else ''}. Bytes per token are per fast-circuit token, summed "
        "over every link of the mesh: *analytic* is the byte ledger of the last training log "
        "(`comm/*_bytes_per_token`); *on the wire* is what the distributed mesh put on its links "
        f"(`{MESH_SUMMARY_NAME}`): *measured* point-to-point payloads plus all-reduces *booked* at a ring's "
        "2(n-1)/n × the tensor bytes (a formula: the backend's own traffic is not visible to the mesh).",
        "",
        "## Runs",
        "",
        *_runs_table(rows),
        "",
    ]
    meshes = [row for row in rows if row["mesh"] is not None]
    if meshes:
        lines += [
            "## Distributed mesh: bytes on the wire",
            "",
            *_mesh_bytes_table(meshes),
            "",
            *_mesh_numbers_table(meshes),
            "",
        ]
        memory = [line for row in meshes for line in mesh_memory_table(row["run"], row["mesh"])]
        if memory:
            lines += [
                "## Distributed mesh: memory per process",
                "",
                "GiB per process, measured (the memory ledger's prediction for its role and stage): parts "
                "counted from the tensors, activations by autograd's saved-tensor hooks, peak RSS from the kernel.",
                "",
                *memory,
                "",
            ]
    lines += [
        "## Plots",
        "",
        f"![training loss (and reward) vs step]({LOSS_PLOT_NAME})",
        "",
        f"![bytes per token by circuit]({BYTES_PLOT_NAME})",
        "",
    ]
    if fidelity:
        lines += [
            "The anchor's fidelity rounds: per boundary, cos(gradient through each codec level, dense gradient) on "
            "the round's batch, and the level a governed run used (`fidelity/*`, `governor/*`).",
            "",
            f"![boundary codec fidelity vs step]({FIDELITY_PLOT_NAME})",
            "",
        ]
    return "\n".join(lines)


def _runs_table(rows: list[dict[str, Any]]) -> list[str]:
    rl = any(row["last_reward"] is not None for row in rows)
    header = [
        "run",
        "steps",
        "first train loss",
        "last train loss",
        "last eval loss",
        *(["first reward", "last reward"] if rl else []),
        *(f"{c} B/token" for c in CIRCUITS),
        "total B/token",
        "vs dense",
        "anchor staleness (steps)",
        "from",
    ]
    table = [_table_row(header), _table_row(["---", *["---:"] * (len(header) - 2), "---"])]
    for row in rows:
        ledger = row["bytes_per_token"] or {}
        compression = row["compression_vs_dense"]
        table.append(
            _table_row(
                [
                    row["run"],
                    _fmt(row["steps"], "d"),
                    *(_fmt(row[k], ".4f") for k in ("first_train_loss", "last_train_loss", "last_eval_loss")),
                    *((_fmt(row["first_reward"], ".3f"), _fmt(row["last_reward"], ".3f")) if rl else ()),
                    *(_fmt(ledger.get(c), ",.1f") for c in (*CIRCUITS, "total")),
                    "–" if compression is None else f"{compression:.2f}×",
                    _fmt(row["anchor_staleness_steps"], ".3g"),
                    ", ".join(row["sources"]),
                ]
            )
        )
    return table


def _mesh_bytes_table(rows: list[dict[str, Any]]) -> list[str]:
    header = ["run", "mesh", "circuit", "measured sends", "booked all-reduces", "on the wire", "analytic"]
    table = [_table_row([*header[:3], *(f"{h} B/token" for h in header[3:])]), "|---|---|---|---:|---:|---:|---:|"]
    for row in rows:
        analytic = _circuit_dict(row["mesh"].get("analytic_bytes_per_token")) or {}
        figures = [row[k] or {} for k in ("measured_bytes_per_token", "booked_bytes_per_token", "wire_bytes_per_token")]
        for circuit in (*CIRCUITS, "total"):
            cells = [_fmt(f.get(circuit), ",.1f") for f in (*figures, analytic)]
            table.append(_table_row([row["run"], str(row["mesh"].get("mesh", "–")), circuit, *cells]))
    return table


def _mesh_numbers_table(rows: list[dict[str, Any]]) -> list[str]:
    header = [
        "run",
        "steps",
        "fast tokens",
        "DP bytes per sync per rank",
        "syncs per rank",
        "anchor rounds",
        "staleness mean / max",
        "step s",
        "final loss",
    ]
    table = [_table_row(header), _table_row(["---", *["---:"] * (len(header) - 1)])]
    for row in rows:
        mesh = row["mesh"]
        staleness = f"{_fmt(mesh.get('anchor_staleness_mean'), '.2f')} / {_fmt(mesh.get('anchor_staleness_max'), 'g')}"
        table.append(
            _table_row(
                [
                    row["run"],
                    _fmt(mesh.get("steps"), "d"),
                    _fmt(mesh.get("fast_tokens"), ",d"),
                    _fmt(mesh.get("dp_bytes_per_sync_per_rank"), ",.0f"),
                    _fmt(mesh.get("dp_syncs_per_rank"), "g"),
                    _fmt(mesh.get("anchor_rounds"), "d"),
                    staleness,
                    _fmt(mesh.get("step_seconds_mean"), ".1f"),
                    _fmt(mesh.get("final_loss"), ".4f"),
                ]
            )
        )
    return table


def mesh_memory_table(run: str, summary: dict[str, Any]) -> list[str]:
    """Every process of a mesh summary: each part measured (predicted), their sum, the peak RSS; [] for a
    summary without memory figures (older runs)."""
    processes = summary.get("memory_gib") or []
    if not processes:
        return []
    predicted = {(p["role"], p["stage"]): p for p in summary.get("memory_predicted_gib") or []}
    header = ["run", "rank", "role", "stage", *MEMORY_PARTS, "counted (predicted)", "peak RSS"]
    table = [_table_row(header), "|---|---:|---|---:|" + "---:|" * (len(MEMORY_PARTS) + 2)]
    for proc in processes:
        guess = predicted.get((proc["role"], proc["stage"]), {})
        cells = [_measured(proc.get(part), guess.get(part)) for part in (*MEMORY_PARTS, "counted")]
        if guess:
            cells[-1] = _measured(proc.get("counted"), guess.get("total"))
        table.append(
            _table_row(
                [run, str(proc["rank"]), proc["role"], str(proc["stage"]), *cells, _fmt(proc["peak_rss"], ".2f")]
            )
        )
    return table


def _measured(value: float | None, predicted: float | None) -> str:
    return _fmt(value, ".3f") + ("" if predicted is None else f" ({predicted:.3f})")


def _fmt(value: Any, spec: str) -> str:
    """``value`` formatted with ``spec``; "–" when missing, ``str(value)`` when it does not fit the spec."""
    if value is None:
        return "–"
    try:
        return format(value, spec)
    except (TypeError, ValueError):  # e.g. a float step count under "d"
        return str(value)


def _table_row(cells: list[str]) -> str:
    return "| " + " | ".join(cell.replace("|", "\\|") for cell in cells) + " |"
