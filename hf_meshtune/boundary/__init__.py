"""Pipeline boundaries: shared-seed masks (``masking``), receiver fills (``fills``), the composed codec a
``boundary_codec`` string spells (``compose``: single-process and on the mesh), baseline codecs for the
quality benchmark (``codecs``) and the forward hooks that attach them to an unmodified model (``hooks``)."""

from .hooks import BoundaryHandle, attach_boundaries, find_decoder_layers, split_stages
from .masking import BoundaryMask, compact, expand, keep_count, keep_indices

__all__ = [
    "BoundaryHandle",
    "BoundaryMask",
    "attach_boundaries",
    "compact",
    "expand",
    "find_decoder_layers",
    "keep_count",
    "keep_indices",
    "split_stages",
]
