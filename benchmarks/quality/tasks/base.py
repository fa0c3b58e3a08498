"""What every task is made of: SFT pairs (`Example`), multiple-choice items (`ChoiceItem`), the
built `Task` that scores a generation, and the helpers the builders share to draw distinct items and
split them into train and eval without overlap."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path

DEFAULT_CACHE = Path(os.environ.get("HF_MESHTUNE_CACHE", Path.home() / ".cache" / "hf_meshtune")) / "quality"


@dataclass(frozen=True)
class Example:
    """One SFT pair; the loss is taken on `answer` only (which starts with a space)."""

    prompt: str
    answer: str


@dataclass(frozen=True)
class ChoiceItem:
    """A multiple-choice item: `choices[label]` is right. Choices carry the leading space of an answer."""

    prompt: str
    choices: tuple[str, ...]
    label: int


@dataclass
class Task:
    """A built task: train pairs, eval items and, for "generate"/"sql", how to score a generation.

    `eval` holds `Example`s for "generate" and "sql", `ChoiceItem`s for "choice", and plain text
    documents for "perplexity" (whose train pairs are `Example(prompt="", answer=chunk)`).
    `max_new_tokens` bounds generation: the byte length of the longest eval answer, which no
    byte-level tokenizer can exceed (each token covers at least one byte).
    """

    name: str
    kind: str
    train: list[Example]
    eval: list
    max_new_tokens: int = 0
    scorer: Callable[[Example, str], bool] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        kinds = ("generate", "sql", "perplexity", "choice")
        if self.kind not in kinds:
            raise ValueError(f"kind={self.kind!r} must be one of {kinds}")
        if self.kind in ("generate", "sql") and self.scorer is None:
            raise ValueError(f"kind={self.kind!r} needs a scorer; got scorer=None")

    def score(self, item: Example, generated: str) -> bool:
        """True when `generated` (the text after the prompt) answers `item` correctly.

        Only the first non-empty line counts: answers are one line, and whatever a model writes
        after it (a new "Question:", say) is not part of its answer.
        """
        if self.scorer is None:
            raise ValueError(f"task {self.name!r} of kind {self.kind!r} is not scored by generation")
        return self.scorer(item, first_line(generated))


def first_line(text: str) -> str:
    """The first line of `text` after leading whitespace, e.g. ``"\\n SELECT 1\\nQuestion"`` → ``"SELECT 1"``."""
    return text.lstrip().split("\n", 1)[0]


def _unique(make: Callable[[random.Random], Example | ChoiceItem], rng: random.Random, n: int) -> list:
    """Draw `n` items with distinct prompts; give up loudly if the generator cannot supply them."""
    items: dict[str, Example | ChoiceItem] = {}
    for _ in range(20 * n + 1000):
        if len(items) == n:
            break
        item = make(rng)
        items.setdefault(item.prompt, item)
    if len(items) < n:
        raise ValueError(f"could only draw {len(items)} distinct prompts, {n} were asked for")
    return list(items.values())


def _split(items: list, n_train: int, n_eval: int) -> tuple[list, list]:
    """Eval first, train after: items are distinct by prompt, so the two sides never share one."""
    return items[n_eval : n_eval + n_train], items[:n_eval]


def _answer_bytes(answers: Iterable[str]) -> int:
    return max((len(a.encode()) for a in answers), default=0)
