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
    "qwen3": {},
    "gemma": {"head_dim": 8},  # Gemma's default head_dim is 256 regardless of hidden_size
    "gemma2": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "gemma3_text": {"head_dim": 8, "query_pre_attn_scalar": 8},
    "phi3": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "phi": {"bos_token_id": 1, "eos_token_id": 2},
    "olmo": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "olmo2": {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2},
    "stablelm": {"bos_token_id": 1, "eos_token_id": 2},
    "gpt2": {"bos_token_id": 1, "eos_token_id": 2, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "attn_pdrop": 0.0},
    "gpt_neox": {"bos_token_id": 1, "eos_token_id": 2},
}

TINY_ARCHS = tuple(_TINY_ARCH_OVERRIDES)

# A governed two-stage tiny_llama: one boundary, ladder int2/int4/int8, a round every 2 steps landing 1 later;
# at target 0.99 the first round picks int4 (its cosine ≥ 0.99, int2's far below)
GOVERNED_TINY = dict(
    num_stages=2,
    boundary_codec="governed",
    codec_ladder="int2,int4,int8",
    anchor_every=2,
    anchor_delay=1,
    fidelity_target=0.99,
    fidelity_hysteresis=0.0,
)


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


# What each family the distributed pipeline supports (``pipeline.layout.FAMILIES``) is tested with: every switch the
# stages must reproduce turned on, at sizes where it matters. Sliding windows of 4 < the tests' 12 tokens (a
# window that covers the sequence is the full mask); soft-caps of 0.5, where tanh bends the tiny model's logits
# (|logits| ≈ 0.4; Gemma's default 30 would be the identity there).
PIPELINE_FAMILIES: dict[str, dict] = {
    "llama": {},
    "mistral": {"sliding_window": 4},  # every layer sliding
    "qwen2": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},  # full, full, sliding, sliding
    "qwen3": {"use_sliding_window": True, "sliding_window": 4, "max_window_layers": 2},
    "gemma": {},  # embeddings scaled by √H
    "gemma2": {"sliding_window": 4, "final_logit_softcapping": 0.5},  # sliding, full, sliding, full
    "gemma3_text": {  # the local rotary base (10^4, not 10^6) on sliding layers
        "sliding_window": 4,
        "layer_types": ["sliding_attention", "full_attention", "full_attention", "sliding_attention"],
        "final_logit_softcapping": 0.5,
    },
    "phi3": {"sliding_window": 4},
    "phi": {},  # embedding dropout module, final_layernorm, partial rotary
    "olmo": {},
    "olmo2": {},  # q/k norms
    "stablelm": {"qk_layernorm": True, "use_parallel_residual": True},
    "gpt_neox": {},  # gpt_neox.embed_in, emb_dropout, final_layer_norm; parallel residual
}


def tiny_family(arch: str, hidden: int = 32, layers: int = 4, seed: int = 0, **overrides) -> torch.nn.Module:
    """``make_tiny_causal_lm`` with the family's ``PIPELINE_FAMILIES`` switches (then ``overrides``)."""
    switches = {**PIPELINE_FAMILIES[arch], **overrides}
    return make_tiny_causal_lm(arch, hidden=hidden, layers=layers, seed=seed, **switches)


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


def tiny_word_tokenizer():
    """The tiny models' tokenizer: 100 whitespace-separated words (``[UNK]`` 0, also the pad; ``[BOS]`` 1,
    ``[EOS]`` 2, ``w3`` … ``w99``), the ids of the tiny Llama's defaults, and a plain chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"[UNK]": 0, "[BOS]": 1, "[EOS]": 2, **{f"w{i}": i for i in range(3, TINY_VOCAB)}}
    core = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    core.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, unk_token="[UNK]", bos_token="[BOS]", eos_token="[EOS]", pad_token="[UNK]"
    )
    tokenizer.chat_template = "{% for m in messages %}{{ m['content'] }} {% endfor %}"
    return tokenizer
