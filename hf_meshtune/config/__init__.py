"""Every knob of the method in one validated place.

``MeshArguments`` holds the fields (with help text and the paper's symbol beside each name) and their
validation. It is mixed into ``MeshConfig`` (a plain dataclass for code that builds the pieces by
hand) and into ``MeshTrainingArguments`` (transformers' ``TrainingArguments`` + these fields, which
also accepts ``optim="spectral_adamw"``). TRL configs reuse the same mixin: mixed into any
``TrainingArguments`` subclass it accepts our optimizer name and validates the knobs.

- ``knobs``: the fields, their types, the three classes that carry them, what a resume must keep;
- ``presets``: the presets and the defaults and choices the fields and rules cite;
- ``rules``: the ranges and the rules between knobs, and what the distributed mesh does not run;
- ``derived``: what several knobs mean together (the composed codec, the governed ladder, the refit period);
- ``training``: what transformers' ``TrainingArguments`` needs to carry them (optimizer name, gloo, servers).
"""

from .derived import cadence_bounds, codec_ladder, codec_refit_every, composed_codec, is_governed, require_ladder_order
from .knobs import TIMING_KNOBS, MeshArguments, MeshConfig, MeshTrainingArguments, require_saved_knobs
from .presets import (
    ANCHOR_PAYLOADS,
    CADENCES,
    DEFAULT_DP_POWERSGD_RANK,
    DEFAULT_DP_QUANTIZE,
    DEFAULT_NUM_STAGES,
    DP_QUANT_BLOCK,
    DP_QUANTIZERS,
    GOVERNED,
    GOVERNED_LADDER,
    PRESETS,
    QUALITY_CODEC,
    SPECTRAL_ADAMW,
)
from .rules import require_mesh_supported

__all__ = [
    "ANCHOR_PAYLOADS",
    "CADENCES",
    "DEFAULT_DP_POWERSGD_RANK",
    "DEFAULT_DP_QUANTIZE",
    "DEFAULT_NUM_STAGES",
    "DP_QUANTIZERS",
    "DP_QUANT_BLOCK",
    "GOVERNED",
    "GOVERNED_LADDER",
    "PRESETS",
    "QUALITY_CODEC",
    "SPECTRAL_ADAMW",
    "TIMING_KNOBS",
    "MeshArguments",
    "MeshConfig",
    "MeshTrainingArguments",
    "cadence_bounds",
    "codec_ladder",
    "codec_refit_every",
    "composed_codec",
    "is_governed",
    "require_ladder_order",
    "require_mesh_supported",
    "require_saved_knobs",
]
