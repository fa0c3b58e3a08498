"""The composed boundary codec: a ``boundary_codec`` string (``spec``), its quantisers (``quant``), the
codec of one boundary with its send/receive autograd pair (``codec``) and the single-process hooks
(``handle``). The same ``ComposedCodec`` runs single-process and at the mesh's stage boundaries."""

from .codec import ComposedCodec
from .grammar import parse_codec
from .spec import QUANT_BITS, CodecSpec

__all__ = ["QUANT_BITS", "CodecSpec", "ComposedCodec", "parse_codec"]
