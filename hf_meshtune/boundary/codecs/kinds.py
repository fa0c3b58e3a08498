"""The five baseline codecs; each docstring states its forward/backward compression."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..._validation import require
from ..masking import compact, expand
from .base import (
    BoundaryCodec,
    _check_bits,
    _check_width,
    _quantized_bytes,
    _Rebuilt,
    quantize_per_token,
)


class QuantCodec(BoundaryCodec):
    """Per-token b-bit absmax quantisation both ways (``bits`` b = 4 by default).

    Forward ⌈H·b/8⌉ + 2 bytes per token (codes + scale) vs dense H·2: ≈ 16/b×. Backward: the same
    quantiser on the activation gradient at ``grad_bits`` (default b), straight-through otherwise.
    """

    name = "quant4"

    def __init__(self, hidden_size: int, bits: int = 4, grad_bits: int | None = None, dtype_bytes: int = 2) -> None:
        super().__init__(hidden_size, dtype_bytes)
        grad_bits = bits if grad_bits is None else grad_bits
        _check_bits("bits", bits)
        _check_bits("grad_bits", grad_bits)
        self.bits, self.grad_bits = bits, grad_bits

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        self._record(hidden)
        return _Rebuilt.apply(hidden, quantize_per_token(hidden.detach(), self.bits), self.grad_bits)

    def wire_bytes_per_token(self, hidden_size: int, dtype_bytes: int = 2) -> tuple[float, float]:
        self._same_width(hidden_size)
        return float(_quantized_bytes(hidden_size, self.bits)), float(_quantized_bytes(hidden_size, self.grad_bits))


class TopKCodec(BoundaryCodec):
    """Per token, the k entries of largest |h|; the receiver zero-fills the rest.

    Forward: k values + k int16 indices, k·(dtype_bytes + 2) bytes. Backward: the gradient on the
    same support, k·dtype_bytes (the sender knows its indices). Give ``k`` or a target forward
    ``compression`` (default 20×): k = max(1, round(H·dtype_bytes / compression / (dtype_bytes + 2))).
    """

    name = "topk"

    def __init__(
        self, hidden_size: int, k: int | None = None, compression: float | None = None, dtype_bytes: int = 2
    ) -> None:
        super().__init__(hidden_size, dtype_bytes)
        require(hidden_size <= 2**16, "hidden_size", hidden_size, "be <= 65536 (indices travel as int16)")
        require(k is None or compression is None, "compression", compression, "be None when k is given")
        if k is None:
            compression = 20.0 if compression is None else compression
            require(compression > 0, "compression", compression, "be > 0")
            k = max(1, round(hidden_size * dtype_bytes / compression / (dtype_bytes + 2)))
        self.k = _check_width("k", k, hidden_size)

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        self._record(hidden)
        idx = hidden.detach().abs().topk(self.k, dim=-1, sorted=False).indices
        return expand(compact(hidden, idx), idx, self.hidden_size)  # autograd: gradient on the support

    def wire_bytes_per_token(self, hidden_size: int, dtype_bytes: int = 2) -> tuple[float, float]:
        self._same_width(hidden_size)
        return float(self.k * (dtype_bytes + 2)), float(self.k * dtype_bytes)


def _default_rank(hidden_size: int, rank: int | None) -> int:
    """K: given, or round(0.05·H) (≈ 20× compression each way)."""
    return _check_width("rank", max(1, round(0.05 * hidden_size)) if rank is None else rank, hidden_size)


def _principal_basis(hidden: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """(μ [H], P [H, K]): mean and top-K principal directions of the tokens in ``hidden`` [..., H].

    μ + P Pᵀ(h − μ) is the best rank-K affine reconstruction in squared error (Eckart–Young).
    Solved in float64; returned in float32 (float64 for float64 activations).
    """
    tokens = hidden.detach().reshape(-1, hidden.shape[-1])
    require(tokens.shape[0] >= rank, "fit tokens", tokens.shape[0], f"be >= rank K={rank}")
    work = tokens.double()
    mean = work.mean(dim=0)
    _, _, vh = torch.linalg.svd(work - mean, full_matrices=False)
    dtype = torch.promote_types(hidden.dtype, torch.float32)
    return mean.to(dtype), vh[:rank].T.contiguous().to(dtype)


class PCACodec(BoundaryCodec):
    """A fixed rank-K PCA projection fitted on dense activations (refit by ``CodecHandle.fit``).

    Forward: z = Pᵀ(h − μ), K values (K·dtype_bytes bytes per token); the receiver rebuilds μ + P z.
    Backward: Pᵀ g, K values, so the sender's gradient is P Pᵀ g. P (H×K, orthonormal) and μ are
    fitted by the anchor replica and broadcast once per refresh: ``basis_bytes`` = (H·K + H)·4
    (float32 P and μ), not per token. Default K = round(0.05·H).
    """

    name = "pca"
    needs_fit = True

    def __init__(self, hidden_size: int, rank: int | None = None, dtype_bytes: int = 2) -> None:
        super().__init__(hidden_size, dtype_bytes)
        self.rank = _default_rank(hidden_size, rank)
        # non-persistent: model.to() moves them, model.state_dict() stays the dense model's
        self.register_buffer("mean", None, persistent=False)
        self.register_buffer("basis", None, persistent=False)

    @property
    def basis_bytes(self) -> int:
        """Bytes of one basis refresh broadcast to both sides of the boundary (float32 P and μ)."""
        return (self.hidden_size * self.rank + self.hidden_size) * 4

    def fit(self, hidden: Tensor) -> None:
        self.mean, self.basis = _principal_basis(hidden, self.rank)

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        require(
            self.basis is not None,
            "pca.basis",
            None,
            "be fitted (CodecHandle.fit(model, batch) or codec.fit(hidden)) before a training forward",
        )
        self._record(hidden)
        mean, basis = self.mean.to(hidden.device), self.basis.to(hidden.device)
        z = (hidden.to(basis.dtype) - mean) @ basis  # the K values that cross the wire
        return (mean + z @ basis.T).to(hidden.dtype)

    def wire_bytes_per_token(self, hidden_size: int, dtype_bytes: int = 2) -> tuple[float, float]:
        self._same_width(hidden_size)
        return float(self.rank * dtype_bytes), float(self.rank * dtype_bytes)

    def codec_state(self) -> dict:
        return {
            "mean": None if self.mean is None else self.mean.clone(),
            "basis": None if self.basis is None else self.basis.clone(),
        }

    def load_codec_state(self, state: dict) -> None:
        self.mean, self.basis = state["mean"], state["basis"]


class BottleneckCodec(BoundaryCodec):
    """A learned rank-K linear bottleneck, trained with the model.

    The sender owns ``down`` (H → K) and the receiver ``up`` (K → H); only the K-dim code crosses,
    K·dtype_bytes bytes per token each way (default K = round(0.05·H)). Each side keeps its own
    bias as the mean offset, so no parameter is shared across stages. ``fit`` sets them to the PCA
    solution (down = Pᵀ, bias −Pᵀμ; up = P, bias μ), the best linear K-dim reconstruction, so
    training starts there; unfitted they hold a fixed random orthonormal projection with no offset.
    """

    name = "bottleneck"
    needs_fit = True

    def __init__(self, hidden_size: int, rank: int | None = None, dtype_bytes: int = 2) -> None:
        super().__init__(hidden_size, dtype_bytes)
        self.rank = _default_rank(hidden_size, rank)
        with torch.random.fork_rng(devices=[]):  # attaching must not move the training RNG
            self.down = nn.Linear(hidden_size, self.rank)
            self.up = nn.Linear(self.rank, hidden_size)
        gen = torch.Generator().manual_seed(0)
        random_basis = torch.linalg.qr(torch.randn(hidden_size, self.rank, generator=gen)).Q
        self._set(torch.zeros(hidden_size), random_basis)

    @torch.no_grad()
    def _set(self, mean: Tensor, basis: Tensor) -> None:
        self.down.weight.copy_(basis.T)
        self.down.bias.copy_(-(mean @ basis))
        self.up.weight.copy_(basis)
        self.up.bias.copy_(mean)

    def fit(self, hidden: Tensor) -> None:
        self._set(*_principal_basis(hidden, self.rank))

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        self._record(hidden)
        code = self.down(hidden.to(self.down.weight.dtype))  # the K values that cross the wire
        return self.up(code).to(hidden.dtype)

    def wire_bytes_per_token(self, hidden_size: int, dtype_bytes: int = 2) -> tuple[float, float]:
        self._same_width(hidden_size)
        return float(self.rank * dtype_bytes), float(self.rank * dtype_bytes)


class DeltaQuantCodec(QuantCodec):
    """AQ-SGD (Wang et al., 2022, "Fine-tuning Language Models over Slow Networks using Activation
    Compression with Guarantees"): send quantised changes of each sample's boundary activation.

    Both sides keep, per training sample (``keys``: one bytes key per batch row), the last activation
    the receiver rebuilt. A first sight (or a key seen with another sequence shape) travels at full
    precision, H·dtype_bytes per token, and is buffered; later sights send the b-bit quantised delta
    Q(h − buffer), ⌈H·b/8⌉ + 2 bytes, and both sides store buffer + Q(h − buffer). As training
    settles the deltas, and so the error at fixed b, shrink. Backward: the gradient quantised to
    ``grad_bits`` (default b). ``wire_bytes_per_token`` is the steady state (every sample seen);
    ``last_wire_bytes`` and the handle's counter hold the measured bytes. Buffers grow by one
    [T, H] tensor per distinct sample, kept on the activations' device.
    """

    name = "delta_quant"
    needs_keys = True

    def __init__(self, hidden_size: int, bits: int = 4, grad_bits: int | None = None, dtype_bytes: int = 2) -> None:
        super().__init__(hidden_size, bits, grad_bits, dtype_bytes)
        self.sample_buffers: dict[bytes, Tensor] = {}

    def forward(self, hidden: Tensor, keys: list[bytes] | None = None) -> Tensor:
        require(
            keys is not None and len(keys) == hidden.shape[0],
            "keys",
            None if keys is None else len(keys),
            f"be one bytes key per batch row ({hidden.shape[0]} rows; CodecHandle derives them from input_ids)",
        )
        assert keys is not None
        self._same_width(hidden.shape[-1])
        sent = [self._exchange(row, key) for row, key in zip(hidden.detach(), keys)]
        tokens = hidden.numel() // hidden.shape[-1]
        self.last_wire_bytes = (sum(n for _, n in sent), tokens * _quantized_bytes(self.hidden_size, self.grad_bits))
        return _Rebuilt.apply(hidden, torch.stack([rebuilt for rebuilt, _ in sent]), self.grad_bits)

    @torch.no_grad()
    def _exchange(self, row: Tensor, key: bytes) -> tuple[Tensor, int]:
        """One sample across the wire: (the receiver's rebuild, forward bytes); updates the buffer."""
        tokens = row.numel() // row.shape[-1]
        previous = self.sample_buffers.get(key)
        if previous is None or previous.shape != row.shape:
            rebuilt, nbytes = row.clone(), tokens * self.hidden_size * self.dtype_bytes
        else:
            previous = previous.to(row.device, row.dtype)
            rebuilt = previous + quantize_per_token(row - previous, self.bits)
            nbytes = tokens * _quantized_bytes(self.hidden_size, self.bits)
        self.sample_buffers[key] = rebuilt
        return rebuilt, nbytes

    # wire_bytes_per_token: QuantCodec's, the steady state (every sample seen before)

    def codec_state(self) -> dict:
        return {"buffers": {key: value.clone() for key, value in self.sample_buffers.items()}}

    def load_codec_state(self, state: dict) -> None:
        self.sample_buffers = {key: value.clone() for key, value in state["buffers"].items()}


CODECS: dict[str, type[BoundaryCodec]] = {
    codec.name: codec for codec in (QuantCodec, TopKCodec, BottleneckCodec, DeltaQuantCodec, PCACodec)
}
