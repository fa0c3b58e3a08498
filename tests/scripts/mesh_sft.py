"""A user's single-process MeshTrainer script, unchanged, run by tests on a launched mesh.

    python tests/scripts/mesh_sft.py --output_dir OUT [--lora] [--checkpoint DIR] [--eval] [MeshTrainingArguments flags]

``--record_callbacks`` adds a ``TrainerCallback`` that writes every event it gets, and every ``on_log``
entry, to ``OUTPUT_DIR/callbacks_rank<r>.jsonl`` (what a ``report_to`` tracker would see, per rank);
``--lora`` trains a LoRA adapter (r = 4 on every linear layer) instead of the whole model;
``--checkpoint DIR`` loads the model from a saved folder with ``hf_meshtune.load_causal_lm`` (on the
mesh: this process's stage only) instead of building the tiny Llama whole; ``--eval`` evaluates on 8
held-out rows after training and writes the metrics to ``OUTPUT_DIR/eval_rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys

import torch
from transformers import HfArgumentParser, TrainerCallback

from hf_meshtune import MeshTrainer, MeshTrainingArguments, load_causal_lm
from tests.tiny import pattern_dataset, tiny_llama


def _take(argv: list[str], flag: str, value: bool = False):
    if flag not in argv:
        return None
    i = argv.index(flag)
    found = argv[i + 1] if value else True
    del argv[i : i + (2 if value else 1)]
    return found


class _Recorder(TrainerCallback):
    """Every callback event this process gets, as JSON lines (a stand-in for a ``report_to`` tracker)."""

    def __init__(self, output_dir: str) -> None:
        rank = os.environ.get("RANK", "0")
        os.makedirs(output_dir, exist_ok=True)
        self.path = os.path.join(output_dir, f"callbacks_rank{rank}.jsonl")

    def _write(self, event: str, state, **extra) -> None:
        with open(self.path, "a") as handle:
            entry = {"event": event, "step": state.global_step, "zero": state.is_world_process_zero, **extra}
            handle.write(json.dumps(entry) + "\n")

    def on_train_begin(self, args, state, control, **kwargs):
        self._write("train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._write("step_end", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._write("log", state, logs=logs)

    def on_train_end(self, args, state, control, **kwargs):
        self._write("train_end", state)


def main(argv: list[str]) -> None:
    argv = list(argv)
    lora, evaluate, record = _take(argv, "--lora"), _take(argv, "--eval"), _take(argv, "--record_callbacks")
    checkpoint = _take(argv, "--checkpoint", value=True)
    (args,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses(argv)
    if checkpoint:  # on the mesh: this process's stage of the run's split only
        model = load_causal_lm(checkpoint, stage_layers=args.stage_layers)
    else:
        model = tiny_llama(seed=0, layers=4, hidden=64)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    held_out = pattern_dataset(72, 16).select(range(64, 72)) if evaluate else None
    trainer = MeshTrainer(
        model=model,
        args=args,
        train_dataset=pattern_dataset(64, 16),
        eval_dataset=held_out,
        peft_config=peft_config,
        callbacks=[_Recorder(args.output_dir)] if record else None,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # as the transformers examples do
    trainer.save_model()
    trainer.save_state()
    if evaluate:
        metrics = trainer.evaluate()
        rank = int(os.environ.get("RANK", "0"))
        with open(os.path.join(args.output_dir, f"eval_rank{rank}.json"), "w") as handle:
            json.dump(metrics, handle)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
