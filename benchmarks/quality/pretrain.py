"""Base model (b) of the quality benchmark: a small Llama pretrained here, from scratch, on offline text.

SmolLM2-135M is too slow on 2 CPU cores for the full sweeps, so the sweeps fine-tune this model:
8 decoder layers, H = 256 (K = 13 kept dims per token at p = 0.95, as in the first prototype), 4 heads,
byte-level BPE vocabulary of 4,096 trained on the same text, tied embeddings, ~7.4M parameters.
The text is Python's HTML documentation and the GCIDE dictionary (Debian packages
``python3.11-doc`` and ``dict-gcide``), so every fine-tuning task is a new domain for it.

    python -m benchmarks.quality.pretrain          # ~15 min on 2 CPU cores, cached afterwards

The checkpoint lives under ``$HF_MESHTUNE_CACHE/quality/`` (outside git); its pretraining loss and
time go to ``benchmarks/quality/results/pretrain.json``.
"""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from hf_meshtune.apps.cache import cache_dir, filled_once

from .tasks import pretraining_corpus

RESULTS = Path(__file__).resolve().parent / "results"
EOS = "<|endoftext|>"


@dataclass(frozen=True)
class PretrainSettings:
    vocab_size: int = 4096
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 8
    num_heads: int = 4
    seq_len: int = 128
    batch_size: int = 16
    steps: int = 1500
    learning_rate: float = 1e-3
    warmup_steps: int = 100
    corpus_chars: int = 24_000_000
    eval_fraction: float = 0.01
    seed: int = 0

    def key(self) -> str:
        return f"tiny_llama_L{self.num_layers}_H{self.hidden_size}_V{self.vocab_size}_S{self.steps}_seed{self.seed}"


def _train_tokenizer(text: str, vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[EOS], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    # digits one by one would make numbers long; BPE learns the frequent ones from the text
    core.train_from_iterator((text[i : i + 100_000] for i in range(0, len(text), 100_000)), trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=core, eos_token=EOS, pad_token=EOS, bos_token=EOS)


def _token_blocks(tokenizer, text: str, seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for start in range(0, len(text), 1_000_000):
        ids.extend(tokenizer(text[start : start + 1_000_000], add_special_tokens=False)["input_ids"])
    usable = len(ids) // seq_len * seq_len
    return torch.tensor(ids[:usable]).view(-1, seq_len)


def _build_model(settings: PretrainSettings, tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=settings.vocab_size,
        hidden_size=settings.hidden_size,
        intermediate_size=settings.intermediate_size,
        num_hidden_layers=settings.num_layers,
        num_attention_heads=settings.num_heads,
        num_key_value_heads=settings.num_heads,
        max_position_embeddings=1024,
        tie_word_embeddings=True,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.eos_token_id,
    )
    return LlamaForCausalLM(config)


@torch.no_grad()
def _held_out_loss(model, blocks: torch.Tensor, batch_size: int) -> float:
    model.eval()
    losses = [
        model(input_ids=blocks[i : i + batch_size], labels=blocks[i : i + batch_size]).loss.item()
        for i in range(0, len(blocks), batch_size)
    ]
    model.train()
    return sum(losses) / len(losses)


def _pretrain(settings: PretrainSettings, model, train: torch.Tensor, held_out: torch.Tensor) -> dict:
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.learning_rate, weight_decay=0.1, betas=(0.9, 0.95))

    def lr_at(step: int) -> float:
        if step < settings.warmup_steps:
            return (step + 1) / settings.warmup_steps
        progress = (step - settings.warmup_steps) / max(1, settings.steps - settings.warmup_steps)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_at)
    curve, started = [], time.time()
    model.train()
    for step in range(settings.steps):
        rows = torch.randint(len(train), (settings.batch_size,), generator=generator)
        loss = model(input_ids=train[rows], labels=train[rows]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step(), scheduler.step(), optimizer.zero_grad(set_to_none=True)
        if step % 100 == 0 or step == settings.steps - 1:
            curve.append({"step": step, "train_loss": loss.item(), "elapsed_s": time.time() - started})
            print(f"pretrain step {step}: loss {loss.item():.3f} ({time.time() - started:.0f} s)", flush=True)
    return {
        "curve": curve,
        "pretrain_s": time.time() - started,
        "held_out_loss": _held_out_loss(model, held_out, settings.batch_size),
    }


def tiny_llama(settings: PretrainSettings = PretrainSettings()) -> Path:
    """Path of the pretrained tiny Llama checkpoint (model + tokenizer); pretrains it on first use, once
    (``filled_once``: concurrent callers wait for the one that pretrains)."""
    return filled_once(
        cache_dir() / "quality" / settings.key(),
        lambda folder: _pretrain_into(folder, settings),
        ("config.json", "model.safetensors"),
    )


def _pretrain_into(folder: Path, settings: PretrainSettings) -> None:
    torch.manual_seed(settings.seed)
    started = time.time()
    text = pretraining_corpus(cache_dir() / "quality", settings.corpus_chars)
    tokenizer = _train_tokenizer(text, settings.vocab_size)
    blocks = _token_blocks(tokenizer, text, settings.seq_len)
    split = max(1, int(len(blocks) * settings.eval_fraction))
    held_out, train = blocks[:split][:256], blocks[split:]
    prep_s = time.time() - started
    model = _build_model(settings, tokenizer)
    report = _pretrain(settings, model, train, held_out)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "pretrain.json").write_text(
        json.dumps(
            {
                "settings": asdict(settings),
                "parameters": sum(p.numel() for p in model.parameters()),
                "corpus_chars": len(text),
                "train_tokens_available": train.numel(),
                "tokens_seen": settings.steps * settings.batch_size * settings.seq_len,
                "tokenize_s": prep_s,
                "torch_threads": torch.get_num_threads(),
                **report,
            },
            indent=2,
        )
    )


def load_tiny_llama(settings: PretrainSettings = PretrainSettings()):
    """(model, tokenizer) of the pretrained tiny Llama, fp32."""
    from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast

    path = tiny_llama(settings)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32), PreTrainedTokenizerFast.from_pretrained(
        path
    )


if __name__ == "__main__":
    print(tiny_llama())
