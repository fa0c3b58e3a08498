"""A peer without the mesh's secret trying to get in, run in a namespace of its own by the soak.

    ip netns exec mtw-n7 python -m benchmarks.reliability.intruder --gate HOST:PORT --targets '[["ip", port], ...]'

It knocks at the mesh's gate with a secret of its own, then opens a TCP connection to every listening
socket of the mesh's namespaces (the lighthouse, the stores, torchft's servers, gloo's pairs). Prints
one JSON line: whether the gate refused it, which targets let it connect (must be none), how many it tried.
"""

from __future__ import annotations

import argparse
import json
import secrets
import socket
import sys
from concurrent.futures import ThreadPoolExecutor

from hf_meshtune.comm.gate import GateRefused, knock, secret_key


def _connects(target: tuple[str, int], timeout_s: float) -> bool:
    try:
        with socket.create_connection(target, timeout=timeout_s):
            return True
    except OSError:
        return False


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability.intruder")
    parser.add_argument("--gate", required=True)
    parser.add_argument("--targets", required=True, help="JSON list of [ip, port]")
    parser.add_argument("--timeout", type=float, default=3.0)
    args = parser.parse_args(argv)
    key = secret_key({"MESHTUNE_SECRET": secrets.token_hex(32)})  # not the mesh's
    try:
        knock(args.gate, key, timeout_s=args.timeout)
        refused, why = False, "admitted"
    except GateRefused as err:
        refused, why = True, str(err)
    except OSError as err:
        refused, why = False, f"gate unreachable: {err}"
    targets = [(ip, int(port)) for ip, port in json.loads(args.targets)]
    with ThreadPoolExecutor(max_workers=32) as pool:
        opened = list(pool.map(lambda t: _connects(t, args.timeout), targets))
    reached = [list(t) for t, ok in zip(targets, opened) if ok]
    print(json.dumps({"refused_at_gate": refused, "gate_said": why, "tried": len(targets), "reached": reached}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
