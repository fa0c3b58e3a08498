"""A user's single-process MeshSFTTrainer (TRL) script, unchanged, run by tests on a launched mesh.

    python tests/scripts/mesh_trl_sft.py --output_dir OUT [MeshSFTConfig flags...]

A tiny Llama with SmolLM2's tokenizer learns arithmetic answers from conversational prompt-completion
rows: TRL tokenizes with the chat template and its collator puts the loss on the completion only.
"""

from __future__ import annotations

import sys

import torch
from transformers import AutoTokenizer, HfArgumentParser

from hf_meshtune import MeshSFTConfig, MeshSFTTrainer
from hf_meshtune.apps.arithmetic import sft_dataset
from hf_meshtune.apps.assets import smollm2_checkpoint
from tests.tiny import make_tiny_causal_lm


def main(argv: list[str]) -> None:
    (args,) = HfArgumentParser(MeshSFTConfig).parse_args_into_dataclasses(argv)
    tokenizer = AutoTokenizer.from_pretrained(smollm2_checkpoint())
    model = make_tiny_causal_lm(
        "llama",
        hidden=64,
        layers=4,
        vocab_size=len(tokenizer),
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    trainer = MeshSFTTrainer(model=model, args=args, train_dataset=sft_dataset(64), processing_class=tokenizer)
    trainer.train()
    trainer.save_model()
    trainer.save_state()
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
