"""The launcher's child processes: start them, forward their output line by line, stop whole groups.

``meshtune launch`` (``launch.py``) decides what runs where; this module runs it: every rank is its
own process group (so a rank's own children go when it goes), its stdout/stderr are forwarded with a
``[replica r stage s]`` prefix (and to ``rank<r>.log``), exits are queued in the order they happen,
and ``stop`` is SIGTERM, a grace period, then SIGKILL of whatever is left.
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from .console import Console

__all__: list[str] = []  # the launcher's internals (launch.py)


@dataclass
class _Child:
    rank: int
    tag: str
    proc: subprocess.Popen
    log: IO[str] | None
    readers: list[threading.Thread] = field(default_factory=list)
    retired: bool = False  # stopped on purpose (its replica restarts): its exit is not a failure


class _Mesh:
    """X·Y child processes, their output forwarding, and the one way to stop them all."""

    def __init__(self, grace_s: float, console: Console) -> None:
        self.children: list[_Child] = []
        self.grace_s, self.console = grace_s, console
        self.exits: queue.Queue[tuple[_Child, int]] = queue.Queue()  # (child, exit code) in exit order
        self._lock = threading.Lock()  # one line at a time on the launcher's stdout/stderr/log files

    def start(
        self, rank: int, tag: str, argv: list[str], env: dict[str, str], log_dir: str | None, append: bool = False
    ) -> None:
        log = (
            open(os.path.join(log_dir, f"rank{rank}.log"), "a" if append else "w", encoding="utf-8")
            if log_dir
            else None
        )
        proc = subprocess.Popen(
            argv,
            env=env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        child = _Child(rank, tag, proc, log)
        self.children.append(child)
        for pipe, is_err in ((proc.stdout, False), (proc.stderr, True)):
            reader = threading.Thread(target=self._forward, args=(child, pipe, is_err), daemon=True)
            reader.start()
            child.readers.append(reader)
        # One waiter per child: the queue then holds exits in the order they happened, so the rank
        # that failed first is not confused with the ones that crashed because of it.
        threading.Thread(target=self._await_exit, args=(child,), daemon=True).start()

    def _await_exit(self, child: _Child) -> None:
        code = child.proc.wait()
        self.exits.put((child, 128 - code if code < 0 else code))  # killed by signal s → 128 + s

    def _forward(self, child: _Child, pipe: IO[bytes], is_err: bool) -> None:
        prefix = f"[{child.tag}] "
        for raw in iter(pipe.readline, b""):
            text = raw.decode("utf-8", errors="replace").rstrip("\r\n")
            line = prefix + text + "\n"
            with self._lock:
                if self.console.shows(child.tag, text, is_err):
                    self.console.write(line, is_err)
                if child.log is not None:
                    child.log.write(line)
                    child.log.flush()
        pipe.close()

    def show_tail(self, child: _Child) -> None:
        """After ``child`` failed: its last lines that the console kept off the terminal (its readers drained
        first, so the lines just before the exit are there)."""
        for reader in child.readers:
            reader.join(timeout=2.0)
        lines = self.console.tail(child.tag)
        if lines:
            with self._lock:
                self.console.write(f"[{child.tag}] ... its last {len(lines)} line(s) not shown above:\n", True)
                for text in lines:
                    self.console.write(f"[{child.tag}] {text}\n", True)

    def stop(self, children: Sequence[_Child] | None = None) -> None:
        """SIGTERM the process groups of ``children`` (default: all), SIGKILL whatever is left after
        ``grace_s``, reap, close their logs."""
        children = list(self.children if children is None else children)
        self._signal_groups(signal.SIGTERM, children)
        deadline = time.monotonic() + self.grace_s
        while time.monotonic() < deadline and self._any_group_alive(children):
            time.sleep(0.05)
        self._signal_groups(signal.SIGKILL, children)
        for child in children:
            child.proc.wait()
        self.close(children)

    def close(self, children: Sequence[_Child] | None = None) -> None:
        """Let the readers drain what the children wrote, then close the log files."""
        for child in self.children if children is None else children:
            for reader in child.readers:
                reader.join(timeout=2.0)  # a grandchild that escaped its group may hold the pipe
            if child.log is not None and not child.log.closed:
                child.log.close()

    @staticmethod
    def _signal_groups(sig: signal.Signals, children: Sequence[_Child]) -> None:
        for child in children:
            try:
                os.killpg(child.proc.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass  # the whole group is gone already

    @staticmethod
    def _any_group_alive(children: Sequence[_Child]) -> bool:
        for child in children:
            child.proc.poll()  # reap the leaders, so their zombies do not count
        return bool(_live_groups({child.proc.pid for child in children}))


def _live_groups(pgids: set[int]) -> set[int]:
    """The process groups in ``pgids`` that still have a running (non-zombie) member.

    Orphaned grandchildren that have died stay zombies until init reaps them, which some
    containers' init does late or never; ``killpg(pgid, 0)`` counts them, /proc does not.
    """
    if not os.path.isdir("/proc/self"):  # not Linux: zombies count, the grace may run out in full
        return {pgid for pgid in pgids if _signal_ok(pgid)}
    live = set()
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()  # after "pid (comm)": state ppid pgrp ...
        except (OSError, IndexError):
            continue  # not a process, or it vanished meanwhile
        if fields[0] != b"Z" and int(fields[2]) in pgids:
            live.add(int(fields[2]))
    return live


def _signal_ok(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _SignalTrap:
    """Record SIGINT/SIGTERM instead of dying, so the launcher can stop the mesh first."""

    def __init__(self) -> None:
        self.signum: int | None = None
        self._previous: dict[int, Any] = {}

    def __enter__(self) -> _SignalTrap:
        if threading.current_thread() is threading.main_thread():  # signal.signal is main-thread only
            for sig in (signal.SIGINT, signal.SIGTERM):
                self._previous[sig] = signal.signal(sig, self._record)
        return self

    def _record(self, signum: int, frame: Any) -> None:
        if self.signum is None:
            self.signum = signum

    def __exit__(self, *exc: Any) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def supervise(
    running: _Mesh,
    trap: _SignalTrap,
    mesh: tuple[int, int],
    jobs: Any | None,
    start_replica: Callable[[int, int], None] | None,
    optional: Sequence[int],
    say: Callable[[str], None],
) -> int:
    """Wait until every child is done, a child fails (past its replica's restarts, outside the
    optional replicas) or a signal arrives; the mesh's exit code. ``jobs``: the launcher's replica-restart
    bookkeeping (``restarts``, ``max_restarts`` per replica), None without restarts; ``say`` prints
    the launcher's own messages. A failed child's last unshown lines are printed before the verdict."""
    done: set[int] = set()  # id() of the children whose exit 0 was seen
    while any(id(c) not in done for c in running.children if not c.retired):
        if trap.signum is not None:
            name = signal.Signals(trap.signum).name
            say(f"got {name}: stopping all {len(running.children)} processes")
            return 128 + trap.signum
        try:
            child, code = running.exits.get(timeout=0.05)
        except queue.Empty:
            continue
        if code == 0 or child.retired:
            done.add(id(child))
            continue
        running.show_tail(child)
        replica = child.rank // mesh[1]
        restart = jobs is not None and jobs.restarts[replica] < jobs.max_restarts
        if not restart and replica not in optional:
            say(f"rank {child.rank} ({child.tag}) failed first with exit code {code}; stopping the others")
            return code
        if restart:
            assert jobs is not None  # restart needs the bookkeeping
            jobs.restarts[replica] += 1
            what = f"restarting replica {replica} ({jobs.restarts[replica]}/{jobs.max_restarts})"
        else:
            what = f"optional replica {replica} is lost"
        say(f"rank {child.rank} ({child.tag}) failed with exit code {code}: {what}; the other replicas go on")
        mates = [c for c in running.children if not c.retired and c.rank // mesh[1] == replica]
        for mate in mates:  # their exits (ours to cause) are not failures
            mate.retired = True
        running.stop(mates)
        if restart:
            assert jobs is not None and start_replica is not None  # restarts come with both
            start_replica(replica, jobs.restarts[replica])
    return 0
