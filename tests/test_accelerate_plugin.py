"""MeshAccelerator: a plain Accelerate loop trains exactly as the pieces wired by hand do."""

from __future__ import annotations

import math

import pytest
import torch
from accelerate import Accelerator
from accelerate.state import AcceleratorState, GradientState
from torch import nn
from torch.optim.lr_scheduler import LambdaLR
from torch.utils.data import DataLoader, IterableDataset
from transformers import default_data_collator

from hf_meshtune import AnchorBatches, AnchorCircuit, MeshConfig, SpectralAdamW, attach_boundaries
from hf_meshtune.accelerate import MeshAccelerator, MeshPlugin
from tests.test_recipes import load_script
from tests.tiny import GOVERNED_TINY, pattern_dataset, tiny_llama

STEPS, BATCH, LR = 4, 2, 1e-2
KNOBS = dict(
    preset="paper",
    mask_ratio=0.75,
    num_stages=2,
    mask_seed=3,
    anchor_every=2,
    anchor_delay=1,
    spectral_alpha=0.3,
    spectral_tau=1e-3,
    anchor_beta=0.9,
    anchor_seed=5,
)


@pytest.fixture(autouse=True)
def fresh_accelerate_state():
    """Each test builds its own accelerator (accelerate keeps process-wide singletons)."""
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _decay(step: int) -> float:
    return 1.0 - 0.1 * step


def _run_accelerate(accelerator: Accelerator, accum: int) -> tuple[nn.Module, Accelerator]:
    """The user's loop: nothing mesh-specific in it."""
    model = tiny_llama(seed=0)
    loader = DataLoader(pattern_dataset(STEPS * accum * BATCH), batch_size=BATCH, collate_fn=default_data_collator)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    scheduler = LambdaLR(optimizer, _decay)
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)
    model.train()
    for batch in loader:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return accelerator.unwrap_model(model), accelerator


def _run_by_hand(accum: int) -> nn.Module:
    """The same steps with attach_boundaries + SpectralAdamW + AnchorCircuit (examples/custom_loop.py)."""
    model = tiny_llama(seed=0)
    dataset = pattern_dataset(STEPS * accum * BATCH)
    batches = list(DataLoader(dataset, batch_size=BATCH, collate_fn=default_data_collator))
    handle = attach_boundaries(model, KNOBS["num_stages"], KNOBS["mask_ratio"], seed=KNOBS["mask_seed"])
    optimizer = SpectralAdamW(
        model.parameters(),
        lr=LR,
        weight_decay=0.01,
        alpha=KNOBS["spectral_alpha"],
        tau=KNOBS["spectral_tau"],
        anchor_beta=KNOBS["anchor_beta"],
        seed=KNOBS["mask_seed"],
    )
    scheduler = LambdaLR(optimizer, _decay)
    matrices = {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2}
    anchor = AnchorCircuit(
        model,
        matrices,
        handle,
        KNOBS["anchor_every"],
        KNOBS["anchor_delay"],
        AnchorBatches(dataset, default_data_collator, BATCH, accum, KNOBS["anchor_seed"]),
        lambda m, batch: m(**batch).loss,
    )
    model.train()
    for step in range(STEPS):
        handle.set_step(step)
        for batch in batches[step * accum : (step + 1) * accum]:
            (model(**batch).loss / accum).backward()
        anchor.on_step(step, optimizer)
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad()
    return model


@pytest.mark.parametrize("accum", [1, 2])
def test_plain_loop_on_mesh_accelerator_equals_the_pieces_by_hand(single_thread_torch, accum):
    meshed, accelerator = _run_accelerate(
        MeshAccelerator(cpu=True, gradient_accumulation_steps=accum, mesh_plugin=MeshPlugin(**KNOBS)), accum
    )
    reference = _run_by_hand(accum)
    for (name, got), want in zip(meshed.named_parameters(), reference.parameters()):
        assert torch.equal(got, want), name
    assert accelerator.mesh_step == STEPS and accelerator.mesh_anchor.rounds_done == 2
    assert isinstance(accelerator.spectral_optimizer, SpectralAdamW)
    assert accelerator.spectral_optimizer.param_groups[0]["lr"] == pytest.approx(LR * _decay(STEPS))
    entries = accelerator.mesh_log_entries()
    assert entries["anchor/staleness_steps"] == 1.0 and "spectral/cos_filtered_vs_anchor" in entries
    assert entries["comm/measured_pp_fwd_bytes_per_token"] == 16 * 4  # K = 16 of H = 64 fp32 values, one boundary

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    plain, _ = _run_accelerate(Accelerator(cpu=True, gradient_accumulation_steps=accum), accum)
    assert not any(torch.allclose(a, b) for a, b in zip(plain.parameters(), meshed.parameters()) if a.ndim == 2)


