"""The GRPO/GSPO policy loss on the pipeline's last stage, as TRL's ``GRPOTrainer`` computes it.

On the mesh only the last stage sees logits, and the pipeline schedule calls its loss function once per
microbatch as ``loss(logits, target)``. The rollouts therefore travel in two tensors of static shape:

- ``ids`` [B, T], every row **left-aligned**: its prompt tokens, its completion tokens, then pads. TRL
  left-pads the prompts and masks the pads in attention; here the pads come after every real token,
  so causal attention without a padding mask sees exactly each row's own tokens, and rotary attention
  depends only on relative positions, so each token's log-probability is TRL's (up to float order).
- ``target`` [B, T, 6] float32: at position t, what the logits of t are scored on, i.e. token t + 1
  (``TARGET_FIELDS``): its id, 1 if it is a completion token counted in the loss, its log-probability
  under π_old and under π_ref, the row's advantage, and the number of completion tokens in the whole
  step's batch (``dapo`` normalises by it).

``PolicyLoss`` then follows ``GRPOTrainer._compute_loss`` term by term for the loss types and options
it supports (``PolicyLossSettings.from_grpo_config`` refuses the others, naming them): the token or
sequence (GSPO) importance ratio against π_old, two-sided clipping (ε_low, ε_high, δ), the k3 KL to
π_ref with weight β, and the ``dapo`` (TRL's default), ``grpo``, ``bnpo``, ``dr_grpo`` and ``luspo``
reductions. π_old absent (TRL's single-iteration case) is the detached current log-probability, as TRL
does. A step's microbatches are TRL's accumulation slices (``steps_per_generation`` = the accumulation
steps, TRL's default): the schedule averages microbatch losses where TRL sums slice losses divided by
their number, so the per-microbatch loss is TRL's times that number for ``dapo`` (whose TRL slice
loss is already a share of the batch's tokens) and TRL's undivided for the others.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

import torch

from .._validation import require

__all__ = ["SUPPORTED_LOSS_TYPES", "TARGET_FIELDS", "PolicyLoss", "PolicyLossSettings", "pack_rollouts"]

TARGET_FIELDS = ("next_id", "mask", "old_logp", "ref_logp", "advantage", "batch_tokens")
SUPPORTED_LOSS_TYPES = ("dapo", "grpo", "bnpo", "dr_grpo", "luspo")


@dataclass(frozen=True)
class PolicyLossSettings:
    """The knobs of TRL's policy loss that the mesh applies (``GRPOConfig`` names them the same way;
    ``epsilon_low`` is its ``epsilon``)."""

    loss_type: str = "dapo"
    importance_sampling_level: str = "token"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.2
    delta: float | None = None
    beta: float = 0.0
    temperature: float = 1.0
    max_completion_length: int = 256
    use_bias_correction_kl: bool = False

    def __post_init__(self) -> None:
        require(
            self.loss_type in SUPPORTED_LOSS_TYPES,
            "loss_type",
            self.loss_type,
            f"be one of {list(SUPPORTED_LOSS_TYPES)} on the mesh",
        )
        require(
            self.importance_sampling_level in ("token", "sequence"),
            "importance_sampling_level",
            self.importance_sampling_level,
            "be 'token' or 'sequence'",
        )
        require(self.temperature > 0, "temperature", self.temperature, "be > 0")
        require(self.max_completion_length >= 1, "max_completion_length", self.max_completion_length, "be >= 1")

    @classmethod
    def from_grpo_config(cls, args) -> PolicyLossSettings:
        """The settings of a TRL ``GRPOConfig``; an option whose loss term the mesh does not compute is
        refused with its name (TRL's trainer would apply it, so training on without it would differ)."""
        off = {
            "top_entropy_quantile": (1.0, "the entropy mask"),
            "entropy_coef": (0.0, "the entropy bonus"),
            "use_adaptive_entropy": (False, "the adaptive entropy bonus"),
            "off_policy_mask_threshold": (None, "the off-policy sequence mask"),
            "use_vllm": (False, "generation is the mesh's own"),
        }
        for name, (value, what) in off.items():
            setting = getattr(args, name, value)
            require(setting == value, name, setting, f"be {value!r} on the mesh ({what} is not applied there)")
        return cls(
            loss_type=args.loss_type,
            importance_sampling_level=args.importance_sampling_level,
            epsilon_low=float(args.epsilon),
            epsilon_high=float(args.epsilon_high if args.epsilon_high is not None else args.epsilon),
            delta=args.delta,
            beta=float(args.beta),
            temperature=float(args.temperature),
            max_completion_length=int(args.max_completion_length),
            use_bias_correction_kl=bool(getattr(args, "use_bias_correction_kl", False)),
        )


def pack_rollouts(
    prompt_ids: torch.Tensor,
    prompt_mask: torch.Tensor,
    completion_ids: torch.Tensor,
    completion_mask: torch.Tensor,
    advantages: torch.Tensor,
    seq_len: int,
    pad_token_id: int,
    old_logps: torch.Tensor | None = None,
    ref_logps: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's rollout batch (left-padded prompts [B, P], completions [B, C] with their masks, advantages
    [B], π_old and π_ref log-probabilities [B, C] or None) as the pipeline's ``(ids, target)``, both
    ``seq_len`` long (module docstring). π_old None is stored as NaN: the loss then uses the detached
    current log-probability."""
    batch = prompt_ids.shape[0]
    prompt_lengths = prompt_mask.sum(-1).long()
    longest = int((prompt_lengths + completion_ids.shape[1]).max())
    require(
        longest <= seq_len,
        "seq_len",
        seq_len,
        f"be >= the longest prompt + completion in the batch ({longest} tokens)",
    )
    ids = torch.full((batch, seq_len), pad_token_id, dtype=torch.long)
    target = torch.zeros(batch, seq_len, len(TARGET_FIELDS), dtype=torch.float32)
    target[..., TARGET_FIELDS.index("old_logp")] = float("nan")
    completion_len = completion_ids.shape[1]
    for row in range(batch):
        prompt = prompt_ids[row][prompt_mask[row].bool()]
        p = prompt.numel()
        ids[row, :p] = prompt
        ids[row, p : p + completion_len] = completion_ids[row]
        at = slice(p - 1, p - 1 + completion_len)  # the positions whose logits score the completion
        target[row, at, 0] = completion_ids[row].float()
        target[row, at, 1] = completion_mask[row].float()
        if old_logps is not None:
            target[row, at, 2] = old_logps[row].float()
        if ref_logps is not None:
            target[row, at, 3] = ref_logps[row].float()
        target[row, :, 4] = float(advantages[row])
    target[..., 5] = float(completion_mask.sum())
    return ids, target


class PolicyLoss:
    """``loss(logits [B, T, V], target [B, T, 6]) → scalar``: TRL's GRPO/GSPO loss of one microbatch of
    a step of ``microbatches`` (module docstring). ``metrics`` collects, per call, what TRL logs: ``kl``
    (β > 0), the clip ratios and the mean completion log-probability; ``pop_metrics`` returns their
    means and clears them."""

    def __init__(self, settings: PolicyLossSettings, microbatches: int = 1) -> None:
        require(microbatches >= 1, "microbatches", microbatches, "be >= 1")
        self.settings, self.microbatches = settings, microbatches
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        s = self.settings
        next_id, mask, old, ref, advantage, batch_tokens = target.unbind(-1)
        mask = mask.to(logits.dtype)
        logps = torch.log_softmax(logits.float() / s.temperature, dim=-1)
        per_token_logps = logps.gather(-1, next_id.long().unsqueeze(-1)).squeeze(-1) * (mask > 0)
        old = torch.where(torch.isnan(old), per_token_logps.detach(), old)
        advantages = advantage[:, :1]  # one advantage per row
        log_ratio = (per_token_logps - old) * (mask > 0)
        if s.importance_sampling_level == "token":
            log_weights = log_ratio
        else:
            log_weights = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
        coef_1 = torch.exp(log_weights)
        if s.beta != 0.0:
            diff = (ref - per_token_logps) * (mask > 0)
            per_token_kl = torch.exp(diff) - diff - 1
            if s.use_bias_correction_kl:
                per_token_kl = per_token_kl * coef_1
        coef_2 = torch.clamp(coef_1, 1 - s.epsilon_low, 1 + s.epsilon_high)
        if s.delta is not None:
            coef_1 = torch.clamp(coef_1, max=s.delta)
        per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
        if s.beta != 0.0:
            per_token_loss = per_token_loss + s.beta * per_token_kl
        if s.loss_type == "dapo":  # TRL: sum / (the batch's completion tokens / slices), summed over slices
            loss = (per_token_loss * mask).sum() * self.microbatches / batch_tokens[0, 0].clamp(min=1.0)
        elif s.loss_type == "grpo":
            loss = ((per_token_loss * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
        elif s.loss_type == "bnpo":
            loss = (per_token_loss * mask).sum() / mask.sum().clamp(min=1.0)
        elif s.loss_type == "dr_grpo":
            loss = (per_token_loss * mask).sum() / (per_token_loss.size(0) * s.max_completion_length)
        else:  # luspo
            loss = (per_token_loss * mask).sum(-1).mean()
        self._record(per_token_logps, coef_1, advantages, mask, per_token_kl if s.beta != 0.0 else None)
        return loss

    @torch.no_grad()
    def _record(self, logps, coef_1, advantages, mask, per_token_kl) -> None:
        s = self.settings

        def masked_mean(x: torch.Tensor) -> float:
            if x.shape[-1] == 1:  # sequence level: one value per row
                return float(x.float().mean())
            return float((x * mask).sum() / mask.sum().clamp(min=1.0))

        low = (coef_1 < 1 - s.epsilon_low) & (advantages < 0)
        high = (coef_1 > 1 + s.epsilon_high) & (advantages > 0)
        self.metrics["clip_ratio/low_mean"].append(masked_mean(low.float()))
        self.metrics["clip_ratio/high_mean"].append(masked_mean(high.float()))
        self.metrics["clip_ratio/region_mean"].append(masked_mean((low | high).float()))
        self.metrics["completion_logp"].append(masked_mean(logps))
        if per_token_kl is not None:
            self.metrics["kl"].append(masked_mean(per_token_kl))

    def pop_metrics(self) -> dict[str, float]:
        out = {name: sum(values) / len(values) for name, values in self.metrics.items() if values}
        self.metrics.clear()
        return out
