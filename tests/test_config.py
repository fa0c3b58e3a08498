"""MeshConfig / MeshTrainingArguments: validation messages, the optim shim, argument parsing."""

from __future__ import annotations

import pytest
from transformers import HfArgumentParser

from hf_meshtune import MeshConfig, MeshTrainer, MeshTrainingArguments, SpectralAdamW
from tests.tiny import pattern_dataset, tiny_llama

BAD_KNOBS = [
    ("mask_ratio", 1.0, "lie in [0, 1)"),
    ("mask_ratio", -0.1, "lie in [0, 1)"),
    ("num_stages", 0, "be >= 1"),
    ("mask_fill", "median", "be one of ['gaussian', 'mean', 'zeros']"),
    ("mask_protect_dims", -1, "be >= 0"),
    ("anchor_every", 0, "be >= 1"),
    ("anchor_delay", -1, "be >= 0"),
    ("anchor_beta", 1.5, "lie in [0, 1]"),
    ("anchor_beta", -0.2, "lie in [0, 1]"),
    ("anchor_microbatches", 0, "be None or an int >= 1"),
    ("anchor_max_staleness", 0, "be None or an int >= 1"),
    ("spectral_tau", 0.0, "be > 0"),
    ("spectral_tau", -1e-3, "be > 0"),
    ("spectral_alpha", 1.01, "lie in [0, 1]"),
    ("spectral_alpha", -0.5, "lie in [0, 1]"),
    ("spectral_rank", 0, "be None or an int >= 1"),
    ("num_replicas", 1, "be >= 2 when anchor=True (one replica is the anchor)"),
    ("dp_sync_every", 0, "be >= 1"),
    ("dp_powersgd_rank", -1, "be None or an int >= 1"),
    ("anchor_payload", "weights", "be one of ['gradient', 'factors']"),
    ("anchor_rate_mbit", -5.0, "be None or > 0 (Mbit/s)"),
    ("dp_timeout_s", -1.0, "be > 0 (seconds)"),
    ("dp_timeout_s", "60", "be of type float"),
]


@pytest.mark.parametrize(("field", "value", "rule"), BAD_KNOBS)
def test_mesh_config_names_field_value_and_rule(field, value, rule):
    with pytest.raises(ValueError) as err:
        MeshConfig(preset="paper", **{field: value})  # the mask and anchor knobs are the paper's
    assert str(err.value) == f"{field}={value!r} is invalid: it must {rule}"


@pytest.mark.parametrize(("field", "value", "rule"), BAD_KNOBS[:6])
def test_training_arguments_validate_the_same_knobs(tmp_path, field, value, rule):
    with pytest.raises(ValueError, match=f"{field}=.* is invalid: it must"):
        MeshTrainingArguments(output_dir=str(tmp_path), preset="paper", **{field: value})


def test_rescale_with_mean_fill_is_rejected():
    with pytest.raises(ValueError, match="mask_fill='mean' is invalid: it must be 'zeros' when mask_rescale=True"):
        MeshConfig(mask_rescale=True, mask_fill="mean")


def test_spectral_optim_name_is_accepted_and_kept(tmp_path):
    args = MeshTrainingArguments(output_dir=str(tmp_path))
    assert args.optim == "spectral_adamw"
    assert MeshTrainingArguments(output_dir=str(tmp_path), anchor=False, optim="adamw_torch").optim == "adamw_torch"


def test_unknown_optim_name_is_rejected(tmp_path):
    with pytest.raises(ValueError, match="optim='spectral_adam' is invalid: it must be 'spectral_adamw' or one of"):
        MeshTrainingArguments(output_dir=str(tmp_path), optim="spectral_adam")


def test_anchor_needs_the_spectral_optimizer(tmp_path):
    with pytest.raises(ValueError, match="optim=.*adamw_torch.* must be 'spectral_adamw' when anchor=True"):
        MeshTrainingArguments(output_dir=str(tmp_path), preset="paper", optim="adamw_torch")


def test_parser_reads_mesh_flags(tmp_path):
    (args,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses(
        [
            "--output_dir",
            str(tmp_path),
            "--mask_ratio",
            "0.9",
            "--num_stages",
            "2",
            "--spectral_rank",
            "16",
            "--anchor_delay",
            "10",
            "--optim",
            "spectral_adamw",
        ]
    )
    assert (args.mask_ratio, args.num_stages, args.spectral_rank, args.anchor_delay) == (0.9, 2, 16, 10)
    assert args.mesh_config == MeshConfig(mask_ratio=0.9, num_stages=2, spectral_rank=16, anchor_delay=10)


def test_trainer_builds_spectral_adamw_from_the_knobs(tmp_path):
    args = MeshTrainingArguments(
        output_dir=str(tmp_path),
        preset="paper",  # the anchor feeds the filter
        spectral_alpha=0.5,
        spectral_tau=0.01,
        anchor_beta=0.8,
        spectral_rank=4,
        spectral_relative_tau=True,
        learning_rate=1e-3,
        report_to=[],
        use_cpu=True,
    )
    trainer = MeshTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset())
    trainer.create_optimizer()
    optimizer = trainer.spectral_optimizer
    assert isinstance(optimizer, SpectralAdamW)
    group = optimizer.param_groups[0]
    assert (group["alpha"], group["tau"], group["anchor_beta"], group["rank"], group["relative_tau"], group["lr"]) == (
        0.5,
        0.01,
        0.8,
        4,
        True,
        1e-3,
    )
    assert trainer.mesh_anchor is not None and all(p.ndim == 2 for p in trainer.mesh_anchor.params.values())


