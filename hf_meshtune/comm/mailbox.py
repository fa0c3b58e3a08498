"""Background threads on the anchor link, so neither end of a fast step ever waits for the anchor.

``Sender.put`` queues a tensor and returns; a thread sends it (blocking, on the ``Wire``), in chunks
(``comm.pacing``) spaced by the link's rate cap when it has one.
``Receiver`` receives whole messages (header, then payload) of one ``Channel`` from one peer into a
queue that the owner polls without waiting (``ready``) or waits on (``next``). gloo's
``irecv(...).is_completed()`` never turns True on CPU, hence threads rather than polled requests.

On the restartable link of replica jobs (``comm.pairlink.PairLinks``) a broken pair is not the end:
the receiver waits for the next pair and goes on with the next whole message (``relinks`` counts
them), and the sender sends each message only over the pair it was queued for (``put(...,
generation=)``), dropping what was queued for a pair that is gone (``dropped``).
"""

from __future__ import annotations

import queue
import sys
import threading

import torch

from .errors import LinkDown
from .messages import STOP, Channel, HeaderRules, MalformedHeader, admit
from .pacing import Pace, chunks
from .pairlink import PairLinks
from .wire import Wire

__all__ = ["Receiver", "Sender"]


class Sender:
    """Blocking point-to-point sends on a background thread: ``put`` never waits for the peer.
    ``pace``: the link's rate cap (None: chunks go as fast as the link takes them)."""

    def __init__(self, wire: Wire, group, circuit: str, pace: Pace | None = None) -> None:
        self.wire, self.group, self.circuit, self.pace = wire, group, circuit, pace
        self.queue: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.dropped = 0  # restartable link: messages queued for a pair that broke before they went
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-sender")
        self.thread.start()

    def put(self, dst: int, tag: int, tensor: torch.Tensor, generation: int | None = None) -> None:
        """Queue a send; on the restartable link, ``generation`` names the pair it must go over."""
        if self.error is None:  # after a failed send nothing more goes out (close() reports it)
            self.queue.put((dst, tag, tensor, generation))

    def _loop(self) -> None:
        while True:
            item = self.queue.get()
            if item is None:
                return
            dst, tag, tensor, generation = item
            group = self.group
            if isinstance(group, PairLinks):
                group = group.current(dst, generation)
                if group is None:  # that pair is gone: the next one starts with a SYNC
                    self.dropped += 1
                    continue
            try:
                for chunk in chunks(tensor):
                    if self.pace is not None:
                        self.pace.wait(chunk.numel() * chunk.element_size())
                    self.wire.send(self.circuit, chunk, dst, group=group, tag=tag)
            except LinkDown:  # the pair broke (and is being rebuilt)
                self.dropped += 1
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
        self.relinks = 0  # restartable link: messages given up because their pair broke
        self.thread = threading.Thread(target=self._loop, daemon=True, name="mesh-receiver")
        self.thread.start()

    def _loop(self) -> None:
        links = self.group if isinstance(self.group, PairLinks) else None
        try:
            while True:
                group = self.group if links is None else links.pinned(self.src)  # LinkDown once closed
                try:
                    if self._receive(group):
                        return
                except LinkDown:
                    if links is None:
                        raise
                    self.relinks += 1  # the pair broke: wait for the next one
        except BaseException as error:  # noqa: BLE001 - surfaced to the main thread
            self.error = error
            self.queue.put(None)

    def _receive(self, group) -> bool:
        """One whole message over ``group`` into the queue (True: it was the STOP)."""
        buffer = self.channel.empty()
        self.wire.recv(self.circuit, buffer, self.src, group=group, tag=self.channel.header_tag)
        header = self.channel.decode(buffer)
        try:
            numel = admit(self.channel, header, self.rules)
        except MalformedHeader as reason:
            self._reject(header, str(reason))
            return False
        if header.kind == STOP:
            self.queue.put(None)
            return True
        payload = torch.empty(numel, dtype=torch.float32)
        for chunk in chunks(payload):  # cut as the sender cut it
            self.wire.recv(self.circuit, chunk, self.src, group=group, tag=self.channel.data_tag)
        self.queue.put((header, payload))
        return False

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

    def join(self, timeout_s: float | None = None) -> None:
        """Wait for the STOP; on the restartable link, past ``timeout_s`` the link is closed first."""
        self.thread.join(timeout_s)
        if self.thread.is_alive() and isinstance(self.group, PairLinks):
            self.group.close()  # the peer is gone for good: the wait for its next pair ends
        self.thread.join()
        if self.error is not None:
            raise RuntimeError(f"receiving on the anchor link failed: {self.error}") from self.error
