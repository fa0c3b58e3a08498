"""Only processes holding the mesh's shared secret get in: a gate that checks a token derived from it,
and a guard on every listening socket of every mesh process that accepts admitted addresses only.

Neither torch's TCPStore, torchft's lighthouse and servers nor gloo's pairs can check a token
themselves, so admission is split in two:

- **The gate** (``Gate``, served by ``meshtune launch`` beside its lighthouse and job store, at
  ``$MESHTUNE_GATE``): a peer proves it holds the secret (``$MESHTUNE_SECRET``, or the contents of
  the file ``$MESHTUNE_SECRET_FILE``) by a challenge and response: the gate sends a fresh nonce, the
  peer answers with its own nonce and HMAC-SHA256(k, "client" ‖ both nonces), k = HMAC-SHA256(secret,
  "hf_meshtune gate v1"), the token derived from the secret. The secret itself never crosses the
  link. A right answer admits the address the peer connected from; the gate answers with the
  admitted addresses, signed the same way, so a peer also knows it reached the mesh's own gate. A
  wrong or missing answer is refused and logged with its reason (``meshtune gate: refused ...``).
- **The guard** (``Guard``, in every process of the mesh and in the launcher): a classic BPF socket
  filter (``SO_ATTACH_FILTER``, no privilege needed) on every listening TCP socket of the process
  (the stores, the lighthouse, torchft's manager and checkpoint servers, gloo's pairs), kept equal to
  the admitted addresses. The kernel drops every packet from another address before the server sees
  it, so a connection from outside never opens.

What this does not do: tell apart two processes behind one address (a NAT, or a second user of an
admitted machine), encrypt anything, or guard a listener created inside torch, torchft or gloo for
the moment before the guard's next scan finds it (``SCAN_PERIOD_S``; the mesh's own code scans again
right after it creates its process groups and servers). Connections already open when a listener is
guarded stay open (they came from the mesh's processes, which knock first).

The guard's filters and its scan are ``comm.guard``; this module holds the secret, the gate, the knock,
and what a launched process does with them (``guard_launched_process``).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable, Mapping

from .._validation import require
from .guard import Guard, _canonical
from .listen import DP_HOST_ENV, listen_address

__all__ = [
    "GATE_ENV",
    "SECRET_ENV",
    "SECRET_FILE_ENV",
    "Gate",
    "GateRefused",
    "Guard",
    "guard_launched_process",
    "knock",
    "secret_key",
]

SECRET_ENV = "MESHTUNE_SECRET"
SECRET_FILE_ENV = "MESHTUNE_SECRET_FILE"
GATE_ENV = "MESHTUNE_GATE"
MIN_SECRET_BYTES = 16
MAX_ADMITTED = 200  # addresses the gate admits: far more than a mesh has hosts
HELLO_TIMEOUT_S = 5.0  # a peer that sends no token within this is refused
REFRESH_PERIOD_S = 0.5  # a process asks the gate for the admitted addresses this often
_MAGIC = b"MTGATE1\n"
_NONCE = 32
_MAC = 32
_MAX_PENDING = 32  # handshakes served at once; more are refused at once (no thread per flood)


class GateRefused(ConnectionError):
    """The mesh's gate refused this process, or the peer at the gate's address is not the mesh's gate."""


# ---------------------------------------------------------------------------------------------------
# The secret and its token
# ---------------------------------------------------------------------------------------------------


def secret_key(env: Mapping[str, str] | None = None) -> bytes | None:
    """The key derived from ``$MESHTUNE_SECRET`` or the file ``$MESHTUNE_SECRET_FILE``; None without either."""
    env = os.environ if env is None else env
    value, path = env.get(SECRET_ENV), env.get(SECRET_FILE_ENV)
    require(not (value and path), SECRET_FILE_ENV, path, f"be unset when {SECRET_ENV} is set (one secret, one source)")
    if path:
        try:
            with open(path, "rb") as handle:
                secret = handle.read().rstrip(b"\r\n")
        except OSError as err:
            require(False, SECRET_FILE_ENV, path, f"name a readable file holding the mesh's secret ({err.strerror})")
            raise  # unreachable: require raised
        require(
            len(secret) >= MIN_SECRET_BYTES,
            SECRET_FILE_ENV,
            path,
            f"hold a secret of at least {MIN_SECRET_BYTES} bytes (it holds {len(secret)})",
        )
    elif value is not None:
        secret = value.encode()
        require(
            len(secret) >= MIN_SECRET_BYTES,
            SECRET_ENV,
            "<hidden>",
            f"be at least {MIN_SECRET_BYTES} bytes long (it is {len(secret)}), e.g. `openssl rand -hex 32`",
        )
    else:
        return None
    return hmac.new(secret, b"hf_meshtune gate v1", hashlib.sha256).digest()


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(parts), hashlib.sha256).digest()


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError(f"closed after {len(data)} of {n} bytes")
        data += chunk
    return bytes(data)


