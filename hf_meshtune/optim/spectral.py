"""Spectral correction optimizer ("spectral AdamW"; docs/design.md, "The four mechanisms").

The fast circuit trains on a *masked* gradient G whose direction can be far from the dense one.
Every so often the anchor delivers a dense gradient G_anc; its momentum M_anc = U S Vᵀ tells which
singular directions the dense objective cares about. Before AdamW sees G, each 2-D weight's gradient
is passed through a Tikhonov soft filter d_i = s_i / (s_i + τ_p) applied on both sides,

    G_filt = U diag(d) Uᵀ G V diag(d) Vᵀ,      G_proj = α·G + (1-α)·G_filt,

so directions the anchor's momentum supports pass, the rest are damped, and nothing is amplified
(0 <= d_i < 1). The SVD is recomputed only when M_anc changes and cached as (U, d, V) (``optim.basis``).

With ``anchor_payload="factors"`` the anchor keeps M_anc itself (``AnchorMomentum``, ``optim.factors``)
and sends only its top-r factors (U_r, s_r, V_r), r·(m+n+1) numbers per matrix instead of m·n; the fast
optimizer takes them in ``SpectralAdamW.update_anchor_factors`` and holds no [m, n] momentum.
"""

from __future__ import annotations

import copy
import logging
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import Tensor

from .._validation import require
from .adamw import _adamw_update
from .basis import (
    _anchor_dtype,
    _basis_seed,
    _factor_shapes_ok,
    _filter_gradient,
    _soft_filter,
    anchor_basis,
    subspace_drift,
)
from .diagnostics import _Diagnostics

__all__ = ["SpectralAdamW", "spectral_options"]

logger = logging.getLogger(__name__)

_ANCHOR_TENSORS = ("anchor_momentum", "anchor_U", "anchor_d", "anchor_V", "anchor_s")


def _validate_group(group: Mapping[str, Any]) -> None:
    """Reject a bad hyper-parameter in the constructor's defaults or in a dict param group."""
    betas = group["betas"]
    require(group["lr"] >= 0, "lr", group["lr"], "be >= 0")
    require(len(betas) == 2 and all(0 <= b < 1 for b in betas), "betas", betas, "be two values in [0, 1)")
    require(group["eps"] >= 0, "eps", group["eps"], "be >= 0")
    require(group["weight_decay"] >= 0, "weight_decay", group["weight_decay"], "be >= 0")
    require(0 <= group["alpha"] <= 1, "alpha", group["alpha"], "lie in [0, 1]")
    require(group["tau"] > 0, "tau", group["tau"], "be > 0")
    require(0 <= group["anchor_beta"] <= 1, "anchor_beta", group["anchor_beta"], "lie in [0, 1]")
    rank = group["rank"]
    ok_rank = rank is None or (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 1)
    require(ok_rank, "rank", rank, "be None or an int >= 1")
    require(isinstance(group["relative_tau"], bool), "relative_tau", group["relative_tau"], "be a bool")
    require(isinstance(group["spectral"], bool), "spectral", group["spectral"], "be a bool")


