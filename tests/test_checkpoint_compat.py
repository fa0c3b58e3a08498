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
give the very same losses at steps 3 and 4 and the same final parameters (sha256) as the run that
wrote it. A renamed key, a module path pickled into a file, a dropped optimizer-state entry or a
changed fill/anchor restore shows up here.

Regenerate the fixture (only when the format is meant to change, then say so in the commit):

    cd /work/main && git worktree add /tmp/v0 HEAD   # or the commit whose format is to be frozen
    cp tests/fixtures/make_v0_checkpoint.py /tmp/v0/tests/fixtures/
    cd /tmp/v0 && PYTHONPATH=/tmp/v0 /work/main/.venv/bin/python tests/fixtures/make_v0_checkpoint.py \
        --out /work/main/tests/fixtures/v0_checkpoint
    cd /work/main && git worktree remove /tmp/v0 --force

(the generator itself checks that the same code resumes its checkpoint exactly before writing it).
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import torch

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from tests.tiny import pattern_dataset, tiny_llama

FIXTURE = Path(__file__).parent / "fixtures" / "v0_checkpoint"


def _params_sha256(model: torch.nn.Module) -> str:
    """As expected.json's "sha_definition": float32 bytes of state_dict() values, sorted keys."""
    digest = hashlib.sha256()
    state = model.state_dict()
    for key in sorted(state):
        digest.update(state[key].detach().to(torch.float32).contiguous().cpu().numpy().tobytes())
    return digest.hexdigest()


def _without_factory(spec: dict) -> dict:
    return {k: v for k, v in spec.items() if k != "factory"}


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

    threads = torch.get_num_threads()
    torch.set_num_threads(expected["torch_num_threads"])
    try:
        args = MeshTrainingArguments(output_dir=str(tmp_path / "out"), **expected["trainer_args"])
        trainer = MeshTrainer(
            model=tiny_llama(**_without_factory(expected["model"])),
            args=args,
            train_dataset=pattern_dataset(**_without_factory(expected["dataset"])),
        )
        trainer.train(resume_from_checkpoint=str(checkpoint))
    finally:
        torch.set_num_threads(threads)

    resume_step = expected["resume_step"]
    losses = {str(h["step"]): h["loss"] for h in trainer.state.log_history if "loss" in h and h["step"] > resume_step}
    # Exact equality: same kernels, same seeds, one thread; the generator checks that the writing code
    # itself resumes exactly. (A torch/transformers upgrade may legitimately change the last bits:
    # then regenerate the fixture with the old package code and the new libraries.)
    assert losses == expected["losses"], (losses, expected["losses"], expected["versions"])
    assert _params_sha256(trainer.model) == expected["final_params_sha256"]
