"""Each mesh process holds only its own stage's tensors.

Two ways in, one result (a model whose non-owned parameters are on the ``meta`` device, marked with
``stage_of(model) == (stage, Y)``):

- ``load_causal_lm(path)``: on a launched mesh, the model skeleton is built on the meta device
  (``accelerate.init_empty_weights``: parameters on meta, buffers such as the rotary frequencies
  real), then only the tensors this process's stage owns are read from the checkpoint's safetensors
  (sharded or not), one tensor at a time through ``safe_open``: no other layer's tensor is ever read.
  Checkpoint keys are matched to the model's names as ``from_pretrained`` matches them, by transformers'
  own load-time renaming (the base model's prefix; GPT-NeoX's head, ``embed_out`` on disk).
  On one process it is ``AutoModelForCausalLM.from_pretrained``.
- ``release_unowned(model, stage_module)``: a model object the user built whole gives back every
  parameter its stage does not hold (``StageWorker`` calls it, so every mesh entry point does).

The stage a process owns is its mesh rank's (``replica · Y + stage``), the anchor's included.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch
from torch import nn

from .._hf_typing import hf_model
from .._validation import require

if TYPE_CHECKING:
    from .stage import StageModule

__all__ = [
    "load_causal_lm",
    "materialise",
    "materialised_bytes",
    "process_stage",
    "release_unowned",
    "split_of",
    "stage_of",
]

_STAGE_ATTR = "_meshtune_stage"
_SPLIT_ATTR = "_meshtune_stage_layers"


def stage_of(model: nn.Module | None) -> tuple[int, int] | None:
    """(stage, Y) when ``model`` holds only that stage's tensors (the rest on meta), else None (no model too)."""
    return getattr(_unwrapped(model), _STAGE_ATTR, None)


def split_of(model: nn.Module | None) -> tuple[int, ...] | None:
    """Decoder layers per stage of the split ``model`` was given back by (``release_unowned``), else None."""
    return getattr(_unwrapped(model), _SPLIT_ATTR, None)


def _unwrapped(model: nn.Module | None) -> nn.Module | None:
    get_base = getattr(model, "get_base_model", None)  # PEFT
    return get_base() if callable(get_base) else model


def _mark(model: nn.Module, stage: int, num_stages: int, split: tuple[int, ...] | None) -> None:
    setattr(_unwrapped(model), _STAGE_ATTR, (stage, num_stages))
    setattr(_unwrapped(model), _SPLIT_ATTR, split)


def materialised_bytes(model: nn.Module) -> int:
    """Bytes of the parameters and buffers this process really holds (meta tensors hold none)."""
    seen: set[int] = set()
    total = 0
    for tensor in [*model.parameters(), *model.buffers()]:
        if tensor.is_meta or id(tensor) in seen:
            continue
        seen.add(id(tensor))
        total += tensor.numel() * tensor.element_size()
    return total


def release_unowned(model: nn.Module, stage_module: nn.Module, stage: int, num_stages: int) -> int:
    """Replace every parameter of ``model`` that ``stage_module`` does not hold by a meta tensor of the
    same shape, dtype and ``requires_grad``; returns the bytes given back. A parameter shared with an
    owned module (tied weights) is owned."""
    owned = {id(p) for p in stage_module.parameters()}
    released = 0
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.is_meta or id(param) in owned:
                continue
            released += param.numel() * param.element_size()
            module._parameters[name] = nn.Parameter(
                torch.empty_like(param, device="meta"), requires_grad=param.requires_grad
            )
    _mark(model, stage, num_stages, getattr(stage_module, "stage_layers", None))
    return released


