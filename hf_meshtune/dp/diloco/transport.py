"""torchft's checkpoint server (how a restarted replica fetches a peer's state), listening on and named by
the address peers reach it at."""

from __future__ import annotations

import socket
from http.server import ThreadingHTTPServer
from typing import Any

from torchft.checkpointing import http_transport as torchft_http_transport
from torchft.checkpointing.http_transport import HTTPTransport

from ...comm.listen import listen_address

__all__ = ["AdvertisedHTTPTransport"]


def _http_server_at(address: str) -> type[ThreadingHTTPServer]:
    """torchft's checkpoint HTTP server class (daemon threads, a deep backlog), listening on ``address``
    whatever address torchft asks for (it asks for every interface)."""
    family = socket.AF_INET6 if ":" in address else socket.AF_INET

    class BoundHTTPServer(ThreadingHTTPServer):
        address_family = family
        daemon_threads = True
        request_queue_size = 1024

        def __init__(self, server_address, handler) -> None:
            super().__init__((address, server_address[1]), handler)

    return BoundHTTPServer


class AdvertisedHTTPTransport(HTTPTransport):
    """torchft's checkpoint server (how a restarted replica fetches a peer's state), named by the
    address peers reach it at: torchft's own names the hostname, which from another machine or
    network namespace may resolve to an interface the server is not reachable on (the heal then
    fails with "Connection refused"). torchft's server would listen on every interface; this one
    listens on ``listen_address(host)`` only (``comm.listen``)."""

    def __init__(self, host: str | None, **kwargs: Any) -> None:
        self._advertised = host
        original = torchft_http_transport._IPv6HTTPServer
        torchft_http_transport._IPv6HTTPServer = _http_server_at(listen_address(host))
        try:
            super().__init__(**kwargs)
        finally:
            torchft_http_transport._IPv6HTTPServer = original

    def address(self) -> str:
        if self._advertised is None:
            return super().address()
        return f"http://{self._advertised}:{self._server.socket.getsockname()[1]}/checkpoint/"