def test_save_state_and_load_state_resume_the_mesh_exactly(single_thread_torch, tmp_path):
    def start() -> tuple:
        model = tiny_llama(seed=0)
        loader = DataLoader(pattern_dataset(STEPS * BATCH), batch_size=BATCH, collate_fn=default_data_collator)
        accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**KNOBS))
        return accelerator, *accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=LR), loader)

    def train(accelerator, model, optimizer, batches) -> None:
        for batch in batches:
            accelerator.backward(model(**batch).loss)
            optimizer.step()
            optimizer.zero_grad()

    accelerator, model, optimizer, loader = start()
    batches = list(loader)
    train(accelerator, model, optimizer, batches[:3])  # a gradient is in flight: snapshot 2, due at 3
    accelerator.save_state(str(tmp_path / "ckpt"))
    train(accelerator, model, optimizer, batches[3:])
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    resumed, model2, optimizer2, _ = start()
    resumed.load_state(str(tmp_path / "ckpt"))
    assert resumed.mesh_step == 3 and len(resumed.mesh_anchor.pending) == 1
    train(resumed, model2, optimizer2, batches[3:])
    for a, b in zip(model.parameters(), model2.parameters()):
        assert torch.equal(a, b)


# --- MeshPlugin: environment defaults ----------------------------------------------------------
def test_plugin_fields_left_unset_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("MESHTUNE_MASK_RATIO", "0.9")
    monkeypatch.setenv("MESHTUNE_ANCHOR", "false")
    monkeypatch.setenv("MESHTUNE_SPECTRAL_RANK", "none")
    monkeypatch.setenv("MESHTUNE_ANCHOR_MICROBATCHES", "3")
    monkeypatch.setenv("MESHTUNE_MASK_FILL", "mean")
    monkeypatch.setenv("MESHTUNE_STAGE_LAYERS", "3, 1")  # a list knob: comma-separated
    monkeypatch.setenv("MESHTUNE_MESH", "3x2")  # the launcher's mesh shape: not a field, but Y when unset
    plugin = MeshPlugin()
    assert (plugin.mask_ratio, plugin.anchor, plugin.spectral_rank, plugin.stage_layers) == (0.9, False, None, [3, 1])
    assert (plugin.anchor_microbatches, plugin.mask_fill, plugin.num_stages) == (3, "mean", 2)
    monkeypatch.delenv("MESHTUNE_STAGE_LAYERS")  # two counts would not fit Y = 4 (refused, naming the variable)
    monkeypatch.setenv("MESHTUNE_NUM_STAGES", "4")  # the field's own variable wins (and the mesh then refuses it)
    assert MeshPlugin().num_stages == 4
    assert MeshAccelerator(cpu=True).mesh_plugin.mask_ratio == 0.9


def test_explicit_plugin_arguments_beat_the_environment(monkeypatch):
    monkeypatch.setenv("MESHTUNE_MASK_RATIO", "0.9")
    monkeypatch.setenv("MESHTUNE_SPECTRAL_RANK", "4")
    monkeypatch.setenv("MESHTUNE_ANCHOR", "0")
    plugin = MeshPlugin(mask_ratio=0.5, spectral_rank=None, anchor=True)
    assert (plugin.mask_ratio, plugin.spectral_rank, plugin.anchor) == (0.5, None, True)


@pytest.mark.parametrize(
    "var, value, message",
    [
        ("MESHTUNE_MASK_RATIO", "lots", "MESHTUNE_MASK_RATIO='lots' is invalid: it must be a number or 'none'"),
        ("MESHTUNE_ANCHOR", "maybe", "MESHTUNE_ANCHOR='maybe' is invalid: it must be one of true/1/yes/false/0/no"),
        ("MESHTUNE_SPECTRAL_RANK", "full", "MESHTUNE_SPECTRAL_RANK='full' is invalid: it must be an int or 'none'"),
        (
            "MESHTUNE_MASK_RATIO",
            "1.5",
            "mask_ratio=1.5 is invalid: it must lie in [0, 1) (the value came from $MESHTUNE_MASK_RATIO)",
        ),
    ],
)
def test_a_bad_environment_value_names_its_variable(monkeypatch, var, value, message):
    monkeypatch.setenv(var, value)
    with pytest.raises(ValueError) as error:
        MeshPlugin()
    assert str(error.value) == message


def _message(make, **knobs) -> str:
    with pytest.raises(ValueError) as error:
        make(**knobs)
    return str(error.value)


def test_plugin_validates_like_mesh_config():
    for bad in ({"mask_ratio": 1.0}, {"num_stages": 0}, {"spectral_rank": 0}, {"anchor_every": 0}):
        assert _message(MeshPlugin, **bad) == _message(MeshConfig, **bad)
    assert _message(MeshPlugin, anchor_loss_fn="loss").startswith("anchor_loss_fn='loss' is invalid")


