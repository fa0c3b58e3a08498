"""Receiver-side fills, above all the Gaussian conditional-mean fill, against float64 references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_meshtune import MeshTrainer, MeshTrainingArguments, attach_boundaries
from hf_meshtune.boundary.fills import FILLS, GaussianFill
from hf_meshtune.boundary.masking import BoundaryMask, expand, keep_indices
from tests.tiny import pattern_dataset, tiny_llama


def _fitted(hidden: int = 12, rank: int = 12, tokens: int = 400, seed: int = 0) -> tuple[GaussianFill, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    basis = torch.randn(hidden, rank, generator=gen, dtype=torch.float64)
    data = torch.randn(tokens, rank, generator=gen, dtype=torch.float64) @ basis.T + 3.0
    fill = GaussianFill()
    fill.observe_dense(data.view(4, -1, hidden))
    fill.advance()
    return fill, data


def test_rebuild_is_the_conditional_gaussian_mean_per_token():
    fill, data = _fitted()
    hidden, keep, seq = 12, 4, 5
    idx = keep_indices(0, 3, 0, seq, hidden, keep, seed=1)
    x = torch.randn(2, seq, hidden, dtype=torch.float64)
    kept = x.gather(-1, idx.expand(2, seq, keep))
    got = fill.rebuild(kept, idx, hidden)
    mu = data.mean(0).numpy()
    cov = np.cov(data.numpy().T)
    ridge = 1e-3 * np.trace(cov) / hidden
    for b in range(2):
        for t in range(seq):
            k = idx[t].numpy()
            s_kk = cov[np.ix_(k, k)] + ridge * np.eye(keep)
            expected = mu + cov[:, k] @ np.linalg.solve(s_kk, kept[b, t].numpy() - mu[k])
            expected[k] = kept[b, t].numpy()
            np.testing.assert_allclose(got[b, t].numpy(), expected, rtol=1e-9, atol=1e-9)


def test_data_of_rank_below_k_is_rebuilt_almost_exactly_where_zero_fill_is_not():
    hidden, keep = 16, 6
    fill, data = _fitted(hidden=hidden, rank=3, tokens=300)
    idx = keep_indices(0, 0, 0, 50, hidden, keep, seed=4)
    x = data[:50].unsqueeze(0)
    kept = x.gather(-1, idx.expand(1, 50, keep))
    err = (fill.rebuild(kept, idx, hidden) - x).norm() / x.norm()
    zero_err = (expand(kept, idx, hidden) - x).norm() / x.norm()
    assert err < 1e-2 < 0.5 < zero_err


def test_before_any_dense_observation_it_is_the_zero_fill():
    idx = keep_indices(0, 0, 0, 3, 8, 2, seed=0)
    kept = torch.randn(2, 3, 2)
    torch.testing.assert_close(GaussianFill().rebuild(kept, idx, 8), expand(kept, idx, 8), rtol=0, atol=0)


def test_backward_is_compact_and_equals_the_transposed_linear_map():
    fill, _ = _fitted()
    hidden, keep, seq = 12, 4, 3
    idx = keep_indices(1, 0, 0, seq, hidden, keep, seed=2)
    kept = torch.randn(1, seq, keep, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(1, seq, hidden, dtype=torch.float64)
    fill.rebuild(kept, idx, hidden).backward(upstream)
    cov, mu = fill.cov, fill.mean
    ridge = 1e-3 * cov.diagonal().mean()
    for t in range(seq):
        k = idx[t]
        a = cov[:, k] @ torch.linalg.inv(cov[k][:, k] + ridge * torch.eye(keep, dtype=torch.float64))  # [H, K]
        a[k] = torch.eye(keep, dtype=torch.float64)  # kept dims pass through as sent
        torch.testing.assert_close(kept.grad[0, t], a.T @ upstream[0, t], rtol=1e-9, atol=1e-9)
    assert mu is fill.mean  # rebuilding does not touch the statistics


def test_advance_blends_first_and_second_moments_by_momentum():
    a = torch.randn(50, 6, dtype=torch.float64)
    b = torch.randn(70, 6, dtype=torch.float64) * 2 + 1
    fill = GaussianFill(momentum=0.25)
    for data in (a, b):
        fill.observe_dense(data)
        fill.advance()
    ref_mean = 0.75 * a.mean(0) + 0.25 * b.mean(0)
    second = lambda d: torch.cov(d.T) + torch.outer(d.mean(0), d.mean(0))  # noqa: E731
    ref_cov = 0.75 * second(a) + 0.25 * second(b) - torch.outer(ref_mean, ref_mean)
    torch.testing.assert_close(fill.mean, ref_mean)
    torch.testing.assert_close(fill.cov, ref_cov)


def test_observations_wait_for_the_next_step_and_survive_a_state_dict_round_trip():
    fill, _ = _fitted()
    mean = fill.mean.clone()
    fill.observe_dense(torch.randn(10, 12, dtype=torch.float64))
    torch.testing.assert_close(fill.mean, mean)  # one step sees one fixed fill
    clone = GaussianFill()
    clone.load_state_dict(fill.state_dict())
    fill.advance(), clone.advance()
    torch.testing.assert_close(clone.mean, fill.mean)
    torch.testing.assert_close(clone.cov, fill.cov)


@pytest.mark.parametrize(
    "field,kwargs", [("mask_fill_momentum", dict(momentum=0.0)), ("mask_fill_ridge", dict(ridge=0.0))]
)
def test_bad_settings_name_the_field(field, kwargs):
    with pytest.raises(ValueError, match=field):
        GaussianFill(**kwargs)


def test_boundary_mask_uses_the_fill_to_rebuild():
    fill, _ = _fitted()
    mask = BoundaryMask(0, 0.75, seed=3, fill=fill)
    h = torch.randn(2, 4, 12, dtype=torch.float64)
    out, payload = mask.apply(h, step=1, microbatch=0)
    idx = keep_indices(0, 1, 0, 4, 12, 3, 3)
    torch.testing.assert_close(out, fill.rebuild(payload, idx, 12))


def test_dense_passes_feed_the_fill_and_masked_passes_do_not():
    model = tiny_llama()
    handle = attach_boundaries(model, num_stages=2, mask_ratio=0.75, fill="gaussian")
    batch = {"input_ids": torch.arange(3, 19).view(2, 8)}
    model(**batch)
    assert handle.masks[0].fill._pending == []
    with handle.disabled():
        model(**batch)
    assert len(handle.masks[0].fill._pending) == 1
    model.eval()
    with handle.disabled(), torch.no_grad():
        model(**batch)  # evaluation is not the anchor's training pass
    assert len(handle.masks[0].fill._pending) == 1


def test_mesh_trainer_calibrates_before_step_0_and_refreshes_at_anchor_rounds(tmp_path):
    assert "gaussian" in FILLS
    model = tiny_llama()
    args = MeshTrainingArguments(
        output_dir=str(tmp_path),
        max_steps=4,
        per_device_train_batch_size=4,
        learning_rate=1e-3,
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        preset="paper",  # the anchor refreshes the fill
        num_stages=2,
        mask_ratio=0.75,
        mask_fill="gaussian",
        anchor_every=2,
        anchor_delay=1,
        disable_tqdm=True,
    )
    trainer = MeshTrainer(model=model, args=args, train_dataset=pattern_dataset(32))
    fill = trainer.mesh_boundaries.masks[0].fill
    seen = []
    original = fill.rebuild

    def spy(kept, idx, hidden_size):
        seen.append(None if fill.mean is None else fill.cov.clone())
        return original(kept, idx, hidden_size)

    fill.rebuild = spy
    trainer.train()
    assert all(c is not None for c in seen)  # calibrated before the first masked forward
    # anchor rounds run after steps 0 and 2; what they observed is folded in at the next step
    assert not torch.equal(seen[0], seen[1]) and torch.equal(seen[1], seen[2]) and not torch.equal(seen[2], seen[3])
