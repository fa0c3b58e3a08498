"""The anchor replica killed by PID mid-run: the fast circuit trains on to the end without it.

A real 3x2 mesh (2 fast replicas + the anchor) on ``meshtune launch --optional-replica 2``
(``tests/scripts/mesh_run.py``); the anchor's stage 0 is SIGKILLed once the fast replicas have taken
KILL_AT steps. The launcher stops the rest of the anchor replica and keeps the fast ones; every fast
process warns once that the anchor link broke and finishes every step, SpectralAdamW fading the last
bases out after ``anchor_max_staleness``.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch

from tests.distributed import mesh_launch

REPO = Path(__file__).resolve().parents[1]
STEPS, KILL_AT = 40, 12
CONFIG = {"anchor": True, "anchor_every": 2, "anchor_delay": 0, "spectral_tau": 1e-3, "anchor_max_staleness": 4}


def _read(path: Path) -> str | None:
    try:
        return path.read_text()
    except OSError:
        return None


@pytest.mark.slow
def test_killing_the_anchor_leaves_the_fast_circuit_training_to_the_end(tmp_path):
    command = [
        *mesh_launch("3x2", "--optional-replica", "2"),
        "tests/scripts/mesh_run.py",
        str(tmp_path),
        str(STEPS),
        json.dumps(CONFIG),
    ]
    launcher = subprocess.Popen(
        command,
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO), "STEP_SECONDS": "0.05"},
        text=True,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    deadline = time.monotonic() + 180
    try:
        while (seen := _read(tmp_path / "progress" / "r1.g0")) is None or int(seen.split()[1]) < KILL_AT:
            assert launcher.poll() is None and time.monotonic() < deadline, "the mesh did not reach the kill step"
            time.sleep(0.05)
        os.kill(int(_read(tmp_path / "progress" / "pid4.g0")), signal.SIGKILL)
        output, _ = launcher.communicate(timeout=240)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 0, output[-3000:]
    assert "rank 4 (r2s0) failed with exit code 137: optional replica 2 is lost; the other replicas go on" in output
    results = [torch.load(tmp_path / f"result{r}.pt", weights_only=False) for r in range(4)]
    for result in results:
        assert result.steps == STEPS  # not one step lost
        assert result.anchor_lost_at is not None and result.anchor_lost_at >= KILL_AT - 2
        arrivals_after = [a for a, _ in result.arrivals if a > result.anchor_lost_at]
        assert not arrivals_after  # nothing from a dead anchor
        assert any(a < KILL_AT for a, _ in result.arrivals)  # it was delivering before
    assert output.count("lost the anchor link at step") == 4  # one warning per fast process
    assert "fades them out after anchor_max_staleness=4 steps" in output
    for stage in (0, 1):  # the fast replicas still share θ_global
        for mine, theirs in zip(results[stage].global_params, results[2 + stage].global_params):
            assert torch.equal(mine, theirs)
    for result in (results[1], results[3]):
        assert sum(result.losses[-5:]) / 5 < sum(result.losses[:5]) / 5
