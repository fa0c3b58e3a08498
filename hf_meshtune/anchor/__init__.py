"""The dense anchor: the single-process circuit (``circuit``), its own data (``batches``), and on the
mesh the outer-update follower that keeps the anchor replica on θ_global (``follower``), the fast side's
end of the anchor link (``link``), the codec refits (``geometry``) and the governor (``mesh_governor``).
The anchor replica's stage worker that runs them is a mesh process: ``runtime.anchor_worker``."""

from .batches import AnchorBatches
from .circuit import AnchorCircuit, PendingGradient

__all__ = ["AnchorBatches", "AnchorCircuit", "PendingGradient"]
