"""Tables and plots of the quality benchmark from the run JSON: ``python -m benchmarks.quality.report``.

Writes ``results/<mode>/results.md`` and ``results/<mode>/*.png`` for every mode with results.
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.masking import keep_count

RESULTS = Path(__file__).resolve().parent / "results"
TASK_ORDER = ("arithmetic", "sql", "cpt", "choice")
METRIC_NAMES = {"exact_match": "EM", "execution_accuracy": "exec acc", "perplexity": "ppl", "accuracy": "MC acc"}


def _load(mode_dir: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(mode_dir.glob("*.json"))]


def _metric(run: dict) -> tuple[str, float]:
    name = next(k for k in run["metric"] if k in METRIC_NAMES)
    return name, run["metric"][name]


def _gap(value: float, dense: float, name: str) -> float:
    """Relative shortfall against Dense in %, positive = worse (perplexity: lower is better)."""
    if name == "perplexity":
        return 100.0 * (value - dense) / dense
    return 100.0 * (dense - value) / dense if dense else float("nan")


def _logs(run: dict, key: str) -> list[float]:
    return [h[key] for h in run["log_history"] if key in h]


def _mean_spread(values: list[float]) -> str:
    if len(values) == 1:
        return f"{values[0]:.3f}"
    return f"{statistics.mean(values):.3f} ± {(max(values) - min(values)) / 2:.3f}"


def _by(runs: list[dict], table: str) -> dict[tuple[str, str], list[dict]]:
    grouped = defaultdict(list)
    for run in runs:
        if run["spec"]["table"] == table:
            grouped[(run["spec"]["row"], run["spec"]["task"])].append(run)
    return grouped


ROW_ORDER = ("Dense", "M95", "M90+AP", "M95+AP")


def _rows_in_order(grouped) -> list[str]:
    rows = list(dict.fromkeys(row for row, _ in grouped))
    return sorted(rows, key=lambda row: ROW_ORDER.index(row) if row in ROW_ORDER else len(ROW_ORDER))


def table1(runs: list[dict]) -> list[str]:
    grouped = _by(runs, "table1")
    if not grouped:
        return []
    tasks = [t for t in TASK_ORDER if any(task == t for _, task in grouped)]
    dense = {
        t: statistics.mean(_metric(r)[1] for r in grouped.get(("Dense", t), []))
        for t in tasks
        if ("Dense", t) in grouped
    }
    seeds = sorted({r["spec"]["seed"] for rs in grouped.values() for r in rs})
    head = ["row"] + [f"{t} {METRIC_NAMES[_metric(grouped[(_rows_in_order(grouped)[0], t)][0])[0]]}" for t in tasks]
    lines = [
        f"Seeds {seeds}; mean ± half-range over seeds; (gap vs Dense, + = worse). Evaluated dense.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in _rows_in_order(grouped):
        cells = [row]
        for t in tasks:
            rs = grouped.get((row, t), [])
            if not rs:
                cells.append("–")
                continue
            name, _ = _metric(rs[0])
            values = [_metric(r)[1] for r in rs]
            gap = _gap(statistics.mean(values), dense[t], name) if t in dense and row != "Dense" else None
            cells.append(_mean_spread(values) + (f" ({gap:+.0f} %)" if gap is not None else ""))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def diagnostics(runs: list[dict], table: str) -> list[str]:
    grouped = _by(runs, table)
    if not grouped:
        return []
    lines = [
        "| row | task | metric | dense eval loss before → after | masked train loss (last) | cos(masked, anchor) | "
        "cos(filtered, anchor) | mean d | step s | optimizer s/step | anchor s/step |",
        "|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row, task in sorted(grouped, key=lambda key: (TASK_ORDER.index(key[1]), _rows_in_order(grouped).index(key[0]))):
        r = min(grouped[(row, task)], key=lambda r: r["spec"]["seed"])
        evals, train = _logs(r, "eval_loss"), _logs(r, "loss")
        cos_m = _logs(r, "spectral/cos_masked_vs_anchor")
        cos_f = _logs(r, "spectral/cos_filtered_vs_anchor")
        mean_d = _logs(r, "spectral/filter_mean_d")
        steps = max(1, r["timing"]["steps"])
        fmt = lambda xs: f"{statistics.mean(xs):.3f}" if xs else "–"  # noqa: E731
        lines.append(
            f"| {row} | {task} | {METRIC_NAMES[_metric(r)[0]]} {_metric(r)[1]:.3f} | "
            f"{r['eval_loss_before']:.3f} → {evals[-1]:.3f} | {train[-1]:.3f} | {fmt(cos_m)} | {fmt(cos_f)} | "
            f"{fmt(mean_d)} | {r['timing']['mean_step_s']:.3f} | {r['timing']['optimizer_s'] / steps:.4f} | "
            f"{r['timing']['anchor_s'] / steps:.4f} |"
        )
    return lines


def codecs(runs: list[dict]) -> list[str]:
    grouped = _by(runs, "codecs")
    if not grouped:
        return []
    t1 = _by(runs, "table1")
    seed = min(r["spec"]["seed"] for rs in grouped.values() for r in rs)
    tasks = [t for t in TASK_ORDER if any(task == t for _, task in grouped)]
    lines = ["| codec | fwd ratio | bwd ratio | " + " | ".join(tasks) + " |", "|---|---:|---:|" + "---:|" * len(tasks)]
    for row in _rows_in_order(grouped):
        r0 = next(iter(grouped[(row, t)][0] for t in tasks if (row, t) in grouped))
        wire = r0["codec_wire_bytes_per_token"]
        cells = [
            row,
            f"{wire['dense'] / wire['fwd']:.1f}× (run: {wire['dense'] / wire['booked_fwd']:.1f}×)",
            f"{wire['dense'] / wire['bwd']:.1f}× (run: {wire['dense'] / wire['booked_bwd']:.1f}×)",
        ]
        cells += [f"{_metric(grouped[(row, t)][0])[1]:.3f}" if (row, t) in grouped else "–" for t in tasks]
        lines.append("| " + " | ".join(cells) + " |")
    hidden = int(r0["codec_wire_bytes_per_token"]["dense"] // 2)
    for ref in ("Dense", "M95+AP", "M95"):
        ratio = "1×" if ref == "Dense" else f"{hidden / keep_count(hidden, 0.95):.1f}×"
        cells = [f"{ref} (seed {seed})", ratio, ratio]
        for t in tasks:
            rs = [r for r in t1.get((ref, t), []) if r["spec"]["seed"] == seed]
            cells.append(f"{_metric(rs[0])[1]:.3f}" if rs else "–")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def boundary_bf16_bytes(knobs: dict, hidden: int) -> float:
    """Formula bytes per real token and boundary on a bf16 wire, the mean of the forward and the backward
    message (they differ where the codec spells a backward apart), before lossless coding: a composed
    codec's records, else K values of a mask (the paper's p = 0.95 unless given; 2·H at 0)."""
    codec = knobs.get("boundary_codec")
    if codec is not None:
        return parse_codec(codec).round_trip_bytes(hidden, 2) / 2
    ratio = knobs.get("mask_ratio", 0.95)
    return 2 * hidden if ratio == 0.0 else keep_count(hidden, ratio) * 2


def row_bf16_bytes(runs: list[dict], hidden: int) -> float:
    """A row's bf16 bytes per token and boundary: the knobs' formula, or for a governed row the mean over its runs
    of the levels each step used (``governor.bf16_bytes_per_token_over_run``)."""
    governed = [r["governor"]["bf16_bytes_per_token_over_run"] for r in runs if "governor" in r]
    return statistics.mean(governed) if governed else boundary_bf16_bytes(runs[0]["spec"]["knobs"], hidden)


def _mean_final_eval_loss(runs: list[dict]) -> float:
    return statistics.mean(_logs(r, "eval_loss")[-1] for r in runs)


def paired_dense(rs: list[dict], dense: list[dict]) -> list[dict] | None:
    """Dense's runs of ``rs``'s seeds, or None where one is missing or fine-tuned another pretraining (not
    bit-exact across sessions: the eval loss before training tells the bases apart)."""
    by_seed = {r["spec"]["seed"]: r for r in dense}
    paired = [by_seed.get(r["spec"]["seed"]) for r in rs]
    if any(d is None or abs(d["eval_loss_before"] - r["eval_loss_before"]) > 1e-6 for d, r in zip(paired, rs)):
        return None
    return paired  # type: ignore[return-value]


def composed(runs: list[dict], table: str = "composed") -> list[str]:
    """The composed codec's sweep (or another table of composed-codec rows, e.g. ``payload``): each task's metric
    and dense eval loss, mean ± half-range over seeds, with the relative gap to the same table's Dense over the same
    seeds on the same base model (+ = worse; "other base" where they differ: not comparable, rerun)."""
    grouped = _by(runs, table)
    if ("Dense", TASK_ORDER[0]) not in grouped:
        return []
    hidden = next(iter(grouped.values()))[0]["ledger"]["hidden_size"]
    tasks = [t for t in TASK_ORDER if ("Dense", t) in grouped]
    head = ["row", "seeds", "bf16 B/token", "compression"]
    for t in tasks:
        head += [f"{t} {METRIC_NAMES[_metric(grouped[('Dense', t)][0])[0]]}", f"{t} eval loss"]
    lines = [
        ("Plain AdamW (no anchor)" if table == "composed" else "SpectralAdamW where +AP, anchor every 20 steps, Δ = 20")
        + f", H = {hidden} (dense bf16 {2 * hidden} B/token/boundary). Mean ± half-range over "
        "seeds; (relative gap to Dense over the same seeds, + = worse). Evaluated dense.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for row in dict.fromkeys(row for row, _ in grouped):
        size = round(row_bf16_bytes([r for (r_, _), rs in grouped.items() if r_ == row for r in rs], hidden))
        seeds = sorted({r["spec"]["seed"] for (r_, _), rs in grouped.items() if r_ == row for r in rs})
        label = row if row == "Dense" else f"`{row}`"
        cells = [label, ",".join(map(str, seeds)), str(size), f"{2 * hidden / size:.1f}×"]
        for t in tasks:
            rs = grouped.get((row, t), [])
            if not rs:
                cells += ["–", "–"]
                continue
            dense = paired_dense(rs, grouped[("Dense", t)])
            name = _metric(rs[0])[0]
            measures = ((lambda r: _metric(r)[1], name), (lambda r: _logs(r, "eval_loss")[-1], "perplexity"))
            for value_of, metric in measures:  # the eval loss gaps like a perplexity: lower is better
                values = [value_of(r) for r in rs]
                if row == "Dense":
                    gap = ""
                elif dense is None:
                    gap = " (other base)"
                else:
                    base = statistics.mean(value_of(r) for r in dense)
                    gap = f" ({_gap(statistics.mean(values), base, metric):+.1f} %)"
                cells.append(_mean_spread(values) + gap)
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def composed_plot(runs: list[dict], out: Path) -> list[str]:
    """Quality vs bytes: each task's dense eval loss gap to Dense (%, mean over seeds) against bf16 bytes per token
    and boundary, the paper's M95+AP of Table 1 beside it."""
    grouped = _by(runs, "composed")
    if ("Dense", TASK_ORDER[0]) not in grouped:
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    hidden = next(iter(grouped.values()))[0]["ledger"]["hidden_size"]
    paper = _by(runs, "table1")
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    for task in TASK_ORDER:
        if ("Dense", task) not in grouped:
            continue
        dense = grouped[("Dense", task)]
        rows = [rs for (row, t), rs in grouped.items() if t == task and row not in ("Dense", "governed")]
        rows += [paper[("M95+AP", task)]] if ("M95+AP", task) in paper else []
        points = sorted(  # the eval loss gaps like a perplexity: lower is better, over Dense's runs of the same seeds
            (row_bf16_bytes(rs, hidden), _gap(_mean_final_eval_loss(rs), _mean_final_eval_loss(pd), "perplexity"))
            for rs in rows
            if (pd := paired_dense(rs, dense)) is not None
        )
        line = ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=task)[0]
        governed = grouped.get(("governed", task), [])
        if governed and (pd := paired_dense(governed, dense)) is not None:  # a star in the task's colour
            gap = _gap(_mean_final_eval_loss(governed), _mean_final_eval_loss(pd), "perplexity")
            ax.plot([row_bf16_bytes(governed, hidden)], [gap], marker="*", markersize=12, color=line.get_color())
    ax.axhline(0.0, color="black", linewidth=0.8, label="Dense")
    ax.axhline(1.0, color="grey", linewidth=0.8, linestyle="--", label="+1 %")
    ax.set_xscale("log")
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_xlabel("bf16 bytes per token and boundary (log; dense = %d)" % (2 * hidden))
    ax.set_ylabel("dense eval loss gap to Dense (%)")
    ax.set_title("Tiny Llama: composed codecs (M95+AP at the left; ★ governed), paired seeds, same base", fontsize=9)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "composed_pareto.png", dpi=90)
    plt.close(fig)
    return ["composed_pareto.png"]


