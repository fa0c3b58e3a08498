"""Each mesh process holds only its stage: per-stage loading, the memory it reports, the memory ledger,
the sharded save and the pipelined evaluation after a mesh run."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

from hf_meshtune import load_causal_lm
from hf_meshtune.memory import ActivationMeter
from hf_meshtune.memory_ledger import MemorySettings, predict_memory
from hf_meshtune.pipeline.placement import materialised_bytes, stage_of
from hf_meshtune.pipeline.stage import StageModule, causal_lm_loss, stage_parameter_names, untie_embeddings
from tests.distributed import mesh_launch
from tests.tiny import make_tiny_causal_lm, pattern_dataset, tiny_llama

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _on_rank(monkeypatch, rank: int, mesh: str = "2x2") -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("MESHTUNE_MESH", mesh)
    monkeypatch.delenv("MESHTUNE_REPLICA", raising=False)


def _owned_names(model, stage: int, stages: int) -> set[str]:
    untie_embeddings(model)
    return set(stage_parameter_names(model, StageModule(model, stage, stages, None, None)))


@pytest.mark.parametrize("stage", [0, 1])
def test_a_stage_reads_only_its_own_tensors_from_a_sharded_checkpoint(tmp_path, monkeypatch, stage):
    """Every tensor another stage owns is cut to one value in the checkpoint: reading (or shape-checking) any
    of them would fail, so a stage that loads has read only its own; they equal the saved ones, the rest is
    on meta, and the tied head is read from the embedding matrix."""
    reference = make_tiny_causal_lm("llama", hidden=64, layers=4, seed=3, tie_word_embeddings=True)
    folder = tmp_path / "ckpt"
    reference.save_pretrained(folder, max_shard_size="100KB")
    shards = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
    assert len(shards) > 2  # sharded, with an index
    saved = {k: v for f in shards for k, v in load_file(folder / f).items()}
    owned = _owned_names(make_tiny_causal_lm("llama", hidden=64, layers=4, tie_word_embeddings=True), stage, 2)
    assert "lm_head.weight" not in saved  # tied: the checkpoint keeps the matrix once, as the embeddings
    keep = {"model.embed_tokens.weight" if n == "lm_head.weight" else n for n in owned}
    for shard in shards:
        tensors = load_file(folder / shard)
        cut = {k: v if k in keep else torch.zeros(1) for k, v in tensors.items()}
        save_file(cut, folder / shard, metadata={"format": "pt"})
    _on_rank(monkeypatch, rank=stage)
    model = load_causal_lm(str(folder))
    assert stage_of(model) == (stage, 2)
    real = {n for n, p in model.named_parameters() if not p.is_meta}
    assert real == owned
    for name in owned:
        key = "model.embed_tokens.weight" if name == "lm_head.weight" else name
        assert torch.equal(model.get_parameter(name), saved[key]), name
    assert materialised_bytes(model) == sum(model.get_parameter(n).nbytes for n in owned) + sum(
        b.nbytes for b in model.buffers()
    )
    assert model.config.tie_word_embeddings is False  # the stages train two copies


def test_a_corrupt_tensor_of_the_stage_itself_is_refused_naming_it(tmp_path, monkeypatch):
    folder = tmp_path / "ckpt"
    tiny_llama().save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.0.mlp.down_proj.weight"] = torch.zeros(1)  # stage 0's
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    _on_rank(monkeypatch, rank=1)
    load_causal_lm(str(folder))  # stage 1 never reads it
    _on_rank(monkeypatch, rank=2)  # replica 1, stage 0
    with pytest.raises(ValueError, match=r"'model.layers.0.mlp.down_proj.weight' \(stage 0\)=\[1\]"):
        load_causal_lm(str(folder))


def test_a_tensor_transformers_would_convert_at_load_is_refused_naming_its_key(tmp_path, monkeypatch):
    """A checkpoint key that transformers' load-time conversion maps onto a stage's parameter (merging,
    splitting or, here, transposing it) is not read as if it were that parameter: the stage names the key
    and the conversion. No supported family has one in transformers 5.24, so the conversion is given."""
    from transformers import conversion_mapping
    from transformers.core_model_loading import Transpose, WeightConverter

    folder = tmp_path / "ckpt"
    tiny_llama().save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors["model.layers.3.mlp.up_proj_t.weight"] = tensors.pop("model.layers.3.mlp.up_proj.weight").T.contiguous()
    save_file(tensors, folder / "model.safetensors", metadata={"format": "pt"})
    transpose = WeightConverter("mlp.up_proj_t.weight", "mlp.up_proj.weight", operations=[Transpose(0, 1)])
    monkeypatch.setattr(conversion_mapping, "get_model_conversion_mapping", lambda model: [transpose])
    _on_rank(monkeypatch, rank=0)
    load_causal_lm(str(folder))  # stage 0 holds no converted tensor
    _on_rank(monkeypatch, rank=1)
    with pytest.raises(
        ValueError,
        match=r"checkpoint tensor 'model.layers.3.mlp.up_proj_t.weight' \(stage 1\)='mlp.up_proj_t.weight' is "
        r"invalid: it must be stored as its parameter \(transformers converts it at load",
    ):
        load_causal_lm(str(folder))


@pytest.mark.parametrize("tied", [True, False])
def test_frozen_embeddings_freeze_a_tied_head_on_its_own_stage_too(tmp_path, monkeypatch, tied):
    """``--freeze_embeddings`` (the recipes' ``freeze_embeddings``): one tensor on one process; a mesh's last
    stage holds an untied copy of a tied head, which stays frozen as the one process's would. An untied
    head trains in both."""
    from hf_meshtune.apps.demo import freeze_embeddings

    folder = tmp_path / "ckpt"
    make_tiny_causal_lm("llama", hidden=64, layers=4, tie_word_embeddings=tied).save_pretrained(folder)
    monkeypatch.setenv("WORLD_SIZE", "1")
    whole = load_causal_lm(str(folder))
    freeze_embeddings(whole, str(folder))
    _on_rank(monkeypatch, rank=1)
    last = load_causal_lm(str(folder))
    freeze_embeddings(last, str(folder))
    assert last.get_output_embeddings().weight is not last.get_input_embeddings().weight
    for model in (whole, last):
        assert model.get_output_embeddings().weight.requires_grad is not tied
        assert not model.get_input_embeddings().weight.requires_grad


def test_on_one_process_it_is_from_pretrained(tmp_path, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "1")
    tiny_llama(seed=5).save_pretrained(tmp_path)
    ours, plain = load_causal_lm(str(tmp_path)), AutoModelForCausalLM.from_pretrained(tmp_path)
    assert stage_of(ours) is None and ours.state_dict().keys() == plain.state_dict().keys()
    assert all(torch.equal(a, plain.state_dict()[k]) for k, a in ours.state_dict().items())


def test_the_activation_meter_counts_each_saved_storage_once_while_autograd_holds_it():
    weight = torch.nn.Parameter(torch.randn(8, 8))
    x = torch.randn(4, 8, requires_grad=True)
    meter = ActivationMeter([weight])
    with meter:
        y = x * x  # saves x twice: one storage
        z = torch.exp(y)  # saves its result
        h = z @ weight  # saves z (already counted) and the weight (a parameter: not counted)
    assert meter.peak == meter.current == x.nbytes + z.nbytes
    h.sum().backward()
    del y, z, h
    assert meter.current == 0 and meter.peak == x.nbytes + 4 * 8 * 4


def test_the_ledger_predicts_a_lora_stage_as_peft_builds_it():
    """With a LoRA config the ledger wraps its meta model as the run does: a stage's weights are the base
    tensors plus PEFT's float32 adapters, and only the adapters have gradients, moments and DP state; the
    activations the adapters add are traced within 15 %."""
    from peft import LoraConfig, get_peft_model

    lora = LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0)
    model = tiny_llama(seed=0, layers=4, hidden=64).to(torch.bfloat16)
    untie_embeddings(model)
    model = get_peft_model(model, lora)
    settings = MemorySettings(num_replicas=2, num_stages=2, microbatch_size=2, microbatches=1, seq_len=32,
                              dtype="bfloat16", powersgd_rank=None)  # fmt: skip
    rows = {row["stage"]: row for row in predict_memory(model.config, settings, peft_config=lora)}
    full = {row["stage"]: row for row in predict_memory(model.config, settings)}
    for stage in (0, 1):
        module = StageModule(model, stage, 2, None, None)
        params = list(stage_parameter_names(model, module).values())
        adapters = [p for p in params if p.requires_grad]
        assert adapters and all(p.dtype == torch.float32 for p in adapters)  # PEFT's own dtype
        adapter_bytes = sum(p.nbytes for p in adapters)
        weights = sum(p.nbytes for p in params) + sum(b.nbytes for b in module.buffers())
        row = rows[stage]
        assert (row["weights"], row["gradients"]) == (weights, adapter_bytes)
        assert row["optimizer"] == 2 * adapter_bytes + 4 * len(adapters)
        assert row["dp"] == 2 * adapter_bytes  # θ_global + outer momentum, no PowerSGD
        assert row["weights"] == full[stage]["weights"] + adapter_bytes  # the base, plus the adapters
        x = torch.randint(3, 90, (2, 32)) if stage == 0 else torch.randn(2, 32, 64, dtype=torch.bfloat16)
        meter = ActivationMeter(module.parameters())
        with meter:
            out = module(x.requires_grad_() if stage == 1 else x)
            if stage == 1:
                out = causal_lm_loss(model)(out, torch.randint(3, 90, (2, 32)))
        assert row["activations"] == pytest.approx(meter.peak, rel=0.15), stage


def _launch(output_dir, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
    flags = [
        "--max_steps", "6", "--per_device_train_batch_size", "2", "--gradient_accumulation_steps", "2",
        "--learning_rate", "3e-3", "--anchor", "false", "--dp_sync_every", "2", "--dp_fragments", "1",
        "--logging_steps", "1", "--report_to", "none", "--save_strategy", "no",
    ]  # fmt: skip
    command = [
        *mesh_launch("2x2"),
        os.path.join(ROOT, "tests", "scripts", "mesh_sft.py"),
        "--output_dir",
        str(output_dir),
        "--eval",
        *flags,
        *extra,
    ]
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=400, cwd=ROOT)


@pytest.mark.slow
def test_per_stage_loading_trains_saves_and_evaluates_as_the_whole_model_path(tmp_path):
    """A 2×2 mesh from a checkpoint loaded per stage vs the same model built whole in every process (its other
    stages released): the same losses and the same saved shards, bit for bit; the shards load with plain
    transformers with no missing or unexpected keys; the pipelined evaluation equals Trainer.evaluate of the
    saved model; every process holds its stage's tensors only, as the memory ledger predicts."""
    checkpoint = tmp_path / "ckpt"
    tiny_llama(seed=0, layers=4, hidden=64).save_pretrained(checkpoint)
    per_stage, whole = tmp_path / "per_stage", tmp_path / "whole"
    for out, extra in ((per_stage, ("--checkpoint", str(checkpoint))), (whole, ())):
        proc = _launch(out, *extra)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    histories = [json.loads((o / "trainer_state.json").read_text())["log_history"] for o in (per_stage, whole)]
    losses = [[e["loss"] for e in h if "loss" in e] for h in histories]
    assert len(losses[0]) == 6 and losses[0] == losses[1]
    names = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    for name in names:
        a, b = load_file(per_stage / name), load_file(whole / name)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    index = json.loads((per_stage / "model.safetensors.index.json").read_text())["weight_map"]
    assert set(index.values()) == set(names)
    saved, info = AutoModelForCausalLM.from_pretrained(per_stage, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    initial = tiny_llama(seed=0, layers=4, hidden=64)
    for name in ("model.embed_tokens.weight", "model.layers.3.mlp.down_proj.weight", "lm_head.weight"):
        assert not torch.equal(saved.state_dict()[name], initial.state_dict()[name]), name
    held_out = pattern_dataset(72, 16).select(range(64, 72))
    reference = Trainer(
        model=saved,
        args=TrainingArguments(str(tmp_path / "eval"), report_to="none", per_device_eval_batch_size=8),
        eval_dataset=held_out,
    ).evaluate()["eval_loss"]
    for rank in range(4):  # every process returns the same metrics
        mesh_eval = json.loads((per_stage / f"eval_rank{rank}.json").read_text())["eval_loss"]
        assert mesh_eval == pytest.approx(reference, rel=1e-6)
    # memory: a process's weights are its stage's tensors; the whole-model path gave the rest back
    untie = tiny_llama(seed=0, layers=4, hidden=64)
    untie_embeddings(untie)
    stage_bytes = [
        sum(p.nbytes for p in StageModule(untie, s, 2, None, None).parameters())
        + sum(b.nbytes for b in untie.buffers())
        for s in range(2)
    ]
    owned_params = [sum(p.nbytes for p in StageModule(untie, s, 2, None, None).parameters()) for s in range(2)]
    total = sum(p.nbytes for p in untie.parameters())
    summaries = [json.loads((o / "mesh_summary.json").read_text()) for o in (per_stage, whole)]
    gib = 1024**3
    for summary, released in zip(summaries, (False, True)):
        for row in summary["memory_gib"]:
            assert round(row["weights"] * gib) == stage_bytes[row["stage"]]
            assert round(row["released"] * gib) == (total - owned_params[row["stage"]] if released else 0)
            assert row["peak_rss"] > row["counted"] > 0
    predicted = {row["stage"]: row for row in summaries[0]["memory_predicted_gib"]}
    for row in summaries[0]["memory_gib"]:
        guess = predicted[row["stage"]]
        for part in ("weights", "gradients", "optimizer", "dp", "codec"):
            assert guess[part] == pytest.approx(row[part], rel=0.01), part
        assert guess["activations"] == pytest.approx(row["activations"], rel=0.15)
        assert guess["total"] == pytest.approx(row["counted"], rel=0.15)
    logged = [e for e in histories[0] if "memory/peak_rss(GiB)" in e]
    assert logged[-1]["memory/peak_rss(GiB)"] == summaries[0]["memory_max_gib"]["peak_rss"]
