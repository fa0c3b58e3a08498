"""Mesh checkpoints: one file per fast process, complete only when all are there, atomic, rotated
safely; and resume through them: bit-exact without the anchor and with it in lockstep.

The real runs are tiny-Llama meshes on ``meshtune launch`` (``tests/scripts/mesh_run.py``); the
checkpoint bookkeeping is tested on its own on fake states first.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from hf_meshtune.runtime.checkpoint import (
    complete_checkpoints,
    latest_complete_checkpoint,
    read_rank_state,
    resolve_resume,
    save_rank_state,
)
from hf_meshtune.topology import MeshTopology
from tests.distributed import mesh_launch

REPO = Path(__file__).resolve().parents[1]
MESH = MeshTopology(3, 2, anchor=True)  # fast ranks 0-3, anchor ranks 4-5


# ---------------------------------------------------------------------------------------------
# Bookkeeping
# ---------------------------------------------------------------------------------------------
def _save_all(out: Path, step: int, ranks=(0, 1, 2, 3), keep=None) -> None:
    for rank in ranks:
        save_rank_state(str(out), step, rank, {"value": torch.tensor([step, rank])}, MESH, keep)


def test_a_checkpoint_is_complete_only_with_every_fast_rank(tmp_path):
    _save_all(tmp_path, 4)
    _save_all(tmp_path, 8, ranks=(0, 1, 3))  # rank 2 was killed before its save of step 8
    (tmp_path / "checkpoint-8" / "mesh" / "rank2.pt.tmp-123").write_bytes(b"half a file")
    assert [step for step, _ in complete_checkpoints(str(tmp_path), MESH)] == [4]
    assert latest_complete_checkpoint(str(tmp_path), MESH) == str(tmp_path / "checkpoint-4")
    assert resolve_resume(True, str(tmp_path), MESH) == str(tmp_path / "checkpoint-4")
    assert resolve_resume(None, str(tmp_path), MESH) is None
    with pytest.raises(ValueError, match=r"missing mesh/rank\{r\}.pt for r in \[2\]"):
        resolve_resume(str(tmp_path / "checkpoint-8"), str(tmp_path), MESH)
    state = read_rank_state(str(tmp_path / "checkpoint-4"), 2, MESH)
    assert state["step"] == 4 and state["mesh"] == "3x2" and torch.equal(state["value"], torch.tensor([4, 2]))
    # the resumed run reaches step 8 again: rank 2's complete file replaces the killed writer's torn one
    (tmp_path / "checkpoint-8" / "mesh" / "rank1.pt.tmp-456").write_bytes(b"another rank's")
    _save_all(tmp_path, 8, ranks=(2,))
    assert sorted(p.name for p in (tmp_path / "checkpoint-8" / "mesh").iterdir()) == [
        "rank0.pt",
        "rank1.pt",
        "rank1.pt.tmp-456",  # rank 1's own to clear, at its next save of step 8
        "rank2.pt",
        "rank3.pt",
    ]


def test_rotation_keeps_the_newest_complete_checkpoints_and_never_the_only_one(tmp_path):
    _save_all(tmp_path, 4, keep=2)
    _save_all(tmp_path, 8, keep=2)
    _save_all(tmp_path, 12, ranks=(0, 1, 2), keep=2)  # incomplete: nothing older may go yet
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-4", "checkpoint-8"]
    _save_all(tmp_path, 12, ranks=(3,), keep=2)  # now 12 is complete: 4 goes
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-8"]
    (tmp_path / "checkpoint-2").mkdir()  # a single-process Trainer checkpoint: not the mesh's to remove
    _save_all(tmp_path, 16, keep=2)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-12", "checkpoint-16", "checkpoint-2"]


def test_a_checkpoint_of_another_mesh_or_a_damaged_file_is_refused_by_name(tmp_path):
    _save_all(tmp_path, 4)
    other = MeshTopology(2, 2, anchor=False)  # fast ranks 0-3 as well, so the folder is complete for it
    with pytest.raises(
        ValueError, match=r"mesh='2x2' is invalid: it must equal the checkpoint's mesh 3x2 \(anchor=True\)"
    ):
        read_rank_state(str(tmp_path / "checkpoint-4"), 0, other)
    (tmp_path / "checkpoint-4" / "mesh" / "rank1.pt").write_bytes(b"\x00" * 10)
    with pytest.raises(ValueError, match=r"rank1.pt' is invalid: it must be a readable file written by a mesh process"):
        read_rank_state(str(tmp_path / "checkpoint-4"), 1, MESH)
    with pytest.raises(
        ValueError, match=r"resume_from_checkpoint=True is invalid: it must find a complete mesh checkpoint"
    ):
        resolve_resume(True, str(tmp_path / "nothing"), MESH)
    with pytest.raises(ValueError, match=r"it must be a mesh checkpoint folder"):
        resolve_resume(str(tmp_path), str(tmp_path), MESH)


# ---------------------------------------------------------------------------------------------
# Real meshes
# ---------------------------------------------------------------------------------------------
STEPS = 16
ANCHOR = {"anchor": True, "anchor_every": 2, "anchor_delay": 0, "anchor_lockstep": True, "spectral_tau": 1e-3}
# the anchor in lockstep with a fitted codec: its geometry is refitted every round (codec_refit_every)
ANCHOR.update(mask_ratio=0.0, boundary_codec="outliers2+pca8+int8")


def _launch(mesh: str, out: Path, config: dict, **env: str) -> subprocess.Popen:
    command = [
        *mesh_launch(mesh),
        "tests/scripts/mesh_run.py",
        str(out),
        str(STEPS),
        json.dumps(config),
    ]
    return subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), **env},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )


def _results(out: Path, count: int) -> list:
    return [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(count)]


def _finish(proc: subprocess.Popen) -> str:
    output, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, output[-3000:]
    return output


def _progress(out: Path, rank: int) -> tuple[int, int] | None:
    try:
        pid, step = (out / "progress" / f"r{rank}.g0").read_text().split()
        return int(pid), int(step)
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def uninterrupted_2x2(tmp_path_factory) -> Path:
    """The output folder of an uninterrupted 2x2 run without the anchor, checkpointing every 4 steps."""
    full = tmp_path_factory.mktemp("full")
    _finish(_launch("2x2", full, {"anchor": False}, CHECKPOINT_EVERY="4"))
    return full


def _assert_continues_exactly(full: Path, resumed: Path, start: int) -> None:
    """The resumed run's losses, θ_global and parameters are the uninterrupted run's from ``start`` on."""
    for before, after in zip(_results(full, 4), _results(resumed, 4)):
        assert after.first_step == start and after.steps == STEPS - start
        assert after.losses == before.losses[start:]  # last stages: exact floats; others log none
        for mine, theirs in zip(before.global_params, after.global_params):
            assert torch.equal(mine, theirs)
        assert after.params.keys() == before.params.keys()
        assert all(torch.equal(before.params[n], after.params[n]) for n in before.params)


@pytest.mark.slow
def test_a_mesh_killed_by_pid_resumes_bit_exactly_without_the_anchor(tmp_path, uninterrupted_2x2):
    """Uninterrupted 2x2 run vs the same run SIGKILLed (every process, by PID) after step 10 and
    resumed from its newest complete checkpoint: the same losses and θ_global, bit for bit. The ranks
    hold after step 10 (``HOLD_FOR_RESTART_AT``, an event, not a pace) so the kill lands there on any
    machine: the newest complete checkpoint is step 8's."""
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    config = {"anchor": False}
    run = _launch("2x2", killed, config, CHECKPOINT_EVERY="4", CHECKPOINT_KEEP="2", HOLD_FOR_RESTART_AT="10")
    deadline = time.monotonic() + 120
    while any((seen := _progress(killed, r)) is None or seen[1] < 10 for r in range(4)):
        assert run.poll() is None and time.monotonic() < deadline
        time.sleep(0.05)
    for pid in [_progress(killed, rank)[0] for rank in range(4)]:
        # the launcher stops the others once one is dead: a process already gone is killed too
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    run.communicate(timeout=60)
    assert run.returncode != 0
    # the newest complete checkpoint: every rank holds after step 10, so step 12's was never begun
    checkpoint = resolve_resume(True, str(killed), MeshTopology(2, 2, anchor=False))
    complete = complete_checkpoints(str(killed), MeshTopology(2, 2, anchor=False))
    assert len(complete) <= 2 and checkpoint == complete[-1][1]  # rotated; (step, path), oldest first
    start = int(checkpoint.rsplit("-", 1)[1])
    assert start == 8, checkpoint
    _finish(_launch("2x2", resumed, config, RESUME_FROM=checkpoint))
    _assert_continues_exactly(uninterrupted_2x2, resumed, start)


