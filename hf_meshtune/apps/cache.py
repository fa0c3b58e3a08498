"""First-use cache fills that many processes may ask for at once, done once and never seen half-written.

Every process of a mesh started on a fresh machine asks for the embedded model at the same moment. The
first to take the fill's file lock fills a temporary folder beside the target and renames it into place
whole; the others wait on the lock and then find the finished folder. A fill that died halfway leaves
only its temporary folder (and a free lock: the kernel drops a dead process's ``flock``), which the next
fill removes before it starts again, so no process ever reads a partial folder.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

from filelock import FileLock

from .._validation import require

__all__ = ["CACHE_ENV", "cache_dir", "filled_once"]

CACHE_ENV = "HF_MESHTUNE_CACHE"


def cache_dir() -> Path:
    """``$HF_MESHTUNE_CACHE`` or, when unset or empty, ``~/.cache/hf_meshtune``: converted checkpoints live
    here, never in git (an empty value once meant the working directory)."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "hf_meshtune")


def _complete(target: Path, required: Sequence[str]) -> bool:
    return all((target / name).is_file() for name in required)


def _writable_parent(target: Path) -> None:
    """Create ``target``'s parent, or say which cache folder cannot be written and why."""
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        probe = target.parent / f".write-test-{os.getpid()}"
        probe.touch()
        probe.unlink()
    except OSError as error:
        require(
            False,
            CACHE_ENV,
            str(target.parent),
            f"be a folder this process can create and write (the first use fills {target.name} there; "
            f"{type(error).__name__}: {error.strerror or error})",
        )


def filled_once(target: Path, fill: Callable[[Path], None], required: Sequence[str]) -> Path:
    """``target``, filled by ``fill(folder)`` the first time any process asks for it.

    ``required``: the files whose presence says the folder is complete. ``fill`` writes into the empty
    temporary ``folder`` it is given; the folder is renamed to ``target`` only after ``fill`` returns, under
    a lock (``target`` + ``.lock``) that every other asking process waits on. A folder at ``target`` that
    lacks a required file (left by an older version or by hand) is replaced, and temporary folders of
    fills that died are removed first.
    """
    if _complete(target, required):
        return target
    _writable_parent(target)
    with FileLock(f"{target}.lock"):
        if _complete(target, required):  # another process filled it while this one waited
            return target
        for stale in target.parent.glob(f"{target.name}.tmp-*"):
            shutil.rmtree(stale, ignore_errors=True)  # a fill that died holding the lock, now released
        folder = target.with_name(f"{target.name}.tmp-{os.getpid()}")
        folder.mkdir()
        try:
            fill(folder)
            require(
                _complete(folder, required),
                "fill",
                getattr(fill, "__name__", repr(fill)),
                f"write {', '.join(required)} into the folder it is given",
            )
            shutil.rmtree(target, ignore_errors=True)  # an incomplete folder: replaced whole
            os.replace(folder, target)
        finally:
            shutil.rmtree(folder, ignore_errors=True)
    return target
