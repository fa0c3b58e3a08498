"""The mesh guide's command (docs/guides/mesh.md), three ways, side by side: bytes per token by circuit, measured on the
wire next to the analytic ledger, DP bytes per sync with and without PowerSGD, anchor staleness.

    python -m benchmarks.mesh.run            # ~7 min on 2 CPU cores; writes benchmarks/mesh/results/

Rows (all `meshtune launch --mesh 3x2 --cpu -- recipes/sft.py`, SmolLM2-135M-Instruct, GSM8K,
embeddings frozen, 8 steps of 2 × 64 tokens per fast replica, DiLoCo every 4 steps):
  m95_ap            p = 0.95, anchor replica, PowerSGD rank 4 (2 fast replicas + anchor)
  m95_ap_dense_dp   the same without PowerSGD
  dense             p = 0, no anchor, no PowerSGD (3 fast replicas)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time

from hf_meshtune.runtime.results import wire_bytes_per_token

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "benchmarks", "mesh", "results")
COMMON = [
    "--num_stages",
    "2",
    "--max_steps",
    "8",
    "--max_length",
    "64",
    "--per_device_train_batch_size",
    "1",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "5e-5",
    "--eval_items",
    "4",
    "--logging_steps",
    "1",
    "--freeze_embeddings",
    "--dp_sync_every",
    "4",
    "--anchor_every",
    "2",
    "--report_to",
    "none",
]
ROWS = {  # the m95 rows name the paper's preset: the library's default became the quality preset
    "m95_ap": ["--preset", "paper"],
    "m95_ap_dense_dp": ["--preset", "paper", "--dp_powersgd_rank", "0"],
    "dense": ["--mask_ratio", "0", "--anchor", "false", "--optim", "adamw_torch", "--dp_powersgd_rank", "0"],
}


def run_row(name: str, extra: list[str], workdir: str) -> dict:
    out = os.path.join(workdir, name)
    command = [
        os.path.join(os.path.dirname(sys.executable), "meshtune"),
        "launch",
        "--mesh",
        "3x2",
        "--cpu",
        "--",
        "recipes/sft.py",
        "--output_dir",
        out,
        *COMMON,
        *extra,
    ]
    start = time.perf_counter()
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env={**os.environ, "RUST_LOG": "warn"})
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    with open(os.path.join(out, "mesh_summary.json")) as handle:
        summary = json.load(handle)
    eval_loss = [line for line in proc.stdout.splitlines() if "eval_loss" in line]
    summary["eval_loss"] = float(eval_loss[-1].split("=")[-1]) if eval_loss else None
    summary["wall_seconds"] = wall
    summary["command"] = "meshtune launch --mesh 3x2 --cpu -- recipes/sft.py --output_dir OUT " + " ".join(
        COMMON + extra
    )
    return summary


def table(results: dict[str, dict]) -> str:
    lines = ["| row | circuit | on the wire B/token | analytic B/token |", "|---|---|---:|---:|"]
    for name, s in results.items():
        wire = wire_bytes_per_token(s)  # measured sends + booked all-reduces
        for circuit in ("pp_fwd", "pp_bwd", "dp", "anchor", "total"):
            analytic = s["analytic_bytes_per_token"][circuit]
            lines.append(f"| {name} | {circuit} | {wire[circuit]:,.1f} | {analytic:,.1f} |")
    lines += [
        "",
        "| row | DP bytes per sync per rank | syncs per rank | anchor rounds | staleness mean / max | step s | "
        "eval loss |",
        "|---|---:|---:|---:|---|---:|---:|",
    ]
    for name, s in results.items():
        stale = (
            "–"
            if s["anchor_staleness_mean"] is None
            else f"{s['anchor_staleness_mean']:.2f} / {s['anchor_staleness_max']}"
        )
        lines.append(
            f"| {name} | {s['dp_bytes_per_sync_per_rank']:,.0f} | {s['dp_syncs_per_rank']:.0f} | "
            f"{s['anchor_rounds']} | {stale} | {s['step_seconds_mean']:.1f} | {s['eval_loss']:.4f} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    os.makedirs(OUT, exist_ok=True)
    with tempfile.TemporaryDirectory() as workdir:
        results = {name: run_row(name, extra, workdir) for name, extra in ROWS.items()}
    with open(os.path.join(OUT, "mesh_3x2.json"), "w") as handle:
        json.dump(results, handle, indent=2)
    with open(os.path.join(OUT, "mesh_3x2.md"), "w") as handle:
        handle.write(table(results))
    print(table(results))


if __name__ == "__main__":
    main()
