"""A checkpoint written by older code (tests/fixtures/v0_checkpoint) still resumes bit-exactly.

What it protects: the on-disk checkpoint format as read back on resume, across refactors that move
modules. The fixture's checkpoint-2 was written by the code of the commit in expected.json
("git_commit") and holds
- ``mesh_state.pt``: its keys ``config`` / ``boundaries`` (step, the ``mean`` fill's mean/sums/counts,
  protected dims) / ``anchor`` (a pending anchor gradient: snapshot at fast step 1, due at fast step 2,
  0-based, i.e. landing in the resumed run's first step; ``rounds_done``, ``last_staleness``);
- ``optimizer.pt``: SpectralAdamW's state per parameter (``exp_avg``, ``exp_avg_sq``, the anchor
  momentum ``anchor_momentum``, the basis ``anchor_U`` / ``anchor_V`` / ``anchor_d``, ``anchor_updates``,
  ``anchor_age``) and its param_group knobs;
- the Trainer's own ``model.safetensors``, ``scheduler.pt``, ``rng_state.pth`` and ``trainer_state.json``.
The current code rebuilds the same trainer from expected.json, resumes from that checkpoint and must
give the very same losses at steps 3 and 4 and the same final parameters (sha256) as the run of the
recording code. A renamed key, a module path pickled into a file, a dropped optimizer-state entry or a
changed fill/anchor restore shows up here.

The resume runs in a fresh process with the numeric kernels pinned to paths that do not depend on the
processor (tests/fixtures/v0_resume.py says why: MKL's and ATen's fast paths differ in the last bits
between processors and even between process states, by 0.4 % of the parameters after two steps), and
expected.json's losses and sha were recorded under the same pinning.

The pinning gives the same losses on every processor seen so far, but not always the same last bits of
the parameters: the v0 code itself gives another sha on an AMD EPYC with AVX-512 than where the fixture
was recorded. Each such sha, produced by the recording code on that processor, is listed in expected.json
(``final_params_sha256_on_other_processors``); the current code must give the losses exactly and one of
the recorded shas.

Re-record the expected figures with the code that wrote the checkpoint, keeping the checkpoint (when
the libraries change the last bits; on a new processor, add its sha to that list instead), or regenerate
the whole fixture (only when the format is meant to change, then say so in the commit):

    cd /work/main && git worktree add /tmp/v0 <commit>   # expected.json's "git_commit" to re-record
    cp tests/fixtures/make_v0_checkpoint.py tests/fixtures/v0_resume.py /tmp/v0/tests/fixtures/
    cd /tmp/v0 && PYTHONPATH=/tmp/v0 /work/main/.venv/bin/python tests/fixtures/make_v0_checkpoint.py \
        --out /work/main/tests/fixtures/v0_checkpoint [--rerecord]
    cd /work/main && git worktree remove /tmp/v0 --force

(the generator itself checks that the same code resumes its checkpoint exactly before writing it).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.fixtures.v0_resume import PINNED_KERNELS, pinned_env

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "v0_checkpoint"


def test_v0_checkpoint_resumes_bit_exactly(tmp_path):
    fixture = tmp_path / "v0_checkpoint"
    shutil.copytree(FIXTURE, fixture)
    expected = json.loads((fixture / "expected.json").read_text())
    checkpoint = fixture / expected["checkpoint"]

    # the fixture still holds what this test claims to cover (read with torch alone, no package code)
    mesh_state = torch.load(checkpoint / "mesh_state.pt", weights_only=True)
    assert set(mesh_state) == {"config", "boundaries", "anchor"}
    assert [set(f) for f in mesh_state["boundaries"]["fills"]] == [{"mean", "sums", "counts"}]
    assert [(p[0], p[1]) for p in mesh_state["anchor"]["pending"]] == [(1, 2)]
    optimizer_state = torch.load(checkpoint / "optimizer.pt", weights_only=True)["state"]
    assert any({"anchor_momentum", "anchor_U", "anchor_V", "anchor_d"} <= set(s) for s in optimizer_state.values())
    assert expected["pinned_kernels"] == PINNED_KERNELS  # recorded under the pinning the test runs with

    run = subprocess.run(
        [sys.executable, str(ROOT / "tests" / "fixtures" / "v0_resume.py"), str(fixture), str(tmp_path / "out")],
        env=pinned_env(str(ROOT)),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    resumed = json.loads(run.stdout.strip().splitlines()[-1])
    # Exact equality: pinned kernels, same seeds, one thread. (A torch/transformers upgrade may
    # legitimately change the last bits: then re-record with the old package code and the new libraries.)
    assert resumed["losses"] == expected["losses"], (resumed["losses"], expected["losses"], expected["versions"])
    recorded = [expected["final_params_sha256"]]
    recorded += [other["final_params_sha256"] for other in expected.get("final_params_sha256_on_other_processors", [])]
    assert resumed["final_params_sha256"] in recorded, (resumed["final_params_sha256"], recorded)


def test_a_knob_the_checkpoint_predates_counts_at_its_default():
    """The v0 checkpoint's config has no governor or cadence knobs: resuming with their defaults is the same
    run (above); resuming with another value is refused, naming the default the checkpoint implies."""
    from hf_meshtune.config import MeshArguments, require_saved_knobs
    from hf_meshtune.engine import RESUME_KNOBS

    saved = torch.load(FIXTURE / "checkpoint-2" / "mesh_state.pt", weights_only=False)["config"]
    assert "fidelity_target" not in saved and "anchor_cadence" not in saved
    knobs = {k: v for k, v in saved.items() if k in {f.name for f in dataclasses.fields(MeshArguments)}}
    require_saved_knobs(saved, MeshArguments(**knobs), RESUME_KNOBS)
    with pytest.raises(ValueError, match=r"fidelity_target=0\.9 is invalid: .*checkpoint's value 0\.96"):
        require_saved_knobs(saved, MeshArguments(**{**knobs, "fidelity_target": 0.9}), RESUME_KNOBS)
