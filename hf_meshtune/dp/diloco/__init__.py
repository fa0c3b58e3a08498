"""Streaming DiLoCo of one pipeline stage with PowerSGD pseudo-gradients, on torchft's ``DiLoCo``.

Fast replicas take ``sync_every`` (S) inner steps, then average a pseudo-gradient Δθ = θ_global − θ_local
and apply it with an outer Nesterov SGD step (DiLoCo, Douillard et al. 2023, arXiv 2311.08105).
Streaming DiLoCo (Douillard et al. 2025, arXiv 2501.18512) splits each stage into F fragments that sync
at staggered inner steps, one every S/F steps, each sync able to overlap ``fragment_sync_delay`` (τ)
following inner steps. Before the all-reduce the pseudo-gradient of every large matrix is compressed
to rank r with PowerSGD (``dp.powersgd``), so a [m, n] matrix travels as r·(m+n) numbers.

torchft has no compressor hook, so this is the one package of the library that reaches into torchft's
private internals (``TORCHFT_INTERNALS`` lists each one; ``require_torchft_internals`` fails naming the
one a torchft release moved): PowerSGD replaces the fragment's pseudo-gradient averaging
(``_StreamingDiLoCoFragment._average_grads``), every all-reduce goes through ``Wire.all_reduce("dp", …)``
so its bytes are counted, and the checkpoint server is named by the address peers reach it at.

- ``internals``: every private torchft name the package uses (``TORCHFT_INTERNALS``) and the check for them;
- ``fragment``: torchft's fragment with the compressed averaging (PowerSGD, int8 codes, buckets);
- ``streaming``: ``StreamingDiLoCo``, the context manager a stage trains in;
- ``transport``: torchft's checkpoint server, named by the address peers reach it at.
"""

from .internals import TORCHFT_INTERNALS, require_torchft_internals
from .streaming import StreamingDiLoCo, p_round_steps
from .transport import AdvertisedHTTPTransport

__all__ = [
    "TORCHFT_INTERNALS",
    "AdvertisedHTTPTransport",
    "StreamingDiLoCo",
    "p_round_steps",
    "require_torchft_internals",
]
