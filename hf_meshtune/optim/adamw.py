"""One AdamW step, op for op torch's own, so that ``SpectralAdamW`` at α = 1 is ``torch.optim.AdamW`` bit for bit."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__: list[str] = []


def _adamw_update(
    param: Tensor, grad: Tensor, state: dict[str, Any], group: dict[str, Any], scratch: bool = False
) -> None:
    """One AdamW step, op for op torch 2.13's ``_single_tensor_adam`` (decoupled, no amsgrad).

    Same ops in the same order (lerp_, mul_/addcmul_, Python-float bias corrections, ``** 0.5``)
    so that α = 1 reproduces ``torch.optim.AdamW(foreach=False)`` bit for bit. ``scratch``: ``grad`` is
    free once the moments hold it, so the denominator is computed in its storage (the same ops, the
    same bits, two [m, n] allocations fewer).
    """
    if "step" not in state:
        state["step"] = torch.tensor(0.0, dtype=torch.float32)
        state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
    lr, wd, eps = group["lr"], group["weight_decay"], group["eps"]
    beta1, beta2 = group["betas"]
    exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
    state["step"] += 1
    if wd != 0:
        param.mul_(1 - lr * wd)
    exp_avg.lerp_(grad, 1 - beta1)
    exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
    step = state["step"].item()
    bias_correction1 = 1 - beta1**step
    bias_correction2 = 1 - beta2**step
    step_size = lr / bias_correction1
    if scratch and grad.dtype == exp_avg_sq.dtype and grad.shape == exp_avg_sq.shape:
        denom = torch.sqrt(exp_avg_sq, out=grad).div_(bias_correction2**0.5).add_(eps)
    else:
        denom = (exp_avg_sq.sqrt() / bias_correction2**0.5).add_(eps)
    param.addcdiv_(exp_avg, denom, value=-step_size)
