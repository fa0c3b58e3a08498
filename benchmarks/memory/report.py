"""The memory benchmark's tables (benchmarks/memory/results/memory.md), rewritten from memory.json alone.

python -m benchmarks.memory.report benchmarks/memory/results/memory.json
"""

from __future__ import annotations

import json
import sys

from hf_meshtune.report import mesh_memory_table


def summary_table(results: dict[str, dict]) -> list[str]:
    lines = [
        "| row | code | processes | peak RSS per process, max (GiB) | all processes at once (sum of PSS), peak (GiB) | "
        "step s | eval loss |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, row in results.items():
        if "failed" in row:
            reason = row["failed"].splitlines()[0].replace("|", "/")
            lines.append(f"| {name} | {row['code']} | – | – | – | – | failed: {reason} |")
            continue
        peaks = row["sampled_peak_gib"]
        step, loss = row.get("step_seconds_mean"), row.get("eval_loss")
        lines.append(
            f"| {name} | {row['code']} | {len(peaks)} | {max(peaks):.2f} | {row['sampled_total_peak_gib']:.2f} | "
            f"{'–' if step is None else f'{step:.1f}'} | {'–' if loss is None else f'{loss:.4f}'} |"
        )
    return lines


def markdown(results: dict[str, dict]) -> str:
    lines = summary_table(results)
    lines += ["", "GiB per process, measured (the memory ledger's prediction), peak RSS from getrusage:", ""]
    lines += [line for name, row in results.items() for line in mesh_memory_table(name, row)]
    return "\n".join(lines) + "\n"


def write_markdown(results: dict[str, dict], path: str) -> None:
    with open(path, "w") as handle:
        handle.write(markdown(results))


if __name__ == "__main__":
    print(markdown(json.load(open(sys.argv[1]))), end="")