@pytest.mark.slow
def test_a_run_with_int8_pseudo_gradients_on_a_variable_size_coded_wire_resumes_bit_exactly(tmp_path):
    """The int8 codes' error feedback (``dp_quantize``) is part of the checkpoint: resumed from step 8, the
    run ends as the uninterrupted one did, bit for bit (without it the later syncs would differ). Its rows
    are of different lengths and its boundary is rotated, asymmetric and zstd-coded: each boundary message
    carries a row only up to its length, and the resumed run still repeats the run exactly."""
    codec = "outliers2+rot16+int4g16e8m0/rot16+int8+zstd"
    config = {"anchor": False, "dp_quantize": "int8", "dp_powersgd_rank": 2, "mask_ratio": 0.0, "boundary_codec": codec}
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _finish(_launch("2x2", full, config, CHECKPOINT_EVERY="4", VARIABLE_ROWS="1"))
    _finish(_launch("2x2", resumed, config, RESUME_FROM=str(full / "checkpoint-8"), VARIABLE_ROWS="1"))
    _assert_continues_exactly(full, resumed, 8)
    for result in _results(full, 4):  # the wire carried fewer positions than the padded batch holds
        assert result.result.tokens < STEPS * 2 * 2 * 16
        if result.result.stage == 0:
            assert result.result.wire["coded"]["pp_fwd"] > 0


