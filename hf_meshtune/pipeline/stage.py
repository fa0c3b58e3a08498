"""Distributed pipeline stages of a Hugging Face causal LM with compact masked boundaries.

``StageModule`` is one stage of a manual split: the first holds the token embeddings, the last the
final norm and the LM head, every stage its contiguous slice of decoder layers (the same
``split_stages`` as the single-process boundaries) and rebuilds the causal mask and the rotary
embeddings for itself, so nothing but the boundary payload crosses between stages.

On a masked replica the payload of boundary ℓ is the compact [B, T, K] tensor of kept values:
``BoundaryMask.send`` (a gather) ends stage ℓ and ``BoundaryMask.receive`` (a scatter into the fill)
starts stage ℓ+1. Both sides compute the keep-set from g(ℓ, step, microbatch, T, H, seed), so no
index or mask ever travels, and autograd turns the pair into a compact [B, T, K] gradient on the way
back. The anchor replica runs the same stages dense ([B, T, H]).

The schedule that runs stages across processes is in ``pipeline.schedule``.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn
from transformers.masking_utils import create_causal_mask

from .._validation import require
from ..boundary.compose.codec import ComposedCodec
from ..boundary.fills import FILLS
from ..boundary.hooks import find_decoder_layers, split_stages
from ..boundary.masking import BoundaryMask, keep_count
from ..config import composed_codec

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "StageModule",
    "build_stage",
    "causal_lm_loss",
    "stage_parameter_names",
    "untie_embeddings",
]

# Decoder-only models whose base model is embed_tokens → layers (with rotary position embeddings
# computed once by ``rotary_emb``) → norm, and whose layers take (hidden, attention_mask,
# position_ids, position_embeddings): the layout the stages rebuild.
SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def _base_model(model: nn.Module) -> nn.Module:
    layers_name, _ = find_decoder_layers(model)
    base_name = layers_name.rsplit(".", 1)[0] if "." in layers_name else ""
    return model.get_submodule(base_name) if base_name else model


def _check_supported(model: nn.Module) -> None:
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None)
    require(
        model_type in SUPPORTED_MODEL_TYPES,
        "model.config.model_type",
        model_type,
        f"be one of {list(SUPPORTED_MODEL_TYPES)} for the distributed pipeline (its stages rebuild "
        "this layout: embed_tokens → layers with rotary embeddings → norm → lm_head)",
    )
    sliding = [t for t in (getattr(config, "layer_types", None) or []) if t != "full_attention"]
    require(
        not sliding and not getattr(config, "use_sliding_window", False),
        "model.config.layer_types",
        sorted(set(sliding)) or "use_sliding_window=True",
        "be full attention only in the distributed pipeline",
    )
    require(getattr(model, "lm_head", None) is not None, "model.lm_head", None, "exist (a causal LM head)")


def causal_lm_loss(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss (shifted cross-entropy, -100 ignored) as ``loss(logits, labels)``."""
    vocab = model.config.get_text_config().vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return model.loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss


