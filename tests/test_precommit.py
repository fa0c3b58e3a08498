"""The pre-commit hooks (.pre-commit-config.yaml) run exactly the lint and type check that .ci/run runs."""

from __future__ import annotations

from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]


def _hooks() -> list[dict]:
    config = yaml.safe_load((ROOT / ".pre-commit-config.yaml").read_text())
    assert all(repo["repo"] == "local" for repo in config["repos"]), "hooks use .venv's tools, fetched from nowhere"
    return [hook for repo in config["repos"] for hook in repo["hooks"]]


def test_every_hook_is_a_check_ci_runs_and_every_check_has_a_hook():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text().splitlines()]
    checks = [line for line in ci if line.startswith((".venv/bin/ruff ", ".venv/bin/mypy "))]
    assert sorted(hook["entry"] for hook in _hooks()) == sorted(checks)


def test_hooks_run_the_installed_tools_on_the_whole_tree():
    for hook in _hooks():
        assert hook["language"] == "system", hook["id"]
        assert hook["entry"].startswith(".venv/bin/"), hook["id"]
        assert hook["pass_filenames"] is False, f"{hook['id']} checks what CI checks, not only the staged files"
