"""One boundary's composed codec: the bytes that cross, and the autograd pair that sends and receives them.

Per token h ∈ R^H the sender's analysis A and the receiver's synthesis S are (O: the N outlier dims,
R: the others, μ/σ/P: mean, standard deviation and r principal directions of the dense h_R)::

    A(h) = (h_O, z)   z = h_R | (h_R - μ)·P | ((h_R - μ)/σ)·P          (none | pca | spca)
    S(y, ẑ) = h̃       h̃_O = y,  h̃_R = ẑ | μ + ẑ·Pᵀ | μ + σ ⊙ (ẑ·Pᵀ)

and the message is [y in the model dtype][bf16 scales][packed codes of Q(z)], padded to whole
model-dtype words: a ``uint8`` buffer viewed as the model dtype, so torch's pipeline sends it as one
tensor of ``payload_width`` values per token and its gradient comes back in the same layout. The
backward message is the same layout for (g_O, Q'(Sᵀg)) with Sᵀg = g_R | g_R·P | (σ ⊙ g_R)·P, and the
sender applies Aᵀ: g_h_R = ĝ_z | ĝ_z·Pᵀ | (ĝ_z·Pᵀ)/σ. Q' rounds stochastically with ``sr`` (noise from
a private generator seeded by (boundary, step, microbatch, seed), the same on every process).

Single-process training runs exactly ``receive(send(h))``: what the mesh's two stages compute.
"""

from __future__ import annotations

import hashlib
import math
from typing import Any

import torch
from torch import Tensor

from ..._validation import require
from ..masking import stable_seed
from .quant import dequantize, quantize
from .rotation import DIRECTIONS, Rotation
from .spec import SCALE_BYTES, CodecSpec, code_bytes

__all__ = [
    "ComposedCodec",
    "geometry_digest",
    "geometry_from_flat",
    "geometry_layout",
    "geometry_to_flat",
    "records_to_payload",
    "wire_records",
]

_STD_FLOOR = 1e-6  # a dim that never varies is standardised by this instead of 0


def _as_bytes(tensor: Tensor) -> Tensor:
    """A tensor's bytes [..., n·e] (uint8), sharing its storage."""
    return tensor.contiguous().view(torch.uint8)


def _held(value: Tensor | None) -> Tensor:
    """A geometry tensor the spec implies (the outlier dims, a projection's μ and P): set once the codec
    is ready, which every caller has required."""
    assert value is not None
    return value