class StageModule(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a causal LM, sharing (not copying) the model's modules.

    Args:
        model: the full HF causal LM (Llama layout, see ``SUPPORTED_MODEL_TYPES``).
        stage, num_stages: this stage's index and Y.
        mask_in / mask_out: the boundary masks on the input (stage > 0) and output (stage < Y-1)
            side; None runs that side dense (the anchor replica, or p = 0).
        codec_in / codec_out: composed codecs (``boundary.compose``) on those sides instead of masks;
            their payload is the codec's packed message (``payload_width`` model-dtype words per token).

    The forward takes ``input_ids`` [B, T] (first stage) or the boundary payload, and returns the
    next payload, or the logits [B, T, V] on the last stage. Set ``step`` before each optimizer step;
    ``microbatch`` is set by ``MeshStage`` before each forward.
    """

    def __init__(
        self,
        model: nn.Module,
        stage: int,
        num_stages: int,
        mask_in: BoundaryMask | None,
        mask_out: BoundaryMask | None,
        codec_in: ComposedCodec | None = None,
        codec_out: ComposedCodec | None = None,
    ) -> None:
        super().__init__()
        _check_supported(model)
        _, layers = find_decoder_layers(model)
        ranges = split_stages(len(layers), num_stages)
        base = _base_model(model)
        self.config = model.config
        self.stage, self.num_stages = stage, num_stages
        self.layer_range = ranges[stage]
        self.hidden_size = self.config.get_text_config().hidden_size
        self.embed_tokens = base.embed_tokens if stage == 0 else None
        self.layers = nn.ModuleList([layers[i] for i in self.layer_range])
        self.rotary_emb = base.rotary_emb
        self.norm = base.norm if stage == num_stages - 1 else None
        self.lm_head = model.lm_head if stage == num_stages - 1 else None
        require(
            not ((mask_in or mask_out) and (codec_in or codec_out)),
            "boundary",
            "a mask and a codec",
            "be masks (mask_in/mask_out) or composed codecs (codec_in/codec_out) on one stage, not both",
        )
        self.mask_in, self.mask_out = mask_in, mask_out
        self.codec_in, self.codec_out = codec_in, codec_out
        self.step, self.microbatch = 0, 0
        self.dense = False  # True: both sides run dense (the codecs' calibration pass)
        self.record: list[torch.Tensor] | None = None  # a list: every forward's outgoing hidden state lands here

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(x)
        elif self.codec_in is not None and not self.dense:
            hidden = self.codec_in.receive(x, self.step, self.microbatch)
        elif self.mask_in is not None:
            idx = self.mask_in.indices(self.step, self.microbatch, x.shape[-2], self.hidden_size, x.device)
            hidden = self.mask_in.receive(x, idx, self.hidden_size)
        else:
            hidden = x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        causal = create_causal_mask(
            config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None, position_ids=positions
        )
        return self.through_layers(hidden, positions, causal)

    def through_layers(self, hidden: torch.Tensor, positions: torch.Tensor, causal) -> torch.Tensor:
        """The stage after its input side: its decoder layers under the ``causal`` mask, then the head
        (last stage) or the output side (the memory ledger traces this on meta tensors)."""
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for layer in self.layers:
            out = layer(hidden, attention_mask=causal, position_ids=positions, position_embeddings=rotary)
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            return self.lm_head(self.norm(hidden))
        if self.record is not None:  # the anchor's dense round: the geometry refit learns from it
            self.record.append(hidden.detach())
        if self.codec_out is not None and not self.dense:
            return self.codec_out.send(hidden, self.step, self.microbatch)
        if self.mask_out is not None:
            idx = self.mask_out.indices(self.step, self.microbatch, hidden.shape[-2], self.hidden_size, hidden.device)
            return self.mask_out.send(hidden, idx)
        return hidden

    def payload_width(self, side: str, dtype: torch.dtype = torch.float32) -> int:
        """Values (of ``dtype``, the model's) per token crossing this stage's ``side`` ("in"/"out")
        boundary: a codec's message width, K, or H when dense."""
        codec = self.codec_in if side == "in" else self.codec_out
        if codec is not None:
            return codec.payload_width(dtype)
        mask = self.mask_in if side == "in" else self.mask_out
        if mask is None or mask.mask_ratio == 0.0:
            return self.hidden_size
        return keep_count(self.hidden_size, mask.mask_ratio)


def untie_embeddings(model: nn.Module) -> bool:
    """Give the LM head its own copy of tied input embeddings; True if they were tied.

    The first stage holds the embeddings and the last the head, on different processes, so one
    shared matrix cannot stay shared: each stage trains its copy (both start from the pretrained
    matrix) and the config says ``tie_word_embeddings=False`` so a saved checkpoint keeps both.
    """
    head, embed = getattr(model, "lm_head", None), model.get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    model.config.tie_word_embeddings = False
    text = model.config.get_text_config()
    if text is not model.config:
        text.tie_word_embeddings = False
    return True


def stage_parameter_names(model: nn.Module, stage_module: StageModule) -> dict[str, nn.Parameter]:
    """The full model's parameter names (as in its ``state_dict``) of the parameters a stage holds."""
    owned = {id(p) for p in stage_module.parameters()}
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if id(p) in owned}


def build_stage(model: nn.Module, stage: int, num_stages: int, cfg, masked: bool) -> StageModule:
    """Stage ``stage`` of ``model`` with the boundary masks of the mesh knobs ``cfg`` (p, seed, rescale,
    fill) on both sides, or its composed ``boundary_codec``, or dense sides (``masked=False``: the anchor
    replica). A codec that needs geometry gets it from ``calibrate_codecs`` before the first step."""
    spec = composed_codec(cfg)
    if spec is not None:
        hidden = model.config.get_text_config().hidden_size

        def codec(boundary: int) -> ComposedCodec | None:
            if not masked or boundary < 0 or boundary >= num_stages - 1:
                return None
            return ComposedCodec(spec, boundary, hidden, cfg.mask_seed)

        return StageModule(model, stage, num_stages, None, None, codec(stage - 1), codec(stage))

    def mask(boundary: int) -> BoundaryMask | None:
        if not masked or boundary < 0 or boundary >= num_stages - 1:
            return None
        return BoundaryMask(boundary, cfg.mask_ratio, cfg.mask_seed, cfg.mask_rescale, FILLS[cfg.mask_fill]())

    return StageModule(model, stage, num_stages, mask(stage - 1), mask(stage))
