"""``meshtune report`` on real tiny runs, the mesh's summary and the demo's; TensorBoard gets the ledger.

The runs are real ``MeshTrainer`` runs (a tiny Llama, 4 steps, ``report_to=["tensorboard"]``): the
report's numbers are checked against ``trainer.state.log_history``, and the TensorBoard event files
against the same log lines.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path

import numpy as np
import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers.trainer import TRAINER_STATE_NAME

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from hf_meshtune.cli import main
from hf_meshtune.report import CIRCUITS, MESH_SUMMARY_NAME, write_report
from hf_meshtune.runtime.job import SUMMARY_NAME
from tests.tiny import GOVERNED_TINY, pattern_dataset, tiny_llama

BASE = dict(
    per_device_train_batch_size=4,
    learning_rate=3e-3,
    logging_steps=1,
    report_to=["tensorboard"],
    use_cpu=True,
    disable_tqdm=True,
    save_strategy="no",
    seed=0,
    lr_scheduler_type="constant",
    max_steps=4,
)
RUNS = {
    "dense": dict(mask_ratio=0.0, anchor=False),
    "m95_ap": dict(preset="paper", num_stages=2, anchor_every=1, anchor_delay=1),
}
LEDGER_KEYS = [f"comm/{name}_bytes_per_token" for name in (*CIRCUITS, "total")]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"

# A distributed mesh's summary as mesh_job.summarize writes it (the m95_ap row of benchmarks/mesh/results).
MESH_SUMMARY = {
    "mesh": "3x2",
    "fast_replicas": 2,
    "anchor": True,
    "steps": 8,
    "fast_tokens": 2048,
    "seq_len": 64,
    "measured_bytes_per_token": {
        "pp_fwd": 116.0,
        "pp_bwd": 116.0,
        "dp": 0.0,
        "anchor": 1249931.484375,
        "total": 1250163.484375,
    },
    "booked_bytes_per_token": {"pp_fwd": 0.0, "pp_bwd": 0.0625, "dp": 9814.5, "anchor": 0.0, "total": 9814.5625},
    "wire_bytes_per_token": {
        "pp_fwd": 116.0,
        "pp_bwd": 116.0625,
        "dp": 9814.5,
        "anchor": 1249931.484375,
        "total": 1259978.046875,
    },
    "analytic_bytes_per_token": {
        "pp_fwd": 116.0,
        "pp_bwd": 116.0,
        "dp": 9814.5,
        "anchor": 1249931.25,
        "total": 1259977.75,
    },
    "analytic_settings": {"num_replicas": 3, "num_stages": 2, "mask_ratio": 0.95, "tokens_per_step": 128},
    "dp_syncs_per_rank": 2.0,
    "dp_bytes_per_sync_per_rank": 2512512.0,
    "anchor_rounds": 3,
    "anchor_arrivals": 12,
    "anchor_staleness_mean": 0.6666666666666666,
    "anchor_staleness_max": 1,
    "step_seconds_mean": 11.151598471429029,
    "final_loss": 13.954839706420898,
    "mesh_env": "3x2",
}


@pytest.fixture
def trained(tmp_path, single_thread_torch) -> dict[str, MeshTrainer]:
    """Two finished runs under ``tmp_path/runs``: dense (p = 0, no anchor) and masked with the anchor."""
    data = pattern_dataset()
    trainers = {}
    for name, knobs in RUNS.items():
        args = MeshTrainingArguments(output_dir=str(tmp_path / "runs" / name), **BASE, **knobs)
        trainer = MeshTrainer(model=tiny_llama(), args=args, train_dataset=data, eval_dataset=data.select(range(8)))
        trainer.train()
        trainer.evaluate()
        trainer.save_state()
        trainers[name] = trainer
    return trainers


def train_logs(trainer: MeshTrainer) -> list[dict]:
    return [entry for entry in trainer.state.log_history if "loss" in entry]


def table_line(report: str, run: str) -> str:
    lines = [line for line in report.splitlines() if line.startswith(f"| {run} |")]
    assert len(lines) == 1, report
    return lines[0]


def assert_png(path: str | Path) -> None:
    data = Path(path).read_bytes()
    assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_report_of_real_runs_shows_what_the_trainer_logged(trained, tmp_path, capsys):
    assert main(["report", str(tmp_path / "runs")]) == 0
    written = capsys.readouterr().out.split()
    assert written == [str(tmp_path / "runs" / name) for name in ("report.md", "loss.png", "bytes_per_token.png")]
    for png in written[1:]:
        assert_png(png)
    report = (tmp_path / "runs" / "report.md").read_text()
    assert (
        "![training loss (and reward) vs step](loss.png)" in report
        and "![bytes per token by circuit](bytes_per_token.png)" in report
    )
    for name, trainer in trained.items():
        last = train_logs(trainer)[-1]
        line = table_line(report, name)
        for key in LEDGER_KEYS:
            assert f" {last[key]:,.1f} " in line, (key, line)
        assert f" {last['comm/compression_vs_dense_ratio']:.2f}× " in line


def test_report_rows_equal_the_log_history(trained, tmp_path):
    result = write_report(tmp_path / "runs", tmp_path / "report")
    rows = {row["run"]: row for row in result["rows"]}
    assert sorted(rows) == sorted(RUNS)  # tensorboard's runs/ folder is not a run
    for name, trainer in trained.items():
        logs, row = train_logs(trainer), rows[name]
        assert row["steps"] == 4 and row["sources"] == [TRAINER_STATE_NAME]
        assert (row["first_train_loss"], row["last_train_loss"]) == (logs[0]["loss"], logs[-1]["loss"])
        assert row["last_eval_loss"] == trainer.state.log_history[-1]["eval_loss"]
        assert row["bytes_per_token"] == {
            key.split("/")[1].removesuffix("_bytes_per_token"): logs[-1][key] for key in LEDGER_KEYS
        }
        assert row["compression_vs_dense"] == logs[-1]["comm/compression_vs_dense_ratio"]
        assert result["bars"][f"{name} analytic"] == {c: row["bytes_per_token"][c] for c in CIRCUITS}
        assert row["measured_bytes_per_token"] is row["wire_bytes_per_token"] is None
    assert rows["dense"]["anchor_staleness_steps"] is None
    assert rows["m95_ap"]["anchor_staleness_steps"] == 1.0
    assert rows["m95_ap"]["bytes_per_token"]["pp_fwd"] < rows["dense"]["bytes_per_token"]["pp_fwd"]
    for key in ("report", "loss_plot", "bytes_plot"):
        assert Path(result[key]).parent == tmp_path / "report"


def test_tensorboard_event_files_carry_the_byte_ledger(trained):
    """transformers' TensorBoard callback writes every training log key under ``train/`` and
    ``eval_<name>`` as ``eval/<name>``; values are stored as float32."""
    for trainer in trained.values():
        events = glob.glob(f"{trainer.args.output_dir}/**/events.out.tfevents.*", recursive=True)
        folders = {Path(path).parent for path in events}
        assert len(folders) == 1, events  # evaluate() after train() opens a second file beside the first
        accumulator = EventAccumulator(str(folders.pop()))
        accumulator.Reload()
        logs = train_logs(trainer)
        for key in [*LEDGER_KEYS, "comm/compression_vs_dense_ratio", "comm/measured_pp_fwd_bytes_per_token", "loss"]:
            scalars = [(event.step, event.value) for event in accumulator.Scalars(f"train/{key}")]
            assert scalars == [(entry["step"], float(np.float32(entry[key]))) for entry in logs], key
        evaluation = trainer.state.log_history[-1]
        assert [(e.step, e.value) for e in accumulator.Scalars("eval/loss")] == [
            (4, float(np.float32(evaluation["eval_loss"])))
        ]
    assert "train/anchor/staleness_steps" in accumulator.Tags()["scalars"]  # the last run has the anchor


def test_mesh_summary_puts_its_wire_bytes_in_the_report_and_the_bars(tmp_path, capsys):
    """Measured sends and booked all-reduces side by side, their sum on the wire, the ledger beside it."""
    assert MESH_SUMMARY_NAME == SUMMARY_NAME
    run = tmp_path / "runs" / "mesh_3x2"
    run.mkdir(parents=True)
    (run / MESH_SUMMARY_NAME).write_text(json.dumps(MESH_SUMMARY))
    assert main(["report", str(tmp_path / "runs"), "--out", str(tmp_path / "out")]) == 0
    assert_png(tmp_path / "out" / "bytes_per_token.png")
    report = (tmp_path / "out" / "report.md").read_text()
    measured, booked = MESH_SUMMARY["measured_bytes_per_token"], MESH_SUMMARY["booked_bytes_per_token"]
    wire, analytic = MESH_SUMMARY["wire_bytes_per_token"], MESH_SUMMARY["analytic_bytes_per_token"]
    assert measured["total"] + booked["total"] == wire["total"]
    for circuit in (*CIRCUITS, "total"):
        cells = " | ".join(f"{f[circuit]:,.1f}" for f in (measured, booked, wire, analytic))
        assert f"| mesh_3x2 | 3x2 | {circuit} | {cells} |" in report
    assert "| mesh_3x2 | 8 | 2,048 | 2,512,512 | 2 | 3 | 0.67 / 1 | 11.2 | 13.9548 |" in report
    row = write_report(tmp_path / "runs", tmp_path / "out")["rows"][0]
    assert row["wire_bytes_per_token"] == wire and row["bytes_per_token"] == analytic
    assert row["measured_bytes_per_token"] == measured and row["booked_bytes_per_token"] == booked
    assert row["steps"] == 8 and row["last_train_loss"] == MESH_SUMMARY["final_loss"]
    bars = write_report(tmp_path / "runs", tmp_path / "out")["bars"]
    assert bars["mesh_3x2 wire"] == {c: wire[c] for c in CIRCUITS}
    assert bars["mesh_3x2 analytic"] == {c: analytic[c] for c in CIRCUITS}


def test_a_mesh_summary_from_before_booked_bytes_reports_its_sum_as_on_the_wire(tmp_path):
    """Older summaries had the sum alone, under ``measured_bytes_per_token``: it is their wire figure, and
    the report does not pretend to know which part was measured."""
    older = {k: v for k, v in MESH_SUMMARY.items() if k not in ("booked_bytes_per_token", "measured_bytes_per_token")}
    older["measured_bytes_per_token"] = older.pop("wire_bytes_per_token")
    run = tmp_path / "runs" / "old"
    run.mkdir(parents=True)
    (run / MESH_SUMMARY_NAME).write_text(json.dumps(older))
    row = write_report(tmp_path / "runs", tmp_path / "out")["rows"][0]
    assert row["wire_bytes_per_token"] == MESH_SUMMARY["wire_bytes_per_token"]
    assert row["measured_bytes_per_token"] is row["booked_bytes_per_token"] is None
    report = (tmp_path / "out" / "report.md").read_text()
    assert f"| old | 3x2 | dp | – | – | {MESH_SUMMARY['wire_bytes_per_token']['dp']:,.1f} |" in report


def test_demo_summary_is_a_run(tmp_path):
    last_log = {
        "loss": 5.87,
        "comm/pp_fwd_bytes_per_token": 348.0,
        "comm/pp_bwd_bytes_per_token": 348.0,
        "comm/dp_bytes_per_token": 50.0,
        "comm/anchor_bytes_per_token": 9000.0,
        "comm/total_bytes_per_token": 9746.0,
        "comm/compression_vs_dense_ratio": 3.5,
        "step": 60,
    }
    summary = {
        "masked_train_loss_first_log": 10.3,
        "masked_train_loss_last_log": 5.87,
        "dense_eval_loss_before": 1.518,
        "dense_eval_loss_after": 1.446,
        "last_log": last_log,
    }
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    row = write_report(tmp_path)["rows"][0]
    assert row["run"] == tmp_path.name and row["sources"] == ["summary.json"]
    assert (row["steps"], row["first_train_loss"], row["last_train_loss"], row["last_eval_loss"]) == (
        60,
        10.3,
        5.87,
        1.446,
    )
    assert row["bytes_per_token"] == {"pp_fwd": 348.0, "pp_bwd": 348.0, "dp": 50.0, "anchor": 9000.0, "total": 9746.0}
    assert row["compression_vs_dense"] == 3.5


def test_checkpoints_belong_to_their_run_and_the_newest_is_read(tmp_path):
    def state(folder: Path, step: int) -> None:
        folder.mkdir(parents=True)
        log = [{"loss": float(s), "step": s, "comm/total_bytes_per_token": 10.0 * s} for s in range(1, step + 1)]
        (folder / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": step, "log_history": log}))

    for step in (2, 9, 10):  # checkpoint-10 sorts before checkpoint-9 as text
        state(tmp_path / "crashed" / f"checkpoint-{step}", step)
    state(tmp_path / "finished" / "checkpoint-2", 2)
    (tmp_path / "finished" / TRAINER_STATE_NAME).write_text(json.dumps({"global_step": 4, "log_history": []}))
    rows = {row["run"]: row for row in write_report(tmp_path)["rows"]}
    assert sorted(rows) == ["crashed", "finished"]
    assert rows["crashed"]["sources"] == [f"checkpoint-10/{TRAINER_STATE_NAME}"]
    assert rows["crashed"]["steps"] == 10 and rows["crashed"]["bytes_per_token"]["total"] == 100.0
    assert rows["finished"]["sources"] == [TRAINER_STATE_NAME] and rows["finished"]["steps"] == 4


@pytest.mark.parametrize("case", ["missing", "empty", "corrupt"])
def test_bad_run_dir_exits_2_with_the_reason(tmp_path, capsys, case):
    run_dir = tmp_path / "runs"
    if case != "missing":
        (run_dir / "run" / "runs").mkdir(parents=True)  # e.g. only TensorBoard's folder: no run
    if case == "corrupt":
        (run_dir / "run" / TRAINER_STATE_NAME).write_text('{"log_history": [')
    assert main(["report", str(run_dir)]) == 2
    err = capsys.readouterr().err
    expected = {
        "missing": f"run_dir={str(run_dir)!r} is invalid: it must be an existing folder",
        "empty": f"run_dir={str(run_dir)!r} is invalid: it must contain at least one run: a folder with "
        f"{TRAINER_STATE_NAME}",
        "corrupt": f"file={str(run_dir / 'run' / TRAINER_STATE_NAME)!r} is invalid: it must hold valid JSON",
    }[case]
    assert err.startswith(f"meshtune report: error: {expected}"), err
    assert not (run_dir / "report.md").exists()


def test_a_mesh_summary_with_memory_reports_every_process_beside_the_ledger(tmp_path):
    """Each process's parts as measured (predicted for its role and stage), the sum against the predicted
    total, the peak RSS; a summary without memory figures (older runs) has no memory section."""
    parts = dict(weights=0.25, gradients=0.125, optimizer=0.25, anchor=0.0, dp=0.5, codec=0.0, activations=0.01)
    guess = {**parts, "activations": 0.012}
    summary = {
        **MESH_SUMMARY,
        "memory_gib": [
            {"rank": r, "replica": r // 2, "stage": r % 2, "role": "fast", **parts, "counted": 1.135, "peak_rss": 2.5}
            for r in range(2)
        ],
        "memory_predicted_gib": [
            {"role": "fast", "stage": 0, **guess, "total": 1.137},
            {"role": "fast", "stage": 1, **guess, "total": 1.2},
        ],
    }
    run = tmp_path / "runs" / "mem"
    run.mkdir(parents=True)
    (run / MESH_SUMMARY_NAME).write_text(json.dumps(summary))
    write_report(tmp_path / "runs", tmp_path / "out")
    report = (tmp_path / "out" / "report.md").read_text()
    cells = "0.250 (0.250) | 0.125 (0.125) | 0.250 (0.250) | 0.000 (0.000) | 0.500 (0.500) | 0.000 (0.000)"
    assert f"| mem | 0 | fast | 0 | {cells} | 0.010 (0.012) | 1.135 (1.137) | 2.50 |" in report
    assert f"| mem | 1 | fast | 1 | {cells} | 0.010 (0.012) | 1.135 (1.200) | 2.50 |" in report
    (run / MESH_SUMMARY_NAME).write_text(json.dumps(MESH_SUMMARY))
    write_report(tmp_path / "runs", tmp_path / "out")
    assert "memory per process" not in (tmp_path / "out" / "report.md").read_text()


def test_governed_run_gets_a_fidelity_plot_of_what_its_anchor_logged(tmp_path, capsys, single_thread_torch):
    """A governed run (the anchor measures int2/int4/int8 at its one boundary every 2 steps; TensorBoard gets the
    same keys): the report draws fidelity.png from ``fidelity/b0/<codec>/cos`` per round and the levels used."""
    args = MeshTrainingArguments(
        output_dir=str(tmp_path / "runs" / "governed"),
        **{**BASE, "max_steps": 8},
        **GOVERNED_TINY,
    )
    trainer = MeshTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset())
    trainer.train()
    trainer.save_state()
    assert main(["report", str(tmp_path / "runs")]) == 0
    written = capsys.readouterr().out.split()
    assert written[-1] == str(tmp_path / "runs" / "fidelity.png")
    assert_png(written[-1])
    assert "![boundary codec fidelity vs step](fidelity.png)" in (tmp_path / "runs" / "report.md").read_text()

    series = write_report(tmp_path / "runs", tmp_path / "report")["fidelity"]
    logs = train_logs(trainer)
    rounds = {}  # each round's entries, once, at its snapshot step
    for entry in logs:
        if "fidelity/step" in entry:
            rounds.setdefault(entry["fidelity/step"], entry)
    assert sorted(rounds) == [0.0, 2.0, 4.0, 6.0]
    for codec in ("int2", "int4", "int8"):  # the first round measures the whole ladder, later ones current ± 1
        drawn = series[0][f"governed {codec}"]
        expected = [(s, e[f"fidelity/b0/{codec}/cos"]) for s, e in rounds.items() if f"fidelity/b0/{codec}/cos" in e]
        assert drawn == expected and drawn
    assert series[0]["governed level"] == [
        (e["step"], e["governor/b0/level"]) for e in logs if "governor/b0/level" in e
    ]
    assert {level for _, level in series[0]["governed level"]} == {1.0}  # int4 from the first round on
