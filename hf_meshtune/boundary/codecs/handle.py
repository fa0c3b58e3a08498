"""Attaching codecs to a model's stage boundaries (the places ``attach_boundaries`` masks)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

import torch
from torch import Tensor, nn

from ..._validation import require
from ..hooks import (
    BoundaryHooks,
    PayloadCounter,
    _hidden_size,
    find_decoder_layers,
    split_stages,
)
from .base import CODECS_ATTR, BoundaryCodec
from .kinds import CODECS


def sample_keys(input_ids: Tensor) -> list[bytes]:
    """One key per batch row: a 16-byte blake2b digest of the row's token ids (AQ-SGD's sample id)."""
    rows = input_ids.detach().to("cpu", torch.int64).reshape(input_ids.shape[0], -1).numpy()
    return [hashlib.blake2b(row.tobytes(), digest_size=16, person=b"meshtune-sample").digest() for row in rows]


@dataclass
class CodecHandle(BoundaryHooks):
    """Codecs attached at a model's pipeline boundaries. ``remove()`` restores the plain dense model.

    While attached, ``codecs`` is registered on the model as ``model.boundary_codecs``: a learned
    codec's parameters (bottleneck) are in ``model.parameters()``, so an optimizer or Trainer built
    after ``attach_codec`` trains them, and ``model.to(...)`` moves every codec. Only learned codecs
    add ``state_dict`` keys (``boundary_codecs.<i>.{down,up}.{weight,bias}``): ``remove()`` before
    ``save_pretrained`` for a plain transformers checkpoint. Non-parameter state (PCA basis, AQ-SGD
    buffers) travels through ``state_dict()``; ``counter`` holds the measured wire bytes.
    """

    codecs: nn.ModuleList
    boundary_layers: list[int]
    stages: list[range]
    layers_name: str
    hidden_size: int
    enabled: bool = True
    counter: PayloadCounter = field(default_factory=PayloadCounter)
    _model: nn.Module | None = field(default=None, repr=False)
    _keys: list[bytes] | None = field(default=None, repr=False)
    _hooks: list = field(default_factory=list, repr=False)

    @property
    def _boundary_codecs(self) -> list[BoundaryCodec]:
        """``codecs`` typed as what they hold (an ``nn.ModuleList`` types its items as plain ``nn.Module``)."""
        return cast("list[BoundaryCodec]", list(self.codecs))

    def remove(self) -> None:
        super().remove()
        if self._model is not None and getattr(self._model, CODECS_ATTR, None) is self.codecs:
            delattr(self._model, CODECS_ATTR)
        self._model = None

    @torch.no_grad()
    def fit(self, model: nn.Module, batch: dict) -> None:
        """Fit the codecs that learn from dense activations (``needs_fit``: pca, bottleneck).

        One dense forward of ``batch`` (codecs off, private RNG so dropout leaves torch's global RNG
        alone) collects every boundary's hidden states at real tokens (``attention_mask`` == 1 when
        given). Calling it again refreshes a PCA basis (another ``basis_bytes`` on a real mesh) and
        re-initialises a bottleneck.
        """
        for codec, hidden in zip(self._boundary_codecs, self.dense_boundary_tokens(model, batch)):
            if codec.needs_fit:
                codec.fit(hidden)

    def state_dict(self) -> dict:
        return {"codecs": [codec.codec_state() for codec in self._boundary_codecs]}

    def load_state_dict(self, state: dict) -> None:
        require(
            len(state["codecs"]) == len(self.codecs),
            "state['codecs']",
            len(state["codecs"]),
            f"hold one entry per boundary ({len(self.codecs)})",
        )
        for codec, codec_state in zip(self._boundary_codecs, state["codecs"]):
            codec.load_codec_state(codec_state)

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if not self._is_training_forward(module):
            return
        ids = kwargs.get("input_ids", args[0] if args else None)
        self.counter.tokens += self._note_real_tokens(args, kwargs)
        wanted = isinstance(ids, Tensor) and any(codec.needs_keys for codec in self._boundary_codecs)
        self._keys = sample_keys(ids) if wanted and isinstance(ids, Tensor) else None

    def _on_layer_output(self, codec: BoundaryCodec, module: nn.Module, args: tuple, output: Any) -> Any:
        if not self._is_training_forward(module):
            return None
        hidden = output[0] if isinstance(output, tuple) else output
        rebuilt = codec(hidden, self._keys if codec.needs_keys else None)
        share = self.real_fraction(hidden[..., 0].numel())  # the real tokens' part of what the codec counted
        fwd_bytes, bwd_bytes = (round(n * share) for n in codec.last_wire_bytes)
        self.counter.book("fwd", fwd_bytes, fwd_bytes)
        if rebuilt.requires_grad:
            rebuilt.register_hook(partial(self._count_backward, bwd_bytes))
        return (rebuilt, *output[1:]) if isinstance(output, tuple) else rebuilt

    def _count_backward(self, nbytes: int, grad: Tensor) -> None:
        self.counter.book("bwd", nbytes, nbytes)


def _first_float_parameter(model: nn.Module) -> Tensor | None:
    return next((p for p in model.parameters() if p.is_floating_point()), None)


def attach_codec(model: nn.Module, num_stages: int, codec: str, **codec_kwargs: Any) -> CodecHandle:
    """Split ``model``'s decoder layers into ``num_stages`` (Y) stages with ``codec`` at each boundary.

    Args:
        model: any HF causal LM, also behind a PEFT wrapper.
        num_stages: Y; Y - 1 boundaries, one codec instance each. Y = 1 attaches no codec.
        codec: a key of ``CODECS``.
        codec_kwargs: the codec's own arguments (``bits``, ``k``, ``rank``, ``dtype_bytes``, ...).

    Example:
        >>> handle = attach_codec(model, num_stages=4, codec="pca", rank=29)  # doctest: +SKIP
        >>> handle.fit(model, batch)                                           # doctest: +SKIP
        >>> model(**batch).loss.backward(); handle.counter.fwd_bytes           # doctest: +SKIP
        >>> handle.remove()                                                    # doctest: +SKIP
    """
    require(codec in CODECS, "codec", codec, f"be one of {sorted(CODECS)}")
    require(not hasattr(model, CODECS_ATTR), CODECS_ATTR, "attached", "be absent: remove() the codecs already attached")
    layers_name, layers = find_decoder_layers(model)
    stages = split_stages(len(layers), num_stages)
    hidden = _hidden_size(model)
    boundary_layers = [stage[-1] for stage in stages[:-1]]
    # built at least once so that bad codec arguments fail even when Y = 1 attaches nothing
    built = [CODECS[codec](hidden, **codec_kwargs) for _ in range(max(1, len(boundary_layers)))]
    codecs = nn.ModuleList(built[: len(boundary_layers)])
    reference = _first_float_parameter(model)
    if reference is not None:
        codecs.to(device=reference.device, dtype=reference.dtype)
    model.add_module(CODECS_ATTR, codecs)
    handle = CodecHandle(codecs, boundary_layers, stages, layers_name, hidden, _model=model)
    handle._hooks.append(model.register_forward_pre_hook(handle._on_model_forward, with_kwargs=True))
    for boundary_codec, layer_index in zip(handle._boundary_codecs, boundary_layers):
        hook = layers[layer_index].register_forward_hook(partial(handle._on_layer_output, boundary_codec))
        handle._hooks.append(hook)
    return handle
