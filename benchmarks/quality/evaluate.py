"""Real metrics of the quality benchmark, always on the dense model (``model.eval()``: no boundary acts).

- generated answers: exact match of the final number (arithmetic) or SQLite execution accuracy (SQL);
- multiple choice: log-likelihood ranking of the choices;
- continued pre-training: held-out perplexity;
- pruning robustness: the same metric after magnitude-pruning a share of every decoder weight matrix.
"""

from __future__ import annotations

import contextlib
import math
from typing import Iterator

import torch
from torch import nn

from hf_meshtune.boundary.hooks import find_decoder_layers

from .tasks import Task, choice_accuracy


def sft_row(tokenizer, prompt: str, answer: str, seq_len: int) -> dict[str, list[int]]:
    """Prompt + answer + EOS, loss on the answer tokens only (prompt labels are -100)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"] if prompt else []
    answer_ids = tokenizer(answer, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
    ids = (prompt_ids + answer_ids)[:seq_len]
    labels = ([-100] * len(prompt_ids) + answer_ids)[:seq_len]
    return {"input_ids": ids, "attention_mask": [1] * len(ids), "labels": labels}


@torch.no_grad()
def generate(model, tokenizer, prompts: list[str], max_new_tokens: int, batch_size: int = 64) -> list[str]:
    """Greedy continuations of ``prompts`` (the tasks' scorers read the first line)."""
    model.eval()
    tokenizer.padding_side = "left"
    outputs = []
    for start in range(0, len(prompts), batch_size):
        batch = tokenizer(
            prompts[start : start + batch_size], return_tensors="pt", padding=True, add_special_tokens=False
        )
        tokens = model.generate(
            **batch,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.eos_token_id,
            eos_token_id=tokenizer.eos_token_id,
        )
        for row in tokens[:, batch["input_ids"].shape[1] :]:
            outputs.append(tokenizer.decode(row, skip_special_tokens=True))
    return outputs


@torch.no_grad()
def continuation_logprobs(model, tokenizer, pairs: list[tuple[str, str]], batch_size: int = 64) -> list[float]:
    """Summed log-probability of each continuation given its prompt."""
    model.eval()
    scores = []
    for start in range(0, len(pairs), batch_size):
        rows = [sft_row(tokenizer, p, c, 10_000) for p, c in pairs[start : start + batch_size]]
        for row in rows:  # score the continuation alone, not the EOS sft_row appends
            row["labels"][-1] = -100
        width = max(len(r["input_ids"]) for r in rows)
        ids = torch.tensor([r["input_ids"] + [tokenizer.eos_token_id] * (width - len(r["input_ids"])) for r in rows])
        mask = torch.tensor([r["attention_mask"] + [0] * (width - len(r["input_ids"])) for r in rows])
        labels = torch.tensor([r["labels"] + [-100] * (width - len(r["labels"])) for r in rows])
        logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1].float()
        target = labels[:, 1:]
        logp = torch.log_softmax(logits, -1).gather(-1, target.clamp(min=0).unsqueeze(-1)).squeeze(-1)
        scores.extend((logp * (target != -100)).sum(-1).tolist())
    return scores


@torch.no_grad()
def perplexity(model, tokenizer, documents: list[str], seq_len: int, batch_size: int = 16) -> float:
    """exp(mean token NLL) over held-out documents, each cut into seq_len windows."""
    model.eval()
    windows = []
    for doc in documents:
        ids = tokenizer(doc, add_special_tokens=False)["input_ids"]
        windows.extend(ids[i : i + seq_len] for i in range(0, len(ids) - 1, seq_len) if len(ids[i : i + seq_len]) > 1)
    total, count = 0.0, 0
    for start in range(0, len(windows), batch_size):
        chunk = windows[start : start + batch_size]
        width = max(map(len, chunk))
        ids = torch.tensor([w + [tokenizer.eos_token_id] * (width - len(w)) for w in chunk])
        labels = torch.tensor([w + [-100] * (width - len(w)) for w in chunk])
        logits = model(input_ids=ids).logits[:, :-1].float()
        target = labels[:, 1:]
        nll = nn.functional.cross_entropy(logits.transpose(1, 2), target, ignore_index=-100, reduction="sum")
        total, count = total + nll.item(), count + int((target != -100).sum())
    return math.exp(total / count)


def task_metric(model, tokenizer, task: Task, seq_len: int) -> dict[str, float]:
    """{metric name: value} of ``task`` on its eval split; higher is better except perplexity."""
    if task.kind in ("generate", "sql"):
        generated = generate(model, tokenizer, [item.prompt for item in task.eval], task.max_new_tokens)
        correct = [task.score(item, text) for item, text in zip(task.eval, generated)]
        name = "exact_match" if task.kind == "generate" else "execution_accuracy"
        return {name: sum(correct) / len(correct), "samples": generated[:3]}
    if task.kind == "choice":
        pairs = [(item.prompt, choice) for item in task.eval for choice in item.choices]
        table = dict(zip(pairs, continuation_logprobs(model, tokenizer, pairs)))
        return {"accuracy": choice_accuracy(lambda p, c: table[(p, c)], task.eval)}
    return {"perplexity": perplexity(model, tokenizer, task.eval, seq_len)}


@contextlib.contextmanager
def magnitude_pruned(model: nn.Module, share: float) -> Iterator[None]:
    """Zero the ``share`` smallest-|w| entries of every decoder weight matrix; restore on exit."""
    layers_name, _ = find_decoder_layers(model)
    saved = {}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.ndim == 2 and name.startswith(f"{layers_name}."):
                saved[name] = param.detach().clone()
                count = int(share * param.numel())
                if count:
                    threshold = param.abs().flatten().kthvalue(count).values
                    param.masked_fill_(param.abs() <= threshold, 0.0)
    try:
        yield
    finally:
        with torch.no_grad():
            params = dict(model.named_parameters())
            for name, value in saved.items():
                params[name].copy_(value)
