"""``anchor_payload="factors"``: the anchor keeps M_anc and sends its top-r factors (U_r, s_r, V_r).

Against references: the anchor's M_anc and factors vs a float64 transcription; the fast optimizer fed full-rank
factors vs the same optimizer fed the gradient (bit for bit: the same M_anc and SVD, computed on the other
side of the link); on one process through ``MeshTrainer``, and on a 3x2 lockstep mesh, where the anchor's
bytes are also counted against the factor sizes.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
import torch

from hf_meshtune.optim.basis import factor_shapes
from hf_meshtune.optim.factors import AnchorMomentum
from hf_meshtune.optim.spectral import SpectralAdamW
from tests.distributed import mesh_launch
from tests.test_trainer import make_trainer, train_losses

REPO = Path(__file__).resolve().parents[1]
BETA = 0.9


def _grads(seed: int, shapes, count: int) -> list[list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(seed)
    return [[torch.randn(*shape, generator=gen) for shape in shapes] for _ in range(count)]


def test_factors_are_the_float64_anchor_momentum_at_full_rank():
    shapes = [(12, 7), (5, 9)]
    anchor = AnchorMomentum(BETA, rank=100)
    reference = [torch.zeros(shape, dtype=torch.float64) for shape in shapes]
    for grads in _grads(0, shapes, 3):
        factors = anchor.fold(grads)
        for i, grad in enumerate(grads):
            reference[i] = BETA * reference[i] + (1 - BETA) * grad.double()
            u, s, v = factors[i]
            assert [tuple(t.shape) for t in (u, s, v)] == factor_shapes(shapes[i], 100)
            torch.testing.assert_close((u.double() * s.double()) @ v.double().mT, reference[i], rtol=1e-5, atol=1e-6)
            eye = torch.eye(u.shape[1], dtype=torch.float64)
            torch.testing.assert_close(u.double().mT @ u.double(), eye, rtol=0, atol=1e-5)
    assert anchor.folds == 3


def test_rank_capped_factors_are_the_leading_singular_triplets():
    """A momentum with a clear gap after its 3rd singular value: the randomized rank-3 factors give its top-3
    singular values and subspaces (float64 SVD) to 1e-4."""
    gen = torch.Generator().manual_seed(1)
    q1 = torch.linalg.qr(torch.randn(40, 40, generator=gen, dtype=torch.float64)).Q
    q2 = torch.linalg.qr(torch.randn(30, 30, generator=gen, dtype=torch.float64)).Q
    spectrum = torch.tensor([9.0, 5.0, 3.0] + [0.01] * 27, dtype=torch.float64)
    grad = (q1[:, :30] * spectrum) @ q2.mT
    anchor = AnchorMomentum(beta=0.0, rank=3)  # β = 0: M_anc is this gradient
    ((u, s, v),) = anchor.fold([grad.float()])
    u_ref, s_ref, vh_ref = torch.linalg.svd(grad)
    torch.testing.assert_close(s.double(), s_ref[:3], rtol=1e-4, atol=1e-5)
    # the same subspaces: |U_rᵀ U_ref| and |V_rᵀ V_ref| are identities up to signs
    torch.testing.assert_close(
        (u.double().mT @ u_ref[:, :3]).abs(), torch.eye(3, dtype=torch.float64), atol=1e-4, rtol=0
    )
    torch.testing.assert_close(
        (v.double().mT @ vh_ref[:3].mT).abs(), torch.eye(3, dtype=torch.float64), atol=1e-4, rtol=0
    )


def _pair(shapes, seed=0):
    torch.manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(*shape)) for shape in shapes]
    twins = [torch.nn.Parameter(p.detach().clone()) for p in params]
    return params, twins


def test_full_rank_factors_step_the_fast_optimizer_as_the_gradient_does_bit_for_bit():
    shapes = [(12, 7), (5, 9)]
    params, twins = _pair(shapes)
    by_gradient = SpectralAdamW(params, lr=1e-2, alpha=0.3, tau=1e-2)
    by_factors = SpectralAdamW(twins, lr=1e-2, alpha=0.3, tau=1e-2)
    anchor = AnchorMomentum(BETA, rank=100)
    anchor_grads = _grads(7, shapes, 3)
    fast_grads = _grads(8, shapes, 6)
    for step in range(6):
        if step % 2 == 0:
            grads = anchor_grads[step // 2]
            assert by_gradient.update_anchor(dict(zip(params, grads)), staleness=0) == 2
            assert by_factors.update_anchor_factors(dict(zip(twins, anchor.fold(grads))), staleness=0) == 2
        for p, t, g in zip(params, twins, fast_grads[step]):
            p.grad, t.grad = g.clone(), g.clone()
        by_gradient.step()
        by_factors.step()
        for p, t in zip(params, twins):
            assert torch.equal(p, t), step
        # the diagnostics from the factors (the rank-r momentum is all of it here) agree with the dense ones
        for key, value in by_gradient.last_diagnostics.items():
            assert by_factors.last_diagnostics[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key
    assert all("anchor_momentum" not in by_factors.state[t] for t in twins)  # no [m, n] momentum on the fast side


def test_a_non_finite_anchor_gradient_is_refused_at_the_anchor_and_rejected_on_the_fast_side():
    shapes = [(6, 4)]
    params, _ = _pair(shapes)
    opt = SpectralAdamW(params, lr=1e-2)
    anchor = AnchorMomentum(BETA, rank=2)
    good = _grads(0, shapes, 1)[0]
    opt.update_anchor_factors(dict(zip(params, anchor.fold(good))))
    momentum, basis = anchor.momenta[0].clone(), opt.state[params[0]]["anchor_U"].clone()
    bad = [good[0].clone()]
    bad[0][1, 2] = float("inf")
    assert opt.update_anchor_factors(dict(zip(params, anchor.fold(bad)))) == 0
    assert torch.equal(anchor.momenta[0], momentum) and anchor.refused == 1 and anchor.folds == 1
    assert torch.equal(opt.state[params[0]]["anchor_U"], basis)
    assert opt.guard_counts["anchor/rejected_non_finite"] == 1


def test_meshtrainer_with_full_rank_factors_repeats_the_gradient_payload_and_resumes_exactly(tmp_path):
    """One process, paper preset (masks + anchor every 2, Δ = 3): the factors payload at a rank above every
    matrix's size trains bit for bit as the gradient payload with the full SVD; a run resumed from step 4
    (one delivery in flight, the anchor's M_anc in the checkpoint) repeats its losses exactly."""
    knobs = dict(max_steps=8, anchor_every=2, anchor_delay=3, save_strategy="steps", save_steps=4)
    gradient = make_trainer(tmp_path / "gradient", **knobs)
    gradient.train()
    factors = make_trainer(tmp_path / "factors", anchor_payload="factors", spectral_rank=10_000, **knobs)
    factors.train()
    assert train_losses(factors) == train_losses(gradient)
    for (name, a), b in zip(gradient.model.named_parameters(), factors.model.parameters()):
        assert torch.equal(a, b), name
    state = torch.load(tmp_path / "factors" / "out" / "checkpoint-4" / "mesh_state.pt", weights_only=True)
    assert state["anchor"]["factors"]["folds"] == 2  # the rounds before step 4: at steps 0 and 2
    resumed = make_trainer(tmp_path / "resumed", anchor_payload="factors", spectral_rank=10_000, **knobs)
    resumed.train(resume_from_checkpoint=str(tmp_path / "factors" / "out" / "checkpoint-4"))
    assert [h["loss"] for h in resumed.state.log_history if "loss" in h and h["step"] > 4] == train_losses(factors)[4:]


def test_meshtrainer_rank_capped_factors_train_and_log_the_filter(tmp_path):
    trainer = make_trainer(
        tmp_path, max_steps=6, anchor_every=2, anchor_delay=1, anchor_payload="factors", spectral_rank=2
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "spectral/filter_mean_d" in h]
    assert logged and all(0 < h["spectral/filter_mean_d"] < 1 for h in logged)
    bases = [s["anchor_U"] for s in trainer.optimizer.state.values() if "anchor_U" in s]
    assert bases and all(u.shape[1] == 2 for u in bases)


# --- the distributed mesh ------------------------------------------------------------------------------
STEPS = 8
LOCKSTEP = {"anchor": True, "anchor_every": 2, "anchor_delay": 0, "anchor_lockstep": True, "spectral_tau": 1e-3}


def _mesh(out, config: dict) -> list:
    command = [*mesh_launch("3x2"), "tests/scripts/mesh_run.py", str(out), str(STEPS), json.dumps(config)]
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(command, cwd=REPO, text=True, capture_output=True, timeout=300, env=env)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    return [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(6)]


@pytest.mark.slow
def test_mesh_factors_at_full_rank_repeat_the_gradient_run_and_rank_capped_ones_send_their_size(tmp_path):
    """3x2 lockstep mesh (anchor every 2 steps, applied at once): with factors at a rank above every matrix's
    size the fast replicas train bit for bit as with the gradient payload (the SVD moved to the anchor).
    At rank 2 each anchor stage sends, per round and fast replica, 4·Σ 2·(m+n+1) payload bytes instead of
    4·Σ m·n (the Wire's measured sends; the headers are the same in both runs), and the fast replicas hold
    rank-2 bases and train."""
    gradient = _mesh(tmp_path / "gradient", LOCKSTEP)
    full = _mesh(tmp_path / "full", {**LOCKSTEP, "anchor_payload": "factors", "spectral_rank": 10_000})
    capped = _mesh(tmp_path / "capped", {**LOCKSTEP, "anchor_payload": "factors", "spectral_rank": 2})
    for g, f in zip(gradient, full):
        if g.role == "anchor":
            continue
        assert f.arrivals == g.arrivals == [(s, s) for s in range(0, STEPS, 2)] + [(STEPS, STEPS)]
        assert f.losses == g.losses
        assert all(torch.equal(g.params[n], f.params[n]) for n in g.params)
    for g, c in zip(gradient, capped):
        if g.role != "anchor":
            assert c.arrivals == g.arrivals and all(torch.isfinite(torch.tensor(c.losses)))
            continue
        fast = next(r for r in gradient if r.role == "fast" and r.stage == g.stage)
        shapes = [tuple(p.shape) for p in fast.params.values() if p.ndim == 2]
        rounds = len(g.anchor_rounds)
        assert c.anchor_rounds == g.anchor_rounds == list(range(0, STEPS + 1, 2))
        saved = 4 * sum(m * n - 2 * (m + n + 1) for m, n in shapes)
        assert g.wire["sent"]["anchor"] - c.wire["sent"]["anchor"] == rounds * 2 * saved  # 2 fast replicas


def test_anchor_momentum_refuses_a_bad_rank_and_a_delivery_of_another_size():
    with pytest.raises(ValueError, match="spectral_rank=0 is invalid: it must be an int >= 1 with anchor_payload"):
        AnchorMomentum(BETA, rank=0)
    anchor = AnchorMomentum(BETA, rank=2)
    anchor.fold(_grads(0, [(4, 3), (3, 3)], 1)[0])
    with pytest.raises(ValueError, match="anchor gradients=1 is invalid: it must number 2 matrices"):
        anchor.fold(_grads(1, [(4, 3)], 1)[0])


def test_an_anchor_state_of_the_other_payload_is_refused(tmp_path):
    knobs = dict(max_steps=2, anchor_every=2, anchor_delay=3)
    gradient = make_trainer(tmp_path / "g", **knobs)
    gradient.train()
    factors = make_trainer(tmp_path / "f", anchor_payload="factors", spectral_rank=4, **knobs)
    factors.train()
    with pytest.raises(ValueError, match="anchor state factors='absent' is invalid: it must match this run's"):
        factors.mesh_anchor.load_state_dict(gradient.mesh_anchor.state_dict())
