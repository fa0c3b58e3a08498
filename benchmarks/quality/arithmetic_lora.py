"""Does a codec keep dense quality when every boundary carries a backward? SmolLM2 + LoRA on arithmetic.

Every row is `recipes/sft.py --dataset arithmetic` on the embedded SmolLM2-135M-Instruct with LoRA
r = 16 on all linear layers (so every stage trains and every boundary sends a gradient), Y = 4, 60
steps of 8 problems, lr 2e-4, the same data order and schedule as the SFT half of
`benchmarks/chain`; only the boundary (and the anchor prior) change. Scored on the **dense** model
(`eval()`: no boundary acts): held-out eval loss on 64 problems and greedy exact match on the same 64
(`hf_meshtune.apps.arithmetic.exact_match`). The gap is to Dense of the same seed, relative, + = worse
(a higher loss, a lower exact match).

    python -m benchmarks.quality.arithmetic_lora           # ~3 min a row alone on 2 CPU cores; skips finished rows
    python -m benchmarks.quality.arithmetic_lora dense outliers8_int3g71   # some rows

Writes benchmarks/quality/arithmetic_lora/<row>.json and results.md.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from benchmarks.quality.codec_sweep import DENSE_BF16, bf16_bytes

ROOT = Path(__file__).resolve().parents[2]
OUT = Path(__file__).resolve().parent / "arithmetic_lora"
EVAL_ITEMS = 64

ROWS: dict[str, dict] = {
    "dense": dict(mask_ratio=0.0, anchor=False, optim="adamw_torch"),
    "m95_ap": dict(preset="paper", anchor_every=10, anchor_delay=10),  # the paper, as benchmarks/chain runs it
    "outliers8_int8": dict(boundary_codec="outliers8+int8", anchor=False, optim="adamw_torch"),
    "outliers8_int4x8": dict(boundary_codec="outliers8+int4x8", anchor=False, optim="adamw_torch"),  # = int4g71 here
    "outliers8_pca512_int4g64": dict(boundary_codec="outliers8+pca512+int4g64", anchor=False, optim="adamw_torch"),
    "outliers8_int4": dict(boundary_codec="outliers8+int4", anchor=False, optim="adamw_torch"),
    "outliers8_int3g71": dict(boundary_codec="outliers8+int3g71", anchor=False, optim="adamw_torch"),
    "outliers8_int3": dict(boundary_codec="outliers8+int3", anchor=False, optim="adamw_torch"),
    "outliers8_spca226_int4": dict(boundary_codec="outliers8+spca226+int4", anchor=False, optim="adamw_torch"),
    "outliers8_int4g71_ap": dict(
        boundary_codec="outliers8+int4g71", anchor=True, anchor_every=10, anchor_delay=10, codec_refit_every=0
    ),
    "dense_seed1": dict(mask_ratio=0.0, anchor=False, optim="adamw_torch", seed=1),
    "outliers8_int8_seed1": dict(boundary_codec="outliers8+int8", anchor=False, optim="adamw_torch", seed=1),
    "outliers8_int3g71_seed1": dict(boundary_codec="outliers8+int3g71", anchor=False, optim="adamw_torch", seed=1),
    # issue 46: forward-only int4 (the backward in int8), rotated codes, e8m0 scales, zstd on the bytes
    "outliers8_int4x8_bwd_int8": dict(boundary_codec="outliers8+int4x8/int8", anchor=False, optim="adamw_torch"),
    "outliers8_rot_int4g64e8m0_zstd": dict(
        boundary_codec="outliers8+rot+int4g64e8m0+zstd", anchor=False, optim="adamw_torch"
    ),
    "outliers8_rot_int3g64e8m0_bwd_rot_int4g64e8m0_zstd": dict(
        boundary_codec="outliers8+rot+int3g64e8m0/rot+int4g64e8m0+zstd", anchor=False, optim="adamw_torch"
    ),
    "outliers8_rot_int3g64e8m0_zstd": dict(
        boundary_codec="outliers8+rot+int3g64e8m0+zstd", anchor=False, optim="adamw_torch"
    ),
    "outliers8_rot_int4g64e8m0_zstd_seed1": dict(
        boundary_codec="outliers8+rot+int4g64e8m0+zstd", anchor=False, optim="adamw_torch", seed=1
    ),
}


def _recipe():
    spec = importlib.util.spec_from_file_location("recipe_sft", ROOT / "recipes" / "sft.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def _flags(knobs: dict) -> list[str]:
    def text(value) -> str:
        return str(value).lower() if isinstance(value, bool) else str(value)

    return [item for key, value in knobs.items() for item in (f"--{key}", text(value))]


def train_and_score(knobs: dict, extra: Sequence[str] = ()) -> tuple[dict, list[dict], float, float]:
    """One row of the recipe (this module's fixed flags, then ``extra`` and the row's knobs): its eval metrics,
    log history, greedy exact match of the saved adapter on its base (dense) and training seconds."""
    from peft import AutoPeftModelForCausalLM
    from transformers import AutoTokenizer

    from hf_meshtune.apps import arithmetic

    with tempfile.TemporaryDirectory() as tmp:
        argv = [
            "--output_dir", tmp, "--dataset", "arithmetic", "--eval_items", str(EVAL_ITEMS),
            "--use_peft", "--lora_r", "16", "--lora_target_modules", "all-linear",
            "--max_steps", "60", "--learning_rate", "2e-4", "--per_device_train_batch_size", "8",
            "--num_stages", "4", "--save_strategy", "no", "--report_to", "none", "--logging_steps", "5",
            *extra, *_flags(knobs),
        ]  # fmt: skip
        start = time.perf_counter()
        metrics = _recipe().main(argv)
        seconds = time.perf_counter() - start
        history = json.loads((Path(tmp) / "trainer_state.json").read_text())["log_history"]
        model = AutoPeftModelForCausalLM.from_pretrained(tmp)  # the saved adapter on its base: dense
        tokenizer = AutoTokenizer.from_pretrained(tmp)
        exact = arithmetic.exact_match(model, tokenizer, arithmetic.problems(EVAL_ITEMS, seed=1))
    return metrics, history, exact, seconds


def gaps(row: dict, dense: dict | None) -> tuple[float, float]:
    """(eval loss gap, exact match gap) of ``row`` to ``dense``, relative, + = worse (NaN without a Dense row)."""
    if dense is None:
        return float("nan"), float("nan")
    loss, exact = dense["dense_eval_loss_after"], dense["exact_match_after"]
    return (row["dense_eval_loss_after"] - loss) / loss, (exact - row["exact_match_after"]) / exact


def run_rows(names: list[str], out: Path, run: Callable[[str], dict], table: Callable[[], str]) -> None:
    """Run each named row not yet in ``out`` (its JSON written as it finishes), rewriting results.md after each."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = out / f"{name}.json"
        if not target.exists():
            target.write_text(json.dumps(run(name), indent=2))
        (out / "results.md").write_text(table())
    print(table())


