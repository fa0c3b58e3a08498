"""Where the default row's step goes on shaped links, and what more microbatches and overlapped DP syncs change.

    sudo .venv/bin/python -m benchmarks.wan.throughput   # ≈ 24 min on 2 idle cores; results/throughput.{json,md}

The WAN benchmark's default row is compute-bound by its bytes (the ideal its bytes allow is its compute-bound
speed), yet on the shaped links it runs at well under it (``wan.md``'s share of ideal). Two costs that the
bytes-only ideal does not see:

- **The pipeline's crossings.** Stage 1 cannot start before the first microbatch's activations have crossed
  the link, stage 0 cannot finish before the last microbatch's gradients have; with 2 microbatches one crossing
  (118 kB: 0.23 s at 4.14 Mbit/s) is longer than a microbatch's compute, so the links set the step. More,
  smaller microbatches put less of a crossing on that path, at the price of smaller matrix products.
- **The DiLoCo sync's step.** A fragment sync's all-reduces run over the shaped links inside one step; with
  ``dp_sync_delay`` = τ the averaged update lands τ inner steps later and its all-reduces overlap them (the
  PowerSGD P round the first steps, Q's the rest, split by their bytes: ``dp.diloco.p_round_steps``). torchft
  drops the τ overlapped inner steps of the fragment (it restarts from the new θ_global);
  ``dp_keep_overlapped`` keeps them on top of it. The sync's
  all-reduces go in buckets (``dp.diloco.fragment.BUCKET_BYTES``); one variant sends one per tensor, as before them.
- **The link's queue.** On a FIFO link an overlapped sync's megabytes queue in front of the pipeline's
  crossings. With ``dp_low_priority`` each process binds its sync to its node's second address
  (``MESHTUNE_DP_HOST``), whose packets the links send only while no other packet waits (``netns._shape``).

Each variant (``rows.THROUGHPUT_ROWS`` and the default row) fine-tunes for ``--steps`` steps on compute-bound links
(10 Gbit/s, no delay), which gives its quality (held-out loss at the end, exact match) and its compute-bound
tokens/s, then runs a timing window on the shaped links of the committed WAN run (``results/wan.json``'s
regime). Tokens/s as ``run.read_run`` takes them (the median over fragment periods after a warm-up); per step
position within a fragment period, the mesh's mean step time on the shaped links (the sync's step is the last).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .anchor_pacing import committed_links
from .rows import ROWS, THROUGHPUT_ROWS, Shape
from .run import COMPUTE_LINKS, RESULTS, TIMING_STEPS, _run, cpu_machine, evaluate, final_loss, generated_by, load_data

VARIANTS = ["default", *THROUGHPUT_ROWS]


def by_position(out: Path, row: str, warm: int) -> list[float]:
    """The mesh's mean step time (slowest fast rank per step) at each position of a fragment period, after
    ``warm`` steps; position p holds fast steps k·period + p + 1 (the last one syncs a fragment)."""
    shape = Shape()
    ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ROWS[row].replicas * shape.stages)]
    fast = [r for r in ranks if r["role"] == "fast"]
    steps = min(r["steps"] for r in fast)
    per_step = [max(r["step_seconds"][i] for r in fast) for i in range(steps)]
    period = shape.sync_every // shape.fragments
    return [statistics.fmean(s for i, s in enumerate(per_step) if i >= warm and i % period == p) for p in range(period)]


def write_report(report: dict, out: Path) -> None:
    links, dp = report["links"], report["dp"]
    lines = [
        "# The default row's step on shaped links: more microbatches, overlapped DP syncs",
        "",
        generated_by("throughput", report) + f", {report.get('seconds', 0) / 60:.0f} min. "
        f"Shaped links: {links['rate_mbit']:.3f} Mbit/s, one-way delay {links['delay_ms']:.2f} ms ({links['source']})"
        f"; compute-bound: 10 Gbit/s, no delay. The default row (outliers8+int8 boundaries, DiLoCo + rank-"
        f"{dp['rank']} PowerSGD in {dp['quantize'] + ' codes' if dp['quantize'] else 'float32'}, S = 20 in 2 "
        "fragments, 3 fast replicas × 2 stages, the pretrained tiny Llama on the arithmetic "
        f"task), 8 rows × 104 positions per replica step in every variant; quality from a {report['steps']}-step "
        f"compute-bound run, shaped tokens/s from a {report['window']}-step window. Share: shaped over compute-bound "
        "tokens/s (for these rows the ideal their bytes allow is their compute-bound speed).",
        "",
        "| variant | compute-bound tokens/s | shaped tokens/s | share of ideal | eval loss | exact match | shaped step "
        "by position in a fragment period (s; the last syncs) |",
        "|---|---:|---:|---:|---:|---:|---|",
    ]
    for name, row in report["rows"].items():
        c, s = row["compute"], row["shaped"]
        positions = ", ".join(f"{v:.2f}" for v in s["by_position"])
        lines.append(
            f"| {ROWS[name].label} | {c['tokens_per_s']:,.0f} | {s['tokens_per_s']:,.0f} | "
            f"{s['tokens_per_s'] / c['tokens_per_s']:.0%} | {final_loss(row['eval']):.4f} | "
            f"{row['eval']['exact_match']:.0%} | {positions} |"
        )
    (out / "throughput.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.throughput")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders and token data (shared)")
    parser.add_argument("--steps", type=int, default=80, help="steps of each compute-bound (quality) run")
    parser.add_argument("--window", type=int, default=TIMING_STEPS["default"], help="steps of each shaped window")
    parser.add_argument("--eval-items", type=int, default=Shape().n_eval)
    parser.add_argument("--only", default="", help=f"comma-separated variants of {VARIANTS} (default: all)")
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else VARIANTS
    unknown = sorted(set(names) - set(VARIANTS))
    if unknown:
        parser.error(f"--only {unknown}: name variants of {VARIANTS}")
    netns.require_root()
    work, out = Path(args.work), Path(args.out)
    links = committed_links()
    data_path, data = load_data(work)
    path = out / "throughput.json"
    report = json.loads(path.read_text()) if args.only and path.exists() else {}
    report |= {
        "steps": args.steps,
        "window": args.window,
        "links": links,
        "machine": cpu_machine(),
        "dp": {"rank": ROWS["default"].powersgd_rank, "quantize": ROWS["default"].dp_quantize},
    }
    report.setdefault("rows", {})
    started = time.perf_counter()
    shaped = {"rate_mbit": links["rate_mbit"], "delay_ms": links["delay_ms"]}
    keep = ("tokens_per_s", "step_seconds", "bytes_per_token", "warmup_steps")
    try:
        for name in names:
            netns.up(8, COMPUTE_LINKS["rate_mbit"], COMPUTE_LINKS["delay_ms"])
            compute = _run("throughput_compute", name, work, data_path, args.steps, args.steps, COMPUTE_LINKS)
            if "error" in compute:
                raise RuntimeError(f"{name}: {compute['error']}")
            ev = evaluate(str(work / "throughput_compute" / name), data, args.eval_items)
            netns.up(8, shaped["rate_mbit"], shaped["delay_ms"])
            window = _run("throughput_shaped", name, work, data_path, args.window, 0, shaped)
            if "error" in window:
                raise RuntimeError(f"{name}: {window['error']}")
            positions = by_position(work / "throughput_shaped" / name, name, window["warmup_steps"])
            report["rows"][name] = {
                "compute": {k: compute[k] for k in keep},
                "shaped": {k: window[k] for k in keep} | {"by_position": positions},
                "eval": ev,
            }
            report["seconds"] = report.get("seconds", 0) + time.perf_counter() - started
            started = time.perf_counter()
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
            write_report(report, out)
            share = window["tokens_per_s"] / compute["tokens_per_s"]
            print(
                f"[throughput] {name}: {share:.0%} of its compute-bound tokens/s, eval {final_loss(ev):.4f}", flush=True
            )
    finally:
        netns.down()


if __name__ == "__main__":
    main()
