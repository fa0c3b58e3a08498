"""One prepared GPU check (≤ 5 min on an H200): masking and SpectralAdamW at Llama-3.2-1B shapes, bf16, CUDA.

    python -m benchmarks.wan.gpu_check                 # writes $OUT/gpu_check.{json,md} (or --out PATH)
    python -m benchmarks.wan.gpu_check --render J.json # rewrites J.md from a run's JSON (no GPU needed)

The CUDA counterpart of ``micro.py`` and the same code: every timing helper is imported from it.
Sections, each written to the JSON as soon as it finishes (a timeout keeps what was done), each
skipped once ``--budget-s`` is spent, and each recording its error instead of stopping the others:

1. ``masking_work``: keep-index generation (always on the CPU, by design) and compact/expand forward
   + backward for 3 boundaries × 4 microbatches of [1, 2048, 2048] bf16 (the paper's 32 × 2k batch
   over 7 fast replicas is ≈ 4.6 sequences per replica per step).
2. ``masked_step``: a randomly initialised Llama-3.2-1B (the ledger's preset) in bf16 with Y = 4
   boundaries at p = 0.95, full steps of the same 4 microbatches (forward, backward, AdamW), masked and
   dense interleaved; with (1), the masking share of a step on a GPU.
3. ``optimizer``: AdamW (torch's default, foreach on CUDA, and single-tensor for reference) against
   SpectralAdamW with a full SVD and rank caps 32 and 8 on one decoder layer's parameters in bf16.

Without a CUDA device it refuses (exit code 2) and names the rule: it never falls back to the CPU.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import transformers

from benchmarks.wan.micro import (
    AMORTISED_TARGET,
    ANCHOR_EVERY,
    MASK_RATIO,
    MASK_SHARE_TARGET,
    SPECTRAL_RANKS,
    _ms,
    _optimizer_lines,
    _profile_lines,
    compare_optimizers,
    decoder_layer_shapes,
    machine_info,
    time_masked_step,
    time_masking_work,
)
from hf_meshtune import ledger as L
from hf_meshtune._validation import require

PRESET = "llama-3.2-1b"
DTYPE = torch.bfloat16
MICROBATCHES, BATCH, SEQ_LEN = 4, 1, 2048
NUM_BOUNDARIES = 3  # Y = 4 stages


def require_cuda(what: str = "gpu_check times bf16 kernels") -> torch.device:
    """The CUDA device, or ``ValueError`` naming the rule (no CPU fallback: the CPU numbers are micro.py's)."""
    available = torch.cuda.is_available()
    require(
        available,
        "torch.cuda.is_available()",
        available,
        f"be True: {what} on a CUDA device and never falls back to the CPU "
        f"(torch {torch.__version__}); run `python -m benchmarks.wan.micro` for the CPU numbers",
    )
    return torch.device("cuda", torch.cuda.current_device())


def default_out() -> str:
    """``$OUT/gpu_check.json`` when $OUT is set, else benchmarks/wan/results/gpu_check.json."""
    folder = os.environ.get("OUT") or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
    return os.path.join(folder, "gpu_check.json")


def masking_work(device: torch.device) -> dict[str, Any]:
    """Section 1: the masking work of one step alone at the paper's shapes."""
    return time_masking_work(
        NUM_BOUNDARIES,
        MICROBATCHES,
        BATCH,
        SEQ_LEN,
        L.PRESETS[PRESET].hidden_size,
        mask_ratio=MASK_RATIO,
        device=device,
        dtype=DTYPE,
        reps=10,
    )


def masked_step(device: torch.device) -> dict[str, Any]:
    """Section 2: full masked and dense steps of a random-init Llama-3.2-1B in bf16."""
    config = L.PRESETS[PRESET]
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE)
    try:
        return time_masked_step(
            model,
            microbatches=MICROBATCHES,
            batch=BATCH,
            seq_len=SEQ_LEN,
            vocab=config.vocab_size,
            device=device,
            reps=5,
        )
    finally:
        del model
        torch.cuda.empty_cache()


