"""Tests of the shared-seed boundary masks (hf_meshtune.boundary.masking, docs/design.md): determinism across
processes, exact K per token, uniformity of the keep-sets, compact/expand autograd, BoundaryMask
and the receiver-side fills."""

from __future__ import annotations

import io
import itertools
import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from hf_meshtune.boundary.fills import MeanFill
from hf_meshtune.boundary.masking import BoundaryMask, compact, expand, keep_count, keep_indices

pytestmark = pytest.mark.usefixtures("single_thread_torch")

REPO_ROOT = Path(__file__).resolve().parents[1]


def mask01(idx: torch.Tensor, hidden_size: int, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """The 0/1 mask m [T, H] of keep-indices [T, K], written with plain indexing (no scatter)."""
    m = torch.zeros(idx.shape[0], hidden_size, dtype=dtype)
    for t in range(idx.shape[0]):
        m[t, idx[t]] = 1.0
    return m


# ---------------------------------------------------------------------------------------------
# g(ℓ, step, microbatch, T, H, seed) is a pure function
# ---------------------------------------------------------------------------------------------

# boundary, step, microbatch, T, H, K, seed
BASE_ARGS = (1, 5, 2, 16, 64, 16, 7)

# The child imports hf_meshtune.boundary.masking under a bare package stub: the package __init__ pulls in
# transformers (seconds per process) and nothing of it is needed to draw indices.
_CHILD = """
import json, sys, types, torch
package = types.ModuleType("hf_meshtune")
package.__path__ = [sys.argv[2]]
sys.modules["hf_meshtune"] = package
from hf_meshtune.boundary.masking import keep_indices
torch.manual_seed(int(sys.argv[1]))
draw = torch.rand(3).tolist()                     # proves the global RNG streams differ
idx = keep_indices(*map(int, sys.argv[3:]))
print(json.dumps({"draw": draw, "idx": idx.tolist()}))
"""


def test_keep_indices_identical_across_processes():
    args = [str(REPO_ROOT / "hf_meshtune"), *(str(a) for a in BASE_ARGS)]
    children = [
        subprocess.Popen([sys.executable, "-c", _CHILD, str(rng_seed), *args], stdout=subprocess.PIPE, text=True)
        for rng_seed in (1, 2)
    ]
    results = []
    for child in children:
        out, _ = child.communicate(timeout=120)
        assert child.returncode == 0
        results.append(json.loads(out))

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)
        parent = keep_indices(*BASE_ARGS).tolist()

    assert results[0]["draw"] != results[1]["draw"]  # the children's global RNGs really differ
    assert results[0]["idx"] == parent
    assert results[1]["idx"] == parent


@pytest.mark.parametrize(
    "position, value",
    [(0, 2), (1, 6), (2, 3), (6, 8)],
    ids=["boundary", "step", "microbatch", "seed"],
)
def test_keep_indices_depend_on_every_coordinate(position, value):
    base = keep_indices(*BASE_ARGS)
    changed = list(BASE_ARGS)
    changed[position] = value
    assert not torch.equal(keep_indices(*changed), base)


def test_keep_indices_depend_on_sequence_length():
    base = keep_indices(*BASE_ARGS)
    longer = list(BASE_ARGS)
    longer[3] += 1  # T: the first T rows of a longer sequence are a different draw
    assert not torch.equal(keep_indices(*longer)[: BASE_ARGS[3]], base)


def test_keep_indices_do_not_touch_global_rng():
    torch.manual_seed(11)
    before = torch.get_rng_state()
    keep_indices(*BASE_ARGS)
    assert torch.equal(torch.get_rng_state(), before)


