"""Pipeline boundaries on an unmodified Hugging Face causal LM.

``attach_boundaries(model, num_stages)`` finds the decoder-layer list, splits it into Y balanced
contiguous stages and puts a shared-seed mask (``masking.BoundaryMask``) on the output of the last
layer of every stage but the final one. It uses forward hooks, not wrapper modules, so parameter
names and ``state_dict`` keys never change and ``save_pretrained`` stays loadable by plain
transformers. Masks act only on training forwards: the layer is in training mode and autograd is
recording. ``eval()``, ``torch.no_grad()`` and ``generate()`` (which runs under no_grad, also on a
model left in training mode, e.g. RL rollouts) see the dense model.

The position of a forward in training is (step, microbatch): ``handle.set_step(step)`` starts a new
optimizer step and every training forward of the wrapped model then takes the next microbatch index,
which is what the distributed pipeline will see for the same data.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import cast

import torch
from torch import nn

from .._validation import require
from .fills import FILLS, GaussianFill, require_fill
from .masking import BoundaryMask, keep_count, private_rng

__all__ = ["BoundaryHandle", "PayloadCounter", "attach_boundaries", "find_decoder_layers", "split_stages"]


def _pretrained_core(model: nn.Module) -> nn.Module | None:
    """The first submodule that declares ``_no_split_modules`` (sees through PEFT wrappers)."""
    for module in model.modules():
        if getattr(module, "_no_split_modules", None):
            return module
    return None


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """(qualified name, layer list): the first ``nn.ModuleList`` whose items are decoder blocks.

    Decoder blocks are recognised by transformers' own ``_no_split_modules`` declaration, which
    every causal LM with a layer stack carries (Llama, Qwen2, Mistral, Gemma, Phi-3, GPT-2, ...).
    """
    core = _pretrained_core(model)
    block_names = set(getattr(core, "_no_split_modules", None) or [])
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) and type(module[0]).__name__ in block_names:
            return name, module
    raise ValueError(
        f"model={type(model).__name__} is invalid: it must contain an nn.ModuleList of decoder blocks "
        f"declared in _no_split_modules (found {sorted(block_names) or 'no _no_split_modules'})"
    )


def split_stages(num_layers: int, num_stages: int, stage_layers: Sequence[int] | None = None) -> list[range]:
    """Contiguous stages: ``stage_layers`` (one layer count per stage, summing to ``num_layers``: an uneven split,
    e.g. fewer layers for a slower host), else balanced (sizes differ by at most one, earlier stages take the extra
    layer)."""
    require(num_stages >= 1, "num_stages", num_stages, "be >= 1")
    require(num_stages <= num_layers, "num_stages", num_stages, f"be <= the number of decoder layers ({num_layers})")
    if stage_layers is None:
        base, extra = divmod(num_layers, num_stages)
        sizes = [base + (1 if i < extra else 0) for i in range(num_stages)]
    else:
        sizes = list(stage_layers)
        require_stage_layers(sizes, num_stages)
        require(
            sum(sizes) == num_layers,
            "stage_layers",
            sizes,
            f"sum to the model's {num_layers} decoder layers (they sum to {sum(sizes)})",
        )
    stages, start = [], 0
    for size in sizes:
        stages.append(range(start, start + size))
        start += size
    return stages


def require_stage_layers(stage_layers: Sequence[int], num_stages: int) -> None:
    """One positive int per stage (what can be checked before the model is known)."""
    require(
        isinstance(stage_layers, (list, tuple)) and all(type(n) is int for n in stage_layers),
        "stage_layers",
        stage_layers,
        "be a list of ints, one decoder-layer count per stage",
    )
    require(
        len(stage_layers) == num_stages,
        "stage_layers",
        list(stage_layers),
        f"have one count per stage (num_stages = {num_stages}), not {len(stage_layers)}",
    )
    require(
        all(n >= 1 for n in stage_layers),
        "stage_layers",
        list(stage_layers),
        "give every stage at least one decoder layer",
    )


def _hidden_size(model: nn.Module) -> int:
    config = getattr(model, "config", None) or getattr(_pretrained_core(model), "config", None)
    size = getattr(config, "hidden_size", None)
    require(isinstance(size, int) and size > 0, "config.hidden_size", size, "be a positive int")
    assert isinstance(size, int)
    return size


@dataclass
class PayloadCounter:
    """Bytes that boundaries of this process would put on the variable-size wire, forward and backward,
    and the real tokens (``attention_mask`` == 1; every position without a mask) of the training forwards
    that produced them: padded positions never cross a link, so neither their bytes nor they count.
    ``*_uncoded`` are the same messages before lossless coding (equal to the coded bytes without a coder)."""

    fwd_bytes: int = 0
    bwd_bytes: int = 0
    tokens: int = 0
    fwd_uncoded: int = 0
    bwd_uncoded: int = 0

    def reset(self) -> None:
        self.fwd_bytes = self.bwd_bytes = self.tokens = self.fwd_uncoded = self.bwd_uncoded = 0

    def book(self, direction: str, coded: int, uncoded: int) -> None:
        if direction == "fwd":
            self.fwd_bytes, self.fwd_uncoded = self.fwd_bytes + coded, self.fwd_uncoded + uncoded
        else:
            self.bwd_bytes, self.bwd_uncoded = self.bwd_bytes + coded, self.bwd_uncoded + uncoded


def real_rows(tensor: torch.Tensor, real: torch.Tensor | None) -> torch.Tensor:
    """[B, T, W] → [n, W]: the rows of the real tokens (``real`` [B, T] bool; None: every position)."""
    if real is None or real.shape != tensor.shape[:-1]:
        return tensor.reshape(-1, tensor.shape[-1])
    return tensor[real.to(tensor.device)]


class BoundaryHooks:
    """What every set of boundary hooks shares (masks here, codecs in ``codecs``): they act only on
    training forwards, ``disabled()`` runs the dense model in training mode, ``remove()`` detaches."""

    enabled: bool
    boundary_layers: list[int]
    microbatch: int
    counter: PayloadCounter
    _hooks: list
    _real_mask: torch.Tensor | None = None  # the current microbatch's real tokens (its attention mask)

    @contextlib.contextmanager
    def disabled(self) -> Iterator[None]:
        """Run the dense model in training mode (the anchor's forward/backward)."""
        previous, self.enabled = self.enabled, False
        try:
            yield
        finally:
            self.enabled = previous

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()
        self._hooks.clear()

    def _is_training_forward(self, module: nn.Module) -> bool:
        return module.training and self.enabled and torch.is_grad_enabled()

    def _on_model_forward(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        """A training forward of the whole model is the next microbatch; its tokens are counted."""
        if not self._is_training_forward(module):
            return
        self.microbatch += 1
        self.counter.tokens += self._note_real_tokens(args, kwargs)

    def _note_real_tokens(self, args: tuple, kwargs: dict) -> int:
        """Keep this microbatch's real-token mask (``_real_mask``: the attention mask, or None) and
        return how many real tokens it has."""
        inputs = kwargs.get("input_ids", args[0] if args else None)
        if inputs is None and kwargs.get("inputs_embeds") is not None:
            inputs = kwargs["inputs_embeds"][..., 0]
        mask = kwargs.get("attention_mask")
        usable = isinstance(mask, torch.Tensor) and isinstance(inputs, torch.Tensor) and mask.shape == inputs.shape
        self._real_mask = mask.bool() if usable and isinstance(mask, torch.Tensor) else None
        if self._real_mask is not None:
            return int(self._real_mask.sum())
        return inputs.numel() if isinstance(inputs, torch.Tensor) else 0

    def real_fraction(self, positions: int) -> float:
        """The share of ``positions`` (this microbatch's) that are real tokens."""
        real = self._real_mask
        return 1.0 if real is None or not positions else float(real.sum()) / real.numel()

    def dense_boundary_tokens(self, model: nn.Module, batch: dict) -> list[torch.Tensor]:
        """``dense_boundary_outputs`` at the real tokens only (``attention_mask`` == 1 when given)."""
        hidden = self.dense_boundary_outputs(model, batch)
        real = batch.get("attention_mask")
        return hidden if real is None else [h[real.to(h.device).bool()] for h in hidden]

    @torch.no_grad()
    def dense_boundary_outputs(self, model: nn.Module, batch: dict) -> list[torch.Tensor]:
        """The hidden state leaving every boundary layer in one dense forward on ``batch`` (under a
        private RNG, so calibrating does not move the training's random stream)."""
        _, layers = find_decoder_layers(model)
        captured: dict[int, torch.Tensor] = {}

        def capture(index: int):
            def hook(module, args, output):
                captured[index] = (output[0] if isinstance(output, tuple) else output).detach()

            return hook

        hooks = [layers[i].register_forward_hook(capture(b)) for b, i in enumerate(self.boundary_layers)]
        try:
            with self.disabled(), private_rng(next(model.parameters()).device):
                model(**batch)
        finally:
            for hook in hooks:
                hook.remove()
        return [captured[b] for b in range(len(self.boundary_layers))]


@dataclass
class BoundaryHandle(BoundaryHooks):
    """Boundaries attached to a model. ``remove()`` restores the plain dense model."""

    masks: list[BoundaryMask]
    boundary_layers: list[int]
    stages: list[range]
    layers_name: str
    hidden_size: int
    keep: int
    step: int = 0
    microbatch: int = -1
    enabled: bool = True
    counter: PayloadCounter = field(default_factory=PayloadCounter)
    _hooks: list = field(default_factory=list, repr=False)

    def set_step(self, step: int) -> None:
        """Start optimizer step ``step``: the next training forward is microbatch 0."""
        if step != self.step:
            for mask in self.masks:
                mask.fill.advance()
        self.step, self.microbatch = step, -1

    @torch.no_grad()
    def protect_largest_dims(self, model: nn.Module, batch: dict, count: int) -> list[list[int]]:
        """Always keep, at every boundary, the ``count`` dims of largest RMS on ``batch`` (dense forward).

        Pretrained residual streams carry a few massive-activation dims; a uniform mask drops each
        of them p of the time, which wrecks the forward pass (benchmarks/quality). The chosen set is
        fixed once and shared by both sides of a boundary, so the wire still carries K values and
        no per-step index. Returns the protected dims per boundary.
        """
        require(count >= 0, "mask_protect_dims", count, "be >= 0")
        if count == 0 or not self.masks:
            return [[] for _ in self.masks]
        require(count < self.keep, "mask_protect_dims", count, f"be < K={self.keep}, the dims kept per token")
        hidden = self.dense_boundary_outputs(model, batch)
        squares = [h.float().pow(2).reshape(-1, h.shape[-1]).mean(0) for h in hidden]
        protected = []
        for b, mask in enumerate(self.masks):
            mask.protected = squares[b].topk(count).indices.sort().values.cpu()
            protected.append(mask.protected.tolist())
        return protected

    @torch.no_grad()
    def calibrate_fills(self, model: nn.Module, batch: dict) -> None:
        """Give fills that learn from dense activations (``gaussian``) a first estimate before
        training, from one dense forward on ``batch``; the anchor's rounds refresh it later."""
        was_training = model.training
        model.train()
        try:
            with self.disabled(), private_rng(next(model.parameters()).device):
                model(**batch)
        finally:
            model.train(was_training)
        for mask in self.masks:
            mask.fill.advance()

    def set_up_masks(self, model: nn.Module, first_batch: Callable[[], dict], protect_dims: int, fill: str) -> None:
        """Before training: the protected dims, then a first Gaussian-fill estimate, both on one training
        batch (``first_batch()``, drawn only when needed); each is skipped when a checkpoint restored it."""
        need_dims = protect_dims > 0 and not any(mask.protected is not None for mask in self.masks)
        need_fill = fill == "gaussian" and bool(self.masks) and cast(GaussianFill, self.masks[0].fill).mean is None
        if not (need_dims or need_fill):
            return
        batch = first_batch()
        if need_dims:
            self.protect_largest_dims(model, batch, protect_dims)
        if need_fill:
            self.calibrate_fills(model, {k: v for k, v in batch.items() if k != "labels"})

    def state_dict(self) -> dict:
        return {
            "step": self.step,
            "fills": [mask.fill.state_dict() for mask in self.masks],
            "protected": [None if mask.protected is None else mask.protected.clone() for mask in self.masks],
        }

    def load_state_dict(self, state: dict) -> None:
        self.step, self.microbatch = state["step"], -1
        for mask, fill_state, protected in zip(self.masks, state["fills"], state["protected"]):
            mask.fill.load_state_dict(fill_state)
            mask.protected = None if protected is None else protected.clone()

    def _on_layer_output(self, mask: BoundaryMask, module: nn.Module, args: tuple, output):
        hidden = output[0] if isinstance(output, tuple) else output
        if module.training and not self.enabled:  # the anchor's dense pass: fills may learn from it
            mask.fill.observe_dense(hidden)
        if not self._is_training_forward(module):
            return None
        if mask.mask_ratio == 0.0:  # K = H: nothing to mask, but the dense state still crosses
            self._count(hidden)
            return None
        masked, payload = mask.apply(hidden, self.step, max(self.microbatch, 0))
        self._count(payload)
        return (masked, *output[1:]) if isinstance(output, tuple) else masked

    def _count(self, payload: torch.Tensor) -> None:
        real = self._real_mask
        nbytes = real_rows(payload, real).numel() * payload.element_size()
        self.counter.book("fwd", nbytes, nbytes)
        if payload.requires_grad:
            payload.register_hook(lambda grad: self.counter.book("bwd", nbytes, nbytes))


def attach_boundaries(
    model: nn.Module,
    num_stages: int,
    mask_ratio: float = 0.95,
    seed: int = 0,
    rescale: bool = False,
    fill: str = "zeros",
    stage_layers: Sequence[int] | None = None,
) -> BoundaryHandle:
    """Split ``model``'s decoder layers into ``num_stages`` (Y) stages with masked boundaries.

    Args:
        model: any HF causal LM, also behind a PEFT wrapper.
        num_stages: Y; Y - 1 boundaries. Y = 1 attaches nothing (a single stage).
        mask_ratio: p; each token keeps K = round((1-p)·H) dims at every boundary.
        seed: the mesh's shared base seed for g(ℓ, step, microbatch, T, H, seed).
        rescale: scale kept values by H/K (off: the paper's plain h ⊙ m).
        fill: receiver-side estimate of dropped dims, "zeros" (the paper), "mean" or "gaussian" (see fills.py).
        stage_layers: decoder layers per stage (an uneven split; None = balanced, see ``split_stages``).

    Example:
        >>> handle = attach_boundaries(model, num_stages=4, mask_ratio=0.95)  # doctest: +SKIP
        >>> handle.set_step(0); loss = model(**batch).loss; loss.backward()    # doctest: +SKIP
        >>> handle.remove()                                                     # doctest: +SKIP
    """
    require_fill(fill, rescale)
    layers_name, layers = find_decoder_layers(model)
    stages = split_stages(len(layers), num_stages, stage_layers)
    hidden = _hidden_size(model)
    keep = keep_count(hidden, mask_ratio)
    boundary_layers = [stage[-1] for stage in stages[:-1]]
    masks = [BoundaryMask(i, mask_ratio, seed, rescale, FILLS[fill]()) for i in range(len(boundary_layers))]
    handle = BoundaryHandle(masks, boundary_layers, stages, layers_name, hidden, keep)
    handle._hooks.append(model.register_forward_pre_hook(handle._on_model_forward, with_kwargs=True))
    for mask, layer_index in zip(masks, boundary_layers):
        hook = layers[layer_index].register_forward_hook(
            lambda module, args, output, mask=mask: handle._on_layer_output(mask, module, args, output)
        )
        handle._hooks.append(hook)
    return handle
