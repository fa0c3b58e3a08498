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


def _timelines(out: Path) -> dict[int, list[tuple[int, float]]]:
    """Survivor rank → [(step, wall time at its end)], as mesh_run.py writes them."""
    timelines = {}
    for rank in (0, 1, 4, 5):
        lines = (out / "progress" / f"t{rank}.g0").read_text().split("\n")
        timelines[rank] = [(int(step), float(t)) for step, t in (line.split() for line in lines if line)]
    return timelines


def _run(out: Path, kill_in_sync: str | None = None) -> dict:
    """The whole run: replica 1's stage 1 (mesh rank 3) dies once, then is restarted with its replica.
    Without ``kill_in_sync`` the test SIGKILLs it once it has taken KILL_AT steps; with it
    (``rank:n``) the process SIGKILLs itself on entering its n-th DiLoCo all-reduce, while its peers
    are inside theirs."""
    command = [*mesh_launch("3x2", "--max-restarts", "1"), "tests/scripts/mesh_run.py", str(out), str(STEPS)]
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
    if kill_in_sync:
        env["KILL_IN_SYNC"] = kill_in_sync
    launcher = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    try:
        if kill_in_sync:
            pid_file = out / "progress" / "pid3.g0"
            while not pid_file.exists():
                assert launcher.poll() is None and time.monotonic() < deadline, "rank 3 did not start"
                time.sleep(0.05)
            pid = int(pid_file.read_text())
            while _alive(pid):
                assert launcher.poll() is None and time.monotonic() < deadline, "rank 3 did not die in its sync"
                time.sleep(0.02)
            killed_at_time, seen = time.time(), _progress(out, 3, 0) or (pid, 0)
        else:
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
    return {
        "kill_time": killed_at_time,
        "timelines": _timelines(out),
        "rc": launcher.returncode,
        "output": output,
        "results": results,
        "killed_at": seen[1],
        "survivors_at_kill": survivors_at_kill,
    }


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _longest_pause(run: dict, until_step: int) -> dict[int, float]:
    """Per survivor: the longest gap between two consecutive steps' ends after the death, up to ``until_step``."""
    pauses = {}
    for rank, timeline in run["timelines"].items():
        window = [(step, t) for step, t in timeline if t >= run["kill_time"] and step <= until_step]
        assert len(window) >= 4, timeline  # they went on training after the death
        pauses[rank] = max(b - a for (_, a), (_, b) in zip(window, window[1:]))
    return pauses


@pytest.fixture(scope="module")
def killed_run(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("replica_restart"))


@pytest.fixture(scope="module")
def died_in_sync_run(tmp_path_factory):
    # a sync is two bucketed all-reduces (P factors with the dense tensors, then Q factors): the 5th of
    # rank 3 is the P bucket of its third sync (step 6), whose peers are all inside theirs
    return _run(tmp_path_factory.mktemp("died_in_sync"), kill_in_sync="3:5")


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
    pauses = _longest_pause(killed_run, KILL_AT + 12)
    assert max(pauses.values()) < 4.5, pauses  # the target is 5 s; a step here is ~0.2 s


def test_a_peer_dying_inside_an_all_reduce_pauses_the_survivors_under_five_seconds(died_in_sync_run):
    # only the members whose part of the all-reduce touches the dead process see its connections break; a
    # survivor waiting for data from one of them used to wait out the 30 s collective timeout (30.2 s in 2
    # of 3 runs of this scenario; which members wait depends on how far each got, so a regression fails this
    # test in about that share of runs). The failed group now aborts itself (dp.ft.AbortingProcessGroupGloo),
    # which releases the others at once: 1.6-2.0 s in 5 of 5 runs.
    run = died_in_sync_run
    assert run["rc"] == 0, run["output"][-3000:]
    assert "restarting replica 1 (1/1)" in run["output"], run["output"][-3000:]
    pauses = _longest_pause(run, KILL_AT + 12)
    assert max(pauses.values()) < 4.5, pauses
    results = run["results"]
    for stage in (0, 1):  # and the mesh still ends with one θ_global
        for replica in (1, 2):
            for mine, theirs in zip(results[stage].global_params, results[replica * 2 + stage].global_params):
                assert torch.equal(mine, theirs)


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
