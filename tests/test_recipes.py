"""The recipe and the example run for real on the embedded SmolLM2 (a couple of steps each)."""

from __future__ import annotations

import importlib.util
import math
import sys
from pathlib import Path

import transformers

ROOT = Path(__file__).resolve().parents[1]


def load_script(relative: str):
    spec = importlib.util.spec_from_file_location(Path(relative).stem, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_sft_recipe_trains_saves_and_takes_trainer_and_mesh_flags(tmp_path):
    out = tmp_path / "sft"
    metrics = load_script("recipes/sft.py").main(
        [
            "--output_dir",
            str(out),
            "--max_steps",
            "2",
            "--per_device_train_batch_size",
            "2",
            "--max_length",
            "96",
            "--eval_items",
            "4",
            "--train_last_layers",
            "1",
            "--use_cpu",
            "--report_to",
            "none",
            "--mask_ratio",
            "0.9",
            "--num_stages",
            "2",
            "--anchor_every",
            "1",
            "--anchor_delay",
            "1",
            "--logging_steps",
            "1",
        ]
    )
    assert math.isfinite(metrics["eval_loss"])
    _, info = transformers.AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys"))
    assert (out / "tokenizer_config.json").is_file()


def test_custom_loop_example_runs_with_anchor_bases():
    losses = load_script("examples/custom_loop.py").main(["--steps", "3", "--seq-len", "96"])
    assert len(losses) == 3 and all(math.isfinite(loss) for loss in losses)
