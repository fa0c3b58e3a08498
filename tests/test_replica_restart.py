"""A fast replica killed by PID mid-run is restarted by ``meshtune launch --max-restarts`` and heals from
a peer, while the other replicas keep training (torchft's quorum shrinks, then grows back).

The mesh is real: 3 replicas × 2 stages of a tiny Llama, each replica a gloo world of its own
(``tests/scripts/mesh_run.py``), Streaming DiLoCo + PowerSGD between them through a torchft
lighthouse on loopback.
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
STEPS, KILL_AT = 80, 10


def _progress(out: Path, rank: int, restart: int) -> tuple[int, int] | None:
    try:
        pid, step = (out / "progress" / f"r{rank}.g{restart}").read_text().split()
        return int(pid), int(step)
    except (OSError, ValueError):
        return None


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    """The whole run: replica 1's stage 1 (mesh rank 3) is SIGKILLed once it has taken KILL_AT steps."""
    out = tmp_path_factory.mktemp("replica_restart")
    command = [
        *mesh_launch("3x2", "--max-restarts", "1"),
        "tests/scripts/mesh_run.py",
        str(out),
        str(STEPS),
    ]
    # events, not clocks: the restarted replica joins once the others have reached step KILL_AT + 6 (at
    # least two syncs, one every dp_sync_every / dp_fragments = 2 steps, without it), and the others wait
    # after step KILL_AT + 12 until it has started (a restart is slow to import on a loaded machine)
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "RESTART_AFTER_STEP": str(KILL_AT + 6),
        "HOLD_FOR_RESTART_AT": str(KILL_AT + 12),
        "STEP_SECONDS": "0.1",
    }
    launcher = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        while (seen := _progress(out, 3, 0)) is None or seen[1] < KILL_AT:
            assert launcher.poll() is None and time.monotonic() < deadline, "the mesh did not reach the kill step"
            time.sleep(0.05)
        killed_at_time = time.time()
        os.kill(seen[0], signal.SIGKILL)
        survivors_at_kill = [(_progress(out, r, 0) or (0, 0))[1] for r in (1, 5)]
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    results = [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(6)]
    timelines = {}  # survivor rank → [(step, wall time at its end)], written by mesh_run.py
    for rank in (0, 1, 4, 5):
        lines = (out / "progress" / f"t{rank}.g0").read_text().split("\n")
        timelines[rank] = [(int(step), float(t)) for step, t in (line.split() for line in lines if line)]
    return {
        "kill_time": killed_at_time,
        "timelines": timelines,
        "rc": launcher.returncode,
        "output": output,
        "results": results,
        "killed_at": seen[1],
        "survivors_at_kill": survivors_at_kill,
    }


def test_the_launcher_restarts_the_killed_replica_and_the_run_completes(killed_run):
    assert killed_run["rc"] == 0, killed_run["output"][-3000:]
    assert (
        "rank 3 (r1s1) failed with exit code 137: restarting replica 1 (1/1); the other replicas go on"
        in killed_run["output"]
    )


def test_the_other_replicas_lose_no_step_and_the_quorum_shrinks_and_grows_back(killed_run):
    results = killed_run["results"]
    for rank in (0, 1, 4, 5):  # replicas 0 and 2 ran every step once, as if nothing happened
        assert results[rank].steps == STEPS and not results[rank].heals
    last_stages = [results[1], results[5]]
    for result in last_stages:
        assert len(result.losses) == STEPS
        participants = result.dp_participants
        assert participants[0] == 3 and participants[-1] == 3, participants
        assert 2 in participants  # a sync averaged without the dead replica: the quorum shrank
        assert participants.index(2) >= 1


def test_the_survivors_pause_under_five_seconds_when_a_peer_replica_dies(killed_run):
    # a survivor's next sync waits for the quorum that leaves the dead replica out, i.e. for the lighthouse
    # to miss its heartbeats (HEARTBEAT_TIMEOUT_MS = 2 s; torchft's default 5 s made this gap 4.9-5.0 s);
    # measured from the kill to the step where the survivors hold for the restart (HOLD_FOR_RESTART_AT)
    pauses = {}
    for rank, timeline in killed_run["timelines"].items():
        window = [(step, t) for step, t in timeline if t >= killed_run["kill_time"] and step <= KILL_AT + 12]
        assert len(window) >= 6, timeline  # they went on training after the kill
        pauses[rank] = max(b - a for (_, a), (_, b) in zip(window, window[1:]))
    assert max(pauses.values()) < 4.5, pauses  # the target is 5 s; a step here is ~0.2 s


def test_the_restarted_replica_heals_from_a_peer_and_ends_at_the_same_step(killed_run):
    for rank in (2, 3):
        heals = killed_run["results"][rank].heals
        assert len(heals) == 1
        own, peer = heals[0]
        assert own < peer and peer >= killed_run["killed_at"]  # it jumped ahead to where the others were
        # it ran from its own restart to the peer's step, then to the end: no step counted twice
        assert killed_run["results"][rank].steps == own + 1 + (STEPS - peer - 1)


def test_all_replicas_end_with_identical_synced_parameters(killed_run):
    results = killed_run["results"]
    for stage in (0, 1):
        reference = results[stage].global_params
        for replica in (1, 2):
            other = results[replica * 2 + stage].global_params
            assert len(other) == len(reference)
            for mine, theirs in zip(reference, other):
                assert torch.equal(mine, theirs)
    # and they trained: θ_global moved away from the initial weights
    from tests.tiny import tiny_llama

    initial = torch.cat([p.detach().reshape(-1) for p in tiny_llama(seed=0, layers=4, hidden=64).parameters()])
    assert not torch.equal(torch.cat(results[0].global_params)[:100], initial[:100])
