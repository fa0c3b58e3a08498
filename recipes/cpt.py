r"""Continued pre-training (plain causal-LM loss on every token) with MeshTrainer.

    python recipes/cpt.py --output_dir runs/cpt --max_steps 200 --num_stages 4     # --preset paper: M95 + AP
    python recipes/cpt.py --output_dir runs/cpt --text_files "notes/*.md" book.txt --block_size 256 --max_steps 200
    accelerate launch --config_file accelerate_configs/cpu_single_process.yaml recipes/cpt.py \
        --output_dir runs/cpt --max_steps 20
    meshtune launch --mesh 3x2 --cpu -- recipes/cpt.py --output_dir runs/cpt-mesh --max_steps 20

The classic transformers ``run_clm`` recipe: every document is tokenized (no special tokens) and
followed by the tokenizer's EOS token, the documents are concatenated into one token stream, and the
stream is cut into blocks of exactly ``--block_size`` tokens (the tail shorter than a block is
dropped); labels are the inputs (the model shifts them). The last ``--eval_blocks`` blocks are held
out for evaluation. Every row has the same length, which is also what the distributed mesh needs
(its pipeline stages exchange fixed-shape tensors; it also needs ``--max_steps``).

Default corpus (no hub access): the embedded GSM8K, its 1,319 math word problems and their worked
solutions as plain text ("Question: ...\nAnswer: ..."), in a fixed shuffled order, i.e.
domain-adaptive pre-training of the embedded SmolLM2-135M-Instruct on math word problems.
``--text_files`` takes local text files (.txt, .md, ...) or globs instead, one document per file.
``--model_name_or_path`` takes any local causal LM folder. At the end the model (a plain transformers
checkpoint) and the trainer state are saved, and the eval metrics carry ``perplexity`` = exp(eval_loss).
"""

from __future__ import annotations

import glob
import math
import os
import sys
from dataclasses import dataclass, field

import datasets
import torch
from transformers import AutoConfig, AutoTokenizer, HfArgumentParser, default_data_collator

from hf_meshtune import MeshTrainer, MeshTrainingArguments, load_causal_lm
from hf_meshtune._validation import require
from hf_meshtune.apps.assets import gsm8k_items, smollm2_checkpoint
from hf_meshtune.apps.demo import freeze_all_but_last, freeze_embeddings


@dataclass
class CPTScriptArguments:
    model_name_or_path: str | None = field(
        default=None, metadata={"help": "Local model folder (default: the embedded SmolLM2-135M-Instruct)."}
    )
    text_files: list[str] | None = field(
        default=None,
        metadata={
            "help": "Local text files or globs, one document per file (default: the embedded GSM8K problems and "
            "solutions as plain text)."
        },
    )
    block_size: int = field(
        default=128,
        metadata={"help": "Tokens per training row: the concatenated corpus is cut into blocks of this length."},
    )
    eval_blocks: int = field(
        default=32, metadata={"help": "Blocks held out for evaluation (the last ones of the stream)."}
    )
    train_last_layers: int | None = field(
        default=None, metadata={"help": "Train only the last N decoder layers and the final norm (default: all)."}
    )
    freeze_embeddings: bool = field(
        default=False, metadata={"help": "Keep the input embeddings (and an LM head tied to them) frozen."}
    )


def read_text_files(patterns: list[str]) -> list[str]:
    """The contents of every file the paths/globs match (sorted, each file once), one document each."""
    require(len(patterns) > 0, "text_files", patterns, "name at least one file or glob")
    paths: list[str] = []
    for pattern in patterns:
        matches = sorted(p for p in glob.glob(os.path.expanduser(pattern), recursive=True) if os.path.isfile(p))
        require(
            len(matches) > 0,
            "text_files",
            pattern,
            "match at least one existing file (a path or a glob of local text files)",
        )
        paths += [p for p in matches if p not in paths]
    texts = []
    for path in paths:
        with open(path, encoding="utf-8") as handle:
            texts.append(handle.read())
    return texts


def gsm8k_documents() -> list[str]:
    """The embedded GSM8K problems with their worked solutions as plain text, in a fixed shuffled order."""
    items = gsm8k_items()
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(1234)).tolist()
    return [f"Question: {items[i]['question']}\nAnswer: {items[i]['answer']}" for i in order]


