"""What a pipeline stage must know about a decoder family to redo its base model's forward in slices.

Every family here runs the same skeleton, read from its ``modeling_<family>.py``: input embeddings
(Gemma's scale by √H lives inside its embedding module) → an embedding dropout (GPT-NeoX, Phi) →
decoder layers, each under its layer type's attention mask and rotary position embeddings → final
norm → LM head → final logit soft-capping (Gemma 2 and 3). Parallel residuals (GPT-NeoX, StableLM),
q/k norms (OLMo 2, Qwen3), partial rotary and attention soft-capping all live inside the layers, which
the stages call unchanged.

What a config switches on is read from the config, not from the family's name, so a tiny and a full
model of one family take the same path: the layer types (``layer_types``, else every layer sliding
when ``sliding_window`` is set, as Mistral and Phi-3 do), the soft-cap (``final_logit_softcapping``)
and one rotary table per layer type (Gemma 3's local base for sliding layers: its ``rotary_emb`` takes
a ``layer_type``). Only the module names differ by family (``FAMILIES``). A family is admitted only
once its forward has been read, because a forward can scale in code that no module or config field
shows (Granite's ``embedding_multiplier``, Cohere's ``logit_scale``): an unread family is refused.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

from torch import nn
from transformers.masking_utils import create_causal_mask, create_sliding_window_causal_mask

from .._hf_typing import hf_config, hf_model
from .._validation import require

__all__ = [
    "FAMILIES",
    "MASKS",
    "SUPPORTED_MODEL_TYPES",
    "DecoderLayout",
    "decoder_layout",
    "layer_cache_argument",
    "layer_types",
    "logit_softcap",
    "rotary_per_layer_type",
]


@dataclass(frozen=True)
class DecoderLayout:
    """The base model's module names a stage takes over (the embeddings and the head are found through
    ``get_input_embeddings`` / ``get_output_embeddings``, the layers through ``find_decoder_layers``)."""

    norm: str = "norm"  # the final norm, after the last layer
    embed_dropout: str | None = None  # a dropout module applied to the embeddings before the first layer


FAMILIES: dict[str, DecoderLayout] = {
    "llama": DecoderLayout(),
    "mistral": DecoderLayout(),
    "qwen2": DecoderLayout(),
    "qwen3": DecoderLayout(),
    "gemma": DecoderLayout(),
    "gemma2": DecoderLayout(),
    "gemma3_text": DecoderLayout(),
    "phi3": DecoderLayout(),
    "phi": DecoderLayout(norm="final_layernorm", embed_dropout="embed_dropout"),
    "olmo": DecoderLayout(),
    "olmo2": DecoderLayout(),
    "stablelm": DecoderLayout(),
    "gpt_neox": DecoderLayout(norm="final_layer_norm", embed_dropout="emb_dropout"),
}
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)

# The mask each layer type attends under, built as the base models build them (no padding, no cache).
MASKS = {"full_attention": create_causal_mask, "sliding_attention": create_sliding_window_causal_mask}

_CACHE_ARGUMENTS = ("cache", "past_key_values", "layer_past")  # the KV cache's name in a decoder layer's forward


def layer_cache_argument(layer: nn.Module) -> str:
    """The name under which ``layer``'s forward takes the KV cache: ``cache`` in most families,
    ``layer_past`` in GPT-NeoX's (generation through the pipeline passes it by name)."""
    parameters = inspect.signature(layer.forward).parameters
    name = next((n for n in _CACHE_ARGUMENTS if n in parameters), None)
    require(
        name is not None,
        "decoder layer",
        type(layer).__name__,
        f"take a KV cache as one of {list(_CACHE_ARGUMENTS)} in its forward (generation through the pipeline)",
    )
    assert name is not None
    return name


def _why_not(model: nn.Module, base: nn.Module) -> str:
    """Why a family outside ``FAMILIES`` is refused, as specific as its structure allows."""
    config = model.config
    if getattr(config, "is_encoder_decoder", False):
        return "it is an encoder-decoder; the pipeline splits one decoder-only layer stack"
    if getattr(base, "rotary_emb", None) is None:
        return (
            "its base model has no rotary position embedding (rotary_emb): its positions (learned absolute ones, "
            "as GPT-2's wpe) are added to the embeddings inside its forward, which no stage rebuilds"
        )
    return (
        "its base model's forward has not been checked against the stages' rebuild (a forward can scale in "
        "code no module shows, as Granite's embedding_multiplier or Cohere's logit_scale do)"
    )


def layer_types(config, num_layers: int) -> list[str]:
    """The attention type of every decoder layer, as the family's base model chooses its masks."""
    text = config.get_text_config()
    types = getattr(text, "layer_types", None)
    if types:
        return list(types[:num_layers])
    sliding = getattr(text, "sliding_window", None) is not None  # Mistral, Phi-3: every layer or none
    return ["sliding_attention" if sliding else "full_attention"] * num_layers


def decoder_layout(model: nn.Module, base: nn.Module, num_layers: int) -> DecoderLayout:
    """The layout of ``model`` (base model ``base``), or a ``ValueError`` saying what is not rebuilt and why."""
    config = hf_config(model)
    model_type = getattr(config, "model_type", None)
    require(
        model_type in FAMILIES,
        "model.config.model_type",
        model_type,
        f"be one of {list(FAMILIES)} for the distributed pipeline: {_why_not(model, base)}",
    )
    text = config.get_text_config()
    unknown = sorted(set(layer_types(config, num_layers)) - set(MASKS))
    require(
        not unknown,
        "model.config.layer_types",
        unknown,
        f"name only {list(MASKS)} layers in the distributed pipeline (the stages build those masks only)",
    )
    for field, causal in (("is_causal", True), ("use_bidirectional_attention", False)):
        value = getattr(text, field, causal)
        require(
            value in (None, causal),
            f"model.config.{field}",
            value,
            f"be {causal} in the distributed pipeline (its stages build causal masks only)",
        )
    require(
        hf_model(model).get_output_embeddings() is not None,
        "model.get_output_embeddings()",
        None,
        "be an LM head (load the model with AutoModelForCausalLM, not its bare base model)",
    )
    assert isinstance(model_type, str)
    return FAMILIES[model_type]


def rotary_per_layer_type(rotary: nn.Module) -> bool:
    """True when ``rotary`` keeps one table per layer type (Gemma 3), i.e. its forward takes ``layer_type``."""
    return "layer_type" in inspect.signature(rotary.forward).parameters


def logit_softcap(config) -> float | None:
    """The final logit soft-cap c (logits ← c·tanh(logits / c) after the head), or None."""
    return getattr(config.get_text_config(), "final_logit_softcapping", None)