def materialise(model: nn.Module, name: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """Give the meta parameter ``name`` real (uninitialised) storage on ``device``; returns it."""
    from accelerate.utils import set_module_tensor_to_device

    param = model.get_parameter(name)
    if param.is_meta:
        set_module_tensor_to_device(model, name, device, value=torch.empty(param.shape, dtype=param.dtype))
    return model.get_parameter(name)


def process_stage(num_layers: int, num_stages: int | None = None) -> tuple[int, int] | None:
    """(stage, Y) of this process on a launched mesh (``$MESHTUNE_MESH`` gives Y, ``num_stages``
    without it), or None on one process. Mesh rank = ``$MESHTUNE_REPLICA`` · Y + ``$RANK`` in replica
    jobs, ``$RANK`` otherwise; stage = mesh rank mod Y."""
    from ..topology import REPLICA_ENV, launched_stages

    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return None
    stages = launched_stages() or num_stages
    require(
        stages is not None,
        "num_stages",
        None,
        "be given to load a stage on a launched job without MESHTUNE_MESH (e.g. accelerate launch)",
    )
    require(
        isinstance(stages, int) and 1 <= stages <= num_layers,
        "num_stages",
        stages,
        f"be an int in [1, {num_layers}] (the checkpoint's decoder layers)",
    )
    assert isinstance(stages, int)
    rank = int(os.environ.get("RANK", "0"))
    replica = os.environ.get(REPLICA_ENV)
    mesh_rank = int(replica) * stages + rank if replica is not None else rank
    return mesh_rank % stages, stages


def _checkpoint_files(path: str) -> dict[str, str]:
    """Tensor name → safetensors file of the checkpoint folder ``path`` (sharded or not)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.isfile(single):
        from safetensors import safe_open

        with safe_open(single, framework="pt") as handle:
            return dict.fromkeys(handle.keys(), single)
    require(
        os.path.isfile(index),
        "model_name_or_path",
        path,
        "be a folder with model.safetensors or model.safetensors.index.json to load one stage of it",
    )
    with open(index) as handle:
        weight_map = json.load(handle)["weight_map"]
    return {name: os.path.join(path, file) for name, file in weight_map.items()}


def _local_folder(path: str) -> str:
    if os.path.isdir(path):
        return path
    from huggingface_hub import snapshot_download  # a hub id: its files, as from_pretrained would fetch them

    return snapshot_download(path, allow_patterns=["*.json", "*.safetensors", "*.txt", "*.model"])


def load_causal_lm(
    path: str,
    *,
    dtype: torch.dtype | str | None = "auto",
    num_stages: int | None = None,
    stage_layers: Sequence[int] | None = None,
    **kwargs,
) -> nn.Module:
    """``AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)``, except on a launched mesh,
    where only this process's stage is built and read (see the module docstring).

    ``num_stages``: Y when the launcher sets no ``$MESHTUNE_MESH`` (``accelerate launch``).
    ``stage_layers``: the run's uneven split (decoder layers per stage; None = balanced). Raises a
    ``ValueError`` naming the stage and the tensor when the checkpoint lacks one the stage needs, or
    naming the tensor and both shapes when the checkpoint does not match its config."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    num_layers = config.get_text_config().num_hidden_layers
    placed = process_stage(num_layers, num_stages)
    if placed is None:
        return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kwargs)
    stage, stages = placed
    folder = _local_folder(path)
    if dtype == "auto" or dtype is None:
        dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or torch.float32
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    from accelerate import init_empty_weights

    with init_empty_weights():  # parameters on meta; buffers (rotary frequencies) real
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, **kwargs)
    model.config._name_or_path = path
    head, embed = model.get_output_embeddings(), model.get_input_embeddings()
    tied = {}  # a tied checkpoint stores the head's matrix once, as the input embeddings
    if head is not None and embed is not None and getattr(config.get_text_config(), "tie_word_embeddings", False):
        tied = {_name_of(model, head, "weight"): _name_of(model, embed, "weight")}
    from .stage import StageModule, untie_embeddings

    untie_embeddings(model)  # the first and last stages each hold their own copy
    if tied:  # a skeleton from a config is not tied yet: its config still says so
        for each in {id(c): c for c in (model.config, model.config.get_text_config())}.values():
            each.tie_word_embeddings = False
    module = StageModule(model, stage, stages, None, None, stage_layers=stage_layers)
    _load_owned(model, module, folder, stage, tied, dtype)
    release_unowned(model, module, stage, stages)  # nothing to give back: marks the model
    _load_generation_config(model, folder)
    model.eval()  # as from_pretrained leaves it
    return model


def _name_of(model: nn.Module, module: nn.Module, attr: str) -> str:
    for name, candidate in model.named_modules(remove_duplicate=False):
        if candidate is module:
            return f"{name}.{attr}" if name else attr
    raise AssertionError("module not in model")


def _checkpoint_names(model: nn.Module, keys) -> dict[str, tuple[str, str | None]]:
    """The model's state-dict name of every checkpoint key in ``keys``, renamed as ``from_pretrained``
    renames it (the base model's prefix added or dropped; a family's legacy names, e.g. GPT-NeoX's
    ``embed_out`` → ``lm_head``): name → (checkpoint key, the pattern of a transformers conversion that
    merges or splits the tensor at load, or None)."""
    from transformers.conversion_mapping import get_model_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    transforms = get_model_conversion_mapping(hf_model(model))
    renamings = [t for t in transforms if isinstance(t, WeightRenaming)]
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    meta = model.state_dict()
    names: dict[str, tuple[str, str | None]] = {}
    for key in keys:
        name, converted = rename_source_key(key, renamings, converters, hf_model(model).base_model_prefix, meta)
        if name not in meta and key in meta:  # as from_pretrained: a key the renaming missed keeps its name
            name, converted = key, None
        names.setdefault(name, (key, converted))
    return names


def _load_owned(model: nn.Module, module: StageModule, folder: str, stage: int, tied: dict, dtype) -> None:
    from accelerate.utils import set_module_tensor_to_device
    from safetensors import safe_open

    from .stage import stage_parameter_names

    files = _checkpoint_files(folder)
    names = _checkpoint_names(model, files)
    wanted: dict[str, list[tuple[str, str]]] = {}
    for name in stage_parameter_names(model, module):
        alias = tied.get(name)
        key, converted = names.get(name) or (names.get(alias) if alias is not None else None) or (None, None)
        require(
            key is not None,
            f"checkpoint tensor {name!r} (stage {stage})",
            "missing",
            f"be in the checkpoint at {folder}: stage {stage} holds it",
        )
        assert key is not None
        require(
            converted is None,
            f"checkpoint tensor {key!r} (stage {stage})",
            converted,
            "be stored as its parameter (transformers converts it at load, merging or splitting tensors, which "
            "per-stage loading does not do: load the model whole and let its stages release the rest)",
        )
        wanted.setdefault(files[key], []).append((name, key))
    for file, entries in wanted.items():
        with safe_open(file, framework="pt") as handle:
            for name, key in entries:
                value = handle.get_tensor(key)
                expected = tuple(model.get_parameter(name).shape)
                require(
                    tuple(value.shape) == expected,
                    f"checkpoint tensor {key!r} (stage {stage})",
                    list(value.shape),
                    f"have the shape {list(expected)} that the checkpoint's config gives it",
                )
                set_module_tensor_to_device(model, name, "cpu", value=value, dtype=dtype)


def _load_generation_config(model: nn.Module, folder: str) -> None:
    if not os.path.isfile(os.path.join(folder, "generation_config.json")):
        return
    from transformers import GenerationConfig

    hf_model(model).generation_config = GenerationConfig.from_pretrained(folder)
