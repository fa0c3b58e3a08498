"""Does the anchor's fidelity signal predict what a codec costs in quality? SmolLM2, codec by codec.

The governor (``boundary_codec="governed"``) picks levels by the gradient cosine the anchor measures
(``hf_meshtune.anchor.fidelity``). Here the same measurement (``AnchorCircuit.measure_ladder``, the
code a governed run uses) runs on the main job's model and data (SmolLM2-135M-Instruct, the last 8
layers trainable, Y = 4, batches of 4 × 192 GSM8K tokens) at the pretrained start, for every composed
codec whose 60-step fine-tune the codec sweep measured without the anchor prior, and is set beside
that sweep's final dense-eval gap to Dense (``codec_sweep/<row>.json``, seed 0). Reported: per codec and
boundary the cosine, the activation and activation-gradient errors (mean over ``ROUNDS`` anchor
batches), and the Spearman rank correlation of (1 − mean cos) with the gap.

The same on the quality benchmark's second model, the tiny Llama, per task, against the composed
table's 150-step gaps (``results/standard/composed__*``), pooled over tasks and per task.

    python -m benchmarks.quality.fidelity_probe        # SmolLM2, ~7 min on 2 CPU cores
    python -m benchmarks.quality.fidelity_probe tiny   # tiny Llama, ~2 min (after its pretraining)

Writes benchmarks/quality/fidelity/probe.{json,md} and probe_tiny.{json,md}.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path

import torch
from transformers import DataCollatorForSeq2Seq

from hf_meshtune._validation import require
from hf_meshtune.anchor.batches import AnchorBatches
from hf_meshtune.anchor.circuit import AnchorCircuit
from hf_meshtune.anchor.governor import FidelityGovernor
from hf_meshtune.apps.assets import load_smollm2
from hf_meshtune.apps.demo import freeze_all_but_last, gsm8k_splits
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.compose.handle import attach_composed

HERE = Path(__file__).resolve().parent
SWEEP, OUT = HERE / "codec_sweep", HERE / "fidelity"
ROUNDS = 3
# codec sweep rows without the anchor prior (seed 0) → their codec
ROWS = {
    "outliers8_spca226_int4": "outliers8+spca226+int4",
    "outliers8_int3": "outliers8+int3",
    "outliers8_int3g71": "outliers8+int3g71",
    "outliers8_pca512_int4g64": "outliers8+pca512+int4g64",
    "outliers8_int4": "outliers8+int4",
    "outliers8_int4g71": "outliers8+int4g71",
    "outliers8_int8": "outliers8+int8",
}


def ranks(values: list[float]) -> list[float]:
    """Average ranks (1-based), ties sharing the mean of their positions."""
    order = sorted(range(len(values)), key=lambda i: values[i])
    out = [0.0] * len(values)
    i = 0
    while i < len(order):
        j = i
        while j + 1 < len(order) and values[order[j + 1]] == values[order[i]]:
            j += 1
        for k in range(i, j + 1):
            out[order[k]] = (i + j) / 2 + 1
        i = j + 1
    return out


def spearman(a: list[float], b: list[float]) -> float:
    ra, rb = ranks(a), ranks(b)
    ma, mb = sum(ra) / len(ra), sum(rb) / len(rb)
    cov = sum((x - ma) * (y - mb) for x, y in zip(ra, rb))
    return cov / math.sqrt(sum((x - ma) ** 2 for x in ra) * sum((y - mb) ** 2 for y in rb))


def probe(model, train, collator, codecs, batch_size: int, stages: int = 4) -> dict:
    """Fidelity of every codec in ``codecs`` at every boundary of ``model`` (its trainable matrices), the mean
    of ``ROUNDS`` anchor batches of ``train``: the measurement a governed run makes (``measure_ladder``)."""
    started = time.time()
    hidden = model.config.hidden_size
    specs = sorted((parse_codec(c) for c in codecs), key=lambda s: s.payload_bytes(hidden, 2))
    handle = attach_composed(model, stages, specs[-1], seed=0, ladder=specs)
    batches = AnchorBatches(train, collator, batch_size, 1, seed=0)
    handle.calibrate(model, {k: v for k, v in batches(0)[0].items() if k != "labels"})
    params = {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2}
    circuit = AnchorCircuit(
        model,
        params,
        handle,
        every=1,
        delay=0,
        batches=batches,
        loss_fn=lambda m, batch: m(**batch).loss,
        governor=FidelityGovernor(len(specs), 0.9),
        feed=False,
    )
    rounds = []
    for r in range(ROUNDS):
        t0 = time.time()
        rounds.append(circuit.measure_ladder(r))
        print(f"round {r}: {time.time() - t0:.0f} s", flush=True)
    per_codec = {}
    for level, spec in enumerate(specs):
        per_boundary = []
        for b in range(len(handle.ladders)):
            keys = ("cos", "act_err", "grad_err")
            per_boundary.append({k: sum(rd[b][level][k] for rd in rounds) / ROUNDS for k in keys})
        per_codec[spec.text] = {"bf16_bytes_per_token": spec.payload_bytes(hidden, 2), "boundaries": per_boundary}
    return {
        "rounds": ROUNDS,
        "probe_passes": circuit.probe_passes,
        "seconds": time.time() - started,
        "codecs": per_codec,
    }


def measure() -> dict:
    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    model.train()
    freeze_all_but_last(model, 8)
    train, _ = gsm8k_splits(tokenizer, 192, 32)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    return probe(model, train, collator, ROWS.values(), 4)


def report(result: dict) -> str:
    dense = json.loads((SWEEP / "dense.json").read_text())["dense_eval_loss_after"]
    lines = [
        f"Fidelity at the pretrained start (mean of {result['rounds']} anchor batches) beside the final gap of the "
        "60-step fine-tune with that codec (`codec_sweep`, no anchor prior, seed 0).",
        "",
        "| codec | bf16 B/token | cos b0 | cos b1 | cos b2 | mean cos | act err (mean) | grad err b2 | final gap |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    xs, mins, gaps = [], [], []
    for row, codec in ROWS.items():
        entry = result["codecs"][codec]
        cos = [b["cos"] for b in entry["boundaries"]]
        act = sum(b["act_err"] for b in entry["boundaries"]) / len(cos)
        gap = json.loads((SWEEP / f"{row}.json").read_text())["dense_eval_loss_after"] / dense - 1
        mean = sum(cos) / len(cos)
        xs.append(1 - mean)
        mins.append(1 - min(cos))
        gaps.append(gap)
        entry.update({"mean_cos": mean, "final_gap": gap, "sweep_row": row})
        lines.append(
            f"| `{codec}` | {entry['bf16_bytes_per_token']} | "
            + " | ".join(f"{c:.4f}" for c in cos)
            + f" | {mean:.4f} | {act:.4f} | {entry['boundaries'][-1]['grad_err']:.4f} | {gap:+.1%} |"
        )
    result["spearman_mean_cos_vs_gap"] = spearman(xs, gaps)
    result["spearman_min_cos_vs_gap"] = spearman(mins, gaps)
    lines += [
        "",
        f"Spearman rank correlation of (1 − mean cos) with the final gap: {result['spearman_mean_cos_vs_gap']:.3f} "
        f"(of 1 − min over boundaries: {result['spearman_min_cos_vs_gap']:.3f}), {len(gaps)} codecs.",
        f"Probe passes: {result['probe_passes']} (each one forward/backward of a 4 × 192 batch); "
        f"{result['seconds']:.0f} s in all.",
    ]
    return "\n".join(lines) + "\n"


# the tiny Llama's composed rows (benchmarks/quality/run.py, table "composed", standard mode, seed 0) → their codec
TINY_ROWS = {
    "outliers8_spca32_int4": "outliers8+spca32+int4",
    "outliers8_spca64_int4": "outliers8+spca64+int4",
    "outliers8_int4x8": "outliers8+int4x8",
    "outliers8_rot_int4g64e8m0_zstd": "outliers8+rot+int4g64e8m0+zstd",
    "outliers8_int8": "outliers8+int8",
}


def _tiny_final_eval_loss(row: str, task: str) -> float | None:
    """The composed table's seed-0 run of ``row`` on ``task``: its final dense eval loss, or None where that run
    fine-tuned another base model than Dense's run (the tiny Llama's pretraining is not bit-exact across machines:
    the eval loss before training tells the bases apart: the composed table's own rule, ``report.paired_dense``)
    and so cannot be compared with it."""
    from .report import paired_dense
    from .run import RESULTS

    def load(name: str) -> dict:
        return json.loads((RESULTS / "standard" / f"composed__{name}__{task}__seed0.json").read_text())

    run = load(row)
    if paired_dense([run], [load("Dense")]) is None:
        return None
    return [h["eval_loss"] for h in run["log_history"] if "eval_loss" in h][-1]


def measure_tiny() -> dict:
    """The same measurement on the tiny Llama (all parameters trainable, Y = 4, batches of 8), per task at the
    pretrained start, beside the composed table's final gaps."""
    from .pretrain import load_tiny_llama
    from .run import MODES, TASK_NAMES, _datasets, build_task

    mode = MODES["standard"]
    out = {}
    for task_name in TASK_NAMES:
        torch.manual_seed(0)
        model, tokenizer = load_tiny_llama()
        model.train()
        train, _ = _datasets(build_task(task_name, mode), tokenizer, mode)
        collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
        out[task_name] = probe(model, train, collator, TINY_ROWS.values(), mode.batch_size)
    return {"tasks": out}


