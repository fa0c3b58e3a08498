"""The dense anchor: the single-process circuit (``circuit``), its own data (``batches``), and on the
mesh the anchor replica's stage worker (``worker``), the outer-update follower that keeps it on
θ_global (``follower``) and the fast side's end of the anchor link (``link``)."""

from .batches import AnchorBatches
from .circuit import AnchorCircuit, PendingGradient

__all__ = ["AnchorBatches", "AnchorCircuit", "PendingGradient"]
