"""``save_model`` after a mesh run: a normal sharded Hugging Face checkpoint, each stage its own shard.

The Y processes of fast replica 0 (in a replica job: replica 0's job only) each write
``model-<s+1>-of-<Y>.safetensors`` with the tensors their stage holds, named as ``save_pretrained``
names them; rank 0 then writes the config (``tie_word_embeddings=False``: the stages trained two
copies), the generation config, the tokenizer, the training arguments and
``model.safetensors.index.json``, last, so a folder with an index is complete. No process gathers the
model. Every file is written under a temporary name and renamed into place; stale weights of an
earlier save in the folder are removed first, so ``from_pretrained`` reads this save's shards only.
"""

from __future__ import annotations

import glob
import json
import os

import torch
import torch.distributed as dist
from torch import nn

from .._hf_typing import hf_model
from ..topology import MeshGroups

__all__ = ["SHARD_NAME", "save_stage_shards"]

SHARD_NAME = "model-{:05d}-of-{:05d}.safetensors"
INDEX_NAME = "model.safetensors.index.json"


def _stage_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's ``state_dict`` entries this process holds (the others are on meta), under the keys
    ``save_pretrained`` writes: transformers reverts its load-time renaming (GPT-NeoX's head is saved as
    ``embed_out``, the name other readers of the checkpoint expect). A stage holds whole layers, so a
    conversion within a layer sees all its tensors."""
    from transformers.core_model_loading import revert_weight_conversion

    held = {n: t.detach().contiguous() for n, t in model.state_dict().items() if not t.is_meta}
    return revert_weight_conversion(hf_model(model), held)


def save_stage_shards(trainer, groups: MeshGroups, output_dir: str, survivors=None) -> None:
    """Write the mesh's trained model to ``output_dir`` (see the module docstring); every process of
    the job calls it, the writers synchronise over fast replica 0's pipeline group."""
    from safetensors.torch import save_file

    topology = groups.topology
    writer_replica = topology.job_replica or 0
    writes = groups.replica == writer_replica and (topology.job_replica is None or topology.job_replica == 0)
    if writes:
        stage, stages = groups.stage, topology.stages
        first = stage == 0
        if first:
            os.makedirs(output_dir, exist_ok=True)
            for stale in [
                os.path.join(output_dir, "model.safetensors"),
                os.path.join(output_dir, INDEX_NAME),
                *glob.glob(os.path.join(output_dir, "model-*-of-*.safetensors")),
            ]:
                if os.path.exists(stale):
                    os.remove(stale)
        dist.barrier(group=groups.pp_group)  # the folder is clean before any shard lands
        tensors = _stage_tensors(trainer.model)
        name = SHARD_NAME.format(stage + 1, stages)
        path = os.path.join(output_dir, name)
        save_file(tensors, f"{path}.tmp", metadata={"format": "pt"})
        os.replace(f"{path}.tmp", path)
        entry = ({key: name for key in tensors}, sum(t.numel() * t.element_size() for t in tensors.values()))
        entries: list = [None] * stages
        dist.all_gather_object(entries, entry, group=groups.pp_group)
        if first:
            _write_rank0_files(trainer, output_dir, entries)
        dist.barrier(group=groups.pp_group)  # the index is there when any writer returns
    dist.barrier(group=survivors)


def _write_rank0_files(trainer, output_dir: str, entries: list) -> None:
    model = trainer.model
    model.config.save_pretrained(output_dir)
    generation = getattr(model, "generation_config", None)
    if generation is not None and getattr(model, "can_generate", lambda: False)():
        generation.save_pretrained(output_dir)
    if getattr(trainer, "processing_class", None) is not None:
        trainer.processing_class.save_pretrained(output_dir)
    torch.save(trainer.args, os.path.join(output_dir, "training_args.bin"))
    weight_map: dict[str, str] = {}
    for names, _ in entries:
        weight_map.update(names)
    index = {
        "metadata": {"total_size": sum(size for _, size in entries)},
        "weight_map": dict(sorted(weight_map.items())),
    }
    path = os.path.join(output_dir, INDEX_NAME)
    with open(f"{path}.tmp", "w") as handle:
        json.dump(index, handle, indent=2)
    os.replace(f"{path}.tmp", path)