def report_tiny(result: dict) -> str:
    lines = [
        f"Tiny Llama: fidelity at the pretrained start (mean of {ROUNDS} anchor batches per task) beside the final "
        "dense-eval-loss gap of the 150-step fine-tune with that codec (`results/standard`, composed table, "
        "seed 0, no anchor).",
        "",
        "| task | codec | bf16 B/token | cos b0 | cos b1 | cos b2 | mean cos | final gap |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    xs, gaps, per_task, other_base = [], [], {}, []
    for task, measured in result["tasks"].items():
        dense = _tiny_final_eval_loss("Dense", task)
        assert dense is not None
        tx, tg = [], []
        for row, codec in TINY_ROWS.items():
            entry = measured["codecs"][codec]
            cos = [b["cos"] for b in entry["boundaries"]]
            mean = sum(cos) / len(cos)
            final = _tiny_final_eval_loss(row, task)
            if final is None:  # fine-tuned from another base model than Dense's run: not comparable
                other_base.append(f"`{codec}` on {task}")
                continue
            gap = final / dense - 1
            entry.update({"mean_cos": mean, "final_gap": gap, "composed_row": row})
            tx.append(1 - mean)
            tg.append(gap)
            lines.append(
                f"| {task} | `{codec}` | {entry['bf16_bytes_per_token']} | "
                + " | ".join(f"{c:.4f}" for c in cos)
                + f" | {mean:.4f} | {gap:+.2%} |"
            )
        per_task[task] = spearman(tx, tg)
        xs += tx
        gaps += tg
    pooled = spearman(xs, gaps)
    passes = sum(m["probe_passes"] for m in result["tasks"].values())
    seconds = sum(m["seconds"] for m in result["tasks"].values())
    if other_base:
        left_out = ", ".join(other_base)
        lines += ["", f"Left out (their run fine-tuned another base model than Dense's: rerun): {left_out}."]
    lines += [
        "",
        f"Spearman rank correlation of (1 − mean cos) with the final gap, pooled over {len(gaps)} (task, codec) "
        f"pairs: {pooled:.3f}; per task: " + ", ".join(f"{t} {v:.3f}" for t, v in per_task.items()) + ".",
        f"Probe passes: {passes} (each one forward/backward of a batch of 8); {seconds:.0f} s in all.",
    ]
    result.update({"spearman_pooled": pooled, "spearman_per_task": per_task})
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    if argv == ["tiny"]:
        result = measure_tiny()
        text = report_tiny(result)
        name = "probe_tiny"
    else:
        require(not argv, "arguments", argv, "be none (SmolLM2) or 'tiny' (the tiny Llama)")
        result = measure()
        text = report(result)
        name = "probe"
    (OUT / f"{name}.json").write_text(json.dumps(result, indent=2))
    (OUT / f"{name}.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main(sys.argv[1:])
