"""An emulated wide-area network on one machine: one network namespace per node, shaped links.

    python -m benchmarks.wan.netns up --nodes 8 --rate-mbit 8 --delay-ms 20   # idempotent
    python -m benchmarks.wan.netns down                                        # idempotent
    python -m benchmarks.wan.netns show

Topology (a star, as nodes behind their own internet uplinks):

    node i: namespace ``mtw-n{i}``, interface ``eth0`` = 10.77.0.{10+i}/24 and 10.77.1.{10+i}/24
       │ veth, tbf rate R on eth0 (uplink) and on its hub end ``p{i}`` (downlink)
    hub: namespace ``mtw-hub``; a switch joins every ``p{i}``

Each node's second address is its low-priority one (``node_dp_ip``): under each tbf, packets to a
10.77.1.x address wait while any other packet is queued (``_shape``), so a process that binds its
DiLoCo sync there (``MESHTUNE_DP_HOST``) has the link's idle time between pipeline crossings for it.

Bandwidth is the kernel's token bucket (``tc qdisc ... tbf``), on both directions of every link.
Latency: netem is not in this kernel, so with ``--delay-ms D > 0`` the hub's switch is a user-space
frame-delay bridge (``benchmarks/wan/bridge.py``, run inside the hub namespace): it
reads every frame from each ``p{i}`` with a raw packet socket, holds it D ms and sends it out of the
port its destination MAC was learned on. A frame therefore takes uplink tbf → D → downlink tbf, so a
TCP round trip gains 2·D, and ACK clocking, slow start and window limits all see the delay. For
raw forwarding the veths' checksum and segmentation offloads are switched off (ethtool ioctls), and
their MTU is 9000 so the bridge handles few frames. With ``--delay-ms 0`` the hub is a kernel bridge.

Nothing here touches the host's own interfaces: every interface is created inside a namespace, and
``down`` only deletes namespaces named ``mtw-*`` (which removes their interfaces) and the bridge
process it started. Root is required (``ip netns``), and refused with a clear message otherwise.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
from dataclasses import asdict, dataclass

from hf_meshtune._validation import require

PREFIX_ENV = "MESHTUNE_NETNS_PREFIX"  # another prefix builds a second, independent star (tests)
SUBNET = "10.77.0"
DP_SUBNET = "10.77.1"  # every node's second address: traffic to it waits for the link's other traffic
MTU = 9000


def prefix() -> str:
    return os.environ.get(PREFIX_ENV, "mtw")


def hub_ns() -> str:
    return f"{prefix()}-hub"


def state_file() -> str:
    return f"/run/{prefix()}-state.json"


def node_ns(i: int) -> str:
    return f"{prefix()}-n{i}"


def node_ip(i: int) -> str:
    return f"{SUBNET}.{10 + i}"


def node_dp_ip(i: int) -> str:
    """Node ``i``'s low-priority address (``MESHTUNE_DP_HOST``): what is sent to it goes after everything else."""
    return f"{DP_SUBNET}.{10 + i}"


@dataclass
class Links:
    """What ``up`` built: every node's link rate and the one-way delay the hub adds."""

    nodes: int
    rate_mbit: float
    delay_ms: float
    bridge_pid: int | None = None

    @property
    def ips(self) -> list[str]:
        return [node_ip(i) for i in range(self.nodes)]


def require_root() -> None:
    require(
        os.geteuid() == 0,
        "user",
        os.getenv("USER", os.geteuid()),
        "be root: network namespaces and tc need CAP_NET_ADMIN (run the benchmark as root, e.g. sudo)",
    )


def _ip(*args: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    cmd = (["ip", "-n", ns] if ns else ["ip"]) + list(args)
    return subprocess.run(cmd, check=check, capture_output=True, text=True)


def _tc(ns: str, *args: str) -> None:
    subprocess.run(["ip", "netns", "exec", ns, "tc", *args], check=True, capture_output=True, text=True)


def namespaces() -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], check=True, capture_output=True, text=True).stdout
    return [line.split()[0] for line in out.splitlines() if line.split() and line.split()[0].startswith(f"{prefix()}-")]


