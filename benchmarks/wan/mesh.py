"""Start one WAN-benchmark row as real processes, rank k inside node k's namespace, and wait for it."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from hf_meshtune.launch import child_env, free_port

from . import netns
from .rows import ROWS, Shape


def run_row(
    row_name: str,
    out: str,
    data: str,
    steps: int,
    *,
    save_every: int = 0,
    timeout_s: float = 1800.0,
    link_timeout_s: float | None = None,
) -> float:
    """Run ``row_name`` for ``steps`` fast steps on the namespaces that are up; returns wall seconds.

    Raises RuntimeError naming the first rank that failed (its log is ``out/rank{k}.log``).
    """
    row, shape = ROWS[row_name], Shape()
    world = row.replicas * shape.stages
    state = netns.read_state()
    if state is None or state.nodes < world:
        raise RuntimeError(
            f"row {row_name} needs {world} nodes but the emulated network has "
            f"{0 if state is None else state.nodes}: run `python -m benchmarks.wan.netns up` first"
        )
    os.makedirs(out, exist_ok=True)
    port = free_port()
    base = {k: v for k, v in os.environ.items() if k != "TORCHFT_LIGHTHOUSE"}
    procs = []
    start = time.perf_counter()
    for rank in range(world):
        env = child_env((row.replicas, shape.stages), rank, cpu=True, master_port=port, lighthouse=None, base=base)
        env.update(
            MASTER_ADDR=netns.node_ip(0),
            GLOO_SOCKET_IFNAME="eth0",
            MESHTUNE_HOST=netns.node_ip(rank),
            **({"MESHTUNE_DP_HOST": netns.node_dp_ip(rank)} if row.dp_low_priority else {}),
            OMP_NUM_THREADS="1",
            TOKENIZERS_PARALLELISM="false",
        )
        argv = [
            *netns.exec_prefix(rank),
            sys.executable,
            "-m",
            "benchmarks.wan.worker",
            "--row",
            row_name,
            "--data",
            data,
            "--out",
            out,
            "--steps",
            str(steps),
            "--save-every",
            str(save_every),
        ]
        if link_timeout_s is not None:
            argv += ["--link-timeout", str(link_timeout_s)]
        log = open(os.path.join(out, f"rank{rank}.log"), "w")
        procs.append(
            (
                subprocess.Popen(
                    argv, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, cwd=netns._repo_root()
                ),
                log,
            )
        )
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            codes = [p.poll() for p, _ in procs]
            failed = [(rank, code) for rank, code in enumerate(codes) if code not in (None, 0)]
            if failed:
                rank, code = failed[0]
                raise RuntimeError(f"row {row_name}: rank {rank} exited with code {code}; see {out}/rank{rank}.log")
            if all(code == 0 for code in codes):
                return time.perf_counter() - start
            if time.monotonic() > deadline:
                raise RuntimeError(f"row {row_name}: still running after {timeout_s:.0f} s; see {out}/rank*.log")
            time.sleep(0.2)
    finally:
        for p, log in procs:
            if p.poll() is None:
                os.killpg(p.pid, 9)
                p.wait()
            log.close()