# ---------------------------------------------------------------------------------------------
# K = round((1-p)·H) distinct, sorted, in-range indices per token
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "mask_ratio, hidden_size, expected_keep",
    [(0.95, 64, 3), (0.95, 2048, 102), (0.9, 576, 58), (0.75, 32, 8), (0.5, 10, 5), (0.0, 16, 16), (0.2, 7, 6)],
)
def test_exactly_k_distinct_sorted_indices(mask_ratio, hidden_size, expected_keep):
    keep = keep_count(hidden_size, mask_ratio)
    assert keep == expected_keep
    idx = keep_indices(0, 3, 1, 12, hidden_size, keep, 0)
    assert idx.shape == (12, expected_keep)
    assert idx.dtype == torch.int64 and idx.device.type == "cpu"
    assert int(idx.min()) >= 0 and int(idx.max()) < hidden_size
    # strictly increasing along each row = sorted and distinct
    assert bool((idx[:, 1:] > idx[:, :-1]).all())


@pytest.mark.parametrize(
    "hidden_size, mask_ratio, shown",
    [(16, 1.0, "mask_ratio=1.0"), (16, -0.1, "mask_ratio=-0.1"), (8, 0.95, "mask_ratio=0.95")],
)
def test_keep_count_rejects_bad_ratios(hidden_size, mask_ratio, shown):
    with pytest.raises(ValueError, match=shown.replace(".", r"\.")):
        keep_count(hidden_size, mask_ratio)


def test_keep_indices_rejects_keep_out_of_range():
    with pytest.raises(ValueError, match="keep=9"):
        keep_indices(0, 0, 0, 4, 8, 9, 0)
    with pytest.raises(ValueError, match="keep=0"):
        keep_indices(0, 0, 0, 4, 8, 0, 0)


# ---------------------------------------------------------------------------------------------
# The keep-sets are uniform K-subsets (marginals, pairs, independence across tokens)
# ---------------------------------------------------------------------------------------------

UNI_H, UNI_K, UNI_T, UNI_DRAWS = 16, 4, 32, 200


def uniformity_violations(draw: Callable[[int], torch.Tensor], hidden_size: int, keep: int) -> list[str]:
    """What is wrong with ``draw(step) → [T, K]`` as a generator of uniform K-subsets of range(H).

    200 draws × 32 tokens = 6400 rows. The bounds sit ≥ 5 standard deviations out (the indices are
    deterministic, so this is not flaky), yet far inside what a biased generator produces.
    """
    rows = torch.cat([draw(step) for step in range(UNI_DRAWS)])
    n = rows.shape[0]
    m = mask01(rows, hidden_size)
    problems = []
    rate = m.mean(0)
    p1 = keep / hidden_size
    if (rate - p1).abs().max() > 0.03:  # σ ≈ 0.0054
        problems.append(f"per-dim keep rate off K/H: {rate.tolist()}")
    counts = m.sum(0)
    chi2 = float(((counts - n * p1) ** 2 / (n * p1)).sum())
    if chi2 > 50.0:  # 15 dof: P(χ² > 50) ≈ 1e-5
        problems.append(f"chi-square of per-dim counts {chi2:.1f}")
    p2 = keep * (keep - 1) / (hidden_size * (hidden_size - 1))
    pair = (m.T @ m) / n
    off_diag = pair[~torch.eye(hidden_size, dtype=torch.bool)]
    if (off_diag - p2).abs().max() > 0.015:  # σ ≈ 0.0027
        problems.append("pairwise co-occurrence is not uniform")
    first = draw(0)
    if len({tuple(r) for r in first.tolist()}) < 0.8 * first.shape[0]:
        problems.append("token positions of one draw share their keep-set")
    return problems


def test_keep_sets_are_uniform():
    def real(step: int) -> torch.Tensor:
        return keep_indices(0, step, 0, UNI_T, UNI_H, UNI_K, 0)

    assert uniformity_violations(real, UNI_H, UNI_K) == []


