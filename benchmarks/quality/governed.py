"""The fidelity governor on the main job: governed boundaries beside the fixed default and the paper.

Rows are the main job (`meshtune demo`: SmolLM2-135M-Instruct, GSM8K SFT, last 8 layers trainable,
Y = 4, 60 steps, anchor rounds every 10 steps landing 10 steps later) with
``boundary_codec="governed"`` (the default ladder ``outliers8+int3x8 / int4x8 / int8``, the default
target; no anchor prior: the anchor circuit runs for the governor only), beside Dense, the fixed
default (``outliers8+int8``) and the paper preset from the codec sweep (``codec_sweep/``), and a
re-run of the default here that must reproduce the sweep's number (same code path, same seed).

Bytes: per boundary and token on a bf16 wire, averaged over the run's steps from the levels the
governor used at each step (the formula of each level), and the fp32 run's measured message bytes
over the run (forward, all three boundaries). The anchor's extra compute: probe passes per round,
each one forward/backward of the round's batch.

    python -m benchmarks.quality.governed            # ~25 min on 2 CPU cores; skips finished rows

Writes benchmarks/quality/fidelity/<row>.json and governed.md.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from benchmarks.quality.smollm2_probe import run_rows
from hf_meshtune.anchor.governor import mean_level_bytes
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.config import GOVERNED_LADDER

HERE = Path(__file__).resolve().parent
SWEEP, OUT = HERE / "codec_sweep", HERE / "fidelity"
H, STEPS, BOUNDARIES = 576, 60, 3

ROWS: dict[str, dict] = {
    "governed": dict(boundary_codec="governed"),
    "outliers8_int8_rerun": dict(boundary_codec="outliers8+int8", anchor=False),
}


def level_bytes(ladder: str) -> list[int]:
    return [parse_codec(level.strip()).payload_bytes(H, 2) for level in ladder.split(",")]


def governed_bytes(summary: dict) -> float:
    """bf16 bytes per token and boundary over the run: each step at the levels in use then."""
    sizes = level_bytes(summary["settings"].get("codec_ladder") or GOVERNED_LADDER)
    return mean_level_bytes(summary["governor"]["switches"], sizes, BOUNDARIES, summary["settings"]["max_steps"])


def table() -> str:
    sweep = {name: json.loads((SWEEP / f"{name}.json").read_text()) for name in ("dense", "outliers8_int8", "m95_ap")}
    mine = {p.stem: json.loads(p.read_text()) for p in OUT.glob("*.json") if p.stem in ROWS}
    dense = sweep["dense"]["dense_eval_loss_after"]
    default = sweep["outliers8_int8"]
    rows = [
        ("Dense (sweep)", sweep["dense"], 2 * H),
        ("paper preset M95+AP (sweep)", sweep["m95_ap"], 29 * 2),
        ("default outliers8+int8 (sweep)", default, level_bytes("outliers8+int8")[0]),
    ]
    if "outliers8_int8_rerun" in mine:
        rows.append(("default outliers8+int8 (re-run here)", mine["outliers8_int8_rerun"], 586))
    if "governed" in mine:
        rows.append(("governed (default ladder and target)", mine["governed"], governed_bytes(mine["governed"])))
    lines = [
        f"Dense eval loss before training: {dense and sweep['dense']['dense_eval_loss_before']:.4f}",
        "",
        "| row | bf16 B/token/boundary over the run | fewer bytes than the default | measured fp32 B/token "
        "(3 boundaries, fwd + bwd) | dense eval loss after | gap to Dense | gap to the default | train s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, r, size in rows:
        after = r["dense_eval_loss_after"]
        measured = r.get("measured_boundary_bytes_per_token")
        lines.append(
            f"| {name} | {size:.0f} | {586 / size:.2f}× | {'–' if measured is None else f'{measured:.0f}'} | "
            f"{after:.4f} | {after / dense - 1:+.2%} | "
            f"{after / default['dense_eval_loss_after'] - 1:+.2%} | {r['train_runtime_s']:.0f} |"
        )
    if "governed" in mine:
        g = mine["governed"]["governor"]
        lines += [
            "",
            f"Governed: level switches (step applied, snapshot, levels per boundary; 0 = int3x8, 1 = int4x8, "
            f"2 = int8): {g['switches']}; {g['rounds']} anchor rounds, {g['probe_passes']} probe passes "
            f"({g['probe_passes'] / max(g['rounds'], 1):.1f} per round, each one forward/backward of the round's "
            "batch: the anchor's compute per round is 1 + that many dense passes).",
            "Measured: what the fp32 run's boundary messages held over the run (`comm/measured_pp_*`), per "
            "token summed over the 3 boundaries, forward and backward (the sweep's rows predate that log: –).",
        ]
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    run_rows(ROWS, argv or list(ROWS), OUT)
    text = table()
    (OUT / "governed.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
