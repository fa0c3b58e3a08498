"""Start a complete local X×Y mesh: X·Y Python processes, one torchft lighthouse, one exit code.

``launch_mesh((X, Y), ["train.py", "--lr", "1e-4"], cpu=True)`` is a small torchrun for one machine
that also knows the mesh: rank r is replica r // Y, stage r % Y (replica X-1 is the anchor). Every
child gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus MESHTUNE_MESH="XxY" and TORCHFT_LIGHTHOUSE, the address of a lighthouse the
launcher runs in its own process (loopback only, ``min_replicas=1``: the anchor replica is not a
torchft participant, and a fast circuit of one replica must still form a quorum).

Output: every child line is forwarded as ``[r{replica}s{stage}] line`` (stdout to stdout, stderr to
stderr), and copied to ``log_dir/rank{N}.log`` when asked.

Replica restarts (``max_restarts`` > 0, ``meshtune launch --max-restarts N``): every replica is a job of
its own (``child_env(..., replica_jobs=True)``: RANK = stage, WORLD_SIZE = Y, its own MASTER_PORT,
MESHTUNE_REPLICA = r, MESHTUNE_RESTART = how many times it was restarted, MESHTUNE_JOB_STORE = a store
the launcher hosts for the first start's barrier). When a child of replica r exits non-zero, the other
processes of replica r are stopped and the whole replica starts again on a fresh port (its pipeline
is one unit), at most ``max_restarts`` times per replica, like torchrun's ``--max_restarts`` for one
replica group; the other replicas keep training and the restarted one heals from them through torchft.

Optional replicas (``optional_replicas``, ``meshtune launch --optional-replica R``): a failure there
stops only that replica (the anchor replica: the fast circuit trains on without it).

Failure semantics: the first child to exit non-zero (past its replica's restarts, outside the
optional replicas) stops the mesh: the others get SIGTERM, then
SIGKILL after ``grace_s``, and the launcher returns that child's code (128+signal if it was killed by
a signal). SIGINT/SIGTERM to the launcher do the same and return 130/143. Children run in their own
sessions, and the launcher signals whole process groups, so workers they spawned (data loaders, a
torchft Manager's subprocesses) go too. What can still outlive it: anything left behind by a
SIGKILL of the launcher itself, and processes that a child moved into a session of their own.
"""

from __future__ import annotations

import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO, Any

from tqdm import tqdm

from ._validation import require

__all__ = ["child_argv", "child_env", "free_port", "launch_mesh", "start_local_lighthouse"]