class ComposedCodec:
    """Boundary ``boundary``'s codec for ``spec`` at hidden size H (see the module docstring).

    Geometry (outlier dims, μ, σ, P) comes from ``fit`` on dense activations, or ``load_geometry``
    (a checkpoint, or the sender's fit received on the mesh); a codec that needs it refuses to run
    before it has it.
    """

    def __init__(self, spec: CodecSpec, boundary: int, hidden_size: int, seed: int = 0) -> None:
        require(not spec.is_mask, "boundary_codec", spec.text, "be a composed codec here (masks run on the mask path)")
        spec.validate(hidden_size)
        self.spec, self.boundary, self.hidden_size, self.seed = spec, boundary, hidden_size, seed
        self.outlier_dims: Tensor | None = None
        self.rest_dims: Tensor | None = None if spec.needs_fit else torch.arange(hidden_size)
        self.mean: Tensor | None = None
        self.std: Tensor | None = None
        self.basis: Tensor | None = None
        self.fits = 0  # how many times the geometry was fitted or loaded
        width = spec.coded_width(hidden_size)
        self.rotations: dict[str, Rotation | None] = {
            d: Rotation(width, rot, boundary, d, seed) if (rot := spec.side(d).rotation) else None for d in DIRECTIONS
        }
        self._device_cache: dict[str, dict[str, Tensor | None]] = {}

    # --- geometry ---------------------------------------------------------------------------------
    @property
    def ready(self) -> bool:
        return self.rest_dims is not None

    def fit(self, hidden: Tensor) -> None:
        """Fit the geometry on dense boundary activations [..., H] (float64 statistics) and use it."""
        self.load_geometry(self.fitted(hidden))

    @torch.no_grad()
    def fitted(self, hidden: Tensor) -> dict[str, Tensor | None]:
        """The geometry ``fit`` would load for dense activations [..., H], without loading it."""
        spec, H = self.spec, self.hidden_size
        rows = hidden.detach().reshape(-1, hidden.shape[-1]).to("cpu", torch.float64)
        require(rows.shape[-1] == H, "hidden_size", rows.shape[-1], f"equal the codec's hidden_size={H}")
        require(rows.shape[0] >= 2, "calibration tokens", rows.shape[0], "be >= 2 to fit the codec's geometry")
        rms = rows.pow(2).mean(0)
        outliers = rms.topk(spec.outliers).indices.sort().values if spec.outliers else torch.empty(0, dtype=torch.int64)
        keep = torch.ones(H, dtype=torch.bool)
        keep[outliers] = False
        rest = keep.nonzero().squeeze(-1)
        geometry: dict[str, Tensor | None] = {"outlier_dims": outliers, "rest_dims": rest}
        if spec.projection:
            assert spec.rank is not None  # parse_codec gives every projection its rank
            values = rows[:, rest]
            mean = values.mean(0)
            centred = values - mean
            std = centred.pow(2).mean(0).sqrt().clamp_min(_STD_FLOOR)
            if spec.projection == "spca":
                centred = centred / std
            covariance = centred.T @ centred / rows.shape[0]
            _, vectors = torch.linalg.eigh(covariance)  # ascending eigenvalues
            basis = vectors[:, -spec.rank :].flip(-1)
            geometry.update(mean=mean.float(), std=std.float() if spec.projection == "spca" else None)
            geometry["basis"] = basis.float().contiguous()
        geometry.setdefault("mean", None)
        geometry.setdefault("std", None)
        geometry.setdefault("basis", None)
        return geometry

    def geometry(self) -> dict[str, Tensor | None]:
        """What both sides of the boundary must hold identically (checkpointed and sent on the mesh)."""
        return {
            "outlier_dims": self.outlier_dims,
            "rest_dims": self.rest_dims,
            "mean": self.mean,
            "std": self.std,
            "basis": self.basis,
        }

    def load_geometry(self, geometry: dict[str, Tensor | None]) -> None:
        def cpu(name: str) -> Tensor | None:
            value = geometry.get(name)
            return None if value is None else value.detach().to("cpu").clone()

        self.outlier_dims, self.rest_dims = cpu("outlier_dims"), cpu("rest_dims")
        self.mean, self.std, self.basis = cpu("mean"), cpu("std"), cpu("basis")
        self._device_cache = {}
        self.fits += 1

    def _on(self, device: torch.device) -> dict[str, Tensor | None]:
        key = str(device)
        if key not in self._device_cache:
            self._device_cache[key] = {k: None if v is None else v.to(device) for k, v in self.geometry().items()}
        return self._device_cache[key]

    # --- sizes ------------------------------------------------------------------------------------
    def payload_bytes(self, dtype: torch.dtype) -> int:
        """Bytes per token of the message tensor both directions share: the larger direction's
        ``CodecSpec.payload_bytes`` (a forward and backward spelled apart differ in size)."""
        size = torch.empty((), dtype=dtype).element_size()
        return max(self.spec.payload_bytes(self.hidden_size, size, d) for d in DIRECTIONS)

    def message_bytes(self, direction: str, dtype: torch.dtype) -> int:
        """Bytes per token that ``direction``'s message holds before lossless coding (the rest of the
        shared layout is zeros the variable-size wire never sends)."""
        return self.spec.side(direction).message_bytes(self.hidden_size, torch.empty((), dtype=dtype).element_size())

    def payload_width(self, dtype: torch.dtype) -> int:
        """Model-dtype values per token of the message tensor."""
        return self.payload_bytes(dtype) // torch.empty((), dtype=dtype).element_size()

    # --- the two messages --------------------------------------------------------------------------
    def _require_ready(self) -> None:
        require(
            self.ready,
            "boundary_codec",
            self.spec.text,
            "be fitted before it runs (its outlier dims / basis come from a calibration pass on a training batch, "
            "which MeshTrainer, MeshAccelerator and the mesh run before the first step; alone: fit() or calibrate())",
        )

    def _split(self, h: Tensor) -> tuple[dict[str, Tensor | None], Tensor, Tensor]:
        """(the geometry on h's device, h's outlier dims, its other dims in float32)."""
        g = self._on(h.device)
        if not self.spec.outliers:
            return g, h[..., :0], h.float()
        return g, h[..., g["outlier_dims"]], h[..., g["rest_dims"]].float()

    def _merge(self, g: dict[str, Tensor | None], y: Tensor, rest: Tensor, dtype: torch.dtype) -> Tensor:
        """Inverse of ``_split``: outlier and other dims back into one [..., H] tensor of ``dtype``."""
        if not self.spec.outliers:
            return rest.to(dtype)
        out = torch.empty(*rest.shape[:-1], self.hidden_size, dtype=dtype, device=rest.device)
        out[..., g["outlier_dims"]] = y.to(dtype)
        out[..., g["rest_dims"]] = rest.to(dtype)
        return out

    def _analysis(self, h: Tensor) -> tuple[Tensor, Tensor]:
        g, y, rest = self._split(h)
        if self.spec.projection is None:
            return y, rest
        centred = rest - _held(g["mean"])
        if g["std"] is not None:
            centred = centred / g["std"]
        return y, centred @ _held(g["basis"])

    def _synthesis(self, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        g = self._on(z.device)
        if self.spec.projection is not None:
            rest = z @ _held(g["basis"]).T
            if g["std"] is not None:
                rest = rest * g["std"]
            z = rest + _held(g["mean"])
        return self._merge(g, y, z, dtype)

    def _gradient_analysis(self, g_h: Tensor) -> tuple[Tensor, Tensor]:
        """Sᵀ: the receiver's dense gradient → (g_O, g_z)."""
        g, y, rest = self._split(g_h)
        if self.spec.projection is None:
            return y, rest
        if g["std"] is not None:
            rest = rest * g["std"]
        return y, rest @ _held(g["basis"])

    def _gradient_synthesis(self, y: Tensor, z: Tensor, dtype: torch.dtype) -> Tensor:
        """Aᵀ: the decoded (ĝ_O, ĝ_z) → the sender's gradient of h."""
        g = self._on(z.device)
        if self.spec.projection is not None:
            z = z @ _held(g["basis"]).T
            if g["std"] is not None:
                z = z / g["std"]
        return self._merge(g, y, z, dtype)

    def _pack(self, y: Tensor, z: Tensor, dtype: torch.dtype, direction: str, clock: tuple[int, int] | None) -> Tensor:
        """(outlier values, coded values) → the message of ``direction`` in the shared [..., payload_width]
        layout (zero bytes after the side's own ``message_bytes``). ``clock`` (step, microbatch) seeds
        stochastic rounding where the side asks for it."""
        spec = self.spec.side(direction)
        parts = [_as_bytes(y.to(dtype))] if spec.outliers else []
        if spec.quant is None:
            parts.append(_as_bytes(z.to(dtype)))
        else:
            assert spec.bits is not None  # parse_codec gives every quantiser its bits
            rotation = self.rotations[direction]
            if rotation is not None:
                z = rotation.forward(z)
            noise = self._noise(z.shape, *clock, z.device) if spec.stochastic and clock is not None else None
            scales, codes = quantize(z, spec.quant, spec.bits, spec.groups(self.hidden_size), noise, spec.scales)
            parts += [_as_bytes(scales), codes]
        message = torch.cat(parts, dim=-1)
        pad = self.payload_bytes(dtype) - message.shape[-1]
        if pad:
            message = torch.nn.functional.pad(message, (0, pad))
        return message.view(dtype)

    def _unpack(self, payload: Tensor, direction: str) -> tuple[Tensor, Tensor]:
        spec, dtype = self.spec.side(direction), payload.dtype
        size = torch.empty((), dtype=dtype).element_size()
        message = _as_bytes(payload)
        at = spec.outliers * size
        y = message[..., :at].contiguous().view(dtype)
        if spec.quant is None:
            width = spec.coded_width(self.hidden_size)
            return y, message[..., at : at + width * size].contiguous().view(dtype).float()
        assert spec.bits is not None  # parse_codec gives every quantiser its bits
        groups, width = spec.groups(self.hidden_size), spec.quantised_width(self.hidden_size)
        scale_bytes = SCALE_BYTES[spec.scales] * groups
        scales = message[..., at : at + scale_bytes].contiguous()
        scales = scales.view(torch.bfloat16) if spec.scales == "bf16" else scales
        at += scale_bytes
        codes = message[..., at : at + code_bytes(spec.quant, spec.bits, width, size)].contiguous()  # padding dropped
        z = dequantize(scales, codes, spec.quant, spec.bits, groups, width)
        rotation = self.rotations[direction]
        return y, z if rotation is None else rotation.inverse(z)

    def encode_activation(self, h: Tensor) -> Tensor:
        """h [..., H] → the forward message [..., payload_width] (model dtype view of the bytes)."""
        self._require_ready()
        y, z = self._analysis(h)
        return self._pack(y, z, h.dtype, "fwd", None)

    def decode_activation(self, payload: Tensor) -> Tensor:
        """The forward message → the receiver's h̃ [..., H] in the payload's dtype."""
        self._require_ready()
        y, z = self._unpack(payload, "fwd")
        return self._synthesis(y, z, payload.dtype)

    def encode_gradient(self, grad: Tensor, step: int, microbatch: int) -> Tensor:
        """The receiver's dL/dh̃ → the backward message (stochastic rounding where the backward asks)."""
        self._require_ready()
        y, z = self._gradient_analysis(grad)
        return self._pack(y, z, grad.dtype, "bwd", (step, microbatch))

    def decode_gradient(self, payload: Tensor) -> Tensor:
        """The backward message → the sender's dL/dh [..., H]."""
        self._require_ready()
        y, z = self._unpack(payload, "bwd")
        return self._gradient_synthesis(y, z, payload.dtype)

    def _noise(self, shape: torch.Size, step: int, microbatch: int, device: torch.device) -> Tensor:
        gen = torch.Generator(device="cpu")
        gen.manual_seed(stable_seed(b"meshtune-sr", self.boundary, step, microbatch, self.seed))
        return torch.rand(shape, generator=gen).to(device)

    # --- inside autograd ----------------------------------------------------------------------------
    def send(self, hidden: Tensor, step: int, microbatch: int) -> Tensor:
        """The sending stage's end: h → the message, whose gradient (the backward message) decodes to dL/dh."""
        return _Send.apply(hidden, self)

    def receive(self, payload: Tensor, step: int, microbatch: int) -> Tensor:
        """The receiving stage's start: the message → h̃, whose gradient is encoded as the backward message."""
        return _Receive.apply(payload, self, step, microbatch)

    def apply(self, hidden: Tensor, step: int, microbatch: int) -> tuple[Tensor, Tensor]:
        """Single-process boundary: (h̃, the message that would travel)."""
        payload = self.send(hidden, step, microbatch)
        return self.receive(payload, step, microbatch), payload


class _Send(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, codec: ComposedCodec) -> Tensor:
        ctx.codec = codec
        with torch.no_grad():
            return codec.encode_activation(hidden.detach())

    @staticmethod
    def backward(ctx: Any, grad_payload: Tensor) -> tuple[Tensor, None]:
        return ctx.codec.decode_gradient(grad_payload.contiguous()), None


class _Receive(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, payload: Tensor, codec: ComposedCodec, step: int, microbatch: int) -> Tensor:
        ctx.codec, ctx.clock = codec, (step, microbatch)
        with torch.no_grad():
            return codec.decode_activation(payload.detach())

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        return ctx.codec.encode_gradient(grad.contiguous(), *ctx.clock), None, None, None


def wire_records(codec: ComposedCodec, direction: str, rows: Tensor) -> Tensor:
    """The bytes of ``direction``'s message for ``rows`` [n, payload_width] (model dtype): [n, message_bytes]
    uint8, the shared layout's trailing zeros dropped. What the variable-size wire sends, before coding."""
    return _as_bytes(rows)[:, : codec.message_bytes(direction, rows.dtype)]


def records_to_payload(codec: ComposedCodec, records: Tensor, dtype: torch.dtype) -> Tensor:
    """Inverse of ``wire_records``: [n, message_bytes] uint8 → [n, payload_width] in ``dtype`` (zeros after)."""
    width = codec.payload_bytes(dtype)
    return torch.nn.functional.pad(records, (0, width - records.shape[-1])).view(dtype)


def geometry_layout(codec: ComposedCodec) -> list[tuple[str, tuple[int, ...], torch.dtype]]:
    """The geometry tensors a codec's spec needs, in the order they travel: (name, shape, dtype)."""
    spec, H = codec.spec, codec.hidden_size
    rest = H - spec.outliers
    layout: list[tuple[str, tuple[int, ...], torch.dtype]] = [
        ("outlier_dims", (spec.outliers,), torch.int64),
        ("rest_dims", (rest,), torch.int64),
    ]
    if spec.projection:
        assert spec.rank is not None  # parse_codec gives every projection its rank
        layout.append(("mean", (rest,), torch.float32))
        if spec.projection == "spca":
            layout.append(("std", (rest,), torch.float32))
        layout.append(("basis", (rest, spec.rank), torch.float32))
    return layout


def geometry_to_flat(codec: ComposedCodec, geometry: dict[str, Tensor | None]) -> Tensor:
    """A geometry as one float32 CPU tensor in ``geometry_layout`` order (dims are < 2^24: exact)."""
    names = [name for name, _, _ in geometry_layout(codec)]
    parts = [_held(geometry[name]).detach().reshape(-1).to("cpu", torch.float32) for name in names]
    return torch.cat(parts)


def geometry_from_flat(codec: ComposedCodec, flat: Tensor) -> dict[str, Tensor | None]:
    """Inverse of ``geometry_to_flat``; a ValueError unless the size is exactly the layout's."""
    total = codec.spec.geometry_numel(codec.hidden_size)
    require(flat.numel() == total, "codec geometry size", flat.numel(), f"equal the layout's {total} values")
    geometry: dict[str, Tensor | None] = {"mean": None, "std": None, "basis": None}
    at = 0
    for name, shape, kind in geometry_layout(codec):
        n = math.prod(shape)
        geometry[name] = flat[at : at + n].reshape(shape).to(kind).clone()
        at += n
    return geometry


def geometry_digest(geometry: dict[str, Tensor | None]) -> str:
    """A hash of a geometry's exact values (to check that two processes hold the same one)."""
    digest = hashlib.blake2b(digest_size=8)
    for name in ("outlier_dims", "rest_dims", "mean", "std", "basis"):
        value = geometry.get(name)
        if value is not None:
            digest.update(name.encode())
            digest.update(value.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()
