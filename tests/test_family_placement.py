"""Per-stage loading beyond Llama's names: a launched rank of a GPT-NeoX, Gemma 2 or Gemma 3 checkpoint reads its
own stage's tensors only, under the checkpoint's own keys (GPT-NeoX's head as ``embed_out``, the name transformers
still writes and renames to ``lm_head`` at load; Gemma's head tied to its embeddings), and the stage it builds
computes what the saved model's stage computes."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_meshtune import load_causal_lm
from hf_meshtune.pipeline.placement import split_of, stage_of
from hf_meshtune.pipeline.stage import StageModule, stage_parameter_names, untie_embeddings
from tests.test_stage_memory import _launch, _on_rank
from tests.tiny import pattern_dataset, tiny_family

pytestmark = pytest.mark.usefixtures("single_thread_torch")

INDEX = "model.safetensors.index.json"


def _cut(folder, keep: set[str]) -> None:
    """Cut every tensor outside ``keep`` to one value: reading (or shape-checking) any of them fails the load."""
    index = json.loads((folder / INDEX).read_text())
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(folder / shard)
        save_file({k: v if k in keep else torch.zeros(1) for k, v in tensors.items()}, folder / shard, {"format": "pt"})


def _stage_input(stage: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(11)
    return torch.randint(3, 100, (2, 12), generator=gen) if stage == 0 else torch.randn(2, 12, 64, generator=gen)


@pytest.mark.parametrize(
    "family, stage", [("gpt_neox", 0), ("gpt_neox", 1), ("gemma2", 0), ("gemma2", 1), ("gemma3_text", 1)]
)
def test_a_stage_of_another_family_reads_only_its_own_tensors(tmp_path, monkeypatch, family, stage):
    reference = tiny_family(family, hidden=64, seed=3)
    folder = tmp_path / "ckpt"
    reference.save_pretrained(folder, max_shard_size="100KB")
    saved = {k: v for f in os.listdir(folder) if f.endswith(".safetensors") for k, v in load_file(folder / f).items()}
    assert (folder / INDEX).exists() and "lm_head.weight" not in saved  # sharded; the head under another key:
    head = "embed_out.weight" if family == "gpt_neox" else "model.embed_tokens.weight"  # GPT-NeoX's / Gemma's tied
    assert head in saved and len(saved) == len(reference.state_dict()) - (family != "gpt_neox")
    untie_embeddings(reference)
    owned = set(stage_parameter_names(reference, StageModule(reference, stage, 2, None, None)))
    key = {"lm_head.weight": head}
    _cut(folder, {key.get(n, n) for n in owned})
    _on_rank(monkeypatch, rank=stage)
    model = load_causal_lm(str(folder))
    assert stage_of(model) == (stage, 2)
    assert {n for n, p in model.named_parameters() if not p.is_meta} == owned
    for name in owned:
        assert torch.equal(model.get_parameter(name), saved[key.get(name, name)]), name
    # the skeleton's buffers (rotary tables, Gemma's √H scale) are the saved model's: the stage computes the same
    reference.eval()
    x = _stage_input(stage)
    expected = StageModule(reference, stage, 2, None, None)(x)
    torch.testing.assert_close(StageModule(model, stage, 2, None, None)(x), expected, rtol=0, atol=0)


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_of_an_uneven_split_reads_only_its_own_layers(tmp_path, monkeypatch, stage):
    """stage_layers = (3, 1): stage 0 reads the embeddings and layers 0-2, stage 1 layer 3, the norm and the head;
    the model remembers the split it was loaded for (a run with another split refuses it by name)."""
    reference = tiny_family("llama", hidden=64, seed=3)
    folder = tmp_path / "ckpt"
    reference.save_pretrained(folder)
    untie_embeddings(reference)
    module = StageModule(reference, stage, 2, None, None, stage_layers=(3, 1))
    owned = set(stage_parameter_names(reference, module))
    _on_rank(monkeypatch, rank=stage)
    model = load_causal_lm(str(folder), stage_layers=[3, 1])
    assert stage_of(model) == (stage, 2) and split_of(model) == (3, 1)
    assert {n for n, p in model.named_parameters() if not p.is_meta} == owned
    layers = {int(n.split(".")[2]) for n in owned if n.startswith("model.layers.")}
    assert layers == ({0, 1, 2} if stage == 0 else {3})
    reference.eval()
    x = _stage_input(stage)
    expected = module(x)
    loaded = StageModule(model, stage, 2, None, None, stage_layers=(3, 1))
    torch.testing.assert_close(loaded(x), expected, rtol=0, atol=0)


@pytest.mark.slow
@pytest.mark.parametrize("family", ["gpt_neox", "gemma2"])
def test_a_mesh_run_of_another_family_loads_saves_and_evaluates_stage_by_stage(tmp_path, family):
    """A 2×2 mesh loads the checkpoint per stage, trains, saves one shard per stage under the keys save_pretrained
    writes (GPT-NeoX's embed_out; Gemma's head untied into its own tensor) that plain transformers loads with
    nothing missing, and its pipelined evaluation equals Trainer.evaluate of the saved model."""
    checkpoint, out = tmp_path / "ckpt", tmp_path / "run"
    tiny_family(family, hidden=64).save_pretrained(checkpoint)
    proc = _launch(out, "--checkpoint", str(checkpoint))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    before = load_file(checkpoint / "model.safetensors")
    index = json.loads((out / INDEX).read_text())["weight_map"]
    assert set(index) == (set(before) if family == "gpt_neox" else set(before) | {"lm_head.weight"})
    saved, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert saved.config.tie_word_embeddings is False
    after = {k: v for f in set(index.values()) for k, v in load_file(out / f).items()}
    assert all(not torch.equal(after[k], before[k]) for k in before if k.endswith("weight") and "norm" not in k)
    held_out = pattern_dataset(72, 16).select(range(64, 72))
    args = TrainingArguments(str(tmp_path / "eval"), report_to="none", per_device_eval_batch_size=8)
    reference = Trainer(model=saved, args=args, eval_dataset=held_out).evaluate()["eval_loss"]
    for rank in range(4):
        mesh_eval = json.loads((out / f"eval_rank{rank}.json").read_text())["eval_loss"]
        assert mesh_eval == pytest.approx(reference, rel=1e-6)
