"""Tiny real models and datasets for tests: built from configs, no hub, no network."""

from __future__ import annotations

import datasets
import torch

TINY_VOCAB = 100

# Per-architecture config overrides on top of the shared tiny sizes. Special-token ids are moved
# inside the tiny vocabulary where the defaults (Phi-3: 32000, GPT-2: 50256) would fall outside it.
_TINY_ARCH_OVERRIDES: dict[str, dict] = {
    "llama": {},
    "qwen2": {},
    "mistral": {},
    "gemma": {"head_dim": 8},  # Gemma's default head_dim is 256 regardless of hidden_size
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"bos_token_id": 1, "eos_token_id": 2, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"bos_token_id": 1, "eos_token_id": 2},
}

TINY_ARCHS = tuple(_TINY_ARCH_OVERRIDES)


def make_tiny_causal_lm(arch: str, hidden: int = 32, layers: int = 4, seed: int = 0, **overrides) -> torch.nn.Module:
    """A randomly initialised causal LM of architecture ``arch`` (a ``model_type`` of TINY_ARCHS).

    hidden H = ``hidden`` (4 heads, 2 KV heads where the architecture has GQA), ``layers`` decoder
    layers, vocabulary of 100, no dropout. Initialisation is seeded by ``seed`` (without disturbing
    the caller's global RNG). The model is in training mode, as ``from_config`` leaves it.
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    if arch == "gpt2":
        sizes = {"n_embd": hidden, "n_layer": layers, "n_head": 4, "n_inner": 2 * hidden, "n_positions": 64}
    else:
        sizes = {
            "hidden_size": hidden,
            "num_hidden_layers": layers,
            "num_attention_heads": 4,
            "intermediate_size": 2 * hidden,
            "max_position_embeddings": 64,
        }
        if arch != "gpt_neox":
            sizes["num_key_value_heads"] = 2
    config = AutoConfig.for_model(
        arch, **{"vocab_size": TINY_VOCAB, **sizes, **_TINY_ARCH_OVERRIDES[arch], **overrides}
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config)


def tiny_llama(seed: int = 0, layers: int = 4, hidden: int = 64) -> torch.nn.Module:
    """The trainer tests' model: a 4-layer Llama with H = 64 and valid special-token ids."""
    return make_tiny_causal_lm(
        "llama", hidden=hidden, layers=layers, seed=seed, pad_token_id=0, bos_token_id=1, eos_token_id=2
    )


def pattern_dataset(n: int = 64, length: int = 16, vocab: int = TINY_VOCAB) -> datasets.Dataset:
    """Learnable sequences: counting upwards (mod the vocabulary) from a different start each row."""
    rows = []
    for i in range(n):
        start = (7 * i) % (vocab - 3)
        ids = [(start + t) % (vocab - 3) + 3 for t in range(length)]
        rows.append({"input_ids": ids, "attention_mask": [1] * length, "labels": ids})
    return datasets.Dataset.from_list(rows)
