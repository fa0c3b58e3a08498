"""Memory per mesh process, measured beside the memory ledger's prediction, and the same model in one process.

    python -m benchmarks.memory.run                   # every row, ~25 min on 2 CPU cores
    python -m benchmarks.memory.run --rows llama1b_2x4_lora,llama1b_1process_lora

Writes benchmarks/memory/results/memory.json after every row (a row already there is kept unless
named in --rows) and memory.md. Rows (every one is `recipes/sft.py` on embedded GSM8K, 1 × 128 tokens
per microbatch, 4 microbatches per step, a DiLoCo sync every 2 steps so its state exists when measured,
and gradient checkpointing off: TRL's default turns it on, and then the run's activation meter sees only
what is saved outside the checkpointed layers, so measured and predicted activations would not compare):

  smollm2_3x2_full            SmolLM2-135M full fine-tune (embeddings train) on `meshtune launch --mesh 3x2`
  smollm2_3x2_full_before     that row on commit BEFORE, the last whose processes each held the whole model
  smollm2_3x2_frozen_emb      the full fine-tune with --freeze_embeddings (what the mesh guide's command used to need)
  smollm2_3x2_frozen_emb_before  that row on commit BEFORE, the last whose processes each held the whole model
  smollm2_1process_full       the full fine-tune in one process (the single-process MeshTrainer, Y = 2)
  llama1b_2x4_lora            a Llama-3.2-1B-shaped model (the real config: H 2048, 16 layers, vocab
                              128,256; random weights, seed 0, bfloat16), LoRA r 16 on every linear,
                              on `meshtune launch --mesh 2x4` (8 processes), 64 tokens per microbatch
  llama1b_1process_lora       the same model and adapter in one process

Two measurements per process: the run's own (``mesh_summary.json``: parts counted from the tensors,
peak RSS from getrusage, the memory ledger's prediction) and this script's, the kernel's VmHWM of every
process of the launch sampled from /proc every 0.5 s, plus the largest sum of their PSS at one sample:
what they hold together, the checkpoint pages several of them map (from_pretrained and the per-stage
loader both map the safetensors file) counted once. On a GPU each process copies its tensors into its
own device memory, and nothing is shared.
The one-process and ``before`` rows have only the sampled figures. A row that fails (or passes
``LIMIT_GIB``) is recorded with its reason and the next row runs.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from hf_meshtune.topology import parse_mesh

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "benchmarks", "memory", "results")
BEFORE = "07763d5"  # the last commit before per-stage placement (3f17adf)
GIB = 1024**3
SFT = ["--max_length", "128", "--per_device_train_batch_size", "1", "--gradient_accumulation_steps", "4",
       "--eval_items", "4", "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
       "--dp_sync_every", "2", "--gradient_checkpointing", "false"]  # fmt: skip
LORA = ["--use_peft", "--lora_r", "16", "--lora_target_modules", "all-linear"]
ROWS: dict[str, dict] = {
    "smollm2_3x2_full": {"mesh": "3x2", "args": ["--max_steps", "4"]},
    "smollm2_3x2_full_before": {"mesh": "3x2", "args": ["--max_steps", "4"], "commit": BEFORE},
    "smollm2_3x2_frozen_emb": {"mesh": "3x2", "args": ["--max_steps", "4", "--freeze_embeddings"]},
    "smollm2_3x2_frozen_emb_before": {"mesh": "3x2", "args": ["--max_steps", "4", "--freeze_embeddings"],
                                      "commit": BEFORE},  # fmt: skip
    "smollm2_1process_full": {"mesh": None, "args": ["--max_steps", "4", "--num_stages", "2"]},
    "llama1b_2x4_lora": {"mesh": "2x4", "model": "llama1b", "args": ["--max_steps", "4", "--max_length", "64", *LORA]},
    "llama1b_1process_lora": {"mesh": None, "model": "llama1b",
                              "args": ["--max_steps", "4", "--max_length", "64", "--num_stages", "4", *LORA]},
}  # fmt: skip


def llama1b_checkpoint() -> str:
    """A Llama-3.2-1B-shaped checkpoint (``meshtune ledger``'s llama-3.2-1b config), random weights of
    seed 0 in bfloat16, sharded, with SmolLM2's tokenizer (its ids fit the 128,256-token vocabulary);
    written once under the cache."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_meshtune.apps.assets import cache_dir, smollm2_checkpoint
    from hf_meshtune.ledger import PRESETS

    target = cache_dir() / "llama-3.2-1b-shape-random-seed0-bf16"
    if (target / "model.safetensors.index.json").is_file():
        return str(target)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(PRESETS["llama-3.2-1b"], dtype=torch.bfloat16)
    tmp = target.with_name(f"{target.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, max_shard_size="1GB")
    AutoTokenizer.from_pretrained(smollm2_checkpoint()).save_pretrained(tmp)
    del model
    os.replace(tmp, target)
    return str(target)


LIMIT_GIB = 22.0  # the machine has 23 GiB: a row that would take it all is stopped, not left to the OOM killer


class Sampler(threading.Thread):
    """VmHWM of every process under ``pid`` (the largest seen) and the largest sum of their proportional
    set sizes (PSS: a page mapped by n of them counts 1/n in each, so the sum is what they hold together,
    the checkpoint's safetensors pages that several processes map counted once); kills them all when
    that sum passes ``LIMIT_GIB``."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid, self.hwm, self.total_peak, self.done = pid, {}, 0, threading.Event()
        self.exceeded = False

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.pid)
        while not self.done.wait(0.5):
            try:
                procs = [root, *root.children(recursive=True)]
            except psutil.NoSuchProcess:
                return
            total = 0
            for proc in procs:
                status = _status(proc.pid)
                if status is None or "python" not in " ".join(_cmdline(proc.pid)):
                    continue
                self.hwm[proc.pid] = max(self.hwm.get(proc.pid, 0), status.get("VmHWM", 0))
                total += _pss(proc.pid)
            self.total_peak = max(self.total_peak, total)
            if total > LIMIT_GIB * GIB:
                self.exceeded = True
                for proc in procs:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        proc.kill()
                return


def _status(pid: int) -> dict[str, int] | None:
    try:
        with open(f"/proc/{pid}/status") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    return {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in lines) if v.strip().endswith("kB")}


def _pss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as handle:
            line = next(line for line in handle if line.startswith("Pss:"))
    except (OSError, StopIteration):
        return 0
    return int(line.split()[1]) * 1024


def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline") as handle:
            return handle.read().split("\0")
    except OSError:
        return []


def _code_root(commit: str | None, workdir: str) -> str:
    if commit is None:
        return ROOT
    tree = os.path.join(workdir, f"code-{commit}")
    if not os.path.isdir(tree):
        subprocess.run(["git", "worktree", "add", "--detach", tree, commit], cwd=ROOT, check=True, capture_output=True)
    return tree


def run_row(name: str, spec: dict, workdir: str) -> dict:
    out = os.path.join(workdir, name)
    code = _code_root(spec.get("commit"), workdir)
    model = ["--model_name_or_path", llama1b_checkpoint()] if spec.get("model") == "llama1b" else []
    recipe = [os.path.join(code, "recipes", "sft.py"), "--output_dir", out, *SFT, *spec["args"], *model]
    bin_dir = os.path.dirname(sys.executable)
    if spec["mesh"]:
        command = [os.path.join(bin_dir, "meshtune"), "launch", "--mesh", spec["mesh"], "--cpu", "--", *recipe]
    else:
        command = [sys.executable, *recipe]
    env = {**os.environ, "RUST_LOG": "warn", "PYTHONPATH": code}
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=code, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    sampler = Sampler(proc.pid)
    sampler.start()
    stdout, stderr = proc.communicate()
    sampler.done.set()
    sampler.join()
    if sampler.exceeded:
        held = sampler.total_peak / GIB
        raise RuntimeError(f"{name}: its processes held {held:.1f} GiB together (over LIMIT_GIB = {LIMIT_GIB})")
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed ({proc.returncode}):\n{stdout[-4000:]}\n{stderr[-4000:]}")
    workers = sorted(sampler.hwm.values(), reverse=True)[: _processes(spec["mesh"])]
    row = {
        "command": _shown_command(spec),
        "code": spec.get("commit") or "this commit",
        "wall_seconds": time.perf_counter() - start,
        "sampled_peak_gib": [b / GIB for b in workers],
        "sampled_total_peak_gib": sampler.total_peak / GIB,
        "eval_loss": _eval_loss(stdout + stderr),
    }
    summary = os.path.join(out, "mesh_summary.json")
    if spec["mesh"] and spec.get("commit") is None:
        with open(summary) as handle:
            mesh = json.load(handle)
        for key in ("memory_gib", "memory_predicted_gib", "memory_max_gib", "step_seconds_mean", "final_loss"):
            row[key] = mesh[key]
    return row


def _shown_command(spec: dict) -> str:
    """The row's command as a user types it (OUT: the output folder, LLAMA1B: llama1b_checkpoint())."""
    launcher = f"meshtune launch --mesh {spec['mesh']} --cpu --" if spec["mesh"] else "python"
    model = ["--model_name_or_path", "LLAMA1B"] if spec.get("model") == "llama1b" else []
    return " ".join([launcher, "recipes/sft.py", "--output_dir", "OUT", *SFT, *spec["args"], *model])


def _processes(mesh: str | None) -> int:
    if not mesh:
        return 1
    x, y = parse_mesh(mesh)
    return x * y


def _eval_loss(text: str) -> float | None:
    lines = [line for line in text.splitlines() if "eval_loss" in line and "=" in line]
    return float(lines[-1].split("=")[-1]) if lines else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help="comma-separated rows to (re)run")
    names = [n.strip() for n in parser.parse_args().rows.split(",") if n.strip()]
    unknown = sorted(set(names) - set(ROWS))
    if unknown:
        sys.exit(f"--rows={unknown} is invalid: it must name rows of {list(ROWS)}")
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, "memory.json")
    results = json.load(open(path)) if os.path.isfile(path) else {}
    from benchmarks.memory.report import write_markdown

    with tempfile.TemporaryDirectory() as workdir:
        try:
            for name in names:
                try:
                    results[name] = run_row(name, ROWS[name], workdir)
                except RuntimeError as err:  # a missed target is a result: say why, run the next row
                    results[name] = {"code": ROWS[name].get("commit") or "this commit", "failed": str(err)[:2000]}
                results = {n: results[n] for n in [*ROWS, *results] if n in results}  # ROWS' order
                with open(path, "w") as handle:
                    json.dump(results, handle, indent=2)
                write_markdown(results, os.path.join(OUT, "memory.md"))
                print(f"{name}: done", flush=True)
        finally:
            subprocess.run(["git", "worktree", "prune"], cwd=ROOT, check=False)
    print(open(os.path.join(OUT, "memory.md")).read())


if __name__ == "__main__":
    main()
