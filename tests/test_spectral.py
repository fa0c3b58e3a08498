"""Tests for ``SpectralAdamW``: a float64 NumPy transcription of the paper's formulas, equivalence
with ``torch.optim.AdamW`` at α = 1, the filter's algebra, the rank cap, state-dict round trips,
validation and diagnostics."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hf_meshtune.optim import SpectralAdamW
from hf_meshtune.optim.basis import _filter_gradient

SHAPES = [(6, 4), (3, 5), (5,)]  # two matrices of different aspect, one bias


# ---------------------------------------------------------------------------------------------
# Reference: the formulas of docs/design.md ("The four mechanisms") written out plainly in float64 NumPy.
# ---------------------------------------------------------------------------------------------
class NumpyReference:
    def __init__(self, params, lr, betas, eps, wd, alpha, tau, anchor_beta, relative_tau):
        self.params = [p.copy() for p in params]
        self.lr, self.beta1, self.beta2, self.eps, self.wd = lr, betas[0], betas[1], eps, wd
        self.alpha, self.tau, self.anchor_beta, self.relative_tau = alpha, tau, anchor_beta, relative_tau
        self.m = [np.zeros_like(p) for p in params]
        self.v = [np.zeros_like(p) for p in params]
        self.anchor = [np.zeros_like(p) for p in params]
        self.basis = [None for _ in params]
        self.t = 0

    def update_anchor(self, grads):
        for i, g in enumerate(grads):
            if g.ndim != 2:
                continue
            self.anchor[i] = self.anchor_beta * self.anchor[i] + (1 - self.anchor_beta) * g
            u, s, vt = np.linalg.svd(self.anchor[i], full_matrices=False)
            tau = self.tau * s.max() if self.relative_tau else self.tau
            self.basis[i] = (u, s / (s + tau), vt.T)

    def step(self, grads):
        self.t += 1
        for i, g in enumerate(grads):
            if self.basis[i] is not None:
                u, d, v = self.basis[i]
                x = u.T @ g @ v
                x_f = np.diag(d) @ x @ np.diag(d)
                g_filt = u @ x_f @ v.T
                g = self.alpha * g + (1 - self.alpha) * g_filt
            p = self.params[i]
            p *= 1 - self.lr * self.wd
            self.m[i] = self.beta1 * self.m[i] + (1 - self.beta1) * g
            self.v[i] = self.beta2 * self.v[i] + (1 - self.beta2) * g * g
            m_hat = self.m[i] / (1 - self.beta1**self.t)
            v_hat = self.v[i] / (1 - self.beta2**self.t)
            p -= self.lr * m_hat / (np.sqrt(v_hat) + self.eps)


def _make_params(dtype: torch.dtype, seed: int = 0) -> list[torch.nn.Parameter]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=gen, dtype=torch.float64).to(dtype)) for s in SHAPES]


def _grads(gen: torch.Generator, dtype: torch.dtype = torch.float64) -> list[torch.Tensor]:
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype) for s in SHAPES]


@pytest.mark.parametrize("relative_tau, tau", [(False, 0.5), (True, 0.3)])
def test_matches_float64_numpy_reference(relative_tau: bool, tau: float) -> None:
    hyper = dict(lr=1e-2, betas=(0.9, 0.99), eps=1e-8, alpha=0.3, tau=tau, anchor_beta=0.8)
    params = _make_params(torch.float64)
    opt = SpectralAdamW(params, weight_decay=0.1, relative_tau=relative_tau, **hyper)
    ref = NumpyReference([p.detach().numpy() for p in params], wd=0.1, relative_tau=relative_tau, **hyper)
    gen = torch.Generator().manual_seed(1)
    saw_mid_filter = False
    for step in range(6):
        if step in (0, 3):
            dense = _grads(gen)
            assert opt.update_anchor(dict(zip(params, dense))) == 2
            ref.update_anchor([g.numpy() for g in dense])
            d = opt.state[params[0]]["anchor_d"]
            saw_mid_filter |= bool(((d > 0.05) & (d < 0.95)).any())
        masked = _grads(gen)
        for p, g in zip(params, masked):
            p.grad = g
        opt.step()
        ref.step([g.numpy() for g in masked])
        for p, expected in zip(params, ref.params):
            np.testing.assert_allclose(p.detach().numpy(), expected, rtol=0, atol=1e-10)
    assert saw_mid_filter, "τ should put some d_i strictly inside (0, 1), or the test checks nothing"


def test_alpha_one_equals_torch_adamw_bitwise() -> None:
    params = _make_params(torch.float32)
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    opt = SpectralAdamW(params, lr=1e-2, weight_decay=0.1, alpha=1.0, tau=1e-3)
    reference = torch.optim.AdamW(twins, lr=1e-2, weight_decay=0.1, foreach=False)
    gen = torch.Generator().manual_seed(2)
    for step in range(5):
        if step in (0, 2):
            opt.update_anchor(dict(zip(params, _grads(gen, torch.float32))))
        for p, q, g in zip(params, twins, _grads(gen, torch.float32)):
            p.grad, q.grad = g.clone(), g.clone()
        opt.step()
        reference.step()
        for p, q in zip(params, twins):
            assert torch.equal(p, q)
    assert opt.last_diagnostics["spectral/matrices_filtered"] == 2.0


def test_full_basis_with_unit_filter_is_identity() -> None:
    gen = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.zeros(6, 6, dtype=torch.float64))
    opt = SpectralAdamW([w], alpha=0.0, tau=1e-12, anchor_beta=0.0)
    opt.update_anchor({w: torch.randn(6, 6, generator=gen, dtype=torch.float64)})
    state = opt.state[w]
    assert state["anchor_d"].min() > 1 - 1e-9
    g = torch.randn(6, 6, generator=gen, dtype=torch.float64)
    out = _filter_gradient(g, state["anchor_U"], state["anchor_d"], state["anchor_V"], alpha=0.0)
    torch.testing.assert_close(out, g, rtol=0, atol=1e-10)


@pytest.mark.parametrize("rank", [None, 2])
def test_filter_never_amplifies(rank: int | None) -> None:
    gen = torch.Generator().manual_seed(4)
    for trial in range(20):
        m, n = 3 + trial % 5, 2 + trial % 7
        w = torch.nn.Parameter(torch.zeros(m, n, dtype=torch.float64))
        tau = 10.0 ** (trial % 6 - 4)
        opt = SpectralAdamW([w], alpha=0.0, tau=tau, anchor_beta=0.0, rank=rank)
        opt.update_anchor({w: torch.randn(m, n, generator=gen, dtype=torch.float64) * 3})
        s = opt.state[w]
        g = torch.randn(m, n, generator=gen, dtype=torch.float64)
        g_filt = _filter_gradient(g, s["anchor_U"], s["anchor_d"], s["anchor_V"], alpha=0.0)
        assert torch.linalg.norm(g_filt) <= torch.linalg.norm(g) * (1 + 1e-12)
        assert s["anchor_d"].max() < 1


def _rank3_momentum() -> torch.Tensor:
    gen = torch.Generator().manual_seed(5)
    left = torch.linalg.qr(torch.randn(40, 3, generator=gen)).Q
    right = torch.linalg.qr(torch.randn(30, 3, generator=gen)).Q
    core = left @ torch.diag(torch.tensor([10.0, 5.0, 2.0])) @ right.T
    return core + 1e-6 * torch.randn(40, 30, generator=gen)


def _anchored_optimizer(momentum: torch.Tensor, **kwargs: object) -> tuple[SpectralAdamW, torch.Tensor]:
    w = torch.nn.Parameter(torch.zeros_like(momentum))
    opt = SpectralAdamW([w], anchor_beta=0.0, tau=0.5, **kwargs)
    opt.update_anchor({w: momentum})
    return opt, w


def test_rank_cap_matches_truncated_svd_deterministically_without_global_rng() -> None:
    momentum = _rank3_momentum()
    rng_before = torch.get_rng_state()
    opt, w = _anchored_optimizer(momentum, rank=3, seed=7)
    assert torch.equal(torch.get_rng_state(), rng_before)
    s = opt.state[w]
    assert s["anchor_U"].shape == (40, 3) and s["anchor_V"].shape == (30, 3) and s["anchor_d"].shape == (3,)
    u, sv, vh = torch.linalg.svd(momentum, full_matrices=False)
    u3, v3 = u[:, :3], vh[:3].T
    torch.testing.assert_close(s["anchor_U"] @ s["anchor_U"].T, u3 @ u3.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(s["anchor_V"] @ s["anchor_V"].T, v3 @ v3.T, rtol=0, atol=1e-5)
    torch.testing.assert_close(s["anchor_d"], sv[:3] / (sv[:3] + 0.5), rtol=1e-5, atol=0)
    twin, w2 = _anchored_optimizer(momentum, rank=3, seed=7)
    for key in ("anchor_U", "anchor_d", "anchor_V"):
        assert torch.equal(s[key], twin.state[w2][key])


def _run(opt: SpectralAdamW, params: list[torch.nn.Parameter], gen: torch.Generator, steps: int) -> None:
    for step in range(steps):
        if step == 1:
            opt.update_anchor({p: g.to(p.dtype) for p, g in zip(params, _grads(gen))})
        for p, g in zip(params, _grads(gen)):
            p.grad = g.to(p.dtype)
        opt.step()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_state_dict_round_trip_continues_bit_identically(dtype: torch.dtype) -> None:
    params = _make_params(dtype)
    kwargs = dict(lr=1e-2, weight_decay=0.1, alpha=0.3, tau=0.5, rank=2, svd_niter=1)
    opt = SpectralAdamW(params, **kwargs)
    _run(opt, params, torch.Generator().manual_seed(6), steps=3)
    clones = [torch.nn.Parameter(p.detach().clone()) for p in params]
    fresh = SpectralAdamW(clones, **kwargs)
    fresh.load_state_dict(opt.state_dict())
    for key in ("anchor_momentum", "anchor_U", "anchor_d", "anchor_V"):
        assert fresh.state[clones[0]][key].dtype == torch.float32
        assert torch.equal(fresh.state[clones[0]][key], opt.state[params[0]][key])
    assert fresh.state[clones[0]]["anchor_updates"] == 1
    # Identical generators on both sides; the run includes another anchor update (seeded by count).
    _run(opt, params, torch.Generator().manual_seed(7), steps=3)
    _run(fresh, clones, torch.Generator().manual_seed(7), steps=3)
    for p, q in zip(params, clones):
        assert torch.equal(p, q)
    assert opt.state[params[0]]["anchor_updates"] == fresh.state[clones[0]]["anchor_updates"] == 2


def test_update_anchor_rejects_unknown_tensor_and_wrong_shape() -> None:
    params = _make_params(torch.float32)
    opt = SpectralAdamW(params)
    with pytest.raises(ValueError, match=r"grads key of shape=\(7, 2\) is invalid: it must be a parameter"):
        opt.update_anchor({torch.zeros(7, 2): torch.zeros(7, 2)})
    with pytest.raises(ValueError, match=r"grads value shape=\(4, 6\) is invalid: .*shape \(6, 4\)"):
        opt.update_anchor({params[0]: torch.zeros(4, 6)})
    assert "anchor_momentum" not in opt.state[params[0]]


def test_update_anchor_skips_vectors_and_opted_out_groups() -> None:
    w, b = torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(4))
    frozen = torch.nn.Parameter(torch.zeros(3, 3))
    opt = SpectralAdamW([{"params": [w, b]}, {"params": [frozen], "spectral": False}])
    assert opt.update_anchor({w: torch.ones(4, 3), b: torch.ones(4), frozen: torch.ones(3, 3)}) == 1
    assert "anchor_U" in opt.state[w]
    assert "anchor_U" not in opt.state[b] and "anchor_U" not in opt.state[frozen]


@pytest.mark.parametrize(
    "kwargs, text",
    [
        (dict(lr=-1), "lr=-1"),
        (dict(alpha=1.5), "alpha=1.5"),
        (dict(alpha=-0.1), "alpha=-0.1"),
        (dict(tau=0), "tau=0"),
        (dict(tau=-1), "tau=-1"),
        (dict(anchor_beta=1.1), "anchor_beta=1.1"),
        (dict(rank=0), "rank=0"),
        (dict(betas=(1.0, 0.9)), "betas=(1.0, 0.9)"),
    ],
)
def test_constructor_rejects_bad_values(kwargs: dict[str, object], text: str) -> None:
    with pytest.raises(ValueError) as err:
        SpectralAdamW(_make_params(torch.float32), **kwargs)
    assert f"{text} is invalid: it must" in str(err.value)


def test_param_group_dict_is_validated() -> None:
    w = torch.nn.Parameter(torch.zeros(2, 2))
    with pytest.raises(ValueError, match=r"alpha=2 is invalid"):
        SpectralAdamW([{"params": [w], "alpha": 2}])


def test_diagnostics_empty_before_anchor_and_cosine_one_when_aligned() -> None:
    params = _make_params(torch.float64)
    opt = SpectralAdamW(params, anchor_beta=0.0, tau=1e-9)
    gen = torch.Generator().manual_seed(8)
    for p, g in zip(params, _grads(gen)):
        p.grad = g
    opt.step()
    assert opt.last_diagnostics == {}
    dense = _grads(gen)
    opt.update_anchor(dict(zip(params, dense)))
    for p, g in zip(params, dense):
        p.grad = 2.0 * g
    opt.step()
    diag = opt.last_diagnostics
    assert diag["spectral/matrices_filtered"] == 2.0
    assert diag["spectral/cos_masked_vs_anchor"] == pytest.approx(1.0, abs=1e-9)
    assert diag["spectral/cos_filtered_vs_anchor"] == pytest.approx(1.0, abs=1e-6)
    assert diag["spectral/filter_mean_d"] == pytest.approx(1.0, abs=1e-6)
    # The opposite direction must read -1: guards against a cosine that is constant or unsigned.
    for p, g in zip(params, dense):
        p.grad = -g
    opt.step()
    assert opt.last_diagnostics["spectral/cos_masked_vs_anchor"] == pytest.approx(-1.0, abs=1e-9)


# --- guards: rejected deliveries, failed SVDs, stale bases ----------------------------------------


def _guarded(max_staleness=None, alpha=0.3):
    gen = torch.Generator().manual_seed(7)
    w = torch.nn.Parameter(torch.randn(6, 4, generator=gen, dtype=torch.float64))
    return w, SpectralAdamW([w], lr=1e-2, alpha=alpha, tau=1e-3, max_staleness=max_staleness), gen


def test_a_non_finite_anchor_delivery_is_rejected_whole_and_logged(caplog):
    w, opt, gen = _guarded()
    opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)})
    before = {k: v.clone() for k, v in opt.state[w].items() if torch.is_tensor(v)}
    bad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    bad[2, 1] = float("nan")
    with caplog.at_level("WARNING", logger="hf_meshtune.optim.spectral"):
        assert opt.update_anchor({w: bad}) == 0
    assert "non-finite" in caplog.text
    for key, value in before.items():
        assert torch.equal(opt.state[w][key], value), key  # M_anc, U, d, V untouched
    w.grad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    opt.step()
    assert opt.last_diagnostics["anchor/rejected_non_finite"] == 1 and torch.isfinite(w).all()


def test_a_delivery_older_than_max_staleness_is_rejected(caplog):
    w, opt, gen = _guarded(max_staleness=3)
    with caplog.at_level("WARNING", logger="hf_meshtune.optim.spectral"):
        assert opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)}, staleness=4) == 0
    assert "staleness 4 steps > max_staleness 3" in caplog.text and "anchor_momentum" not in opt.state[w]
    assert opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)}, staleness=3) == 1
    assert opt.guard_counts["anchor/rejected_stale"] == 1


@pytest.mark.parametrize("failure", ["raises", "nan"])
def test_a_failed_svd_leaves_that_matrix_unfiltered_and_is_counted(failure, monkeypatch, caplog):
    w, opt, gen = _guarded()
    twin = torch.nn.Parameter(w.detach().clone())
    reference = torch.optim.AdamW([twin], lr=1e-2, weight_decay=0.01, foreach=False)

    def broken_svd(matrix, full_matrices=True):
        if failure == "raises":
            raise torch.linalg.LinAlgError("linalg.svd: The algorithm failed to converge")
        n = min(matrix.shape)
        nan = torch.full((), float("nan"), dtype=matrix.dtype)
        return nan.expand(matrix.shape[0], n).clone(), nan.expand(n).clone(), nan.expand(n, matrix.shape[1]).clone()

    monkeypatch.setattr(torch.linalg, "svd", broken_svd)
    with caplog.at_level("WARNING", logger="hf_meshtune.optim.spectral"):
        opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)})
    assert "SVD of the anchor momentum (6, 4) failed" in caplog.text and "anchor_U" not in opt.state[w]
    grad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    w.grad, twin.grad = grad.clone(), grad.clone()
    opt.step()
    reference.step()
    assert torch.equal(w, twin)  # the unfiltered gradient: exactly AdamW
    assert opt.last_diagnostics["spectral/svd_fallbacks"] == 1
    monkeypatch.undo()  # the next good delivery brings the filter back
    opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)})
    assert "anchor_U" in opt.state[w]


def test_a_basis_past_max_staleness_fades_linearly_to_plain_adamw(monkeypatch, caplog):
    from hf_meshtune.optim import spectral

    w, opt, gen = _guarded(max_staleness=2, alpha=0.3)
    alphas = []
    real_filter = spectral._filter_gradient
    monkeypatch.setattr(
        spectral, "_filter_gradient", lambda g, u, d, v, a, **kw: alphas.append(a) or real_filter(g, u, d, v, a, **kw)
    )
    opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)})
    with caplog.at_level("WARNING", logger="hf_meshtune.optim.spectral"):
        for _ in range(6):  # ages 0..5 at the six steps
            w.grad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
            opt.step()
    # ages 0, 1, 2 trust the basis; age 3 is half-way ((3-2)/2); ages 4 and 5 are plain AdamW (no filter call)
    assert alphas == pytest.approx([0.3, 0.3, 0.3, 0.3 + 0.7 * 0.5])
    assert opt.last_diagnostics["spectral/stale_matrices"] == 1 and caplog.text.count("fading its filter out") == 1
    opt.update_anchor({w: torch.randn(6, 4, generator=gen, dtype=torch.float64)}, staleness=1)  # the anchor is back
    w.grad = torch.randn(6, 4, generator=gen, dtype=torch.float64)
    opt.step()
    assert alphas[-1] == 0.3 and "spectral/stale_matrices" not in opt.last_diagnostics


def test_max_staleness_is_validated():
    with pytest.raises(ValueError, match="max_staleness=0 is invalid: it must be None or an int >= 1"):
        SpectralAdamW([torch.nn.Parameter(torch.zeros(2, 2))], max_staleness=0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reusing_grads_as_scratch_and_skipping_diagnostics_change_no_bit(dtype: torch.dtype) -> None:
    """The fast path (G_proj written into .grad, AdamW's denominator in its storage, no cosines) against the
    plain one (.grad kept, every temporary its own, diagnostics on): the same parameters and moments, bit for
    bit, over steps with and without a basis; only the plain one leaves .grad intact and logs cosines."""
    gen = torch.Generator().manual_seed(3)
    shapes = [(24, 10), (7, 13), (10,)]
    params = [torch.nn.Parameter(torch.randn(*s, generator=gen).to(dtype)) for s in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    hyper = dict(lr=1e-2, weight_decay=0.1, alpha=0.3, tau=1e-2, rank=4)
    fast = SpectralAdamW(params, diagnostics=False, overwrite_grads=True, **hyper)
    plain = SpectralAdamW(twins, diagnostics=True, overwrite_grads=False, **hyper)
    for step in range(5):
        if step in (1, 3):
            anchor = [torch.randn(*s, generator=gen) for s in shapes[:2]]
            fast.update_anchor(dict(zip(params, anchor)))
            plain.update_anchor(dict(zip(twins, anchor)))
        grads = [torch.randn(*s, generator=gen).to(dtype) for s in shapes]
        for p, t, g in zip(params, twins, grads):
            p.grad, t.grad = g.clone(), g.clone()
        fast.step()
        plain.step()
        for p, t, g in zip(params, twins, grads):
            assert torch.equal(p, t), (step, p.shape)
            assert torch.equal(fast.state[p]["exp_avg_sq"], plain.state[t]["exp_avg_sq"])
            assert torch.equal(t.grad, g)  # overwrite_grads=False: .grad is still the gradient
        assert "spectral/cos_filtered_vs_anchor" not in fast.last_diagnostics
        assert ("spectral/cos_filtered_vs_anchor" in plain.last_diagnostics) == (step >= 1)
    # float32: the fast path used .grad as scratch; bf16 filters in float32, so the scratch is its own copy
    assert torch.equal(params[0].grad, grads[0]) == (dtype == torch.bfloat16)


def test_the_optimizer_flags_are_checked() -> None:
    with pytest.raises(ValueError, match="diagnostics=1 is invalid"):
        SpectralAdamW([torch.nn.Parameter(torch.zeros(2, 2))], diagnostics=1)
    with pytest.raises(ValueError, match="overwrite_grads='yes' is invalid"):
        SpectralAdamW([torch.nn.Parameter(torch.zeros(2, 2))], overwrite_grads="yes")
