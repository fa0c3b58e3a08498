"""Checkpoints of the distributed mesh: one file per fast process, complete when every fast process wrote its own.

Layout: ``OUTPUT_DIR/checkpoint-N/mesh/rank{r}.pt`` for every fast mesh rank r, written by that
process after fast step N (write to a temporary name, then rename: a kill mid-save leaves no partial
file). A checkpoint counts only when all fast ranks' files are there: a run killed while some ranks
were still writing step N resumes from the newest *complete* one. Rotation (``keep``): after its
save, a process removes the checkpoint folders older than the newest ``keep`` complete ones
(complete or not); nobody writes into those any more and a resume never needs them, so the newest
complete checkpoint is never lost to a crash.

Anchor processes write nothing: on resume the anchor replica rebuilds its state from fast replica
0's file of its stage (θ_global of every DiLoCo fragment and the outer momentum it replays with)
and starts its next round at the checkpoint's step.

Steps must fall on DiLoCo's fragment period (``dp_sync_every / dp_fragments``), so no fragment
sync is in flight in the saved state.
"""

from __future__ import annotations

import glob
import os
import re
import shutil

import torch

from .._validation import require
from ..topology import MeshTopology

__all__ = [
    "complete_checkpoints",
    "latest_complete_checkpoint",
    "read_rank_state",
    "require_complete",
    "resolve_resume",
    "save_rank_state",
]

_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
FORMAT = 1


def atomic_torch_save(obj, path: str) -> None:
    """Write then rename, so a crash mid-save never leaves a truncated file under ``path``."""
    tmp = f"{path}.tmp-{os.getpid()}"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load_torch_file(path: str, field: str, written_by: str):
    """``torch.load`` (tensors only), or a ValueError naming the file when it is truncated, empty or foreign."""
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # torch raises RuntimeError, EOFError or UnpicklingError for a damaged file
        first = (str(err).splitlines() or [""])[0][:200] or "no message: the file is empty or cut short"
        raise ValueError(
            f"{field}={path!r} is invalid: it must be a readable file written by {written_by} "
            f"({type(err).__name__}: {first})"
        ) from err


def rank_file(checkpoint: str, rank: int) -> str:
    return os.path.join(checkpoint, "mesh", f"rank{rank}.pt")


def _fast_ranks(topology: MeshTopology) -> list[int]:
    return [topology.rank(r, s) for r in topology.fast_replicas for s in range(topology.stages)]


def _missing(checkpoint: str, topology: MeshTopology) -> list[int]:
    return [r for r in _fast_ranks(topology) if not os.path.isfile(rank_file(checkpoint, r))]


def complete_checkpoints(output_dir: str, topology: MeshTopology) -> list[tuple[int, str]]:
    """``(step, path)`` of every complete mesh checkpoint under ``output_dir``, oldest first."""
    if not os.path.isdir(output_dir):
        return []
    found = []
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and os.path.isdir(os.path.join(path, "mesh")) and not _missing(path, topology):
            found.append((int(match.group(1)), path))
    return sorted(found)


def latest_complete_checkpoint(output_dir: str, topology: MeshTopology) -> str | None:
    found = complete_checkpoints(output_dir, topology)
    return found[-1][1] if found else None


def save_rank_state(
    output_dir: str, step: int, rank: int, state: dict, topology: MeshTopology, keep: int | None
) -> str:
    """Write this process's state of step ``step`` atomically; then drop its own files of checkpoints
    older than the newest ``keep`` complete ones. Returns the checkpoint folder."""
    checkpoint = os.path.join(output_dir, f"checkpoint-{step}")
    path = rank_file(checkpoint, rank)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    atomic_torch_save(
        {
            "format": FORMAT,
            "step": step,
            "rank": rank,
            "mesh": f"{topology.replicas}x{topology.stages}",
            "anchor": topology.anchor,
            **state,
        },
        path,
    )
    # a torn file of this rank's that a killed writer left here (its PID in the name): the only live
    # writer of rank `rank` is this process, and the complete file is now in place
    for stale in glob.glob(f"{glob.escape(path)}.tmp-*"):
        os.remove(stale)
    if keep:
        complete = complete_checkpoints(output_dir, topology)
        if len(complete) >= keep:
            _remove_older_than(output_dir, complete[-keep][0])
    return checkpoint


def _remove_older_than(output_dir: str, step: int) -> None:
    """Remove mesh checkpoint folders of steps before ``step`` (complete or not): a resume uses the
    newest complete one, which is at or after ``step``; no process writes into older folders."""
    for name in os.listdir(output_dir):
        match = _CHECKPOINT.match(name)
        path = os.path.join(output_dir, name)
        if match and int(match.group(1)) < step and os.path.isdir(os.path.join(path, "mesh")):
            shutil.rmtree(path, ignore_errors=True)


def require_complete(checkpoint: str, topology: MeshTopology) -> None:
    """A ValueError unless ``checkpoint`` is a mesh checkpoint folder with every fast rank's file."""
    require(
        os.path.isdir(os.path.join(checkpoint, "mesh")),
        "resume_from_checkpoint",
        checkpoint,
        "be a mesh checkpoint folder (checkpoint-N holding mesh/rank<r>.pt, written by a distributed mesh run)",
    )
    missing = _missing(checkpoint, topology)
    require(
        not missing,
        "resume_from_checkpoint",
        checkpoint,
        f"hold the state of every fast rank (missing mesh/rank{{r}}.pt for r in {missing}: a save that did not "
        "complete; resume from an older checkpoint)",
    )


def resolve_resume(resume: bool | str | None, output_dir: str, topology: MeshTopology) -> str | None:
    """``Trainer.train(resume_from_checkpoint=...)`` on the mesh: True = the newest complete checkpoint in
    ``output_dir``, a path = that checkpoint (checked complete), None/False = a fresh start."""
    if resume is None or resume is False:
        return None
    if resume is True:
        found = latest_complete_checkpoint(output_dir, topology)
        require(
            found is not None,
            "resume_from_checkpoint",
            True,
            f"find a complete mesh checkpoint (checkpoint-N/mesh/) in output_dir={output_dir!r} (there is none)",
        )
        return found
    require_complete(str(resume), topology)
    return str(resume)


def read_rank_state(checkpoint: str, rank: int, topology: MeshTopology) -> dict:
    """The state mesh rank ``rank`` saved in ``checkpoint``, after checking the checkpoint is complete
    and was written by a mesh of this shape (a ValueError naming what differs otherwise)."""
    require_complete(checkpoint, topology)
    path = rank_file(checkpoint, rank)
    state = load_torch_file(path, "mesh checkpoint file", "a mesh process")
    require(
        isinstance(state, dict) and state.get("format") == FORMAT,
        "mesh checkpoint file",
        path,
        f"hold a format-{FORMAT} mesh state",
    )
    shape = f"{topology.replicas}x{topology.stages}"
    require(
        state["mesh"] == shape and state["anchor"] == topology.anchor,
        "mesh",
        shape,
        f"equal the checkpoint's mesh {state['mesh']} (anchor={state['anchor']}) to resume from {checkpoint}",
    )
    require(
        state["rank"] == rank, "mesh checkpoint file", path, f"hold rank {rank}'s state (it holds rank {state['rank']})"
    )
    return state
