"""MeshTrainer through the public entry point: an unchanged training script on `meshtune launch`."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from hf_meshtune.boundary.masking import keep_count
from hf_meshtune.ledger import dp_payload_numel
from tests.distributed import mesh_launch
from tests.tiny import tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLAGS = [
    "--preset",  # the paper's masks and anchor; the default boundary runs in test_cpt_recipe's mesh test
    "paper",  # no --num_stages: Y comes from the launched mesh (MESHTUNE_MESH)
    "--max_steps",
    "12",
    "--per_device_train_batch_size",
    "2",
    "--gradient_accumulation_steps",
    "2",
    "--learning_rate",
    "3e-3",
    "--mask_ratio",
    "0.9",
    "--anchor_every",
    "2",
    "--dp_sync_every",
    "4",
    "--dp_fragments",
    "2",
    "--dp_powersgd_rank",
    "2",
    "--dp_quantize",  # float32 factors: the ledger's bytes are then exact (int8 rounds pad to whole blocks)
    "none",
    "--logging_steps",
    "1",
    "--report_to",
    "none",
    "--save_strategy",
    "no",
]


def _launch(mesh: str, output_dir: str, *extra: str, launcher: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    command = [
        *mesh_launch(mesh, *launcher),
        os.path.join(ROOT, "tests", "scripts", "mesh_sft.py"),
        "--output_dir",
        output_dir,
        *FLAGS,
        *extra,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)


@pytest.mark.slow
def test_meshtrainer_script_runs_unchanged_on_a_launched_3x2_mesh(tmp_path):
    out = tmp_path / "run"
    proc = _launch("3x2", str(out), "--record_callbacks")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["mesh"] == "3x2" and summary["fast_replicas"] == 2 and summary["steps"] == 12
    _assert_callbacks_saw_the_run(out, proc.stdout)
    # boundaries: measured sends of exactly the analytic K values per token each way; the one clipping
    # scalar per step backward is an all-reduce, so it is booked (ring factor) and not measured
    measured, booked = summary["measured_bytes_per_token"], summary["booked_bytes_per_token"]
    wire, analytic = summary["wire_bytes_per_token"], summary["analytic_bytes_per_token"]
    # (plus each microbatch message's 24-byte header: under a byte per token here)
    assert analytic["pp_fwd"] == analytic["pp_bwd"] == keep_count(64, 0.9) * 4 and booked["pp_fwd"] == 0
    assert analytic["pp_fwd"] < measured["pp_fwd"] < analytic["pp_fwd"] + 1
    assert analytic["pp_bwd"] < measured["pp_bwd"] < analytic["pp_bwd"] + 1
    clip = 4 * 12 * 4 * (2 * (2 - 1) / 2) / summary["fast_tokens"]  # 4 fast ranks × 12 steps × one fp32 norm, ring
    assert booked["pp_bwd"] == pytest.approx(clip, rel=1e-12)
    # DP is all-reduces only: nothing measured, the booked ring traffic is the ledger's (tensor sizes × factor)
    assert measured["dp"] == 0 and booked["dp"] == pytest.approx(analytic["dp"], rel=1e-9)
    assert wire["anchor"] == pytest.approx(analytic["anchor"], rel=0.02)  # + headers and round messages
    assert all(wire[c] == pytest.approx(measured[c] + booked[c], rel=1e-12) for c in wire)
    assert summary["anchor_rounds"] >= 2 and summary["anchor_arrivals"] >= 2
    # a delivery is computed on a snapshot and applied at a later step: never the snapshot's own step, and
    # (no anchor_max_staleness here) never later than the run
    assert 1 <= summary["anchor_staleness_max"] <= summary["steps"]
    # the loss fell and the saved model is a plain transformers checkpoint with the trained weights
    losses = [
        json.loads(line.split("] ", 1)[1])["loss"]
        for line in proc.stdout.splitlines()
        if line.startswith("[r0s1] {") and '"loss"' in line
    ]
    assert len(losses) == 12 and sum(losses[-3:]) / 3 < sum(losses[:3]) / 3
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]  # what `meshtune report` reads
    assert [entry["step"] for entry in history] == list(range(1, 13))
    assert history[-1]["comm/measured_pp_fwd_bytes_per_token"] == measured["pp_fwd"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    initial = tiny_llama(seed=0, layers=4, hidden=64)
    for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "lm_head.weight"):
        assert not torch.equal(saved.state_dict()[name], initial.state_dict()[name]), name


def _assert_callbacks_saw_the_run(out, stdout: str) -> None:
    """The user's TrainerCallback (a stand-in for a report_to tracker) sees the run as in Trainer.train():
    begin and end on every rank, a step end per fast step on the fast ranks, and on the loss rank (replica 0's
    last stage, the one world-process-zero there) one on_log per logging step with the printed step line."""
    events = {
        r: [json.loads(line) for line in (out / f"callbacks_rank{r}.jsonl").read_text().splitlines()] for r in range(6)
    }
    printed = [json.loads(line.split("] ", 1)[1]) for line in stdout.splitlines() if line.startswith("[r0s1] {")]
    for rank, seen in events.items():
        kinds = [e["event"] for e in seen if e["event"] != "log" or e["logs"].get("eval_loss") is None]
        fast = rank < 4  # replica 2 is the anchor
        assert kinds[0] == "train_begin" and "train_end" in kinds, (rank, kinds)
        assert kinds.count("step_end") == (12 if fast else 0), (rank, kinds)
        train_logs = [e for e in seen if e["event"] == "log" and "loss" in e["logs"]]
        assert all(e["zero"] == (rank == 1) for e in seen), rank
        if rank != 1:
            assert train_logs == [], rank
            continue
        assert [e["step"] for e in train_logs] == [p["step"] for p in printed] == list(range(1, 13))
        assert [e["logs"]["loss"] for e in train_logs] == [p["loss"] for p in printed]
        assert all(e["logs"]["learning_rate"] == p["lr"] for e, p in zip(train_logs, printed))
        assert all(e["logs"]["mesh_tokens_per_s"] > 0 for e in train_logs)


@pytest.mark.slow
def test_lora_on_the_mesh_syncs_and_filters_only_the_adapter_and_saves_a_plain_peft_adapter(tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    out = tmp_path / "lora"
    proc = _launch("3x2", str(out), "--lora", "--max_steps", "4")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "mesh_summary.json").read_text())
    measured, analytic = summary["measured_bytes_per_token"], summary["analytic_bytes_per_token"]
    # LoRA leaves the payload as it is (plus each message's 24-byte header, under a byte per token here)
    assert analytic["pp_fwd"] == keep_count(64, 0.9) * 4 < measured["pp_fwd"] < analytic["pp_fwd"] + 1
    dp = summary["booked_bytes_per_token"]["dp"]  # all-reduces: booked at the ring factor
    assert dp == pytest.approx(analytic["dp"], rel=1e-9) and summary["dp_syncs_per_rank"] == 4 // 2
    # DP: PowerSGD rank 2 of each stage's LoRA matrices (r = 4), nothing of the frozen base
    reference = get_peft_model(
        tiny_llama(seed=0, layers=4, hidden=64),
        LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM"),
    )
    payload = sum(dp_payload_numel(p.shape, 2) for p in reference.parameters() if p.requires_grad)
    # fp32, mean over the 2 stages, and each sync carries one of the dp_fragments = 2 fragments (the LoRA
    # matrices of each stage split into two halves of equal payload)
    assert summary["dp_bytes_per_sync_per_rank"] == pytest.approx(payload * 4 / 2 / 2, rel=1e-9)
    assert summary["anchor_rounds"] >= 1 and summary["anchor_arrivals"] >= 1
    loaded = PeftModel.from_pretrained(tiny_llama(seed=0, layers=4, hidden=64), str(out))
    trained_b = [p for n, p in loaded.named_parameters() if "lora_B" in n]
    assert trained_b and all(p.abs().sum() > 0 for p in trained_b)  # lora_B starts at zero: every stage trained
    assert "## Trained with hf_meshtune" in (out / "README.md").read_text()


@pytest.mark.slow
def test_trl_sft_script_runs_unchanged_on_a_launched_mesh(tmp_path):
    """MeshSFTTrainer on the mesh: TRL's tokenized rows and completion-only collator feed the pipeline."""
    out = tmp_path / "trl"
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    command = [
        *mesh_launch("3x2"),
        os.path.join(ROOT, "tests", "scripts", "mesh_trl_sft.py"),
        "--output_dir",
        str(out),
        *FLAGS,
        "--max_steps",
        "4",
        "--max_length",
        "48",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "mesh_summary.json").read_text())
    measured, analytic = summary["measured_bytes_per_token"], summary["analytic_bytes_per_token"]
    assert summary["steps"] == 4 and analytic["pp_fwd"] == keep_count(64, 0.9) * 4
    assert analytic["pp_fwd"] < measured["pp_fwd"] < analytic["pp_fwd"] + 1  # each message's 24-byte header
    assert summary["booked_bytes_per_token"]["dp"] == pytest.approx(analytic["dp"], rel=1e-9)
    assert summary["anchor_rounds"] >= 1
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history] == [1, 2, 3, 4] and all(math.isfinite(e["loss"]) for e in history)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    assert "MeshSFTTrainer" in (out / "README.md").read_text()


