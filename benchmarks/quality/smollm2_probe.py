"""Where does M95+AP keep quality on a real pretrained model? A side-by-side probe on SmolLM2-135M.

Every variant is the main job (`meshtune demo`: SFT on GSM8K, last 8 layers trainable, 60 steps,
same data order and lr schedule) with one or two knobs changed; all are evaluated on the dense model.
"retained" = (dense-eval improvement of the variant) / (improvement of the Dense run).

    python benchmarks/quality/smollm2_probe.py            # ~50 min on 2 CPU cores; skips finished variants

Writes benchmarks/quality/smollm2_probe/<variant>.json and results.md.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from hf_meshtune.apps.demo import DemoSettings, run_demo

OUT = Path(__file__).resolve().parent / "smollm2_probe"

# preset="paper": every variant here is the paper's method (M95, zero fill, anchor prior) with a knob changed
VARIANTS: dict[str, dict] = {
    "dense": dict(mask_ratio=0.0, anchor=False),
    "m95": dict(preset="paper", anchor=False),
    "m95_ap": dict(preset="paper"),
    "m95_ap_mean_fill": dict(preset="paper", mask_fill="mean"),
    "m95_ap_rescale": dict(preset="paper", mask_rescale=True),
    "m95_ap_relative_tau_0.1": dict(preset="paper", spectral_relative_tau=True, spectral_tau=0.1),
    "m95_ap_alpha_0": dict(preset="paper", spectral_alpha=0.0),
    "m90_ap": dict(preset="paper", mask_ratio=0.90),
    "m75_ap": dict(preset="paper", mask_ratio=0.75),
    "m50_ap": dict(preset="paper", mask_ratio=0.50),
    "m95_ap_y2": dict(preset="paper", num_stages=2),
    "m90_ap_y2_mean_fill": dict(preset="paper", mask_ratio=0.90, num_stages=2, mask_fill="mean"),
    "m95_ap_protect8": dict(preset="paper", mask_protect_dims=8),
    "m95_ap_protect8_mean_fill": dict(preset="paper", mask_protect_dims=8, mask_fill="mean"),
    "m95_protect8_mean_fill": dict(preset="paper", mask_protect_dims=8, mask_fill="mean", anchor=False),
    "m95_ap_gaussian_fill": dict(preset="paper", mask_fill="gaussian"),
    "m95_gaussian_fill": dict(preset="paper", mask_fill="gaussian", anchor=False),
}


def run_rows(rows: dict[str, dict], names: list[str], out: Path, extra: Callable[[str], dict] | None = None) -> None:
    """The main job once per row of ``rows`` named in ``names`` (knobs over ``DemoSettings``), each written to
    ``out/<row>.json`` as soon as it ends (with ``extra(row)`` merged in); finished rows are skipped."""
    out.mkdir(parents=True, exist_ok=True)
    for name in names:
        target = out / f"{name}.json"
        if target.exists():
            continue
        with tempfile.TemporaryDirectory() as tmp:
            summary = run_demo(DemoSettings(output_dir=tmp, **rows[name]))
        summary.update({"variant": name, **(extra(name) if extra else {})})
        target.write_text(json.dumps(summary, indent=2, default=str))


def main(rows: dict[str, dict], out: Path, table: Callable[[], str], argv: list[str]) -> None:
    """Run the rows ``argv`` names (all by default), then write and print ``table()``."""
    run_rows(rows, argv or list(rows), out)
    (out / "results.md").write_text(table())
    print(table())


def load_rows(out: Path) -> tuple[dict[str, dict], dict | None, float | None]:
    """(every row's summary by name, the Dense row, Dense's eval-loss improvement) from ``out``."""
    rows = {p.stem: json.loads(p.read_text()) for p in sorted(out.glob("*.json"))}
    dense = rows.get("dense")
    gain = dense["dense_eval_loss_before"] - dense["dense_eval_loss_after"] if dense else None
    return rows, dense, gain


def before_line(rows: dict[str, dict], digits: int) -> str:
    before = next(iter(rows.values()))["dense_eval_loss_before"] if rows else float("nan")
    return f"Dense eval loss before training: {before:.{digits}f}\n\n"


def table() -> str:
    rows, dense, gain = load_rows(OUT)
    lines = [
        "| variant | knobs | dense eval loss after | retained | masked train loss (last) | cos(masked, anchor) | "
        "cos(filtered, anchor) | mean d | train s |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name in VARIANTS:
        if name not in rows:
            continue
        r, log = rows[name], rows[name].get("last_log", {})
        retained = (r["dense_eval_loss_before"] - r["dense_eval_loss_after"]) / gain if gain else float("nan")
        knobs = ", ".join(f"{k}={v}" for k, v in VARIANTS[name].items()) or "defaults"
        lines.append(
            f"| {name} | {knobs} | {r['dense_eval_loss_after']:.3f} | {retained:.0%} | "
            f"{r['masked_train_loss_last_log']:.2f} | {log.get('spectral/cos_masked_vs_anchor', float('nan')):.3f} | "
            f"{log.get('spectral/cos_filtered_vs_anchor', float('nan')):.3f} | "
            f"{log.get('spectral/filter_mean_d', float('nan')):.3f} | {r['train_runtime_s']:.0f} |"
        )
    return before_line(rows, 3) + "\n".join(lines) + "\n"


if __name__ == "__main__":
    main(VARIANTS, OUT, table, sys.argv[1:])
