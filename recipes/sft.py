"""Supervised fine-tuning with MeshTrainer: every TrainingArguments flag plus the mesh knobs.

    python recipes/sft.py --output_dir runs/sft --max_steps 200 --mask_ratio 0.95 --num_stages 4
    meshtune launch --mesh 3x2 --cpu -- recipes/sft.py --output_dir runs/mesh --num_stages 2 --max_steps 20
    accelerate launch --config_file accelerate_configs/cpu_single_process.yaml recipes/sft.py --output_dir runs/sft

Defaults to the embedded SmolLM2-135M-Instruct and GSM8K (no hub access); `--model_name_or_path`
takes any local causal LM folder. The saved model is a plain transformers checkpoint.
"""

from __future__ import annotations

import sys

import torch
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorForSeq2Seq, HfArgumentParser

from hf_meshtune import MeshTrainer, MeshTrainingArguments
from hf_meshtune.assets import smollm2_checkpoint
from hf_meshtune.demo import freeze_all_but_last, gsm8k_splits


@dataclass
class SFTScriptArguments:
    model_name_or_path: str | None = field(default=None, metadata={"help": "Local model folder (default: the embedded SmolLM2-135M-Instruct)."})
    max_length: int = field(default=192, metadata={"help": "Tokens per example (prompt + answer), truncated."})
    eval_items: int = field(default=32, metadata={"help": "Held-out GSM8K problems for evaluation."})
    train_last_layers: int | None = field(default=None, metadata={"help": "Train only the last N decoder layers and the final norm (default: all)."})
    freeze_embeddings: bool = field(default=False, metadata={"help": "Keep the input embeddings (and an LM head tied to them) frozen."})


def main(argv: list[str] | None = None) -> dict:
    script, args = HfArgumentParser((SFTScriptArguments, MeshTrainingArguments)).parse_args_into_dataclasses(argv)
    path = script.model_name_or_path or str(smollm2_checkpoint())
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    if script.train_last_layers is not None:
        freeze_all_but_last(model, script.train_last_layers)
    if script.freeze_embeddings:
        model.get_input_embeddings().weight.requires_grad_(False)
    train, evaluation = gsm8k_splits(tokenizer, script.max_length, script.eval_items)
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = MeshTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                          data_collator=collator, processing_class=tokenizer)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    trainer.log_metrics("eval", metrics)
    if torch.distributed.is_initialized():  # a launched mesh: leave the process group cleanly
        torch.distributed.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
