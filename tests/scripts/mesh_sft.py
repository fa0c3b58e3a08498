"""A user's single-process MeshTrainer script, unchanged, run by tests on a launched mesh.

    python tests/scripts/mesh_sft.py OUTPUT_DIR [MeshTrainingArguments flags...]
"""

from __future__ import annotations

import sys

import torch
from transformers import HfArgumentParser

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from tests.tiny import pattern_dataset, tiny_llama


def main(argv: list[str]) -> None:
    (args,) = HfArgumentParser(MeshTrainingArguments).parse_args_into_dataclasses(argv)
    model = tiny_llama(seed=0, layers=4, hidden=64)
    trainer = MeshTrainer(model=model, args=args, train_dataset=pattern_dataset(64, 16))
    trainer.train()
    trainer.save_model()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
