"""Arithmetic problems with a verifiable answer: data for SFT and a reward for GSPO.

Each problem is ``a op b`` with integer operands and an exact integer answer; problems are a pure
function of (seed, index), so train and eval splits never overlap when their seeds differ. The same
problems come in TRL's formats:

- ``sft_dataset``: conversational prompt-completion rows (``prompt`` = user turn, ``completion`` =
  assistant turn "The answer is N."), which ``SFTTrainer`` trains on with the loss on the completion;
- ``prompt_dataset``: conversational prompts plus an ``answer`` column, which ``GRPOTrainer`` passes
  to reward functions as a keyword argument;
- ``exact_answer_reward``: 1.0 when the last integer in a completion equals the answer, else 0.0;
- ``exact_match``: the same score for greedy answers of a model, the before/after figure of a run.
"""

from __future__ import annotations

import random
import re

import datasets
import torch

from .._validation import require

__all__ = [
    "ANSWER_TEMPLATE",
    "exact_answer_reward",
    "exact_match",
    "extract_answer",
    "problems",
    "prompt_dataset",
    "sft_dataset",
]

ANSWER_TEMPLATE = "The answer is {answer}."
_OPERATORS = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
_INTEGER = re.compile(r"-?\d[\d,]*")


def problems(count: int, seed: int = 0, max_operand: int = 20, operators: str = "+-") -> list[dict[str, str]]:
    """``count`` problems ``{"question", "answer"}`` with operands in [0, max_operand]."""
    require(count >= 1, "count", count, "be >= 1")
    require(max_operand >= 1, "max_operand", max_operand, "be >= 1")
    require(
        len(operators) > 0 and set(operators) <= set(_OPERATORS),
        "operators",
        operators,
        f"be a non-empty string of {''.join(_OPERATORS)}",
    )
    rng = random.Random(f"meshtune-arithmetic-{seed}")
    out = []
    for _ in range(count):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(operators)
        out.append({"question": f"What is {a} {op} {b}? Reply with the number.", "answer": str(_OPERATORS[op](a, b))})
    return out


def sft_dataset(count: int, seed: int = 0, **kwargs) -> datasets.Dataset:
    """Conversational prompt-completion rows for ``SFTTrainer``."""
    return datasets.Dataset.from_list(
        [
            {
                "prompt": [{"role": "user", "content": p["question"]}],
                "completion": [{"role": "assistant", "content": ANSWER_TEMPLATE.format(answer=p["answer"])}],
            }
            for p in problems(count, seed, **kwargs)
        ]
    )


def prompt_dataset(count: int, seed: int = 0, **kwargs) -> datasets.Dataset:
    """Conversational prompts with an ``answer`` column for ``GRPOTrainer`` and its reward."""
    return datasets.Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": p["question"]}], "answer": p["answer"]}
            for p in problems(count, seed, **kwargs)
        ]
    )


def extract_answer(text: str) -> str | None:
    """The last integer in ``text`` (thousands separators dropped), or None."""
    found = _INTEGER.findall(text)
    return found[-1].replace(",", "") if found else None


def _text(completion) -> str:
    if isinstance(completion, str):
        return completion
    return "".join(message.get("content", "") for message in completion if isinstance(message, dict))


def exact_answer_reward(completions: list, answer: list[str], **kwargs) -> list[float]:
    """TRL reward function: 1.0 where the completion's last integer equals the reference answer."""
    return [1.0 if extract_answer(_text(c)) == str(a) else 0.0 for c, a in zip(completions, answer, strict=True)]


@torch.no_grad()
def exact_match(model, tokenizer, items: list[dict[str, str]], batch_size: int = 16, max_new_tokens: int = 16) -> float:
    """Fraction of ``items`` whose greedy answer (chat template, left-padded batches) is exactly right."""
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    correct = 0
    try:
        for start in range(0, len(items), batch_size):
            chunk = items[start : start + batch_size]
            prompts = [
                tokenizer.apply_chat_template(
                    [{"role": "user", "content": p["question"]}], tokenize=False, add_generation_prompt=True
                )
                for p in chunk
            ]
            encoded = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(model.device)
            out = model.generate(
                **encoded, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=tokenizer.pad_token_id
            )
            texts = tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1] :], skip_special_tokens=True)
            correct += sum(extract_answer(t) == p["answer"] for t, p in zip(texts, chunk))
    finally:
        model.train(was_training)
        tokenizer.padding_side = side
    return correct / len(items)
