"""One prepared CUDA check of the training paths (≤ 5 min on one GPU): MeshTrainer and the launched mesh.

    python -m benchmarks.wan.gpu_mesh_check            # writes $OUT/gpu_mesh_check.json (or --out PATH)

Until a GPU was lent, every run of this library was on CPUs. Each section is written to the JSON as
soon as it finishes, records its error (traceback or the launch's log tail) instead of stopping the
others, and is skipped once ``--budget-s`` is spent:

1. ``single_<preset>``: single-process ``MeshTrainer`` (Y = 2 stages in one process, tiny Llama,
   12 steps) on the GPU and its CPU twin with the same seed, for the ``quality`` preset (the default)
   and the ``paper`` preset (masks + the anchor): the loss curves side by side and their largest
   relative gap (fp32 both; TF32 is off).
2. ``mesh_<XxY>``: ``tests/scripts/mesh_sft.py``, the user's script, under ``meshtune launch`` without
   ``--cpu`` on 1x2 with the default preset (the pipeline alone) and 3x2 with the paper preset (two
   DiLoCo replicas + the anchor). Every process sees
   the one GPU as ``cuda:0`` (``LOCAL_RANK=0``), as one process per internet host would.

Without a CUDA device it refuses (exit code 2) and names the rule, as ``gpu_check`` does.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from typing import Any

import torch

from benchmarks.wan.gpu_check import require_cuda
from benchmarks.wan.micro import machine_info

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
STEPS = 12
FLAGS = {
    "max_steps": STEPS,
    "per_device_train_batch_size": 2,
    "gradient_accumulation_steps": 2,
    "learning_rate": 3e-3,
    "logging_steps": 1,
    "save_strategy": "no",
    "seed": 0,
    "lr_scheduler_type": "constant",
}
MESH_FLAGS = ["--anchor_every", "2", "--dp_sync_every", "4", "--dp_fragments", "2", "--dp_powersgd_rank", "2"]
# every process takes cuda:0, as one process per host would; then the user's script runs unchanged
ONE_GPU_PER_HOST = os.path.join(ROOT, "benchmarks", "wan", "one_gpu_per_host.py")


def default_out() -> str:
    folder = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return os.path.join(folder, "gpu_mesh_check.json")


def _single_run(preset: str, use_cpu: bool, out_dir: str) -> dict[str, Any]:
    from hf_meshtune import MeshTrainer, MeshTrainingArguments
    from tests.tiny import pattern_dataset, tiny_llama

    args = MeshTrainingArguments(
        output_dir=out_dir, preset=preset, num_stages=2, use_cpu=use_cpu, report_to=[], disable_tqdm=True, **FLAGS
    )
    data = pattern_dataset(64, 16)
    trainer = MeshTrainer(model=tiny_llama(seed=0), args=args, train_dataset=data, eval_dataset=data.select(range(8)))
    start = time.perf_counter()
    trainer.train()
    wall = time.perf_counter() - start
    logs = trainer.state.log_history
    return {
        "device": str(next(trainer.model.parameters()).device),
        "losses": [h["loss"] for h in logs if "loss" in h],
        "eval_loss": trainer.evaluate()["eval_loss"],
        "train_wall_s": wall,
        "last_log": {k: v for k, v in logs[-2].items() if isinstance(v, (int, float))} if len(logs) > 1 else {},
    }


def single(preset: str, scratch: str) -> dict[str, Any]:
    """Section 1 for one preset: the GPU run and its CPU twin."""
    torch.backends.cuda.matmul.allow_tf32 = False
    gpu = _single_run(preset, False, os.path.join(scratch, f"{preset}_gpu"))
    cpu = _single_run(preset, True, os.path.join(scratch, f"{preset}_cpu"))
    gaps = [abs(g - c) / abs(c) for g, c in zip(gpu["losses"], cpu["losses"])]
    return {"gpu": gpu, "cpu": cpu, "max_rel_loss_gap": max(gaps) if gaps else None, "same_length": len(gaps) == STEPS}


def mesh(shape: str, preset: str, scratch: str, timeout_s: float) -> dict[str, Any]:
    """Section 2 for one mesh shape: the launched script on the GPU, its exit code and summary."""
    out_dir = os.path.join(scratch, f"mesh_{shape}")
    argv = [item for key, value in FLAGS.items() for item in (f"--{key}", str(value))]
    command = [
        sys.executable,
        "-m",
        "hf_meshtune.cli",
        "launch",
        "--mesh",
        shape,
        "--log-dir",
        os.path.join(out_dir, "logs"),
        "--",
        ONE_GPU_PER_HOST,
        os.path.join(ROOT, "tests", "scripts", "mesh_sft.py"),
        "--output_dir",
        out_dir,
        "--preset",
        preset,
        "--report_to",
        "none",
        *argv,
        *MESH_FLAGS,
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]), "RUST_LOG": "warn"}
    start = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
        rc, stdout, stderr = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as err:
        rc, stdout, stderr = "timeout", str(err.stdout or ""), str(err.stderr or "")
    result: dict[str, Any] = {"command": command, "rc": rc, "wall_s": time.perf_counter() - start}
    result["stdout_tail"], result["stderr_tail"] = stdout[-4000:], stderr[-6000:]
    logs = os.path.join(out_dir, "logs")
    if os.path.isdir(logs):  # each rank's own output: the first error's whole traceback is there
        result["rank_log_tails"] = {
            name: open(os.path.join(logs, name), errors="replace").read()[-12000:] for name in sorted(os.listdir(logs))
        }
    summary = os.path.join(out_dir, "mesh_summary.json")
    if os.path.exists(summary):
        with open(summary) as fh:
            result["mesh_summary"] = json.load(fh)
    return result


def run(out_path: str, budget_s: float, only: list[str] | None = None) -> int:
    require_cuda("gpu_mesh_check trains")
    import tempfile

    scratch = tempfile.mkdtemp(prefix="gpu_mesh_check-")
    sections = {
        "single_quality": lambda: single("quality", scratch),
        "single_paper": lambda: single("paper", scratch),
        "mesh_1x2_quality": lambda: mesh("1x2", "quality", scratch, 120),
        "mesh_3x2_paper": lambda: mesh("3x2", "paper", scratch, 150),
    }
    if only:
        sections = {name: section for name, section in sections.items() if name in only}
    start = time.perf_counter()
    data: dict[str, Any] = {"machine": machine_info(torch.device("cuda")), "errors": {}}
    failed = False
    for name, section in sections.items():
        if time.perf_counter() - start > budget_s:
            data[name] = {"skipped": f"time budget of {budget_s:.0f} s spent"}
            continue
        t0 = time.perf_counter()
        try:
            data[name] = section()
            failed |= data[name].get("rc", 0) != 0
        except Exception as err:  # keep the other sections' results; report the failure loudly
            failed = True
            data["errors"][name] = "".join(traceback.format_exception(err))
            print(f"gpu_mesh_check: section {name} failed: {err!r}", file=sys.stderr, flush=True)
        data.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0
        data["wall_s"] = time.perf_counter() - start
        os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
        with open(out_path, "w") as fh:
            json.dump(data, fh, indent=2, default=str)
        print(f"gpu_mesh_check: {name} done in {data['section_wall_s'][name]:.0f} s", flush=True)
    return 1 if failed else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_mesh_check.json)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no section after this many seconds")
    parser.add_argument("--sections", default=None, help="comma-separated section names (default: all)")
    args = parser.parse_args(argv)
    try:
        return run(args.out or default_out(), args.budget_s, args.sections.split(",") if args.sections else None)
    except ValueError as err:
        print(f"gpu_mesh_check: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
