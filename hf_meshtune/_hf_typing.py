"""Typed views of the Hugging Face model behind an ``nn.Module``, for the type checker only.

The code holds models as ``nn.Module`` (a PEFT wrapper forwards the same attributes), and torch types
every unknown attribute of a module as ``Tensor | Module``: ``model.config.get_text_config()`` then
reads as calling a tensor. These casts say what the attributes are; at run time they return their
argument unchanged.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, cast

from torch import nn

if TYPE_CHECKING:
    from transformers import PreTrainedConfig, PreTrainedModel

__all__ = ["hf_config", "hf_model"]


def hf_config(model: nn.Module) -> PreTrainedConfig:
    """``model.config``, typed as the Hugging Face config it is."""
    return cast("PreTrainedConfig", model.config)


def hf_model(model: nn.Module) -> PreTrainedModel:
    """``model`` typed as a ``PreTrainedModel`` (its ``get_input_embeddings``, ``loss_function``, ...)."""
    return cast("PreTrainedModel", model)
