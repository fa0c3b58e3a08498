"""The composed boundary codec against float64 transcriptions: every stage and composition, forward and
backward, the message's size against the stated formula, unbiased stochastic rounding, the spec's rules,
and the single-process hooks on a real model."""

from __future__ import annotations

import math

import pytest
import torch

from hf_meshtune import MeshConfig
from hf_meshtune.boundary.compose import ComposedCodec, parse_codec
from hf_meshtune.boundary.compose.codec import geometry_digest, wire_records
from hf_meshtune.boundary.compose.handle import attach_composed
from hf_meshtune.boundary.compose.quant import dequantize, int_levels, pack_bits, quantize, unpack_bits
from hf_meshtune.ledger import LedgerSettings, compute_ledger
from tests.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

H = 64


def _activations(rows: int = 256, seed: int = 0) -> torch.Tensor:
    """Correlated activations with two massive dims, like a pretrained residual stream."""
    gen = torch.Generator().manual_seed(seed)
    mix = torch.randn(H, H, generator=gen) / math.sqrt(H)
    x = torch.randn(rows, H, generator=gen) @ mix * torch.linspace(0.2, 3.0, H)
    x[:, 5] += 300.0
    x[:, 40] -= 150.0
    return x


def _fitted(text: str, seed: int = 0) -> ComposedCodec:
    codec = ComposedCodec(parse_codec(text), 0, H, seed=seed)
    if codec.spec.needs_fit:
        codec.fit(_activations())
    return codec


# --- float64 transcriptions -----------------------------------------------------------------------