@pytest.mark.slow
def test_meshtrainer_runs_with_every_replica_a_job_of_its_own(tmp_path):
    """``--max-restarts``: three gloo worlds of two processes meet only through torchft; the summary
    still covers the whole mesh (results travel through the launcher's store) and only replica 0 saves.
    A fitted codec (its calibration pass between the stages of every replica's own world) runs too, on an uneven
    split (``stage_layers``: stage 0 holds 3 of the 4 layers) that the saved checkpoint puts back together."""
    out = tmp_path / "jobs"
    codec = ("--mask_ratio", "0", "--boundary_codec", "outliers2+int8", "--stage_layers", "3", "1")
    proc = _launch("3x2", str(out), "--anchor", "false", *codec, launcher=("--max-restarts", "1"))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "one job per replica, up to 1 restart(s) each" in proc.stderr
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["replicas_reported"] == 3 and summary["fast_replicas"] == 3 and summary["steps"] == 12
    assert summary["stage_layers"] == [3, 1]
    split = summary["step_split_per_rank"]  # every fast rank's step: its stage computing, then waiting
    assert [(r["replica"], r["stage"]) for r in split] == [(0, 0), (0, 1), (1, 0), (1, 1), (2, 0), (2, 1)]
    assert all(0 < r["compute_s"] <= r["pipeline_s"] <= r["step_s"] for r in split)
    assert len(summary["compute_s_per_stage"]) == 2 and summary["slowest_stage"]["stage"] in (0, 1)
    assert summary["dp_syncs_per_rank"] == 12 // 2 and summary["heals"] == []
    assert summary["booked_bytes_per_token"]["dp"] == pytest.approx(summary["analytic_bytes_per_token"]["dp"], rel=1e-9)
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("mesh_summary")) == ["mesh_summary.json"]
    saved = AutoModelForCausalLM.from_pretrained(out)
    initial = tiny_llama(seed=0, layers=4, hidden=64)
    for name in ("lm_head.weight", "model.layers.2.mlp.down_proj.weight", "model.layers.3.mlp.down_proj.weight"):
        assert not torch.equal(saved.state_dict()[name], initial.state_dict()[name]), name


