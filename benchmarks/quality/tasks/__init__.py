"""Adaptation tasks with real metrics for the fine-tuning quality benchmark.

Five tasks, each rebuilt exactly from a seed, each with train and eval items kept apart (no eval
prompt appears in train):

| task                    | kind         | metric (who computes it)                                      |
|-------------------------|--------------|---------------------------------------------------------------|
| `arithmetic`            | "generate"   | GSM8K exact match of the number after ``####`` (`Task.score`)  |
| `text_to_sql`           | "sql"        | Spider-style execution accuracy on a fixed SQLite DB (`Task.score`) |
| `continued_pretraining` | "perplexity" | held-out perplexity on unseen Shakespeare plays (the runner)  |
| `sequence_choice`       | "choice"     | log-likelihood ranking accuracy (`choice_accuracy`)           |
| `category_choice`       | "choice"     | log-likelihood ranking accuracy (`choice_accuracy`)           |

SFT pairs are `Example(prompt, answer)`: the loss covers the answer tokens only, and every answer
starts with a space so that it tokenizes the same way after the prompt as it does in the middle of
text. Answers are one line; `Task.score` reads a generation up to its first newline.

`pretraining_corpus` supplies plain English (Python docs + the GCIDE dictionary) for training the
tiny model from scratch. Only the standard library is used.

>>> task = TASKS["arithmetic"](seed=0)
>>> item = task.eval[0]
>>> task.score(item, item.answer), task.score(item, " #### -1")
(True, False)

One module per task: `word_problems` (arithmetic), `sql` (text_to_sql), `shakespeare`
(continued_pretraining), `choice` (sequence_choice), `categories` (category_choice), plus `base`
(the items, `Task` and shared helpers) and `corpus` (pretraining_corpus). Every public name is
re-exported here.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

from .base import DEFAULT_CACHE, ChoiceItem, Example, Task, first_line
from .categories import CATEGORIES, category_choice
from .choice import choice_accuracy, sequence_choice
from .corpus import GCIDE, PYTHON_DOCS, clean_gcide, html_to_text, pretraining_corpus
from .shakespeare import (
    CHUNK_CHARS,
    N_EVAL_PLAYS,
    SHAKESPEARE_PIN,
    chunk_text,
    clean_play_text,
    continued_pretraining,
    shakespeare_texts,
)
from .sql import SQL_TIMEOUT_S, execution_match, sql_database_script, text_to_sql
from .word_problems import arithmetic, extract_number, gsm8k_score

__all__ = [
    "CATEGORIES",
    "CHUNK_CHARS",
    "DEFAULT_CACHE",
    "GCIDE",
    "N_EVAL_PLAYS",
    "PYTHON_DOCS",
    "SHAKESPEARE_PIN",
    "SQL_TIMEOUT_S",
    "TASKS",
    "ChoiceItem",
    "Example",
    "Task",
    "arithmetic",
    "category_choice",
    "choice_accuracy",
    "chunk_text",
    "clean_gcide",
    "clean_play_text",
    "continued_pretraining",
    "execution_match",
    "extract_number",
    "first_line",
    "gsm8k_score",
    "html_to_text",
    "pretraining_corpus",
    "sequence_choice",
    "shakespeare_texts",
    "sql_database_script",
    "text_to_sql",
]

TASKS: dict[str, Callable[..., Task]] = {
    "arithmetic": partial(arithmetic, seed=0, n_train=2000, n_eval=200),
    "text_to_sql": partial(text_to_sql, seed=0, n_train=2000, n_eval=200),
    "continued_pretraining": partial(continued_pretraining, seed=0, n_train_chars=400_000, n_eval_docs=100),
    "sequence_choice": partial(sequence_choice, seed=0, n_train=2000, n_eval=200),
    "category_choice": partial(category_choice, seed=0, n_train=2000, n_eval=200),
}