# ---------------------------------------------------------------------------------------------------
# The gate
# ---------------------------------------------------------------------------------------------------


class Gate:
    """Admits the addresses of peers that prove they hold the secret; serves on ``host``, ``port`` (0: a free one).

    ``address``: "host:port" to give the mesh's processes (``$MESHTUNE_GATE``). ``admitted()``: the
    admitted addresses. ``refusals``: (peer "ip:port", reason) of every refused handshake.
    ``on_admit(addresses)`` is called after each new admission (the launcher's own guard)."""

    def __init__(
        self, key: bytes, host: str, on_admit: Callable[[list[str]], object] | None = None, port: int = 0
    ) -> None:
        self._key = key
        self._on_admit = on_admit
        self._lock = threading.Lock()
        self._admitted: list[str] = []
        self.refusals: list[tuple[str, str]] = []
        self._pending = threading.Semaphore(_MAX_PENDING)
        bind = listen_address(host)
        family = socket.AF_INET6 if ":" in bind else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind((bind, port))
        self._sock.listen(128)
        self.inode = os.fstat(self._sock.fileno()).st_ino  # the one listener the guards leave open
        port = self._sock.getsockname()[1]
        self.address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        self._closed = False
        self._thread = threading.Thread(target=self._accept, name="meshtune-gate", daemon=True)
        self._thread.start()

    def admitted(self) -> list[str]:
        with self._lock:
            return list(self._admitted)

    def close(self) -> None:
        self._closed = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._sock.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                conn, peer = self._sock.accept()
            except OSError:
                return
            if not self._pending.acquire(blocking=False):
                self._refuse(conn, peer, f"more than {_MAX_PENDING} handshakes at once")
                continue
            threading.Thread(target=self._serve, args=(conn, peer), name="meshtune-gate-peer", daemon=True).start()

    def _serve(self, conn: socket.socket, peer: tuple) -> None:
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            nonce = secrets.token_bytes(_NONCE)
            conn.sendall(_MAGIC + nonce)
            answer = _recv_exact(conn, _NONCE + _MAC)  # a fixed size: nothing a peer sends sizes an allocation
            theirs, mac = answer[:_NONCE], answer[_NONCE:]
            if not hmac.compare_digest(mac, _mac(self._key, b"client", nonce, theirs)):
                self._refuse(conn, peer, "its token does not match this mesh's secret (MESHTUNE_SECRET)")
                return
            address = _canonical(peer[0])
            with self._lock:
                new = address not in self._admitted
                if new and len(self._admitted) >= MAX_ADMITTED:
                    full = True
                else:
                    full = False
                    if new:
                        self._admitted.append(address)
                admitted = list(self._admitted)
            if full:
                self._refuse(conn, peer, f"the gate already admits {MAX_ADMITTED} addresses, its most")
                return
            if new and self._on_admit is not None:
                self._on_admit(admitted)
            payload = "\n".join(admitted).encode()
            conn.sendall(
                b"OK" + struct.pack("!H", len(payload)) + payload + _mac(self._key, b"gate", theirs, nonce, payload)
            )
        except socket.timeout:
            self._refuse(conn, peer, f"it sent no token within {HELLO_TIMEOUT_S:g} s")
        except (EOFError, OSError) as err:
            self._refuse(conn, peer, f"it broke off the handshake ({err})")
        finally:
            conn.close()
            self._pending.release()

    def _refuse(self, conn: socket.socket, peer: tuple, reason: str) -> None:
        where = f"{peer[0]}:{peer[1]}"
        with self._lock:
            self.refusals.append((where, reason))
        print(f"meshtune gate: refused {where}: {reason}", file=sys.stderr, flush=True)
        try:
            conn.sendall(b"NO")
        except OSError:
            pass
        conn.close()


