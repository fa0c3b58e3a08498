"""Every row of docs/bad_input.md, triggered: the exception type and the exact message (tests/bad_input_cases.py).

Why the table is tested and not only written: a reworded rule, a check moved after a rendezvous or a
bad input that stops being refused changes the error users get; here it fails a test instead of
silently leaving the docs wrong.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from accelerate.state import AcceleratorState, GradientState

from tests.bad_input_cases import CASES, GROUP_NOTES, GROUPS, Case, render

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "bad_input.md"

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.fixture(autouse=True)
def clean_process_state(monkeypatch: pytest.MonkeyPatch):
    """Rows build accelerators and trainers; accelerate keeps process-wide singletons between them. The
    variables a launcher or a user sets (WORLD_SIZE, MESHTUNE_*) are cleared: rows set their own."""
    for name in [name for name in os.environ if name.startswith("MESHTUNE_")] + ["WORLD_SIZE"]:
        monkeypatch.delenv(name, raising=False)
    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _case_id(case: Case) -> str:
    return f"{GROUPS.index(case.group):02d}-{case.input}"


@pytest.mark.parametrize("case", CASES, ids=[_case_id(case) for case in CASES])
def test_bad_input_gets_the_documented_error(case: Case, tmp_path: Path) -> None:
    tmp = tmp_path if case.wants_tmp else None
    with pytest.raises(BaseException) as caught:
        case.run(tmp)
    assert type(caught.value) is case.error, f"{type(caught.value).__name__}: {caught.value}"
    message, expected = str(caught.value), case.expected(tmp)
    if case.prefix:
        assert message.startswith(expected), message
    else:
        assert message == expected


def test_every_group_has_a_note_and_every_row_is_unique() -> None:
    assert set(GROUPS) == set(GROUP_NOTES)
    keys = [(case.group, case.input, case.where) for case in CASES]
    assert len(keys) == len(set(keys))


def test_the_doc_is_what_the_generator_writes() -> None:
    """Regenerate with ``python -m tests.bad_input_cases > docs/bad_input.md``."""
    assert DOC.read_text(encoding="utf-8") == render()


def test_the_generator_runs_as_a_module() -> None:
    """The command the doc names writes the same text (no test-only state leaks into it)."""
    out = subprocess.run(
        [sys.executable, "-m", "tests.bad_input_cases"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        check=True,
        timeout=120,
    ).stdout
    assert out == render()
