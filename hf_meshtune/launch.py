"""Start a complete local X×Y mesh: X·Y Python processes, one torchft lighthouse, one exit code.

``launch_mesh((X, Y), ["train.py", "--lr", "1e-4"], cpu=True)`` is a small torchrun for one machine
that also knows the mesh: rank r is replica r // Y, stage r % Y (replica X-1 is the anchor). Every
child gets the torchrun environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT) plus MESHTUNE_MESH="XxY" and TORCHFT_LIGHTHOUSE, the address of a lighthouse the
launcher runs in its own process (loopback only, ``min_replicas=1``: the anchor replica is not a
torchft participant, and a fast circuit of one replica must still form a quorum).

Output (``console.py``): the terminal shows one training run: the lines of the rank with the loss
(replica 0's last stage) as ``[r0s{Y-1}] line``, a progress bar over the steps, process 0's standard
output (a script's results), and of every other rank only the lines that warn or fail (and its last
lines when it exits non-zero); ``all_ranks`` forwards every
line, as ``[r{replica}s{stage}] line`` (stdout to stdout, stderr to stderr). Every line of every rank goes
to ``log_dir/rank{N}.log`` (a fresh temporary folder when none is given; the launcher says where).
torchft's Rust servers log at ``RUST_LOG=warn`` unless the environment sets RUST_LOG.

Replica restarts (``max_restarts`` > 0, ``meshtune launch --max-restarts N``): every replica is a job of
its own (``child_env(..., replica_jobs=True)``: RANK = stage, WORLD_SIZE = Y, its own MASTER_PORT,
MESHTUNE_REPLICA = r, MESHTUNE_RESTART = how many times it was restarted, MESHTUNE_JOB_STORE = a store
the launcher hosts for the first start's barrier). When a child of replica r exits non-zero, the other
processes of replica r are stopped and the whole replica starts again on a fresh port (its pipeline
is one unit), at most ``max_restarts`` times per replica, like torchrun's ``--max_restarts`` for one
replica group; the other replicas keep training and the restarted one heals from them through torchft.

A shared secret (``$MESHTUNE_SECRET`` or ``$MESHTUNE_SECRET_FILE`` in the launcher's environment,
``comm.gate``): the launcher also serves the mesh's gate (MESHTUNE_GATE, exported to every child),
guards its lighthouse and store so that only admitted addresses reach them, and refuses a
``lighthouse`` of someone else's. Every child knocks at the gate before anything else.

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
import re
import socket
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ._validation import require
from .console import CONSOLE_ENV, Console, StepProgress
from .processes import _Mesh, _SignalTrap, supervise

__all__ = ["child_argv", "child_env", "free_port", "launch_mesh"]

DEFAULT_GRACE_S = 10.0
"""Seconds between SIGTERM and SIGKILL when the mesh is stopped."""

_ADDRESS = re.compile(r"(?:https?://)?(\[[0-9A-Fa-f:.]+\]|[^\s/:\[\]]+):(\d{1,5})/?")


# ---------------------------------------------------------------------------------------------------
# What each child gets (pure functions)
# ---------------------------------------------------------------------------------------------------


def child_argv(command: Sequence[str]) -> list[str]:
    """``["script.py", *args]`` or ``["-m", "module", *args]`` → the argv run with this interpreter."""
    return [sys.executable, *command]


def child_env(
    mesh: tuple[int, int],
    rank: int,
    *,
    cpu: bool,
    master_port: int,
    lighthouse: str | None,
    base: Mapping[str, str],
    cpu_count: int | None = None,
    replica_jobs: bool = False,
    restart: int = 0,
    job_store: str | None = None,
) -> dict[str, str]:
    """The environment of global rank ``rank`` in a local mesh of X·Y processes.

    ``base`` (usually ``os.environ``) is copied first; the torchrun variables, MESHTUNE_MESH,
    MESHTUNE_CONSOLE=launcher and PYTHONUNBUFFERED=1 (so lines reach the launcher as they are printed)
    always win; RUST_LOG is ``warn`` unless ``base`` sets it. With ``cpu``:
    ACCELERATE_USE_CPU=true, no visible CUDA device and OMP_NUM_THREADS = max(1, cpu_count // (X·Y))
    unless ``base`` already sets OMP_NUM_THREADS (an exported value is respected, as torchrun does).
    ``replica_jobs``: rank ``rank``'s replica is a world of its own (RANK = stage, WORLD_SIZE = Y,
    ``master_port`` is that replica's), with MESHTUNE_REPLICA, MESHTUNE_RESTART = ``restart`` and
    MESHTUNE_JOB_STORE = ``job_store``; LOCAL_RANK stays the mesh rank (one device per process).
    """
    world_size = mesh[0] * mesh[1]
    env = dict(base)
    env.update(
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(world_size),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(master_port),
        MESHTUNE_MESH=f"{mesh[0]}x{mesh[1]}",
        PYTHONUNBUFFERED="1",
        **{CONSOLE_ENV: "launcher"},
    )
    env.setdefault("RUST_LOG", "warn")  # torchft's INFO chatter (quorum status, every connection) stays off
    if replica_jobs:
        env.update(
            RANK=str(rank % mesh[1]),
            WORLD_SIZE=str(mesh[1]),
            MESHTUNE_REPLICA=str(rank // mesh[1]),
            MESHTUNE_RESTART=str(restart),
        )
        if job_store is not None:
            env["MESHTUNE_JOB_STORE"] = job_store
    if lighthouse is not None:
        env["TORCHFT_LIGHTHOUSE"] = lighthouse
    if cpu:
        cores = cpu_count if cpu_count is not None else _cpu_count()
        env.update(ACCELERATE_USE_CPU="true", CUDA_VISIBLE_DEVICES="")
        env.setdefault("OMP_NUM_THREADS", str(max(1, cores // world_size)))
    return env


def free_port(address: str = "127.0.0.1") -> int:
    """A TCP port that was free on ``address`` a moment ago."""
    with socket.socket() as sock:
        sock.bind((address, 0))
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
    ok = (
        isinstance(mesh, tuple)
        and len(mesh) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) and v >= 1 for v in mesh)
    )
    require(ok, "mesh", mesh, "be a pair (X, Y) of integers >= 1 (X replicas, Y stages)")
    require(
        len(command) > 0, "script", "", "be given after `--`: a Python file or `-m module`, followed by its arguments"
    )
    if command[0] == "-m":
        require(
            len(command) > 1 and not command[1].startswith("-"),
            "script",
            " ".join(command),
            "name a module after -m, e.g. `-m recipes.sft`",
        )
    else:
        require(
            not command[0].startswith("-"),
            "script",
            command[0],
            "be a Python file or `-m module` (other interpreter flags are not supported)",
        )
        require(os.path.isfile(command[0]), "script", command[0], "be an existing Python file")
    if master_port is not None:
        require(
            isinstance(master_port, int) and 1 <= master_port <= 65535,
            "master_port",
            master_port,
            "be an integer in [1, 65535]",
        )
    if lighthouse is not None:
        require(
            _ADDRESS.fullmatch(lighthouse) is not None,
            "lighthouse",
            lighthouse,
            "be host:port or http://host:port of a running torchft lighthouse",
        )


def _normalize_lighthouse(address: str) -> str:
    return address if "://" in address else f"http://{address}"


# ---------------------------------------------------------------------------------------------------
# The lighthouse
# ---------------------------------------------------------------------------------------------------


def _maybe_start_lighthouse(lighthouse: str | None, host: str) -> tuple[Any, str]:
    """The lighthouse given, or one started on ``host`` (listening there only, so that address works)."""
    if lighthouse is not None:
        return None, _normalize_lighthouse(lighthouse)
    from .dp.ft import start_lighthouse  # lazy: a launch given --lighthouse (and `meshtune --help`) imports no torch

    return start_lighthouse(host=host)


def _say(message: str) -> None:
    print(f"meshtune launch: {message}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------
# Public entry point
# ---------------------------------------------------------------------------------------------------

RankHook = Callable[[int], "tuple[list[str], dict[str, str]]"]
"""rank → (argv prefix, extra environment) of that rank's process."""


def launch_mesh(
    mesh: tuple[int, int],
    command: list[str],
    *,
    cpu: bool,
    master_port: int | None = None,
    lighthouse: str | None = None,
    log_dir: str | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    max_restarts: int = 0,
    host: str = "127.0.0.1",
    rank_hook: RankHook | None = None,
    optional_replicas: Sequence[int] = (),
    all_ranks: bool = False,
) -> int:
    """Run ``python *command`` as every rank of a local X × Y mesh; return the mesh's exit code.

    ``mesh`` is (X replicas, Y stages) → X·Y processes; rank r is replica r // Y, stage r % Y.
    ``command`` is ``["script.py", *args]`` or ``["-m", "module", *args]``. ``cpu`` sets
    ACCELERATE_USE_CPU, hides CUDA and splits the cores over the processes. ``master_port`` defaults to
    a free port; ``lighthouse`` (host:port) defaults to one the launcher starts and stops itself.
    ``log_dir`` receives each rank's prefixed output as ``rank{N}.log`` (default: a new temporary
    folder); the terminal shows the loss rank, a progress bar and other ranks' warnings and failures, or
    every line with ``all_ranks``. ``env`` is added to every
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
    _validate_restarts(mesh, max_restarts, optional_replicas, master_port)
    log_dir = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="meshtune-logs-")
    os.makedirs(log_dir, exist_ok=True)
    port = master_port if master_port is not None else free_port()
    gate = _Gatekeeper.from_environment(host, lighthouse)
    server, address = _maybe_start_lighthouse(lighthouse, host)
    jobs = _ReplicaJobs(mesh, max_restarts, host) if max_restarts else None
    if gate is not None:
        gate.guard(int(address.rstrip("/").rsplit(":", 1)[1]), *([jobs.store.port] if jobs is not None else []))
        env = {**(env or {}), **gate.env}
    _say(
        f"mesh {mesh[0]}x{mesh[1]} = {mesh[0] * mesh[1]} processes, "
        + (f"one job per replica, up to {max_restarts} restart(s) each" if jobs else f"master 127.0.0.1:{port}")
        + f", lighthouse {address}"
    )
    loss_tag = _rank_tag(mesh, mesh[1] - 1)
    _say(
        f"every rank's output: {os.path.join(log_dir, 'rank<N>.log')}; "
        + ("showing all ranks" if all_ranks else f"showing {loss_tag} (the loss), r0s0's prints, warnings and failures")
    )
    console = Console(loss_tag, StepProgress(command, loss_tag), all_ranks)
    running = _Mesh(grace_s, console)
    starter = _Starter(running, mesh, command, cpu, address, env, log_dir, rank_hook, jobs)
    with _SignalTrap() as trap:  # also covers the stop: a second Ctrl-C must not cut it short
        try:
            if jobs is None:
                starter.start_world(port)
            else:
                for replica in range(mesh[0]):
                    starter.start_replica(replica, 0)
            return supervise(running, trap, mesh, jobs, starter.start_replica, optional_replicas, _say)
        finally:
            running.stop()
            console.close()
            if jobs is not None:
                jobs.close()
            if server is not None:
                server.shutdown()
            if gate is not None:
                gate.close()


def _validate_restarts(mesh: tuple[int, int], max_restarts: Any, optional_replicas: Sequence[int],
                       master_port: int | None) -> None:  # fmt: skip
    require(
        isinstance(max_restarts, int) and not isinstance(max_restarts, bool) and max_restarts >= 0,
        "max_restarts",
        max_restarts,
        "be an integer >= 0 (restarts per replica)",
    )
    optional = list(optional_replicas)
    require(
        all(isinstance(r, int) and 0 <= r < mesh[0] for r in optional),
        "optional_replicas",
        optional,
        f"name replicas in [0, {mesh[0]}) of the {mesh[0]}x{mesh[1]} mesh",
    )
    require(
        max_restarts == 0 or master_port is None,
        "master_port",
        master_port,
        "be unset with max_restarts > 0 (every replica, and every restart of one, gets a free port of its own)",
    )


@dataclass
class _Starter:
    """Starts the mesh's ranks: all in one world, or one replica job (a fresh port per start)."""

    running: _Mesh
    mesh: tuple[int, int]
    command: list[str]
    cpu: bool
    lighthouse: str | None
    env: dict[str, str] | None
    log_dir: str | None
    rank_hook: RankHook | None
    jobs: _ReplicaJobs | None

    def start(self, rank: int, ranked_env: dict[str, str], append: bool = False) -> None:
        prefix, extra = self.rank_hook(rank) if self.rank_hook is not None else ([], {})
        argv = [*prefix, *child_argv(self.command)]
        self.running.start(
            rank, _rank_tag(self.mesh, rank), argv, ranked_env | dict(extra), self.log_dir, append=append
        )

    def start_world(self, port: int) -> None:
        for rank in range(self.mesh[0] * self.mesh[1]):
            ranked_env = child_env(
                self.mesh, rank, cpu=self.cpu, master_port=port, lighthouse=self.lighthouse, base=os.environ
            )
            self.start(rank, ranked_env | dict(self.env or {}))

    def start_replica(self, replica: int, restart: int) -> None:
        assert self.jobs is not None  # replicas restart as jobs of their own
        replica_port = free_port()
        for rank in range(replica * self.mesh[1], (replica + 1) * self.mesh[1]):
            ranked_env = child_env(
                self.mesh, rank, cpu=self.cpu, master_port=replica_port, lighthouse=self.lighthouse, base=os.environ,
                replica_jobs=True, restart=restart, job_store=self.jobs.address,
            )  # fmt: skip
            self.start(rank, ranked_env | dict(self.env or {}), append=restart > 0)


class _Gatekeeper:
    """With a secret in the environment (``comm.gate``): the mesh's gate, and a guard on the
    launcher's lighthouse and job store that admits only the addresses the gate admitted."""

    def __init__(self, key: bytes, host: str, port: int = 0) -> None:
        from .comm.gate import GATE_ENV, Gate, Guard

        self._ports: set[int] = set()
        self._guard: Guard | None = None
        self.gate = Gate(key, host, on_admit=lambda _: self._guard is not None and self._guard.scan(), port=port)
        self._guard = Guard(self.gate.admitted, exempt={self.gate.inode}, ports=self._ports)
        self.env = {GATE_ENV: self.gate.address}
        _say(f"gate {self.gate.address}: only processes holding the mesh's secret get in")

    @classmethod
    def from_environment(cls, host: str, lighthouse: str | None) -> _Gatekeeper | None:
        from .comm.gate import SECRET_ENV, secret_key

        key = secret_key()
        if key is None:
            return None
        require(
            lighthouse is None,
            "lighthouse",
            lighthouse,
            f"be unset when {SECRET_ENV} is: with a secret the launcher starts and guards its own lighthouse "
            "(another one would accept anyone)",
        )
        return cls(key, host)

    def guard(self, *ports: int) -> None:
        """Guard the servers on ``ports`` (the lighthouse, the job store), now that they listen."""
        self._ports.update(ports)
        assert self._guard is not None  # set by __init__
        self._guard.scan()

    def close(self) -> None:
        assert self._guard is not None  # set by __init__
        self._guard.stop()
        self.gate.close()
        if self.gate.refusals:
            _say(f"the gate refused {len(self.gate.refusals)} connection(s)")


class _ReplicaJobs:
    """Restart bookkeeping of a mesh launched as one job per replica, and the store of its first start."""

    def __init__(self, mesh: tuple[int, int], max_restarts: int, host: str) -> None:

        self.max_restarts = max_restarts
        self.restarts = [0] * mesh[0]
        from .comm.listen import bound_store, listen_address

        self.store = bound_store(listen_address(host))  # on ``host`` only, not every interface
        self.address = f"{host}:{self.store.port}"

    def close(self) -> None:
        del self.store