def test_uniformity_check_catches_biased_generators():
    """The check above must fail for generators that are wrong in each of the ways it looks at."""
    gen = torch.Generator().manual_seed(0)

    def first_k(step: int) -> torch.Tensor:
        return torch.arange(UNI_K).expand(UNI_T, UNI_K)

    def random_window(step: int) -> torch.Tensor:  # right marginals, wrong pairs
        start = torch.randint(UNI_H, (UNI_T, 1), generator=gen)
        return ((start + torch.arange(UNI_K)) % UNI_H).sort(-1).values

    def one_set_per_draw(step: int) -> torch.Tensor:  # right marginals and pairs, rows not independent
        row = torch.randperm(UNI_H, generator=gen)[:UNI_K].sort().values
        return row.expand(UNI_T, UNI_K)

    def skewed(step: int) -> torch.Tensor:  # dim 0 a bit more likely than the rest
        weights = torch.ones(UNI_T, UNI_H)
        weights[:, 0] = 1.5
        return torch.multinomial(weights, UNI_K, generator=gen).sort(-1).values

    for biased in (first_k, random_window, one_set_per_draw, skewed):
        assert uniformity_violations(biased, UNI_H, UNI_K), biased.__name__


# ---------------------------------------------------------------------------------------------
# compact / expand: values and autograd
# ---------------------------------------------------------------------------------------------

B, T, H, K = 2, 3, 6, 2


@pytest.fixture
def idx() -> torch.Tensor:
    return keep_indices(0, 0, 0, T, H, K, 0)


def test_compact_expand_values(idx):
    h = torch.randn(B, T, H, dtype=torch.float64)
    kept = compact(h, idx)
    assert kept.shape == (B, T, K)
    for b, t, k in itertools.product(range(B), range(T), range(K)):
        assert kept[b, t, k] == h[b, t, idx[t, k]]
    assert torch.equal(expand(kept, idx, H), h * mask01(idx, H))


def test_compact_expand_gradcheck(idx):
    h = torch.randn(B, T, H, dtype=torch.float64, requires_grad=True)
    x = torch.randn(B, T, K, dtype=torch.float64, requires_grad=True)
    fill = torch.randn(H, dtype=torch.float64)
    assert torch.autograd.gradcheck(lambda h: compact(h, idx), (h,))
    assert torch.autograd.gradcheck(lambda x: expand(x, idx, H), (x,))
    assert torch.autograd.gradcheck(lambda x: expand(x, idx, H, fill), (x,))
    assert torch.autograd.gradcheck(lambda h: expand(compact(h, idx), idx, H), (h,))


def test_expand_fill_takes_dropped_dims_and_gets_no_gradient(idx):
    m = mask01(idx, H)
    x = torch.randn(B, T, K, dtype=torch.float64, requires_grad=True)
    fill = torch.randn(H, dtype=torch.float32, requires_grad=True)
    out = expand(x, idx, H, fill)
    assert out.dtype == torch.float64
    dropped = (m == 0).expand(B, T, H)
    assert torch.equal(out[dropped], fill.detach().double().expand(B, T, H)[dropped])
    assert torch.equal(compact(out, idx), x)
    grad = torch.randn(B, T, H, dtype=torch.float64)
    out.backward(grad)
    assert fill.grad is None
    assert torch.equal(x.grad, compact(grad, idx))


# ---------------------------------------------------------------------------------------------
# BoundaryMask
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("rescale", [False, True])
def test_boundary_mask_apply_forward_and_backward(rescale):
    batch, seq, hidden, p = 3, 5, 16, 0.75
    keep = 4
    mask = BoundaryMask(boundary=2, mask_ratio=p, seed=9, rescale=rescale)
    m = mask01(keep_indices(2, 7, 1, seq, hidden, keep, 9), hidden)
    scale = hidden / keep if rescale else 1.0

    h = torch.randn(batch, seq, hidden, dtype=torch.float64, requires_grad=True)
    out, payload = mask.apply(h, step=7, microbatch=1)
    assert payload.shape == (batch, seq, keep)
    torch.testing.assert_close(out, h.detach() * m * scale, rtol=1e-15, atol=0)
    torch.testing.assert_close(payload, compact(h.detach() * scale, keep_indices(2, 7, 1, seq, hidden, keep, 9)))

    upstream = torch.randn(batch, seq, hidden, dtype=torch.float64)
    out.backward(upstream)
    kept = m.bool().expand_as(upstream)
    assert bool((h.grad[~kept] == 0).all())
    torch.testing.assert_close(h.grad[kept], upstream[kept] * scale, rtol=1e-15, atol=0)


