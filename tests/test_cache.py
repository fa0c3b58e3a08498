"""First-use cache fills (``hf_meshtune.apps.cache.filled_once``): once under concurrency, never read
half-written, redone after an interruption, and a clear error for a cache folder that cannot be written.
The real 3×2 mesh on an empty cache is ``tests/test_cpt_recipe.py::test_cpt_recipe_runs_on_a_launched_3x2_mesh``."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import pytest

from hf_meshtune.apps.cache import filled_once

REQUIRED = ("config.json", "weights.bin")


def _slow_fill(folder: Path) -> None:
    """Writes one file, waits, writes the other, and books its pid: a reader in between would see half."""
    with open(folder.parent / "fills.log", "a") as log:
        log.write(f"{os.getpid()}\n")
    (folder / "config.json").write_text("{}")
    time.sleep(1.0)
    (folder / "weights.bin").write_bytes(b"w" * 1000)


def _ask(target: str, results) -> None:
    path = filled_once(Path(target), _slow_fill, REQUIRED)
    results.put(sorted(os.listdir(path)) + [str((path / "weights.bin").stat().st_size)])


def test_concurrent_first_uses_fill_once_and_all_see_the_whole_folder(tmp_path):
    target = tmp_path / "cache" / "model"
    ctx = multiprocessing.get_context("fork")
    results = ctx.Queue()
    procs = [ctx.Process(target=_ask, args=(str(target), results)) for _ in range(4)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(timeout=60)
        assert proc.exitcode == 0
    seen = [results.get(timeout=5) for _ in procs]
    assert seen == [["config.json", "weights.bin", "1000"]] * 4  # every process: the complete folder
    assert len((tmp_path / "cache" / "fills.log").read_text().split()) == 1  # filled by one of them
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["fills.log", "model", "model.lock"]


def _fill_then_die(folder: Path) -> None:
    (folder / "config.json").write_text("{}")
    os.kill(os.getpid(), signal.SIGKILL)  # the conversion is interrupted halfway, lock held


def test_an_interrupted_fill_is_redone_and_never_read(tmp_path):
    target = tmp_path / "model"
    ctx = multiprocessing.get_context("fork")
    proc = ctx.Process(target=filled_once, args=(target, _fill_then_die, REQUIRED))
    proc.start()
    proc.join(timeout=60)
    assert proc.exitcode == -signal.SIGKILL
    assert not target.exists() and len(list(tmp_path.glob("model.tmp-*"))) == 1  # only its temporary folder
    path = filled_once(target, _slow_fill, REQUIRED)  # the dead process's lock is free again
    assert sorted(os.listdir(path)) == ["config.json", "weights.bin"]
    assert not list(tmp_path.glob("model.tmp-*"))


def test_a_fill_that_raises_leaves_nothing_behind(tmp_path):
    def broken(folder: Path) -> None:
        (folder / "config.json").write_text("{}")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        filled_once(tmp_path / "model", broken, REQUIRED)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.lock"]


def test_an_incomplete_folder_in_place_is_replaced_and_a_complete_one_kept(tmp_path):
    target = tmp_path / "model"
    target.mkdir()
    (target / "config.json").write_text("{}")  # left by hand or by an older version: no weights
    filled_once(target, _slow_fill, REQUIRED)
    assert (target / "weights.bin").stat().st_size == 1000
    mtime = (target / "weights.bin").stat().st_mtime_ns
    filled_once(target, lambda folder: pytest.fail("a complete folder is filled again"), REQUIRED)
    assert (target / "weights.bin").stat().st_mtime_ns == mtime


def test_a_fill_that_writes_too_little_is_refused(tmp_path):
    def partial(folder: Path) -> None:
        (folder / "config.json").write_text("{}")

    with pytest.raises(ValueError, match=r"fill='partial' is invalid: it must write config.json, weights.bin"):
        filled_once(tmp_path / "model", partial, REQUIRED)
    assert not (tmp_path / "model").exists()


def test_a_cache_folder_that_cannot_be_written_names_the_variable(tmp_path, monkeypatch):
    from hf_meshtune.apps.assets import smollm2_checkpoint

    (tmp_path / "file").write_text("not a folder")
    monkeypatch.setenv("HF_MESHTUNE_CACHE", str(tmp_path / "file" / "cache"))
    with pytest.raises(ValueError, match=r"HF_MESHTUNE_CACHE='.*/file/cache' is invalid: it must be a folder this"):
        smollm2_checkpoint()
