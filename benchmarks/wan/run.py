"""WAN benchmark: every row fine-tunes the same pretrained model on the same mesh over emulated internet links.

    sudo .venv/bin/python -m benchmarks.wan.run            # ≈ 65 min on 2 idle cores; results/wan.{json,md} + plots
    sudo .venv/bin/python -m benchmarks.wan.run --report   # tables and plots again from results/wan.json
    sudo .venv/bin/python -m benchmarks.wan.run --smoke    # a few steps per run, report under WORK/results

Model and task (``rows.py``): the quality benchmark's pretrained tiny Llama (8 layers, H = 256, 7.4M
parameters, 8.4M with its embeddings untied across the two stages; ``benchmarks/quality/pretrain.py``)
fine-tuned on its arithmetic word problems (loss on the answer tokens; metric: exact match of the
number after ``####``, greedy generation), from the same weights, on the same examples in the same
order, in every row.

Phases (each row runs as 6 or 8 real processes, one network namespace per node, see ``netns.py``):

1. **Compute-bound runs** (links at 10 Gbit/s, no delay): the synchronous rows (Dense, +DP, the default
   codec, the ~20x codec and the peers) train ``--steps`` steps. Their loss per step does not depend on
   link timing (every sync is a blocking collective), so these runs give their quality curves, and
   Dense's run gives the compute-bound step time τ and the bytes Dense puts on its busiest link per
   step. The rows with an anchor run a short window here (their compute-bound throughput).
2. **Regime.** On the paper's mesh Dense runs 44.5× slower than the link-free M95 (1.1k vs 48.9k
   tokens/s at 200 Mbit/s): its links take 44.5 times its compute. These CPUs compute thousands of
   times slower than the paper's GPUs, so at 200 Mbit/s every row would be compute-bound. The link
   rate is scaled so that Dense's busiest link again needs 44.5 τ per step:
   R = Dense bytes per step on its busiest link / (44.5 τ); scale = R / 200 Mbit/s. Latency is scaled
   with time: one-way D = 20 ms × τ / τ_paper, τ_paper = 65,536 tokens / 48.9k tokens/s.
3. **Shaped runs** (rate R, delay D): the rows with an anchor (M95+AP, Default+AP, Governed) train
   ``--steps`` steps there (the anchor is asynchronous, so its staleness, and hence their quality,
   depends on the links); the synchronous rows run a short timing window.
4. **Unscaled run:** Dense, M95+AP and the default codec at the paper's 200 Mbit/s (and 20 ms) on these CPUs.

After each quality run the dense model of fast replica 0 is evaluated: held-out loss at every saved
step (and step 0, the pretrained model), exact match on the first ``--eval-items`` (100) items of the
eval split at the last step. A shaped run with the gradient payload lasts longer than its steps: the
fast replicas wait at the end for the anchor rounds still on the links (a few minutes at rate R).
Figures per row: steady-state tokens/s (median over windows after warm-up), bytes per fast token per
circuit from the Wire (and the kernel's interface counters), speedup over Dense, time-to-quality
= (steps to reach Dense's final eval loss) × steady-state shaped step time, and the speedup at the
row's own final loss.

``wan.json`` is written after every run (a killed run keeps what finished, ``"complete": false``), and
a rerun with the same ``--work`` skips every run whose records are there with the same settings.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import platform
import shutil
import statistics
import time
from pathlib import Path

import torch

from hf_meshtune.apps.assets import cache_dir

from . import netns
from .mesh import run_row
from .rows import ROWS, Shape, build_model, build_task, prepare_data

RESULTS = Path(__file__).resolve().parent / "results"
PAPER = {
    "rate_mbit": 200.0,
    "dense_over_compute": 48.9 / 1.1,
    "tokens_per_step": 32 * 2048,
    "m95_tokens_s": 48_900.0,
    "delay_ms": 20.0,
    "tokens_s": {"dense": 1_100, "dp": 3_600, "m95": 48_900, "m90_ap": 27_800, "m95_ap": 46_500},
    "bytes_per_token": {"dense": 22_900, "dp": 6_900, "m95": 370, "m90_ap": 790, "m95_ap": 446},
}
SYNC_ROWS = ["dense", "dp", "default", "codec20", "torchft_diloco", "powersgd_hook", "int8_dense_dp"]
ANCHOR_ROWS = ["m95_ap", "default_ap", "governed"]
# timing windows: per-step DP rows time every step (Dense's all-reduce costs the same from its first step on:
# warm-up 1; the PowerSGD hook's first 2 steps all-reduce densely: warm-up 3); DiLoCo rows: the median over
# windows of one fragment period (10 steps) after a warm-up of 3
TIMING_STEPS = {
    "dense": 3,
    "int8_dense_dp": 3,
    "powersgd_hook": 8,
    **dict.fromkeys(["dp", "default", "codec20", "torchft_diloco", "m95_ap", "default_ap", "governed"], 23),
}
UNSCALED_ROWS = ["dense", "m95_ap", "default"]
COMPUTE_LINKS = {"rate_mbit": 10_000.0, "delay_ms": 0.0}


# ---------------------------------------------------------------------------------------------------
# Reading one run
# ---------------------------------------------------------------------------------------------------
# Every frame on the emulated links is TCP over IPv4 with timestamps (Linux's default): 14 (Ethernet) + 20 (IP)
# + 32 (TCP with the 12-byte timestamp option) bytes of headers each, a pure ACK being nothing else. veth hands
# segmentation-offloaded super-frames to its counters as one packet with one set of headers, so headers =
# packets × 66 holds for the counters as they count.
FRAME_HEADER_BYTES = 14 + 20 + 32


def kernel_check(record: dict) -> dict:
    """One process's interface counters against its Wire: what it sent on eth0, the frame headers in it
    (``FRAME_HEADER_BYTES`` per packet, ACKs included), the payload left, and the Wire's bytes (measured sends,
    the calibration pass among them, plus booked all-reduces). The rest (payload − wire) is what no Wire sees:
    gloo's message framing, torchft's quorum and heartbeat calls, the stores."""
    wire = sum(record["wire"]["sent"].values()) + sum(record["wire"]["booked"].values())
    headers = FRAME_HEADER_BYTES * record["tx_packets"]
    payload = record["tx_bytes"] - headers
    check = {
        "rank": record["rank"],
        "tx_bytes": record["tx_bytes"],
        "tx_packets": record["tx_packets"],
        "headers": headers,
        "payload": payload,
        "wire": wire,
        "payload_over_wire": payload / wire if wire else None,
    }
    if "tx_low_bytes" in record:  # runs recorded before the links had a low-priority class lack it
        # what the low-priority class sent (the DiLoCo sync's packets with dp_low_priority, else nothing) against the
        # Wire's DP bytes
        low = record["tx_low_bytes"] - FRAME_HEADER_BYTES * record["tx_low_packets"]
        dp = record["wire"]["sent"].get("dp", 0) + record["wire"]["booked"].get("dp", 0)
        check |= {"low_priority_payload": low, "dp_wire": dp, "low_over_dp": low / dp if dp else None}
    return check


def _extremes(values: list) -> list | None:
    known = [v for v in values if v is not None]
    return [min(known), max(known)] if known else None


def read_run(out: str, row_name: str) -> dict:
    """Aggregate one run's rank records: tokens/s, bytes per fast token per circuit, staleness."""
    row, shape = ROWS[row_name], Shape()
    ranks = [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in range(row.replicas * shape.stages)]
    fast = [r for r in ranks if r["role"] == "fast"]
    steps = min(r["steps"] for r in fast)
    # the tokens the fast replicas' wire carried (each row up to its last label: the mesh counts them since the
    # variable-size wire; records from before it counted every padded position, which was what it carried then)
    fast_tokens = sum(r["tokens"] for r in fast if r["stage"] == 0)
    tokens_per_step = fast_tokens / max(steps, 1)
    # measured sends + booked all-reduces (2(n-1)/n × the tensor bytes), checked against the kernel's counter
    # below; the codecs' one-off calibration pass (a dense forward before step 1) is counted apart
    calibration = sum(r.get("calibration_bytes", 0.0) for r in ranks)
    circuits = {
        c: sum(r["wire"]["sent"][c] + r["wire"]["booked"][c] for r in ranks) / fast_tokens
        for c in ("pp_fwd", "pp_bwd", "dp", "anchor")
    }
    circuits["pp_fwd"] -= calibration / fast_tokens
    circuits["total"] = sum(circuits.values())
    kernel = sum(r["tx_bytes"] for r in ranks) / fast_tokens
    per_process = [kernel_check(r) for r in ranks]
    # the mesh's time per step: the slowest fast rank's (they move in lockstep through the pipeline)
    per_step = [max(r["step_seconds"][i] for r in fast) for i in range(steps)]
    warm = max(3, steps // 10) if steps > 10 else 2
    if row.dp_mode == "allreduce" and steps <= 10:
        warm = 1  # the same all-reduce every step: only the first pays for the links' start-up
    if row.dp_mode == "powersgd_hook":
        warm = max(warm, 3)  # torch's hook all-reduces densely for its first start_powerSGD_iter steps
    period = (row.sync_every or shape.sync_every) // shape.fragments
    # a per-step DP peer costs the same every step; DiLoCo's syncs land every `period` steps: whole periods
    window = period if row.dp_mode == "streaming_diloco" and steps - warm >= 2 * period else 1
    timed = per_step[warm:]
    windows = [sum(timed[i : i + window]) / window for i in range(0, len(timed) - window + 1, window)]
    step_s = statistics.median(windows)
    # anchor deliveries that training used: those that landed before the last step (the rest arrive while the
    # run drains its links at the end)
    arrivals = [a for r in fast for a in r["arrivals"] if r["replica"] == 0 and r["stage"] == 0]
    staleness = [s - snap for s, snap in arrivals if s < steps]
    busiest = max(r["tx_bytes"] for r in ranks) / steps
    return {
        "row": row_name,
        "label": row.label,
        "steps": steps,
        "tokens_per_step": tokens_per_step,
        "step_seconds": step_s,
        "tokens_per_s": tokens_per_step / step_s,
        "window_steps": window,
        "warmup_steps": warm,
        "bytes_per_token": circuits,
        "kernel_bytes_per_token": kernel,
        "kernel_per_process": per_process,
        "kernel_payload_over_wire": _extremes([p["payload_over_wire"] for p in per_process]),
        "calibration_bytes": calibration,
        "busiest_link_bytes_per_step": busiest,
        "anchor_deliveries": len(staleness),
        "staleness_mean": statistics.fmean(staleness) if staleness else None,
        "staleness_max": max(staleness) if staleness else None,
        "losses": [statistics.fmean(r["losses"][i] for r in fast if r["losses"]) for i in range(steps)],
    }


# ---------------------------------------------------------------------------------------------------
# Evaluation (the dense model of fast replica 0)
# ---------------------------------------------------------------------------------------------------
@torch.no_grad()
def eval_loss(model, data: dict, batch_size: int = 32) -> float:
    """Mean NLL per answer token over the held-out items (prompt and padding excluded, as in training)."""
    model.eval()
    ids, labels = data["eval_ids"], data["eval_labels"]
    total, count = 0.0, 0
    for i in range(0, len(ids), batch_size):
        logits = model(input_ids=ids[i : i + batch_size]).logits[:, :-1].float()
        target = labels[i : i + batch_size, 1:]
        total += torch.nn.functional.cross_entropy(
            logits.transpose(1, 2), target, ignore_index=-100, reduction="sum"
        ).item()
        count += int((target != -100).sum())
    return total / count


def exact_match(model, data: dict, eval_items: int) -> dict:
    """The quality benchmark's arithmetic metric (``benchmarks.quality.evaluate.task_metric``, in one batch):
    greedy generation on the first ``eval_items`` eval items, exact match of the number after ``####``."""
    from transformers import PreTrainedTokenizerFast

    from benchmarks.quality.evaluate import generate

    task = build_task(Shape())
    items = task.eval[:eval_items]
    tokenizer = PreTrainedTokenizerFast.from_pretrained(data["tokenizer"])
    started = time.perf_counter()
    # one batch: the decode steps, not the rows, cost on these cores
    generated = generate(model, tokenizer, [it.prompt for it in items], task.max_new_tokens, batch_size=len(items))
    correct = [task.score(item, text) for item, text in zip(items, generated)]
    return {"exact_match": sum(correct) / len(correct), "items": eval_items, "samples": generated[:3],
            "seconds": time.perf_counter() - started}  # fmt: skip


def cpu_machine() -> dict:
    """The machine a CPU benchmark ran on, as its report records it."""
    return {"cpus": os.cpu_count(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d")}


def generated_by(module: str, report: dict) -> str:
    """The opening of a CPU benchmark's report: which command, on what, when (``cpu_machine``)."""
    m = report["machine"]
    return f"Generated by `python -m benchmarks.wan.{module}` on {m['cpus']} CPUs ({m['date']}, torch {m['torch']})"


def final_loss(ev: dict) -> float:
    """The held-out loss at the last saved step of an ``evaluate`` result."""
    return ev["eval_loss"][str(ev["final_step"])]


def evaluate(out: str, data: dict, eval_items: int) -> dict:
    """Held-out loss at step 0 and every saved step; exact match at the last saved step. Cached in OUT/eval.json."""
    cached = os.path.join(out, "eval.json")
    if os.path.exists(cached):
        saved = json.loads(open(cached).read())
        if saved.get("items") == eval_items:
            return saved
    shape = Shape()
    model = build_model(data)
    curve = {0: eval_loss(model, data)}
    params = os.path.join(out, "params")
    steps = sorted({int(name[4:9]) for name in os.listdir(params)}) if os.path.isdir(params) else []
    for step in steps:
        state = {}
        for stage in range(shape.stages):
            state.update(torch.load(os.path.join(params, f"step{step:05d}_stage{stage}.pt")))
        missing = set(model.state_dict()) - set(state)
        if missing - {"model.rotary_emb.inv_freq"}:
            raise RuntimeError(f"{out}: step {step} lacks {sorted(missing)[:3]}")
        model.load_state_dict(state, strict=False)
        curve[step] = eval_loss(model, data)
    result = {"eval_loss": {str(k): v for k, v in curve.items()}, "final_step": max(curve)}
    result |= exact_match(model, data, eval_items)
    Path(cached).write_text(json.dumps(result, indent=1))
    return result


# ---------------------------------------------------------------------------------------------------
# The run
# ---------------------------------------------------------------------------------------------------
def source_digest() -> str:
    """A digest of the code a run executes (the library's source and this benchmark's worker): a cached run that
    other code made is not kept (its settings alone would not say so)."""
    import hf_meshtune

    library = Path(hf_meshtune.__file__).parent
    digest = hashlib.sha256()
    for path in sorted(library.rglob("*.py")):
        digest.update(str(path.relative_to(library)).encode() + b"\0" + path.read_bytes())
    digest.update(Path(__file__).with_name("worker.py").read_bytes())
    return digest.hexdigest()[:16]


def _finished(out: Path, row: str, meta: dict) -> bool:
    """Whether ``out`` holds this run's complete records, made with the same settings."""
    try:
        saved = json.loads((out / "meta.json").read_text())
    except (FileNotFoundError, json.JSONDecodeError):
        return False
    world = ROWS[row].replicas * Shape().stages
    same = {k: v for k, v in saved.items() if k != "wall_seconds"} == meta
    return same and all((out / f"rank{r}.json").exists() for r in range(world))


def _run(phase: str, row: str, work: Path, data_path: str, steps: int, save_every: int, links: dict) -> dict:
    """One run of ``row`` (or its records from an earlier run with the same settings); a failed row is
    recorded with its error (a row the mesh refuses does not end the benchmark), except Dense."""
    out = work / phase / row
    meta = json.loads(
        json.dumps(
            {
                "steps": steps,
                "save_every": save_every,
                "links": links,
                "shape": dataclasses.asdict(Shape()),
                "row": dataclasses.asdict(ROWS[row]),
                "code": source_digest(),
            }  # fmt: skip
        )
    )
    if _finished(out, row, meta):
        wall = json.loads((out / "meta.json").read_text())["wall_seconds"]
        print(f"[wan] {phase}: {row}: kept from an earlier run ({out})", flush=True)
    else:
        print(f"[wan] {phase}: {row} for {steps} steps", flush=True)
        shutil.rmtree(out, ignore_errors=True)
        try:
            wall = run_row(row, str(out), data_path, steps, save_every=save_every, timeout_s=3600.0)
        except RuntimeError as err:
            if row == "dense":
                raise
            print(f"[wan]   FAILED: {err}", flush=True)
            return {"row": row, "label": ROWS[row].label, "error": _log_tail(str(err), out)}
        (out / "meta.json").write_text(json.dumps(meta | {"wall_seconds": wall}, indent=1))
    result = read_run(str(out), row) | {"wall_seconds": wall}
    print(
        f"[wan]   {result['step_seconds']:.3f} s/step, {result['tokens_per_s']:.0f} tokens/s, "
        f"{result['bytes_per_token']['total']:.0f} B/token, {wall:.0f} s",
        flush=True,
    )
    return result


def _log_tail(error: str, out: Path) -> str:
    """The error and the last line of the failed rank's log that names an error (the refusal's message)."""
    for rank in range(8):
        log = out / f"rank{rank}.log"
        if log.exists():
            lines = [line for line in log.read_text(errors="replace").splitlines() if "Error" in line]
            if lines:
                return f"{error}: {lines[-1][:400]}"
    return error


def _save(report: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / "wan.json.tmp"
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, out / "wan.json")


def load_data(work: Path) -> tuple[str, dict]:
    """(path, contents) of WORK/data.pt, the token data every run reads; prepared again when missing or made
    for another ``Shape``."""
    work.mkdir(parents=True, exist_ok=True)
    path = str(work / "data.pt")
    data = torch.load(path) if os.path.exists(path) else None
    if data is None or data.get("shape") != dataclasses.asdict(Shape()):
        data = prepare_data(Shape(), path)
    return path, data


def run(work: Path, steps: int, save_every: int, out: Path, rows: list[str], eval_items: int) -> dict:
    netns.require_root()
    shape = Shape()
    data_path, data = load_data(work)
    sync_rows = [r for r in SYNC_ROWS if r in rows]
    anchor_rows = [r for r in ANCHOR_ROWS if r in rows]
    nodes = 8
    report: dict = {
        "complete": False,
        "shape": dataclasses.asdict(shape),
        "model": {
            "name": "tiny Llama pretrained by benchmarks/quality/pretrain.py",
            "hidden": data["config"]["hidden_size"],
            "layers": data["config"]["num_hidden_layers"],
            "vocab": data["vocab_size"],
            "parameters": data["parameters"],
        },
        "task": {
            "name": "arithmetic word problems",
            "train_items": shape.n_train,
            "eval_items": eval_items,
            "eval_loss_items": shape.n_eval_loss,
        },  # fmt: skip
        "steps": steps,
        "save_every": save_every,
        "paper": PAPER,
        "machine": {
            "cpus": os.cpu_count(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": time.strftime("%Y-%m-%d"),
        },
        "phases": {"compute": {}, "shaped": {}, "unscaled": {}},
        "eval": {},
    }
    started = time.perf_counter()
    pretrained = work / "pretrained"
    pretrained.mkdir(exist_ok=True)
    report["pretrained"] = evaluate(str(pretrained), data, eval_items)

    def phase(name: str, row: str, n: int, save: int, links: dict) -> None:
        result = _run(name, row, work, data_path, n, save, links)
        report["phases"][name][row] = result
        if save and "error" not in result:
            report["eval"][row] = evaluate(str(work / name / row), data, eval_items) | {"phase": name}
            ev = report["eval"][row]
            print(
                f"[wan]   eval loss {final_loss(ev):.4f}, exact match "
                f"{ev['exact_match']:.3f} ({ev['seconds']:.0f} s to generate)",
                flush=True,
            )
        report["seconds"] = time.perf_counter() - started
        _save(report, out)

    netns.up(nodes, COMPUTE_LINKS["rate_mbit"], COMPUTE_LINKS["delay_ms"])
    for row in sync_rows:
        phase("compute", row, steps, save_every, COMPUTE_LINKS)
    for row in anchor_rows:
        phase("compute", row, TIMING_STEPS[row], 0, COMPUTE_LINKS)
    dense = report["phases"]["compute"]["dense"]
    tau = dense["step_seconds"]
    rate_bytes = dense["busiest_link_bytes_per_step"] / (PAPER["dense_over_compute"] * tau)
    rate_mbit = rate_bytes * 8 / 1e6
    tau_paper = PAPER["tokens_per_step"] / PAPER["m95_tokens_s"]
    delay_ms = PAPER["delay_ms"] * tau / tau_paper
    report["regime"] = {
        "tau_s": tau,
        "dense_busiest_link_bytes_per_step": dense["busiest_link_bytes_per_step"],
        "rate_mbit": rate_mbit,
        "scale": rate_mbit / PAPER["rate_mbit"],
        "delay_ms": delay_ms,
        "tau_paper_s": tau_paper,
        "time_scale": tau / tau_paper,
    }
    print(
        f"[wan] regime: τ = {tau:.3f} s, R = {rate_mbit:.3f} Mbit/s (scale {rate_mbit / 200:.2e}), "
        f"D = {delay_ms:.2f} ms",
        flush=True,
    )

    shaped_links = {"rate_mbit": rate_mbit, "delay_ms": delay_ms}
    netns.up(nodes, rate_mbit, delay_ms)
    for row in anchor_rows:
        phase("shaped", row, steps, save_every, shaped_links)
    for row in sync_rows:
        phase("shaped", row, TIMING_STEPS[row], 0, shaped_links)

    unscaled_links = {"rate_mbit": PAPER["rate_mbit"], "delay_ms": PAPER["delay_ms"]}
    netns.up(nodes, PAPER["rate_mbit"], PAPER["delay_ms"])
    for row in [r for r in UNSCALED_ROWS if r in rows]:
        phase("unscaled", row, TIMING_STEPS[row], 0, unscaled_links)
    netns.down()
    report["complete"] = True
    report["seconds"] = time.perf_counter() - started
    return report


# ---------------------------------------------------------------------------------------------------
# Figures
# ---------------------------------------------------------------------------------------------------
def summarize(report: dict) -> dict:
    """Per row: tokens/s, speedup, ideal speedup from bytes, quality, time-to-quality, next to the paper."""
    shaped, compute = report["phases"]["shaped"], report["phases"]["compute"]
    curves = {row: {int(k): v for k, v in e["eval_loss"].items()} for row, e in report["eval"].items()}
    target = curves["dense"][max(curves["dense"])]
    dense = shaped["dense"]
    failed = {
        name: r["error"] for phase in report["phases"].values() for name, r in phase.items() if "error" in r
    }  # fmt: skip
    rows = {}
    for name in [n for n in ROWS if n in shaped and n in compute and n in curves and n not in failed]:
        run_ = shaped[name]
        curve = curves[name]
        steps_to = first_step_at(curve, target)
        # bytes per token do not depend on timing: take them from the row's long run (its quality run),
        # where one-off costs (the PowerSGD hook's dense warm-up steps) are amortised as in training
        long_run = shaped[name] if name in ANCHOR_ROWS else compute[name]
        long_bytes = long_run["bytes_per_token"]
        dense_bytes = compute["dense"]["bytes_per_token"]
        byte_ratio = dense_bytes["total"] / long_bytes["total"]
        # the anchor's traffic is asynchronous and leaves from the anchor's own nodes: what a fast step
        # waits for is PP + DP, and no row can beat its own compute-bound throughput on these cores
        blocking = sum(long_bytes[c] for c in ("pp_fwd", "pp_bwd", "dp"))
        blocking_ratio = sum(dense_bytes[c] for c in ("pp_fwd", "pp_bwd", "dp")) / blocking
        compute_cap = compute[name]["tokens_per_s"] / dense["tokens_per_s"]
        ideal = min(blocking_ratio, compute_cap)
        speedup = run_["tokens_per_s"] / dense["tokens_per_s"]
        rows[name] = {
            "label": run_["label"],
            "peer": ROWS[name].peer,
            "tokens_per_s": run_["tokens_per_s"],
            "step_seconds": run_["step_seconds"],
            "speedup": speedup,
            "byte_ratio_all_circuits": byte_ratio,
            "byte_ratio_blocking": blocking_ratio,
            "compute_bound_speedup": compute_cap,
            "ideal_speedup": ideal,
            "share_of_ideal": speedup / ideal,
            "compute_bound_tokens_per_s": compute[name]["tokens_per_s"],
            "bytes_per_token": long_bytes,
            "kernel_bytes_per_token": long_run["kernel_bytes_per_token"],
            "final_eval_loss": curve[max(curve)],
            "exact_match": report["eval"][name]["exact_match"],
            "steps_to_dense_quality": steps_to,
            "time_to_quality_s": steps_to * run_["step_seconds"] if steps_to else None,
            "staleness_mean": run_.get("staleness_mean"),
            "staleness_max": run_.get("staleness_max"),
            "paper_tokens_per_s": PAPER["tokens_s"].get(name),
            "paper_bytes_per_token": PAPER["bytes_per_token"].get(name),
        }
    dense_ttq = rows["dense"]["time_to_quality_s"]
    dense_curve = sorted(curves["dense"].items())
    for name, r in rows.items():
        r["time_to_quality_gain"] = dense_ttq / r["time_to_quality_s"] if r["time_to_quality_s"] else None
        # the other way round, at the row's own quality L = its final loss + 0.01: how long Dense needs
        # to reach L (linear between its saved steps) against how long this row needs (first saved step)
        level, curve = r["final_eval_loss"] + 0.01, sorted(curves[name].items())
        own_steps = next(s for s, v in curve if v <= level)
        dense_steps = _steps_to(dense_curve, level)
        r["own_steps_to_its_final_loss"] = own_steps
        r["dense_steps_to_this_final_loss"] = dense_steps
        r["equal_quality_speedup"] = (
            (dense_steps * shaped["dense"]["step_seconds"] / (own_steps * shaped[name]["step_seconds"]))
            if dense_steps and own_steps
            else None
        )
    return {"target_eval_loss": target, "rows": rows, "failed": failed}


def first_step_at(curve: dict[int, float], target: float) -> int | None:
    """First saved step whose held-out loss is at or below ``target`` (None: not within the run)."""
    return next((s for s in sorted(curve) if curve[s] <= target), None)


def _steps_to(curve: list[tuple[int, float]], loss: float) -> float | None:
    """First (fractional) step where a loss curve given at saved steps falls to ``loss`` (linear in between)."""
    if curve and curve[0][1] <= loss:
        return curve[0][0]
    for (s0, v0), (s1, v1) in zip(curve, curve[1:]):
        if v1 <= loss:
            return s1 if v0 == v1 else s0 + (s1 - s0) * (v0 - loss) / (v0 - v1)
    return None


def _fmt(value, spec: str = ",.0f", none: str = "–") -> str:
    return none if value is None else format(value, spec)


def write_report(report: dict, out: Path) -> None:
    summary = summarize(report)
    report["summary"] = summary
    _save(report, out)
    reg, model, task, shape = report["regime"], report["model"], report["task"], report["shape"]
    pre = report["pretrained"]
    tokens = shape["seq_len"] * shape["microbatch_size"] * shape["microbatches"]
    lines = [
        "# WAN benchmark: fine-tuning a pretrained model on emulated links",
        "",
        f"Command: `sudo .venv/bin/python -m benchmarks.wan.run` ({report['seconds'] / 60:.0f} min on "
        f"{report['machine']['cpus']} cores, torch {report['machine']['torch']}, {report['machine']['date']})"
        + ("" if report.get("complete", True) else " — **incomplete run**")
        + ".",
        "",
        f"**Model:** the quality benchmark's pretrained tiny Llama (H={model['hidden']}, {model['layers']} layers, "
        f"vocabulary {model['vocab']:,}, {model['parameters'] / 1e6:.1f}M parameters, embeddings untied across the "
        "two stages); every row starts from the same weights.",
        "",
        f"**Task:** the quality benchmark's arithmetic word problems: {task['train_items']:,} train items in one "
        f"order for every row, loss on the answer tokens; held-out loss on {task['eval_loss_items']} eval items, "
        f"exact match (greedy generation, the number after ####) on {task['eval_items']} eval items with the dense "
        f"model of fast replica 0 at the last step. Before fine-tuning: held-out loss "
        f"{pre['eval_loss']['0']:.4f}, exact match {pre['exact_match']:.1%}.",
        "",
        f"**Mesh:** 3 fast replicas × 2 stages (+1 anchor replica for the rows with an anchor), one network namespace "
        f"per process; {tokens:,} positions per replica step ({shape['microbatches']} microbatches of "
        f"{shape['microbatch_size']} × {shape['seq_len']}, padding included), lr {shape['lr']:g}, "
        f"{report['steps']} steps; DiLoCo rows sync every {shape['sync_every']} steps in {shape['fragments']} "
        f"fragments, anchor rounds every {shape['anchor_every']} steps.",
        "",
        f"**Regime:** Dense's compute-bound step τ = {reg['tau_s']:.3f} s; its busiest link carries "
        f"{reg['dense_busiest_link_bytes_per_step'] / 1e6:.2f} MB per step. Link rate R = {reg['rate_mbit']:.3f} "
        f"Mbit/s (**scale {reg['scale']:.2e}** of the paper's 200 Mbit/s) so that Dense's link time is "
        f"{PAPER['dense_over_compute']:.1f} τ as on the paper's mesh; one-way delay {reg['delay_ms']:.2f} ms (20 ms × "
        f"τ/τ_paper, time scale {reg['time_scale']:.3f}). The rows with an anchor train their {report['steps']} "
        "steps on these links (their quality depends on the anchor's timing); the synchronous rows' quality comes "
        "from their compute-bound runs and their throughput from a timing window on these links.",
        "",
        f"Time-to-quality target: Dense's final held-out loss {summary['target_eval_loss']:.4f}; time = steps to "
        "reach it (first saved step) × the row's steady-state step time on the shaped links. "
        "\"Speedup at this loss\": at the row's own quality L = its final loss + 0.01, Dense's time to reach L "
        "(linear between saved steps) over the row's (first saved step at or below L), both at shaped "
        "steady-state step times.",
        "",
        "Ideal speedup = min(byte ratio of the circuits a fast step waits for (PP + DP), the row's compute-bound "
        "throughput / Dense's shaped one); the byte ratio over all circuits (anchor included) is given too: the "
        "anchor's bytes are asynchronous and leave from the anchor's own nodes. Bytes per token are the Wire's "
        "(sends + booked all-reduces) over the row's quality run, without the codecs' one-off calibration pass; "
        "the kernel's counter includes it.",
        "",
        "| row | tokens/s | speedup vs Dense | ideal speedup | share of ideal | byte ratio (all circuits) | "
        "B/token total | pp_fwd | pp_bwd | dp | anchor | kernel B/token | final eval loss | exact match | "
        "steps to Dense's loss | time-to-quality (s) | TTQ gain | Dense steps to this loss + 0.01 | "
        "speedup at this loss | paper tokens/s | paper B/token |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in summary["rows"].values():
        b = r["bytes_per_token"]
        lines.append(
            f"| {r['label']}{' (peer)' if r['peer'] else ''} | {r['tokens_per_s']:,.0f} | {r['speedup']:.2f}× | "
            f"{r['ideal_speedup']:.2f}× | {r['share_of_ideal']:.0%} | {r['byte_ratio_all_circuits']:.2f}× | "
            f"{b['total']:,.0f} | {b['pp_fwd']:,.0f} | {b['pp_bwd']:,.0f} | {b['dp']:,.0f} | {b['anchor']:,.0f} | "
            f"{r['kernel_bytes_per_token']:,.0f} | {r['final_eval_loss']:.4f} | {r['exact_match']:.1%} | "
            f"{_fmt(r['steps_to_dense_quality'], 'd', 'not reached')} | {_fmt(r['time_to_quality_s'], ',.1f')} | "
            f"{_fmt(r['time_to_quality_gain'], '.2f')}{'×' if r['time_to_quality_gain'] else ''} | "
            f"{_fmt(r['dense_steps_to_this_final_loss'], '.1f')} | "
            f"{_fmt(r['equal_quality_speedup'], '.2f')}{'×' if r['equal_quality_speedup'] else ''} | "
            f"{_fmt(r['paper_tokens_per_s'])} | {_fmt(r['paper_bytes_per_token'])} |"
        )
    lines += [
        "",
        "Every run, by phase (compute-bound: 10 Gbit/s links; shaped: R and D above; unscaled: 200 Mbit/s, 20 ms):",
        "",
        "The last column checks the Wire against the kernel, process by process: each node's eth0 bytes sent, less "
        f"{FRAME_HEADER_BYTES} bytes of Ethernet/IPv4/TCP headers per packet counted (ACKs are nothing else), over "
        "the bytes its Wire measured or booked (calibration included); the excess is traffic no Wire sees (gloo's "
        "framing, torchft's quorum and heartbeats, the stores).",
        "",
        "| phase | row | steps | step s | tokens/s | B/token | calibration bytes | wall s | kernel payload / wire, "
        "per process |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for phase in ("compute", "shaped", "unscaled"):
        for name, r in report["phases"][phase].items():
            if "error" in r:
                lines.append(f"| {phase} | {r['label']} | failed | | | | | | |")
                continue
            check = r.get("kernel_payload_over_wire")  # absent from runs recorded before the packet counters
            lines.append(
                f"| {phase} | {r['label']} | {r['steps']} | {r['step_seconds']:.3f} | {r['tokens_per_s']:,.0f} | "
                f"{r['bytes_per_token']['total']:,.0f} | {r['calibration_bytes']:,.0f} | {r['wall_seconds']:.0f} | "
                f"{f'{check[0]:.3f}–{check[1]:.3f}' if check else '–'} |"
            )
    anchored = [n for n in ANCHOR_ROWS if n in summary["rows"]]
    if anchored:
        shaped = report["phases"]["shaped"]
        lines += [
            "",
            "Anchor staleness on the shaped links (fast steps between snapshot and use, over the deliveries that "
            "landed before the last step): "
            + ", ".join(
                f"{shaped[n]['label']} mean {_fmt(shaped[n]['staleness_mean'], '.1f')} / max "
                f"{_fmt(shaped[n]['staleness_max'], 'd')} over {shaped[n]['anchor_deliveries']} deliveries"
                for n in anchored
            )
            + ".",
        ]
    if summary["failed"]:
        lines += ["", "Rows that did not run:", ""]
        lines += [f"- `{name}`: {error}" for name, error in summary["failed"].items()]
    lines.append("")
    (out / "wan.md").write_text("\n".join(lines) + "\n")
    _plots(report, summary, out)


def _plots(report: dict, summary: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = summary["rows"]
    names = list(rows)
    labels = [rows[n]["label"] for n in names]
    fig, axes = plt.subplots(1, 3, figsize=(19, 5))
    axes[0].bar(labels, [rows[n]["tokens_per_s"] for n in names], color="tab:blue")
    axes[0].set_yscale("log")
    axes[0].set_ylabel("steady-state tokens/s (shaped links)")
    for i, n in enumerate(names):
        axes[0].annotate(f"{rows[n]['speedup']:.1f}×", (i, rows[n]["tokens_per_s"]), ha="center", va="bottom")
    bottom = [0.0] * len(names)
    for circuit, color in (
        ("pp_fwd", "tab:orange"),
        ("pp_bwd", "tab:red"),
        ("dp", "tab:green"),
        ("anchor", "tab:purple"),
    ):
        values = [rows[n]["bytes_per_token"][circuit] for n in names]
        axes[1].bar(labels, values, bottom=bottom, label=circuit, color=color)
        bottom = [b + v for b, v in zip(bottom, values)]
    axes[1].set_yscale("log")
    axes[1].set_ylim(bottom=1)
    axes[1].set_ylabel("bytes per fast token on the wire (Wire: sends + booked all-reduces)")
    axes[1].legend()
    axes[2].bar(labels, [100 * rows[n]["exact_match"] for n in names], color="tab:gray")
    axes[2].axhline(100 * report["pretrained"]["exact_match"], color="black", ls=":", lw=0.8, label="pretrained")
    axes[2].set_ylabel("exact match (%), dense model, last step")
    axes[2].legend()
    for ax in axes:
        ax.tick_params(axis="x", rotation=35)
        for tick in ax.get_xticklabels():
            tick.set_horizontalalignment("right")
    fig.tight_layout()
    fig.savefig(out / "wan_throughput_bytes.png", dpi=110)
    plt.close(fig)

    fig, ax = plt.subplots(figsize=(8, 4.8))
    shaped = report["phases"]["shaped"]
    for n in names:
        curve = sorted((int(k), v) for k, v in report["eval"][n]["eval_loss"].items())
        ax.plot(
            [max(s, 0.5) * shaped[n]["step_seconds"] for s, _ in curve],
            [v for _, v in curve],
            marker=".",
            label=rows[n]["label"],
        )
    ax.axhline(summary["target_eval_loss"], color="gray", ls="--", lw=0.8, label="Dense final")
    ax.set_xscale("log")
    ax.set_xlabel("simulated wall-clock on the shaped links (s) = step × steady-state step time")
    ax.set_ylabel("held-out loss on the answer tokens (dense model)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "wan_time_to_quality.png", dpi=110)
    plt.close(fig)


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.run")
    parser.add_argument("--work", default=str(cache_dir() / "wan"), help="run folders, token data, saved parameters")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--save-every", type=int, default=10)
    parser.add_argument("--eval-items", type=int, default=Shape().n_eval, help="eval items scored by exact match")
    parser.add_argument("--out", default=None, help="wan.json, wan.md, plots (default: results/; smoke: WORK/results)")
    parser.add_argument("--skip", default="", help="comma-separated rows to leave out, e.g. default_ap")
    parser.add_argument("--report", action="store_true", help="only rebuild the tables and plots from OUT/wan.json")
    parser.add_argument("--smoke", action="store_true", help="a few steps per run (checks the pipeline, not a result)")
    args = parser.parse_args()
    skip = {name for name in args.skip.split(",") if name}
    unknown = skip - set(ROWS) | ({"dense"} & skip)
    if unknown:
        parser.error(f"--skip {sorted(unknown)}: name rows of {sorted(set(ROWS) - {'dense'})}")
    if args.smoke:
        args.steps, args.save_every = 20, 10
        TIMING_STEPS.update({row: 3 if n <= 4 else 6 for row, n in TIMING_STEPS.items()})
    out = Path(args.out) if args.out else (Path(args.work) / "results" if args.smoke else RESULTS)
    if args.report:
        report = json.loads((out / "wan.json").read_text())
    else:
        try:
            rows = [name for name in ROWS if name not in skip]
            report = run(Path(args.work), args.steps, args.save_every, out, rows, args.eval_items)
        finally:
            if os.geteuid() == 0:
                netns.down()
    write_report(report, out)
    print((out / "wan.md").read_text())


if __name__ == "__main__":
    main()
