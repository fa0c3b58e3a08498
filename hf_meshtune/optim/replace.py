"""Replacing a user's torch AdamW/Adam by ``SpectralAdamW`` (``MeshAccelerator.prepare``), LR schedulers included.

The new optimizer takes over the old one's param groups (same lr, betas, eps, weight decay per group);
LR schedulers built on the old optimizer are pointed at the new one and its ``step`` is marked the way
torch's ``LRScheduler`` marks the optimizer it is built on.
"""

from __future__ import annotations

import functools
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim.lr_scheduler import LRScheduler

from .._validation import require
from .spectral import SpectralAdamW, spectral_options

__all__ = ["move_schedulers", "spectral_adamw_like", "track_step_calls"]


# torch Adam/AdamW group keys that SpectralAdamW has no use for (checked below where they matter).
_ADAM_ONLY_KEYS = ("amsgrad", "maximize", "foreach", "capturable", "differentiable", "fused", "decoupled_weight_decay")


def spectral_adamw_like(optimizer: torch.optim.Optimizer, knobs: Any) -> SpectralAdamW:
    """A ``SpectralAdamW`` over ``optimizer``'s param groups, same lr/betas/eps/weight_decay per group,
    with the knobs' α, τ_p, β_anc, rank and relative τ (``spectral_options``). ``optimizer`` is a fresh
    torch Adam/AdamW."""
    name = type(optimizer).__name__
    require(
        not optimizer.state,
        "optimizer",
        name,
        "have taken no step yet when MeshAccelerator replaces it by SpectralAdamW (its moments would be lost)",
    )
    groups = []
    for group in optimizer.param_groups:
        require(not group.get("amsgrad", False), "amsgrad", True, "be False (SpectralAdamW is AdamW without amsgrad)")
        require(not group.get("maximize", False), "maximize", True, "be False (SpectralAdamW minimises)")
        decoupled = group.get("decoupled_weight_decay", isinstance(optimizer, torch.optim.AdamW))
        require(
            decoupled or group["weight_decay"] == 0,
            "weight_decay",
            group["weight_decay"],
            f"be 0 for {name} without decoupled_weight_decay (its L2 penalty is not AdamW's decoupled decay); use "
            "AdamW",
        )
        groups.append({key: value for key, value in group.items() if key not in _ADAM_ONLY_KEYS})
    defaults = optimizer.defaults
    return SpectralAdamW(
        groups,
        lr=defaults["lr"],
        betas=defaults["betas"],
        eps=defaults["eps"],
        weight_decay=defaults["weight_decay"],
        **spectral_options(knobs),
    )


def move_schedulers(objects: Sequence[Any], old: torch.optim.Optimizer, new: torch.optim.Optimizer) -> None:
    """LR schedulers built on the replaced optimizer drive its replacement (whose groups carry their lr)."""
    for obj in objects:
        for scheduler in (obj, *getattr(obj, "_schedulers", ())):  # SequentialLR / ChainedScheduler children
            if isinstance(scheduler, LRScheduler) and scheduler.optimizer is old:
                scheduler.optimizer = new
                track_step_calls(new)


def track_step_calls(optimizer: torch.optim.Optimizer) -> None:
    """Mark ``optimizer.step`` the way an LR scheduler built on it would have (torch's LRScheduler
    warns on its first step if the optimizer's step lacks that mark, and checks it was called)."""
    if hasattr(optimizer.step, "_wrapped_by_lr_sched"):
        return
    owner, step = weakref.ref(optimizer), type(optimizer).step

    # the marks are torch's private attributes (LRScheduler's own wrapper sets them), not in its stubs: setattr
    @functools.wraps(step)
    def tracked_step(*args, **kwargs):
        opt = owner()
        assert opt is not None  # alive: this is its bound step
        setattr(opt, "_opt_called", True)
        return step(opt, *args, **kwargs)

    setattr(tracked_step, "_wrapped_by_lr_sched", True)
    setattr(optimizer, "step", tracked_step)
