"""The fidelity governor on the distributed mesh, beside the fixed default, on the real model.

    python -m benchmarks.mesh.governed [ROW ...]  # ~3 × 12 min on 2 CPU cores; writes benchmarks/mesh/results/

Both rows: `meshtune launch --mesh 3x2 --cpu -- recipes/sft.py`, SmolLM2-135M-Instruct, GSM8K, embeddings
frozen, 2 fast replicas + the anchor replica (asynchronous, a round every 4 steps), DiLoCo every 4 steps,
the same data, steps and seed; they differ only in the boundary:
  default     boundary_codec = outliers8+int8 (the quality preset's codec), geometry refitted by the anchor
  governed    boundary_codec = governed (ladder outliers8+int3x8, outliers8+int4x8, outliers8+int8, target 0.96)
  governed_0.95  the same at fidelity_target 0.95 (the 2-stage split's boundary measures int4x8 near 0.96)
Per row: the boundary bytes per fast token on the wire (pp_fwd + pp_bwd, measured from the sent tensors,
calibration pass excluded), the dense eval loss after, the governor's switches and each round's fidelity,
the anchor's probe passes, and the mean fast step time.
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
STEPS = 40
COMMON = [
    "--num_stages",
    "2",
    "--max_steps",
    str(STEPS),
    "--max_length",
    "64",
    "--per_device_train_batch_size",
    "1",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "5e-5",
    "--eval_items",
    "16",
    "--logging_steps",
    "1",
    "--freeze_embeddings",
    "--dp_sync_every",
    "4",
    "--anchor",
    "true",
    "--anchor_every",
    "4",
    "--report_to",
    "none",
]
ROWS = {
    "default": ["--boundary_codec", "outliers8+int8"],
    "governed": ["--boundary_codec", "governed"],
    "governed_0.95": ["--boundary_codec", "governed", "--fidelity_target", "0.95"],
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
    with open(os.path.join(out, "trainer_state.json")) as handle:
        history = json.load(handle)["log_history"]
    eval_loss = [line for line in proc.stdout.splitlines() if "eval_loss" in line]
    wire = wire_bytes_per_token(summary)
    return {
        "command": "meshtune launch --mesh 3x2 --cpu -- recipes/sft.py --output_dir OUT " + " ".join(COMMON + extra),
        "eval_loss": float(eval_loss[-1].split("=")[-1]) if eval_loss else None,
        "boundary_bytes_per_token": wire["pp_fwd"] + wire["pp_bwd"],
        "anchor_bytes_per_token": wire["anchor"],
        "step_seconds_mean": summary["step_seconds_mean"],
        "wall_seconds": wall,
        "levels": [
            {k: v for k, v in line.items() if k.startswith("governor/b") and k.endswith("/level")}
            | {"step": line["step"]}
            for line in history
            if any(k.endswith("/level") for k in line)
        ],
        "fidelity": [
            {k: v for k, v in line.items() if k.startswith(("fidelity/", "governor/b")) and "/level" not in k}
            for line in history
            if "fidelity/step" in line
        ],
    }


def table(results: dict[str, dict]) -> str:
    base = results["default"]
    lines = [
        "| row | boundary B/token (fp32 wire, fwd + bwd) | fewer than the default | dense eval loss "
        "| gap to the default | anchor B/token | step s | probe passes |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r in results.items():
        passes = r["fidelity"][-1]["fidelity/probe_passes"] if r["fidelity"] else 0
        lines.append(
            f"| {name} | {r['boundary_bytes_per_token']:,.0f} | "
            f"{base['boundary_bytes_per_token'] / r['boundary_bytes_per_token']:.2f}× | {r['eval_loss']:.4f} | "
            f"{(r['eval_loss'] / base['eval_loss'] - 1) * 100:+.2f}% | {r['anchor_bytes_per_token']:,.0f} | "
            f"{r['step_seconds_mean']:.1f} | {passes:.0f} |"
        )
    for name, r in results.items():
        changes, previous = [], None
        for line in r["levels"]:  # the line of step s + 1 logs the level the forward of step s used
            level = int(line["governor/b0/level"])
            if level != previous:
                changes.append(f"{line['step'] - 1}: {level}")
                previous = level
        if changes:
            lines += [
                "",
                f"{name}: the boundary's level (0 = the cheapest) from the forward of step " + ", ".join(changes),
            ]
    return "\n".join(lines) + "\n"


def main(names: list[str]) -> None:
    """Every row, or only ``names`` (the others kept from the committed JSON)."""
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "governed_3x2.json")
    results: dict[str, dict] = {}
    if names:
        with open(path) as handle:
            results = json.load(handle)
    with tempfile.TemporaryDirectory() as workdir:
        for name, extra in ROWS.items():
            if names and name not in names:
                continue
            results[name] = run_row(name, extra, workdir)
            with open(path, "w") as handle:  # written as the rows come
                json.dump(results, handle, indent=2)
    with open(os.path.join(OUT, "governed_3x2.md"), "w") as handle:
        handle.write(table(results))
    print(table(results))


if __name__ == "__main__":
    main(sys.argv[1:])