def test_trainer_rejects_plain_training_arguments(tmp_path):
    from transformers import TrainingArguments

    with pytest.raises(ValueError, match="args='TrainingArguments' is invalid: it must be a MeshTrainingArguments"):
        MeshTrainer(
            model=tiny_llama(),
            args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True),
            train_dataset=pattern_dataset(),
        )


def test_trainer_rejects_more_stages_than_layers(tmp_path):
    args = MeshTrainingArguments(output_dir=str(tmp_path), num_stages=9, use_cpu=True)
    with pytest.raises(ValueError, match=r"num_stages=9 is invalid: it must be <= the number of decoder layers \(4\)"):
        MeshTrainer(model=tiny_llama(), args=args, train_dataset=pattern_dataset())


def test_powersgd_rank_zero_means_uncompressed_for_command_lines():
    assert MeshConfig(dp_powersgd_rank=0).dp_powersgd_rank is None


@pytest.mark.parametrize(
    "field, value, rule",
    [
        ("dp_fragments", 3, "divide dp_sync_every=20"),
        ("dp_fragments", 0, "be an int >= 1"),
        ("dp_sync_delay", 20, "lie in [0, dp_sync_every / dp_fragments = 20)"),
        ("dp_keep_overlapped", True, "be False when dp_sync_delay=0"),
        ("dp_outer_lr", 0.0, "be > 0"),
        ("dp_outer_momentum", 1.0, "lie in [0, 1)"),
    ],
)
def test_dp_sync_knobs_name_field_value_and_rule(field, value, rule):
    with pytest.raises(ValueError) as error:
        MeshConfig(**{field: value})
    assert f"{field}={value!r} is invalid: it must {rule}" in str(error.value)


def test_a_preset_fills_only_the_boundary_and_anchor_knobs_left_unset(tmp_path):
    import dataclasses

    from hf_meshtune.config import PRESETS, QUALITY_CODEC

    paper, quality = MeshConfig(preset="paper"), MeshConfig()
    assert quality.preset == "quality"  # the default
    assert (paper.preset, paper.mask_ratio, paper.boundary_codec, paper.anchor) == ("paper", 0.95, None, True)
    assert (quality.mask_ratio, quality.boundary_codec, quality.anchor) == (0.0, QUALITY_CODEC, False)
    assert PRESETS["quality"]["boundary_codec"] == QUALITY_CODEC
    # explicit knobs win: a mask ratio keeps masks under "quality", a codec replaces them under "paper"
    masked = MeshConfig(preset="quality", mask_ratio=0.9)
    assert (masked.mask_ratio, masked.boundary_codec, masked.anchor) == (0.9, None, False)
    coded = MeshConfig(boundary_codec="outliers8+int4g71", anchor=False)
    assert (coded.mask_ratio, coded.boundary_codec) == (0.0, "outliers8+int4g71")
    spec = MeshConfig(preset="quality", boundary_codec="mask0.8+mean")
    assert (spec.mask_ratio, spec.mask_fill, spec.anchor) == (0.8, "mean", False)
    # resolving again (dataclasses.replace, a config rebuilt from its fields) changes nothing
    again = dataclasses.replace(quality)
    assert dataclasses.asdict(again) == dataclasses.asdict(quality)
    # and every entry point parses it: the argument dataclasses through HfArgumentParser
    (args,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", str(tmp_path), "--use_cpu", "--preset", "quality", "--optim", "adamw_torch"]
    )
    assert (args.boundary_codec, args.mask_ratio, args.anchor) == (QUALITY_CODEC, 0.0, False)


def test_the_demo_and_the_accelerate_plugin_take_the_preset_too(monkeypatch):
    from hf_meshtune.accelerate import MeshPlugin
    from hf_meshtune.apps.demo import DemoSettings
    from hf_meshtune.config import QUALITY_CODEC

    assert DemoSettings().mesh_config().boundary_codec == QUALITY_CODEC
    assert DemoSettings(preset="paper").mesh_config().mask_ratio == 0.95
    monkeypatch.setenv("MESHTUNE_PRESET", "quality")
    plugin = MeshPlugin(num_stages=2)
    assert (plugin.boundary_codec, plugin.anchor) == (QUALITY_CODEC, False)


def test_num_stages_defaults_to_the_launched_meshs_y_and_an_explicit_one_is_kept(tmp_path, monkeypatch):
    """One source of truth for Y: ``meshtune launch --mesh 3x2`` sets MESHTUNE_MESH, so a script that does
    not name num_stages gets 2; not launched, 4; an explicit value stays (the launched job then refuses one
    that disagrees with the mesh, tests/test_mesh_trainer.py)."""
    from hf_meshtune.topology import MeshTopology

    monkeypatch.delenv("MESHTUNE_MESH", raising=False)
    assert MeshConfig().num_stages == 4
    monkeypatch.setenv("MESHTUNE_MESH", "3x2")
    assert MeshConfig().num_stages == 2
    args = MeshTrainingArguments(str(tmp_path), use_cpu=True, report_to="none")
    assert args.num_stages == args.mesh_config.num_stages == 2
    (parsed,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses(["--output_dir", str(tmp_path)])
    assert parsed.num_stages == 2
    assert MeshConfig(num_stages=3).num_stages == 3
    with pytest.raises(ValueError, match=r"num_stages=3 is invalid: it must equal Y = 2 of the mesh 3x2"):
        MeshTopology.from_environment(6, 3, anchor=True, num_layers=4)
    monkeypatch.setenv("MESHTUNE_MESH", "3by2")
    with pytest.raises(ValueError, match=r"MESHTUNE_MESH='3by2' is invalid: it must look like XxY"):
        MeshConfig()
