"""Communication apart from the algorithms it serves: the byte-booking ``Wire``, the anchor link's
typed messages, its mailbox threads, and the wording of a broken link."""

from .messages import GRADIENTS, ROUNDS, UPDATES, Channel
from .wire import CIRCUITS, Wire, nbytes

__all__ = ["CIRCUITS", "GRADIENTS", "ROUNDS", "UPDATES", "Channel", "Wire", "nbytes"]