def tokenize_documents(tokenizer, documents: list[str]) -> list[int]:
    """One token stream: each document's tokens (no special tokens), then EOS when the tokenizer has one."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    stream: list[int] = []
    for document in documents:
        # verbose=False: a whole document may exceed model_max_length; it is cut into blocks below
        stream += tokenizer(document, add_special_tokens=False, verbose=False)["input_ids"] + eos
    return stream


def group_blocks(token_ids: list[int], block_size: int, min_blocks: int = 2) -> list[list[int]]:
    """Consecutive blocks of exactly ``block_size`` tokens; the tail shorter than a block is dropped."""
    require(block_size >= 2, "block_size", block_size, "be >= 2 (a causal-LM row predicts its tokens 2..T)")
    count = len(token_ids) // block_size
    require(
        count >= min_blocks,
        "block_size",
        block_size,
        f"fit at least {min_blocks} times into the corpus of {len(token_ids)} tokens "
        "(one block to train on and one to evaluate; give more text or a smaller block_size)",
    )
    return [token_ids[i * block_size : (i + 1) * block_size] for i in range(count)]


def lm_dataset(blocks: list[list[int]]) -> datasets.Dataset:
    """Rows ``input_ids`` / ``attention_mask`` / ``labels`` (labels = inputs; the model shifts them)."""
    return datasets.Dataset.from_dict(
        {
            "input_ids": blocks,
            "attention_mask": [[1] * len(b) for b in blocks],
            "labels": [list(b) for b in blocks],
        }
    )


def cpt_splits(
    tokenizer, documents: list[str], block_size: int, eval_blocks: int
) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) block datasets: the last ``eval_blocks`` blocks of the stream are held out."""
    require(eval_blocks >= 1, "eval_blocks", eval_blocks, "be >= 1")
    blocks = group_blocks(tokenize_documents(tokenizer, documents), block_size)
    require(
        len(blocks) > eval_blocks,
        "eval_blocks",
        eval_blocks,
        f"be smaller than the corpus's {len(blocks)} blocks of {block_size} tokens (leave blocks to train on)",
    )
    return lm_dataset(blocks[:-eval_blocks]), lm_dataset(blocks[-eval_blocks:])


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover, or None when its config does not say."""
    config = config.get_text_config()
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def main(argv: list[str] | None = None) -> dict:
    script, args = HfArgumentParser((CPTScriptArguments, MeshTrainingArguments)).parse_args_into_dataclasses(argv)
    require(
        script.block_size >= 2, "block_size", script.block_size, "be >= 2 (a causal-LM row predicts its tokens 2..T)"
    )
    documents = read_text_files(script.text_files) if script.text_files is not None else gsm8k_documents()
    path = script.model_name_or_path or str(smollm2_checkpoint())
    # every input check before the (slower) model load
    limit = max_positions(AutoConfig.from_pretrained(path))
    require(
        limit is None or script.block_size <= limit,
        "block_size",
        script.block_size,
        f"be <= the model's max_position_embeddings={limit}",
    )
    tokenizer = AutoTokenizer.from_pretrained(path)
    train, evaluation = cpt_splits(tokenizer, documents, script.block_size, script.eval_blocks)
    # on a launched mesh: this process's stage only
    model = load_causal_lm(path, num_stages=args.num_stages, stage_layers=args.stage_layers)
    if script.train_last_layers is not None:
        freeze_all_but_last(model, script.train_last_layers)
    if script.freeze_embeddings:
        freeze_embeddings(model, path)
    # default_data_collator, not DataCollatorForLanguageModeling: with pad == EOS (SmolLM2) the latter
    # would hide the EOS document separators from the loss; rows are equal-length, nothing to pad.
    trainer = MeshTrainer(
        model=model,
        args=args,
        train_dataset=train,
        eval_dataset=evaluation,
        data_collator=default_data_collator,
        processing_class=tokenizer,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    metrics = trainer.evaluate()
    trainer.save_state()  # after evaluate: trainer_state.json carries the eval loss too
    try:
        metrics["perplexity"] = math.exp(metrics["eval_loss"])
    except OverflowError:
        metrics["perplexity"] = math.inf
    trainer.log_metrics("eval", metrics)
    trainer.save_metrics("eval", metrics)
    if torch.distributed.is_initialized():  # a launched mesh: leave the process group cleanly
        torch.distributed.destroy_process_group()
    return metrics


if __name__ == "__main__":
    main(sys.argv[1:])