DEFAULT_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when the mesh is stopped."""

_ADDRESS = re.compile(r"(?:https?://)?(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(\d{1,5})/?")


# ---------------------------------------------------------------------------------------------------
# What each child gets (pure functions)
# ---------------------------------------------------------------------------------------------------

def child_argv(command: Sequence[str]) -> list[str]:
    """``["script.py", *args]`` or ``["-m", "module", *args]`` → the argv run with this interpreter."""
    return [sys.executable, *command]


def child_env(mesh: tuple[int, int], rank: int, *, cpu: bool, master_port: int, lighthouse: str | None,
              base: Mapping[str, str], cpu_count: int | None = None, replica_jobs: bool = False,
              restart: int = 0, job_store: str | None = None) -> dict[str, str]:
    """The environment of global rank ``rank`` in a local mesh of X·Y processes.

    ``base`` (usually ``os.environ``) is copied first; the torchrun variables, MESHTUNE_MESH and
    PYTHONUNBUFFERED=1 (so lines reach the launcher as they are printed) always win. With ``cpu``:
    ACCELERATE_USE_CPU=true, no visible CUDA device and OMP_NUM_THREADS = max(1, cpu_count // (X·Y))
    unless ``base`` already sets OMP_NUM_THREADS (an exported value is respected, as torchrun does).
    ``replica_jobs``: rank ``rank``'s replica is a world of its own (RANK = stage, WORLD_SIZE = Y,
    ``master_port`` is that replica's), with MESHTUNE_REPLICA, MESHTUNE_RESTART = ``restart`` and
    MESHTUNE_JOB_STORE = ``job_store``; LOCAL_RANK stays the mesh rank (one device per process).
    """
    world_size = mesh[0] * mesh[1]
    env = dict(base)
    env.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
               LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(master_port),
               MESHTUNE_MESH=f"{mesh[0]}x{mesh[1]}", PYTHONUNBUFFERED="1")
    if replica_jobs:
        env.update(RANK=str(rank % mesh[1]), WORLD_SIZE=str(mesh[1]), MESHTUNE_REPLICA=str(rank // mesh[1]),
                   MESHTUNE_RESTART=str(restart))
        if job_store is not None:
            env["MESHTUNE_JOB_STORE"] = job_store
    if lighthouse is not None:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
    if cpu:
        cores = cpu_count if cpu_count is not None else _cpu_count()
        env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // world_size)))
    return env


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _rank_tag(mesh: tuple[int, int], rank: int) -> str:
    return f"r{rank // mesh[1]}s{rank % mesh[1]}"


# ---------------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------------

def _validate(mesh: Any, command: Sequence[str], master_port: int | None, lighthouse: str | None) -> None:
    ok = (isinstance(mesh, tuple) and len(mesh) == 2
          and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh))
    require(ok, "mesh", mesh, "be a pair (X, Y) of integers >= 1 (X replicas, Y stages)")
    require(len(command) > 0, "script", "",
            "be given after `--`: a Python file or `-m module`, followed by its arguments")
    if command[0] == "-m":
        require(len(command) > 1 and not command[1].startswith("-"), "script", " ".join(command),
                "name a module after -m, e.g. `-m recipes.sft`")
    else:
        require(not command[0].startswith("-"), "script", command[0],
                "be a Python file or `-m module` (other interpreter flags are not supported)")
        require(os.path.isfile(command[0]), "script", command[0], "be an existing Python file")
    if master_port is not None:
        require(isinstance(master_port, int) and 1 <= master_port <= 65535, "master_port", master_port,
                "be an integer in [1, 65535]")
    if lighthouse is not None:
        require(_ADDRESS.fullmatch(lighthouse) is not None, "lighthouse", lighthouse,
                "be host:port or http://host:port of a running torchft lighthouse")


def _normalize_lighthouse(address: str) -> str:
    return address if "://" in address else f"http://{address}"


# ---------------------------------------------------------------------------------------------------
# The lighthouse
# ---------------------------------------------------------------------------------------------------

def start_local_lighthouse(min_replicas: int = 1, host: str = "127.0.0.1") -> tuple[Any, str]:
    """Start a torchft lighthouse on a free port of ``host``; return ``(server, "http://HOST:PORT")``.

    torchft advertises the machine's hostname (``http://vm:PORT``), which may not resolve, or resolve
    to another interface; the server only listens on ``host`` (loopback by default), so that address
    is the one that works. Stop it with ``server.shutdown()``.
    """
    from torchft.coordination import LighthouseServer  # lazy: torchft is optional for the library

    from .dp_sync import JOIN_TIMEOUT_MS

    server = LighthouseServer(bind=f"{host}:0", min_replicas=min_replicas, join_timeout_ms=JOIN_TIMEOUT_MS)
    port = server.address().rsplit(":", 1)[1].rstrip("/")
    return server, f"http://{host}:{port}"


def _maybe_start_lighthouse(lighthouse: str | None, host: str) -> tuple[Any, str | None]:
    if lighthouse is not None:
        return None, _normalize_lighthouse(lighthouse)
    try:
        return start_local_lighthouse(host=host)
    except ImportError:
        _say("torchft is not installed: no lighthouse, TORCHFT_LIGHTHOUSE is left unset")
        return None, None


def _say(message: str) -> None:
    print(f"meshtune launch: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# The running mesh
# ---------------------------------------------------------------------------------------------------

class StepProgress:
    """A progress bar over the mesh's optimizer steps, fed by the step lines the loss-computing rank
    (replica 0's last stage) prints, ``{"mesh": ..., "step": N, ...}``. It shows on a terminal only
    (tqdm's ``disable=None``); the total is the command's ``--max_steps`` when it has one."""

    _STEP = re.compile(r'^\{"mesh": "[^"]*", "step": (\d+)')

    def __init__(self, command: Sequence[str], tag: str, file: IO[str] | None = None, disable: bool | None = None) -> None:
        self.tag = tag
        total = None
        for flag, value in zip(command, command[1:]):
            if flag == "--max_steps" and value.isdigit():
                total = int(value)
        self.bar = tqdm(total=total, desc="mesh steps", unit="step", file=file or sys.stderr, disable=disable, leave=True)

    def feed(self, tag: str, text: str) -> None:
        """Move the bar to step N when ``text`` is the loss rank's step line."""
        match = self._STEP.match(text) if tag == self.tag else None
        if match and int(match[1]) > self.bar.n:
            self.bar.update(int(match[1]) - self.bar.n)

    def close(self) -> None:
        self.bar.close()


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

    def __init__(self, grace_s: float, progress: StepProgress | None = None) -> None:
        self.children: list[_Child] = []
        self.grace_s, self.progress = grace_s, progress
        self.exits: queue.Queue[tuple[_Child, int]] = queue.Queue()  # (child, exit code) in exit order
        self._lock = threading.Lock()  # one line at a time on the launcher's stdout/stderr/log files

    def start(self, rank: int, tag: str, argv: list[str], env: dict[str, str], log_dir: str | None,
              append: bool = False) -> None:
        log = open(os.path.join(log_dir, f"rank{rank}.log"), "a" if append else "w", encoding="utf-8") if log_dir else None
        proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.PIPE, start_new_session=True)
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
                try:
                    out = sys.stderr if is_err else sys.stdout
                    with tqdm.external_write_mode(file=out):  # lift the progress bar while the line goes by
                        out.write(line)
                        out.flush()
                except (OSError, ValueError):  # closed or unencodable terminal: keep draining the pipe
                    pass
                if self.progress is not None:
                    self.progress.feed(child.tag, text)
                if child.log is not None:
                    child.log.write(line)
                    child.log.flush()
        pipe.close()

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


# ---------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------

RankHook = Callable[[int], "tuple[list[str], dict[str, str]]"]
"""rank → (argv prefix, extra environment) of that rank's process."""


def launch_mesh(mesh: tuple[int, int], command: list[str], *, cpu: bool, master_port: int | None = None,
                lighthouse: str | None = None, log_dir: str | None = None,
                env: dict[str, str] | None = None, grace_s: float = DEFAULT_GRACE_S, max_restarts: int = 0,
                host: str = "127.0.0.1", rank_hook: RankHook | None = None,
                optional_replicas: Sequence[int] = ()) -> int:
    """Run ``python *command`` as every rank of a local X × Y mesh; return the mesh's exit code.

    ``mesh`` is (X replicas, Y stages) → X·Y processes; rank r is replica r // Y, stage r % Y.
    ``command`` is ``["script.py", *args]`` or ``["-m", "module", *args]``. ``cpu`` sets
    ACCELERATE_USE_CPU, hides CUDA and splits the cores over the processes. ``master_port`` defaults to
    a free port; ``lighthouse`` (host:port) defaults to one the launcher starts and stops itself.
    ``log_dir`` also receives each rank's prefixed output as ``rank{N}.log``. ``env`` is added to every
    child's environment last (it overrides everything). ``grace_s``: seconds between SIGTERM and
    SIGKILL when the mesh is stopped. ``max_restarts`` > 0: every replica is a job of its own and one
    that fails is restarted, at most that many times per replica (module docstring). ``host``: the
    address the launcher's lighthouse and store listen on and advertise (loopback by default; the
    address of an interface the children reach when they run elsewhere). ``rank_hook(rank)`` →
    ``(argv prefix, env)`` for one rank, applied last (e.g. ``ip netns exec NS`` and its MASTER_ADDR
    and MESHTUNE_HOST when ranks run in network namespaces). ``optional_replicas``: replicas whose
    failure does not stop the others (the anchor replica X-1: the fast circuit trains on without it;
    its remaining processes are stopped). Returns 0 when
    every child exits 0, else the code of the child that failed first (128+s if signal s killed it),
    or 130/143 after SIGINT/SIGTERM.

    Example:
        >>> launch_mesh((3, 2), ["recipes/sft.py", "--max_steps", "10"], cpu=True)  # doctest: +SKIP
    """
    _validate(mesh, command, master_port, lighthouse)
    require(isinstance(max_restarts, int) and not isinstance(max_restarts, bool) and max_restarts >= 0,
            "max_restarts", max_restarts, "be an integer >= 0 (restarts per replica)")
    optional = list(optional_replicas)
    require(all(isinstance(r, int) and 0 <= r < mesh[0] for r in optional), "optional_replicas", optional,
            f"name replicas in [0, {mesh[0]}) of the {mesh[0]}x{mesh[1]} mesh")
    require(max_restarts == 0 or master_port is None, "master_port", master_port,
            "be unset with max_restarts > 0 (every replica, and every restart of one, gets a free port of its own)")
    if log_dir is not None:
        os.makedirs(log_dir, exist_ok=True)
    port = master_port if master_port is not None else free_port()
    server, address = _maybe_start_lighthouse(lighthouse, host)
    world_size = mesh[0] * mesh[1]
    jobs = _ReplicaJobs(mesh, max_restarts, host) if max_restarts else None

    def start(rank: int, ranked_env: dict[str, str], append: bool = False) -> None:
        prefix, extra = rank_hook(rank) if rank_hook is not None else ([], {})
        running.start(rank, _rank_tag(mesh, rank), [*prefix, *child_argv(command)], ranked_env | dict(extra), log_dir,
                      append=append)

    _say(f"mesh {mesh[0]}x{mesh[1]} = {world_size} processes, "
         + (f"one job per replica, up to {max_restarts} restart(s) each" if jobs else f"master 127.0.0.1:{port}")
         + f", lighthouse {address}")
    progress = StepProgress(command, _rank_tag(mesh, mesh[1] - 1))
    running = _Mesh(grace_s, progress)

    def start_replica(replica: int, restart: int) -> None:
        replica_port = free_port()
        for rank in range(replica * mesh[1], (replica + 1) * mesh[1]):
            ranked_env = child_env(mesh, rank, cpu=cpu, master_port=replica_port, lighthouse=address, base=os.environ,
                                   replica_jobs=True, restart=restart, job_store=jobs.address) | dict(env or {})
            start(rank, ranked_env, append=restart > 0)

    with _SignalTrap() as trap:  # also covers the stop: a second Ctrl-C must not cut it short
        try:
            if jobs is None:
                for rank in range(world_size):
                    ranked_env = child_env(mesh, rank, cpu=cpu, master_port=port, lighthouse=address,
                                           base=os.environ) | dict(env or {})
                    start(rank, ranked_env)
            else:
                for replica in range(mesh[0]):
                    start_replica(replica, 0)
            return _supervise(running, trap, mesh, jobs, start_replica, optional_replicas)
        finally:
            running.stop()
            progress.close()
            if jobs is not None:
                jobs.close()
            if server is not None:
                server.shutdown()


class _ReplicaJobs:
    """Restart bookkeeping of a mesh launched as one job per replica, and the store of its first start."""

    def __init__(self, mesh: tuple[int, int], max_restarts: int, host: str) -> None:
        import torch.distributed as dist  # lazy: the launcher imports no torch for a plain launch

        self.max_restarts = max_restarts
        self.restarts = [0] * mesh[0]
        self.store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False)
        self.address = f"{host}:{self.store.port}"

    def close(self) -> None:
        del self.store


def _supervise(running: _Mesh, trap: _SignalTrap, mesh: tuple[int, int], jobs: _ReplicaJobs | None = None,
               start_replica: Callable[[int, int], None] | None = None, optional: Sequence[int] = ()) -> int:
    """Wait until every child is done, a child fails (past its replica's restarts, outside the
    optional replicas) or a signal arrives; the mesh's exit code."""
    done: set[int] = set()  # id() of the children whose exit 0 was seen
    while any(id(c) not in done for c in running.children if not c.retired):
        if trap.signum is not None:
            name = signal.Signals(trap.signum).name
            _say(f"got {name}: stopping all {len(running.children)} processes")
            return 128 + trap.signum
        try:
            child, code = running.exits.get(timeout=0.05)
        except queue.Empty:
            continue
        if code == 0 or child.retired:
            done.add(id(child))
            continue
        replica = child.rank // mesh[1]
        restart = jobs is not None and jobs.restarts[replica] < jobs.max_restarts
        if not restart and replica not in optional:
            _say(f"rank {child.rank} ({child.tag}) failed first with exit code {code}; stopping the others")
            return code
        if restart:
            jobs.restarts[replica] += 1
            what = f"restarting replica {replica} ({jobs.restarts[replica]}/{jobs.max_restarts})"
        else:
            what = f"optional replica {replica} is lost"
        _say(f"rank {child.rank} ({child.tag}) failed with exit code {code}: {what}; the other replicas go on")
        mates = [c for c in running.children if not c.retired and c.rank // mesh[1] == replica]
        for mate in mates:  # their exits (ours to cause) are not failures
            mate.retired = True
        running.stop(mates)
        if restart:
            start_replica(replica, jobs.restarts[replica])
    return 0
