"""The wire's new stages on their own: the rotation (orthogonal, its exact inverse), e8m0 scales, the lossless
coder (every byte pattern, empty and one-token messages), the variable-size message (carried lengths, header
checks) and the ledger's coder ratio."""

from __future__ import annotations

import math

import pytest
import torch

from hf_meshtune.boundary.compose.entropy import CODERS, decode_records, encode_records
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.compose.quant import dequantize, quantize, scale_values
from hf_meshtune.boundary.compose.rotation import Rotation, hadamard
from hf_meshtune.ledger import LedgerSettings, compute_ledger, measured_ratios
from hf_meshtune.pipeline.messages import WireFormat, carried_lengths, carried_mask

pytestmark = pytest.mark.usefixtures("single_thread_torch")


@pytest.mark.parametrize(("width", "block"), [(64, 64), (56, 16), (62, 8), (568, 64), (5, 2)])
def test_the_rotation_is_orthogonal_and_its_transpose_inverts_it_exactly(width, block):
    rotation = Rotation(width, block, boundary=1, direction="fwd", seed=3)
    assert rotation.padded % block == 0 and width <= rotation.padded < width + block
    basis = torch.eye(width, dtype=torch.float64)
    columns = rotation.forward(basis.float()).double()  # R applied to each unit vector: R's columns, [D, D']
    torch.testing.assert_close(columns @ columns.T, basis, atol=1e-6, rtol=0)  # isometric on R^D
    z = torch.randn(7, width, generator=torch.Generator().manual_seed(width))
    torch.testing.assert_close(rotation.inverse(rotation.forward(z)), z, atol=2e-6, rtol=0)
    h = hadamard(block, torch.float64)
    torch.testing.assert_close(h @ h.T, block * torch.eye(block, dtype=torch.float64))


def test_the_rotation_is_seeded_per_boundary_direction_and_seed():
    def signs(*args):
        rotation = Rotation(64, 16, *args)
        return rotation.signs.tolist(), rotation.permutation.tolist()

    assert signs(0, "fwd", 1) == signs(0, "fwd", 1)  # sender and receiver derive the same R
    assert len({str(signs(*a)) for a in [(0, "fwd", 1), (1, "fwd", 1), (0, "bwd", 1), (0, "fwd", 2)]}) == 4


def test_a_rotation_spreads_an_outlier_over_its_block():
    z = torch.zeros(1, 64)
    z[0, 5] = 8.0
    rotated = Rotation(64, 64, 0, "fwd", 0).forward(z)
    assert torch.allclose(rotated.abs(), torch.full_like(rotated, 1.0))  # 8 / √64 in every position


def test_e8m0_scales_are_powers_of_two_at_or_above_absmax_over_levels():
    z = torch.tensor([[0.3, -2.9, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0], [1e-3, 5.0, -7.0, 7.0]])
    scales, codes = quantize(z, "int", 4, 1, scales_form="e8m0")
    assert scales.dtype == torch.uint8 and scales.shape == (3, 1)
    values = scale_values(scales).squeeze(-1)
    assert values.tolist() == [0.5, 1.0, 1.0]  # 2.9 / 7 → 2^-1; an all-zero row → 1; 7 / 7 → 2^0
    back = dequantize(scales, codes, "int", 4, 1, 4)
    assert back[1].eq(0).all() and (back - z).abs().max() <= values.max() / 2 + 1e-6


@pytest.mark.parametrize("coder", CODERS)
@pytest.mark.parametrize("rows", [0, 1, 256])
def test_the_coder_round_trips_every_byte_pattern(coder, rows):
    width = 37
    records = (torch.arange(rows * width, dtype=torch.int64) * 7 % 256).to(torch.uint8).reshape(rows, width)
    if rows == 256:
        records[:, 0] = torch.arange(256, dtype=torch.uint8)  # every byte value in one column
    data = encode_records(records, coder)
    assert torch.equal(decode_records(data, rows, width, coder), records)
    with pytest.raises(ValueError, match="coded boundary message=.* must hold"):
        decode_records(data, rows + 1, width, coder)


