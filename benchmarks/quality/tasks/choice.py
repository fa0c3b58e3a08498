"""Sequence continuation as multiple choice, BIG-bench-style: pick the next term of an
arithmetic, geometric or alternating sequence, scored by log-likelihood ranking (`choice_accuracy`)."""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable, Sequence

from .base import ChoiceItem, Example, Task, _split, _unique


def _arithmetic_sequence(rng: random.Random) -> tuple[list[int], int, list[int]]:
    step, start = rng.choice([d for d in range(-9, 10) if d]), rng.randint(-20, 30)
    terms = [start + i * step for i in range(rng.randint(4, 5))]
    nxt, last = terms[-1] + step, terms[-1]
    return terms, nxt, [last + 2 * step, last, nxt + 1, last - step, nxt - 1]


def _geometric_sequence(rng: random.Random) -> tuple[list[int], int, list[int]]:
    ratio, start = rng.choice([2, 3]), rng.choice([s for s in range(-20, 21) if s])
    terms = [start * ratio**i for i in range(rng.randint(4, 5))]
    nxt, last = terms[-1] * ratio, terms[-1]
    return terms, nxt, [2 * last - terms[-2], last, nxt + 1, last * (ratio + 1), nxt - 1]


def _alternating_sequence(rng: random.Random) -> tuple[list[int], int, list[int]]:
    n = rng.randint(5, 6)
    if rng.random() < 0.5:  # add `up`, subtract `down`, repeat: 5, 8, 6, 9, 7, ...
        up, down = rng.randint(2, 9), rng.randint(1, 8)
        terms = [rng.randint(0, 20)]
        for i in range(1, n + 1):
            terms.append(terms[-1] + (up if i % 2 else -down))
        terms, nxt = terms[:-1], terms[-1]
        wrong_op = terms[-1] - down if nxt > terms[-1] else terms[-1] + up
        return terms, nxt, [wrong_op, terms[-1], nxt + 1, terms[-2]]
    a, b, da, db = rng.randint(1, 9), rng.randint(10, 50), rng.randint(1, 5), rng.randint(5, 20)
    both = [x for i in range(n // 2 + 1) for x in (a + i * da, b + i * db)]  # 1, 10, 2, 20, 3, 30, ...
    terms, nxt = both[:n], both[n]
    return terms, nxt, [terms[-1] + (terms[-1] - terms[-3]), terms[-1], nxt + 1, terms[-2]]


_SEQUENCES = (_arithmetic_sequence, _geometric_sequence, _alternating_sequence)


def _sequence_item(rng: random.Random) -> ChoiceItem:
    """One item with the right next term and three distinct distractors from plausible mistakes."""
    terms, nxt, mistakes = rng.choice(_SEQUENCES)(rng)
    wrong = list(dict.fromkeys(m for m in mistakes if m != nxt))
    wrong = rng.sample(wrong, min(3, len(wrong)))
    for offset in itertools.count(2):  # rare: too many mistakes coincide
        if len(wrong) == 3:
            break
        wrong += [v for v in (nxt + offset, nxt - offset) if v not in wrong][: 3 - len(wrong)]
    label = rng.randrange(4)
    values = wrong[:label] + [nxt] + wrong[label:]
    prompt = "Continue the sequence: " + ", ".join(map(str, terms)) + ", ->"
    return ChoiceItem(prompt, tuple(f" {v}" for v in values), label)


def sequence_choice(seed: int, n_train: int, n_eval: int) -> Task:
    """Arithmetic (any nonzero step), geometric (×2, ×3) and alternating sequences.

    Prompt ``"Continue the sequence: 3, 7, 11, 15, ->"``; 4 choices like ``" 19"``. Train is
    ``Example(prompt, " 19")`` (the right choice), eval the `ChoiceItem`s; see `choice_accuracy`.
    Geometric sequences have only 160 distinct prompts, so a large `n_train` holds few of them.
    """
    items = _unique(_sequence_item, random.Random(f"sequence_choice/{seed}"), n_train + n_eval)
    train, eval_ = _split(items, n_train, n_eval)
    train = [Example(item.prompt, item.choices[item.label]) for item in train]
    return Task("sequence_choice", "choice", train, eval_)


def choice_accuracy(logprob_fn: Callable[[str, str], float], items: Sequence[ChoiceItem]) -> float:
    """Fraction of items whose right choice has the strictly highest log-likelihood.

    `logprob_fn(prompt, continuation)` returns the summed log-probability of the continuation's
    tokens given the prompt. A tie for first place counts as wrong, so a model that cannot tell the
    choices apart scores 0, not 1/4.
    """
    if not items:
        raise ValueError("items must not be empty")
    right = 0
    for item in items:
        scores = [logprob_fn(item.prompt, choice) for choice in item.choices]
        best_other = max(s for i, s in enumerate(scores) if i != item.label)
        right += scores[item.label] > best_other
    return right / len(items)
