"""Plain-English pretraining corpus for the tiny model: the Python 3.11 HTML docs and the GCIDE
dictionary (Debian: python3.11-doc, dict-gcide), cleaned to text and cached."""

from __future__ import annotations

import gzip
import os
import re
import tempfile
from collections.abc import Callable
from html.parser import HTMLParser
from pathlib import Path

from .base import DEFAULT_CACHE

PYTHON_DOCS = Path("/usr/share/doc/python3.11-doc/html")
GCIDE = Path("/usr/share/dictd/gcide.dict.dz")
_APT_HINT = "install them with: apt-get install python3.11-doc dict-gcide"
_SKIPPED_PAGES = re.compile(r"genindex.*|py-modindex|search|contents")


class _HTMLText(HTMLParser):
    """Collects the visible text of a page, one line per block element.

    Inside a Sphinx page only the ``role="main"`` element is kept (no navigation bars or sidebars);
    script, style and the ``¶`` permalinks are skipped everywhere.
    """

    BLOCKS = {
        "p",
        "div",
        "section",
        "li",
        "dt",
        "dd",
        "pre",
        "tr",
        "br",
        "table",
        "ul",
        "ol",
        "dl",
        "h1",
        "h2",
        "h3",
        "h4",
        "h5",
        "h6",
        "blockquote",
        "title",
        "figcaption",
    }
    VOID = {"br", "img", "hr", "meta", "link", "input", "wbr", "col", "area", "base", "source"}

    def __init__(self) -> None:
        super().__init__(convert_charrefs=True)
        self.all_lines: list[str] = []
        self.main_lines: list[str] = []
        self._block: list[str] = []
        self._main_depth = 0  # open elements inside the role="main" element (0: outside it)
        self._skip: str | None = None  # tag whose content is being skipped

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        attr = dict(attrs)
        if self._skip is None and (tag in ("script", "style") or "headerlink" in (attr.get("class") or "")):
            self._skip = tag
        if tag in self.BLOCKS:
            self._flush()
        if tag in self.VOID:
            return
        if self._main_depth:
            self._main_depth += 1
        elif attr.get("role") == "main":
            self._main_depth = 1

    def handle_endtag(self, tag: str) -> None:
        if tag == self._skip:
            self._skip = None
        if tag in self.BLOCKS:
            self._flush()
        if self._main_depth and tag not in self.VOID:
            self._main_depth -= 1

    def handle_data(self, data: str) -> None:
        if self._skip is None:
            self._block.append(data)

    def _flush(self) -> None:
        line = " ".join("".join(self._block).split())
        self._block = []
        if line:
            self.all_lines.append(line)
            if self._main_depth:
                self.main_lines.append(line)


def html_to_text(html: str) -> str:
    """Visible text of an HTML page, whitespace collapsed, one line per paragraph/heading/item."""
    parser = _HTMLText()
    parser.feed(html)
    parser.close()
    parser._flush()
    return "\n".join(parser.main_lines or parser.all_lines)


_GCIDE_SOURCE_TAG = re.compile(r"\[[^\]\n]*(?:Webster|WordNet|PJC)[^\]\n]*\]")
_GCIDE_ACCENT = re.compile(
    r"\[[-*=.\"`'~^,]?([A-Za-z]{1,2})[=.\"`'~^,]?\]"
    r"|\[([A-Za-z])(?:mac|um|acute|grave|circ|tilde|cedil|breve|dot|ring)\]"
)
_GCIDE_SYMBOL = re.compile(r"\[(?:eth|thorn|root|deg|sect)\]|[ \t]*\(\?(?: or \?)*\)")
_GCIDE_HEADWORD = re.compile(r"^\S[^\n]* \\[^\\\n]+\\", re.MULTILINE)


def clean_gcide(raw: str) -> str:
    """Plain text of dictd-format GCIDE: the database header dropped, pronunciations (``\\A*ban"don\\``),
    source tags (``[1913 Webster]``), symbol codes (``[root]``) and ``{braces}`` removed, accent codes
    reduced to their letter (``[a^]``, ``[imac]`` → ``a``, ``i``), each entry's wrapped lines joined
    into one line per sense; entries separated by blank lines."""
    first = _GCIDE_HEADWORD.search(raw)
    text = raw[first.start() :] if first else raw
    text = _GCIDE_SOURCE_TAG.sub("", text)
    text = re.sub(r"[ \t]*\\[^\\\n]*\\", "", text)
    # the coded pronunciation after a headword: ([.a]*b[a^]n"d[u^]n)
    text = re.sub(r"[ \t]*\((?:[^()\n]*\[[^\]\n]{1,3}\])+[^()\n]*\)", "", text)
    text = _GCIDE_ACCENT.sub(lambda m: m.group(1) or m.group(2), text)
    text = _GCIDE_SYMBOL.sub("", text).replace("{", "").replace("}", "")
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return "\n\n".join(p for p in paragraphs if p)


def _python_docs_text() -> str:
    if not PYTHON_DOCS.is_dir():
        raise FileNotFoundError(f"{PYTHON_DOCS} not found; {_APT_HINT}")
    pages = sorted(p for p in PYTHON_DOCS.rglob("*.html") if not _SKIPPED_PAGES.fullmatch(p.stem))
    texts = (html_to_text(p.read_text(encoding="utf-8", errors="replace")) for p in pages)
    return "\n\n".join(t for t in texts if t)


def _gcide_text() -> str:
    if not GCIDE.is_file():
        raise FileNotFoundError(f"{GCIDE} not found; {_APT_HINT}")
    with gzip.open(GCIDE, "rb") as f:  # dictzip is gzip with extra header fields
        return clean_gcide(f.read().decode("utf-8", errors="ignore"))


def _cached_text(path: Path, build: Callable[[], str]) -> str:
    """`build()`'s text, stored at `path` on first use (written to a temp file, then renamed)."""
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent)
        try:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(build())
            os.chmod(tmp, 0o644)  # mkstemp makes it private; the cache is meant to be shared
            os.replace(tmp, path)
        finally:
            Path(tmp).unlink(missing_ok=True)
    return path.read_text(encoding="utf-8")


def pretraining_corpus(cache: Path = DEFAULT_CACHE, max_chars: int = 20_000_000) -> str:
    """At most `max_chars` of plain English: the Python 3.11 docs, then the GCIDE dictionary.

    Each source gets half of `max_chars`; if one runs short the other fills the rest. The full
    extracted text of each source is cached under `cache` (the first extraction takes a minute).
    """
    docs = _cached_text(Path(cache) / "pretrain_python_docs.txt", _python_docs_text)
    gcide = _cached_text(Path(cache) / "pretrain_gcide.txt", _gcide_text)
    return _mix(docs, gcide, max_chars)


def _mix(first: str, second: str, max_chars: int) -> str:
    """`first` then `second`, each given half of `max_chars` unless the other is shorter."""
    head = first[: max(max_chars // 2, max_chars - len(second) - 2)]
    tail = second[: max(0, max_chars - len(head) - 2)]
    return f"{head}\n\n{tail}" if head and tail else (head or tail)[:max_chars]