def ablations(runs: list[dict]) -> list[str]:
    grouped = _by(runs, "ablations")
    if not grouped:
        return []
    base = [
        r
        for r in runs
        if r["spec"]["table"] == "table1"
        and r["spec"]["row"] in ("M95+AP", "Dense")
        and r["spec"]["task"] == next(iter(grouped))[1]
        and r["spec"]["seed"] == 0
    ]
    lines = [
        "| setting | metric | dense eval loss | masked train loss | cos(filtered, anchor) | mean d |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in sorted(base, key=lambda r: r["spec"]["row"]) + [rs[0] for rs in grouped.values()]:
        label = r["spec"]["row"] if r["spec"]["table"] == "ablations" else f"{r['spec']['row']} (table 1)"
        cos, d = _logs(r, "spectral/cos_filtered_vs_anchor"), _logs(r, "spectral/filter_mean_d")
        lines.append(
            f"| {label} | {_metric(r)[1]:.3f} | {_logs(r, 'eval_loss')[-1]:.3f} | {_logs(r, 'loss')[-1]:.3f} | "
            f"{statistics.mean(cos) if cos else float('nan'):.3f} | {statistics.mean(d) if d else float('nan'):.3f} |"
        )
    return lines


def pruning(runs: list[dict]) -> list[str]:
    pruned = [r for r in runs if "pruned" in r]
    if not pruned:
        return []
    lines = [
        "| task | row | unpruned | "
        + " | ".join(f"{int(float(s) * 100)} % pruned (rel. drop)" for s in pruned[0]["pruned"])
        + " |",
        "|---|---|---:|" + "---:|" * len(pruned[0]["pruned"]),
    ]
    groups = defaultdict(list)
    for r in pruned:
        groups[(r["spec"]["task"], r["spec"]["row"])].append(r)
    for (task, row), rs in sorted(groups.items()):
        name, _ = _metric(rs[0])
        base = statistics.mean(_metric(r)[1] for r in rs)
        cells = [task, row, f"{base:.3f}"]
        for share in rs[0]["pruned"]:
            value = statistics.mean(r["pruned"][share][name] for r in rs)
            cells.append(f"{value:.3f} ({_gap(value, base, name):+.0f} %)" if base else f"{value:.3f}")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def overhead(runs: list[dict]) -> list[str]:
    """Per-step cost of the anchor prior: M95+AP against M95 (same masks, no anchor, no filter)."""
    grouped = _by(runs, "table1")
    lines = [
        "| task | M95 step s | M95+AP step s | overhead | optimizer s/step (M95 → M95+AP) | anchor gradient s/step |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for task in TASK_ORDER:
        if ("M95", task) not in grouped or ("M95+AP", task) not in grouped:
            continue
        plain, ap = (
            statistics.mean(r["timing"]["mean_step_s"] for r in grouped[(row, task)]) for row in ("M95", "M95+AP")
        )
        per_step = lambda row, key: statistics.mean(  # noqa: E731
            r["timing"][key] / max(1, r["timing"]["steps"]) for r in grouped[(row, task)]
        )
        lines.append(
            f"| {task} | {plain:.3f} | {ap:.3f} | {100 * (ap - plain) / plain:+.0f} % | "
            f"{per_step('M95', 'optimizer_s'):.4f} → {per_step('M95+AP', 'optimizer_s'):.4f} | "
            f"{per_step('M95+AP', 'anchor_s'):.4f} |"
        )
    return lines if len(lines) > 2 else []


def smollm2(probe_dir: Path = Path(__file__).resolve().parent / "smollm2_probe") -> list[str]:
    """Base model (a): the real SmolLM2-135M rows of smollm2_probe.py (GSM8K SFT, dense eval loss)."""
    names = {
        "dense": "Dense",
        "m95": "M95",
        "m90_ap": "M90+AP",
        "m95_ap": "M95+AP",
        "m95_ap_rescale": "M95+AP rescale",
        "m95_gaussian_fill": "M95 gaussian fill",
        "m95_ap_gaussian_fill": "M95+AP gaussian fill",
    }
    rows = {n: json.loads((probe_dir / f"{n}.json").read_text()) for n in names if (probe_dir / f"{n}.json").exists()}
    if "dense" not in rows:
        return []
    before = rows["dense"]["dense_eval_loss_before"]
    gain = before - rows["dense"]["dense_eval_loss_after"]
    lines = [
        f"SmolLM2-135M-Instruct, SFT on GSM8K (last 8 layers trainable, 60 steps, seed 0), dense eval loss "
        f"on 32 held-out items, before training {before:.3f}. Retained = share of Dense's improvement.",
        "",
        "| row | dense eval loss after | retained | masked train loss (last) |",
        "|---|---:|---:|---:|",
    ]
    for name, r in rows.items():
        after = r["dense_eval_loss_after"]
        lines.append(
            f"| {names[name]} | {after:.3f} | {100 * (before - after) / gain:.0f} % | "
            f"{r['masked_train_loss_last_log']:.2f} |"
        )
    return lines


def plots(runs: list[dict], out: Path) -> list[str]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    written = []
    for table in ("table1", "variants", "codecs", "ablations"):
        grouped = _by(runs, table)
        tasks = [t for t in TASK_ORDER if any(task == t for _, task in grouped)]
        if not tasks:
            continue
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            for row in _rows_in_order(grouped):
                for r in grouped.get((row, task), [])[:1]:
                    steps = [h["step"] for h in r["log_history"] if "eval_loss" in h]
                    ax.plot(steps, _logs(r, "eval_loss"), label=row)
            ax.set_title(f"{task}: dense eval loss (seed 0)")
            ax.set_xlabel("step")
        axes[0][-1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / f"{table}_eval_loss.png", dpi=80)
        plt.close(fig)
        written.append(f"{table}_eval_loss.png")
        fig, axes = plt.subplots(1, len(tasks), figsize=(4.5 * len(tasks), 3.6), squeeze=False)
        for ax, task in zip(axes[0], tasks):
            rows = [row for row in _rows_in_order(grouped) if (row, task) in grouped]
            values = [statistics.mean(_metric(r)[1] for r in grouped[(row, task)]) for row in rows]
            ax.bar(range(len(rows)), values)
            ax.set_xticks(range(len(rows)), rows, rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{task}: {METRIC_NAMES[_metric(grouped[(rows[0], task)][0])[0]]}")
        fig.tight_layout()
        fig.savefig(out / f"{table}_metrics.png", dpi=80)
        plt.close(fig)
        written.append(f"{table}_metrics.png")
    return written


def write_report(root: Path = RESULTS) -> None:
    for mode_dir in sorted(p for p in root.iterdir() if p.is_dir()):
        runs = _load(mode_dir)
        if not runs:
            continue
        mode = runs[0]["mode"]
        total = sum(r["train_s"] for r in runs)
        sections = [
            f"# Quality benchmark, mode `{mode_dir.name}`",
            "",
            f"Tiny Llama (pretrain.py), {mode['steps']} steps × batch {mode['batch_size']} × ≤{mode['seq_len']} "
            f"tokens, lr {mode['learning_rate']} cosine, Y = 4 (3 boundaries), anchor every 20 with Δ = 20. "
            f"{len(runs)} runs, {total / 60:.0f} min of training.",
            "",
        ]
        for title, lines in (
            ("Table 1: Dense vs masked", table1(runs)),
            ("Table 1 diagnostics (seed 0)", diagnostics(runs, "table1")),
            ("Variants of the masked method (seed 0)", diagnostics(runs, "variants")),
            ("Table 2: boundary codecs (seed 0)", codecs(runs)),
            ("Composed boundary codec: quality vs bytes", composed(runs)),
            ("What the anchor sends: its gradient vs its momentum's rank-8 factors", composed(runs, "payload")),
            ("Ablations (arithmetic, seed 0)", ablations(runs)),
            ("Pruning robustness", pruning(runs)),
            ("Anchor prior overhead per step", overhead(runs)),
            ("Base model (a): SmolLM2-135M", smollm2()),
        ):
            if lines:
                sections += [f"## {title}", "", *lines, ""]
        sections += [f"![{name}]({name})" for name in plots(runs, mode_dir) + composed_plot(runs, mode_dir)]
        (mode_dir / "results.md").write_text("\n".join(sections) + "\n")


if __name__ == "__main__":
    write_report()
