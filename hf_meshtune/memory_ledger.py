"""The memory ledger: what each mesh process will hold, predicted from the config alone (no weights).

Like the byte ledger, but for memory: for every stage of the fast circuit and of the anchor replica,
the parts ``memory`` measures in a run, from the model's real shapes (the model is built on
the meta device) and the run's settings:

- ``weights``: the stage's parameters and buffers in the model dtype (with ``peft_config``, the
  adapters too, built by PEFT itself on the meta model: their dtype is PEFT's, float32 by default);
- ``gradients``: one gradient per trainable parameter (with an adapter, the adapter's only);
- ``optimizer``: AdamW's two moments per trainable parameter (and a float32 step per tensor);
- ``anchor``: fast ranks with the anchor, ``SpectralAdamW``'s anchor momentum (float32 or wider) and
  filter bases U [m, r], d [r], V [n, r] per trainable matrix; the anchor replica, the outer momentum
  it replays;
- ``dp``: Streaming DiLoCo's θ_global backup and outer momentum per trainable parameter, PowerSGD's
  float32 error feedback and Q [n, rank] per matrix it compresses;
- ``codec``: the composed boundary codecs' geometry;
- ``activations``: what autograd saves for backward, traced: the stage's forward runs once on meta
  tensors of one microbatch's shape (with the loss on the last stage) under the same counting hooks
  as the run's ``ActivationMeter``, times the microbatches a 1F1B stage s keeps in flight,
  min(Y − s, M) (all M under GPipe, when M < Y). With gradient checkpointing: what is saved outside
  the layers, and each layer's input [B, T, H], per microbatch in flight, plus one layer's activations
  (the one recomputing in backward).

What no ledger can know is the process's own overhead (the Python runtime and libraries, allocator
slack): a run's peak RSS is the predicted total plus that, shown beside it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from ._hf_typing import hf_config
from ._validation import require
from .config import DP_QUANTIZERS
from .memory import MEMORY_PARTS

__all__ = ["MemorySettings", "format_memory_table", "meta_model", "predict_memory"]


@dataclass(frozen=True)
class MemorySettings:
    """The run's shape: the mesh, the step's microbatches, the dtype and the method's knobs."""

    num_replicas: int
    num_stages: int
    microbatch_size: int
    microbatches: int
    seq_len: int
    dtype: str = "float32"
    anchor: bool = False
    anchor_microbatches: int | None = None
    dp_mode: str = "streaming_diloco"
    powersgd_rank: int | None = 4
    dp_quantize: str | None = None  # "int8": the tensors that go dense keep a float32 error feedback
    spectral_rank: int | None = None
    boundary_codec: str | None = None
    mask_seed: int = 0
    gradient_checkpointing: bool = False
    stage_layers: tuple[int, ...] | None = None  # decoder layers per stage (uneven); None = balanced

    def __post_init__(self) -> None:
        for name in ("num_replicas", "num_stages", "microbatch_size", "microbatches", "seq_len"):
            value = getattr(self, name)
            require(isinstance(value, int) and value >= 1, name, value, "be an int >= 1")
        require(isinstance(getattr(torch, self.dtype, None), torch.dtype), "dtype", self.dtype, "name a torch dtype")
        require(
            self.dp_quantize in (None, *DP_QUANTIZERS),
            "dp_quantize",
            self.dp_quantize,
            f"be None or one of {list(DP_QUANTIZERS)}",
        )
        require(
            not self.anchor or self.num_replicas >= 2,
            "num_replicas",
            self.num_replicas,
            "be >= 2 with the anchor (it is one of the X replicas)",
        )


def meta_model(config) -> nn.Module:
    from accelerate import init_empty_weights
    from transformers import AutoModelForCausalLM

    with init_empty_weights():  # parameters on meta, buffers (rotary frequencies) real
        return AutoModelForCausalLM.from_config(config)


