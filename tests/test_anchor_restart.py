"""With the anchor on, a killed process of any replica is restarted and the mesh goes on: the anchor link
restarts with it (``comm.pairlink``).

A real 3×2 mesh on ``meshtune launch --max-restarts 1`` (``tests/scripts/mesh_run.py``): fast replicas 0
and 1, the anchor replica 2, each replica a gloo world of its own, Streaming DiLoCo + PowerSGD through
a torchft lighthouse (int8 codes), the anchor's gradients over one gloo pair per (anchor stage, fast stage). Two
runs: fast replica 0's stage 1 (mesh rank 1, the stage that forwards every outer update to the anchor)
is SIGKILLed at step 10, or the anchor's stage 1 (mesh rank 5) is.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import mesh_launch

pytestmark = pytest.mark.slow  # real launches with kills and restarts

REPO = Path(__file__).resolve().parents[1]
STEPS, KILL_AT, EVERY = 60, 10, 4
# int8 DiLoCo codes: the updates fast replica 0 forwards travel as their codes (dp.quantize.Int8Codes), which
# the anchor must replay bitwise across a restart of either end
ANCHOR = '{"anchor": true, "anchor_every": %d, "dp_quantize": "int8"}' % EVERY


def _step(out: Path, rank: int) -> int:
    try:
        return int((out / "progress" / f"r{rank}.g0").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return -1


def _run(out: Path, victim: int) -> dict:
    """Kill mesh rank ``victim`` once fast rank 2 (replica 1, never killed here) has taken KILL_AT steps."""
    command = [*mesh_launch("3x2", "--max-restarts", "1"), "tests/scripts/mesh_run.py", str(out), str(STEPS), ANCHOR]
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RESTART_AFTER_STEP": str(KILL_AT + 6),  # the others go on without it for a while
        "HOLD_FOR_RESTART_AT": str(KILL_AT + 12),  # and wait there until it has started
        "STEP_SECONDS": "0.1",
    }
    launcher = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        while _step(out, 2) < KILL_AT:
            assert launcher.poll() is None and time.monotonic() < deadline, "the mesh did not reach the kill step"
            time.sleep(0.05)
        os.kill(int((out / "progress" / f"pid{victim}.g0").read_text()), signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    results = [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(6)]
    return {"rc": launcher.returncode, "output": output, "results": results}


@pytest.fixture(scope="module")
def fast_killed(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("fast_killed"), victim=1)


@pytest.fixture(scope="module")
def anchor_killed(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("anchor_killed"), victim=5)


def _assert_one_global_state(results) -> None:
    """θ_global is one on every fast replica, and the anchor's stages hold it too, bitwise: the anchor's
    follower is whole (a SYNC replaced what it missed, then it replayed every update after it)."""
    for stage in (0, 1):
        reference = results[stage].global_params
        for replica in (1, 2):
            for mine, theirs in zip(reference, results[replica * 2 + stage].global_params, strict=True):
                assert torch.equal(mine, theirs), (stage, replica)


def test_a_killed_fast_rank_restarts_heals_and_the_run_completes(fast_killed):
    assert fast_killed["rc"] == 0, fast_killed["output"][-3000:]
    assert "rank 1 (r0s1) failed with exit code 137: restarting replica 0 (1/1)" in fast_killed["output"]
    for rank in (0, 1):  # the restarted replica took a peer's state
        assert len(fast_killed["results"][rank].heals) == 1


def test_the_restarted_forwarder_resyncs_the_anchor_and_its_deliveries_reach_it_again(fast_killed):
    results = fast_killed["results"]
    for stage in (0, 1):
        fast, anchor = results[stage], results[4 + stage]
        (sync,) = fast.anchor_syncs  # one SYNC, at its first committed sync after healing
        assert sync > fast.heals[0][1]
        assert anchor.anchor_syncs == [sync]  # the anchor's stage loaded it
        after = [snapshot for _, snapshot in fast.arrivals if snapshot >= sync]
        assert len(after) >= 3, fast.arrivals  # the anchor's gradients reach the restarted process again
    for rank in (2, 3):  # the other fast replica trained on; the anchor's rounds resumed after the SYNC (the
        # anchor replays replica 0's updates only, so it has no new snapshot while replica 0 is away)
        assert results[rank].steps == STEPS and not results[rank].heals
        sync = results[rank % 2].anchor_syncs[0]
        assert len([snapshot for _, snapshot in results[rank].arrivals if snapshot >= sync]) >= 3


def test_with_a_fast_rank_restarted_theta_global_is_one_everywhere(fast_killed):
    _assert_one_global_state(fast_killed["results"])


def test_a_killed_anchor_stage_restarts_and_rejoins_the_running_mesh(anchor_killed):
    run = anchor_killed
    assert run["rc"] == 0, run["output"][-3000:]
    assert "rank 5 (r2s1) failed with exit code 137: restarting replica 2 (1/1)" in run["output"]
    results = run["results"]
    for rank in range(4):  # no fast process restarted or lost a step
        assert results[rank].steps == STEPS and not results[rank].heals
    for stage in (0, 1):
        anchor = results[4 + stage]
        (sync,) = anchor.anchor_syncs  # θ_global from fast replica 0's SYNC, no resume of the mesh
        assert sync > KILL_AT
        assert results[stage].anchor_syncs == [sync]
    # stage 0 picks every round's snapshot: the first is the state it rejoined with (each stage of replica 0
    # sends its SYNC at its own next committed sync, so stage 1's may be a sync later)
    assert results[4].anchor_rounds[0] == results[4].anchor_syncs[0]
    assert results[4].anchor_rounds == results[5].anchor_rounds


def test_the_rejoined_anchors_deliveries_are_applied_again(anchor_killed):
    results = anchor_killed["results"]
    sync = results[4].anchor_syncs[0]
    for rank in range(4):
        after = [(step, snapshot) for step, snapshot in results[rank].arrivals if snapshot >= sync]
        # applied (an arrival is recorded when it goes into SpectralAdamW), fresh, and until the end
        assert len(after) >= 3, results[rank].arrivals
        assert all(step - snapshot <= EVERY for step, snapshot in after), after
        assert results[rank].anchor_lost_at is None


def test_with_the_anchor_restarted_theta_global_is_one_everywhere(anchor_killed):
    _assert_one_global_state(anchor_killed["results"])
