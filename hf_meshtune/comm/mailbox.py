"""Background threads on the anchor link, so neither end of a fast step ever waits for the anchor.

``Sender.put`` queues a tensor and returns; a thread sends it (blocking, on the ``Wire``).
``Receiver`` receives whole messages (header, then payload) of one ``Channel`` from one peer into a
queue that the owner polls without waiting (``ready``) or waits on (``next``). gloo's
``irecv(...).is_completed()`` never turns True on CPU, hence threads rather than polled requests.
"""

from __future__ import annotations

import queue
import sys
import threading

import torch

from .messages import STOP, Channel, HeaderRules, MalformedHeader, admit
from .wire import Wire

__all__ = ["Receiver", "Sender"]


class Sender:
    """Blocking point-to-point sends on a background thread: ``put`` never waits for the peer."""

    def __init__(self, wire: Wire, group, circuit: str) -> None:
        self.wire, self.group, self.circuit = wire, group, circuit
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-sender")
        self.thread.start()

    def put(self, dst: int, tag: int, tensor: torch.Tensor) -> None:
        if self.error is None:  # after a failed send nothing more goes out (close() reports it)
            self.queue.put((dst, tag, tensor))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            dst, tag, tensor = item
            try:
                self.wire.send(self.circuit, tensor, dst, group=self.group, tag=tag)
            except BaseException as error:  # noqa: BLE001 - reported by close()
                self.error = error
                return

    def close(self) -> None:
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"sending to the anchor link failed: {self.error}") from self.error


class Receiver:
    """Receives ``channel``'s messages from ``src`` on a background thread, until a STOP header.

    Every header is admitted by ``rules`` (``messages.admit``: kinds, steps, indices and the payload's
    exact size) before its payload is allocated and received; one that is not is logged, kept in
    ``rejected`` as (header, reason) and skipped, and the receiver goes on. The queue holds
    ``(header, payload)`` per message and None after a STOP (or a failure: ``error``).
    """

    def __init__(
        self,
        wire: Wire,
        group,
        src: int,
        channel: Channel,
        rules: HeaderRules,
        circuit: str = "anchor",
    ) -> None:
        self.wire, self.group, self.src, self.channel = wire, group, src, channel
        self.rules, self.circuit = rules, circuit
        self.rejected: list[tuple[tuple, str]] = []
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-receiver")
        self.thread.start()

    def _loop(self) -> None:
        try:
            while True:
                buffer = self.channel.empty()
                self.wire.recv(self.circuit, buffer, self.src, group=self.group, tag=self.channel.header_tag)
                header = self.channel.decode(buffer)
                try:
                    numel = admit(self.channel, header, self.rules)
                except MalformedHeader as reason:
                    self._reject(header, str(reason))
                    continue
                if header.kind == STOP:
                    self.queue.put(None)
                    return
                payload = torch.empty(numel, dtype=torch.float32)
                if payload.numel():
                    self.wire.recv(self.circuit, payload, self.src, group=self.group, tag=self.channel.payload_tag)
                self.queue.put((header, payload))
        except BaseException as error:  # noqa: BLE001 - surfaced to the main thread
            self.error = error
            self.queue.put(None)

    def _reject(self, header: tuple, reason: str) -> None:
        self.rejected.append((tuple(header), reason))
        print(f"hf_meshtune: rejected a message from rank {self.src} on the anchor link: {reason}", file=sys.stderr)

    def ready(self) -> list:
        """Every message that has arrived, without waiting (a STOP shows as None)."""
        out = []
        while True:
            try:
                out.append(self.queue.get_nowait())
            except queue.Empty:
                return out

    def next(self):
        """The next message, waiting for it (None after STOP)."""
        return self.queue.get()

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"receiving on the anchor link failed: {self.error}") from self.error
