"""The distributed pipeline: a manual stage split of a Hugging Face causal LM (``stage``), the
schedule that runs the stages across processes, every payload booked on the ``Wire`` (``schedule``),
and generation through the stages, each keeping its own layers' KV cache (``generate``)."""

from .generate import RolloutSettings, pipelined_generate
from .schedule import MeshStage, build_schedule, run_schedule
from .stage import (
    SUPPORTED_MODEL_TYPES,
    StageModule,
    build_stage,
    causal_lm_loss,
    stage_parameter_names,
    untie_embeddings,
)

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "MeshStage",
    "RolloutSettings",
    "StageModule",
    "build_schedule",
    "build_stage",
    "causal_lm_loss",
    "pipelined_generate",
    "run_schedule",
    "stage_parameter_names",
    "untie_embeddings",
]
