"""Boundaries that remember: per-sample change coding over a 3-epoch LoRA fine-tune, beside Dense.

Every row is `benchmarks/quality/arithmetic_lora`'s recipe (`recipes/sft.py --dataset arithmetic` on the
embedded SmolLM2-135M-Instruct, LoRA r = 16 on all linear layers, Y = 4, lr 2e-4, 60 steps of 8) on a
fixed subset of 160 problems, so the 60 steps are 3 epochs; the Trainer reshuffles each epoch from the
seed, so every row of a seed sees the same rows in the same order. Only the boundary changes: Dense,
rotated int4 (`outliers8+rot+int4g64e8m0+zstd`, the default when this ran) alone, and with
`boundary_change_codec` (a row revisited with the same tokens sends the change of its activation since its last
visit, rounded on the grid int<b> would use on the cached value, zstd-coded). Scored on the **dense** model:
eval loss and greedy exact match on 64 held-out problems; the gap is to Dense of the same seed, relative,
+ = worse.

Bytes are **measured** (what the counters booked: the real tokens' records, coded) on this fp32 run, per
real token, boundary and direction, per epoch and over the run (mean of the 5-step logs); the reference is
a bf16 Dense boundary, 1,152 B per token and direction (the measured fp32 records hold the 8 outlier dims
in 4 bytes, not 2: the ratios are slightly pessimistic).

    python -m benchmarks.quality.epochs                      # every row, ~10 min each on 2 CPU cores; skips done ones
    python -m benchmarks.quality.epochs dense rot_int4_delta5  # some rows

Writes benchmarks/quality/epochs/<row>.json and results.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.quality.arithmetic_lora import gaps, run_rows, train_and_score

OUT = Path(__file__).resolve().parent / "epochs"
TRAIN_ITEMS, STEPS, EPOCHS = 160, 60, 3  # arithmetic_lora's 60 steps of 8: 3 epochs of 160 problems
BOUNDARIES, DENSE_BF16 = 3, 576 * 2  # per token, boundary and direction
ADAMW = dict(anchor=False, optim="adamw_torch")
ROTATED_INT4 = "outliers8+rot+int4g64e8m0+zstd"  # 4.9x, the boundary whose revisits are change-coded


def _changed(change: str, seed: int = 0) -> dict:
    return dict(ADAMW, boundary_codec=ROTATED_INT4, boundary_change_codec=change, seed=seed)


ROWS: dict[str, dict] = {
    "dense": dict(ADAMW, mask_ratio=0.0),
    "rot_int4": dict(ADAMW, boundary_codec=ROTATED_INT4),
    "rot_int4_delta4": _changed("rot+delta4g64+zstd"),
    "rot_int4_delta5": _changed("rot+delta5g64+zstd"),
    "rot_int4_delta6": _changed("rot+delta6g64+zstd"),
    "dense_seed1": dict(ADAMW, mask_ratio=0.0, seed=1),
    "rot_int4_delta5_seed1": _changed("rot+delta5g64+zstd", seed=1),
}


def _epoch_of(step: int) -> int:
    return (step - 1) * EPOCHS // STEPS  # steps 1..20 → 0, 21..40 → 1, 41..60 → 2


def run_row(name: str) -> dict:
    knobs = {"seed": 0, **ROWS[name]}
    extra = ["--train_items", str(TRAIN_ITEMS)]  # 60 steps of 8 (the module's own flags): 3 epochs of the subset
    metrics, history, exact, seconds = train_and_score(knobs, extra)
    logs = [entry for entry in history if "comm/measured_pp_fwd_bytes_per_token" in entry]
    per_epoch = []
    for epoch in range(EPOCHS):
        inside = [entry for entry in logs if _epoch_of(entry["step"]) == epoch]
        per_epoch.append(
            {
                key: sum(entry[f"comm/measured_pp_{key}_bytes_per_token"] for entry in inside) / len(inside)
                for key in ("fwd", "bwd")
            }
            | {"revisit_fraction": sum(entry.get("change/revisit_fraction", 0.0) for entry in inside) / len(inside)}
            if inside
            else {}
        )
    losses = [entry["loss"] for entry in history if "loss" in entry]
    return {
        "row": name,
        "knobs": knobs,
        "dense_eval_loss_after": metrics["eval_loss"],
        "exact_match_after": exact,
        "train_loss_last_log": losses[-1] if losses else None,
        "train_seconds": seconds,
        # measured on this fp32 run, all boundaries, per real token (coded where the codec ends in a coder)
        "per_epoch": per_epoch,
        "cache_bytes": max((entry.get("change/cache_bytes", 0.0) for entry in logs), default=0.0),
    }


def table() -> str:
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(OUT.glob("*.json"))}
    lines = [
        "| row | boundary | change | seed | B/token/boundary fwd+bwd, epochs 1 / 2 / 3 | over the run | "
        "× vs bf16 Dense | cache MB | dense eval loss | gap | exact match (64) | gap |",
        "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, knobs in ROWS.items():
        if name not in rows:
            continue
        r, seed = rows[name], knobs.get("seed", 0)
        dense = rows.get("dense" if seed == 0 else f"dense_seed{seed}")
        loss, exact = r["dense_eval_loss_after"], r["exact_match_after"]
        loss_gap, exact_gap = gaps(r, dense)
        if knobs.get("boundary_codec"):
            sizes = [(e["fwd"] + e["bwd"]) / BOUNDARIES for e in r["per_epoch"]]
            run = sum(sizes) / len(sizes)
            epochs, over, ratio = " / ".join(f"{s:.0f}" for s in sizes), f"{run:.0f}", f"{2 * DENSE_BF16 / run:.1f}×"
        else:
            epochs, over, ratio = "(bf16: 2,304 each)", "2304", "1.0×"
        lines.append(
            f"| {name} | `{knobs.get('boundary_codec') or 'dense'}` | `{knobs.get('boundary_change_codec') or '-'}` | "
            f"{seed} | {epochs} | {over} | {ratio} | {r['cache_bytes'] / 1e6:.0f} | {loss:.4f} | {loss_gap:+.1%} | "
            f"{exact:.3f} | {exact_gap:+.1%} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    run_rows(argv or list(ROWS), OUT, run_row, table)


if __name__ == "__main__":
    main(sys.argv[1:])