def predict_memory(
    config, settings: MemorySettings, trainable: Callable[[str], bool] | None = None, peft_config=None
) -> list[dict[str, int | str]]:
    """Per process kind (role, stage): the predicted bytes of every part and their ``total``.

    ``config``: a transformers config of a causal LM; ``trainable(name)``: whether the parameter of
    that full-model name trains (default: all, a full fine-tune); ``peft_config``: a PEFT config (e.g.
    ``LoraConfig``) whose adapters wrap the model as in the run, the adapters alone training."""
    from .boundary.compose.codec import ComposedCodec, geometry_layout
    from .config import composed_codec
    from .dp.powersgd import PowerSGD
    from .memory import ActivationMeter
    from .pipeline.stage import StageModule, stage_parameter_names, untie_embeddings

    dtype = getattr(torch, settings.dtype)
    model = meta_model(config).to(dtype)
    untie_embeddings(model)  # the mesh's first and last stages each hold a copy
    if peft_config is not None:
        model = _with_adapters(model, peft_config)
    else:
        trains = trainable or (lambda name: True)
        for name, param in model.named_parameters():
            param.requires_grad_(trains(name))
    model.train()
    stages = settings.num_stages
    powersgd = PowerSGD(settings.powersgd_rank) if settings.powersgd_rank else None
    spec = composed_codec(settings)  # None for masks: they keep no state
    hidden = hf_config(model).get_text_config().hidden_size
    rows: list[dict[str, int | str]] = []
    roles = ["fast", "anchor"] if settings.anchor else ["fast"]
    for stage in range(stages):
        module = StageModule(model, stage, stages, None, None, stage_layers=settings.stage_layers)
        named = stage_parameter_names(model, module)
        params = list(named.values())
        train = [p for p in params if p.requires_grad]
        weights = _nbytes(params) + sum(b.numel() * b.element_size() for b in module.buffers())
        grads = _nbytes(train)
        for role in roles:
            micro = settings.microbatches if role == "fast" else (settings.anchor_microbatches or settings.microbatches)
            parts = dict.fromkeys(MEMORY_PARTS, 0)
            parts["weights"], parts["gradients"] = weights, grads
            parts["activations"] = _activations(module, model, settings, micro, ActivationMeter)
            if role == "fast":
                parts["optimizer"] = 2 * grads + 4 * len(train)
                parts["dp"] = _dp_bytes(train, powersgd, settings)
                if settings.anchor:
                    parts["anchor"] = sum(_anchor_bytes(p, settings.spectral_rank) for p in train if p.ndim == 2)
                if spec is not None:
                    boundaries = [b for b in (stage - 1, stage) if 0 <= b < stages - 1]
                    parts["codec"] = sum(
                        math.prod(shape) * kind.itemsize
                        for b in boundaries
                        for _, shape, kind in geometry_layout(ComposedCodec(spec, b, hidden, settings.mask_seed))
                    )
            else:
                parts["anchor"] = grads  # the outer momentum it replays
            rows.append({"role": role, "stage": stage, **parts, "total": sum(parts.values())})
    return rows


def _nbytes(params: list[nn.Parameter]) -> int:
    return sum(p.numel() * p.element_size() for p in params)


def _with_adapters(model: nn.Module, peft_config) -> nn.Module:
    """The meta model wrapped by PEFT as the run wraps it: adapter tensors on meta too, PEFT's own
    dtype and ``requires_grad`` (the base frozen)."""
    import copy

    from accelerate import init_empty_weights
    from peft import get_peft_model

    with init_empty_weights():
        return get_peft_model(model, copy.deepcopy(peft_config))


def _dp_bytes(train: list[nn.Parameter], powersgd, settings: MemorySettings) -> int:
    if settings.dp_mode != "streaming_diloco" or settings.num_replicas - int(settings.anchor) < 1:
        return 0
    total = 2 * _nbytes(train)  # θ_global backup + outer momentum
    for p in train:
        if powersgd is not None and powersgd.compresses(p.shape):
            total += p.numel() * 4 + p.shape[1] * powersgd.rank * 4  # error feedback + Q, float32
        elif settings.dp_quantize is not None:
            total += p.numel() * 4  # the int8 codes' error feedback, float32 (dp.quantize)
    return total


def _anchor_bytes(param: nn.Parameter, rank: int | None) -> int:
    m, n = param.shape
    wide = torch.promote_types(param.dtype, torch.float32).itemsize
    r = min(m, n) if rank is None else min(rank, m, n)
    return (m * n + (m + n) * r + r) * wide


def _activations(module, model, settings: MemorySettings, microbatches: int, meter_cls) -> int:
    """Bytes autograd saves for the microbatches this stage keeps in flight, traced on meta. With gradient
    checkpointing each layer keeps only its input [B, T, H] per microbatch in flight, and one layer at a
    time recomputes its activations in backward."""
    stages, stage = settings.num_stages, module.stage
    in_flight = min(stages - stage, microbatches) if microbatches >= stages else microbatches
    full = _trace(module, model, settings, meter_cls, layers=True)
    if not settings.gradient_checkpointing or not len(module.layers):
        return full * in_flight
    outside = _trace(module, model, settings, meter_cls, layers=False)
    per_layer = (full - outside) // len(module.layers)
    inputs = len(module.layers) * settings.microbatch_size * settings.seq_len * module.hidden_size
    return (outside + inputs * getattr(torch, settings.dtype).itemsize) * in_flight + per_layer


