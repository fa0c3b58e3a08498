"""Tests of the baseline boundary codecs (hf_meshtune.boundary.codecs): each codec against a plain float64
reference of its forward and backward, the dense model outside training forwards, wire-byte
formulas (what the handle books: these codecs build no message) checked against the composed codec's
packed messages where both have the scheme, and argument validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_meshtune.boundary.codecs import (
    CODECS,
    CODECS_ATTR,
    BottleneckCodec,
    DeltaQuantCodec,
    PCACodec,
    QuantCodec,
    TopKCodec,
    attach_codec,
)
from tests.tiny import tiny_llama

pytestmark = pytest.mark.usefixtures("single_thread_torch")

H = 64  # tiny_llama's hidden size


def randn(*shape: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)


def token_batch(batch: int = 2, seq: int = 8, seed: int = 0) -> torch.Tensor:
    return torch.randint(3, 100, (batch, seq), generator=torch.Generator().manual_seed(seed))


def grad_of(out: torch.Tensor, x: torch.Tensor, upstream: torch.Tensor) -> torch.Tensor:
    return torch.autograd.grad(out, x, upstream)[0]


def reference_quantize(x: np.ndarray, bits: int) -> np.ndarray:
    """Per-token absmax quantisation written out in float64 NumPy: codes -L..L (L = 2^(b-1) - 1) times absmax/L."""
    levels = 2 ** (bits - 1) - 1
    step = np.abs(x).max(axis=-1, keepdims=True) / levels
    codes = np.clip(np.round(x / np.where(step > 0, step, 1.0)), -levels, levels)
    return codes * step


def affine_subspace_data(rows: int, rank: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Points mu + A z lying in a rank-dim affine subspace of R^H, and an orthonormal basis of span(A)."""
    mu, a = randn(H, seed=100), randn(H, rank, seed=101)
    return mu + randn(rows, rank, seed=seed) @ a.T, torch.linalg.qr(a).Q


def nudged(model: torch.nn.Module) -> torch.nn.Module:
    """The same small weight change on every copy (an optimizer step's worth)."""
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(1.1)
    return model


def fitted_handle(codec: str, model: torch.nn.Module, ids: torch.Tensor, **kwargs):
    handle = attach_codec(model, num_stages=3, codec=codec, **kwargs)
    handle.fit(model, {"input_ids": ids})
    return handle


# ---------------------------------------------------------------------------------------------
# Each codec against its reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quant_forward_and_backward_match_reference(bits):
    x = randn(2, 5, H).requires_grad_()
    with torch.no_grad():
        x[1, 2] = 0.0  # an all-zero token stays zero
    out = QuantCodec(H, bits=bits)(x, None)
    expected = reference_quantize(x.detach().numpy(), bits)
    np.testing.assert_allclose(out.detach().numpy(), expected, rtol=1e-12, atol=1e-12)
    levels = 2 ** (bits - 1) - 1
    assert all(len(np.unique(token)) <= 2 * levels + 1 for token in out.detach().numpy().reshape(-1, H))
    scale = x.detach().abs().amax(-1, keepdim=True)
    assert bool(((out - x).abs() <= scale / (2 * levels) + 1e-12).all())
    assert bool((out[x.abs() < scale / (2 * levels) - 1e-9] == 0).all())  # the zero level: small entries stay 0
    assert not torch.allclose(out, x)

    upstream = randn(2, 5, H, seed=1)
    expected_grad = reference_quantize(upstream.numpy(), bits)
    np.testing.assert_allclose(grad_of(out, x, upstream).numpy(), expected_grad, rtol=1e-12, atol=1e-12)


def test_quant_grad_bits_apply_to_the_gradient_only():
    x = randn(1, 3, H).requires_grad_()
    out = QuantCodec(H, bits=2, grad_bits=8)(x, None)
    upstream = randn(1, 3, H, seed=1)
    np.testing.assert_allclose(out.detach().numpy(), reference_quantize(x.detach().numpy(), 2), atol=1e-12)
    np.testing.assert_allclose(grad_of(out, x, upstream).numpy(), reference_quantize(upstream.numpy(), 8), atol=1e-12)


def test_topk_keeps_the_k_largest_and_restricts_the_gradient():
    k = 5
    x = randn(2, 4, H).requires_grad_()
    out = TopKCodec(H, k=k)(x, None)
    support = torch.zeros(2, 4, H, dtype=torch.bool)
    for b in range(2):
        for t in range(4):
            largest = np.argsort(-np.abs(x[b, t].detach().numpy()))[:k]
            support[b, t, torch.as_tensor(largest)] = True
    assert torch.equal(out.detach() != 0, support)
    assert torch.equal(out.detach()[support], x.detach()[support])

    upstream = randn(2, 4, H, seed=1)
    grad = grad_of(out, x, upstream)
    assert torch.equal(grad[support], upstream[support])
    assert bool((grad[~support] == 0).all())


