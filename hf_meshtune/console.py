"""What ``meshtune launch`` shows on its terminal: one training run, not X·Y interleaved logs.

- **The rank with the loss** (replica 0's last stage, ``r0s<Y-1>``) is shown whole: its step lines
  (``{"mesh": ..., "step": N, "loss": ..., ...}``, one per logging step, as a Trainer prints its log
  dicts) and the end-of-run summary table it prints.
- **One progress bar** over the optimizer steps, fed by those step lines: step/total, ETA (tqdm's, from
  the steps' rate), loss, the fast circuit's tokens/s and the loss rank's bytes on the wire per token.
- **Process 0's standard output** (``r0s0``, the Trainer's world process zero, where a script's
  ``if trainer.is_world_process_zero(): print(...)`` and ``trainer.log_metrics`` print) is shown too; its
  standard error (progress bars, library logs) is quiet like the other ranks'.
- **Every other rank is quiet** unless a line of its output warns or fails (``LOUD``), and then each
  distinct line once (six ranks' identical deprecation warning is one warning); when a rank exits
  non-zero, the last lines it wrote that were not shown follow, so a crash is never silent. Every line of
  every rank still goes to ``<log dir>/rank<N>.log`` (``--all-ranks`` shows everything, as before).
"""

from __future__ import annotations

import collections
import json
import re
import sys
import threading
from collections.abc import Sequence
from typing import IO

from tqdm import tqdm

__all__ = ["CONSOLE_ENV", "LOUD", "TAIL_LINES", "Console", "StepProgress"]

CONSOLE_ENV = "MESHTUNE_CONSOLE"
"""Set to ``launcher`` in every child of ``meshtune launch`` (``launch.child_env``): the launcher draws the
progress bar, so the loss rank's Trainer callbacks must not draw one into a pipe (``runtime.console``)."""

LOUD = re.compile(r"warn|error|exception|traceback|fatal|critical|abort", re.IGNORECASE)
"""A line of a quiet rank that matches this reaches the terminal (Python warnings and tracebacks, torchft's
``[WARN]``/``[ERROR]`` lines, transformers' and torch's warnings)."""

TAIL_LINES = 40
"""Lines of a failed quiet rank's unshown output printed after its failure."""

MAX_REMEMBERED = 10_000
"""Distinct loud lines remembered to show each only once, whichever quiet rank says it again."""


def _si(value: float) -> str:
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g}{unit}"
    return f"{value:.3g}"


class StepProgress:
    """A progress bar over the mesh's optimizer steps, fed by the step lines the loss-computing rank
    (replica 0's last stage) prints, ``{"mesh": ..., "step": N, ...}``. It shows on a terminal only
    (tqdm's ``disable=None``); the total is the command's ``--max_steps`` when it has one."""

    _STEP = re.compile(r'^\{"mesh": "[^"]*", "step": (\d+)')

    def __init__(
        self, command: Sequence[str], tag: str, file: IO[str] | None = None, disable: bool | None = None
    ) -> None:
        self.tag = tag
        total = None
        for flag, value in zip(command, command[1:]):
            if flag == "--max_steps" and value.isdigit():
                total = int(value)
        self.bar = tqdm(
            total=total, desc="mesh steps", unit="step", file=file or sys.stderr, disable=disable, leave=True
        )

    def feed(self, tag: str, text: str) -> None:
        """Move the bar to step N when ``text`` is the loss rank's step line; show its loss, tokens/s and
        bytes per token beside the bar."""
        match = self._STEP.match(text) if tag == self.tag else None
        if not match or int(match[1]) <= self.bar.n:
            return
        try:
            entry = json.loads(text)
        except ValueError:
            entry = {}
        shown = {}
        if isinstance(entry.get("loss"), (int, float)):
            shown["loss"] = f"{entry['loss']:.4g}"
        if isinstance(entry.get("mesh_tokens_per_s"), (int, float)):
            shown["tok/s"] = _si(entry["mesh_tokens_per_s"])
        if isinstance(entry.get("comm/rank_bytes_per_token"), (int, float)):
            shown["wire B/tok"] = _si(entry["comm/rank_bytes_per_token"])
        if shown:
            self.bar.set_postfix(shown, refresh=False)
        self.bar.update(int(match[1]) - self.bar.n)

    def close(self) -> None:
        self.bar.close()


class Console:
    """Decides, line by line, which child output reaches the launcher's terminal (module docstring)."""

    def __init__(
        self, loss_tag: str, progress: StepProgress | None = None, all_ranks: bool = False, main_tag: str = "r0s0"
    ) -> None:
        self.loss_tag, self.progress, self.all_ranks, self.main_tag = loss_tag, progress, all_ranks, main_tag
        self._unshown: dict[str, collections.deque[tuple[str, bool]]] = {}
        self._said: set[str] = set()  # loud lines of quiet ranks already shown
        self._lock = threading.Lock()

    def shows(self, tag: str, text: str, is_err: bool) -> bool:
        """Whether this line of rank ``tag`` goes to the terminal; lines that do not are kept for its tail."""
        if self.progress is not None:
            self.progress.feed(tag, text)
        if self.all_ranks or tag == self.loss_tag or (tag == self.main_tag and not is_err):
            return True
        with self._lock:
            if LOUD.search(text) and text not in self._said:  # the same warning from six ranks: said once
                if len(self._said) < MAX_REMEMBERED:
                    self._said.add(text)
                return True
            self._unshown.setdefault(tag, collections.deque(maxlen=TAIL_LINES)).append((text, is_err))
        return False

    def tail(self, tag: str) -> list[str]:
        """The last unshown lines of rank ``tag`` (at most ``TAIL_LINES``), emptied: what to print when it fails."""
        with self._lock:
            lines = self._unshown.pop(tag, ())
        return [text for text, _ in lines]

    def write(self, line: str, is_err: bool) -> None:
        """Write one line above the progress bar."""
        out = sys.stderr if is_err else sys.stdout
        try:
            with tqdm.external_write_mode(file=out):  # lift the progress bar while the line goes by
                out.write(line)
                out.flush()
        except (OSError, ValueError):  # closed or unencodable terminal: keep draining the pipe
            pass

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
