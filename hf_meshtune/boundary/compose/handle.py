"""Composed codecs at a model's stage boundaries, single-process (forward hooks, like the masks).

Every training forward's boundary output h is replaced by ``codec.receive(codec.send(h))``: the
message the mesh would send is built and decoded in place, so training sees the wire's error both
ways, and the counter books the bytes of the message tensors themselves (forward at the send,
backward when the gradient message is built). ``eval()``, ``no_grad`` and ``generate()`` run dense.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..._validation import require
from ..hooks import BoundaryHooks, PayloadCounter, _hidden_size, find_decoder_layers, split_stages
from .codec import ComposedCodec
from .spec import CodecSpec, parse_codec

__all__ = ["ComposedHandle", "attach_composed"]


@dataclass
class ComposedHandle(BoundaryHooks):
    """Composed codecs attached to a model; ``remove()`` restores the plain dense model. Same clock as
    the masks: ``set_step(step)`` starts an optimizer step, each training forward is the next microbatch."""

    codecs: list[ComposedCodec]
    boundary_layers: list[int]
    stages: list[range]
    layers_name: str
    hidden_size: int
    step: int = 0
    microbatch: int = -1
    enabled: bool = True
    counter: PayloadCounter = field(default_factory=PayloadCounter)
    _hooks: list = field(default_factory=list, repr=False)
    _recorded: list[list[Tensor]] | None = field(default=None, repr=False)
    _real: Tensor | None = field(default=None, repr=False)

    @property
    def spec(self) -> CodecSpec | None:
        return self.codecs[0].spec if self.codecs else None

    def set_step(self, step: int) -> None:
        self.step, self.microbatch = step, -1

    @property
    def ready(self) -> bool:
        return all(codec.ready for codec in self.codecs)

    @torch.no_grad()
    def calibrate(self, model: nn.Module, batch: dict) -> None:
        """Fit every codec's geometry on one dense forward of ``batch`` (real tokens only)."""
        for codec, hidden in zip(self.codecs, self.dense_boundary_tokens(model, batch)):
            codec.fit(hidden)

    def set_up(self, model: nn.Module, first_batch: Callable[[], dict]) -> None:
        """Before training: calibrate on ``first_batch()`` unless the codecs need nothing or a checkpoint
        restored their geometry."""
        if self.ready:
            return
        batch = first_batch()
        self.calibrate(model, {k: v for k, v in batch.items() if k != "labels"})

    # --- refits from the anchor's dense passes ---------------------------------------------------
    @contextlib.contextmanager
    def recording(self) -> Iterator[None]:
        """Inside: every dense training forward (the anchor's, ``disabled()``) leaves its boundary
        outputs at the real tokens for ``refit_geometry``."""
        self._recorded, self._real = [[] for _ in self.codecs], None
        try:
            yield
        except BaseException:
            self._recorded = None  # nothing half-recorded outlives a failed pass
            raise
        finally:
            self._real = None

    def refit_geometry(self) -> list[dict[str, Tensor | None]]:
        """Every codec's geometry fitted on what ``recording`` saw (not loaded: the anchor delivers it)."""
        recorded, self._recorded = self._recorded, None
        require(
            recorded is not None and all(recorded),
            "codec refit",
            "no dense forward recorded",
            "follow a recording() with at least one dense training forward",
        )
        return [codec.fitted(torch.cat(rows)) for codec, rows in zip(self.codecs, recorded)]

    def load_geometries(self, geometries: list[dict[str, Tensor | None]]) -> None:
        """Use ``geometries`` (one per boundary, as ``refit_geometry`` gives them) from the next forward on."""
        for codec, geometry in zip(self.codecs, geometries, strict=True):
            codec.load_geometry(geometry)

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._on_model_forward(module, args, kwargs)
        if self._recorded is not None:
            self._real = kwargs.get("attention_mask")

    def state_dict(self) -> dict:
        return {"step": self.step, "codecs": [codec.geometry() for codec in self.codecs]}

    def load_state_dict(self, state: dict) -> None:
        require(
            len(state["codecs"]) == len(self.codecs),
            "state['codecs']",
            len(state["codecs"]),
            f"hold one entry per boundary ({len(self.codecs)})",
        )
        self.step, self.microbatch = state["step"], -1
        for codec, geometry in zip(self.codecs, state["codecs"]):
            if geometry["rest_dims"] is not None:
                codec.load_geometry(geometry)

    def _on_layer_output(self, codec: ComposedCodec, module: nn.Module, args: tuple, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        if self._recorded is not None and module.training and not self.enabled:  # the anchor's dense pass
            rows = hidden.detach()
            real = self._real
            self._recorded[codec.boundary].append(rows[real.to(rows.device).bool()] if real is not None else rows)
        if not self._is_training_forward(module):
            return None
        microbatch = max(self.microbatch, 0)
        payload = codec.send(hidden, self.step, microbatch)
        self.counter.fwd_bytes += payload.numel() * payload.element_size()
        if payload.requires_grad:
            payload.register_hook(self._count_backward)
        rebuilt = codec.receive(payload, self.step, microbatch)
        return (rebuilt, *output[1:]) if isinstance(output, tuple) else rebuilt

    def _count_backward(self, grad: Tensor) -> None:
        self.counter.bwd_bytes += grad.numel() * grad.element_size()


def attach_composed(model: nn.Module, num_stages: int, codec: str | CodecSpec, seed: int = 0) -> ComposedHandle:
    """Split ``model``'s decoder layers into ``num_stages`` (Y) stages with the composed ``codec`` at
    each boundary (a ``boundary_codec`` string such as ``"outliers8+int4g71"``).

    Example:
        >>> handle = attach_composed(model, 4, "outliers8+int4g71")  # doctest: +SKIP
        >>> handle.calibrate(model, batch); model(**batch).loss.backward()  # doctest: +SKIP
    """
    spec = parse_codec(codec) if isinstance(codec, str) else codec
    layers_name, layers = find_decoder_layers(model)
    stages = split_stages(len(layers), num_stages)
    hidden = _hidden_size(model)
    spec.validate(hidden)
    boundary_layers = [stage[-1] for stage in stages[:-1]]
    codecs = [ComposedCodec(spec, b, hidden, seed) for b in range(len(boundary_layers))]
    handle = ComposedHandle(codecs, boundary_layers, stages, layers_name, hidden)
    handle._hooks.append(model.register_forward_pre_hook(handle._on_model_forward, with_kwargs=True))
    for boundary_codec, layer_index in zip(codecs, boundary_layers):
        hook = layers[layer_index].register_forward_hook(
            lambda module, args, output, c=boundary_codec: handle._on_layer_output(c, module, args, output)
        )
        handle._hooks.append(hook)
    return handle
