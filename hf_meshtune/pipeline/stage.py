"""Distributed pipeline stages of a Hugging Face causal LM with compact masked boundaries.

``StageModule`` is one stage of a manual split: the first holds the token embeddings (and the
embedding dropout), the last the final norm, the LM head and the logit soft-cap, every stage its
contiguous slice of decoder layers (the same ``split_stages`` as the single-process boundaries) and
rebuilds the attention masks and the rotary embeddings its layers need for itself, so nothing but the
boundary payload crosses between stages. Which families it rebuilds, and how each differs, is
``pipeline.layout``.

On a masked replica the payload of boundary ℓ is the compact [B, T, K] tensor of kept values:
``BoundaryMask.send`` (a gather) ends stage ℓ and ``BoundaryMask.receive`` (a scatter into the fill)
starts stage ℓ+1. Both sides compute the keep-set from g(ℓ, step, microbatch, T, H, seed), so no
index or mask ever travels, and autograd turns the pair into a compact [B, T, K] gradient on the way
back. The anchor replica runs the same stages dense ([B, T, H]).

The schedule that runs stages across processes is in ``pipeline.schedule``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import cast

import torch
from torch import nn

from .._hf_typing import hf_config, hf_model
from .._validation import require
from ..boundary.compose.codec import ComposedCodec
from ..boundary.fills import FILLS
from ..boundary.hooks import find_decoder_layers, split_stages
from ..boundary.masking import BoundaryMask, keep_count
from ..config import codec_ladder, composed_codec, is_governed
from .layout import (
    MASKS,
    SUPPORTED_MODEL_TYPES,
    decoder_layout,
    layer_cache_argument,
    layer_types,
    logit_softcap,
    rotary_per_layer_type,
)
from .messages import WireFormat

__all__ = [
    "SUPPORTED_MODEL_TYPES",
    "StageModule",
    "build_stage",
    "causal_lm_loss",
    "stage_parameter_names",
    "untie_embeddings",
]


def _base_model(model: nn.Module) -> nn.Module:
    layers_name, _ = find_decoder_layers(model)
    base_name = layers_name.rsplit(".", 1)[0] if "." in layers_name else ""
    return model.get_submodule(base_name) if base_name else model


def causal_lm_loss(model: nn.Module) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The model's own causal-LM loss (shifted cross-entropy, -100 ignored) as ``loss(logits, labels)``.

    The logits are the last stage's, already soft-capped where the family caps them: the cap is part of
    the model's logits (``generate`` and evaluation see it too), not of its loss."""
    vocab = hf_config(model).get_text_config().vocab_size

    def loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return hf_model(model).loss_function(logits=logits, labels=labels, vocab_size=vocab)

    return loss


