"""Arithmetic word problems, GSM8K-style: buying, sharing, ages, distances and giving, 1–2
operations each, scored by exact match of the number after ``####`` (`gsm8k_score`)."""

from __future__ import annotations

import operator
import random
import re
from decimal import Decimal, InvalidOperation

from .base import Example, Task, _answer_bytes, _split, _unique

_PEOPLE = (
    ("Tom", "he"),
    ("Maria", "she"),
    ("Ahmed", "he"),
    ("Lena", "she"),
    ("Kenji", "he"),
    ("Sara", "she"),
    ("Omar", "he"),
    ("Julia", "she"),
    ("Pablo", "he"),
    ("Nadia", "she"),
    ("Ivan", "he"),
    ("Chloe", "she"),
    ("Ravi", "he"),
    ("Emma", "she"),
    ("Lucas", "he"),
    ("Aisha", "she"),
    ("Felix", "he"),
    ("Mei", "she"),
)
_GOODS = ("apples", "pencils", "notebooks", "cookies", "stickers", "oranges", "books", "candles", "cups", "toys")
_THINGS = ("marbles", "cards", "shells", "coins", "stamps", "beads", "stones", "buttons", "ribbons", "balloons")
_VEHICLES = ("car", "bus", "train", "truck", "bike", "boat")
_OPS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.floordiv}


def _eq(a: int, op: str, b: int) -> tuple[str, int]:
    """``_eq(4, "*", 3)`` → ``("4 * 3 = 12", 12)``; division is only ever asked when it is exact."""
    assert op != "/" or a % b == 0, (a, b)
    value = _OPS[op](a, b)
    return f"{a} {op} {b} = {value}", value


def _two_people(rng: random.Random) -> tuple[tuple[str, str], tuple[str, str]]:
    first, second = rng.sample(_PEOPLE, 2)
    return first, second


def _buying(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he), _ = _two_people(rng)
    n, price, goods = rng.randint(2, 9), rng.randint(2, 15), rng.choice(_GOODS)
    text, cost = _eq(n, "*", price)
    question = f"{name} buys {n} {goods} for ${price} each."
    if rng.random() < 0.5:
        return question + f" How much does {he} spend?", [f"{name} spends {text} dollars."], cost
    bill = rng.choice([b for b in (20, 50, 100, 200) if b > cost])
    change_text, change = _eq(bill, "-", cost)
    question += f" {he.capitalize()} pays with a ${bill} bill. How much change does {he} get?"
    return question, [f"The {goods} cost {text} dollars.", f"The change is {change_text} dollars."], change


def _sharing(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he), _ = _two_people(rng)
    friends, each, things = rng.randint(2, 8), rng.randint(2, 12), rng.choice(_THINGS)
    if rng.random() < 0.5:
        total = friends * each
        text, value = _eq(total, "/", friends)
        question = f"{name} has {total} {things} and shares them equally among {friends} friends."
        return question + f" How many {things} does each friend get?", [f"Each friend gets {text} {things}."], value
    keep = rng.randint(1, 9)
    total = friends * each + keep
    rest_text, rest = _eq(total, "-", keep)
    text, value = _eq(rest, "/", friends)
    question = (
        f"{name} has {total} {things}. {he.capitalize()} keeps {keep} and shares the rest equally "
        f"among {friends} friends. How many {things} does each friend get?"
    )
    return question, [f"{name} shares {rest_text} {things}.", f"Each friend gets {text} {things}."], value


def _ages(rng: random.Random) -> tuple[str, list[str], int]:
    (name, _), (other, _) = _two_people(rng)
    age, form = rng.randint(3, 40), rng.randrange(3)
    if form == 0:
        times = rng.randint(2, 4)
        text, value = _eq(age, "*", times)
        question = f"{name} is {age} years old. {other} is {times} times as old as {name}. How old is {other}?"
        return question, [f"{other} is {text} years old."], value
    gap = rng.randint(2, 30)
    text, older = _eq(age, "+", gap)
    question = f"{name} is {age} years old. {other} is {gap} years older than {name}."
    if form == 1:
        return question + f" How old is {other}?", [f"{other} is {text} years old."], older
    years = rng.randint(2, 15)
    later_text, later = _eq(older, "+", years)
    question += f" How old will {other} be in {years} years?"
    return question, [f"{other} is {text} years old now.", f"In {years} years {other} will be {later_text}."], later