# --- prepare: what it refuses, what it keeps ---------------------------------------------------
def _loader() -> DataLoader:
    return DataLoader(pattern_dataset(8), batch_size=BATCH, collate_fn=default_data_collator)


def test_a_model_without_decoder_layers_is_refused():
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**KNOBS))
    with pytest.raises(ValueError, match=r"model=Sequential is invalid: .*decoder blocks"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()), _loader())


def test_another_optimizer_with_the_anchor_is_refused_by_class():
    model = tiny_llama()
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**KNOBS))
    with pytest.raises(ValueError, match=r"optimizer='SGD' is invalid: it must be torch.optim.AdamW or Adam"):
        accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), _loader())
    assert not model._forward_pre_hooks  # nothing attached by a refused prepare


def test_the_anchor_needs_the_training_loader_in_the_same_call():
    model = tiny_llama()
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**KNOBS))
    with pytest.raises(ValueError, match=r"DataLoader=None is invalid: it must be passed to the same prepare\(\) call"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()))

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(pattern_dataset(4))

    with pytest.raises(ValueError, match=r"dataset='Stream' is invalid: it must be map-style"):
        accelerator.prepare(model, torch.optim.AdamW(model.parameters()), DataLoader(Stream(), batch_size=2))


@pytest.mark.filterwarnings("ignore:Detected call of")
def test_a_scheduler_left_out_of_prepare_still_sets_the_spectral_optimizers_lr():
    model = tiny_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1.0)
    scheduler = LambdaLR(optimizer, lambda step: 0.5**step)
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**KNOBS))
    accelerator.prepare(model, optimizer, _loader())
    scheduler.step()
    assert [g["lr"] for g in accelerator.spectral_optimizer.param_groups] == [0.5]


def test_without_the_anchor_any_optimizer_is_kept_and_drives_the_clock(single_thread_torch):
    model = tiny_llama()
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**{**KNOBS, "anchor": False}))
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, sgd)
    assert optimizer.optimizer is sgd and accelerator.mesh_anchor is None and accelerator.spectral_optimizer is None
    batch = next(iter(_loader()))
    for step in range(2):
        assert accelerator.mesh_boundaries.step == step
        model(**batch).loss.backward()
        assert accelerator.mesh_boundaries.microbatch == 0
        optimizer.step()
        optimizer.zero_grad()
    assert accelerator.mesh_step == 2 and "comm/pp_fwd_bytes_per_token" in accelerator.mesh_log_entries()


def test_a_governed_plain_loop_keeps_its_optimizer_and_runs_at_the_governors_levels(single_thread_torch):
    """boundary_codec='governed' through a plain Accelerate loop: the anchor circuit runs for the governor alone
    (the user's AdamW stays), its first round starts the boundary at int4 (cos ≥ 0.99; int2 below), the logs
    carry the fidelity rounds, and the wire carries int4 messages from the second step on."""
    model = tiny_llama()
    accelerator = MeshAccelerator(cpu=True, mesh_plugin=MeshPlugin(**GOVERNED_TINY))
    adamw = torch.optim.AdamW(model.parameters(), lr=LR)
    model, optimizer, loader = accelerator.prepare(model, adamw, _loader())
    assert optimizer.optimizer is adamw and accelerator.spectral_optimizer is None
    sent, rounds = [], []
    for batch in loader:
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        logs = accelerator.mesh_log_entries()
        sent.append(logs["comm/measured_pp_fwd_bytes_per_token"])
        assert logs["governor/b0/level"] == 1.0
        if "fidelity/step" in logs:  # a round's measurement, logged once: rounds at steps 0 and 2
            rounds.append(logs["fidelity/step"])
            assert logs["fidelity/b0/int8/cos"] > logs["fidelity/b0/int4/cos"] >= 0.99 > logs["fidelity/b0/int2/cos"]
    assert rounds == [0.0, 2.0]
    anchor = accelerator.mesh_anchor
    assert anchor.feed is False and anchor.switches == [(0, 0, [1])] and anchor.rounds_done == 2
    assert sent == [66.0, 34.0, 34.0, 34.0]  # H = 64, a real token's record: int8 2 + 64 = 66 bytes, int4 2 + 32


# --- the example -------------------------------------------------------------------------------
def test_accelerate_loop_example_runs_on_smollm2(capsys):
    losses = load_script("examples/accelerate_loop.py").main(
        ["--steps", "2", "--seq-len", "96", "--batch-size", "1", "--grad-accum", "1"]
    )
    assert len(losses) == 2 and all(math.isfinite(loss) for loss in losses)
    out = capsys.readouterr().out
    assert out.count("comm/pp_fwd_bytes_per_token") == 2 and "comm/measured_pp_fwd_bytes_per_token" in out
    # the paper's preset: M95 (K = 29 of 576, fp32, 3 boundaries) and the anchor circuit booked
    assert "comm/pp_fwd_bytes_per_token 348," in out and "comm/anchor_bytes_per_token 0," not in out
