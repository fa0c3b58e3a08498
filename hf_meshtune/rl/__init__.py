"""Reinforcement learning on the mesh: TRL's GRPO/GSPO policy loss computed on the pipeline's last stage
(``loss``). Generation through the stages is ``pipeline.generate``."""

from .loss import SUPPORTED_LOSS_TYPES, TARGET_FIELDS, PolicyLoss, PolicyLossSettings, pack_rollouts

__all__ = ["SUPPORTED_LOSS_TYPES", "TARGET_FIELDS", "PolicyLoss", "PolicyLossSettings", "pack_rollouts"]