def down() -> None:
    """Remove everything ``up`` made (idempotent): the bridge process, then every ``mtw-*`` namespace."""
    require_root()
    state = read_state()
    if state is not None and state.bridge_pid:
        try:
            os.kill(state.bridge_pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for ns in namespaces():
        _ip("netns", "del", ns, check=False)
    if os.path.exists(state_file()):
        os.remove(state_file())


def read_state() -> Links | None:
    try:
        with open(state_file()) as fh:
            return Links(**json.load(fh))
    except FileNotFoundError:
        return None


def _shape(ns: str, dev: str, rate_mbit: float, *, first: bool = False) -> None:
    """tbf at ``rate_mbit`` on ``dev``'s egress; a deep queue (2 s at the rate) so TCP sees delay, not loss.

    Under the tbf two classes, served in strict order (an HTB whose classes never run out of rate, so it only
    orders them): packets to a node's low-priority address (``DP_SUBNET``) wait in the second while the
    first has any, everything else goes in the first. With no traffic to those addresses the link is the
    single FIFO of before. Each class is a byte FIFO of the queue's depth. ``first``: build the classes
    (``up``); otherwise only the rate changes (``set_rate``).
    """
    rate_bit = int(rate_mbit * 1e6)
    burst = max(2 * MTU + 100, rate_bit // 8 // 100)  # ≥ two frames, ≥ 10 ms at the rate
    limit = max(4 * burst, rate_bit // 8 * 2)
    tbf = ["tbf", "rate", f"{rate_bit}bit", "burst", str(burst), "limit", str(limit)]
    _tc(ns, "qdisc", "replace" if first else "change", "dev", dev, "root", "handle", "1:", *tbf)
    if not first:
        return
    _tc(ns, *f"qdisc add dev {dev} parent 1:1 handle 10: htb default 1".split())
    for band in (1, 2):  # prio 0 before prio 1; 100 Gbit/s: the tbf above sets the rate, not these
        _tc(ns, *f"class add dev {dev} parent 10: classid 10:{band} htb rate 100gbit prio {band - 1}".split())
        _tc(ns, *f"qdisc add dev {dev} parent 10:{band} bfifo limit {limit}".split())
    _tc(
        ns, *f"filter add dev {dev} parent 10: protocol ip prio 1 u32 match ip dst {DP_SUBNET}.0/24 flowid 10:2".split()
    )


def low_priority_sent(ns: str | None = None, dev: str = "eth0") -> dict[str, int]:
    """Bytes and packets ``dev`` has sent from its low-priority class (frames, Ethernet headers included): the
    kernel's qdisc counters, in namespace ``ns`` (None: this process's own, as a worker inside a node reads it)."""
    cmd = ["tc", "-s", "-j", "qdisc", "show", "dev", dev]
    out = subprocess.run((["ip", "netns", "exec", ns] if ns else []) + cmd, check=True, capture_output=True, text=True)
    low = next(q for q in json.loads(out.stdout) if q.get("parent") == "10:2")
    return {"bytes": low["bytes"], "packets": low["packets"]}


def up(nodes: int, rate_mbit: float, delay_ms: float = 0.0) -> Links:
    """Build the star of ``nodes`` namespaces with ``rate_mbit`` links and ``delay_ms`` one-way hub delay."""
    require_root()
    require(isinstance(nodes, int) and 2 <= nodes <= 200, "nodes", nodes, "be an integer in [2, 200]")
    require(rate_mbit > 0, "rate_mbit", rate_mbit, "be > 0 (Mbit/s of every node's link, each direction)")
    require(0 <= delay_ms <= 10_000, "delay_ms", delay_ms, "lie in [0, 10000] (one-way ms added at the hub)")
    down()
    _ip("netns", "add", hub_ns())
    _ip("link", "set", "lo", "up", ns=hub_ns())
    if delay_ms == 0:
        _ip("link", "add", "br0", "type", "bridge", ns=hub_ns())
        _ip("link", "set", "br0", "up", ns=hub_ns())
    for i in range(nodes):
        ns = node_ns(i)
        _ip("netns", "add", ns)
        _ip("link", "set", "lo", "up", ns=ns)
        _ip(
            "link",
            "add",
            "eth0",
            "netns",
            ns,
            "mtu",
            str(MTU),
            "type",
            "veth",
            "peer",
            "name",
            f"p{i}",
            "netns",
            hub_ns(),
            "mtu",
            str(MTU),
            ns=hub_ns(),
        )
        _ip("addr", "add", f"{node_ip(i)}/24", "dev", "eth0", ns=ns)
        _ip("addr", "add", f"{node_dp_ip(i)}/24", "dev", "eth0", ns=ns)
        _ip("link", "set", "eth0", "up", ns=ns)
        _ip("link", "set", f"p{i}", "up", ns=hub_ns())
        if delay_ms == 0:
            _ip("link", "set", f"p{i}", "master", "br0", ns=hub_ns())
        else:
            _run_in(ns, ["offloads-off", "eth0"])
            _run_in(hub_ns(), ["offloads-off", f"p{i}"])
        _shape(ns, "eth0", rate_mbit, first=True)
        _shape(hub_ns(), f"p{i}", rate_mbit, first=True)
    links = Links(nodes, rate_mbit, delay_ms)
    if delay_ms > 0:
        ports = ",".join(f"p{i}" for i in range(nodes))
        proc = subprocess.Popen(
            [
                "ip",
                "netns",
                "exec",
                hub_ns(),
                sys.executable,
                "-m",
                "benchmarks.wan.bridge",
                "forward",
                "--ports",
                ports,
                "--delay-ms",
                str(delay_ms),
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=None,
            start_new_session=True,
            cwd=_repo_root(),
        )
        links.bridge_pid = proc.pid
    with open(state_file(), "w") as fh:
        json.dump(asdict(links), fh)
    _wait_reachable(links)
    return links


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_in(ns: str, args: list[str]) -> None:
    subprocess.run(
        ["ip", "netns", "exec", ns, sys.executable, "-m", "benchmarks.wan.bridge", *args],
        check=True,
        capture_output=True,
        text=True,
        cwd=_repo_root(),
    )


_PROBE_PORT = 29400
_LISTEN = (
    "import socket,sys; s=socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
    "s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64); s.settimeout(float(sys.argv[4]))\n"
    "for _ in range(int(sys.argv[3])): s.accept()[0].close()"
)
_CONNECT = (
    "import socket,sys,time; d=time.monotonic()+float(sys.argv[3])\n"
    "while True:\n"
    "    try: socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=1).close(); break\n"
    "    except OSError:\n"
    "        if time.monotonic() > d: sys.exit(1)\n"
    "        time.sleep(0.1)"
)


def _wait_reachable(links: Links, timeout_s: float = 20.0) -> None:
    """Every node opens a TCP connection to node 0 (the links and the switch work) before ``up`` returns."""
    listener = subprocess.Popen(
        [
            *exec_prefix(0),
            sys.executable,
            "-c",
            _LISTEN,
            node_ip(0),
            str(_PROBE_PORT),
            str(links.nodes - 1),
            str(timeout_s),
        ],
        stderr=subprocess.DEVNULL,
    )
    try:
        for i in range(1, links.nodes):
            ok = (
                subprocess.run(
                    [*exec_prefix(i), sys.executable, "-c", _CONNECT, node_ip(0), str(_PROBE_PORT), str(timeout_s)],
                    capture_output=True,
                ).returncode
                == 0
            )
            if not ok:
                raise RuntimeError(
                    f"node {i} ({node_ip(i)}) cannot reach node 0 ({node_ip(0)}) after "
                    f"{timeout_s:.0f} s: the emulated network did not come up"
                )
        listener.wait(timeout=timeout_s)
    finally:
        if listener.poll() is None:
            listener.kill()


def set_link(i: int, up: bool) -> None:
    """Bring node ``i``'s link down (cut) or back up, as an unplugged cable would."""
    _ip("link", "set", "eth0", "up" if up else "down", ns=node_ns(i))


def set_rate(i: int, rate_mbit: float) -> None:
    """Reshape node ``i``'s link (both directions) to ``rate_mbit``, e.g. a straggler at a tenth."""
    require(rate_mbit > 0, "rate_mbit", rate_mbit, "be > 0 (Mbit/s of the link, each direction)")
    _shape(node_ns(i), "eth0", rate_mbit)
    _shape(hub_ns(), f"p{i}", rate_mbit)


def unavailable() -> str | None:
    """Why network namespaces cannot be made here (None: they can): root and iproute2 are not enough
    without CAP_NET_ADMIN (e.g. an unprivileged container), so the probe makes and removes one."""
    import shutil

    if os.geteuid() != 0 or shutil.which("ip") is None or shutil.which("tc") is None:
        return "network namespaces need root and iproute2 (ip, tc)"
    probe = f"meshtune-probe-{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` fails here (no CAP_NET_ADMIN?): {made.stderr.strip()[:200]}"
    subprocess.run(["ip", "netns", "delete", probe], capture_output=True)
    return None


def pids(i: int) -> list[int]:
    """The processes running in node ``i``'s namespace (a host's launcher and everything it started)."""
    out = subprocess.run(["ip", "netns", "pids", node_ns(i)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def exec_prefix(i: int) -> list[str]:
    """argv prefix that runs a command inside node ``i``'s namespace."""
    return ["ip", "netns", "exec", node_ns(i)]


def tx_bytes(i: int) -> int:
    """Bytes node ``i`` has sent on its link (the kernel's counter, headers included)."""
    out = subprocess.run(
        [*exec_prefix(i), "cat", "/sys/class/net/eth0/statistics/tx_bytes"], check=True, capture_output=True, text=True
    ).stdout
    return int(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.netns", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_up = sub.add_parser("up", help="build the namespaces and shaped links (idempotent)")
    p_up.add_argument("--nodes", type=int, required=True)
    p_up.add_argument("--rate-mbit", type=float, required=True)
    p_up.add_argument("--delay-ms", type=float, default=0.0)
    sub.add_parser("down", help="remove them (idempotent)")
    sub.add_parser("show", help="print what is up")
    args = parser.parse_args(argv)
    try:
        if args.cmd == "up":
            print(json.dumps(asdict(up(args.nodes, args.rate_mbit, args.delay_ms))))
        elif args.cmd == "down":
            down()
        else:
            print(json.dumps({"state": asdict(s) if (s := read_state()) else None, "namespaces": namespaces()}))
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
