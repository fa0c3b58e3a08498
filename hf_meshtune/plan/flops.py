"""Floating-point work of each pipeline stage, counted on the model itself (built on the meta device).

Per token of a forward pass, a decoder layer costs 2 FLOPs per weight of its matrices (every 2-D parameter:
the attention and MLP projections, whatever the family names them) plus the attention itself,
4 · heads · head_dim · context FLOPs (scores and the weighted sum), with context the causal average
(T + 1) / 2 of a full layer and min(window, T) of a sliding one at most. The last stage adds the LM head
(2 · hidden · vocab), the first the embedding lookup (no FLOPs). A backward pass costs twice its forward
where the weights train (gradients of activations and of weights) and once where they are frozen (LoRA:
activations only; the adapters' own work is left out), plus one forward more with gradient checkpointing.

Model families the pipeline does not split (``pipeline.layout.FAMILIES``) are refused by name: their layers
are not counted here either.
"""

from __future__ import annotations

from dataclasses import dataclass

from .._validation import require

__all__ = ["StageFlops", "stage_flops"]


@dataclass(frozen=True)
class StageFlops:
    """FLOPs per token of one stage: its forward, and its backward as trained."""

    forward: float
    backward: float


def stage_flops(
    config, num_stages: int, seq_len: int, stage_layers=None, *, lora: bool = False, checkpointing: bool = False
) -> list[StageFlops]:
    """Per stage of ``config``'s model split into ``num_stages`` (``stage_layers``: its split): FLOPs per token."""
    from ..boundary.hooks import find_decoder_layers, split_stages
    from ..memory_ledger import meta_model
    from ..pipeline.layout import FAMILIES, layer_types

    model_type = getattr(config, "model_type", None)
    require(
        model_type in FAMILIES,
        "config.model_type",
        model_type,
        f"be a family whose layers the plan counts and the pipeline splits: one of {sorted(FAMILIES)}",
    )
    require(isinstance(seq_len, int) and seq_len >= 1, "seq_len", seq_len, "be an integer >= 1")
    model = meta_model(config)
    _, layers = find_decoder_layers(model)
    text = config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    window = getattr(text, "sliding_window", None)
    types = layer_types(config, len(layers))
    per_layer = []
    for layer, kind in zip(layers, types):
        weights = sum(p.numel() for p in layer.parameters() if p.ndim == 2)
        context = (seq_len + 1) / 2
        if kind == "sliding_attention" and window:
            context = min(context, float(window))
        per_layer.append(2.0 * weights + 4.0 * heads * head_dim * context)
    head = 2.0 * text.hidden_size * text.vocab_size
    backward_factor = 1.0 if lora else 2.0
    recompute = 1.0 if checkpointing else 0.0
    result = []
    for stage, layer_range in enumerate(split_stages(len(layers), num_stages, stage_layers)):
        forward = sum(per_layer[i] for i in layer_range) + (head if stage == num_stages - 1 else 0.0)
        result.append(StageFlops(forward=forward, backward=forward * (backward_factor + recompute)))
    return result