def run_row(name: str) -> dict:
    knobs = {"seed": 0, **ROWS[name]}
    metrics, history, exact, seconds = train_and_score(knobs)
    losses = [entry["loss"] for entry in history if "loss" in entry]
    ratios = [entry["comm/pp_coding_ratio"] for entry in history if "comm/pp_coding_ratio" in entry]
    measured = [
        entry["comm/measured_pp_fwd_bytes_per_token"] + entry["comm/measured_pp_bwd_bytes_per_token"]
        for entry in history
        if "comm/measured_pp_fwd_bytes_per_token" in entry
    ]
    return {
        "row": name,
        "knobs": knobs,
        "dense_eval_loss_after": metrics["eval_loss"],
        "exact_match_after": exact,
        "train_loss_last_log": losses[-1] if losses else None,
        "train_seconds": seconds,
        # measured on this fp32 run, all boundaries, per real token (coded where the codec ends in a coder)
        "measured_pp_bytes_per_real_token": sum(measured) / len(measured) if measured else None,
        "coding_ratio": sum(ratios) / len(ratios) if ratios else None,
    }


def table() -> str:
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))}
    lines = [
        "| row | boundary | seed | anchor prior | bf16 B/token/boundary | compression | dense eval loss | "
        "gap (+ = worse) | exact match (64) | gap (+ = worse) | train loss (last log) |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, knobs in ROWS.items():
        if name not in rows:
            continue
        r, seed = rows[name], knobs.get("seed", 0)
        dense = rows.get("dense" if seed == 0 else f"dense_seed{seed}")
        loss, exact = r["dense_eval_loss_after"], r["exact_match_after"]
        loss_gap, exact_gap = gaps(r, dense)
        boundary = knobs.get("boundary_codec") or ("dense" if knobs.get("mask_ratio") == 0.0 else "mask0.95 (zeros)")
        size = bf16_bytes(knobs)
        prior = "yes" if knobs.get("anchor", knobs.get("preset", "paper") == "paper") else "no"
        lines.append(
            f"| {name} | `{boundary}` | {seed} | {prior} | {size} | "
            f"{DENSE_BF16 / size:.1f}× | {loss:.4f} | {loss_gap:+.1%} | {exact:.3f} | {exact_gap:+.1%} | "
            f"{r['train_loss_last_log']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    run_rows(argv or list(ROWS), OUT, run_row, table)


if __name__ == "__main__":
    main(sys.argv[1:])
