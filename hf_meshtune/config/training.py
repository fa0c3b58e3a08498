"""What transformers' ``TrainingArguments`` needs to carry the mesh knobs (``MeshArguments.__post_init__``
runs these on any ``TrainingArguments`` subclass, TRL's configs too): our optimizer name through its
closed enum, gloo as the process group's backend, and the mesh's servers bound before accelerate starts."""

from __future__ import annotations

import os

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from .._validation import require
from .presets import SPECTRAL_ADAMW

__all__ = ["prepare_training_arguments"]

# A built-in optimizer name that lets TrainingArguments.__post_init__ run for ours (its `optim`
# field is a closed enum): swapped in before and back out after.
_STAND_IN_OPTIM = "adamw_torch"


def _post_init_with_spectral_optim(args: TrainingArguments, parent_post_init) -> None:
    """Run ``TrainingArguments.__post_init__`` on args whose ``optim`` may be ``"spectral_adamw"``.

    transformers validates ``optim`` against its closed ``OptimizerNames`` enum there; a built-in
    name stands in for ours during that call and ours is put back after.
    """
    optim = getattr(args.optim, "value", args.optim)
    known = {name.value for name in OptimizerNames}
    require(
        optim == SPECTRAL_ADAMW or optim in known,
        "optim",
        optim,
        f"be '{SPECTRAL_ADAMW}' or one of transformers' OptimizerNames",
    )
    if optim != SPECTRAL_ADAMW:
        parent_post_init()
        return
    args.optim = _STAND_IN_OPTIM
    try:
        parent_post_init()
    finally:
        args.optim = SPECTRAL_ADAMW


def _require_gloo_backend(args) -> None:
    """The mesh's process group is gloo's, on GPUs too: in a launched process (LOCAL_RANK set, where
    accelerate would create an NCCL group on a GPU machine) ``ddp_backend`` unset becomes ``"gloo"``;
    any other backend is refused. Gloo runs over any TCP link, across the internet, and the mesh stages
    GPU tensors through CPU memory for its point-to-point sends."""
    if args.ddp_backend is None and int(os.environ.get("LOCAL_RANK", "-1")) != -1:
        args.ddp_backend = "gloo"
    require(
        args.ddp_backend in (None, "gloo"),
        "ddp_backend",
        args.ddp_backend,
        "be 'gloo' or unset: every link of the mesh (pipeline boundaries, DiLoCo syncs, the anchor) runs on "
        "gloo, over any TCP link, with GPU tensors staged through CPU memory; NCCL needs one fabric",
    )


def _bind_mesh_servers() -> None:
    """In a launched process, before accelerate creates its process group: with a secret, admission at
    the mesh's gate and a guard on every listener (``comm.gate``); gloo on ``$MESHTUNE_HOST``'s
    interface, and rank 0's rendezvous store on MASTER_ADDR only (``comm.listen``)."""
    if int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        return
    from ..comm.gate import guard_launched_process
    from ..comm.listen import gloo_interface, serve_rendezvous_store

    guard = guard_launched_process()
    gloo_interface()
    serve_rendezvous_store()
    if guard is not None:
        guard.scan()


def prepare_training_arguments(args: TrainingArguments, parent_post_init) -> None:
    """Before the knobs are validated: gloo as the backend, the mesh's servers bound, then
    ``TrainingArguments.__post_init__`` run with ``optim`` possibly ours."""
    _require_gloo_backend(args)
    _bind_mesh_servers()
    _post_init_with_spectral_optim(args, parent_post_init)