def _step_losses(stdout: str) -> dict[int, float]:
    lines = [
        json.loads(line.split("] ", 1)[1])
        for line in stdout.splitlines()
        if line.startswith("[r0s1] {") and '"loss"' in line
    ]
    return {entry["step"]: entry["loss"] for entry in lines}


@pytest.mark.slow
def test_meshtrainer_writes_mesh_checkpoints_and_resumes_from_one_exactly(tmp_path):
    """``--save_strategy steps`` writes checkpoint-N/mesh/; ``--resume_from_checkpoint`` continues from
    one with the losses of the uninterrupted run, bit for bit (no anchor: nothing runs on its own clock)."""
    first, second = tmp_path / "first", tmp_path / "second"
    flags = ("--anchor", "false", "--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "2")
    proc = _launch("2x2", str(first), *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in first.iterdir() if p.name.startswith("checkpoint-")) == [
        "checkpoint-12",
        "checkpoint-8",
    ]
    assert sorted(os.listdir(first / "checkpoint-8" / "mesh")) == [f"rank{r}.pt" for r in range(4)]
    proc2 = _launch("2x2", str(second), *flags, "--resume_from_checkpoint", str(first / "checkpoint-8"))
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    uninterrupted, resumed = _step_losses(proc.stdout), _step_losses(proc2.stdout)
    assert sorted(resumed) == [9, 10, 11, 12]
    assert all(resumed[step] == uninterrupted[step] for step in resumed)
    summary = json.loads((second / "mesh_summary.json").read_text())
    assert summary["resumed_from_step"] == 8
    history = json.loads((second / "trainer_state.json").read_text())["log_history"]
    assert [entry["step"] for entry in history] == [9, 10, 11, 12]


def _child_with_rank(parent: int, rank: int) -> int | None:
    """The launcher's child process whose environment says RANK=rank."""
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as handle:
                ppid = int(handle.read().rsplit(b")", 1)[1].split()[1])
            with open(f"/proc/{entry}/environ", "rb") as handle:
                env = handle.read().split(b"\0")
        except (OSError, ValueError):
            continue
        if ppid == parent and f"RANK={rank}".encode() in env:
            return int(entry)
    return None


@pytest.mark.slow
def test_meshtrainer_trains_on_when_the_anchor_replica_is_killed(tmp_path):
    """``--optional-replica 2``: SIGKILL the anchor's stage 0 at step 6; the fast replicas run every
    step, rank 0 writes the summary (anchor lost at its step) and the trained model is saved."""
    import signal

    out = tmp_path / "lost"
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    flags = [*FLAGS, "--max_steps", "24", "--anchor_max_staleness", "4"]
    command = [
        *mesh_launch("3x2", "--optional-replica", "2"),
        os.path.join(ROOT, "tests", "scripts", "mesh_sft.py"),
        "--output_dir",
        str(out),
        *flags,
    ]
    launcher = subprocess.Popen(command, env=env, cwd=ROOT, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines = []
    try:
        for line in launcher.stdout:
            lines.append(line)
            if line.startswith("[r0s1] {") and json.loads(line.split("] ", 1)[1]).get("step") == 6:
                os.kill(_child_with_rank(launcher.pid, 4), signal.SIGKILL)
        launcher.wait(timeout=300)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    output = "".join(lines)
    assert launcher.returncode == 0, output[-4000:]
    assert "optional replica 2 is lost; the other replicas go on" in output
    assert sorted(_step_losses(output)) == list(range(1, 25))
    summary = json.loads((out / "mesh_summary.json").read_text())
    # the loss is noticed at or after the kill (step 6) and before the end; every step ran after it
    assert summary["steps"] == 24 and 6 <= summary["anchor_lost_at_step"] < 24 and summary["replicas_reported"] == 2
    saved = AutoModelForCausalLM.from_pretrained(out)
    initial = tiny_llama(seed=0, layers=4, hidden=64)
    assert not torch.equal(saved.state_dict()["lm_head.weight"], initial.state_dict()["lm_head.weight"])


@pytest.mark.slow
def test_a_mesh_that_does_not_fit_the_world_fails_fast_on_every_rank(tmp_path):
    proc = _launch("2x2", str(tmp_path / "bad"), "--num_stages", "3")
    assert proc.returncode != 0
    text = proc.stdout + proc.stderr
    assert "num_stages=3 is invalid: it must equal Y = 2 of the mesh 2x2" in text


@pytest.mark.slow
def test_the_same_script_runs_under_accelerate_launch_with_its_own_lighthouse(tmp_path):
    """accelerate's yaml for a local CPU mesh; no TORCHFT_LIGHTHOUSE, so global rank 0 starts one."""
    out = tmp_path / "acc"
    env = {key: value for key, value in os.environ.items() if key not in ("TORCHFT_LIGHTHOUSE", "MESHTUNE_MESH")}
    env.update({"PYTHONPATH": ROOT, "RUST_LOG": "warn", "ACCELERATE_USE_CPU": "true"})
    accelerate = os.path.join(os.path.dirname(sys.executable), "accelerate")
    command = [
        accelerate,
        "launch",
        "--config_file",
        os.path.join(ROOT, "accelerate_configs", "cpu_mesh_3x2.yaml"),
        os.path.join(ROOT, "tests", "scripts", "mesh_sft.py"),
        "--output_dir",
        str(out),
        *FLAGS,
        "--num_stages",  # accelerate launch sets no MESHTUNE_MESH: Y is the script's
        "2",
    ]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "mesh_summary.json").read_text())
    assert summary["mesh"] == "3x2" and summary["mesh_env"] is None  # X inferred from WORLD_SIZE / num_stages
    assert summary["dp_syncs_per_rank"] == 12 // 2 and summary["anchor_rounds"] >= 2
    assert summary["booked_bytes_per_token"]["dp"] == pytest.approx(summary["analytic_bytes_per_token"]["dp"], rel=1e-9)