def _distances(rng: random.Random) -> tuple[str, list[str], int]:
    vehicle, speed, hours = rng.choice(_VEHICLES), rng.randint(3, 20) * 5, rng.randint(2, 6)
    text, dist = _eq(speed, "*", hours)
    question = f"A {vehicle} travels at {speed} km per hour for {hours} hours."
    if rng.random() < 0.5:
        return question + " How many km does it travel?", [f"It travels {text} km."], dist
    extra = rng.randint(5, 60)
    total_text, total = _eq(dist, "+", extra)
    question += f" Then it travels {extra} km more. How many km does it travel in total?"
    return question, [f"First it travels {text} km.", f"In total it travels {total_text} km."], total


def _giving(rng: random.Random) -> tuple[str, list[str], int]:
    (name, he), (other, _) = _two_people(rng)
    start, things = rng.randint(10, 60), rng.choice(_THINGS)
    given, found = rng.randint(1, start - 1), rng.randint(1, 30)
    left_text, left = _eq(start, "-", given)
    now_text, now = _eq(left, "+", found)
    question = (
        f"{name} has {start} {things}. {he.capitalize()} gives {given} to {other} and then finds "
        f"{found} more. How many {things} does {name} have now?"
    )
    return question, [f"After giving some away {name} has {left_text}.", f"Now {he} has {now_text} {things}."], now


_WORD_PROBLEMS = (_buying, _sharing, _ages, _distances, _giving)


def _word_problem(rng: random.Random) -> Example:
    question, steps, value = rng.choice(_WORD_PROBLEMS)(rng)
    return Example(f"Question: {question}\nAnswer:", f" {' '.join(steps)} #### {value}")


_NUMBER = re.compile(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")


def extract_number(text: str) -> str | None:
    """The answer number in `text`, commas stripped: the first number after the first ``####``, or
    (when there is no ``####``) the last number anywhere; None when there is none.

    ``"so 1,200 #### 1,234"`` → ``"1234"``; ``"#### -7"`` → ``"-7"``; ``"it is 3.50"`` → ``"3.5"``.
    """
    head, marker, tail = text.partition("####")
    if marker:
        found = _NUMBER.search(tail)
    else:
        found = next(reversed(list(_NUMBER.finditer(head))), None)
    if found is None:
        return None
    number = found.group().replace(",", "")
    return number.rstrip("0").rstrip(".") if "." in number else number


def gsm8k_score(generated: str, reference_answer: str) -> bool:
    """GSM8K exact match: the number `extract_number` reads from `generated` equals the number after
    ``####`` in `reference_answer` (compared as decimals, so ``"8.0"`` matches ``"8"``)."""
    _, marker, tail = reference_answer.partition("####")
    if not marker:
        raise ValueError(f"reference_answer={reference_answer!r} has no '#### N' part")
    predicted, reference = extract_number(generated), extract_number(marker + tail)
    if predicted is None or reference is None:
        return False
    try:
        return Decimal(predicted) == Decimal(reference)
    except InvalidOperation:
        return False


def arithmetic(seed: int, n_train: int, n_eval: int) -> Task:
    """GSM8K-style word problems (buying, sharing, ages, distances, giving; 1–2 operations).

    Prompt ``"Question: ...\\nAnswer:"``, answer ``" <reasoning with the equations> #### <int>"``.
    """
    items = _unique(_word_problem, random.Random(f"arithmetic/{seed}"), n_train + n_eval)
    train, eval_ = _split(items, n_train, n_eval)
    scorer = lambda item, generated: gsm8k_score(generated, item.answer)  # noqa: E731
    return Task("arithmetic", "generate", train, eval_, _answer_bytes(e.answer for e in eval_), scorer)
