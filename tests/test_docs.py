"""The README and the documentation site (mkdocs.yml, docs/): the README stays a short front page that starts
with the two commands for a new machine, its links land on pages and headings that exist, the commands the
pages mark as quick run and print what the pages say, the API page names every public name, and the site
builds in strict mode (every link and anchor resolved, zero warnings) with its generated pages filled in.

A command block is marked quick by an HTML comment on the line before its fence, invisible once rendered:

    <!-- run: quick; expect: PHRASE[; expect: PHRASE ...] -->
    ```bash
    .venv/bin/meshtune --help
    ```

The block runs in the repository root under ``bash -e``; it must exit 0 and print every PHRASE (whitespace
collapsed, so a wrapped help text still matches)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
DOCS = ROOT / "docs"
SETUP_COMMANDS = [
    "bash scripts/setup.sh && .venv/bin/meshtune demo",
    "bash scripts/setup.sh && .venv/bin/python -m pytest -q",
]
QUICK = re.compile(r"^<!-- run: quick((?:; expect: .+?)+) -->\n```bash\n(.*?)\n```$", re.M | re.S)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")


def _pages() -> list[Path]:
    """The README and every Markdown page of the site's own (docs/_hooks aside)."""
    return [README, *sorted(p for p in DOCS.rglob("*.md") if "_hooks" not in p.parts)]


def _quick_blocks() -> list[tuple[str, str, list[str]]]:
    blocks = []
    for page in _pages():
        for expects, script in QUICK.findall(page.read_text()):
            phrases = [e.strip() for e in expects.split("; expect: ")[1:]]
            blocks.append((str(page.relative_to(ROOT)), script, phrases))
    return blocks


def test_the_readme_is_a_front_page_that_starts_with_the_two_setup_commands():
    lines = README.read_text().splitlines()
    assert len(lines) <= 200, f"README.md has {len(lines)} lines: move the rest into docs/ (a page of the site)"
    assert lines[0].startswith("# ") and lines[1] == "" and lines[2] == "```bash", lines[:3]
    end = lines.index("```", 3)
    commands = [line.split("#", 1)[0].strip() for line in lines[3:end]]
    assert commands == SETUP_COMMANDS, commands


def _slug(heading: str) -> str:
    """The anchor a heading gets: the site's toc slugify (mkdocs.yml), which is GitHub's."""
    from pymdownx.slugs import slugify

    text = re.sub(r"`([^`]*)`", r"\1", re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading))
    return slugify(case="lower")(text.replace("*", ""), "-")


def _anchors(page: Path) -> set[str]:
    fenced, found = False, set()
    for line in page.read_text().splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#{1,6} ", line):
            found.add(_slug(line.split(" ", 1)[1].strip()))
    return found


def test_the_readme_links_land_on_files_and_headings_that_exist():
    """mkdocs checks the pages' links; the README is not one of the site's pages, so its links are checked here."""
    links = LINK.findall(README.read_text())
    assert len(links) >= 20
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue
        path, _, anchor = link.partition("#")
        target = (ROOT / path) if path else README
        assert target.exists(), link
        if anchor:
            assert anchor in _anchors(target), (link, sorted(_anchors(target)))


def test_the_quick_commands_are_marked_where_a_newcomer_reads():
    pages = {page for page, _, _ in _quick_blocks()}
    assert {"README.md", "docs/guides/quickstart.md", "docs/guides/reports.md"} <= pages, pages
    # a marker with a typo would silently mark nothing: every "run: quick" comment must parse
    for page in _pages():
        text = page.read_text()
        assert text.count("<!-- run: quick") == len(QUICK.findall(text)), page


@pytest.mark.parametrize(
    "page, script, phrases", _quick_blocks(), ids=[f"{p}:{s.split()[1]}" for p, s, _ in _quick_blocks()]
)
def test_a_quick_command_of_the_docs_runs_and_prints_what_the_page_says(page, script, phrases):
    venv_bin = str(Path(sys.executable).parent)
    env = dict(os.environ, PATH=venv_bin + os.pathsep + os.environ.get("PATH", ""), COLUMNS="100")
    done = subprocess.run(["bash", "-ec", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    output = " ".join((done.stdout + done.stderr).split())
    assert done.returncode == 0, f"{page}: {script!r} exited {done.returncode}:\n{done.stderr[-3000:]}"
    for phrase in phrases:
        assert " ".join(phrase.split()) in output, f"{page}: {script!r} did not print {phrase!r}:\n{output[-3000:]}"


def test_the_api_page_documents_every_public_name_at_its_public_path():
    import hf_meshtune

    documented = re.findall(r"^::: hf_meshtune\.(\w+)$", (DOCS / "reference/api.md").read_text(), re.M)
    assert sorted(documented) == sorted(hf_meshtune.__all__), set(documented) ^ set(hf_meshtune.__all__)


def test_the_site_builds_in_strict_mode_with_its_generated_pages(tmp_path):
    """What .ci/run builds: any warning (a broken link or anchor, a missing API name, a knob without help)
    fails; the knob table and the API page come out whole."""
    import dataclasses

    import hf_meshtune

    mkdocs = Path(sys.executable).parent / "mkdocs"
    site = tmp_path / "site"
    done = subprocess.run(
        [str(mkdocs), "build", "--strict", "--site-dir", str(site)],
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    assert "WARNING" not in done.stderr, done.stderr[-5000:]
    knobs = (site / "reference/knobs/index.html").read_text()
    for field in dataclasses.fields(hf_meshtune.MeshConfig):
        assert f"<code>--{field.name}</code>" in knobs, field.name
    api = (site / "reference/api/index.html").read_text()
    for name in hf_meshtune.__all__:
        assert f'id="hf_meshtune.{name}"' in api, name
    # the committed results are pages of the site, linked from the benchmark pages
    assert (site / "benchmarks/wan/results/wan/index.html").exists()
    assert (site / "benchmarks/wan/results/wan_time_to_quality.png").exists()