def optimizer(device: torch.device) -> dict[str, Any]:
    """Section 3: AdamW vs SpectralAdamW (full SVD, rank caps) on one decoder layer's parameters in bf16."""
    shapes = decoder_layer_shapes(L.PRESETS[PRESET])
    out = compare_optimizers(
        list(shapes.values()),
        device=device,
        dtype=DTYPE,
        ranks=SPECTRAL_RANKS,
        reps=10,
        svd_reps=3,
        adamw_variants={"single_tensor": {"foreach": False}},
    )
    out["shapes"] = shapes
    torch.cuda.empty_cache()
    return out


SECTIONS: dict[str, Callable[[torch.device], dict[str, Any]]] = {
    "masking_work": masking_work,
    "masked_step": masked_step,
    "optimizer": optimizer,
}


def summarise(data: dict[str, Any]) -> dict[str, Any]:
    """The headline ratios, from whichever sections finished."""
    out: dict[str, Any] = {}
    work, step = data.get("masking_work", {}), data.get("masked_step", {})
    if "mask_fwd_bwd" in work and "masked_step" in step:
        masked = step["masked_step"]["median_s"]
        out["masking_share_of_step"] = work["mask_fwd_bwd"]["median_s"] / masked
        out["index_generation_share_of_step"] = work["index_generation"]["median_s"] / masked
        out["masked_minus_dense_share"] = (masked - step["dense_step"]["median_s"]) / masked
    opt = data.get("optimizer", {})
    for key, spec in opt.get("spectral", {}).items():
        out[f"spectral_{key}_amortised_over_adamw"] = spec["amortised_over_adamw"]
    return out


def run(out_path: str, budget_s: float) -> int:
    """Run every section within ``budget_s`` seconds, rewriting ``out_path`` after each; exit code."""
    device = require_cuda()
    start = time.perf_counter()
    data: dict[str, Any] = {"machine": machine_info(device), "preset": PRESET, "dtype": str(DTYPE), "errors": {}}
    failed = False
    for name, section in SECTIONS.items():
        if time.perf_counter() - start > budget_s:
            data[name] = {"skipped": f"time budget of {budget_s:.0f} s spent"}
            continue
        torch.cuda.reset_peak_memory_stats(device)
        t0 = time.perf_counter()
        try:
            data[name] = section(device)
        except Exception as err:  # keep the other sections' numbers; report the failure loudly
            failed = True
            data["errors"][name] = "".join(traceback.format_exception(err))
            print(f"gpu_check: section {name} failed: {err!r}", file=sys.stderr)
        data.setdefault("section_wall_s", {})[name] = time.perf_counter() - t0
        data.setdefault("section_peak_gib", {})[name] = torch.cuda.max_memory_allocated(device) / 2**30
        data["summary"], data["wall_s"] = summarise(data), time.perf_counter() - start
        _write(out_path, data)
    print(json.dumps(data["summary"], indent=2))
    print(f"wrote {out_path} in {data['wall_s']:.0f} s")
    return 1 if failed else 0


def _write(path: str, data: dict[str, Any]) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, default=str)
    with open(os.path.splitext(path)[0] + ".md", "w") as fh:
        fh.write(markdown(data))


