"""How much sooner than Dense a row reaches Dense's final quality when it may train longer: the WAN benchmark's
80-step table leaves the figure undefined (no compressed row reaches Dense's final held-out loss in 80 steps), so
here the default row, and the peer a user would pick instead (torchft DiLoCo), train with longer step budgets, each
with the benchmark's own schedule stretched over the budget (warm-up a tenth, cosine to 0.1×), on the same data in
the same order, at the benchmark's lr and at 0.002 (``rows.EQUAL_QUALITY_ROWS``), and the default at 0.002 with
dp_sweep's best outer step there (averaging, η = 1, μ = 0, instead of MeshConfig's Nesterov η = 0.7, μ = 0.9), that
one also with each sync overlapping the next 5 inner steps (kept) at low priority on the links
(``dp_r128_int8_avg_lr2e-3_overlap_low``). Dense trains its 80 steps at every lr of dp_sweep's grid
(``DENSE_NAMES``): the benchmark's lr is tuned for neither, so the target is tuned Dense's final loss (its best
lr), with Dense at the WAN table's lr beside it.

    sudo .venv/bin/python -m benchmarks.wan.equal_quality   # ≈ 93 min on 2 idle CPU cores (≈ 82 after dp_sweep, run)

Quality does not depend on the links for these rows (an overlapped sync lands τ steps after its prepare whatever
the links), so every run trains on compute-bound links (10 Gbit/s, no delay) and is timed with its row's
steady-state step on the shaped links from the committed ``results/wan.json`` (run.py's shaped timing window), or for
the overlapped row from ``results/throughput.json`` (a window of the same length on the same links, the default row
timed beside it); neither the lr nor the outer step changes a step's bytes or FLOPs (``timed_as``). ``--keep``
trains only ``--rows`` and keeps the other runs of the committed json. Time to a target for one budget = the first
saved step (every 10) whose held-out loss is at or below it × that step time; a row's figure is its best budget's.
Dense's own time is its 80 steps at its shaped step. Runs are cached in the WAN benchmark's work folder
(``run._run``: the 80-step runs are run.py's and dp_sweep's own, the others phase ``budget<B>``);
``equal_quality.json`` is written after every run.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import replace
from pathlib import Path

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .rows import ROWS, THROUGHPUT_ROWS, Row, Shape
from .run import (
    ANCHOR_ROWS,
    COMPUTE_LINKS,
    RESULTS,
    SYNC_ROWS,
    _fmt,
    _run,
    cpu_machine,
    evaluate,
    final_loss,
    first_step_at,
    generated_by,
    load_data,
)

DENSE_STEPS = 80  # run.py's steps: Dense's final quality is the target
DENSE_NAMES = ("dense", "dense_lr1e-3", "dense_lr2e-3", "dense_lr4e-3")  # Dense over dp_sweep's lr grid
BUDGETS = (80, 100, 120, 160, 240)
# the default at 0.002 with dp_sweep's best outer step there (averaging: η = 1, μ = 0) besides MeshConfig's
ROW_NAMES = (
    "dp_r128_int8_avg_lr2e-3_overlap_low",
    "dp_r128_int8_avg_lr2e-3",
    "default_lr2e-3",
    "torchft_diloco_lr2e-3",
    "default",
    "torchft_diloco",
)


def _cost(row: Row) -> Row:
    """What sets a row's step time: the row less its label, peak lr and outer step (none of them changes a byte
    or a FLOP), its sync period spelled out."""
    return replace(
        row, label="", lr=None, outer_lr=None, outer_momentum=None, sync_every=row.sync_every or Shape().sync_every
    )


def timed_as(name: str) -> str | None:
    """The row whose shaped step time a run of ``name`` takes (None: none costs the same): a row of the WAN
    table, else a variant of the throughput benchmark (``rows.THROUGHPUT_ROWS``: the DP sync overlapped, at low
    priority, ...), timed by the same window on the same links."""
    candidates = SYNC_ROWS + ANCHOR_ROWS + list(THROUGHPUT_ROWS)
    return next((n for n in candidates if _cost(ROWS[n]) == _cost(ROWS[name])), None)


def step_times(out: Path) -> dict[str, dict]:
    """Every timed row's steady-state step on the shaped links: the WAN table's (``wan.json``'s shaped phase),
    then the throughput variants' (``throughput.json``), each with the file it comes from."""
    wan = json.loads((out / "wan.json").read_text())["phases"]["shaped"]
    times = {n: r | {"source": "wan.json"} for n, r in wan.items()}
    path = out / "throughput.json"
    if path.exists():
        for n, r in json.loads(path.read_text())["rows"].items():
            if n in THROUGHPUT_ROWS:
                times[n] = r["shaped"] | {"source": "throughput.json"}
            elif n == "default":  # the default row timed in that run too: the two files' machine speeds differ
                times["default in throughput.json"] = r["shaped"] | {"source": "throughput.json"}
    return times


def _curve(ev: dict) -> dict[int, float]:
    return {int(k): v for k, v in ev["eval_loss"].items()}


def summarize(report: dict, shaped: dict, dense_name: str | None = None) -> dict:
    """Against Dense's final loss (``dense_name``'s; None: the best over Dense's lrs): per row and budget, the
    first step at it and the time that takes on the shaped links; per row, its best budget and the speedup."""
    dense_runs = {n: final_loss(report["runs"][n][str(DENSE_STEPS)]) for n in DENSE_NAMES if n in report["runs"]}
    dense_name = dense_name or min(dense_runs, key=dense_runs.get)
    target = dense_runs[dense_name]
    dense_time = DENSE_STEPS * shaped["dense"]["step_seconds"]
    rows = {}
    for name, budgets in report["runs"].items():
        if name in DENSE_NAMES:
            continue
        timing_row = timed_as(name)
        timed = shaped[timing_row]
        step_s = timed["step_seconds"]
        per_budget = {}
        for budget, ev in budgets.items():
            step = first_step_at(_curve(ev), target)
            per_budget[budget] = {
                "final_eval_loss": final_loss(ev),
                "exact_match": ev["exact_match"],
                "steps_to_dense_quality": step,
                "time_to_quality_s": None if step is None else step * step_s,
            }
        times = [(b["time_to_quality_s"], budget) for budget, b in per_budget.items() if b["time_to_quality_s"]]
        best = min(times) if times else None
        rows[name] = {
            "label": ROWS[name].label,
            "peer": ROWS[name].peer,
            "shaped_step_seconds": step_s,
            "timed_as": timing_row,
            "timed_in": timed["source"],
            "default_step_there": shaped.get(
                "default" if timed["source"] == "wan.json" else f"default in {timed['source']}", {}
            ).get("step_seconds"),
            "budgets": per_budget,
            "best_budget": None if best is None else best[1],
            "time_to_quality_s": None if best is None else best[0],
            "speedup_at_dense_quality": None if best is None else dense_time / best[0],
        }
    return {
        "dense": dense_name,
        "dense_final_losses": dense_runs,
        "target_eval_loss": target,
        "dense_time_to_quality_s": dense_time,
        "dense_shaped_step_seconds": shaped["dense"]["step_seconds"],
        "rows": rows,
    }


def _table(report: dict, summary: dict) -> list[str]:
    lines = [
        "| row | budget (steps) | final eval loss | exact match | steps to the target | shaped step s | "
        "time to the target (s) | speedup at the target |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    dense_ev = report["runs"][summary["dense"]][str(DENSE_STEPS)]
    lines.append(
        f"| {ROWS[summary['dense']].label} | {DENSE_STEPS} | {final_loss(dense_ev):.4f} | "
        f"{dense_ev['exact_match']:.0%} | {DENSE_STEPS} | {summary['dense_shaped_step_seconds']:.3f} | "
        f"{summary['dense_time_to_quality_s']:,.1f} | 1.00× |"
    )
    for r in summary["rows"].values():
        for budget, b in r["budgets"].items():
            best = budget == r["best_budget"]
            speedup = summary["dense_time_to_quality_s"] / b["time_to_quality_s"] if b["time_to_quality_s"] else None
            lines.append(
                f"| {r['label']}{' (peer)' if r['peer'] else ''} | {budget} | {b['final_eval_loss']:.4f} | "
                f"{b['exact_match']:.0%} | {_fmt(b['steps_to_dense_quality'], 'd', 'not reached')} | "
                f"{r['shaped_step_seconds']:.3f} | {_fmt(b['time_to_quality_s'], ',.1f')} | "
                f"{'**' if best else ''}{_fmt(speedup, '.2f')}{'×' if speedup else ''}{'**' if best else ''} |"
            )
    return lines


def write_report(report: dict, shaped: dict, out: Path) -> None:
    tuned, base = summarize(report, shaped), summarize(report, shaped, "dense")
    grid = ", ".join(f"{ROWS[n].lr or Shape().lr:g}: {v:.4f}" for n, v in tuned["dense_final_losses"].items())
    lines = [
        "# Time to Dense's final quality with longer step budgets",
        "",
        generated_by("equal_quality", report) + f", {report['seconds'] / 60:.0f} min. Dense trains its "
        f"{DENSE_STEPS} steps at each peak lr of the grid (final held-out loss by lr: {grid}; results/wan.json's "
        f"Dense, lr {Shape().lr:g}: {report['wan_dense_final']:.4f}). Dense's time to its final loss: {DENSE_STEPS} × "
        f"{tuned['dense_shaped_step_seconds']:.3f} s = {tuned['dense_time_to_quality_s']:,.1f} s on the shaped "
        "links, whatever the lr. Every other run trains the row for the budget's steps with the benchmark's "
        "schedule stretched over them (warm-up a tenth, cosine to 0.1×), same data and order, on compute-bound "
        "links, at the lr its label names (else the benchmark's); its time = the first saved step (every 10) at "
        "or below the target × the row's steady-state step on the shaped links (results/wan.json, run.py's timing "
        "window). Speedup = Dense's time over the row's best budget's.",
        *_provenance(report, tuned),
        "",
        f"**Target: tuned Dense** (its best lr of the grid, {ROWS[tuned['dense']].lr or Shape().lr:g}), "
        f"{tuned['target_eval_loss']:.4f}:",
        "",
        *_table(report, tuned),
        "",
        f"**Target: Dense at the WAN table's lr** ({Shape().lr:g}), {base['target_eval_loss']:.4f}:",
        "",
        *_table(report, base),
        "",
        "Held-out loss along each run (steps 0, 10, …):",
        "",
    ]
    for name, budgets in report["runs"].items():
        for budget, ev in budgets.items():
            curve = ", ".join(f"{v:.3f}" for _, v in sorted(_curve(ev).items()))
            lines.append(f"- {ROWS[name].label}, {budget} steps: {curve}")
    lines.append("")
    (out / "equal_quality.md").write_text("\n".join(lines))
    _plot(report, tuned, base, out)


def _provenance(report: dict, summary: dict) -> list[str]:
    """Sentences on runs timed outside wan.json and on runs kept from an earlier invocation (``--keep``)."""
    lines = []
    for r in summary["rows"].values():
        if r["timed_in"] != "wan.json":
            lines.append(
                f"{r['label']} is timed as `{r['timed_as']}` ({ROWS[r['timed_as']].label}) in results/{r['timed_in']}:"
                f" a timing window of the same length on the same links, {r['shaped_step_seconds']:.3f} s a step (the "
                f"default row there: {_fmt(r['default_step_there'], '.3f')} s; in wan.json: "
                f"{_fmt(summary['rows'].get('default', {}).get('shaped_step_seconds'), '.3f')} s)."
            )
    if "kept_from" in report:
        k = report["kept_from"]
        lines.append(
            f"Rows not trained in this invocation (`--keep`) were trained by an earlier one ({k['date']}, "
            f"{k['seconds'] / 60:.0f} min) of the same settings."
        )
    return ["", " ".join(lines)] if lines else []


def _plot(report: dict, tuned: dict, base: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5.4))
    for name, budgets in report["runs"].items():
        dense = name in DENSE_NAMES
        step_s = tuned["dense_shaped_step_seconds"] if dense else tuned["rows"][name]["shaped_step_seconds"]
        # one curve per row: its best budget against tuned Dense, else its longest
        budget = str(DENSE_STEPS) if dense else tuned["rows"][name]["best_budget"] or max(budgets, key=int)
        curve = sorted((s, v) for s, v in _curve(budgets[budget]).items() if s > 0)
        ax.plot(
            [s * step_s for s, _ in curve],
            [v for _, v in curve],
            marker=".",
            lw=1,
            ls="--" if dense else "-",
            label=f"{ROWS[name].label}, {budget} steps",
        )
    ax.axhline(tuned["target_eval_loss"], color="black", ls="-.", lw=0.8, label="tuned Dense final")
    ax.axhline(base["target_eval_loss"], color="gray", ls=":", lw=0.8, label=f"Dense final at lr {Shape().lr:g}")
    ax.set_xscale("log")
    ax.set_ylim(0.35, 1.6)
    ax.set_xlabel("simulated wall-clock on the shaped links (s) = step × steady-state step time")
    ax.set_ylabel("held-out loss on the answer tokens (dense model)")
    ax.set_title("each row's best budget against tuned Dense (else its longest)", fontsize=9)
    ax.legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "equal_quality.png", dpi=110)
    plt.close(fig)


