"""The guard: a classic BPF socket filter (``SO_ATTACH_FILTER``, no privilege needed) on every listening TCP
socket of a process, kept equal to the addresses the mesh's gate admitted (``comm.gate``). The kernel
drops every packet from another address before the server sees it, so a connection from outside never
opens. Listeners created inside torch, torchft or gloo are found by a scan of ``/proc/self/fd`` every
``SCAN_PERIOD_S``."""

from __future__ import annotations

import ctypes
import ipaddress
import os
import socket
import struct
import sys
import threading
from collections.abc import Callable, Iterable

__all__ = ["SCAN_PERIOD_S", "Guard", "attach_filter", "filter_program"]

SCAN_PERIOD_S = 0.25  # the guard looks for new listening sockets this often


def _canonical(address: str) -> str:
    """An address as the kernel reports peers: an IPv4-mapped IPv6 address becomes the IPv4 one."""
    ip = ipaddress.ip_address(address.split("%")[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return str(ip)


_SO_ATTACH_FILTER = 26
_SKF_NET_OFF = -0x100000 & 0xFFFFFFFF  # loads relative to the IP header
_LD_W, _LD_B = 0x20, 0x30  # BPF_LD | BPF_W/B | BPF_ABS
_RSH_K = 0x74  # BPF_ALU | BPF_RSH | BPF_K
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JA = 0x05  # BPF_JMP | BPF_JA
_RET_K = 0x06
_ACCEPT, _DROP = 0xFFFFFFFF, 0


def filter_program(addresses: Iterable[str]) -> list[tuple[int, int, int, int]]:
    """A classic BPF program (code, jt, jf, k) that keeps the packets whose IP source is in ``addresses``."""
    v4: list[bytes] = []
    v6: list[bytes] = []
    for a in addresses:
        ip = ipaddress.ip_address(_canonical(a))
        (v4 if ip.version == 4 else v6).append(ip.packed)
    four = [(_LD_W, 0, 0, _SKF_NET_OFF + 12)]
    for packed in v4:
        four += [(_JEQ_K, 0, 1, struct.unpack("!I", packed)[0]), (_RET_K, 0, 0, _ACCEPT)]
    four.append((_RET_K, 0, 0, _DROP))
    six = [(_JEQ_K, 1, 0, 6), (_RET_K, 0, 0, _DROP)]
    for packed in v6:
        words = struct.unpack("!4I", packed)
        for i, word in enumerate(words):
            left = 2 * (3 - i) + 1  # instructions after this compare up to and including the accept
            six += [(_LD_W, 0, 0, _SKF_NET_OFF + 8 + 4 * i), (_JEQ_K, 0, left, word)]
        six.append((_RET_K, 0, 0, _ACCEPT))
    six.append((_RET_K, 0, 0, _DROP))
    head = [(_LD_B, 0, 0, _SKF_NET_OFF), (_RSH_K, 0, 0, 4), (_JEQ_K, 1, 0, 4), (_JA, 0, 0, len(four))]
    return head + four + six


def attach_filter(sock: socket.socket, addresses: Iterable[str]) -> None:
    """Make the kernel drop every packet to ``sock`` (and to the connections it accepts from now on)
    whose source is not in ``addresses``."""
    program = filter_program(addresses)
    code = ctypes.create_string_buffer(b"".join(struct.pack("HBBI", *ins) for ins in program))
    fprog = struct.pack("HL", len(program), ctypes.addressof(code))  # struct sock_fprog
    sock.setsockopt(socket.SOL_SOCKET, _SO_ATTACH_FILTER, fprog)


def _listening_sockets() -> Iterable[tuple[int, socket.socket]]:
    """(inode, a duplicate) of every listening TCP socket of this process; close each duplicate."""
    for name in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not link.startswith("socket:["):
            continue
        try:
            sock = socket.socket(fileno=os.dup(int(name)))
        except OSError:
            continue
        try:
            tcp = sock.type == socket.SOCK_STREAM and sock.family in (socket.AF_INET, socket.AF_INET6)
            if tcp and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
                yield int(link[8:-1]), sock
                continue
        except OSError:
            pass
        sock.close()


class Guard:
    """Keeps the filter of every listening TCP socket of this process equal to ``admitted()``.

    A thread rescans every ``SCAN_PERIOD_S`` (new listeners, a changed list); ``scan()`` does it now.
    ``exempt``: inodes of listeners left open (the gate's own). ``ports``: guard only the listeners on
    these local ports (the launcher guards its own servers, not its host process's others)."""

    def __init__(
        self, admitted: Callable[[], list[str]], exempt: Iterable[int] = (), ports: set[int] | None = None
    ) -> None:
        self._admitted = admitted
        self._exempt = set(exempt)
        self._ports = ports  # None: every listener; else only those on these ports (read at each scan)
        self._guarded: dict[int, tuple[str, ...]] = {}  # inode -> the addresses its filter keeps
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.scan()
        self._thread = threading.Thread(target=self._run, name="meshtune-guard", daemon=True)
        self._thread.start()

    def guarded(self) -> dict[int, tuple[str, ...]]:
        with self._lock:
            return dict(self._guarded)

    def scan(self) -> int:
        """Guard every listener that is new or whose admitted addresses changed; how many were (re)guarded."""
        with self._lock:
            allowed = tuple(sorted(set(self._admitted())))
            changed, alive = 0, set()
            for inode, sock in _listening_sockets():
                with sock:
                    alive.add(inode)
                    if inode in self._exempt or self._guarded.get(inode) == allowed:
                        continue
                    if self._ports is not None and sock.getsockname()[1] not in self._ports:
                        continue
                    attach_filter(sock, allowed)
                    self._guarded[inode] = allowed
                    changed += 1
            for gone in set(self._guarded) - alive:
                del self._guarded[gone]
            return changed

    def stop(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while not self._stop.wait(SCAN_PERIOD_S):
            try:
                self.scan()
            except Exception as err:  # a guard that dies silently would leave new listeners open
                print(f"meshtune guard: scan failed ({err!r}); retrying", file=sys.stderr, flush=True)
