"""What a fast mesh process saves and takes back: the state a peer gives a restarted replica when it heals
(torchft reads it inside DiLoCo's step post-hook), its part of a mesh checkpoint, and a resume from one.

Functions of the ``FastWorker`` whose state they are (``runtime.worker`` delegates to them).
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING

import torch

from .._validation import require
from ..config import require_saved_knobs
from ..pipeline.stage import stage_parameter_names
from .checkpoint import read_rank_state

if TYPE_CHECKING:
    from .worker import FastWorker

__all__ = ["checkpoint_state", "restore_stage", "resume", "stage_state"]


def stage_state(worker: FastWorker) -> dict:
    """What a peer's stage s gives a restarted replica's stage s when it heals (torchft reads it in
    DiLoCo's step post-hook, during the quorum: the inner step of ``worker._step`` is done; its
    scheduler step is not)."""
    return {
        "step": worker._step,
        "params": {
            n: p.detach() for n, p in stage_parameter_names(worker.model, worker.module).items() if p.requires_grad
        },
        "optimizer": worker.optimizer.state_dict(),
        "scheduler": worker.scheduler.state_dict() if worker.scheduler is not None else None,
    }


def checkpoint_state(worker: FastWorker) -> dict:
    """This process's part of a mesh checkpoint (``runtime.checkpoint``): the healing state plus the
    knobs, the RNG and DiLoCo's state (θ_global, outer momentum, PowerSGD, manager step)."""
    return {
        **stage_state(worker),
        "config": dataclasses.asdict(worker.settings.config),
        "rng": torch.get_rng_state(),
        "diloco": worker._streaming.state_dict() if worker.manager is not None else None,
        "codecs": [c.geometry() if c is not None else None for c in (worker.module.codec_in, worker.module.codec_out)],
        "geometry_snapshot": None if worker.geometry is None else worker.geometry.current,
        "governor": None if worker.levels is None else worker.levels.state(worker._step),
        "ladder_codecs": [[c.geometry() for c in ladder] for ladder in worker.module.ladders.values() if ladder],
    }


def resume(worker: FastWorker, checkpoint: str) -> None:
    state = read_rank_state(checkpoint, worker.rank, worker.topology)
    require_saved_knobs(state["config"], worker.settings.config, context=f"to resume from {checkpoint}")
    worker._step = restore_stage(worker, state)
    ladders = [ladder for ladder in worker.module.ladders.values() if ladder]
    if ladders:  # governed: every level's geometry
        for ladder, geometries in zip(ladders, state["ladder_codecs"], strict=True):
            for codec, geometry in zip(ladder, geometries, strict=True):
                codec.load_geometry(geometry)
    saved = state.get("codecs") or (None, None)
    for codec, geometry in zip((worker.module.codec_in, worker.module.codec_out), saved):
        if not ladders and codec is not None and geometry is not None and geometry["rest_dims"] is not None:
            codec.load_geometry(geometry)  # the geometry the run had, not a new fit
    if worker.geometry is not None and state.get("geometry_snapshot") is not None:
        worker.geometry.current = state["geometry_snapshot"]  # later refits only
    if worker.levels is not None and state.get("governor") is not None:
        worker.levels.load_state(state["governor"], worker._step)
    if worker.manager is not None:
        worker._streaming.load_state_dict(state["diloco"])
    torch.set_rng_state(state["rng"])
    worker.result.first_step = worker._step


def restore_stage(worker: FastWorker, state: dict) -> int:
    """Load a stage state's parameters, optimizer and scheduler; returns its step."""
    params = stage_parameter_names(worker.model, worker.module)
    require(
        set(state["params"]) == {n for n, p in params.items() if p.requires_grad},
        "healing state",
        sorted(state["params"])[:3],
        "hold this stage's trainable parameters (a peer with another model or stage split)",
    )
    with torch.no_grad():
        for name, value in state["params"].items():
            params[name].copy_(value)
    worker.optimizer.load_state_dict(state["optimizer"])
    if worker.scheduler is not None and state["scheduler"] is not None:
        worker.scheduler.load_state_dict(state["scheduler"])
    return int(state["step"])
