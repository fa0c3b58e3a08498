"""WAN benchmark: every row on the same mesh over emulated internet links, measured side by side.

    sudo .venv/bin/python -m benchmarks.wan.run            # ≈ 30 min on 2 cores; results/wan.{json,md} + plots
    sudo .venv/bin/python -m benchmarks.wan.run --report   # tables and plots again from results/wan.json

Phases (each row runs as 6 or 8 real processes, one network namespace per node, see ``netns.py``):

1. **Compute-bound runs** (links at 10 Gbit/s, no delay): the synchronous rows (Dense, +DP, M95 and
   the peers) train ``--steps`` steps. Their loss per step does not depend on link timing (every sync
   is a blocking collective), so these runs give their quality curves, and Dense's run gives the
   compute-bound step time τ and the bytes Dense puts on its busiest link per step.
2. **Regime.** On the paper's mesh Dense runs 44.5× slower than the link-free M95 (1.1k vs 48.9k
   tokens/s at 200 Mbit/s): its links take 44.5 times its compute. These CPUs compute thousands of
   times slower than the paper's GPUs, so at 200 Mbit/s every row would be compute-bound. The link
   rate is scaled so that Dense's busiest link again needs 44.5 τ per step:
   R = Dense bytes per step on its busiest link / (44.5 τ); scale = R / 200 Mbit/s. Latency is scaled
   with time: one-way D = 20 ms × τ / τ_paper, τ_paper = 65,536 tokens / 48.9k tokens/s.
3. **Shaped runs** (rate R, delay D): the +AP rows train ``--steps`` steps there (the anchor is
   asynchronous, so its staleness, and hence their quality, depends on the links); the synchronous
   rows run a short timing window.
4. **Unscaled run:** Dense and M95+AP at the paper's 200 Mbit/s (and 20 ms) on these CPUs.

Afterwards the dense model of fast replica 0 is evaluated (held-out loss) at every saved step.
Figures per row: steady-state tokens/s (median over windows after warm-up), bytes per fast token per
circuit from the Wire (and the kernel's interface counters), speedup over Dense, and time-to-quality
= (steps to reach Dense's final eval loss) × steady-state step time.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time
from pathlib import Path

import torch

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .mesh import run_row
from .rows import ROWS, Shape, build_model, prepare_data

RESULTS = Path(__file__).resolve().parent / "results"
PAPER = {
    "rate_mbit": 200.0,
    "dense_over_compute": 48.9 / 1.1,
    "tokens_per_step": 32 * 2048,
    "m95_tokens_s": 48_900.0,
    "delay_ms": 20.0,
    "tokens_s": {"dense": 1_100, "dp": 3_600, "m95": 48_900, "m90_ap": 27_800, "m95_ap": 46_500},
    "bytes_per_token": {"dense": 22_900, "dp": 6_900, "m95": 370, "m90_ap": 790, "m95_ap": 446},
}
SYNC_ROWS = ["dense", "dp", "m95", "torchft_diloco", "powersgd_hook"]
ANCHOR_ROWS = ["m95_ap", "m90_ap"]
TIMING_STEPS = {"dense": 8, "dp": 45, "m95": 45, "torchft_diloco": 45, "powersgd_hook": 25}
UNSCALED_ROWS = ["dense", "m95_ap"]


# ---------------------------------------------------------------------------------------------------
# Reading one run
# ---------------------------------------------------------------------------------------------------
def read_run(out: str, row_name: str) -> dict:
    """Aggregate one run's rank records: tokens/s, bytes per fast token per circuit, staleness."""
    row, shape = ROWS[row_name], Shape()
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(row.replicas * shape.stages)]
    fast = [r for r in ranks if r["role"] == "fast"]
    steps = min(r["steps"] for r in fast)
    tokens_per_step = len({r["replica"] for r in fast}) * shape.tokens_per_replica_step
    fast_tokens = tokens_per_step * steps
    # measured sends + booked all-reduces (2(n-1)/n × the tensor bytes), checked against the kernel's counter below
    circuits = {
        c: sum(r["wire"]["sent"][c] + r["wire"]["booked"][c] for r in ranks) / fast_tokens
        for c in ("pp_fwd", "pp_bwd", "dp", "anchor")
    }
    circuits["total"] = sum(circuits.values())
    kernel = sum(r["tx_bytes"] for r in ranks) / fast_tokens
    # the mesh's time per step: the slowest fast rank's (they move in lockstep through the pipeline)
    per_step = [max(r["step_seconds"][i] for r in fast) for i in range(steps)]
    warm = max(3, steps // 10) if steps > 10 else 2
    if row.dp_mode == "powersgd_hook":
        warm = max(warm, 3)  # torch's hook all-reduces densely for its first start_powerSGD_iter steps
    window = shape.sync_every // shape.fragments if steps - warm >= 2 * (shape.sync_every // shape.fragments) else 1
    timed = per_step[warm:]
    windows = [sum(timed[i : i + window]) / window for i in range(0, len(timed) - window + 1, window)]
    step_s = statistics.median(windows)
    arrivals = [a for r in fast for a in r["arrivals"] if r["replica"] == 0 and r["stage"] == 0]
    staleness = [s - snap for s, snap in arrivals if snap > 0]
    busiest = max(r["tx_bytes"] for r in ranks) / steps
    return {
        "row": row_name,
        "label": row.label,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "step_seconds": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "window_steps": window,
        "warmup_steps": warm,
        "bytes_per_token": circuits,
        "kernel_bytes_per_token": kernel,
        "busiest_link_bytes_per_step": busiest,
        "anchor_deliveries": len(staleness),
        "staleness_mean": statistics.fmean(staleness) if staleness else None,
        "staleness_max": max(staleness) if staleness else None,
        "losses": [statistics.fmean(r["losses"][i] for r in fast if r["losses"]) for i in range(steps)],
    }


@torch.no_grad()
def evaluate(out: str, data: dict) -> dict[int, float]:
    """Held-out loss of the dense model (fast replica 0's parameters) at every saved step, and step 0."""
    shape = Shape()
    model = build_model(shape, data["vocab_size"])
    model.load_state_dict(data["init"])
    model.eval()
    blocks = data["eval"]

    def loss() -> float:
        return statistics.fmean(
            model(input_ids=blocks[i : i + 16], labels=blocks[i : i + 16]).loss.item()
            for i in range(0, len(blocks), 16)
        )

    curve = {0: loss()}
    params = os.path.join(out, "params")
    steps = sorted({int(name[4:9]) for name in os.listdir(params)}) if os.path.isdir(params) else []
    for step in steps:
        state = {}
        for stage in range(shape.stages):
            state.update(torch.load(os.path.join(params, f"step{step:05d}_stage{stage}.pt")))
        missing = set(model.state_dict()) - set(state)
        if missing - {"model.rotary_emb.inv_freq"}:
            raise RuntimeError(f"{out}: step {step} lacks {sorted(missing)[:3]}")
        model.load_state_dict(state, strict=False)
        curve[step] = loss()
    return curve


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def _run(name: str, row: str, work: Path, data_path: str, steps: int, save_every: int) -> dict:
    out = str(work / name / row)
    print(f"[wan] {name}: {row} for {steps} steps", flush=True)
    wall = run_row(row, out, data_path, steps, save_every=save_every)
    result = read_run(out, row) | {"wall_seconds": wall}
    print(
        f"[wan]   {result['tokens_per_s']:.0f} tokens/s, {result['bytes_per_token']['total']:.0f} B/token, "
        f"{wall:.0f} s",
        flush=True,
    )
    return result


def run(work: Path, steps: int, save_every: int) -> dict:
    netns.require_root()
    shape = Shape()
    work.mkdir(parents=True, exist_ok=True)
    data_path = str(work / "data.pt")
    data = prepare_data(shape, data_path)
    nodes = 8
    report: dict = {
        "shape": shape.__dict__,
        "steps": steps,
        "paper": PAPER,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "phases": {},
    }
    started = time.perf_counter()

    netns.up(nodes, 10_000.0, 0.0)
    compute = {row: _run("compute", row, work, data_path, steps, save_every) for row in SYNC_ROWS}
    compute |= {row: _run("compute", row, work, data_path, TIMING_STEPS["m95"], 0) for row in ANCHOR_ROWS}
    dense = compute["dense"]
    tau = dense["step_seconds"]
    rate_bytes = dense["busiest_link_bytes_per_step"] / (PAPER["dense_over_compute"] * tau)
    rate_mbit = rate_bytes * 8 / 1e6
    tau_paper = PAPER["tokens_per_step"] / PAPER["m95_tokens_s"]
    delay_ms = PAPER["delay_ms"] * tau / tau_paper
    report["regime"] = {
        "tau_s": tau,
        "dense_busiest_link_bytes_per_step": dense["busiest_link_bytes_per_step"],
        "rate_mbit": rate_mbit,
        "scale": rate_mbit / PAPER["rate_mbit"],
        "delay_ms": delay_ms,
        "tau_paper_s": tau_paper,
        "time_scale": tau / tau_paper,
    }
    print(
        f"[wan] regime: τ = {tau:.3f} s, R = {rate_mbit:.3f} Mbit/s (scale {rate_mbit / 200:.2e}), "
        f"D = {delay_ms:.2f} ms",
        flush=True,
    )

    netns.up(nodes, rate_mbit, delay_ms)
    shaped = {row: _run("shaped", row, work, data_path, steps, save_every) for row in ANCHOR_ROWS}
    shaped |= {row: _run("shaped", row, work, data_path, TIMING_STEPS[row], 0) for row in SYNC_ROWS}

    netns.up(nodes, PAPER["rate_mbit"], PAPER["delay_ms"])
    unscaled = {row: _run("unscaled", row, work, data_path, TIMING_STEPS.get(row, 45), 0) for row in UNSCALED_ROWS}
    netns.down()

    curves = {row: evaluate(str(work / "compute" / row), data) for row in SYNC_ROWS}
    curves |= {row: evaluate(str(work / "shaped" / row), data) for row in ANCHOR_ROWS}
    report["phases"] = {"compute": compute, "shaped": shaped, "unscaled": unscaled}
    report["eval_loss"] = {row: {str(k): v for k, v in curve.items()} for row, curve in curves.items()}
    report["seconds"] = time.perf_counter() - started
    return report


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------
def summarize(report: dict) -> dict:
    """Per row: tokens/s, speedup, ideal speedup from bytes, time-to-quality, next to the paper."""
    shaped, compute = report["phases"]["shaped"], report["phases"]["compute"]
    curves = {row: {int(k): v for k, v in c.items()} for row, c in report["eval_loss"].items()}
    target = curves["dense"][max(curves["dense"])]
    dense = shaped["dense"]
    rows = {}
    for name in [n for n in ROWS if n in shaped]:  # the paper's order, then the peers
        run_ = shaped[name]
        curve = curves[name]
        reached = [s for s in sorted(curve) if curve[s] <= target]
        steps_to = reached[0] if reached else None
        # bytes per token do not depend on timing: take them from the row's long run (its quality run),
        # where one-off costs (the PowerSGD hook's dense warm-up steps) are amortised as in training
        long_run = shaped[name] if name in ANCHOR_ROWS else compute[name]
        long_bytes = long_run["bytes_per_token"]
        dense_bytes = compute["dense"]["bytes_per_token"]
        byte_ratio = dense_bytes["total"] / long_bytes["total"]
        # the anchor's traffic is asynchronous and leaves from the anchor's own nodes: what a fast step
        # waits for is PP + DP, and no row can beat its own compute-bound throughput on these cores
        blocking = sum(long_bytes[c] for c in ("pp_fwd", "pp_bwd", "dp"))
        blocking_ratio = sum(dense_bytes[c] for c in ("pp_fwd", "pp_bwd", "dp")) / blocking
        compute_cap = compute[name]["tokens_per_s"] / dense["tokens_per_s"]
        ideal = min(blocking_ratio, compute_cap)
        speedup = run_["tokens_per_s"] / dense["tokens_per_s"]
        rows[name] = {
            "label": run_["label"],
            "tokens_per_s": run_["tokens_per_s"],
            "speedup": speedup,
            "byte_ratio_all_circuits": byte_ratio,
            "byte_ratio_blocking": blocking_ratio,
            "compute_bound_speedup": compute_cap,
            "ideal_speedup": ideal,
            "share_of_ideal": speedup / ideal,
            "compute_bound_tokens_per_s": compute[name]["tokens_per_s"],
            "bytes_per_token": long_bytes,
            "kernel_bytes_per_token": long_run["kernel_bytes_per_token"],
            "final_eval_loss": curve[max(curve)],
            "steps_to_dense_quality": steps_to,
            "time_to_quality_s": steps_to * run_["step_seconds"] if steps_to else None,
            "staleness_mean": run_.get("staleness_mean"),
            "staleness_max": run_.get("staleness_max"),
            "paper_tokens_per_s": PAPER["tokens_s"].get(name),
            "paper_bytes_per_token": PAPER["bytes_per_token"].get(name),
        }
    dense_ttq = rows["dense"]["time_to_quality_s"]
    dense_curve = sorted(curves["dense"].items())
    for name, r in rows.items():
        r["time_to_quality_gain"] = dense_ttq / r["time_to_quality_s"] if r["time_to_quality_s"] else None
        # the other way round, at the row's own quality L = its final loss + 0.01: how long Dense needs
        # to reach L (linear between its saved steps) against how long this row needs (first saved step)
        level, curve = r["final_eval_loss"] + 0.01, sorted(curves[name].items())
        own_steps = next(s for s, v in curve if v <= level)
        dense_steps = _steps_to(dense_curve, level)
        r["own_steps_to_its_final_loss"] = own_steps
        r["dense_steps_to_this_final_loss"] = dense_steps
        r["equal_quality_speedup"] = (
            (dense_steps * shaped["dense"]["step_seconds"] / (own_steps * shaped[name]["step_seconds"]))
            if dense_steps and own_steps
            else None
        )
    return {"target_eval_loss": target, "rows": rows}


def _steps_to(curve: list[tuple[int, float]], loss: float) -> float | None:
    """First (fractional) step where a loss curve given at saved steps falls to ``loss`` (linear in between)."""
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v1 <= loss:
            return s1 if v0 == v1 else s0 + (s1 - s0) * (v0 - loss) / (v0 - v1)
    return None


def _fmt(value, spec: str = ",.0f", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def write_report(report: dict, out: Path) -> None:
    summary = summarize(report)
    report["summary"] = summary
    out.mkdir(parents=True, exist_ok=True)
    (out / "wan.json").write_text(json.dumps(report, indent=1))
    reg = report["regime"]
    lines = [
        "# WAN benchmark: measured on emulated links",
        "",
        f"Command: `sudo .venv/bin/python -m benchmarks.wan.run` ({report['seconds'] / 60:.0f} min on "
        f"{report['machine']['cpus']} cores, torch {report['machine']['torch']}, {report['machine']['date']}).",
        "",
        f"Mesh: 3 fast replicas × 2 stages (+1 anchor replica for +AP rows), one network namespace per process; "
        f"tiny Llama (H={report['shape']['hidden']}, {report['shape']['layers']} layers) trained from scratch on "
        f"GSM8K text, {Shape().tokens_per_replica_step} tokens per replica step, {report['steps']} steps.",
        "",
        f"**Regime:** Dense's compute-bound step τ = {reg['tau_s']:.3f} s; its busiest link carries "
        f"{reg['dense_busiest_link_bytes_per_step'] / 1e6:.2f} MB per step. Link rate R = {reg['rate_mbit']:.3f} "
        f"Mbit/s (**scale {reg['scale']:.2e}** of the paper's 200 Mbit/s) so that Dense's link time is "
        f"{PAPER['dense_over_compute']:.1f} τ as on the paper's mesh; one-way delay {reg['delay_ms']:.2f} ms (20 ms × "
        f"τ/τ_paper, time scale {reg['time_scale']:.3f}).",
        "",
        f"Time-to-quality target: Dense's final held-out loss {summary['target_eval_loss']:.4f}. "
        "\"Speedup at this loss\": at the row's own quality L = its final loss + 0.01, Dense's time to reach L "
        "(linear between saved steps) over the row's (first saved step at or below L), both at shaped "
        "steady-state step times.",
        "",
        "Ideal speedup = min(byte ratio of the circuits a fast step waits for (PP + DP), the row's compute-bound "
        "throughput / Dense's shaped one); the byte ratio over all circuits (anchor included) is given too: the "
        "anchor's bytes are asynchronous and leave from the anchor's own nodes.",
        "",
        "| row | tokens/s | speedup vs Dense | ideal speedup | share of ideal | byte ratio (all circuits) | "
        "B/token total | pp_fwd | pp_bwd | dp | anchor | kernel B/token | final eval loss | steps to Dense's loss | "
        "time-to-quality (s) | TTQ gain | Dense steps to this loss + 0.01 | speedup at this loss | paper tokens/s | "
        "paper B/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"].values():
        b = r["bytes_per_token"]
        lines.append(
            f"| {r['label']} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f}× | {r['ideal_speedup']:.2f}× | "
            f"{r['share_of_ideal']:.0%} | {r['byte_ratio_all_circuits']:.2f}× | {b['total']:,.0f} | "
            f"{b['pp_fwd']:,.0f} | {b['pp_bwd']:,.0f} | {b['dp']:,.0f} | {b['anchor']:,.0f} | "
            f"{r['kernel_bytes_per_token']:,.0f} | {r['final_eval_loss']:.4f} | "
            f"{_fmt(r['steps_to_dense_quality'], 'd', 'not reached')} | {_fmt(r['time_to_quality_s'], ',.1f')} | "
            f"{_fmt(r['time_to_quality_gain'], '.2f')}{'×' if r['time_to_quality_gain'] else ''} | "
            f"{_fmt(r['dense_steps_to_this_final_loss'], '.1f')} | "
            f"{_fmt(r['equal_quality_speedup'], '.2f')}{'×' if r['equal_quality_speedup'] else ''} | "
            f"{_fmt(r['paper_tokens_per_s'])} | {_fmt(r['paper_bytes_per_token'])} |"
        )
    lines += [
        "",
        "Compute-bound (10 Gbit/s links) and unscaled (200 Mbit/s, 20 ms) runs:",
        "",
        "| phase | row | tokens/s | step s | B/token |",
        "|---|---|---:|---:|---:|",
    ]
    for phase in ("compute", "unscaled"):
        for name, r in report["phases"][phase].items():
            lines.append(
                f"| {phase} | {r['label']} | {r['tokens_per_s']:,.0f} | {r['step_seconds']:.3f} | "
                f"{r['bytes_per_token']['total']:,.0f} |"
            )
    lines += [
        "",
        "Anchor staleness on the shaped links (fast steps between snapshot and use): "
        + ", ".join(
            f"{report['phases']['shaped'][n]['label']} mean "
            f"{_fmt(report['phases']['shaped'][n]['staleness_mean'], '.1f')} / max "
            f"{_fmt(report['phases']['shaped'][n]['staleness_max'], 'd')} over "
            f"{report['phases']['shaped'][n]['anchor_deliveries']} deliveries"
            for n in ANCHOR_ROWS
        )
        + ".",
        "",
    ]
    (out / "wan.md").write_text("\n".join(lines) + "\n")
    _plots(report, summary, out)


def _plots(report: dict, summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    names = list(rows)
    labels = [rows[n]["label"] for n in names]
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    axes[0].bar(labels, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("steady-state tokens/s (shaped links)")
    for i, n in enumerate(names):
        axes[0].annotate(f"{rows[n]['speedup']:.1f}×", (i, rows[n]["tokens_per_s"]), ha="center", va="bottom")
    bottom = [0.0] * len(names)
    for circuit, color in (
        ("pp_fwd", "tab:orange"),
        ("pp_bwd", "tab:red"),
        ("dp", "tab:green"),
        ("anchor", "tab:purple"),
    ):
        values = [rows[n]["bytes_per_token"][circuit] for n in names]
        axes[1].bar(labels, values, bottom=bottom, label=circuit, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].set_yscale("log")
    axes[1].set_ylim(bottom=1)
    axes[1].set_ylabel("bytes per fast token on the wire (Wire: sends + booked all-reduces)")
    axes[1].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=30)
    fig.tight_layout()
    fig.savefig(out / "wan_throughput_bytes.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(7.5, 4.5))
    shaped = report["phases"]["shaped"]
    for n in names:
        curve = sorted((int(k), v) for k, v in report["eval_loss"][n].items())
        ax.plot(
            [max(s, 0.5) * shaped[n]["step_seconds"] for s, _ in curve],
            [v for _, v in curve],
            marker=".",
            label=rows[n]["label"],
        )
    ax.axhline(summary["target_eval_loss"], color="gray", ls="--", lw=0.8, label="Dense final")
    ax.set_xscale("log")
    ax.set_xlabel("simulated wall-clock on the shaped links (s) = step × steady-state step time")
    ax.set_ylabel("held-out loss (dense model)")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "wan_time_to_quality.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.run")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders, token data, saved parameters")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--save-every", type=int, default=20)
    parser.add_argument("--out", default=str(RESULTS))
    parser.add_argument("--report", action="store_true", help="only rebuild the tables and plots from OUT/wan.json")
    parser.add_argument("--smoke", action="store_true", help="a few steps per run (checks the pipeline, not a result)")
    args = parser.parse_args()
    if args.smoke:
        args.steps, args.save_every = 20, 10
        TIMING_STEPS.update(dict.fromkeys(TIMING_STEPS, 6))
    out = Path(args.out)
    if args.report:
        report = json.loads((out / "wan.json").read_text())
    else:
        try:
            report = run(Path(args.work), args.steps, args.save_every)
        finally:
            if os.geteuid() == 0:
                netns.down()
    write_report(report, out)
    print((out / "wan.md").read_text())


if __name__ == "__main__":
    main()
