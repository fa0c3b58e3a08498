"""Where the mesh's services listen: on one address, never on every interface.

A mesh process runs up to six servers: torch's rendezvous store (rank 0 of a world), a replica's
TCPStore and torchft's manager server (stage 0 of a fast replica), torchft's checkpoint server
(every fast process), the launcher's job store and torchft's lighthouse (the launcher). Left to
themselves, all but the lighthouse listen on every interface. Here each is bound to
``listen_address()``: the address of ``$MESHTUNE_HOST`` (``meshtune launch --host``), else of the
hostname, the same address the process advertises to its peers. Gloo's own pairs listen on the
interface ``GLOO_SOCKET_IFNAME`` names, which ``gloo_interface`` finds for ``$MESHTUNE_HOST``; the
DiLoCo sync's pairs on ``$MESHTUNE_DP_HOST`` where it is set (``dp_gloo_device``).

What this does not do: authenticate peers. That is ``comm.gate``'s part (a shared secret, checked at
the launcher's gate, and a filter on every listening socket of the process; docs/guides/security.md).
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
from collections.abc import Iterator
from datetime import timedelta
from typing import Any

import torch.distributed as dist

from .._validation import require

__all__ = [
    "DP_HOST_ENV",
    "HOST_ENV",
    "advertised_host",
    "dp_gloo_device",
    "bind_spec",
    "bound_store",
    "gloo_interface",
    "listen_address",
    "serve_rendezvous_store",
]

HOST_ENV = "MESHTUNE_HOST"
DP_HOST_ENV = "MESHTUNE_DP_HOST"
_RENDEZVOUS: list = []  # the rendezvous store this process serves, alive as long as the process


def advertised_host() -> str:
    """The address other machines reach this process at: ``$MESHTUNE_HOST``, else the hostname.

    torchft's servers and the replica stores advertise the hostname, which on a multi-homed machine
    (or inside a network namespace) may name an interface the peers cannot reach; set MESHTUNE_HOST
    to the address of the interface the mesh runs on (as GLOO_SOCKET_IFNAME picks gloo's).
    """
    return os.environ.get(HOST_ENV) or socket.gethostname()


def listen_address(host: str | None = None, *, field: str = HOST_ENV) -> str:
    """The IP address servers bind to: ``host`` (default ``advertised_host()``), resolved if a name;
    ``field`` is what an error names."""
    name = host or advertised_host()
    try:
        return str(ipaddress.ip_address(name.strip("[]")))
    except ValueError:
        pass
    try:
        return str(socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)[0][4][0])  # an IP's text: str already
    except OSError:
        require(False, field, name, "resolve to an address of this machine for the mesh's servers to listen on")
        raise  # unreachable: require raised


def dp_gloo_device():
    """The gloo device of the DiLoCo sync's process group: bound to ``$MESHTUNE_DP_HOST``, or None where it is
    unset (gloo's own device: ``GLOO_SOCKET_IFNAME``'s interface, as every other group of the mesh).

    Why a second address: on a link the sync shares with the pipeline's crossings, its bytes (megabytes per
    fragment) queue in front of a crossing (kilobytes) that the next step waits for. On an address of its own
    the network can tell the two apart, e.g. a ``tc`` filter on the uplink that serves the sync's packets only
    when no crossing waits (``benchmarks/wan/netns.py``), so an overlapped sync (``dp_sync_delay``) fills the
    link's idle time instead of delaying the steps it overlaps. Every fast process of the mesh needs one, and
    the peers must reach it: the pairs connect to the address each process binds."""
    host = os.environ.get(DP_HOST_ENV)
    if not host:
        return None
    address = listen_address(host, field=DP_HOST_ENV)
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((address, 0))
        except OSError as err:
            require(
                False,
                DP_HOST_ENV,
                host,
                f"be an address of this machine (it resolves to {address}, which cannot be bound here: "
                f"{err.strerror}; the DiLoCo sync's gloo pairs bind to it)",
            )
    return dist.ProcessGroupGloo.create_device(hostname=address)


def bind_spec(address: str, port: int = 0) -> str:
    """``address:port`` as torchft's servers take it (IPv6 in brackets)."""
    return f"[{address}]:{port}" if ":" in address else f"{address}:{port}"


def _listening_fd(address: str, port: int) -> tuple[int, int]:
    """A socket bound to ``address:port`` and listening: (its descriptor, owned by the caller from now; its port)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((address, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise OSError(
            err.errno,
            f"cannot listen on {address}:{port} ({err.strerror}): {HOST_ENV} (`meshtune launch --host`) and "
            "MASTER_ADDR must be addresses of this machine",
        ) from err
    port = sock.getsockname()[1]
    return sock.detach(), port  # the store's server closes the descriptor


def bound_store(
    address: str, port: int = 0, *, timeout_s: float | None = None, multi_tenant: bool = False
) -> dist.TCPStore:
    """A TCPStore server listening on ``address`` only (torch's own listens on every interface)."""
    fd, port = _listening_fd(address, port)
    kwargs: dict[str, Any] = {} if timeout_s is None else {"timeout": timedelta(seconds=timeout_s)}
    return dist.TCPStore(
        address, port, is_master=True, wait_for_workers=False, multi_tenant=multi_tenant, master_listen_fd=fd, **kwargs
    )


def serve_rendezvous_store() -> None:
    """In rank 0 of a launched world, before its process group exists: serve torch's rendezvous store
    at MASTER_ADDR:MASTER_PORT bound to that address. torch's ``env://`` rendezvous then shares this
    server (its stores are multi-tenant) instead of starting one on every interface. Nothing to do
    where a launcher's agent serves the store (torchrun: TORCHELASTIC_USE_AGENT_STORE)."""
    env = os.environ
    if (
        _RENDEZVOUS
        or env.get("RANK") != "0"
        or int(env.get("WORLD_SIZE", "1")) <= 1
        or not env.get("MASTER_ADDR")
        or not env.get("MASTER_PORT")
        or env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true"
        or dist.is_initialized()
    ):
        return
    _RENDEZVOUS.append(bound_store(listen_address(env["MASTER_ADDR"]), int(env["MASTER_PORT"]), multi_tenant=True))


def gloo_interface() -> None:
    """Point gloo's pairs at ``$MESHTUNE_HOST``'s interface (``GLOO_SOCKET_IFNAME``) unless it is set."""
    host = os.environ.get(HOST_ENV)
    if not host or os.environ.get("GLOO_SOCKET_IFNAME"):
        return
    import psutil  # accelerate's dependency

    address = listen_address(host)
    for name, addresses in psutil.net_if_addrs().items():
        if any(a.address.split("%")[0] == address for a in addresses):
            os.environ["GLOO_SOCKET_IFNAME"] = name
            return


@contextlib.contextmanager
def manager_server_bound_to(address: str) -> Iterator[None]:
    """While a torchft ``Manager`` is built: its manager server binds to ``address`` (torchft hard-codes
    ``[::]``, every interface), on the port it would have used."""
    import torchft.manager as tm

    original = tm.ManagerServer

    def bound(**kwargs):
        kwargs["bind"] = bind_spec(address, int(kwargs["bind"].rsplit(":", 1)[1]))
        return original(**kwargs)

    tm.ManagerServer = bound
    try:
        yield
    finally:
        tm.ManagerServer = original
