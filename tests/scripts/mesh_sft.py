"""A user's single-process MeshTrainer script, unchanged, run by tests on a launched mesh.

    python tests/scripts/mesh_sft.py OUTPUT_DIR [--lora] [MeshTrainingArguments flags...]

``--lora`` trains a LoRA adapter (r = 4 on every linear layer) instead of the whole model.
"""

from __future__ import annotations

import sys

import torch
from transformers import HfArgumentParser

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from tests.tiny import pattern_dataset, tiny_llama


def main(argv: list[str]) -> None:
    lora = "--lora" in argv
    (args,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses([a for a in argv if a != "--lora"])
    model = tiny_llama(seed=0, layers=4, hidden=64)
    peft_config = None
    if lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", task_type="CAUSAL_LM")
    trainer = MeshTrainer(model=model, args=args, train_dataset=pattern_dataset(64, 16), peft_config=peft_config)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)  # as the transformers examples do
    trainer.save_model()
    trainer.save_state()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