def test_rescale_with_protected_dims_is_unbiased_per_dim():
    """Protected dims are always kept, so they stay unscaled; the others are kept with probability
    (K-P)/(H-P) and scaled by its inverse. The mean over many steps then equals h in every dim."""
    hidden, p, protected = 16, 0.5, torch.tensor([3, 11])
    keep = keep_count(hidden, p)
    mask = BoundaryMask(boundary=0, mask_ratio=p, seed=5, rescale=True, protected=protected)
    h = torch.randn(1, 4, hidden, dtype=torch.float64)
    out, _ = mask.apply(h, step=0, microbatch=0)
    idx = keep_indices(0, 0, 0, 4, hidden, keep, 5, protected)
    m = mask01(idx, hidden).bool()
    expected = torch.zeros_like(h)
    expected[0][m] = h[0][m] * (hidden - 2) / (keep - 2)
    expected[..., protected] = h[..., protected]
    torch.testing.assert_close(out, expected, rtol=1e-15, atol=0)
    steps = 4000
    mean = sum(mask.apply(h, step=s, microbatch=0)[0] for s in range(steps)) / steps
    torch.testing.assert_close(mean, h, rtol=0, atol=0.12 * float(h.abs().max()))


def test_boundary_mask_rejects_bad_ratio():
    with pytest.raises(ValueError, match=r"mask_ratio=1\.0"):
        BoundaryMask(0, 1.0)


# ---------------------------------------------------------------------------------------------
# MeanFill
# ---------------------------------------------------------------------------------------------

MF_H, MF_K, MF_T = 6, 3, 40


def _observe_constant(fill: MeanFill, per_dim: torch.Tensor, step: int) -> None:
    """Observe tokens whose dim j is exactly per_dim[j] through the kept coordinates of one draw."""
    idx = keep_indices(0, step, 0, MF_T, MF_H, MF_K, 0)
    h = per_dim.expand(2, MF_T, MF_H)
    fill.observe(compact(h, idx), idx, MF_H)


def test_mean_fill_exact_update_and_constant_within_step():
    j = torch.arange(MF_H, dtype=torch.float32)
    fill = MeanFill(momentum=0.25)
    _observe_constant(fill, j, step=0)
    assert fill.value(MF_H) is None  # nothing folded yet: zeros until the step ends
    fill.advance()
    assert torch.equal(fill.value(MF_H), j)

    _observe_constant(fill, 2 * j, step=1)
    assert torch.equal(fill.value(MF_H), j)  # unchanged within the step
    fill.advance()
    torch.testing.assert_close(fill.value(MF_H), j + 0.25 * (2 * j - j))


def test_mean_fill_keeps_unseen_dims():
    fill = MeanFill(momentum=0.5)
    idx = torch.tensor([[0, 1]]).expand(4, 2)
    fill.observe(torch.full((1, 4, 2), 3.0), idx, 5)
    fill.advance()
    assert fill.value(5).tolist() == [3.0, 3.0, 0.0, 0.0, 0.0]
    idx = torch.tensor([[1, 2]]).expand(4, 2)
    fill.observe(torch.full((1, 4, 2), 5.0), idx, 5)
    fill.advance()
    value = fill.value(5).tolist()
    assert value[:2] == [3.0, 4.0]  # dim 0 unseen this step: kept; dim 1: lerp(3, 5, 0.5)
    assert value[2] == 5.0  # first seen now: takes its batch mean rather than a pull from zero
    assert value[3:] == [0.0, 0.0]  # never seen