@pytest.mark.slow
def test_a_rank_killed_while_writing_its_checkpoint_resumes_from_the_previous_complete_one(tmp_path, uninterrupted_2x2):
    """Rank 3 is SIGKILLed halfway through writing its file of step 12 (``KILL_DURING_SAVE``: half the
    bytes fsynced under the temporary name, then the signal). Step 12's checkpoint lacks rank 3's file,
    so the newest complete one is step 8's; the run resumed from it continues bit-exactly, and the torn
    temporary file is not something a load would accept."""
    killed, resumed = tmp_path / "killed", tmp_path / "resumed"
    topology = MeshTopology(2, 2, anchor=False)
    run = _launch("2x2", killed, {"anchor": False}, CHECKPOINT_EVERY="4", KILL_DURING_SAVE="12:3", LINK_TIMEOUT_S="10")
    output, _ = run.communicate(timeout=300)
    assert run.returncode != 0, output[-2000:]
    folder = killed / "checkpoint-12" / "mesh"
    torn = list(folder.glob("rank3.pt.tmp-*"))
    assert len(torn) == 1 and torn[0].stat().st_size > 0 and not (folder / "rank3.pt").exists()
    with pytest.raises(Exception):  # half a zip archive: torch refuses it
        torch.load(torn[0], weights_only=True)
    assert [step for step, _ in complete_checkpoints(str(killed), topology)] == [4, 8]
    checkpoint = resolve_resume(True, str(killed), topology)
    assert checkpoint == str(killed / "checkpoint-8")
    _finish(_launch("2x2", resumed, {"anchor": False}, RESUME_FROM=checkpoint))
    _assert_continues_exactly(uninterrupted_2x2, resumed, 8)