def knock(address: str, key: bytes, timeout_s: float = 10.0, source: str | None = None) -> list[str]:
    """Prove the secret to the gate at ``address`` ("host:port"); the addresses it admits, this one's included.
    ``source``: the local address to knock from, and so to admit (None: the one the route picks).

    Raises ``GateRefused`` when the gate refuses the token or does not sign its answer with the secret."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]")
    bind = None if source is None else (source, 0)
    with socket.create_connection((host, int(port)), timeout=timeout_s, source_address=bind) as sock:
        hello = _recv_exact(sock, len(_MAGIC) + _NONCE)
        if hello[: len(_MAGIC)] != _MAGIC:
            raise GateRefused(f"{GATE_ENV}={address!r} is not a meshtune gate (it did not greet as one)")
        theirs, mine = hello[len(_MAGIC) :], secrets.token_bytes(_NONCE)
        sock.sendall(mine + _mac(key, b"client", theirs, mine))
        verdict = _recv_exact(sock, 2)
        if verdict != b"OK":
            raise GateRefused(
                f"the mesh's gate at {address} refused this process: its {SECRET_ENV} (or {SECRET_FILE_ENV}) "
                "is not the mesh's secret"
            )
        (size,) = struct.unpack("!H", _recv_exact(sock, 2))
        payload = _recv_exact(sock, size)
        if not hmac.compare_digest(_recv_exact(sock, _MAC), _mac(key, b"gate", mine, theirs, payload)):
            raise GateRefused(
                f"the gate at {address} does not hold this mesh's secret (its answer is not signed with it)"
            )
    return [_canonical(a) for a in payload.decode().split("\n") if a]


class _Admissions:
    """The admitted addresses as a launched process sees them: refreshed from the gate every
    ``REFRESH_PERIOD_S``; the last answer is kept while the gate cannot be reached. With ``$MESHTUNE_DP_HOST``
    set the process knocks from that address too, since its DiLoCo pairs connect from there."""

    def __init__(self, gate: str, key: bytes) -> None:
        self._gate, self._key = gate, key
        dp = os.environ.get(DP_HOST_ENV)
        self._sources = [None] + ([listen_address(dp, field=DP_HOST_ENV)] if dp else [])
        self._addresses = self._knock(10.0)  # raises GateRefused: a process without the secret stops here
        self._asked = time.monotonic()
        self._warned = False

    def _knock(self, timeout_s: float) -> list[str]:
        for source in self._sources:  # the last answer lists every address admitted so far
            addresses = knock(self._gate, self._key, timeout_s=timeout_s, source=source)
        return addresses

    def __call__(self) -> list[str]:
        if time.monotonic() - self._asked >= REFRESH_PERIOD_S:
            self._asked = time.monotonic()
            try:
                self._addresses = self._knock(2.0)
                self._warned = False
            except OSError as err:  # the launcher is gone or a link is cut: keep what was admitted
                if isinstance(err, GateRefused):
                    raise
                if not self._warned:
                    print(f"meshtune guard: gate {self._gate} unreachable ({err}); keeping the admitted addresses",
                          file=sys.stderr, flush=True)  # fmt: skip
                    self._warned = True
        return list(self._addresses)


_GUARD: list[Guard] = []


def guard_launched_process() -> Guard | None:
    """In a process of a mesh started with a secret: knock at ``$MESHTUNE_GATE`` and guard every
    listening socket of this process from now on. Nothing without a secret and a gate. Call it before
    the process group exists; calling again rescans at once (after creating servers)."""
    if _GUARD:
        _GUARD[0].scan()
        return _GUARD[0]
    key, gate = secret_key(), os.environ.get(GATE_ENV)
    if gate is None:
        require(
            key is None,
            GATE_ENV,
            None,
            f"be set when {SECRET_ENV} or {SECRET_FILE_ENV} is: a secret needs `meshtune launch`, whose gate admits "
            "the mesh's processes (torchrun's own rendezvous store cannot be guarded)",
        )
        return None
    require(
        key is not None,
        SECRET_ENV,
        None,
        f"be set (or {SECRET_FILE_ENV}) in every process of a mesh with a gate ({GATE_ENV}={gate}): the mesh "
        "admits only processes holding its secret",
    )
    assert key is not None
    _GUARD.append(Guard(_Admissions(gate, key)))
    return _GUARD[0]
