"""Text to SQL, Spider-style: questions about one fixed SQLite database of employees and
departments, scored by execution accuracy (`execution_match`) on a read-only in-memory copy."""

from __future__ import annotations

import itertools
import random
import re
import sqlite3
import time
from collections import Counter
from collections.abc import Sequence
from functools import cache

from .base import Example, Task, _answer_bytes, _split

_DEPARTMENTS = ("Engineering", "Sales", "Marketing", "Finance", "Support", "Research")
_CITIES = ("Paris", "London", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Dublin")
_FIRST = (
    "Alice",
    "Bruno",
    "Carla",
    "David",
    "Elena",
    "Farid",
    "Grace",
    "Hugo",
    "Irene",
    "Jonas",
    "Karin",
    "Leo",
    "Mona",
    "Nils",
    "Olga",
    "Peter",
    "Quinn",
    "Rosa",
    "Simon",
    "Tara",
)
_LAST = ("Moreau", "Smith", "Keller", "Garcia", "Rossi", "Novak", "Berg", "Walsh", "Costa", "Klein")
SQL_TIMEOUT_S = 1.0
_SQL_MAX_ROWS = 10_000


@cache
def _database_rows() -> tuple[tuple[tuple, ...], tuple[tuple, ...]]:
    """(departments, employees) rows of the fixed database; salaries all distinct, so ``ORDER BY
    salary`` never has ties to break."""
    rng = random.Random("text_to_sql/database")
    names = rng.sample([f"{f} {last}" for f in _FIRST for last in _LAST], 60)
    salaries = rng.sample(range(40_000, 150_001, 500), 60)
    budgets = rng.sample(range(200_000, 2_000_001, 50_000), len(_DEPARTMENTS))
    departments = tuple(zip(_DEPARTMENTS, budgets, (1, 2, 2, 3, 4, 4)))
    employees = tuple(
        (i, name, rng.choice(_DEPARTMENTS), salary, rng.randint(22, 64), rng.choice(_CITIES))
        for i, (name, salary) in enumerate(zip(names, salaries), start=1)
    )
    return departments, employees


@cache
def sql_database_script() -> str:
    """The SQL script that builds the fixed database: ``departments(name, budget, floor)`` with 6
    rows and ``employees(id, name, department, salary, age, city)`` with 60 rows in 8 cities."""
    departments, employees = _database_rows()
    lines = [
        "CREATE TABLE departments (name TEXT PRIMARY KEY, budget INTEGER, floor INTEGER);",
        "CREATE TABLE employees (id INTEGER PRIMARY KEY, name TEXT, department TEXT, salary INTEGER,"
        " age INTEGER, city TEXT);",
    ]
    lines += [f"INSERT INTO departments VALUES ({_sql_values(row)});" for row in departments]
    lines += [f"INSERT INTO employees VALUES ({_sql_values(row)});" for row in employees]
    return "\n".join(lines)


def _sql_values(row: tuple) -> str:
    return ", ".join(f"'{v}'" if isinstance(v, str) else str(v) for v in row)


def _read_only_database() -> sqlite3.Connection:
    """A fresh in-memory copy of the database that refuses to change and stops slow queries.

    Three locks: ``PRAGMA query_only``, an authorizer that allows only reads (no PRAGMA, ATTACH,
    or writes), and a progress handler that aborts a query after `SQL_TIMEOUT_S`. Each score gets
    its own copy, so even a query that slipped past them could not affect the next one.
    """
    conn = sqlite3.connect(":memory:")
    conn.executescript(sql_database_script())
    conn.execute("PRAGMA query_only = ON")
    allowed = {
        sqlite3.SQLITE_SELECT,
        sqlite3.SQLITE_READ,
        sqlite3.SQLITE_FUNCTION,
        getattr(sqlite3, "SQLITE_RECURSIVE", sqlite3.SQLITE_SELECT),
    }
    conn.set_authorizer(lambda action, *_: sqlite3.SQLITE_OK if action in allowed else sqlite3.SQLITE_DENY)
    return conn


def _run_query(conn: sqlite3.Connection, sql: str) -> list[tuple]:
    deadline = time.monotonic() + SQL_TIMEOUT_S
    conn.set_progress_handler(lambda: time.monotonic() > deadline, 1000)
    rows = conn.execute(sql).fetchmany(_SQL_MAX_ROWS + 1)
    if len(rows) > _SQL_MAX_ROWS:
        raise ValueError(f"query returned more than {_SQL_MAX_ROWS} rows")
    return [tuple(round(v, 6) if isinstance(v, float) else v for v in row) for row in rows]


def execution_match(predicted_sql: str, gold_sql: str) -> bool:
    """Spider execution accuracy: both queries run on a fresh read-only copy of the database and
    return the same rows — as multisets, or in order when `gold_sql` has ORDER BY. Any error or
    timeout in the predicted query counts as wrong."""
    conn = _read_only_database()
    try:
        gold = _run_query(conn, gold_sql)
        try:
            predicted = _run_query(conn, predicted_sql)
        except Exception:  # noqa: BLE001  (a broken prediction is simply wrong)
            return False
    finally:
        conn.close()
    if re.search(r"\border\s+by\b", gold_sql, re.IGNORECASE):
        return predicted == gold
    return Counter(predicted) == Counter(gold)


_AGES = tuple(range(24, 62, 3))
_SALARY_LEVELS = tuple(range(50_000, 140_001, 2_500))
_NAMES = tuple(row[1] for row in _database_rows()[1])
# (phrasings, gold SQL, slot values); every combination of slot values is one query.
_SQL_TEMPLATES: tuple[tuple[tuple[str, ...], str, dict[str, Sequence]], ...] = (
    (
        ("What are the names of the employees in the {dept} department?", "Who works in {dept}?"),
        "SELECT name FROM employees WHERE department = '{dept}'",
        {"dept": _DEPARTMENTS},
    ),
    (
        ("How many employees work in {city}?", "Count the employees who live in {city}."),
        "SELECT COUNT(*) FROM employees WHERE city = '{city}'",
        {"city": _CITIES},
    ),
    (
        ("What is the average salary in the {dept} department?", "Average salary of {dept} employees?"),
        "SELECT AVG(salary) FROM employees WHERE department = '{dept}'",
        {"dept": _DEPARTMENTS},
    ),
    (
        ("What is the highest salary of employees older than {age}?", "Maximum salary among employees over {age}?"),
        "SELECT MAX(salary) FROM employees WHERE age > {age}",
        {"age": _AGES},
    ),
    (
        ("How old is the youngest employee in {city}?", "What is the minimum age of employees in {city}?"),
        "SELECT MIN(age) FROM employees WHERE city = '{city}'",
        {"city": _CITIES},
    ),
    (
        ("List the names of the {k} highest paid employees.", "Who are the top {k} earners?"),
        "SELECT name FROM employees ORDER BY salary DESC LIMIT {k}",
        {"k": range(1, 6)},
    ),
    (
        ("Which employees earn more than {salary}?", "Names of employees with a salary above {salary}?"),
        "SELECT name FROM employees WHERE salary > {salary}",
        {"salary": _SALARY_LEVELS},
    ),
    (
        ("Which employees work in a department on floor {floor}?", "Who works on floor {floor}?"),
        "SELECT e.name FROM employees AS e JOIN departments AS d ON e.department = d.name WHERE d.floor = {floor}",
        {"floor": range(1, 5)},
    ),
    (
        ("How many employees older than {age} live in each city?", "For each city, count the employees over {age}."),
        "SELECT city, COUNT(*) FROM employees WHERE age > {age} GROUP BY city",
        {"age": _AGES},
    ),
    (
        (
            "What is the highest salary in each department among employees in {city}?",
            "For each department, the maximum salary of employees in {city}?",
        ),
        "SELECT department, MAX(salary) FROM employees WHERE city = '{city}' GROUP BY department",
        {"city": _CITIES},
    ),
    (
        ("How many employees of the {dept} department live in {city}?", "Count {dept} employees in {city}."),
        "SELECT COUNT(*) FROM employees WHERE department = '{dept}' AND city = '{city}'",
        {"dept": _DEPARTMENTS, "city": _CITIES},
    ),
    (
        ("Which employees in {city} are older than {age}?", "Names of employees from {city} over {age}?"),
        "SELECT name FROM employees WHERE city = '{city}' AND age > {age}",
        {"city": _CITIES, "age": _AGES},
    ),
    (
        (
            "List the employees of the {dept} department from highest to lowest salary.",
            "Order the {dept} employees by salary, highest first.",
        ),
        "SELECT name FROM employees WHERE department = '{dept}' ORDER BY salary DESC",
        {"dept": _DEPARTMENTS},
    ),
    (
        ("How many employees earn less than {salary}?", "Count the employees with a salary below {salary}."),
        "SELECT COUNT(*) FROM employees WHERE salary < {salary}",
        {"salary": _SALARY_LEVELS},
    ),
    (
        (
            "What is the average age of {dept} employees in {city}?",
            "Average age of the employees of the {dept} department who live in {city}?",
        ),
        "SELECT AVG(age) FROM employees WHERE department = '{dept}' AND city = '{city}'",
        {"dept": _DEPARTMENTS, "city": _CITIES},
    ),
    (
        ("How old is {name}?", "What is the age of {name}?"),
        "SELECT age FROM employees WHERE name = '{name}'",
        {"name": _NAMES},
    ),
    (
        ("What is the budget of the department {name} works in?", "Budget of {name}'s department?"),
        "SELECT d.budget FROM employees AS e JOIN departments AS d ON e.department = d.name WHERE e.name = '{name}'",
        {"name": _NAMES},
    ),
    (
        (
            "Which employees in {city} earn more than {salary}?",
            "Names of {city} employees with a salary above {salary}?",
        ),
        "SELECT name FROM employees WHERE city = '{city}' AND salary > {salary}",
        {"city": _CITIES, "salary": _SALARY_LEVELS},
    ),
    (
        (
            "Which {dept} employees earn less than {salary}?",
            "Names of employees in the {dept} department with a salary below {salary}?",
        ),
        "SELECT name FROM employees WHERE department = '{dept}' AND salary < {salary}",
        {"dept": _DEPARTMENTS, "salary": _SALARY_LEVELS},
    ),
    (
        (
            "How many employees in {city} earn more than {salary}?",
            "Count {city} employees with a salary above {salary}.",
        ),
        "SELECT COUNT(*) FROM employees WHERE city = '{city}' AND salary > {salary}",
        {"city": _CITIES, "salary": _SALARY_LEVELS},
    ),
    (
        ("How many {dept} employees are older than {age}?", "Count the employees of the {dept} department over {age}."),
        "SELECT COUNT(*) FROM employees WHERE department = '{dept}' AND age > {age}",
        {"dept": _DEPARTMENTS, "age": _AGES},
    ),
    (
        (
            "What is the average salary of employees in {city} older than {age}?",
            "Average salary of {city} employees over {age}?",
        ),
        "SELECT AVG(salary) FROM employees WHERE city = '{city}' AND age > {age}",
        {"city": _CITIES, "age": _AGES},
    ),
    (
        (
            "How many employees on floor {floor} live in {city}?",
            "Count the employees in {city} who work on floor {floor}.",
        ),
        "SELECT COUNT(*) FROM employees AS e JOIN departments AS d ON e.department = d.name"
        " WHERE d.floor = {floor} AND e.city = '{city}'",
        {"floor": range(1, 5), "city": _CITIES},
    ),
    (
        (
            "What is the average salary in each department for employees older than {age}?",
            "For each department, the average salary of employees over {age}?",
        ),
        "SELECT department, AVG(salary) FROM employees WHERE age > {age} GROUP BY department",
        {"age": _AGES},
    ),
)


def _sql_queries() -> list[list[tuple[tuple[str, ...], str]]]:
    """Per template, every (phrasings, gold SQL) whose result holds a value other than NULL or 0 (an
    empty answer would also be matched by many wrong queries)."""
    conn = _read_only_database()
    groups = []
    for phrasings, sql, slots in _SQL_TEMPLATES:
        group = []
        for values in itertools.product(*slots.values()):
            bound = dict(zip(slots, values))
            gold = sql.format(**bound)
            if any(v not in (None, 0) for row in _run_query(conn, gold) for v in row):
                group.append((tuple(p.format(**bound) for p in phrasings), gold))
        groups.append(group)
    conn.close()
    return groups


def _stratified_split(groups: list[list], n_eval: int, rng: random.Random) -> tuple[list, list]:
    """(eval, rest) of shuffled groups, both in round-robin order (one item per group in turn), so
    any prefix of either mixes the groups evenly. Eval takes at most half of each group, so every
    group keeps items for train."""
    for group in groups:
        rng.shuffle(group)
    cap = sum(len(group) // 2 for group in groups)
    if n_eval > cap:
        raise ValueError(f"n_eval={n_eval} must be <= {cap} (half of each template's queries)")
    halves = [group[: len(group) // 2] for group in groups]
    eval_ = _round_robin(halves)[:n_eval]
    taken = {id(item) for item in eval_}
    rest = _round_robin([[item for item in group if id(item) not in taken] for group in groups])
    return eval_, rest


def _round_robin(groups: list[list]) -> list:
    return [item for layer in itertools.zip_longest(*groups) for item in layer if item is not None]


def text_to_sql(seed: int, n_train: int, n_eval: int) -> Task:
    """Questions about one fixed employees/departments database → gold SQL (24 templates: WHERE,
    COUNT, AVG/MAX/MIN, ORDER BY LIMIT, JOIN, GROUP BY; ~1400 queries, two phrasings each).

    Prompt ``"Question: ...\\nSQL:"`` (the schema is never shown), answer ``" SELECT ..."``. Train
    and eval are split by query, not by phrasing, so no eval query is seen in any wording. Eval
    draws evenly across templates (see `_stratified_split`), one phrasing per query. Train is drawn
    the same way from every remaining query in one phrasing, then again in the other (so up to
    ~1200 train items are distinct queries, past that paraphrases of them), then shuffled.
    """
    rng = random.Random(f"text_to_sql/{seed}")
    eval_queries, rest = _stratified_split(_sql_queries(), n_eval, rng)
    wordings = [(rng.sample(phrasings, len(phrasings)), sql) for phrasings, sql in rest]
    most = max((len(ph) for ph, _ in wordings), default=0)
    train_pairs = [(ph[k], sql) for k in range(most) for ph, sql in wordings if k < len(ph)]
    if n_train > len(train_pairs):
        raise ValueError(f"n_train={n_train} must be <= {len(train_pairs)} (queries left after eval × phrasings)")
    pairs = [(rng.choice(phrasings), sql) for phrasings, sql in eval_queries] + train_pairs[:n_train]
    items = [Example(f"Question: {question}\nSQL:", f" {sql}") for question, sql in pairs]
    train, eval_ = _split(items, n_train, n_eval)
    rng.shuffle(train)
    scorer = lambda item, generated: execution_match(generated, item.answer)  # noqa: E731
    return Task("text_to_sql", "sql", train, eval_, _answer_bytes(e.answer for e in eval_), scorer)
