"""Baseline boundary codecs: what the shared-seed masks are compared against (paper Table 2).

A codec replaces the hidden state h that crosses a pipeline boundary by h̃, what the receiving stage
rebuilds from the compressed message, inside autograd: training sees exactly the error the wire
introduces, and the activation gradient sent back goes through the codec's backward compression.
``attach_codec`` puts one codec at each place ``attach_boundaries`` puts a mask (the output of the
last decoder layer of every stage but the final one) and, like the masks, acts only on training
forwards; ``eval()``, ``torch.no_grad()`` and ``generate()`` see the dense model.

Bytes per token at H = 576 against dense bf16 (H·2 = 1152 B), defaults, ``dtype_bytes`` = 2:

=============  =======================================  ===========  ===========
codec          forward message                          forward      backward
=============  =======================================  ===========  ===========
quant4         H 4-bit codes + 2-byte scale              290 (4.0×)   290 (4.0×)
topk           k = 14 values + int16 indices              56 (20.6×)   28 (41×)
bottleneck     K = 29 learned projections                 58 (19.9×)   58 (19.9×)
delta_quant    4-bit delta vs. the sample's last value   290 (4.0×)†  290 (4.0×)
pca            K = 29 principal components                58 (19.9×)   58 (19.9×)
=============  =======================================  ===========  ===========

† steady state; a sample's first sight costs 1152 B. pca adds a one-off ``basis_bytes`` per refit.
"""

from .base import CODECS_ATTR, BoundaryCodec, quantize_per_token
from .handle import CodecHandle, attach_codec, sample_keys
from .kinds import (
    CODECS,
    BottleneckCodec,
    DeltaQuantCodec,
    PCACodec,
    QuantCodec,
    TopKCodec,
)

__all__ = [
    "CODECS",
    "CODECS_ATTR",
    "BoundaryCodec",
    "BottleneckCodec",
    "CodecHandle",
    "DeltaQuantCodec",
    "PCACodec",
    "QuantCodec",
    "TopKCodec",
    "attach_codec",
    "quantize_per_token",
    "sample_keys",
]
