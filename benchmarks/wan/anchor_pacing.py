"""What the anchor costs the fast steps on shaped links, and what a rate cap on its link changes.

    sudo .venv/bin/python -m benchmarks.wan.anchor_pacing   # ≈ 15 min on 2 idle cores; results/anchor_pacing.{json,md}

Three rows of the WAN benchmark (``rows.py``), one after another on the same emulated links, each fine-tuning
the pretrained tiny Llama for ``--steps`` steps: the default (outliers8+int8 boundaries, DiLoCo with rank-32
PowerSGD, no anchor), the same with the anchor sending rank-8 factors, and the same with every pair of the
anchor link capped at 1.3 Mbit/s (``anchor_rate_mbit``). The links are the committed WAN run's regime
(``results/wan.json``: rate R and one-way delay D), unless ``--rate-mbit``/``--delay-ms`` say otherwise.

Per row: the mesh's step time per step (the slowest fast rank's, as ``run.read_run``), its median, 90th
percentile and maximum after the warm-up, and the same over the steps right after a DiLoCo fragment sync (when
fast replica 0 forwards the committed update to the anchor, on the same link as its pipeline traffic); the
anchor's deliveries (how long each round's sending took, the staleness of what arrived); bytes per fast token
per circuit; the held-out loss at the end. Caveat of this emulation: only egress is shaped, so the anchor's
deliveries (which leave from the anchor's own nodes) do not queue on a fast node's link; fast replica 0's
forwarding does. Two anchor processes share the 2 cores with the six fast ones, which slows every fast step
on its own (the CPU, not the links); the compute-bound windows in ``results/wan.md`` show that part.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .rows import ROWS, Shape
from .run import RESULTS, _run, cpu_machine, evaluate, final_loss, generated_by, load_data

PACING_ROWS = ["default", "default_ap", "default_ap_paced"]


def step_profile(out: Path, row: str) -> dict:
    """The mesh's per-step times of one run (the slowest fast rank's per step), its anchor's delivery times."""
    shape = Shape()
    world = ROWS[row].replicas * shape.stages
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(world)]
    fast = [r for r in ranks if r["role"] == "fast"]
    steps = min(r["steps"] for r in fast)
    per_step = [max(r["step_seconds"][i] for r in fast) for i in range(steps)]
    warm = max(3, steps // 10)
    timed = list(enumerate(per_step))[warm:]
    period = shape.sync_every // shape.fragments
    # step i (0-based) is fast step i + 1: the first step after a fragment sync at step k·period is k·period + 1
    after_sync = [s for i, s in timed if i % period == 0]
    ordered = sorted(s for _, s in timed)
    deliveries = [s for r in ranks if r["role"] == "anchor" for s in r.get("delivery_seconds", [])]
    return {
        "step_seconds": per_step,
        "median_s": statistics.median(ordered),
        "p90_s": ordered[int(0.9 * (len(ordered) - 1))],
        "max_s": ordered[-1],
        "after_sync_mean_s": statistics.fmean(after_sync) if after_sync else None,
        "other_mean_s": statistics.fmean(s for i, s in timed if i % period != 0),
        "delivery_seconds": deliveries,
    }


def write_report(report: dict, out: Path) -> None:
    links = report["links"]
    lines = [
        "# The anchor's cost to fast steps on shaped links, with and without a rate cap on its link",
        "",
        generated_by("anchor_pacing", report) + f", {report.get('seconds', 0) / 60:.0f} min. "
        f"Links: {links['rate_mbit']:.3f} Mbit/s, one-way delay {links['delay_ms']:.2f} ms ({links['source']}); "
        f"{report['steps']} steps per row, 3 fast replicas × 2 stages (+1 anchor replica), the pretrained tiny Llama "
        "on the arithmetic task. Step times: the slowest fast rank's per step, after a warm-up of 8 steps; "
        "'after a sync': the steps right after a DiLoCo fragment sync, when fast replica 0 forwards the committed "
        "update to the anchor on its own link. Only egress is shaped, and two anchor processes share the 2 cores "
        "with the six fast ones (see the module's docstring).",
        "",
        "| row | median step (s) | p90 (s) | max (s) | after a sync, mean (s) | other steps, mean (s) | anchor "
        "round sending, mean / max (s) | staleness mean / max | anchor B/token | eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["rows"].items():
        p, r = row["profile"], row["run"]
        sending = (
            f"{statistics.fmean(p['delivery_seconds']):.2f} / {max(p['delivery_seconds']):.2f}"
            if p["delivery_seconds"]
            else "–"
        )
        stale = "–" if r["staleness_mean"] is None else f"{r['staleness_mean']:.1f} / {r['staleness_max']}"
        loss = f"{final_loss(row['eval']):.4f}" if row.get("eval") else "–"
        lines.append(
            f"| {ROWS[name].label} | {p['median_s']:.3f} | {p['p90_s']:.3f} | {p['max_s']:.3f} | "
            f"{p['after_sync_mean_s']:.3f} | {p['other_mean_s']:.3f} | {sending} | {stale} | "
            f"{r['bytes_per_token']['anchor']:,.0f} | {loss} |"
        )
    (out / "anchor_pacing.md").write_text("\n".join(lines) + "\n")


def committed_links() -> dict:
    """The shaped links of the committed WAN run (``results/wan.json``'s regime)."""
    regime = json.loads((RESULTS / "wan.json").read_text())["regime"]
    return {"rate_mbit": regime["rate_mbit"], "delay_ms": regime["delay_ms"], "source": "results/wan.json's regime"}


def _links(args) -> dict:
    if args.rate_mbit is not None:
        return {"rate_mbit": args.rate_mbit, "delay_ms": args.delay_ms or 0.0, "source": "given"}
    return committed_links()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.anchor_pacing")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders and token data (shared)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--eval-items", type=int, default=Shape().n_eval)
    parser.add_argument("--rate-mbit", type=float, default=None, help="link rate (default: results/wan.json's)")
    parser.add_argument("--delay-ms", type=float, default=None, help="one-way delay (with --rate-mbit)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    netns.require_root()
    work, out = Path(args.work), Path(args.out)
    links = _links(args)
    data_path, data = load_data(work)
    report = {
        "steps": args.steps,
        "links": links,
        "machine": cpu_machine(),
        "rows": {},
    }
    started = time.perf_counter()
    shaped = {"rate_mbit": links["rate_mbit"], "delay_ms": links["delay_ms"]}
    netns.up(8, shaped["rate_mbit"], shaped["delay_ms"])
    try:
        for name in PACING_ROWS:
            result = _run("pacing", name, work, data_path, args.steps, args.steps, shaped)
            if "error" in result:
                raise RuntimeError(f"{name}: {result['error']}")
            ev = evaluate(str(work / "pacing" / name), data, args.eval_items)
            slim = {k: v for k, v in result.items() if k not in ("losses", "kernel_per_process")}
            report["rows"][name] = {"run": slim, "profile": step_profile(work / "pacing" / name, name), "eval": ev}
            report["seconds"] = time.perf_counter() - started
            out.mkdir(parents=True, exist_ok=True)
            (out / "anchor_pacing.json").write_text(json.dumps(report, indent=1))
            write_report(report, out)
            median = report["rows"][name]["profile"]["median_s"]
            print(f"[anchor_pacing] {name}: median step {median:.3f} s", flush=True)
    finally:
        netns.down()


if __name__ == "__main__":
    main()