@pytest.mark.parametrize("codec_class", [PCACodec, BottleneckCodec])
def test_low_rank_codecs_are_exact_on_an_affine_subspace(codec_class):
    rank = 3
    train, basis = affine_subspace_data(40, rank, seed=0)
    fresh, _ = affine_subspace_data(6, rank, seed=1)
    codec = codec_class(H, rank=rank).double()
    codec.fit(train)
    x = fresh.reshape(2, 3, H).requires_grad_()
    out = codec(x, None)
    torch.testing.assert_close(out, x, rtol=1e-9, atol=1e-9)

    # the gradient is the projection onto span(A), whatever basis the codec found for it
    projector = basis @ basis.T
    upstream = randn(2, 3, H, seed=2)
    torch.testing.assert_close(grad_of(out, x, upstream), upstream @ projector, rtol=1e-9, atol=1e-9)
    assert not torch.allclose(upstream @ projector, upstream)  # rank K < H: a real projection


def test_pca_gradient_is_p_p_transpose_g_off_the_subspace():
    codec = PCACodec(H, rank=4).double()
    codec.fit(randn(50, H))
    p = codec.basis
    torch.testing.assert_close(p.T @ p, torch.eye(4, dtype=torch.float64), rtol=0, atol=1e-12)
    x = randn(1, 3, H, seed=1).requires_grad_()
    upstream = randn(1, 3, H, seed=2)
    out = codec(x, None)
    torch.testing.assert_close(out, codec.mean + (x - codec.mean) @ p @ p.T)
    torch.testing.assert_close(grad_of(out, x, upstream), upstream @ p @ p.T)
    assert codec.basis_bytes == (H * 4 + H) * 4


def test_pca_refuses_to_run_unfitted():
    with pytest.raises(ValueError, match=r"pca\.basis=None is invalid: it must be fitted"):
        PCACodec(H)(randn(1, 2, H), None)


def test_bottleneck_parameters_train_with_the_model():
    model = tiny_llama()
    ids = token_batch()
    handle = fitted_handle("bottleneck", model, ids)
    names = {name for name, _ in model.named_parameters()}
    sides = [f"{side}.{kind}" for side in ("down", "up") for kind in ("weight", "bias")]
    assert {f"{CODECS_ATTR}.{i}.{side}" for i in range(2) for side in sides} <= names
    model(input_ids=ids, labels=ids).loss.backward()
    for codec in handle.codecs:
        for name, param in codec.named_parameters():
            assert param.grad is not None and bool(param.grad.abs().sum() > 0), name
    handle.remove()
    assert not any(name.startswith(CODECS_ATTR) for name, _ in model.named_parameters())


