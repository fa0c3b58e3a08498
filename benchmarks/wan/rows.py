"""What the WAN benchmark compares: the rows, the shared model/mesh shape and the data.

Every row trains the same model from the same initial weights on the same token blocks, with the same
fast replicas (3), pipeline stages (2), batch, schedule and steps; rows differ only in what crosses
the links. The +AP rows add the anchor replica (2 more nodes), as the paper's mesh does.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Row:
    label: str
    mask_ratio: float
    anchor: bool
    dp_mode: str  # streaming_diloco | allreduce | powersgd_hook
    powersgd_rank: int | None
    peer: bool = False  # a method a user would otherwise pick, not one of the paper's rows

    @property
    def replicas(self) -> int:
        return 4 if self.anchor else 3


ROWS: dict[str, Row] = {
    "dense": Row("Dense", 0.0, False, "allreduce", None),
    "dp": Row("+DP", 0.0, False, "streaming_diloco", 4),
    "m95": Row("M95", 0.95, False, "streaming_diloco", 4),
    "m90_ap": Row("M90+AP", 0.90, True, "streaming_diloco", 4),
    "m95_ap": Row("M95+AP", 0.95, True, "streaming_diloco", 4),
    "torchft_diloco": Row("torchft DiLoCo", 0.0, False, "streaming_diloco", None, peer=True),
    "powersgd_hook": Row("PowerSGD hook (DDP)", 0.0, False, "powersgd_hook", 4, peer=True),
}


@dataclass(frozen=True)
class Shape:
    """The model and mesh every row shares (a tiny Llama trained from scratch on GSM8K text)."""

    hidden: int = 128
    layers: int = 4
    heads: int = 4
    vocab: int = 2048
    stages: int = 2
    seq_len: int = 64
    microbatch_size: int = 4
    microbatches: int = 4
    lr: float = 3e-3
    sync_every: int = 20
    fragments: int = 2
    anchor_every: int = 20

    @property
    def tokens_per_replica_step(self) -> int:
        return self.seq_len * self.microbatch_size * self.microbatches


def build_model(shape: Shape, vocab_size: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=shape.hidden,
        intermediate_size=4 * shape.hidden,
        num_hidden_layers=shape.layers,
        num_attention_heads=shape.heads,
        num_key_value_heads=shape.heads,
        max_position_embeddings=shape.seq_len,
        tie_word_embeddings=False,
        bos_token_id=0,
        eos_token_id=0,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config)


def prepare_data(shape: Shape, path: str, eval_blocks: int = 64) -> dict:
    """Tokenize the embedded GSM8K (a BPE trained on it), cut blocks, fix the initial weights; save."""
    from benchmarks.quality.pretrain import _token_blocks, _train_tokenizer
    from hf_meshtune.apps.assets import gsm8k_items

    text = "".join(f"Question: {it['question']}\nAnswer: {it['answer']}<|endoftext|>" for it in gsm8k_items())
    tokenizer = _train_tokenizer(text, shape.vocab)
    blocks = _token_blocks(tokenizer, text, shape.seq_len)
    torch.manual_seed(0)
    model = build_model(shape, len(tokenizer))
    data = {
        "train": blocks[:-eval_blocks],
        "eval": blocks[-eval_blocks:],
        "vocab_size": len(tokenizer),
        "init": model.state_dict(),
    }
    torch.save(data, path)
    return data