@pytest.mark.slow
def test_a_composed_codec_runs_on_the_mesh_with_one_geometry_per_boundary_and_resumes_exactly(tmp_path):
    """``--boundary_codec`` on a launched 2×2 mesh: a calibration pass gives both sides of the boundary the
    sender's fit (bit for bit, as the rank checkpoints show), the wire carries exactly the codec's message,
    and a resumed run continues with the geometry it had: the losses of the uninterrupted run, bit for bit."""
    codec, first, second = "outliers2+spca24+int4sr", tmp_path / "first", tmp_path / "second"
    flags = ("--anchor", "false", "--boundary_codec", codec, "--mask_ratio", "0", "--max_steps", "8")  # no mask
    flags += ("--save_strategy", "steps", "--save_steps", "4", "--save_total_limit", "2")
    proc = _launch("2x2", str(first), *flags)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((first / "mesh_summary.json").read_text())
    measured, analytic = summary["measured_bytes_per_token"], summary["analytic_bytes_per_token"]
    message = 2 * 4 + 2 + 3 * 4  # a real token's record: 2 fp32 outliers + a bf16 scale + 24 int4 codes
    assert analytic["pp_fwd"] == message < measured["pp_fwd"] < message + 1  # + each message's 24-byte header
    clip = 4 * 8 * 4 * (2 * (2 - 1) / 2) / summary["fast_tokens"]  # the gradient-norm scalar, as in the 3x2 test
    assert analytic["pp_bwd"] == message < measured["pp_bwd"] < message + 1  # the codec's record back, measured
    assert summary["booked_bytes_per_token"]["pp_bwd"] == pytest.approx(clip, rel=1e-12)
    # calibration, per replica: stage 0's dense output on batches(0) (2·2 rows × 16 tokens × H fp32) + its geometry
    geometry = (2 + 62) * 8 + (62 + 62 + 62 * 24) * 4  # dims (int64); mean, std, basis (fp32)
    assert summary["codec_calibration_bytes"] == 2 * (4 * 16 * 64 * 4 + geometry)
    for replica in (0, 1):
        sender = torch.load(first / "checkpoint-8" / "mesh" / f"rank{2 * replica}.pt", weights_only=False)
        receiver = torch.load(first / "checkpoint-8" / "mesh" / f"rank{2 * replica + 1}.pt", weights_only=False)
        sent, received = sender["codecs"][1], receiver["codecs"][0]
        assert sent["outlier_dims"].numel() == 2 and sent["basis"].shape == (62, 24)
        for name in ("outlier_dims", "rest_dims", "mean", "std", "basis"):
            assert torch.equal(sent[name], received[name]), name
    proc2 = _launch("2x2", str(second), *flags, "--resume_from_checkpoint", str(first / "checkpoint-4"))
    assert proc2.returncode == 0, proc2.stdout[-3000:] + proc2.stderr[-3000:]
    uninterrupted, resumed = _step_losses(proc.stdout), _step_losses(proc2.stdout)
    assert sorted(resumed) == [5, 6, 7, 8]
    assert all(resumed[step] == uninterrupted[step] for step in resumed)
    assert sum(list(uninterrupted.values())[-3:]) < sum(list(uninterrupted.values())[:3])