def _budgets(text: str) -> list[int] | None:
    """The step budgets in ``--budgets`` (None: not a list of step counts of at least 10)."""
    try:
        budgets = [int(b) for b in text.split(",") if b]
    except ValueError:
        return None
    return budgets if budgets and all(b >= 10 for b in budgets) else None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.equal_quality")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders and token data (shared)")
    parser.add_argument("--budgets", default=",".join(map(str, BUDGETS)), help="step budgets, comma-separated")
    parser.add_argument(
        "--rows",
        default=",".join(ROW_NAMES),
        help="rows of rows.ROWS trained at every budget, each timed as the WAN row that costs the same (timed_as)",
    )
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-items", type=int, default=Shape().n_eval)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--report", action="store_true", help="only rebuild the table and plot from OUT's json")
    parser.add_argument(
        "--keep",
        action="store_true",
        help="keep the runs OUT's json holds of rows --rows does not name (and of Dense) instead of training them",
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    path = out / "equal_quality.json"
    wan = json.loads((out / "wan.json").read_text())
    shaped = step_times(out)
    names = [n for n in args.rows.split(",") if n]
    timed = {n: timed_as(n) for n in names if n in ROWS}
    unusable = [n for n in names if timed.get(n) not in shaped or "error" in shaped[timed[n]] or ROWS[n].anchor]
    if unusable:
        parser.error(f"--rows {unusable}: name synchronous rows timed in {out / 'wan.json'} or throughput.json")
    if args.report:
        write_report(json.loads(path.read_text()), shaped, out)
        return
    budgets = _budgets(args.budgets)
    if budgets is None:
        parser.error(f"--budgets {args.budgets!r}: give step counts of at least 10, comma-separated, e.g. 80,120")
    netns.require_root()
    work = Path(args.work)
    data_path, data = load_data(work)
    report = {
        "machine": cpu_machine(),
        "eval_items": args.eval_items,
        "wan_dense_final": final_loss(wan["eval"]["dense"]),
        "runs": {},
    }
    seconds = 0.0
    if args.keep and path.exists():  # the other rows' runs as an earlier invocation left them
        kept = json.loads(path.read_text())
        report["runs"] = {n: r for n, r in kept["runs"].items() if n not in names}
        report["kept_from"] = kept.get("kept_from", kept["machine"] | {"seconds": kept["seconds"]})
        seconds = kept["seconds"]
    started = time.perf_counter()
    dense = [(name, DENSE_STEPS) for name in DENSE_NAMES if name not in report["runs"]]
    plan = dense + [(name, budget) for name in names for budget in budgets]
    netns.up(8, COMPUTE_LINKS["rate_mbit"], COMPUTE_LINKS["delay_ms"])
    try:
        for name, budget in plan:
            # the 80-step runs are run.py's and dp_sweep's own quality runs: cached ones are kept (run._run)
            phase = "compute" if budget == DENSE_STEPS else f"budget{budget}"
            result = _run(phase, name, work, data_path, budget, args.save_every, COMPUTE_LINKS)
            if "error" in result:
                raise RuntimeError(f"{name}, {budget} steps: {result['error']}")
            ev = evaluate(str(work / phase / name), data, args.eval_items)
            report["runs"].setdefault(name, {})[str(budget)] = ev
            report["seconds"] = seconds + time.perf_counter() - started
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
            if len(report["runs"]) > len(DENSE_NAMES):
                write_report(report, shaped, out)
            print(f"[equal_quality] {name}, {budget} steps: eval loss {final_loss(ev):.4f}", flush=True)
    finally:
        netns.down()


if __name__ == "__main__":
    main()
