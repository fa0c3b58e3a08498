"""How a broken link reads: which backend errors are network failures, and the message that names the peers."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence

import torch.distributed as dist

__all__ = ["LinkDown", "is_link_error", "naming_the_peers"]

# gloo's transport errors; a pending send whose pair timed out reads "Application timeout caused pair closure"
_LINK_ERRORS = (
    "gloo/transport",
    "Timed out waiting",
    "Connection reset",
    "Connection closed",
    "Broken pipe",
    "caused pair closure",
)


class LinkDown(RuntimeError):
    """No link to that peer right now (its process is gone or restarting), or the link just failed."""


def is_link_error(err: BaseException) -> bool:
    """A backend's network failure (gloo raises a plain RuntimeError from its transport), not a bug in the step."""
    return isinstance(err, (dist.DistError, LinkDown)) or (
        isinstance(err, RuntimeError) and any(m in str(err) for m in _LINK_ERRORS)
    )


@contextlib.contextmanager
def naming_the_peers(who: str, step: int, what: str, peers: Sequence[str], timeout_s: float | None) -> Iterator[None]:
    """Re-raise a network failure inside the block (gloo's transport error or timeout) as a message
    naming this process (``who``), the step and the ``peers`` (described with their addresses);
    other errors pass unchanged."""
    try:
        yield
    except RuntimeError as err:
        if not is_link_error(err):
            raise
        raise RuntimeError(
            f"{who} lost its pipeline link at step {step}: {what} {', '.join(peers)} did not complete (timeout "
            f"{timeout_s} s: TrainingArguments.ddp_timeout, RunSettings.link_timeout_s): "
            f"{type(err).__name__}: {err}"
        ) from err