class SpectralAdamW(torch.optim.Optimizer):
    """AdamW on a gradient filtered through the anchor momentum's spectrum ("spectral correction").

    From "Communication-Efficient LLM Adaptation over Decentralized GPU Meshes" (arXiv 2609.14339),
    spectral correction. Paper symbols beside the code names:

    * ``update_anchor(grads)`` receives the dense anchor gradient G_anc and updates the anchor
      momentum M_anc ← β_anc·M_anc + (1-β_anc)·G_anc (no bias correction), then caches its SVD
      M_anc = U S Vᵀ as (U, d, V) with d_i = s_i / (s_i + τ_p).
    * ``step()`` maps each matrix gradient G to G_proj = α·G + (1-α)·U diag(d) Uᵀ G V diag(d) Vᵀ
      and takes a plain AdamW step on G_proj.
    * ``alpha`` (α), ``tau`` (τ_p), ``anchor_beta`` (β_anc); ``rank`` caps the basis with a
      randomized SVD (``svd_niter`` power iterations, ``svd_oversample`` extra columns, test matrix
      seeded by ``seed``); ``relative_tau`` uses τ_p·s_max instead of an absolute τ_p.

    Per-group options: lr, betas, eps, weight_decay, alpha, tau, anchor_beta, rank, relative_tau and
    ``spectral`` (False opts a group out). A parameter is filtered iff its group is spectral and it is
    2-D; others (norms, biases) and matrices without anchor momentum yet get the plain gradient.
    After each step ``last_diagnostics`` holds the cosines of G and G_proj with M_anc, which tell
    how much of the dense direction the filtered masked gradient carries; they cost five reductions over
    every matrix, so ``diagnostics`` (an attribute, also a constructor argument) can be switched off for
    steps that are not logged (``MeshTrainer`` and the mesh's workers do). ``overwrite_grads=True``:
    ``step()`` uses each ``.grad`` as scratch (G_proj, then AdamW's denominator), which saves up to three
    [m, n] allocations per matrix and leaves ``.grad`` holding no gradient after the step; for loops that
    zero the gradients right after ``step()`` (``MeshTrainer`` and the mesh's workers turn it on). Off by
    default, as torch's optimizers leave ``.grad`` alone. Either way the parameters are the same bit for bit.

    Guards (nothing bad is ever applied, and each case is counted in ``last_diagnostics`` and logged):

    * an anchor delivery with a non-finite value, or (``max_staleness`` set) one older than
      ``max_staleness`` fast steps, is rejected whole (``anchor/rejected_non_finite``,
      ``anchor/rejected_stale``); M_anc and the bases stay as they were;
    * an SVD that fails to converge or returns non-finite factors drops that matrix's basis, so
      its gradient passes unfiltered until the next good delivery (``spectral/svd_fallbacks``);
    * ``max_staleness`` (``anchor_max_staleness``): a basis that no delivery has refreshed for more
      than that many steps fades out: the filtered share (1-α) falls linearly to 0 over the next
      ``max_staleness`` steps, so a dead anchor leaves plain AdamW on the masked gradient
      (``spectral/stale_matrices`` counts the matrices fading). None = bases never expire (the paper).

    Example:
        >>> w = torch.nn.Parameter(torch.randn(8, 4))
        >>> opt = SpectralAdamW([w], lr=1e-2, alpha=0.3, tau=1e-3)
        >>> opt.update_anchor({w: torch.randn(8, 4)})  # dense G_anc from the anchor
        1
        >>> w.grad = torch.randn(8, 4)  # masked gradient from the fast circuit
        >>> opt.step()
        >>> sorted(opt.last_diagnostics)[0]
        'spectral/cos_filtered_vs_anchor'
    """

    def __init__(
        self,
        params: Iterable[Tensor] | Iterable[dict[str, Any]],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.01,
        alpha: float = 0.3,
        tau: float = 1e-3,
        anchor_beta: float = 0.9,
        rank: int | None = None,
        relative_tau: bool = False,
        svd_niter: int = 2,
        svd_oversample: int = 8,
        seed: int = 0,
        max_staleness: int | None = None,
        diagnostics: bool = True,
        overwrite_grads: bool = False,
    ) -> None:
        defaults: dict[str, Any] = dict(
            lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay, alpha=alpha, tau=tau,
            anchor_beta=anchor_beta, rank=rank, relative_tau=relative_tau, spectral=True,
        )  # fmt: skip
        _validate_group(defaults)
        require(isinstance(svd_niter, int) and svd_niter >= 0, "svd_niter", svd_niter, "be an int >= 0")
        ok_oversample = isinstance(svd_oversample, int) and svd_oversample >= 0
        require(ok_oversample, "svd_oversample", svd_oversample, "be an int >= 0")
        require(isinstance(seed, int), "seed", seed, "be an int")
        ok_staleness = max_staleness is None or (isinstance(max_staleness, int) and max_staleness >= 1)
        require(ok_staleness, "max_staleness", max_staleness, "be None or an int >= 1")
        self.svd_niter, self.svd_oversample, self.seed = svd_niter, svd_oversample, seed
        self.max_staleness = max_staleness
        require(isinstance(diagnostics, bool), "diagnostics", diagnostics, "be a bool")
        require(isinstance(overwrite_grads, bool), "overwrite_grads", overwrite_grads, "be a bool")
        self.diagnostics, self.overwrite_grads = diagnostics, overwrite_grads
        self.last_diagnostics: dict[str, float] = {}
        self.last_drift: float | None = None  # mean subspace drift of the newest anchor delivery
        # cumulative counts of the guards' interventions (reported while non-zero)
        self.guard_counts = {"anchor/rejected_non_finite": 0, "anchor/rejected_stale": 0, "spectral/svd_fallbacks": 0}
        super().__init__(params, defaults)

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        """Add a group after checking its options (merged with the defaults) like the constructor."""
        _validate_group({**self.defaults, **param_group})
        super().add_param_group(param_group)

    @staticmethod
    def _is_spectral(param: Tensor, group: Mapping[str, Any]) -> bool:
        return bool(group["spectral"]) and param.ndim == 2

    @torch.no_grad()
    def update_anchor(self, grads: Mapping[Tensor, Tensor], staleness: int | None = None) -> int:
        """Fold a dense anchor gradient G_anc into M_anc and recompute each matrix's (U, d, V).

        ``grads`` maps parameters of this optimizer to their dense gradients. Entries for parameters
        that are not spectral (1-D, or in a group with ``spectral=False``) are accepted and ignored,
        so a caller can pass a whole model's gradients. ``staleness``: fast steps between the
        gradient's snapshot and now, checked against ``max_staleness``. Returns the number of
        matrices updated (0 for a rejected delivery).
        """
        owners = {id(p): (i, p, g) for i, (p, g) in enumerate(self._params_with_groups())}
        for key, grad in grads.items():  # check everything first so a bad entry changes nothing
            owner = owners.get(id(key))
            known = owner is not None
            require(known, "grads key of shape", tuple(key.shape), "be a parameter of this optimizer")
            assert owner is not None
            shape = tuple(owner[1].shape)
            rule = f"equal its parameter's shape {shape}"
            require(tuple(grad.shape) == shape, "grads value shape", tuple(grad.shape), rule)
        if self._reject(grads, staleness):
            return 0
        updated, drifts = 0, []
        for key, grad in grads.items():
            index, param, group = owners[id(key)]
            if self._is_spectral(param, group):
                drift = self._update_basis(index, param, grad, group)
                if drift is not None:
                    drifts.append(drift)
                updated += 1
        self.last_drift = sum(drifts) / len(drifts) if drifts else None
        return updated

    def _reject(self, grads: Mapping[Tensor, Tensor], staleness: int | None) -> bool:
        """True (counted and logged) for a delivery that must not touch M_anc: too old or non-finite."""
        if staleness is not None and self.max_staleness is not None and staleness > self.max_staleness:
            self.guard_counts["anchor/rejected_stale"] += 1
            logger.warning(
                "anchor gradient rejected: staleness %d steps > max_staleness %d", staleness, self.max_staleness
            )
            return True
        bad = [tuple(key.shape) for key, grad in grads.items() if not bool(torch.isfinite(grad).all())]
        if bad:
            self.guard_counts["anchor/rejected_non_finite"] += 1
            logger.warning(
                "anchor gradient rejected: non-finite values in %d matrices (first of shape %s)", len(bad), bad[0]
            )
            return True
        return False

    def _params_with_groups(self) -> list[tuple[Tensor, dict[str, Any]]]:
        return [(p, g) for g in self.param_groups for p in g["params"]]

    def _update_basis(self, index: int, param: Tensor, grad: Tensor, group: dict[str, Any]) -> float | None:
        """Fold ``grad`` into the matrix's M_anc and refresh (U, d, V); returns the subspace drift
        (``subspace_drift`` of the old and new U), None for the first basis or a failed one."""
        state = self.state[param]
        previous = state.get("anchor_U")
        dtype = _anchor_dtype(param)
        if "anchor_momentum" not in state:
            state["anchor_momentum"] = torch.zeros(param.shape, dtype=dtype, device=param.device)
            state["anchor_updates"] = 0
        beta = group["anchor_beta"]
        momentum = state["anchor_momentum"]
        momentum.mul_(beta).add_(grad.to(device=momentum.device, dtype=dtype), alpha=1 - beta)
        seed = _basis_seed(self.seed, index, state["anchor_updates"])
        state["anchor_updates"] += 1
        try:
            factors = anchor_basis(momentum, group["rank"], self.svd_niter, self.svd_oversample, seed)
        except RuntimeError as err:  # torch.linalg.LinAlgError (no convergence) is a RuntimeError
            factors = None
            reason = f"{type(err).__name__}: {err}"
        else:
            reason = "non-finite factors"
        return self._set_basis(param, state, group, factors, previous, reason)

    def _set_basis(
        self,
        param: Tensor,
        state: dict[str, Any],
        group: dict[str, Any],
        factors: tuple[Tensor, Tensor, Tensor] | None,
        previous: Tensor | None,
        reason: str,
    ) -> float | None:
        """Cache (U, d, V) from good factors, or drop the basis (counted, logged) for missing/non-finite ones."""
        if factors is None or not all(bool(torch.isfinite(t).all()) for t in factors):
            for key in ("anchor_U", "anchor_d", "anchor_V", "anchor_s"):  # unfiltered until the next good basis
                state.pop(key, None)
            self.guard_counts["spectral/svd_fallbacks"] += 1
            logger.warning(
                "SVD of the anchor momentum %s failed (%s): that matrix steps unfiltered", tuple(param.shape), reason
            )
            return None
        u, s, v = factors
        state["anchor_U"], state["anchor_V"] = u, v
        state["anchor_d"] = _soft_filter(s, group["tau"], group["relative_tau"])
        state["anchor_age"] = 0
        return subspace_drift(previous, u) if previous is not None and previous.shape == u.shape else None

    @torch.no_grad()
    def update_anchor_factors(
        self, factors: Mapping[Tensor, tuple[Tensor, Tensor, Tensor]], staleness: int | None = None
    ) -> int:
        """Take the anchor momentum's top-r factors (U_r [m, r], s_r [r], V_r [n, r]) as each matrix's basis.

        The anchor keeps M_anc (``AnchorMomentum``) and sends these instead of its gradient
        (``anchor_payload="factors"``); d = s_r / (s_r + τ_p) as in ``update_anchor``. Non-spectral keys
        are accepted and ignored. A delivery with a non-finite value anywhere (the anchor marks a gradient
        it refused that way) or older than ``max_staleness`` is rejected whole and counted; the bases stay.
        Returns the number of matrices updated (0 for a rejected delivery).
        """
        owners = {id(p): (i, p, g) for i, (p, g) in enumerate(self._params_with_groups())}
        for key, triple in factors.items():
            owner = owners.get(id(key))
            require(owner is not None, "factors key of shape", tuple(key.shape), "be a parameter of this optimizer")
            assert owner is not None
            shape = tuple(owner[1].shape)
            got = tuple(tuple(t.shape) for t in triple)
            ok = _factor_shapes_ok(shape, got)
            require(ok, "factors value shapes", got, f"be (U [m, r], s [r], V [n, r]) for its parameter {shape}")
        flat = {key: torch.cat([t.reshape(-1) for t in triple]) for key, triple in factors.items()}
        if self._reject(flat, staleness):
            return 0
        updated, drifts = 0, []
        for key, (u, s, v) in factors.items():
            _, param, group = owners[id(key)]
            if not self._is_spectral(param, group):
                continue
            state = self.state[param]
            dtype = _anchor_dtype(param)
            u, s, v = (t.to(device=param.device, dtype=dtype) for t in (u, s, v))
            previous = state.get("anchor_U")
            state["anchor_updates"] = state.get("anchor_updates", 0) + 1
            state.pop("anchor_momentum", None)  # this optimizer's M_anc is the anchor's now
            drift = self._set_basis(param, state, group, (u, s, v), previous, "non-finite factors")
            if "anchor_U" in state:
                state["anchor_s"] = s
            if drift is not None:
                drifts.append(drift)
            updated += 1
        self.last_drift = sum(drifts) / len(drifts) if drifts else None
        return updated

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> float | None:  # type: ignore[override]
        """Filter each matrix gradient through the cached basis, then take an AdamW step."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        diagnostics = _Diagnostics()
        for param, group in self._params_with_groups():
            if param.grad is None:
                continue
            grad, owned = self._projected_grad(param, group, diagnostics)
            _adamw_update(param, grad, self.state[param], group, scratch=owned or self.overwrite_grads)
        guards = {k: float(v) for k, v in self.guard_counts.items() if v}
        self.last_diagnostics = {**diagnostics.as_dict(), **guards} if self.diagnostics else guards
        if diagnostics.stale:
            self.last_diagnostics["spectral/stale_matrices"] = float(diagnostics.stale)
        return loss

    def _projected_grad(self, param: Tensor, group: dict[str, Any], diagnostics: _Diagnostics) -> tuple[Tensor, bool]:
        """(G_proj in the gradient's dtype, whether it is a tensor of this step's own rather than ``param.grad``)."""
        grad = param.grad
        assert grad is not None  # step() skips parameters without one
        state = self.state[param]
        if not self._is_spectral(param, group) or "anchor_U" not in state:
            return grad, False
        u, d, v = state["anchor_U"], state["anchor_d"], state["anchor_V"]
        alpha = self._fading_alpha(state, group["alpha"], diagnostics)
        if alpha == 1:
            proj = grad.to(u.dtype)  # G_proj = G exactly; skipping the filter keeps AdamW bit-exact
        else:  # in place only without diagnostics: they need G beside G_proj
            proj = _filter_gradient(grad, u, d, v, alpha, in_place=self.overwrite_grads and not self.diagnostics)
        if self.diagnostics and "anchor_s" in state:  # factors: <·, M_r> from U diag(s) Vᵀ, no [m, n] product
            diagnostics.add_factors(grad, proj, u, state["anchor_s"], v, d)
        elif self.diagnostics:
            diagnostics.add(grad, proj, state["anchor_momentum"], d)
        out = proj.to(grad.dtype)
        return out, out is not grad

    def _fading_alpha(self, state: dict[str, Any], alpha: float, diagnostics: _Diagnostics) -> float:
        """α, or past ``max_staleness`` steps without a fresh basis, α + (1-α)·(age - max)/max up to 1."""
        age = state.get("anchor_age", 0)
        state["anchor_age"] = age + 1
        if self.max_staleness is None or age <= self.max_staleness:
            return alpha
        if age == self.max_staleness + 1:
            logger.warning(
                "anchor basis of a %s matrix is %d steps old (> max_staleness %d): fading its filter out",
                tuple(state["anchor_U"].shape[:1] + state["anchor_V"].shape[:1]),
                age,
                self.max_staleness,
            )
        diagnostics.stale += 1
        return alpha + (1 - alpha) * min(1.0, (age - self.max_staleness) / self.max_staleness)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load like torch, but keep the anchor tensors in float32 (or wider) and own all storage.

        torch casts every floating state tensor to the parameter's dtype, which would round M_anc,
        U, d, V to bf16 on a bf16 model. It also keeps same-dtype tensors by reference, so a loaded
        optimizer would step the source's moments in place; a deep copy prevents both.
        """
        state_dict = copy.deepcopy(state_dict)
        anchors = {pid: {k: s.pop(k) for k in _ANCHOR_TENSORS if k in s} for pid, s in state_dict["state"].items()}
        saved_ids = [pid for g in state_dict["param_groups"] for pid in g["params"]]
        super().load_state_dict(state_dict)
        for pid, (param, _) in zip(saved_ids, self._params_with_groups()):
            for key, value in anchors.get(pid, {}).items():
                self.state[param][key] = value.to(device=param.device, dtype=_anchor_dtype(param))


def spectral_options(knobs: Any) -> dict[str, Any]:
    """``SpectralAdamW``'s filter and anchor arguments from the mesh knobs (``config.MeshArguments``):
    α, τ_p, β_anc, the rank cap, relative τ, the basis seed and the staleness bound. Every place that
    builds a ``SpectralAdamW`` from the knobs (Trainer, Accelerate, the mesh's fast ranks) uses this."""
    return {
        "alpha": knobs.spectral_alpha,
        "tau": knobs.spectral_tau,
        "anchor_beta": knobs.anchor_beta,
        "rank": knobs.spectral_rank,
        "relative_tau": knobs.spectral_relative_tau,
        "seed": knobs.mask_seed,
        "max_staleness": knobs.anchor_max_staleness,
    }