def _ref_scale(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The stated scale: absmax / top · (1 + 2^-7), stored as bfloat16 (1 for an all-zero group)."""
    scale = (absmax / top * (1 + 2**-7)).to(torch.bfloat16).double()
    return torch.where(absmax > 0, scale, torch.ones_like(scale))


def _ref_e8m0(absmax: torch.Tensor, top: float) -> torch.Tensor:
    """The stated e8m0 scale: the power of two at or above absmax / top (1 for an all-zero group)."""
    return torch.where(absmax > 0, 2.0 ** torch.ceil(torch.log2(absmax / top)), torch.ones_like(absmax))


def _ref_quant(z: torch.Tensor, quant: str, bits: int, groups: int, scales: str = "bf16") -> torch.Tensor:
    """Float64 quantise-dequantise of z [..., D] with one scale per each of ``groups`` contiguous groups, cut
    as ``torch.tensor_split`` cuts (sizes differ by at most one, the longer ones first)."""
    scale_of = _ref_e8m0 if scales == "e8m0" else _ref_scale
    out = []
    for g in torch.tensor_split(z.double(), groups, dim=-1):
        if quant == "fp8":
            scale = scale_of(g.abs().amax(-1, keepdim=True), 448.0)
            out.append((g / scale).float().to(torch.float8_e4m3fn).double() * scale)
        else:
            levels = 2 ** (bits - 1) - 1
            scale = scale_of(g.abs().amax(-1, keepdim=True), levels)
            out.append(torch.round(g / scale).clamp(-levels, levels) * scale)
    return torch.cat(out, dim=-1)


def _ref_rotation(codec: ComposedCodec, direction: str) -> torch.Tensor:
    """R [D', D] in float64 from its definition: blockdiag(H_b)/√b · diag(s) · P · pad, with H_b[i, j] =
    (-1)^popcount(i & j) (Sylvester's matrix) and the codec's seeded permutation and signs."""
    rotation = codec.rotations[direction]
    width, padded, block = rotation.width, rotation.padded, rotation.block
    index = torch.arange(block)
    parity = torch.tensor([[bin(int(i) & int(j)).count("1") % 2 for j in index] for i in index], dtype=torch.float64)
    hadamard = (1 - 2 * parity) / math.sqrt(block)
    blocks = torch.block_diag(*[hadamard] * (padded // block))
    permute = torch.zeros(padded, padded, dtype=torch.float64)
    permute[torch.arange(padded), rotation.permutation] = 1.0
    embed = torch.eye(padded, width, dtype=torch.float64)
    return blocks @ torch.diag(rotation.signs.double()) @ permute @ embed


def _ref_code(codec: ComposedCodec, direction: str, z: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The quantiser of ``direction``'s message on z [..., D] in float64, rotated before where it says so."""
    spec = codec.spec.side(direction)
    if spec.quant is None:
        return z.to(dtype).double()
    if spec.rotation is None:
        return _ref_quant(z, spec.quant, spec.bits, spec.groups(H), spec.scales)
    rotation = _ref_rotation(codec, direction)
    return _ref_quant(z.double() @ rotation.T, spec.quant, spec.bits, spec.groups(H), spec.scales) @ rotation


def _ref_roundtrip(codec: ComposedCodec, h: torch.Tensor) -> torch.Tensor:
    """S(Q(A(h))) in float64 from the codec's geometry (outliers kept in the model dtype)."""
    spec, geo = codec.spec, codec.geometry()
    x = h.double()
    rest = x[..., geo["rest_dims"]]
    if spec.projection:
        centred = rest - geo["mean"].double()
        if spec.projection == "spca":
            centred = centred / geo["std"].double()
        z = centred @ geo["basis"].double()
    else:
        z = rest
    zq = _ref_code(codec, "fwd", z, h.dtype)
    if spec.projection:
        back = zq @ geo["basis"].double().T
        if spec.projection == "spca":
            back = back * geo["std"].double()
        zq = back + geo["mean"].double()
    out = torch.empty_like(x)
    out[..., geo["outlier_dims"]] = x[..., geo["outlier_dims"]]
    out[..., geo["rest_dims"]] = zq
    return out


def _ref_gradient(codec: ComposedCodec, g: torch.Tensor) -> torch.Tensor:
    """Aᵀ(Q(Sᵀ g)) in float64: what the sender gets for the receiver's gradient g (round to nearest)."""
    spec, geo = codec.spec, codec.geometry()
    x = g.double()
    rest = x[..., geo["rest_dims"]]
    if spec.projection:
        if spec.projection == "spca":
            rest = rest * geo["std"].double()
        rest = rest @ geo["basis"].double()
    zq = _ref_code(codec, "bwd", rest, g.dtype)
    if spec.projection:
        zq = zq @ geo["basis"].double().T
        if spec.projection == "spca":
            zq = zq / geo["std"].double()
    out = torch.empty_like(x)
    out[..., geo["outlier_dims"]] = x[..., geo["outlier_dims"]]
    out[..., geo["rest_dims"]] = zq
    return out


COMPOSITIONS = [
    "int8",
    "int4",
    "int3g16",
    "int2g8",
    "fp8",
    "fp8g16",
    "outliers2+int4g31",
    "outliers4+int3",
    "pca12",
    "pca12+int8",
    "spca20+int4g10",
    "outliers2+spca24+int4",
    "outliers4+pca16+fp8g4",
    "int4x5",  # 64 values in 5 groups: 13, 13, 13, 13, 12
    "outliers8+int4x8",  # 56 in 8 equal groups
    "outliers3+int3x8",  # 61 in 8: 8 × 5, 7 × 3
    "outliers2+fp8x7",
    "outliers2+spca24+int2x5",
    "rot+int4",  # one block of 64
    "outliers8+rot16+int4g16",  # 56 values padded to 64: four blocks, one scale each
    "outliers2+rot8+int3x8e8m0",  # 62 padded to 64, power-of-two scales
    "outliers4+pca20+rot8+int4g8",  # rotation after a projection: 20 padded to 24
    "outliers8+int4x8/int8",  # the backward finer than the forward
    "outliers8+rot16+int4g16e8m0/rot32+int6g32",  # each direction rotated its own way
    "outliers2+int8/rot+int5x4",  # a rotation on the backward only
    "outliers8+rot+int4g64+zstd",  # lossless coding changes no value
    "outliers8+int3x8/int6+zlib",
]


@pytest.mark.parametrize("text", COMPOSITIONS)
def test_forward_and_backward_match_the_float64_transcription(text):
    codec = _fitted(text)
    h = _activations(48, seed=1).reshape(4, 12, H).requires_grad_()
    rebuilt, payload = codec.apply(h, step=3, microbatch=1)
    scale = h.detach().abs().amax()
    torch.testing.assert_close(rebuilt.double(), _ref_roundtrip(codec, h.detach()), rtol=0, atol=2e-5 * scale)
    g = torch.randn(4, 12, H, generator=torch.Generator().manual_seed(2), dtype=torch.float32)
    rebuilt.backward(g)
    torch.testing.assert_close(h.grad.double(), _ref_gradient(codec, g), rtol=0, atol=2e-5 * g.abs().amax() * 10)
    # the message: the larger direction's stated formula, padded to whole fp32 words; each direction's
    # records hold its own formula's bytes
    assert payload.dtype == torch.float32
    assert payload.shape == (4, 12, codec.payload_bytes(torch.float32) // 4)
    words = max(codec.spec.payload_bytes(H, 4, d) for d in ("fwd", "bwd"))
    assert payload.numel() * payload.element_size() == 4 * 12 * words
    for direction in ("fwd", "bwd"):
        records = wire_records(codec, direction, payload.detach().reshape(-1, payload.shape[-1]))
        assert records.shape == (48, codec.spec.side(direction).message_bytes(H, 4))


def test_the_quantiser_has_a_zero_level_and_uses_symmetric_levels():
    z = torch.tensor([[0.0, 1.0, -1.0, 0.49, -0.51, 0.0, 0.2, 0.0]])
    for bits in (2, 3, 4, 8):
        scales, codes = quantize(z, "int", bits, 1)
        back = dequantize(scales, codes, "int", bits, 1, z.shape[-1])
        assert back[0, 0] == 0 and back[0, 5] == 0 and back[0, 7] == 0  # zero stays exactly zero
        assert back[0, 1] == pytest.approx(1.0, rel=2**-7) and back[0, 2] == -back[0, 1]
        codes_back = unpack_bits(codes, bits, z.shape[-1]) if bits < 8 else codes.long()
        assert int(codes_back.max()) <= 2 * int_levels(bits)
    # int2: exactly the levels {-s, 0, s}
    scales, codes = quantize(z, "int", 2, 1)
    values = set(dequantize(scales, codes, "int", 2, 1, 8).flatten().tolist())
    assert len(values) == 3


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("width", [1, 7, 8, 13, 64])
def test_bit_packing_round_trips_and_has_the_stated_size(bits, width):
    codes = torch.randint(0, 2**bits, (3, 5, width), generator=torch.Generator().manual_seed(width), dtype=torch.int64)
    packed = pack_bits(codes.to(torch.uint8), bits)
    assert packed.dtype == torch.uint8
    assert packed.shape[-1] == (width if bits == 8 else math.ceil(width / 8) * bits)
    assert torch.equal(unpack_bits(packed, bits, width), codes)


@pytest.mark.parametrize("text", ["outliers2+int2g31sr", "outliers3+int2x8sr"])
def test_stochastic_rounding_of_the_backward_is_unbiased_and_seeded(text):
    codec = _fitted(text)
    g = torch.randn(2, 8, H, generator=torch.Generator().manual_seed(5))
    draws = torch.stack([codec.decode_gradient(codec.encode_gradient(g, 0, m)) for m in range(4000)])
    rest = codec.rest_dims
    mean, spread = draws.mean(0)[..., rest], draws.std(0)[..., rest]
    # every coordinate's mean is within 5 standard errors of the true gradient; a value far below its level step s
    # (int2: s = the group's absmax) may round up in none of the n draws, so one step over n is undetectable
    resolution = g[..., rest].abs().amax() * (1 + 2**-7) / len(draws)
    assert ((mean - g[..., rest]).abs() <= 5 * spread / math.sqrt(len(draws)) + resolution).all()
    nearest = _fitted(text[: -len("sr")])
    bias = (nearest.decode_gradient(nearest.encode_gradient(g, 0, 0)) - g)[..., rest].abs().mean()
    assert (mean - g[..., rest]).abs().mean() < bias / 10  # round-to-nearest at 2 bits is biased; SR is not
    # the noise is a function of (boundary, step, microbatch, seed): the same on every process, new per microbatch
    same = codec.encode_gradient(g, 4, 2)
    assert torch.equal(same.view(torch.uint8), codec.encode_gradient(g, 4, 2).view(torch.uint8))
    assert not torch.equal(same.view(torch.uint8), codec.encode_gradient(g, 4, 3).view(torch.uint8))
    assert not torch.equal(same.view(torch.uint8), _fitted(text, seed=1).encode_gradient(g, 4, 2).view(torch.uint8))


def test_the_fit_keeps_the_largest_dims_and_an_orthonormal_basis():
    codec = _fitted("outliers2+spca24+int4")
    assert codec.outlier_dims.tolist() == [5, 40]
    assert sorted(codec.rest_dims.tolist() + codec.outlier_dims.tolist()) == list(range(H))
    basis = codec.basis.double()
    torch.testing.assert_close(basis.T @ basis, torch.eye(24, dtype=torch.float64), atol=1e-5, rtol=0)
    # a full-rank projection without quantisation rebuilds h (float32 arithmetic)
    full = ComposedCodec(parse_codec("outliers2+pca61"), 0, H)
    full.fit(_activations())
    h = _activations(16, seed=3)
    err = (full.apply(h, 0, 0)[0] - h).norm() / h.norm()
    assert err < 0.05  # r = 61 of 62 directions: only the weakest is lost
    assert (_fitted("outliers2+pca8").apply(h, 0, 0)[0] - h).norm() / h.norm() > err


def test_bytes_per_token_of_the_issue_table_at_smollm2_width():
    cases = {
        "outliers8+int4g71": 316,
        "outliers8+int4x8": 316,
        "outliers8+int4x7": 314,
        "outliers8+int3g71": 246,
        "outliers8+int2g71": 174,
        "outliers8+spca226+int4": 134,
        "pca57+int8": 60,
        "pca29": 58,
        "int8": 578,
    }
    for text, expected in cases.items():
        assert parse_codec(text).payload_bytes(576, 2) == expected, text


def test_a_codec_that_needs_geometry_refuses_to_run_without_it():
    codec = ComposedCodec(parse_codec("outliers2+int4"), 0, H)
    with pytest.raises(ValueError, match="be fitted before it runs"):
        codec.encode_activation(torch.zeros(1, H))
    assert ComposedCodec(parse_codec("int4"), 0, H).ready  # a plain quantiser needs nothing


# --- the single-process hooks ---------------------------------------------------------------------


def test_the_hooks_run_receive_of_send_on_training_forwards_and_book_the_message_bytes():
    model = tiny_llama(seed=0, layers=4, hidden=H)
    ids = torch.randint(3, 100, (2, 10), generator=torch.Generator().manual_seed(0))
    dense_loss = model(input_ids=ids, labels=ids).loss.item()
    handle = attach_composed(model, 4, "outliers2+int3g31")
    handle.calibrate(model, {"input_ids": ids})
    handle.set_step(0)
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    message = parse_codec("outliers2+int3g31").payload_bytes(H, 4)
    assert handle.counter.fwd_bytes == handle.counter.bwd_bytes == 3 * ids.numel() * message
    assert handle.counter.tokens == ids.numel()
    assert loss.item() != dense_loss and abs(loss.item() - dense_loss) < 0.05 * dense_loss
    model.eval()
    with torch.no_grad():
        assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(dense_loss, rel=1e-6)
    handle.remove()
    model.train()
    assert model(input_ids=ids, labels=ids).loss.item() == pytest.approx(dense_loss, rel=1e-6)


def test_the_mesh_knob_and_the_ledger_book_the_codec_message():
    cfg = MeshConfig(boundary_codec="outliers8+int4g71", num_stages=4)
    assert cfg.mask_ratio == 0.0  # a composed codec sends no mask
    with pytest.raises(ValueError, match=r"mask_ratio=0.9 is invalid: it must stay 0.0 with boundary_codec"):
        MeshConfig(boundary_codec="outliers8+int4g71", mask_ratio=0.9)
    paper = MeshConfig(boundary_codec="mask0.8+mean")
    assert (paper.mask_ratio, paper.mask_fill) == (0.8, "mean")
    settings = LedgerSettings(num_stages=4, boundary_codec="outliers8+int4g71", anchor=False, num_replicas=2)
    ledger = compute_ledger([(576, 576)], 576, settings)
    assert ledger.pp_fwd == ledger.pp_bwd == 3 * 316
    assert ledger.keep == 158


def test_a_resumed_trainer_continues_exactly_with_the_geometry_it_had(tmp_path):
    """MeshTrainer with a fitted codec, anchor on: the checkpoint holds the outlier dims and the basis (and a
    refit in flight with its gradient), and a run resumed from it on another model object (whose own
    calibration would differ) gives the same losses and ends with the same refitted geometry."""
    from hf_meshtune.trainer import MESH_STATE_NAME
    from tests.test_trainer import make_trainer, train_losses

    knobs = dict(
        max_steps=6,
        boundary_codec="outliers2+spca16+int4sr",
        mask_ratio=None,  # the codec is the boundary (make_trainer's knobs name a mask ratio)
        anchor_every=2,
        anchor_delay=1,
        save_strategy="steps",
        save_steps=3,
    )
    full = make_trainer(tmp_path / "full", **knobs)
    full.train()
    checkpoint = tmp_path / "full" / "out" / "checkpoint-3"
    state = torch.load(checkpoint / MESH_STATE_NAME, weights_only=True)
    (geometry,) = state["boundaries"]["codecs"]
    assert geometry["outlier_dims"].numel() == 2 and geometry["basis"].shape == (62, 16)
    resumed = make_trainer(tmp_path / "resumed", model=tiny_llama(seed=123), **knobs)
    resumed.train(resume_from_checkpoint=str(checkpoint))
    after_resume = [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 3]
    assert len(after_resume) == 3 and after_resume == train_losses(full)[3:]
    final = full.mesh_boundaries.codecs[0].geometry()
    assert not torch.equal(final["basis"], geometry["basis"])  # the anchor's rounds refitted it after step 3
    assert geometry_digest(resumed.mesh_boundaries.codecs[0].geometry()) == geometry_digest(final)


def test_k_equal_groups_are_the_group_size_that_divides():
    """At SmolLM2's width, outliers8+int4x8 cuts the 568 other dims as int4g71 does: the same message bit for bit."""
    z = torch.randn(3, 568, generator=torch.Generator().manual_seed(0))
    counted, sized = parse_codec("outliers8+int4x8"), parse_codec("outliers8+int4g71")
    assert counted.groups(576) == sized.groups(576) == 8
    for a, b in zip(quantize(z, "int", 4, counted.groups(576)), quantize(z, "int", 4, sized.groups(576))):
        assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