def test_the_coder_shrinks_codes_with_few_levels():
    codes = torch.randint(6, 10, (512, 64), generator=torch.Generator().manual_seed(0), dtype=torch.uint8)
    assert len(encode_records(codes, "zstd")) < codes.numel() / 2


def test_carried_lengths_end_after_each_rows_last_label():
    labels = torch.tensor([[1, 2, 3, -100], [-100, 5, -100, -100], [-100] * 4, [9] * 4])
    assert carried_lengths(labels).tolist() == [3, 2, 0, 4]
    assert carried_mask(torch.tensor([3, 0]), 4).tolist() == [[True, True, True, False], [False] * 4]


def test_a_message_carries_the_carried_rows_records_and_its_header_is_checked():
    form = WireFormat(record=6, width=2, dtype=torch.float32, coder="zstd")
    payload = torch.arange(2 * 5 * 2, dtype=torch.float32).reshape(2, 5, 2)
    lengths = torch.tensor([2, 4])
    header, body = form.pack(payload, lengths)
    assert header.tolist()[1:] == [6, 6] and header[0] == body.numel()
    assert form.expect(header, lengths, 10) == body.numel()
    target = torch.empty(2, 5, 2)
    form.unpack(body, lengths, target)
    kept = payload.view(torch.uint8).reshape(2, 5, 8)[..., :6]  # the first 6 bytes of each position, the rest 0
    expected = torch.zeros(2, 5, 8, dtype=torch.uint8)
    expected[..., :6] = kept
    expected[0, 2:] = 0
    expected[1, 4:] = 0
    assert torch.equal(target.view(torch.uint8).reshape(2, 5, 8), expected)
    with pytest.raises(ValueError, match=r"header=\(rows 6, record 6 B\) is invalid: it must announce the 5"):
        form.expect(header, torch.tensor([2, 3]), 10)


def test_the_ledger_divides_a_coded_codec_by_its_measured_ratios():
    codec = "outliers8+rot+int4g64e8m0+zstd"
    spec = parse_codec(codec)
    base = dict(num_replicas=2, num_stages=3, anchor=False, boundary_codec=codec, activation_dtype="bfloat16")
    uncoded = compute_ledger([(8, 8)], 576, LedgerSettings(**base))
    coded = compute_ledger([(8, 8)], 576, LedgerSettings(**base, coding_ratio=(2.0, 1.25)))
    record = spec.message_bytes(576, 2)
    assert uncoded.pp_fwd == uncoded.pp_bwd == 2 * record
    assert coded.pp_fwd == pytest.approx(2 * record / 2.0) and coded.pp_bwd == pytest.approx(2 * record / 1.25)
    assert (
        uncoded.to_dict()["boundary_coding"] == "not counted"
        and "measured ratios" in coded.to_dict()["boundary_coding"]
    )
    assert measured_ratios(300, 200, 0, 0) == (1.5, 1.5)  # no backward carried: the forward's ratio
    assert measured_ratios(0, 0, 0, 0) == (1.0, 1.0)
    with pytest.raises(ValueError, match=r"coding_ratio=-1 is invalid"):
        LedgerSettings(**base, coding_ratio=-1)
    assert not math.isnan(coded.total)


def test_a_microbatch_that_carries_nothing_has_an_empty_body_and_lands_zeros():
    form = WireFormat(record=8, width=2, dtype=torch.float32)
    header, body = form.pack(torch.ones(2, 3, 2), torch.tensor([0, 0]))
    assert header.tolist() == [0, 0, 8] and body.numel() == 0  # MeshStage sends the header alone
    target = torch.ones(2, 3, 2)
    form.unpack(body, torch.tensor([0, 0]), target)
    assert target.eq(0).all()
