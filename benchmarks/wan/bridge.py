"""The hub's frame-delay switch and the offload switch of the emulated WAN (see ``netns.py``).

Kept free of ``hf_meshtune`` imports so that it starts in a fraction of a second inside a namespace:

    python -m benchmarks.wan.bridge offloads-off eth0
    python -m benchmarks.wan.bridge forward --ports p0,p1,p2 --delay-ms 20
"""

from __future__ import annotations

import argparse
import ctypes
import fcntl
import heapq
import select
import signal
import socket
import struct
import sys
import time

_SIOCETHTOOL = 0x8946
_ETHTOOL_SET = {"tx-checksum": 0x17, "scatter-gather": 0x19, "tso": 0x1F, "gso": 0x24, "gro": 0x2C}


def offloads_off(dev: str) -> None:
    """Switch off checksum/segmentation offloads of ``dev`` (in this process's namespace)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for name, cmd in _ETHTOOL_SET.items():
            value = ctypes.create_string_buffer(struct.pack("II", cmd, 0))
            ifreq = struct.pack("16sP", dev.encode(), ctypes.addressof(value))
            try:
                fcntl.ioctl(sock.fileno(), _SIOCETHTOOL, ifreq)
            except OSError as exc:
                raise RuntimeError(f"cannot switch off {name} offload on {dev}: {exc}") from exc


_ETH_P_ALL = 0x0003
_PACKET_OUTGOING = 4


def bridge(ports: list[str], delay_ms: float) -> None:
    """Forward frames between ``ports`` like a learning switch, each one ``delay_ms`` late. Runs forever."""
    socks = {}
    for port in ports:
        sock = socket.socket(socket.AF_PACKET, socket.SOCK_RAW, socket.htons(_ETH_P_ALL))
        sock.bind((port, 0))
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
        sock.setblocking(False)
        socks[sock.fileno()] = (port, sock)
    by_name = {port: sock for _, (port, sock) in socks.items()}
    learned: dict[bytes, str] = {}
    pending: list[tuple[float, int, str, bytes]] = []
    delay = delay_ms / 1000.0
    seq = 0
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    while True:
        now = time.monotonic()
        while pending and pending[0][0] <= now:
            _, _, out, frame = heapq.heappop(pending)
            try:
                by_name[out].send(frame)
            except OSError:  # a full queue drops the frame, as a router would; TCP resends it
                pass
        timeout = max(0.0, pending[0][0] - now) if pending else 1.0
        readable, _, _ = select.select(list(socks), [], [], timeout)
        arrived = time.monotonic()
        for fd in readable:
            port, sock = socks[fd]
            while True:
                try:
                    frame, addr = sock.recvfrom(65536)
                except BlockingIOError:
                    break
                if addr[2] == _PACKET_OUTGOING or len(frame) < 14:
                    continue
                dst, src = frame[:6], frame[6:12]
                learned[src] = port
                outs = [learned[dst]] if dst in learned and not dst[0] & 1 else [p for p in ports if p != port]
                for out in outs:
                    if out != port:
                        seq += 1
                        heapq.heappush(pending, (arrived + delay, seq, out, frame))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.wan.bridge")
    sub = parser.add_subparsers(dest="cmd", required=True)
    p_off = sub.add_parser("offloads-off", help="switch off checksum/segmentation offloads of a device")
    p_off.add_argument("dev")
    p_fw = sub.add_parser("forward", help="run the frame-delay switch between ports (forever)")
    p_fw.add_argument("--ports", required=True)
    p_fw.add_argument("--delay-ms", type=float, required=True)
    args = parser.parse_args(argv)
    if args.cmd == "offloads-off":
        offloads_off(args.dev)
    else:
        bridge(args.ports.split(","), args.delay_ms)
    return 0


if __name__ == "__main__":
    sys.exit(main())