class StageModule(nn.Module):
    """Stage ``stage`` of ``num_stages`` of a causal LM, sharing (not copying) the model's modules.

    Args:
        model: the full HF causal LM (a family of ``SUPPORTED_MODEL_TYPES``, see ``pipeline.layout``).
        stage, num_stages: this stage's index and Y.
        mask_in / mask_out: the boundary masks on the input (stage > 0) and output (stage < Y-1)
            side; None runs that side dense (the anchor replica, or p = 0).
        codec_in / codec_out: composed codecs (``boundary.compose``) on those sides instead of masks;
            their payload is the codec's packed message (``payload_width`` model-dtype words per token).
        ladder_in / ladder_out: governed (``boundary_codec="governed"``), one codec per level of the
            ladder on that side instead of one codec; ``set_levels`` picks the one in use (the
            richest at the start), which ``codec_in``/``codec_out`` then name.
        stage_layers: decoder layers per stage (an uneven split, e.g. fewer for a slower host; None =
            balanced, see ``split_stages``).

    On the anchor's dense stages ``probe`` (a callable ``probe(h, step, microbatch) → h``) sees every
    outgoing hidden state first: the fidelity probe codes it there (``anchor.mesh_governor``).

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
        ladder_in: list[ComposedCodec] | None = None,
        ladder_out: list[ComposedCodec] | None = None,
        stage_layers: Sequence[int] | None = None,
    ) -> None:
        super().__init__()
        _, layers = find_decoder_layers(model)
        base = _base_model(model)
        layout = decoder_layout(model, base, len(layers))
        ranges = split_stages(len(layers), num_stages, stage_layers)
        self.config = hf_config(model)
        self.mask_config = hf_config(base)  # the masks are built from the base model's (text) config, as it does
        self.stage, self.num_stages = stage, num_stages
        self.layer_range = ranges[stage]
        self.stage_layers = tuple(len(r) for r in ranges)  # the split this stage belongs to
        self.hidden_size = self.config.get_text_config().hidden_size
        first, last = stage == 0, stage == num_stages - 1
        self.embed_tokens = hf_model(model).get_input_embeddings() if first else None
        self.embed_dropout = getattr(base, layout.embed_dropout) if first and layout.embed_dropout else None
        self.layers = nn.ModuleList([layers[i] for i in self.layer_range])
        types = layer_types(model.config, len(layers))
        self.layer_types = [types[i] for i in self.layer_range]
        self.rotary_emb = cast(nn.Module, base.rotary_emb)
        self.rotary_per_type = rotary_per_layer_type(self.rotary_emb)
        self.norm = getattr(base, layout.norm) if last else None
        self.lm_head = hf_model(model).get_output_embeddings() if last else None
        self.softcap = logit_softcap(model.config) if last else None
        self._setup_boundaries(mask_in, mask_out, codec_in, codec_out)
        self.ladders = {"in": ladder_in, "out": ladder_out}
        if ladder_in or ladder_out:
            require(
                codec_in is None and codec_out is None and mask_in is None and mask_out is None,
                "boundary",
                "a ladder and a codec or mask",
                "be governed ladders (ladder_in/ladder_out) alone on a stage: set_levels picks their codecs",
            )
            self.set_levels(len(ladder_in) - 1 if ladder_in else None, len(ladder_out) - 1 if ladder_out else None)

    def _setup_boundaries(self, mask_in, mask_out, codec_in, codec_out) -> None:
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
        self.probe: Callable[[torch.Tensor, int, int], torch.Tensor] | None = None  # the anchor's fidelity probe
        self.levels: tuple[int | None, int | None] = (None, None)  # governed: the level in use per side

    def side_codecs(self, side: str) -> list[ComposedCodec]:
        """Every codec ``side`` ("in"/"out") holds: governed, its ladder (every level); else its codec."""
        ladder = self.ladders[side]
        if ladder:
            return list(ladder)
        codec = self.codec_in if side == "in" else self.codec_out
        return [codec] if codec is not None else []

    def set_levels(self, level_in: int | None, level_out: int | None) -> None:
        """Governed: use ladder level ``level_in`` on the input side and ``level_out`` on the output side
        from the next forward on (None for a side without a ladder). The payload widths change with
        them: the caller rebuilds the pipeline stage that sizes its buffers (``runtime.stage``)."""
        for side, level in (("in", level_in), ("out", level_out)):
            ladder = self.ladders[side]
            require(
                (ladder is None and level is None)
                or (ladder is not None and isinstance(level, int) and 0 <= level < len(ladder)),
                f"level_{side}",
                level,
                f"name a level in [0, {len(ladder)}) of this stage's {side}put ladder"
                if ladder is not None
                else f"be None: stage {self.stage} has no {side}put boundary ladder",
            )
        self.levels = (level_in, level_out)
        ladder_in, ladder_out = self.ladders["in"], self.ladders["out"]  # each set where its level is (required above)
        self.codec_in = ladder_in[level_in] if ladder_in is not None and level_in is not None else None
        self.codec_out = ladder_out[level_out] if ladder_out is not None and level_out is not None else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed(x) if self.embed_tokens is not None else self.receive(x)
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        return self.through_layers(hidden, positions, self.attention_masks(hidden, positions))

    def decode(
        self, x: torch.Tensor, cache, attention_mask: torch.Tensor | None, positions: torch.Tensor
    ) -> torch.Tensor:
        """One decoding forward through this stage, dense on both sides (rollouts sample the model itself,
        not its compressed boundaries): ``x`` is token ids [B, T] (first stage) or the previous stage's
        hidden state [B, T, H]; ``cache`` holds the keys and values of this stage's own layers (a
        ``DynamicCache`` of the whole model's layout, of which this stage fills its slice);
        ``attention_mask`` the 2D padding mask over every position so far (None: no padding);
        ``positions`` [B, T] as ``generate`` builds them. Returns the hidden state [B, T, H], or the last
        position's logits [B, 1, V] on the last stage."""
        hidden = self.embed(x) if self.embed_tokens is not None else x
        masks = {}
        for kind in dict.fromkeys(self.layer_types):
            first_of_kind = self.layer_range[self.layer_types.index(kind)]  # a layer whose cache this stage fills
            masks[kind] = MASKS[kind](
                config=self.mask_config,
                inputs_embeds=hidden,
                attention_mask=attention_mask,
                cache=cache,
                position_ids=positions,
                layer_idx=first_of_kind,
            )
        rotary = self.rotary(hidden, positions)
        for layer, kind in zip(self.layers, self.layer_types):
            out = layer(
                hidden,
                attention_mask=masks[kind],
                position_ids=positions,
                position_embeddings=rotary[kind],
                use_cache=True,
                **{layer_cache_argument(layer): cache},
            )
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            return self.logits(hidden[:, -1:])
        return hidden

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """The first stage's input side: the embeddings (scaled inside the module where the family scales
        them) and the family's embedding dropout."""
        assert self.embed_tokens is not None  # called on the first stage only
        hidden = self.embed_tokens(ids)
        return self.embed_dropout(hidden) if self.embed_dropout is not None else hidden

    def receive(self, x: torch.Tensor) -> torch.Tensor:
        """A later stage's input side: the boundary payload back to [B, T, H]."""
        if self.codec_in is not None and not self.dense:
            return self.codec_in.receive(x, self.step, self.microbatch)
        if self.mask_in is not None:
            idx = self.mask_in.indices(self.step, self.microbatch, x.shape[-2], self.hidden_size, x.device)
            return self.mask_in.receive(x, idx, self.hidden_size)
        return x

    def attention_masks(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor | None]:
        """The mask of every layer type this stage's layers use, built as the base model builds it."""
        kwargs = dict(config=self.mask_config, inputs_embeds=hidden, attention_mask=None, cache=None)
        return {kind: MASKS[kind](**kwargs, position_ids=positions) for kind in dict.fromkeys(self.layer_types)}

    def rotary(self, hidden: torch.Tensor, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """(cos, sin) for every layer type this stage's layers use: one table, or one per type (Gemma 3)."""
        kinds = dict.fromkeys(self.layer_types)
        if self.rotary_per_type:
            return {kind: self.rotary_emb(hidden, positions, kind) for kind in kinds}
        shared = self.rotary_emb(hidden, position_ids=positions)
        return dict.fromkeys(kinds, shared)

    def through_layers(self, hidden: torch.Tensor, positions: torch.Tensor, masks: dict | None) -> torch.Tensor:
        """The stage after its input side: its decoder layers, each under its layer type's mask in ``masks``
        (None: no mask tensor, SDPA's own causal path), then the head (last stage) or the output side (the
        memory ledger traces this on meta tensors)."""
        rotary = self.rotary(hidden, positions)
        for layer, kind in zip(self.layers, self.layer_types):
            mask = None if masks is None else masks[kind]
            out = layer(hidden, attention_mask=mask, position_ids=positions, position_embeddings=rotary[kind])
            hidden = out[0] if isinstance(out, tuple) else out
        if self.lm_head is not None:
            return self.logits(hidden)
        return self.send(hidden)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The last stage's head: final norm, LM head, then the family's soft-cap c·tanh(logits / c)."""
        assert self.lm_head is not None and self.norm is not None  # called on the last stage only
        logits = self.lm_head(self.norm(hidden))
        if self.softcap is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

    def send(self, hidden: torch.Tensor) -> torch.Tensor:
        """A stage's output side: the hidden state as its boundary payload."""
        if self.record is not None:  # the anchor's dense round: the geometry refit learns from it
            self.record.append(hidden.detach())
        if self.probe is not None:  # the anchor's fidelity probe: this boundary through a codec level
            hidden = self.probe(hidden, self.step, self.microbatch)
        if self.codec_out is not None and not self.dense:
            return self.codec_out.send(hidden, self.step, self.microbatch)
        if self.mask_out is not None:
            idx = self.mask_out.indices(self.step, self.microbatch, hidden.shape[-2], self.hidden_size, hidden.device)
            return self.mask_out.send(hidden, idx)
        return hidden

    def wire_format(self, side: str, direction: str, dtype: torch.dtype) -> WireFormat:
        """How ``side``'s ("in"/"out") boundary message travels in ``direction`` ("fwd": the payload,
        "bwd": its gradient): a codec's record of that direction (and its coder), else the payload's values."""
        return _wire_format(self, side, direction, dtype)

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


def _wire_format(module: StageModule, side: str, direction: str, dtype: torch.dtype) -> WireFormat:
    size = torch.empty((), dtype=dtype).element_size()
    codec = module.codec_in if side == "in" else module.codec_out
    if codec is not None and not module.dense:
        return WireFormat(codec.message_bytes(direction, dtype), codec.payload_width(dtype), dtype, codec.spec.entropy)
    width = module.payload_width(side, dtype)
    return WireFormat(width * size, width, dtype)


def untie_embeddings(model: nn.Module) -> bool:
    """Give the LM head its own copy of tied input embeddings; True if they were tied.

    The first stage holds the embeddings and the last the head, on different processes, so one
    shared matrix cannot stay shared: each stage trains its copy (both start from the pretrained
    matrix) and the config says ``tie_word_embeddings=False`` so a saved checkpoint keeps both.
    """
    head, embed = hf_model(model).get_output_embeddings(), hf_model(model).get_input_embeddings()
    if head is None or embed is None or head.weight is not embed.weight:
        return False
    head.weight = nn.Parameter(embed.weight.detach().clone(), requires_grad=embed.weight.requires_grad)
    config = hf_config(model)
    config.tie_word_embeddings = False
    text = config.get_text_config()
    if text is not config:
        text.tie_word_embeddings = False
    return True


def stage_parameter_names(model: nn.Module, stage_module: StageModule) -> dict[str, nn.Parameter]:
    """The full model's parameter names (as in its ``state_dict``) of the parameters a stage holds."""
    owned = {id(p) for p in stage_module.parameters()}
    return {name: p for name, p in model.named_parameters(remove_duplicate=False) if id(p) in owned}


def build_stage(
    model: nn.Module, stage: int, num_stages: int, cfg, masked: bool, local: Sequence[int] = ()
) -> StageModule:
    """Stage ``stage`` of ``model`` with the boundary masks of the mesh knobs ``cfg`` (p, seed, rescale, fill) on
    both sides, or its composed ``boundary_codec``, or dense sides (``masked=False``: the anchor replica). A
    boundary in ``local`` (its two stages share a host) is dense whatever ``cfg`` says. A codec that needs
    geometry gets it from ``calibrate_codecs`` before the first step. Governed: both sides hold the whole
    ``codec_ladder``, at its richest level until the governor says otherwise."""
    spec = composed_codec(cfg)
    if spec is not None and is_governed(cfg):
        hidden = hf_config(model).get_text_config().hidden_size
        specs = codec_ladder(cfg)

        def ladder(boundary: int) -> list[ComposedCodec] | None:
            if not masked or boundary in local or boundary < 0 or boundary >= num_stages - 1:
                return None
            return [ComposedCodec(level, boundary, hidden, cfg.mask_seed) for level in specs]

        return StageModule(
            model,
            stage,
            num_stages,
            None,
            None,
            ladder_in=ladder(stage - 1),
            ladder_out=ladder(stage),
            stage_layers=cfg.stage_layers,
        )
    if spec is not None:
        hidden = hf_config(model).get_text_config().hidden_size

        def codec(boundary: int) -> ComposedCodec | None:
            if not masked or boundary in local or boundary < 0 or boundary >= num_stages - 1:
                return None
            return ComposedCodec(spec, boundary, hidden, cfg.mask_seed)

        return StageModule(
            model, stage, num_stages, None, None, codec(stage - 1), codec(stage), stage_layers=cfg.stage_layers
        )

    def mask(boundary: int) -> BoundaryMask | None:
        if not masked or boundary in local or boundary < 0 or boundary >= num_stages - 1:
            return None
        return BoundaryMask(boundary, cfg.mask_ratio, cfg.mask_seed, cfg.mask_rescale, FILLS[cfg.mask_fill]())

    return StageModule(model, stage, num_stages, mask(stage - 1), mask(stage), stage_layers=cfg.stage_layers)