def _masking_lines(data: dict[str, Any]) -> list[str]:
    work, step = data.get("masking_work", {}), data.get("masked_step", {})
    if "mask_fwd_bwd" not in work or "masked_step" not in step:
        return [f"Not measured: {work.get('skipped') or step.get('skipped') or data['errors']}"]
    s = data["summary"]
    share = s["masking_share_of_step"]
    verdict = "met" if share <= MASK_SHARE_TARGET else f"missed ({share / MASK_SHARE_TARGET:.1f}× the target)"
    per_draw = work["index_generation"]["median_s"] / (work["num_boundaries"] * work["microbatches"])
    return [
        f"Y = {work['num_boundaries'] + 1} stages ({work['num_boundaries']} boundaries), p = {MASK_RATIO}, "
        f"{work['microbatches']} microbatches of [{work['batch']}, {work['seq_len']}], H = {work['hidden']}, "
        f"K = {work['keep']}; step = forward + backward of every microbatch + AdamW on a random-init {data['preset']} "
        f"in {data['dtype']}.",
        "",
        "| masked step (ms) | dense step (ms) | index gen, CPU (ms) | mask fwd+bwd incl. index gen (ms) | "
        "share of step | of which index gen | (masked − dense) / masked | ≤ 3 %? |",
        "|---:|---:|---:|---:|---:|---:|---:|---|",
        f"| {_ms(step['masked_step']['median_s'])} | {_ms(step['dense_step']['median_s'])} | "
        f"{_ms(work['index_generation']['median_s'])} | {_ms(work['mask_fwd_bwd']['median_s'])} | "
        f"{100 * share:.1f} % | {100 * s['index_generation_share_of_step']:.1f} % | "
        f"{100 * s['masked_minus_dense_share']:+.1f} % | {verdict} |",
        "",
        f"Keep-index generation runs on the CPU by design (every stage must draw the same indices, whatever its "
        f"device): {_ms(per_draw)} ms per boundary per microbatch here, with {data['machine']['torch_threads']} "
        "torch threads.",
    ]


def markdown(data: dict[str, Any]) -> str:
    """gpu_check.md: the machine, the masking share of a step and SpectralAdamW against AdamW, from the JSON."""
    m = data["machine"]
    opt = data.get("optimizer", {})
    out = [
        f"# GPU check: masking and SpectralAdamW at {data['preset']} shapes on an {m.get('gpu', '?')}",
        "",
        f"Generated by `python -m benchmarks.wan.gpu_check` on {m['date']} in {data['wall_s']:.1f} s: "
        f"{m.get('gpu', '?')}, torch {m['torch']}, transformers {m['transformers']}, Python {m['python']}, "
        f"{m['cpu_affinity']} CPU cores, {m['platform']}. Times are medians of repetitions (the JSON has each).",
        "",
        f"## Masking as a share of a training step (target ≤ {100 * MASK_SHARE_TARGET:.0f} %)",
        "",
        *_masking_lines(data),
        "",
        f"## SpectralAdamW vs AdamW (target: amortised ≤ {AMORTISED_TARGET}×)",
        "",
    ]
    if "spectral" not in opt:
        out.append(f"Not measured: {opt.get('skipped') or data['errors'].get('optimizer')}")
    else:
        sets = {"anchor_every": ANCHOR_EVERY, "sets": {f"{data['preset']}-layer": opt}}
        out += [*_optimizer_lines(sets, where=f"{opt['dtype']} on the GPU"), ""]
        for label, variant in opt.get("adamw_variants", {}).items():
            out.append(
                f"AdamW {label.replace('_', '-')}: {_ms(variant['median_s'])} ms against the default's "
                f"{_ms(opt['adamw']['step']['median_s'])} ms."
            )
        profile = _profile_lines(sets)
        if profile:
            out += [
                "",
                "### Where the time goes, in AdamW steps (they add up to the amortised ratio)",
                "",
                *profile,
            ]
    if data["errors"]:
        out += ["", "## Errors", "", *[f"- {name}: {err.splitlines()[-1]}" for name, err in data["errors"].items()]]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    """Parse flags, refuse without CUDA (exit 2, the rule on stderr), run the sections."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=None, help="JSON path (default $OUT/gpu_check.json)")
    parser.add_argument("--budget-s", type=float, default=240.0, help="start no section after this many seconds")
    parser.add_argument("--render", metavar="JSON", help="only rewrite the .md beside an earlier run's JSON")
    args = parser.parse_args(argv)
    if args.render:
        with open(args.render) as fh:
            data = json.load(fh)
        with open(os.path.splitext(args.render)[0] + ".md", "w") as fh:
            fh.write(markdown(data))
        return 0
    try:
        return run(args.out or default_out(), args.budget_s)
    except ValueError as err:
        print(f"gpu_check: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