def test_delta_quant_sends_full_precision_first_then_quantised_deltas():
    bits, seq = 4, 3
    codec = DeltaQuantCodec(H, bits=bits)
    x = randn(2, seq, H)
    first = codec(x, [b"a", b"b"])
    assert torch.equal(first, x)
    assert codec.last_wire_bytes[0] == 2 * seq * H * 2

    moved = x + 0.01 * randn(2, seq, H, seed=1)
    second = codec(moved, [b"a", b"b"])
    bound = (moved - x).abs().amax(-1, keepdim=True) / (2 * (2 ** (bits - 1) - 1))
    assert bool(((second - moved).abs() <= bound + 1e-12).all())
    assert not torch.equal(second, moved)
    assert codec.last_wire_bytes[0] == 2 * seq * (H * bits // 8 + 2) < 2 * seq * H * 2
    torch.testing.assert_close(codec.sample_buffers[b"a"], second[0], rtol=0, atol=0)  # both sides store the rebuild

    # another key never reads a's buffer, and a new shape under a known key starts over
    third = codec(moved + 1.0, [b"a", b"c"])
    assert not torch.equal(third[0], moved[0] + 1.0) and torch.equal(third[1], moved[1] + 1.0)
    longer = randn(1, seq + 1, H, seed=3)
    assert torch.equal(codec(longer, [b"b"]), longer)


def test_delta_quant_gradient_is_quantised_and_keys_are_required():
    x = randn(1, 2, H).requires_grad_()
    codec = DeltaQuantCodec(H, bits=4, grad_bits=3)
    upstream = randn(1, 2, H, seed=1)
    grad = grad_of(codec(x, [b"k"]), x, upstream)
    np.testing.assert_allclose(grad.numpy(), reference_quantize(upstream.numpy(), 3), atol=1e-12)
    with pytest.raises(ValueError, match=r"keys=None is invalid: it must be one bytes key per batch row"):
        codec(x, None)


def test_delta_quant_through_a_model_costs_less_on_the_second_epoch():
    model = tiny_llama()
    ids = token_batch()
    handle = attach_codec(model, num_stages=2, codec="delta_quant")
    model(input_ids=ids, labels=ids).loss.backward()
    first = handle.counter.fwd_bytes
    model(input_ids=ids, labels=ids).loss.backward()
    assert handle.counter.fwd_bytes - first == ids.numel() * (H * 4 // 8 + 2) < first == ids.numel() * H * 2
    assert len(handle.codecs[0].sample_buffers) == 2  # one buffer per distinct row


# ---------------------------------------------------------------------------------------------
# Dense outside training forwards
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_codecs_act_only_on_training_forwards(codec):
    ids = token_batch()
    reference = nudged(tiny_llama())
    dense_train = reference(input_ids=ids).logits.detach()
    reference.eval()
    with torch.no_grad():
        dense_eval = reference(input_ids=ids).logits

    model = tiny_llama()
    handle = fitted_handle(codec, model, ids)
    model(input_ids=ids)  # delta_quant: a first sight is full precision and fills the buffers ...
    nudged(model)  # ... and a later sight of changed activations sends a lossy delta
    assert not torch.allclose(model(input_ids=ids).logits, dense_train)
    with handle.disabled():
        assert torch.equal(model(input_ids=ids).logits, dense_train)
    with torch.no_grad():
        assert torch.equal(model(input_ids=ids).logits, dense_train)
    model.eval()
    assert torch.equal(model(input_ids=ids).logits.detach(), dense_eval)
    model.train()
    handle.remove()
    assert not hasattr(model, CODECS_ATTR)
    assert torch.equal(model(input_ids=ids).logits, dense_train)


def test_state_dict_round_trip():
    ids = token_batch()
    model, twin = tiny_llama(), tiny_llama()
    handle = fitted_handle("pca", model, ids)
    twin_handle = attach_codec(twin, num_stages=3, codec="pca")
    twin_handle.load_state_dict(handle.state_dict())
    torch.testing.assert_close(twin(input_ids=ids).logits, model(input_ids=ids).logits, rtol=0, atol=0)

    delta, twin_delta = attach_codec(tiny_llama(), 2, "delta_quant"), attach_codec(tiny_llama(), 2, "delta_quant")
    delta.codecs[0](randn(2, 3, H).float(), [b"a", b"b"])
    twin_delta.load_state_dict(delta.state_dict())
    moved = randn(2, 3, H, seed=1).float()
    assert torch.equal(delta.codecs[0](moved, [b"a", b"b"]), twin_delta.codecs[0](moved, [b"a", b"b"]))


# ---------------------------------------------------------------------------------------------
# Wire bytes: formulas at H = 576 and the measured counter
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "codec, kwargs, expected",
    [
        ("quant4", {}, (576 * 4 / 8 + 2, 576 * 4 / 8 + 2)),
        ("quant4", {"bits": 3, "grad_bits": 8}, (576 * 3 / 8 + 2, 576 + 2)),
        ("topk", {}, (14 * 4, 14 * 2)),  # k = round(576·2/20/4) = round(14.4)
        ("topk", {"k": 100, "dtype_bytes": 4}, (100 * 6, 100 * 4)),
        ("bottleneck", {}, (29 * 2, 29 * 2)),  # K = round(0.05·576) = round(28.8)
        ("delta_quant", {}, (576 * 4 / 8 + 2, 576 * 4 / 8 + 2)),
        ("pca", {}, (29 * 2, 29 * 2)),
        ("pca", {"rank": 64}, (64 * 2, 64 * 2)),
    ],
)
def test_wire_bytes_per_token_at_576(codec, kwargs, expected):
    dtype_bytes = kwargs.get("dtype_bytes", 2)
    assert CODECS[codec](576, **kwargs).wire_bytes_per_token(576, dtype_bytes) == expected


def test_topk_default_compresses_twenty_fold():
    fwd, _ = TopKCodec(576).wire_bytes_per_token(576)
    assert 19 <= 576 * 2 / fwd <= 21
    assert TopKCodec(576, compression=10).k == 29


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_the_quant_formula_is_the_size_of_a_packed_int_message(bits):
    """QuantCodec books ⌈H·b/8⌉ + 2 bytes a token; the composed ``int<b>`` codec builds that message
    (codes packed into bytes, one bf16 scale) as a tensor: its bytes, counted, are the formula's."""
    from hf_meshtune.boundary.compose import ComposedCodec, parse_codec

    hidden = randn(3, 5, 576, seed=bits).bfloat16()
    payload = ComposedCodec(parse_codec(f"int{bits}"), 0, 576).encode_activation(hidden)
    counted = payload.numel() * payload.element_size() / 15
    assert counted == QuantCodec(576, bits=bits).wire_bytes_per_token(576, 2)[0] == 576 * bits / 8 + 2


def test_the_pca_formula_is_the_size_of_a_packed_projection_message():
    from hf_meshtune.boundary.compose import ComposedCodec, parse_codec

    hidden = randn(4, 16, 576, seed=3).bfloat16()
    codec = ComposedCodec(parse_codec("pca29"), 0, 576)
    codec.fit(hidden.float())
    payload = codec.encode_activation(hidden)
    assert payload.numel() * payload.element_size() / 64 == PCACodec(576).wire_bytes_per_token(576, 2)[0] == 29 * 2


@pytest.mark.parametrize("codec", sorted(CODECS))
def test_the_counter_books_every_token_at_every_boundary_both_ways_after_one_step(codec):
    """Bookkeeping, not traffic: these baseline codecs build no message, so the counter books tokens × the
    codec's formula, and what this checks is that every token of every boundary is booked once each way.
    That the formulas are the sizes of real messages is checked above for the quantiser and the projection
    (the packed tensors of the composed codec, counted), and the composed codec's counter counts its tensors."""
    model = tiny_llama()
    ids = token_batch()
    handle = fitted_handle(codec, model, ids)  # 3 stages: 2 boundaries
    model(input_ids=ids, labels=ids).loss.backward()
    fwd, bwd = handle.codecs[0].wire_bytes_per_token(H)
    if codec == "delta_quant":
        fwd = H * 2  # every row is a first sight
    tokens = ids.numel()
    assert handle.counter.tokens == tokens
    assert (handle.counter.fwd_bytes, handle.counter.bwd_bytes) == (2 * tokens * fwd, 2 * tokens * bwd)
    assert handle.counter.bwd_bytes < 2 * tokens * H * 2  # every codec compresses the gradient


# ---------------------------------------------------------------------------------------------
# Validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "num_stages, codec, kwargs, shown",
    [
        (2, "gzip", {}, r"codec='gzip' is invalid: it must be one of \['bottleneck'"),
        (0, "quant4", {}, r"num_stages=0 is invalid: it must be >= 1"),
        (2, "quant4", {"bits": 1}, r"bits=1 is invalid: it must be an int in \[2, 8\]"),
        (2, "quant4", {"bits": 9}, r"bits=9 is invalid"),
        (2, "quant4", {"grad_bits": 16}, r"grad_bits=16 is invalid"),
        (2, "delta_quant", {"bits": 0}, r"bits=0 is invalid"),
        (2, "topk", {"k": 0}, r"k=0 is invalid: it must be an int in \[1, hidden_size - 1 = 63\]"),
        (2, "topk", {"k": H}, rf"k={H} is invalid"),
        (2, "topk", {"k": 4, "compression": 10.0}, r"compression=10.0 is invalid: it must be None when k is given"),
        (2, "topk", {"compression": 0.5}, r"k=64 is invalid"),
        (2, "pca", {"rank": 0}, r"rank=0 is invalid: it must be an int in \[1, hidden_size - 1 = 63\]"),
        (2, "bottleneck", {"rank": H}, rf"rank={H} is invalid"),
        (1, "pca", {"rank": H}, rf"rank={H} is invalid"),  # checked even when Y = 1 attaches nothing
    ],
)
def test_attach_codec_rejects(num_stages, codec, kwargs, shown):
    model = tiny_llama(layers=2)
    with pytest.raises(ValueError, match=shown):
        attach_codec(model, num_stages=num_stages, codec=codec, **kwargs)
    assert not hasattr(model, CODECS_ATTR)


def test_attach_codec_twice_and_width_mismatch_are_rejected():
    model = tiny_llama(layers=2)
    attach_codec(model, 2, "quant4")
    with pytest.raises(ValueError, match=rf"{CODECS_ATTR}='attached' is invalid"):
        attach_codec(model, 2, "topk")
    with pytest.raises(ValueError, match=r"hidden_size=32 is invalid: it must equal the codec's hidden_size=64"):
        QuantCodec(H)(randn(1, 2, 32), None)