@pytest.mark.slow
def test_a_resumed_mesh_with_the_anchor_in_lockstep_continues_bit_exactly(tmp_path):
    """3x2 with the anchor in lockstep (a snapshot every 2 steps, its gradient applied at once) and a
    codec whose geometry it refits every round: the run resumed from step 8 repeats the uninterrupted
    one bit for bit — losses, fast parameters, θ_global, the anchor's rounds (the snapshot of step 8
    first, as the checkpoint holds it), the step at which each of its gradients was applied, and the
    geometry both sides of the boundary switched to after each of those steps."""
    full, resumed = tmp_path / "full", tmp_path / "resumed"
    _finish(_launch("3x2", full, ANCHOR, CHECKPOINT_EVERY="8"))
    _finish(_launch("3x2", resumed, ANCHOR, RESUME_FROM=str(full / "checkpoint-8")))
    before, after = _results(full, 6), _results(resumed, 6)
    for b, a in zip(before, after):
        if b.role == "anchor":
            assert b.anchor_rounds == list(range(0, STEPS + 1, 2)) and a.anchor_rounds == b.anchor_rounds[4:]
            assert a.losses == b.losses[4:]
            if b.stage == 0:  # it fits boundary 0
                assert [s for s, _ in b.geometry] == b.anchor_rounds and a.geometry == b.geometry[4:]
            continue
        assert a.first_step == 8 and a.steps == STEPS - 8
        assert b.arrivals == [(s, s) for s in range(0, STEPS, 2)] + [(STEPS, STEPS)]
        assert a.arrivals == b.arrivals[4:]
        sent = dict(before[4].geometry)  # the anchor's fits of boundary 0, by snapshot
        assert [(step, s) for step, s, _, _ in b.geometry] == [(s, s) for s in range(0, STEPS, 2)]
        side = 3 if b.stage == 0 else 2  # (step, snapshot, digest in, digest out): stage 0 encodes, stage 1 decodes
        assert [entry[side] for entry in b.geometry] == [sent[s] for _, s, _, _ in b.geometry]
        assert a.geometry == b.geometry[4:]
        assert a.losses == b.losses[8:]
        for mine, theirs in zip(b.global_params, a.global_params):
            assert torch.equal(mine, theirs)
        assert a.params.keys() == b.params.keys()
        assert all(torch.equal(b.params[n], a.params[n]) for n in b.params)


def test_a_rank_file_of_another_format_or_rank_is_refused_by_name(tmp_path):
    _save_all(tmp_path, 4)
    files = tmp_path / "checkpoint-4" / "mesh"
    torch.save({"step": 4}, files / "rank0.pt")  # no format marker: not written by a mesh process
    with pytest.raises(ValueError, match=r"rank0.pt' is invalid: it must hold a format-1 mesh state"):
        read_rank_state(str(tmp_path / "checkpoint-4"), 0, MESH)
    (files / "rank2.pt").write_bytes((files / "rank1.pt").read_bytes())  # rank 1's state under rank 2's name
    with pytest.raises(ValueError, match=r"rank2.pt' is invalid: it must hold rank 2's state \(it holds rank 1\)"):
        read_rank_state(str(tmp_path / "checkpoint-4"), 2, MESH)


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"checkpoint_dir": ".", "checkpoint_every": 0},
            "checkpoint_every=0 is invalid: it must be None or an int >= 1",
        ),
        ({"checkpoint_keep": 0}, "checkpoint_keep=0 is invalid: it must be None or an int >= 1"),
    ],
)
def test_checkpoint_settings_are_validated(sizes, message):
    from hf_meshtune.config import MeshConfig
    from hf_meshtune.runtime.settings import RunSettings

    with pytest.raises(ValueError, match=message):
        RunSettings(config=MeshConfig(), microbatch_size=1, microbatches=1, seq_len=8, max_steps=1, **sizes)


def test_a_state_of_another_stage_split_is_refused_before_it_is_loaded():
    """Healing or resuming copies a peer's parameters by name: a state whose names differ (another
    model or stage split) is refused, naming what it holds, before anything is overwritten."""
    from hf_meshtune.pipeline.stage import StageModule
    from hf_meshtune.runtime.fast_state import restore_stage
    from hf_meshtune.runtime.worker import FastWorker
    from tests.tiny import tiny_llama

    model = tiny_llama(seed=0, layers=4, hidden=64)
    worker = FastWorker.__new__(FastWorker)
    worker.model, worker.module = model, StageModule(model, 0, 2, None, None)
    before = model.model.embed_tokens.weight.detach().clone()
    with pytest.raises(
        ValueError,
        match=r"healing state=\['model.layers.3.mlp.down_proj.weight'\] is invalid: it must "
        r"hold this stage's trainable parameters",
    ):
        restore_stage(worker, {"params": {"model.layers.3.mlp.down_proj.weight": torch.zeros(64, 128)}, "step": 3})
    assert torch.equal(model.model.embed_tokens.weight, before)
