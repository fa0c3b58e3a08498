"""Composed codecs at a model's stage boundaries, single-process (forward hooks, like the masks).

Every training forward's boundary output h is replaced by ``codec.receive(codec.send(h))``: the
message the mesh would send is built and decoded in place, so training sees the wire's error both
ways, and the counter books the bytes of the message tensors themselves (forward at the send,
backward when the gradient message is built). ``eval()``, ``no_grad`` and ``generate()`` run dense.

Governed (``boundary_codec="governed"``): every boundary holds one codec per level of the ladder
(each with its own geometry, all fitted on the same dense activations) and ``set_levels`` picks the one
in use; ``probing(record)`` lets the anchor's fidelity probe code one boundary with any codec on its
passes (``anchor.fidelity``).

Change-coded (``boundary_change_codec``, ``compose.change``): each training forward's rows come with
their ids (``set_rows`` before the forward); a row revisited with the same tokens rebuilds its real
tokens from the change codec's message against the cached h̄ (the gradient passes straight through to
the boundary codec's backward), a first visit uses the boundary codec's, and both are booked as sent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from ..._validation import require
from ..hooks import BoundaryHooks, PayloadCounter, _hidden_size, find_decoder_layers, real_rows, split_stages
from .change import ChangeCache, ChangeCodec, ChangeSpec, change_records, encode_change, row_digest
from .codec import ComposedCodec, wire_records
from .entropy import encode_records
from .grammar import parse_codec
from .spec import CodecSpec

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
    ladders: list[list[ComposedCodec]] | None = None  # governed: per boundary, one codec per level
    levels: list[int] | None = None  # governed: the level in use per boundary
    levels_restored: bool = False  # governed: a checkpoint gave the levels (no start-up measurement)
    _hooks: list = field(default_factory=list, repr=False)
    _recorded: list[list[Tensor]] | None = field(default=None, repr=False)
    _real: Tensor | None = field(default=None, repr=False)
    _real_mask: Tensor | None = field(default=None, repr=False)
    _probe: Any = field(default=None, repr=False)
    changes: list[ChangeCodec] | None = None  # change-coded: per boundary, the codec of a revisit's change
    caches: list[ChangeCache] = field(default_factory=list)  # change-coded: per boundary, h̄ per row
    visits: dict[str, int] = field(default_factory=lambda: {"first": 0, "revisit": 0})  # rows × boundaries
    change_counter: PayloadCounter = field(default_factory=PayloadCounter)  # the revisits' change messages
    _pending_rows: Tensor | None = field(default=None, repr=False)
    _rows: list[tuple[int, bytes, Tensor]] | None = field(default=None, repr=False)

    @property
    def spec(self) -> CodecSpec | None:
        return self.codecs[0].spec if self.codecs else None

    @property
    def all_codecs(self) -> list[ComposedCodec]:
        """Every codec the handle holds: the one per boundary, or governed every level of every boundary."""
        return [c for ladder in self.ladders for c in ladder] if self.ladders is not None else list(self.codecs)

    def set_levels(self, levels: Sequence[int]) -> None:
        """Governed: use ladder level ``levels[b]`` at boundary b from the next forward on."""
        require(self.ladders is not None, "levels", list(levels), "be set only on a governed boundary_codec")
        assert self.ladders is not None
        require(
            len(levels) == len(self.ladders)
            and all(isinstance(lv, int) and 0 <= lv < len(ladder) for lv, ladder in zip(levels, self.ladders)),
            "levels",
            list(levels),
            f"give one level in [0, {len(self.ladders[0]) if self.ladders else 0}) per boundary ({len(self.ladders)})",
        )
        self.levels = list(levels)
        self.codecs = [ladder[lv] for ladder, lv in zip(self.ladders, self.levels)]

    @contextlib.contextmanager
    def probing(self, record: Any) -> Iterator[None]:
        """Inside: training forwards follow ``record`` (``anchor.fidelity.ProbeRecord``): with
        ``record.boundary`` None they stay dense and every boundary records dL/dh; else only that
        boundary is coded, by ``record.codec``, and records its activation error and dL/dh."""
        previous, self._probe = self._probe, record
        try:
            yield
        finally:
            self._probe = previous

    def set_step(self, step: int) -> None:
        self.step, self.microbatch = step, -1

    def set_rows(self, ids: Tensor) -> None:
        """Change-coded: the training-dataset index of each row of the next training forward."""
        self._pending_rows = ids.detach().to("cpu", torch.int64).reshape(-1)

    @property
    def cache_bytes(self) -> int:
        """What the change caches hold (one process keeps one cache per boundary: the mesh keeps two)."""
        return sum(cache.nbytes for cache in self.caches)

    @property
    def ready(self) -> bool:
        return all(codec.ready for codec in self.all_codecs)

    @torch.no_grad()
    def calibrate(self, model: nn.Module, batch: dict) -> None:
        """Fit every codec's geometry on one dense forward of ``batch`` (real tokens only)."""
        hidden = self.dense_boundary_tokens(model, batch)
        for codec in self.all_codecs:
            codec.fit(hidden[codec.boundary])

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
        assert recorded is not None
        return [codec.fitted(torch.cat(recorded[codec.boundary])) for codec in self.all_codecs]

    def load_geometries(self, geometries: list[dict[str, Tensor | None]]) -> None:
        """Use ``geometries`` (one per codec of ``all_codecs``, as ``refit_geometry`` gives them) from the
        next forward on."""
        for codec, geometry in zip(self.all_codecs, geometries, strict=True):
            codec.load_geometry(geometry)

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        super()._on_model_forward(module, args, kwargs)
        if self._recorded is not None:
            self._real = kwargs.get("attention_mask")
        if self.changes is not None and self._is_training_forward(module) and self._probe is None:
            self._rows = self._keyed_rows(kwargs.get("input_ids", args[0] if args else None))

    def _keyed_rows(self, input_ids: Any) -> list[tuple[int, bytes, Tensor]]:
        """(row id, digest of its real tokens, their positions) per row of this training forward."""
        ids, self._pending_rows = self._pending_rows, None
        require(
            ids is not None,
            "row ids",
            None,
            "be given for every training forward when boundary_change_codec is set: train through MeshTrainer or "
            "MeshSFTTrainer, which give every row its index in the training dataset (or call set_rows(ids) before "
            "each training forward)",
        )
        assert ids is not None
        require(
            isinstance(input_ids, Tensor) and input_ids.shape[0] == ids.numel(),
            "boundary_change_codec",
            f"{ids.numel()} row ids for input_ids of shape "
            f"{tuple(input_ids.shape) if isinstance(input_ids, Tensor) else None}",
            "give one id per row of input_ids (change coding keys rows by their tokens)",
        )
        real = self._real_mask
        rows = []
        for i, row in enumerate(ids.tolist()):
            positions = real[i].nonzero().squeeze(-1) if real is not None else torch.arange(input_ids.shape[1])
            rows.append((row, row_digest(input_ids[i, positions.to(input_ids.device)]), positions))
        return rows

    def state_dict(self) -> dict:
        state = {"step": self.step, "codecs": [codec.geometry() for codec in self.all_codecs]}
        if self.levels is not None:
            state["levels"] = list(self.levels)
        if self.changes is not None:
            state["change_caches"] = [cache.state_dict() for cache in self.caches]
            state["visits"] = dict(self.visits)
        return state

    def load_state_dict(self, state: dict) -> None:
        codecs = self.all_codecs
        require(
            len(state["codecs"]) == len(codecs),
            "state['codecs']",
            len(state["codecs"]),
            f"hold one entry per codec ({len(codecs)}: every boundary, and governed every level of each)",
        )
        self.step, self.microbatch = state["step"], -1
        for codec, geometry in zip(codecs, state["codecs"]):
            if geometry["rest_dims"] is not None:
                codec.load_geometry(geometry)
        if self.ladders is not None and state.get("levels") is not None:
            self.set_levels(state["levels"])
            self.levels_restored = True
        if self.changes is not None:
            require(
                "change_caches" in state and len(state["change_caches"]) == len(self.caches),
                "state['change_caches']",
                len(state.get("change_caches", [])),
                f"hold one change cache per boundary ({len(self.caches)}): resume with the boundary_change_codec "
                "the run was saved with",
            )
            for cache, held in zip(self.caches, state["change_caches"]):
                cache.load_state_dict(held)
            self.visits = dict(state["visits"])

    def _on_layer_output(self, boundary: int, module: nn.Module, args: tuple, output: Any) -> Any:
        hidden = output[0] if isinstance(output, tuple) else output
        if self._recorded is not None and module.training and not self.enabled:  # the anchor's dense pass
            rows = hidden.detach()
            real = self._real
            self._recorded[boundary].append(rows[real.to(rows.device).bool()] if real is not None else rows)
        if self._probe is not None and module.training and torch.is_grad_enabled():
            return self._on_probe(boundary, hidden, output)
        if not self._is_training_forward(module):
            return None
        codec = self.codecs[boundary]
        microbatch = max(self.microbatch, 0)
        payload = codec.send(hidden, self.step, microbatch)
        real = self._real_mask
        if payload.requires_grad:
            payload.register_hook(lambda grad: self._book(codec, "bwd", grad, real))
        rebuilt = codec.receive(payload, self.step, microbatch)
        sent = real  # the tokens whose forward message is the boundary codec's (the hook above keeps `real`)
        if self.changes is not None and self._rows is not None:
            rebuilt, sent = self._change_code(boundary, hidden, rebuilt, real)
        self._book(codec, "fwd", payload, sent)
        return (rebuilt, *output[1:]) if isinstance(output, tuple) else rebuilt

    def _change_code(
        self, boundary: int, hidden: Tensor, rebuilt: Tensor, real: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """Revisited rows take h̃ = h̄ + D(change message) at their real tokens (straight through: the
        gradient reaches ``rebuilt``'s own path, the boundary codec's backward); first visits keep the boundary
        codec's h̃. Returns (h̃, the real tokens that sent the boundary codec's message) and books the change
        messages. The sender and the receiver are one process here: one cache, ``encode_change`` alone."""
        assert self.changes is not None and self._rows is not None
        change, cache, codec = self.changes[boundary], self.caches[boundary], self.codecs[boundary]
        assert codec.outlier_dims is not None and codec.rest_dims is not None  # a codec runs fitted
        dims = (codec.outlier_dims, codec.rest_dims)  # the outlier dims travel as they are, as in its own message
        first = torch.ones(rebuilt.shape[:2], dtype=torch.bool) if real is None else real.clone().cpu()
        correction = torch.zeros_like(rebuilt)
        messages = []
        for i, (row, digest, positions) in enumerate(self._rows):
            at = positions.to(hidden.device)
            coded = encode_change(change, cache, row, digest, hidden[i, at].detach(), dims)
            if coded is None:
                cache.put(row, digest, rebuilt[i, at].detach())
                self.visits["first"] += 1
                continue
            message, values = coded
            messages.append(change_records(message))
            correction[i, at] = values.to(rebuilt.dtype) - rebuilt[i, at].detach()
            first[i] = False
            self.visits["revisit"] += 1
        if messages:
            records = torch.cat(messages)  # a token's record: its outlier values, then an int8 code per other value
            self.change_counter.book("fwd", len(encode_records(records, change.spec.coder)), records.numel())
        return rebuilt + correction, first

    def _on_probe(self, boundary: int, hidden: Tensor, output: Any) -> Any:
        record = self._probe

        def keep_grad(grad: Tensor) -> None:
            record.grads.setdefault(boundary, []).append(grad.detach().clone())

        if record.boundary is None:  # the dense reference: dL/dh at every boundary
            if hidden.requires_grad:
                hidden.register_hook(keep_grad)
            return None
        if boundary != record.boundary:
            return None
        rebuilt, _ = record.codec.apply(hidden, self.step, 0)
        dense = hidden.detach().double()
        record.act_num += float((rebuilt.detach().double() - dense).pow(2).sum())
        record.act_den += float(dense.pow(2).sum())
        if hidden.requires_grad:
            hidden.register_hook(keep_grad)  # the decoded gradient the codec hands the sending stage
        return (rebuilt, *output[1:]) if isinstance(output, tuple) else rebuilt

    def _book(self, codec: ComposedCodec, direction: str, message: Tensor, real: Tensor | None) -> None:
        """Book what the variable-size wire would carry of ``message``: its real tokens' records, coded
        where the codec ends in a coder (the coded size is measured by coding them)."""
        records = wire_records(codec, direction, real_rows(message.detach(), real))
        uncoded = records.numel()
        if not uncoded:  # nothing to send (every row a revisit): the variable-size wire sends no body
            return
        coded = len(encode_records(records, codec.spec.entropy)) if codec.spec.entropy else uncoded
        self.counter.book(direction, coded, uncoded)


def attach_composed(
    model: nn.Module,
    num_stages: int,
    codec: str | CodecSpec,
    seed: int = 0,
    ladder: Sequence[CodecSpec] | None = None,
    change: ChangeSpec | None = None,
    stage_layers: Sequence[int] | None = None,
) -> ComposedHandle:
    """Split ``model``'s decoder layers into ``num_stages`` (Y) stages with the composed ``codec`` at
    each boundary (a ``boundary_codec`` string such as ``"outliers8+int4g71"``). With ``ladder`` (governed,
    cheapest level first) every boundary holds a codec per level and starts at the richest until
    ``set_levels``; ``codec`` is then unused. With ``change`` (``compose.change.change_spec``) a row revisited
    with the same tokens sends the change of its activation in that codec (rows keyed by ``set_rows``).
    ``stage_layers``: decoder layers per stage (an uneven split; None = balanced, see ``split_stages``).

    Example:
        >>> handle = attach_composed(model, 4, "outliers8+int4g71")  # doctest: +SKIP
        >>> handle.calibrate(model, batch); model(**batch).loss.backward()  # doctest: +SKIP
    """
    spec = parse_codec(codec) if isinstance(codec, str) else codec
    layers_name, layers = find_decoder_layers(model)
    stages = split_stages(len(layers), num_stages, stage_layers)
    hidden = _hidden_size(model)
    spec.validate(hidden)
    boundary_layers = [stage[-1] for stage in stages[:-1]]
    if ladder is None:
        codecs = [ComposedCodec(spec, b, hidden, seed) for b in range(len(boundary_layers))]
        handle = ComposedHandle(codecs, boundary_layers, stages, layers_name, hidden)
    else:
        for level in ladder:
            level.validate(hidden)
        ladders = [[ComposedCodec(level, b, hidden, seed) for level in ladder] for b in range(len(boundary_layers))]
        handle = ComposedHandle([], boundary_layers, stages, layers_name, hidden, ladders=ladders)
        handle.set_levels([len(ladder) - 1] * len(ladders))
    if change is not None:
        require(ladder is None, "boundary_change_codec", change.text, "be None with boundary_codec='governed'")
        width = hidden - spec.outliers  # the boundary codec's outlier dims travel as they are
        change.validate(width)
        handle.changes = [ChangeCodec(change, b, width, seed) for b in range(len(boundary_layers))]
        handle.caches = [ChangeCache() for _ in boundary_layers]
    handle._hooks.append(model.register_forward_pre_hook(handle._on_model_forward, with_kwargs=True))
    for boundary, layer_index in enumerate(boundary_layers):
        hook = layers[layer_index].register_forward_hook(
            lambda module, args, output, b=boundary: handle._on_layer_output(b, module, args, output)
        )
        handle._hooks.append(hook)
    return handle