def _trace(module, model, settings: MemorySettings, meter_cls, layers: bool) -> int:
    """Bytes autograd saves in one microbatch's forward of the stage (``layers=False``: without its layers)."""
    from .pipeline.stage import causal_lm_loss

    b, t = settings.microbatch_size, settings.seq_len
    dtype = getattr(torch, settings.dtype)
    if module.embed_tokens is not None:
        x = torch.zeros(b, t, dtype=torch.long, device="meta")
    else:
        x = torch.zeros(b, t, module.hidden_size, dtype=dtype, device="meta", requires_grad=True)
    meter = meter_cls(module.parameters())
    with meter, _FusedAttentionOnMeta():
        hidden = module.embed(x) if module.embed_tokens is not None else x
        positions = torch.arange(t, device="meta").unsqueeze(0)
        # the masks as a run has them (see _meta_masks): none for SDPA's causal layers, [B, 1, T, T] otherwise
        kept = module.layers
        if not layers:
            module.layers = nn.ModuleList()
        try:
            out = module.through_layers(hidden, positions, _meta_masks(module, hidden))
        finally:
            module.layers = kept
        if module.lm_head is not None:
            out = causal_lm_loss(model)(out, torch.zeros(b, t, dtype=torch.long, device="meta"))
        one = meter.peak
        del out
    return one


def _meta_masks(module, hidden: torch.Tensor) -> dict[str, torch.Tensor | None]:
    """Stand-ins for the masks a stage builds in a run (transformers cannot build them on meta): eager
    attention always gets an additive [B, 1, T, T] mask in the model dtype; SDPA gets none for causal
    layers (its is_causal path) and a boolean one for sliding layers once T reaches the window."""
    b, t = hidden.shape[:2]
    config = module.mask_config
    eager = config._attn_implementation == "eager"

    def mask(kind: str) -> torch.Tensor | None:
        if not eager and (kind == "full_attention" or t < config.sliding_window):
            return None
        return torch.zeros(b, 1, t, t, dtype=hidden.dtype if eager else torch.bool, device="meta")

    return {kind: mask(kind) for kind in dict.fromkeys(module.layer_types)}


class _FusedAttentionOnMeta(torch.overrides.TorchFunctionMode):
    """On meta, ``scaled_dot_product_attention`` would trace its math fallback, which saves the
    [B, heads, T, T] weights; a run's CPU and GPU kernels (flash / memory-efficient) save only the
    inputs, the output and a [B, heads, T] log-sum-exp. Trace the fused kernel's autograd instead; a
    boolean mask (a sliding window) becomes the additive mask SDPA converts it to in every call."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is not torch.nn.functional.scaled_dot_product_attention or not args[0].is_meta:
            return func(*args, **kwargs)
        q, k, v = args[:3]
        if kwargs.get("enable_gqa") and k.shape[-3] != q.shape[-3]:
            repeat = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(repeat, dim=-3), v.repeat_interleave(repeat, dim=-3)
        mask = kwargs.get("attn_mask")
        if mask is not None and mask.dtype == torch.bool:
            mask = torch.zeros(mask.shape, dtype=q.dtype, device=mask.device)
        out = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            q,
            k,
            v,
            kwargs.get("dropout_p", 0.0),
            kwargs.get("is_causal", False),
            attn_mask=mask,
            scale=kwargs.get("scale"),
        )
        return out[0]


def format_memory_table(rows: list[dict], settings: MemorySettings) -> str:
    """The ledger as a text table in GiB, one line per (role, stage)."""
    gib = 1024**3
    head = f"{'role':<7}{'stage':>6}" + "".join(f"{p:>13}" for p in (*MEMORY_PARTS, "total"))
    lines = [
        f"predicted memory per process (GiB), mesh {settings.num_replicas}x{settings.num_stages}, "
        f"{settings.microbatches} × [{settings.microbatch_size}, {settings.seq_len}] per step, {settings.dtype}",
        head,
    ]
    for row in rows:
        lines.append(
            f"{row['role']:<7}{row['stage']:>6}" + "".join(f"{row[p] / gib:>13.3f}" for p in (*MEMORY_PARTS, "total"))
        )
    lines.append("(+ the process's own runtime: Python, torch and transformers, allocator slack; not predicted)")
    return "\n".join(lines)
