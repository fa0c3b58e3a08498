"""``launch_mesh`` for the soak, run inside the service namespace: rank r runs in node r's namespace.

    ip netns exec mtw-n6 python -m benchmarks.reliability.launch --mesh 3x2 --out DIR --steps N
        [--max-restarts R] [--config JSON] [--optional-replica R]

The launcher's lighthouse and store listen on the service node's address; every rank reaches them,
its replica's stage 0 (MASTER_ADDR) and its pipeline neighbours over the shaped links.
"""

from __future__ import annotations

import argparse
import os
import sys

from benchmarks.wan import netns
from hf_meshtune.launch import launch_mesh
from hf_meshtune.topology import parse_mesh


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability.launch")
    parser.add_argument("--mesh", default="3x2")
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--max-restarts", type=int, default=0)
    parser.add_argument("--config", default="{}")
    parser.add_argument("--service-node", type=int, required=True)
    parser.add_argument("--optional-replica", type=int, action="append", default=[])
    args = parser.parse_args(argv)
    replicas, stages = parse_mesh(args.mesh)
    jobs = args.max_restarts > 0

    def hook(rank: int) -> tuple[list[str], dict[str, str]]:
        master = (rank // stages) * stages if jobs else 0  # the replica's own stage 0, or global rank 0
        return netns.exec_prefix(rank), {
            "MESHTUNE_HOST": netns.node_ip(rank),
            "GLOO_SOCKET_IFNAME": "eth0",
            "MASTER_ADDR": netns.node_ip(master),
            "OMP_NUM_THREADS": "1",
        }

    return launch_mesh(
        (replicas, stages),
        ["tests/scripts/mesh_run.py", args.out, str(args.steps), args.config],
        cpu=True,
        max_restarts=args.max_restarts,
        host=netns.node_ip(args.service_node),
        rank_hook=hook,
        log_dir=os.path.join(args.out, "logs"),
        optional_replicas=args.optional_replica,
    )


if __name__ == "__main__":
    sys.exit(main())
