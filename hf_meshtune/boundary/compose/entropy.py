"""Lossless coding of a boundary message's bytes: the last stage of a ``boundary_codec`` (``+zstd``).

A message is a [n, w] ``uint8`` matrix: one fixed-rate record of w bytes per real token (outlier values,
scales, packed codes). It is coded column-major (byte 0 of every token, then byte 1, ...), so each field's
bytes sit together and the coder's order-0 stage (zstd's Huffman literals) sees one field at a time rather
than outlier, scale and code bytes interleaved. Decoding needs n and w, which the receiver knows (the wire's
header carries n; w is the codec's). ``zstd`` is the ``zstandard`` package (level ``ZSTD_LEVEL``); ``zlib``
is Python's own, kept for comparison (``benchmarks/wire``).
"""

from __future__ import annotations

import threading
import zlib

import numpy as np
import torch
from torch import Tensor

__all__ = ["CODERS", "ZSTD_LEVEL", "decode_records", "encode_records", "require_coder"]

CODERS = ("zstd", "zlib")
ZSTD_LEVEL = 1  # measured in benchmarks/wire: higher levels buy < 1 % on codes at several times the CPU
ZLIB_LEVEL = 6
_local = threading.local()  # zstandard's (de)compressor objects are not thread-safe


def require_coder(name: str, text: str = "", field: str = "boundary_codec") -> None:
    """A ValueError naming ``field`` unless ``name`` is a coder this environment can run."""
    shown = text or name
    if name not in CODERS:
        raise ValueError(f"{field}={shown!r} is invalid: it must name a coder from {list(CODERS)} ({name!r})")
    if name == "zstd":
        try:
            import zstandard  # noqa: F401
        except ImportError as err:
            raise ValueError(
                f"{field}={shown!r} is invalid: it must name a coder this environment has (zstd needs the "
                "zstandard package: pip install 'zstandard>=0.22')"
            ) from err


def _zstd():
    if not hasattr(_local, "zstd"):
        import zstandard

        _local.zstd = (zstandard.ZstdCompressor(level=ZSTD_LEVEL), zstandard.ZstdDecompressor())
    return _local.zstd


def encode_records(records: Tensor, coder: str) -> bytes:
    """[n, w] uint8 records (CPU) → the coded bytes, column-major."""
    columns = np.ascontiguousarray(records.detach().to("cpu", torch.uint8).numpy().T).tobytes()
    if coder == "zstd":
        return _zstd()[0].compress(columns)
    if coder == "zlib":
        return zlib.compress(columns, ZLIB_LEVEL)
    raise ValueError(f"coder={coder!r} is invalid: it must be one of {list(CODERS)}")


def decode_records(data: bytes, rows: int, width: int, coder: str) -> Tensor:
    """Inverse of ``encode_records``: the coded bytes of ``rows`` records of ``width`` bytes → [rows, width]."""
    if coder == "zstd":
        raw = _zstd()[1].decompress(data, max_output_size=rows * width)
    elif coder == "zlib":
        raw = zlib.decompress(data)
    else:
        raise ValueError(f"coder={coder!r} is invalid: it must be one of {list(CODERS)}")
    if len(raw) != rows * width:
        raise ValueError(
            f"coded boundary message={len(raw)} bytes decoded is invalid: it must hold {rows} records of {width} bytes"
        )
    columns = np.frombuffer(raw, dtype=np.uint8).reshape(width, rows)
    return torch.from_numpy(columns.T.copy())
