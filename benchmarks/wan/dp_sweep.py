"""Which DP sync keeps the fine-tune's quality, and at what bytes: the WAN benchmark's default row with its DP
setting changed, side by side with Dense.

    sudo .venv/bin/python -m benchmarks.wan.dp_sweep      # ≈ 55 min on 2 idle CPU cores; results/dp_sweep.{json,md}

Every variant (``rows.DP_SWEEP``) is the default row (outliers8+int8 boundaries, no anchor, 3 fast replicas ×
2 stages) fine-tuning the pretrained tiny Llama on the arithmetic task for ``--steps`` steps, on compute-bound
links (10 Gbit/s, no delay: quality does not depend on the link for these synchronous rows), with one DP
setting changed: the PowerSGD rank r of the pseudo-gradients (none: uncompressed), float32 or int8 codes
(``dp_quantize``), the sync period S, and the outer step (DiLoCo's Nesterov SGD, η = 0.7, μ = 0.9, parameter
averaging, η = 1, μ = 0, or η = 1.5, μ = 0, past the average), and the inner AdamW's peak lr: the
quality benchmark's 0.0005 and 0.001–0.004, with the outer steps compared again at the best lr. Dense (a
gradient all-reduce every step, at each lr) is the reference. Held-out loss along the run and exact match at the end
(``run.evaluate``); DP bytes per fast token from the Wire (booked all-reduces). Runs are cached in the WAN
benchmark's work folder (``run._run``) and ``dp_sweep.json`` is written after every variant.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .rows import DP_SWEEP, ROWS, Shape
from .run import COMPUTE_LINKS, RESULTS, _run, cpu_machine, evaluate, final_loss, generated_by, load_data


def _line(name: str, result: dict, ev: dict, dense_final: float | None) -> str:
    final = final_loss(ev)
    gap = "" if dense_final is None or name.startswith("dense") else f"{(final - dense_final) / dense_final:+.1%}"
    b = result["bytes_per_token"]
    return (
        f"| {ROWS[name].label} | {final:.4f} | {gap} | {ev['exact_match']:.0%} | {b['dp']:,.1f} | {b['total']:,.0f} |"
    )


def _ordered(rows: dict) -> dict:
    """``rows`` in the sweep's order (Dense, then DP_SWEEP's), whichever run first."""
    return {n: rows[n] for n in ["dense", *DP_SWEEP] if n in rows}


def write_report(report: dict, out: Path) -> None:
    # each row against Dense at its own lr
    dense = {
        row["row"].get("lr"): final_loss(row["eval"]) for n, row in report["rows"].items() if n.startswith("dense")
    }
    lines = [
        "# DP sync on the fine-tune: quality against bytes",
        "",
        generated_by("dp_sweep", report) + f": {len(report['rows'])} training runs of "
        f"{sum(r['run']['wall_seconds'] for r in report['rows'].values()):,.0f} s in all (a rerun keeps the finished "
        "ones), plus their evaluation. The WAN benchmark's default row "
        f"(outliers8+int8 boundaries, 3 fast replicas × 2 stages, the pretrained tiny Llama on the arithmetic task, "
        f"{report['steps']} steps, compute-bound links) with its DP setting changed; Dense all-reduces the "
        "gradients every step. DiLoCo syncs in 2 fragments (one every S/2 steps); Nesterov: outer η = 0.7, "
        f"μ = 0.9 (MeshConfig's); averaging: η = 1, μ = 0. Every row's inner AdamW peaks at lr {Shape().lr:g} "
        "(the quality benchmark's) unless it names another; vs Dense: against Dense at the same lr. The "
        "pseudo-gradients travel in float32, or as int8 codes "
        "where the row says int8 (`dp_quantize`: every all-reduce, PowerSGD's factors included, a float32 scale "
        "per 256 values); the library's default is rank 128 in int8. Eval loss: held-out answer tokens at the last "
        "step; "
        f"exact match on {report['eval_items']} eval items. DP B/token: the all-reduces' ring traffic, booked by "
        "the Wire from the tensor sizes, per fast token, all processes together.",
        "",
        "| DP | eval loss | vs Dense | exact match | DP B/token | total B/token |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in report["rows"].items():
        lines.append(_line(name, row["run"], row["eval"], dense.get(row["row"].get("lr"))))
    lines += ["", "Eval loss along the run (steps 0, 10, …):", ""]
    for name, row in report["rows"].items():
        curve = ", ".join(f"{v:.3f}" for _, v in sorted((int(k), v) for k, v in row["eval"]["eval_loss"].items()))
        lines.append(f"- {ROWS[name].label}: {curve}")
    (out / "dp_sweep.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.dp_sweep")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders and token data (shared)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-items", type=int, default=Shape().n_eval)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--only", default="", help="comma-separated variants (default: dense and all of DP_SWEEP)")
    args = parser.parse_args(argv)
    names = args.only.split(",") if args.only else ["dense", *DP_SWEEP]
    unknown = sorted(set(names) - {"dense", *DP_SWEEP})
    if unknown:
        parser.error(f"--only {unknown}: name variants of {['dense', *DP_SWEEP]}")
    netns.require_root()
    work, out = Path(args.work), Path(args.out)
    data_path, data = load_data(work)
    path = out / "dp_sweep.json"
    # --only adds to (or replaces rows of) the committed report
    kept = json.loads(path.read_text())["rows"] if args.only and path.exists() else {}
    report = {
        "steps": args.steps,
        "eval_items": args.eval_items,
        "machine": cpu_machine(),
        "rows": _ordered(kept),
    }
    started = time.perf_counter()
    netns.up(8, COMPUTE_LINKS["rate_mbit"], COMPUTE_LINKS["delay_ms"])
    try:
        for name in names:
            result = _run("compute", name, work, data_path, args.steps, args.save_every, COMPUTE_LINKS)
            if "error" in result:
                raise RuntimeError(f"{name}: {result['error']}")
            ev = evaluate(str(work / "compute" / name), data, args.eval_items)
            slim = {k: v for k, v in result.items() if k not in ("losses", "kernel_per_process")}
            report["rows"][name] = {"row": dataclasses.asdict(ROWS[name]), "run": slim, "eval": ev}
            report["rows"] = _ordered(report["rows"])
            report["seconds"] = time.perf_counter() - started
            out.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
            write_report(report, out)
            print(f"[dp_sweep] {name}: eval loss {final_loss(ev):.4f}", flush=True)
    finally:
        netns.down()


if __name__ == "__main__":
    main()
