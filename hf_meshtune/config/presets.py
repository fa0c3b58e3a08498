"""The knobs' named values: the two presets, the defaults the fields cite, the choices the rules allow.

``preset`` fills in ``mask_ratio``, ``boundary_codec`` and ``anchor`` where they are left unset (None),
once, when the knobs are validated (``apply_preset``); a knob given explicitly always wins.
"""

from __future__ import annotations

from typing import Any

from .._validation import require

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
    "apply_preset",
]

SPECTRAL_ADAMW = "spectral_adamw"
# Y when neither the knob nor a launched mesh (MESHTUNE_MESH) says: the paper's four stages
DEFAULT_NUM_STAGES = 4

# What `preset` fills in for the knobs left unset (None): "quality" (the default) = the cheapest boundary
# measured to keep both quality models within 1 % of Dense (benchmarks/quality, seeds 0 and 1: SmolLM2's main job
# GSM8K eval loss, its LoRA arithmetic eval loss and exact match, the tiny Llama's four eval losses; the tiny
# Llama's generative scores, 200 items each, within a query or two, which they cannot resolve to 1 %),
# "paper" = the literal method (M95, zero fill, anchor prior). Knobs given explicitly always win. The quality
# codec: the 8 outlier dims in the model dtype, the other 568 in int8 under one scale per token, the records
# zstd-coded (lossless: the numerics are outliers8+int8's): 586 B a token and direction on a bf16 wire before
# coding, ~484 after (benchmarks/wire), 2.4x fewer than bf16 Dense's 1,152. Rotated int4
# (outliers8+rot+int4g64e8m0+zstd, 4.9x) keeps SmolLM2 within 1 % but not the tiny Llama (eval losses +1.5, +8.4,
# +0.2, +2.9 % on its four tasks at two seeds), so it is a codec string to choose, not the default.
QUALITY_CODEC = "outliers8+int8+zstd"
# boundary_codec="governed": the anchor measures every boundary's fidelity and the governor picks the
# level of this ladder (cheapest first; x8: eight near-equal scale groups, valid at any width).
GOVERNED = "governed"
GOVERNED_LADDER = "outliers8+int3x8,outliers8+int4x8,outliers8+int8"
CADENCES = ("fixed", "adaptive")
# PowerSGD rank and codes of the DP pseudo-gradients, both presets: on the WAN benchmark's fine-tune
# (benchmarks/wan/dp_sweep.md) float32 rank 4 ended at eval loss 1.45 against Dense's 0.85 and uncompressed
# DiLoCo's 0.90, float32 rank 32 at 0.96; rank 128 in int8 codes (dp.quantize) at 0.92 for float32 rank 32's
# bytes. At Llama-3.2-1B shapes (bf16 gradients in the ledger) DP is 1,160 B/token against float rank 32's 572
# (benchmarks/wan/ledger_1b.md: 19 % of the default's 6,005; 9 % of outliers8+int8's 13,508 before it).
DEFAULT_DP_POWERSGD_RANK = 128
DEFAULT_DP_QUANTIZE = "int8"
PRESETS: dict[str, dict[str, Any]] = {
    "quality": {"boundary_codec": QUALITY_CODEC, "mask_ratio": 0.0, "anchor": False},
    "paper": {"boundary_codec": None, "mask_ratio": 0.95, "anchor": True},
}
ANCHOR_PAYLOADS = ("gradient", "factors")

DP_QUANTIZERS = ("int8",)  # MeshConfig.dp_quantize: how dense pseudo-gradients travel (dp.quantize)
DP_QUANT_BLOCK = 256  # values per shared scale of int8 pseudo-gradients: 4 / 256 bytes per value (1.6 %)


def apply_preset(cfg) -> None:
    """Fill in the unset boundary and anchor knobs from ``preset`` (idempotent: once filled, they are set).

    The boundary: a mask ratio or a codec given explicitly is kept (and the other comes from it); with
    neither, the preset's boundary. The anchor: the preset's unless given.
    """
    require(isinstance(cfg.preset, str) and cfg.preset in PRESETS, "preset", cfg.preset, f"be one of {list(PRESETS)}")
    chosen = PRESETS[cfg.preset]
    if cfg.mask_ratio is None:
        if cfg.boundary_codec is None:
            cfg.boundary_codec = chosen["boundary_codec"]
            cfg.mask_ratio = chosen["mask_ratio"]
            cfg._boundary_from_preset = True  # for the errors that follow: the user did not name this codec
        else:  # a composed codec sends no mask; a mask spec sets mask_ratio itself (_apply_boundary_codec)
            cfg.mask_ratio = 0.0
    if cfg.anchor is None:
        cfg.anchor = chosen["anchor"]
