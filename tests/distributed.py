"""The one launcher every multi-process test uses: N gloo processes on loopback.

``launch(fn, world_size, *args)`` starts ``world_size`` fresh Python processes (spawn, so nothing of
the test process leaks in), each joins a gloo process group on 127.0.0.1 with its own free port and
calls ``fn(rank, world_size, *args)``. It returns the list of the ranks' return values (picklable),
or raises ``DistributedFailure`` carrying every failed rank's traceback. A process that has not
finished when ``timeout`` runs out is killed, with all its siblings, so a deadlock fails the test
instead of hanging CI. ``fn`` must be importable (module level of a module on the path).
"""

from __future__ import annotations

import os
import pickle
import queue
import socket
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp

from hf_meshtune.runtime.settings import StageCallback

__all__ = ["DistributedFailure", "free_port", "launch", "mesh_launch"]


class DistributedFailure(RuntimeError):
    """One or more ranks raised, died or timed out; the message holds what each of them reported."""


def free_port() -> int:
    """A TCP port that was free on 127.0.0.1 a moment ago."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def mesh_launch(mesh: str, *flags: str) -> list[str]:
    """``meshtune launch --mesh MESH --cpu FLAGS --`` as this interpreter runs it; the script and its
    arguments follow."""
    return [sys.executable, "-m", "hf_meshtune.cli", "launch", "--mesh", mesh, "--cpu", *flags, "--"]


def _child(fn: Callable, rank: int, world_size: int, port: int, env: dict[str, str], results, args: tuple) -> None:
    os.environ.update(
        {
            "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(port),
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "LOCAL_WORLD_SIZE": str(world_size),
            **env,
        }
    )
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)  # N processes share 2 cores; intra-op threads only spin
        if env.get("MESHTUNE_TEST_NO_INIT") != "1":
            dist.init_process_group("gloo", rank=rank, world_size=world_size)
        value = fn(rank, world_size, *args)
        # plain pickle: tensors travel by value (torch's queue would share storages that vanish with the child)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException:  # noqa: BLE001 - everything a rank raises goes back to the test
        results.put((rank, "error", traceback.format_exc()))
        return
    finally:
        try:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - teardown of a failed group must not mask the result
            pass


def launch(
    fn: Callable, world_size: int, *args: Any, timeout: float = 120.0, env: dict[str, str] | None = None
) -> list[Any]:
    """Run ``fn(rank, world_size, *args)`` in ``world_size`` gloo processes; their return values by rank.

    ``env`` is added to every child's environment (``MESHTUNE_TEST_NO_INIT=1``: do not create the
    default process group, ``fn`` does it itself).
    """
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_child, args=(fn, rank, world_size, port, dict(env or {}), results, args), daemon=True)
        for rank in range(world_size)
    ]
    for proc in procs:
        proc.start()
    outcomes: dict[int, tuple[str, Any]] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(outcomes) < world_size:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            try:
                rank, status, value = results.get(timeout=min(remaining, 0.5))
                outcomes[rank] = (status, value)
                if status == "error":  # siblings blocked on the failed rank would wait for ever
                    deadline = min(deadline, time.monotonic() + 10.0)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if p.exitcode not in (None, 0) and r not in outcomes]
                for r in dead:
                    outcomes[r] = ("error", f"rank {r} died with exit code {procs[r].exitcode}")
                if dead:
                    deadline = min(deadline, time.monotonic() + 10.0)
    finally:
        for proc in procs:
            proc.join(timeout=5.0 if len(outcomes) == world_size else 0.1)
            if proc.is_alive():
                proc.kill()
                proc.join()
    errors = {r: v for r, (s, v) in outcomes.items() if s == "error"}
    missing = [r for r in range(world_size) if r not in outcomes]
    if errors or missing:
        parts = [f"--- rank {r} ---\n{v}" for r, v in sorted(errors.items())]
        if missing:
            parts.append(f"ranks {missing} did not finish within {timeout:.0f} s (killed)")
        raise DistributedFailure("\n".join(parts))
    return [pickle.loads(outcomes[r][1]) for r in range(world_size)]


class ParameterRecorder(StageCallback):
    """A ``StageCallback`` that keeps the stage's final parameters and θ_global (what tests compare).

    ``record(result)`` → ``RankRecord``: the process's ``MeshResult`` with ``params`` and
    ``global_params`` beside it, picklable for the launcher."""

    def __init__(self) -> None:
        self.params: dict | None = None
        self.global_params: list | None = None

    def on_train_end(self, view) -> None:
        self.params, self.global_params = view.parameters(), view.global_parameters()

    def record(self, result) -> RankRecord:
        return RankRecord(result, self.params, self.global_params)


class RankRecord:
    """A ``MeshResult`` (its fields read through) plus the final ``params`` and ``global_params``."""

    def __init__(self, result, params, global_params) -> None:
        self.result, self.params, self.global_params = result, params, global_params

    def __getattr__(self, name: str):
        if name == "result":
            raise AttributeError(name)
        return getattr(self.result, name)