def test_mean_fill_converges_to_per_dim_means():
    hidden, batch, seq = 16, 4, 32
    target = torch.arange(hidden, dtype=torch.float32)
    fill = MeanFill(momentum=0.3)
    mask = BoundaryMask(0, mask_ratio=0.75, seed=1, fill=fill)
    gen = torch.Generator().manual_seed(0)
    start = torch.full((hidden,), -5.0)
    mask.apply(start + torch.randn(batch, seq, hidden, generator=gen), step=0, microbatch=0)
    fill.advance()
    assert (fill.value(hidden) - target).abs().min() > 4.0  # starts far away
    for step in range(1, 40):
        for mb in range(2):
            h = target + torch.randn(batch, seq, hidden, generator=gen)
            out, _ = mask.apply(h, step=step, microbatch=mb)
            dropped = (mask01(keep_indices(0, step, mb, seq, hidden, 4, 1), hidden) == 0).expand_as(out)
            # dropped dims carry the fill folded at the end of the previous step
            assert torch.equal(out[dropped], fill.value(hidden).expand_as(out)[dropped])
        fill.advance()
    assert (fill.value(hidden) - target).abs().max() < 0.15


def test_mean_fill_state_dict_round_trip():
    j = torch.arange(MF_H, dtype=torch.float32)
    a = MeanFill(momentum=0.5)
    _observe_constant(a, j, step=0)
    a.advance()
    _observe_constant(a, 3 * j, step=1)  # pending statistics of an unfinished step

    buffer = io.BytesIO()
    torch.save(a.state_dict(), buffer)
    buffer.seek(0)
    b = MeanFill(momentum=0.5)
    b.load_state_dict(torch.load(buffer))
    assert torch.equal(b.value(MF_H), a.value(MF_H))
    a.advance()
    b.advance()
    assert torch.equal(b.value(MF_H), a.value(MF_H))
    torch.testing.assert_close(b.value(MF_H), 2 * j)

    # a loaded fill owns its tensors: observing into one leaves the other alone
    _observe_constant(a, j, step=2)
    c = MeanFill(momentum=0.5)
    c.load_state_dict(a.state_dict())
    _observe_constant(a, 5 * j, step=3)
    a.advance()
    c.advance()
    torch.testing.assert_close(c.value(MF_H), 1.5 * j)

    empty = MeanFill()
    empty.load_state_dict(MeanFill().state_dict())
    assert empty.value(MF_H) is None


@pytest.mark.parametrize("momentum", [0.0, 1.5])
def test_mean_fill_rejects_bad_momentum(momentum):
    with pytest.raises(ValueError, match="mask_fill_momentum"):
        MeanFill(momentum)


def test_protected_dims_are_always_kept_and_the_rest_stays_uniform():
    hidden, keep, seq = 24, 6, 4000
    protected = torch.tensor([3, 17])
    idx = keep_indices(0, 1, 0, seq, hidden, keep, 0, protected)
    assert idx.shape == (seq, keep)
    assert bool((idx == 3).any(-1).all()) and bool((idx == 17).any(-1).all())
    counts = torch.bincount(idx.reshape(-1), minlength=hidden).float() / seq
    others = torch.ones(hidden, dtype=torch.bool)
    others[protected] = False
    expected = (keep - 2) / (hidden - 2)  # the other K - m dims: a uniform subset of the rest
    assert float((counts[others] - expected).abs().max()) < 0.03
    # the same draw as without protection for a row whose uniform top-K already held both dims; every
    # other row differs (it now holds a protected dim its uniform draw lacked)
    plain = keep_indices(0, 1, 0, seq, hidden, keep, 0)
    held_both = (plain == 3).any(-1) & (plain == 17).any(-1)
    assert 0 < int(held_both.sum()) < seq
    assert torch.equal(idx[held_both], plain[held_both])
    assert bool((idx[~held_both] != plain[~held_both]).any(-1).all())


def test_protected_dims_must_leave_room_for_random_ones():
    with pytest.raises(ValueError, match="mask_protect_dims=6 is invalid: it must be < K=6"):
        keep_indices(0, 0, 0, 4, 24, 6, 0, torch.arange(6))
