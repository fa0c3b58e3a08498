"""Micro-benchmarks of the fast circuit's local overheads: masking (DESIGN §2.1) and SpectralAdamW (§2.3).

    python -m benchmarks.wan.micro            # ≈ 5 min on 2 CPU cores; writes benchmarks/wan/results/micro.{md,json}
    python -m benchmarks.wan.micro --smoke    # seconds; tiny shapes, for the tests

(a) Masking as a share of a training step. A real model with Y = 4 stages (3 masked boundaries,
    p = 0.95) attached through ``hf_meshtune.boundary.hooks`` takes full steps (forward + backward of every
    microbatch, then ``torch.optim.AdamW``); separately, the masking work of the same step alone:
    keep-index generation g(ℓ, step, microbatch, T, H) and compact/expand forward and backward
    (``BoundaryMask.apply``, the same calls the hooks make) for the same boundaries, microbatches and
    shapes. Share = masking work / masked step. Target: ≤ 3 %. The masked step is also timed against
    the same model with its boundaries disabled (dense), interleaved, as a second, noisier estimate.
(b) ``SpectralAdamW`` against ``torch.optim.AdamW`` on the same parameters: a step with a cached basis,
    the step that follows an anchor delivery (``update_anchor`` recomputes the SVD, then ``step``), and
    their average over an anchor period A = 20 (one SVD step + 19 cached steps) / 20. Full SVD and the
    rank-capped randomized SVD (``rank=``). Target: amortised ≤ 1.3× AdamW.
(c) Optimizer state bytes / parameter bytes for both.

Timings are medians of several repetitions. The timing helpers here are shared with ``gpu_check.py``
(same code on CUDA, with synchronisation).
"""

from __future__ import annotations

import argparse
import copy
import datetime
import itertools
import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import transformers

from hf_meshtune import ledger as L
from hf_meshtune.apps.assets import cache_dir, load_smollm2
from hf_meshtune.boundary.hooks import attach_boundaries
from hf_meshtune.boundary.masking import BoundaryMask, keep_count, keep_indices
from hf_meshtune.optim.factors import AnchorMomentum
from hf_meshtune.optim.spectral import SpectralAdamW

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
MASK_SHARE_TARGET = 0.03  # masking ≤ 3 % of a step
AMORTISED_TARGET = 1.3  # SpectralAdamW amortised over A ≤ 1.3× AdamW
ANCHOR_EVERY = 20  # A
MASK_RATIO = 0.95  # p
NUM_STAGES = 4  # Y: 3 boundaries, as in the ledger's 8×4 mesh
SPECTRAL_RANKS: tuple[int | None, ...] = (None, 32, 8)  # None = full SVD (the paper), else randomized rank cap


# ---------------------------------------------------------------------------------------------------
# timing helpers (shared with gpu_check.py)
# ---------------------------------------------------------------------------------------------------


def synchronize(device: torch.device | str) -> None:
    """Wait for queued kernels, so that a wall-clock interval covers the work (no-op on CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def time_call(fn: Callable[[], Any], reps: int, device: torch.device | str = "cpu", warmup: int = 1) -> dict[str, Any]:
    """Median wall time of ``fn()`` over ``reps`` calls after ``warmup`` untimed ones (seconds)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(reps):
        synchronize(device)
        start = time.perf_counter()
        fn()
        synchronize(device)
        times.append(time.perf_counter() - start)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": times}


def time_interleaved(
    fns: Mapping[str, Callable[[], Any]], reps: int, device: torch.device | str = "cpu", warmup: int = 1
) -> dict[str, dict[str, Any]]:
    """``time_call`` for several functions, alternating them every repetition so that a machine
    shared with other jobs slows them alike; returns {name: timing}."""
    for fn in fns.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(reps):
        for name, fn in fns.items():
            synchronize(device)
            start = time.perf_counter()
            fn()
            synchronize(device)
            times[name].append(time.perf_counter() - start)
    return {name: {"median_s": statistics.median(t), "min_s": min(t), "times_s": t} for name, t in times.items()}


def machine_info(device: torch.device | str = "cpu") -> dict[str, Any]:
    """torch version, CPU count and threads, date, and the GPU's name when ``device`` is CUDA."""
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "cpu_affinity": len(os.sched_getaffinity(0)),
        "torch_threads": torch.get_num_threads(),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "platform": platform.platform(),
    }
    if torch.device(device).type == "cuda":
        info["gpu"] = torch.cuda.get_device_name(device)
    return info


# ---------------------------------------------------------------------------------------------------
# shapes (from the library's presets; nothing hard-coded)
# ---------------------------------------------------------------------------------------------------


def _meta_model(config: transformers.PretrainedConfig) -> torch.nn.Module:
    with torch.device("meta"):
        return transformers.AutoModelForCausalLM.from_config(config)


def decoder_layer_shapes(config: transformers.PretrainedConfig) -> dict[str, tuple[int, ...]]:
    """{name: shape} of one decoder layer's parameters (q/k/v/o, gate/up/down, the two norms)."""
    one_layer = copy.deepcopy(config)
    one_layer.num_hidden_layers = 1
    model = _meta_model(one_layer)
    return {
        name.split("layers.0.", 1)[1]: tuple(p.shape) for name, p in model.named_parameters() if "layers.0." in name
    }


def model_shapes(config: transformers.PretrainedConfig) -> list[tuple[int, ...]]:
    """Shapes of every trainable parameter of the model ``config`` describes (tied weights once)."""
    return L.param_shapes_of(_meta_model(config))


def random_params(
    shapes: Sequence[tuple[int, ...]], device: torch.device | str, dtype: torch.dtype, seed: int = 0
) -> list[torch.nn.Parameter]:
    """Random parameters with random gradients (scaled like a fine-tuning gradient, ~1e-3)."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    params = []
    for shape in shapes:
        p = torch.nn.Parameter((torch.randn(shape, generator=gen) * 0.02).to(device, dtype))
        p.grad = (torch.randn(shape, generator=gen) * 1e-3).to(device, dtype)
        params.append(p)
    return params


def state_over_param_bytes(optimizer: torch.optim.Optimizer, params: Sequence[torch.Tensor]) -> float:
    """Sum of the bytes of every tensor in the optimizer's state over the bytes of the parameters."""
    state = sum(
        v.numel() * v.element_size() for p in params for v in optimizer.state[p].values() if isinstance(v, torch.Tensor)
    )
    return state / sum(p.numel() * p.element_size() for p in params)


# ---------------------------------------------------------------------------------------------------
# (b, c) SpectralAdamW vs AdamW
# ---------------------------------------------------------------------------------------------------


def _adamw(params: Sequence[torch.nn.Parameter], **kwargs: Any) -> torch.optim.AdamW:
    """torch.optim.AdamW with the benchmark's hyper-parameters (``kwargs`` e.g. ``foreach=False``;
    default: torch's choice for these tensors, single-tensor on CPU, foreach on CUDA)."""
    return torch.optim.AdamW(params, lr=1e-5, weight_decay=0.01, **kwargs)


def paired_ratio(phase: Mapping[str, Mapping[str, Any]], key: str, base: str = "adamw") -> float:
    """Median over repetitions of time[key] / time[base] within one interleaved phase: each ratio
    compares two calls made back to back, so a load burst from another job cancels out."""
    return statistics.median(a / b for a, b in zip(phase[key]["times_s"], phase[base]["times_s"]))


def time_spectral_vs_adamw(
    params: Sequence[torch.nn.Parameter],
    ranks: Sequence[int | None],
    reps: int,
    svd_reps: int,
    device: torch.device | str,
    anchor_every: int = ANCHOR_EVERY,
    seed: int = 1,
) -> dict[str, Any]:
    """AdamW and one SpectralAdamW per rank on the same parameters, interleaved in three phases:

    1. before any anchor delivery: SpectralAdamW steps the plain gradient (its own AdamW loop);
    2. with a cached basis (the fast circuit's usual step), plus an α = 1 instance whose filter is
       skipped but whose diagnostics still run (separates the filter from the diagnostics);
    3. the step after a delivery: ``update_anchor`` (momentum update + SVD) then ``step``, a new
       delivery every call so the SVD is really recomputed.

    Per rank, in units of one AdamW step (paired ratios, see ``paired_ratio``): amortised over an
    anchor period A = (SVD step + (A - 1) cached steps) / A = loop + diagnostics + filter + SVD / A.
    """
    gen = torch.Generator(device="cpu").manual_seed(seed)
    anchor = {p: (torch.randn(p.shape, generator=gen) * 1e-3).to(device, p.dtype) for p in params}
    adamw = _adamw(params)
    spectral = {
        ("full" if r is None else f"rank{r}"): SpectralAdamW(params, lr=1e-5, weight_decay=0.01, rank=r) for r in ranks
    }
    # what MeshTrainer and the mesh's workers build: no cosines on steps that are not logged, .grad as scratch
    # (the gradients these repetitions step on then drift, which a CPU's time per element does not depend on)
    trainer_path = dict(lr=1e-5, weight_decay=0.01, diagnostics=False, overwrite_grads=True)
    capped = [r for r in ranks if r is not None]
    fast = {f"rank{r} trainer path": SpectralAdamW(params, rank=r, **trainer_path) for r in capped}
    # anchor_payload="factors": the anchor sends the top-r factors; the fast node takes them, no SVD of its own
    matrices = [p for p in params if p.ndim == 2]
    factors = {
        r: dict(zip(matrices, AnchorMomentum(0.9, r).fold([anchor[p].float() for p in matrices]))) for r in capped
    }
    by_factors = {f"rank{r} factors, trainer path": SpectralAdamW(params, **trainer_path) for r in capped}
    spectral_all = {**spectral, **fast, **by_factors}
    rank_of = {key: opt.defaults["rank"] for key, opt in {**spectral, **fast}.items()}
    rank_of |= dict(zip(by_factors, capped))
    unfiltered = SpectralAdamW(params, lr=1e-5, weight_decay=0.01, alpha=1.0, rank=min(r or 8 for r in ranks))
    phase1 = time_interleaved({"adamw": adamw.step, "no_basis": unfiltered.step}, reps, device)
    for opt in (*spectral.values(), *fast.values(), unfiltered):
        opt.update_anchor(anchor)  # first delivery: allocates M_anc and the bases
    for r, (key, opt) in zip(capped, by_factors.items()):
        opt.update_anchor_factors(factors[r])
    phase2 = time_interleaved(
        {"adamw": adamw.step, "alpha1": unfiltered.step, **{k: o.step for k, o in spectral_all.items()}}, reps, device
    )
    del unfiltered
    svd_fns = {k: (lambda o=o: (o.update_anchor(anchor), o.step())) for k, o in {**spectral, **fast}.items()}
    svd_fns |= {
        k: (lambda o=o, f=factors[r]: (o.update_anchor_factors(f), o.step()))
        for r, (k, o) in zip(capped, by_factors.items())
    }
    phase3 = time_interleaved({"adamw": adamw.step, **svd_fns}, svd_reps, device, warmup=0)
    out = {
        "adamw": {
            "step_phases": {"no_basis": phase1["adamw"], "cached": phase2["adamw"], "svd": phase3["adamw"]},
            "step": phase2["adamw"],
            "state_over_params": state_over_param_bytes(adamw, params),
        },
        "spectral": {},
    }
    loop, diag_total = paired_ratio(phase1, "no_basis"), paired_ratio(phase2, "alpha1")
    for key, opt in spectral_all.items():
        cached, svd = paired_ratio(phase2, key), paired_ratio(phase3, key)
        amortised = cached + (svd - cached) / anchor_every
        out["spectral"][key] = {
            "rank": rank_of[key],
            "no_basis_step": phase1["no_basis"],
            "alpha1_step": phase2["alpha1"],
            "cached_step": phase2[key],
            "svd_step": phase3[key],
            "amortised_s": (phase3[key]["median_s"] + (anchor_every - 1) * phase2[key]["median_s"]) / anchor_every,
            "cached_over_adamw": cached,
            "svd_step_over_adamw": svd,
            "amortised_over_adamw": amortised,
            "meets_target": amortised <= AMORTISED_TARGET,
            "profile_in_adamw_steps": (
                {
                    "adamw_loop": loop,
                    "diagnostics": diag_total - loop,
                    "filter": cached - diag_total,
                    "svd_per_step": (svd - cached) / anchor_every,
                }
                if key in spectral  # the parts are measured for the plain path (its loop, its α = 1 twin)
                else None
            ),
            "state_over_params": state_over_param_bytes(opt, params),
        }
    return out


def svd_profile(
    named_params: Mapping[str, torch.nn.Parameter], rank: int | None, reps: int, device: torch.device | str
) -> dict[str, dict[str, Any]]:
    """``update_anchor`` (momentum update + SVD) of one matrix, per distinct shape: the fastest of
    ``reps`` deliveries (a profile: the minimum is the least disturbed by other jobs) and the matrices
    of that shape."""
    by_shape: dict[tuple[int, ...], list[str]] = {}
    for name, p in named_params.items():
        if p.ndim == 2:
            by_shape.setdefault(tuple(p.shape), []).append(name)
    opt = SpectralAdamW(list(named_params.values()), rank=rank)
    out = {}
    for shape, names in by_shape.items():
        p = named_params[names[0]]
        grad = torch.randn_like(p) * 1e-3
        timing = time_call(lambda: opt.update_anchor({p: grad}), reps, device, warmup=0)
        out["×".join(map(str, shape))] = {"min_s": timing["min_s"], "times_s": timing["times_s"], "matrices": names}
    return out


def compare_optimizers(
    shapes: Sequence[tuple[int, ...]],
    *,
    device: torch.device | str,
    dtype: torch.dtype,
    ranks: Sequence[int | None],
    reps: int,
    svd_reps: int,
    adamw_variants: Mapping[str, Mapping[str, Any]] | None = None,
) -> dict[str, Any]:
    """AdamW and SpectralAdamW (one entry per rank) on random parameters of ``shapes``.

    Ratios are against torch's default AdamW; ``adamw_variants`` ({label: AdamW kwargs}, e.g.
    ``{"single_tensor": {"foreach": False}}``) are timed too, for reference.
    """
    params = random_params(shapes, device, dtype)
    out: dict[str, Any] = {"num_params": sum(p.numel() for p in params), "dtype": str(dtype)}
    out.update(time_spectral_vs_adamw(params, ranks, reps, svd_reps, device))
    out["adamw_variants"] = {
        label: time_call(_adamw(params, **kw).step, reps, device) for label, kw in (adamw_variants or {}).items()
    }
    return out


# ---------------------------------------------------------------------------------------------------
# (a) masking vs a training step
# ---------------------------------------------------------------------------------------------------


def time_masking_work(
    num_boundaries: int,
    microbatches: int,
    batch: int,
    seq_len: int,
    hidden: int,
    *,
    mask_ratio: float = MASK_RATIO,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
) -> dict[str, Any]:
    """The masking work of one training step alone, per step: index generation, and the whole
    ``BoundaryMask.apply`` (indices + compact + expand) forward plus its backward (scatter + gather).

    A fresh step number every call, so indices are really drawn (``BoundaryMask`` caches the last one).
    """
    masks = [BoundaryMask(b, mask_ratio, seed=0) for b in range(num_boundaries)]
    hs = [torch.randn(batch, seq_len, hidden, device=device, dtype=dtype, requires_grad=True) for _ in masks]
    grad_out = torch.randn(batch, seq_len, hidden, device=device, dtype=dtype)
    steps = itertools.count(1)

    def indices() -> None:
        step = next(steps)
        for mb, mask in itertools.product(range(microbatches), masks):
            mask.indices(step, mb, seq_len, hidden, device)

    def apply_fwd_bwd() -> None:
        step = next(steps)
        for mb, (mask, h) in itertools.product(range(microbatches), zip(masks, hs)):
            out, _ = mask.apply(h, step, mb)
            torch.autograd.grad(out, h, grad_out)

    timings = time_interleaved({"index_generation": indices, "mask_fwd_bwd": apply_fwd_bwd}, reps, device)
    return {
        "num_boundaries": num_boundaries,
        "microbatches": microbatches,
        "batch": batch,
        "seq_len": seq_len,
        "hidden": hidden,
        "keep": keep_count(hidden, mask_ratio),
        "dtype": str(dtype),
        **timings,
    }


def time_masked_step(
    model: torch.nn.Module,
    *,
    microbatches: int,
    batch: int,
    seq_len: int,
    vocab: int,
    device: torch.device | str = "cpu",
    reps: int = 5,
    num_stages: int = NUM_STAGES,
    mask_ratio: float = MASK_RATIO,
) -> dict[str, Any]:
    """Full training steps through ``attach_boundaries``: every microbatch's forward + backward, then
    AdamW; masked and (boundaries disabled) dense, interleaved. Also the boundary bytes per token."""
    model.train()
    handle = attach_boundaries(model, num_stages, mask_ratio)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-5)
    gen = torch.Generator(device="cpu").manual_seed(0)
    ids = [torch.randint(3, vocab, (batch, seq_len), generator=gen).to(device) for _ in range(microbatches)]
    steps = itertools.count()

    def step() -> None:
        handle.set_step(next(steps))
        for x in ids:
            (model(input_ids=x, labels=x).loss / microbatches).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def dense_step() -> None:
        with handle.disabled():
            step()

    try:
        timings = time_interleaved({"masked_step": step, "dense_step": dense_step}, reps, device)
        handle.counter.reset()
        step()
        fwd_bytes_per_token = handle.counter.fwd_bytes / handle.counter.tokens
    finally:
        handle.remove()
    return {
        "num_boundaries": len(handle.boundary_layers),
        "hidden": handle.hidden_size,
        "keep": handle.keep,
        "microbatches": microbatches,
        "batch": batch,
        "seq_len": seq_len,
        "fwd_boundary_bytes_per_token": fwd_bytes_per_token,
        **timings,
    }


def masking_share(
    model: torch.nn.Module,
    *,
    microbatches: int,
    batch: int,
    seq_len: int,
    vocab: int,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    reps: int = 5,
) -> dict[str, Any]:
    """(a) for one model: the masked step, the masking work of the same step alone, and the share."""
    step = time_masked_step(
        model, microbatches=microbatches, batch=batch, seq_len=seq_len, vocab=vocab, device=device, reps=reps
    )
    work = time_masking_work(
        step["num_boundaries"], microbatches, batch, seq_len, step["hidden"], device=device, dtype=dtype, reps=reps
    )
    masked = step["masked_step"]["median_s"]
    share = work["mask_fwd_bwd"]["median_s"] / masked
    return {
        "step": step,
        "masking_work": work,
        "share_of_step": share,
        "index_generation_share": work["index_generation"]["median_s"] / masked,
        "masked_minus_dense_share": 1 - 1 / paired_ratio(step, "masked_step", "dense_step"),
        "meets_target": share <= MASK_SHARE_TARGET,
    }


def tiny_llama(hidden: int, layers: int, vocab: int) -> torch.nn.Module:
    """A randomly initialised Llama (4 heads, 2 KV heads, intermediate 2·H), as the tests build one."""
    config = transformers.LlamaConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * hidden,
        vocab_size=vocab,
        max_position_embeddings=2048,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return transformers.AutoModelForCausalLM.from_config(config)


def smollm2_if_cached() -> tuple[torch.nn.Module | None, str | None]:
    """(SmolLM2-135M, None) when its converted checkpoint is cached, else (None, the reason)."""
    folder = cache_dir() / "smollm2-135m-instruct"
    if not (folder / "model.safetensors").is_file():
        return (
            None,
            f"not cached: {folder}/model.safetensors is missing "
            "(hf_meshtune.apps.assets.smollm2_checkpoint converts it)",
        )
    model, _ = load_smollm2(torch.float32)
    return model, None


# ---------------------------------------------------------------------------------------------------
# the run
# ---------------------------------------------------------------------------------------------------


def plan(smoke: bool) -> dict[str, Any]:
    """Sizes and repetitions of a full run or of a smoke run (tiny shapes, one repetition)."""
    if smoke:
        tiny = transformers.LlamaConfig(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            intermediate_size=256,
            vocab_size=100,
        )
        return {
            "reps": 1,
            "mask_reps": 1,
            "svd_reps": 1,
            "profile_reps": 1,
            "tiny": dict(hidden=64, layers=4, vocab=100, microbatches=2, batch=2, seq_len=16),
            "smollm2": None,
            "paper_shape_index": dict(seq_len=64, hidden=128),
            "optim_sets": {"tiny-llama-layer": ("layer", tiny), "tiny-llama-model": ("model", tiny)},
        }
    return {
        "reps": 5,
        "mask_reps": 10,
        "svd_reps": 3,
        "profile_reps": 2,
        "tiny": dict(hidden=256, layers=8, vocab=1000, microbatches=2, batch=4, seq_len=128),
        "smollm2": dict(microbatches=2, batch=1, seq_len=256),
        "paper_shape_index": dict(seq_len=2048, hidden=2048),
        "optim_sets": {
            "llama-3.2-1b-layer": ("layer", L.PRESETS["llama-3.2-1b"]),
            "smollm2-135m-model": ("model", L.PRESETS["smollm2-135m"]),
        },
    }


def run_masking(p: Mapping[str, Any]) -> dict[str, Any]:
    """(a) for the tiny Llama and, when cached, SmolLM2-135M; plus index generation at 1B shapes."""
    t = p["tiny"]
    out: dict[str, Any] = {
        "target_share": MASK_SHARE_TARGET,
        "mask_ratio": MASK_RATIO,
        "num_stages": NUM_STAGES,
        "models": {},
    }
    model = tiny_llama(t["hidden"], t["layers"], t["vocab"])
    out["models"]["tiny-llama"] = masking_share(
        model,
        microbatches=t["microbatches"],
        batch=t["batch"],
        seq_len=t["seq_len"],
        vocab=t["vocab"],
        reps=p["mask_reps"],
    )
    if p["smollm2"] is None:
        out["models"]["smollm2-135m"] = {"skipped": "smoke run"}
    else:
        model, reason = smollm2_if_cached()
        if model is None:
            out["models"]["smollm2-135m"] = {"skipped": reason}
        else:
            s = p["smollm2"]
            out["models"]["smollm2-135m"] = masking_share(model, vocab=model.config.vocab_size, reps=p["reps"], **s)
        del model
    s = p["paper_shape_index"]
    keep = keep_count(s["hidden"], MASK_RATIO)
    steps = itertools.count()
    timing = time_call(lambda: keep_indices(0, next(steps), 0, s["seq_len"], s["hidden"], keep, 0), p["reps"])
    out["index_generation_at_1b_shape"] = {**s, "keep": keep, "per_boundary_per_microbatch": timing}
    return out


def run_optimizers(p: Mapping[str, Any]) -> dict[str, Any]:
    """(b) and (c) for every shape set of the plan, fp32 on CPU; SVD profile of the first set."""
    out: dict[str, Any] = {"target_amortised_over_adamw": AMORTISED_TARGET, "anchor_every": ANCHOR_EVERY, "sets": {}}
    for label, (kind, config) in p["optim_sets"].items():
        start = time.perf_counter()
        names_shapes = (
            decoder_layer_shapes(config) if kind == "layer" else {str(i): s for i, s in enumerate(model_shapes(config))}
        )
        result = compare_optimizers(
            list(names_shapes.values()),
            device="cpu",
            dtype=torch.float32,
            ranks=SPECTRAL_RANKS,
            reps=p["reps"],
            svd_reps=p["svd_reps"],
        )
        result["shapes"] = (
            names_shapes if kind == "layer" else f"{len(names_shapes)} tensors of {config.model_type} (ledger preset)"
        )
        if kind == "layer":
            params = random_params(list(names_shapes.values()), "cpu", torch.float32)
            result["svd_profile_full"] = svd_profile(dict(zip(names_shapes, params)), None, p["profile_reps"], "cpu")
        result["wall_s"] = time.perf_counter() - start
        out["sets"][label] = result
    return out


def run(smoke: bool) -> dict[str, Any]:
    """Everything micro.json holds."""
    torch.set_num_threads(len(os.sched_getaffinity(0)))
    p = plan(smoke)
    start = time.perf_counter()
    data: dict[str, Any] = {"smoke": smoke, "machine": machine_info()}
    data["masking"] = run_masking(p)
    data["masking_wall_s"] = time.perf_counter() - start
    data["optimizer"] = run_optimizers(p)
    data["wall_s"] = time.perf_counter() - start
    return data


# ---------------------------------------------------------------------------------------------------
# report
# ---------------------------------------------------------------------------------------------------


def _ms(seconds: float) -> str:
    return f"{1e3 * seconds:,.1f}"


def _masking_lines(m: Mapping[str, Any]) -> list[str]:
    lines = [
        f"Y = {m['num_stages']} stages (3 boundaries), p = {m['mask_ratio']}; step = forward + backward of every "
        "microbatch + AdamW.",
        "",
        "| model | H / K | microbatches × [B, T] | masked step (ms) | dense step (ms) | index gen (ms) | "
        "mask fwd+bwd incl. index gen (ms) | share of step | (masked − dense) / masked | ≤ 3 %? |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    for name, r in m["models"].items():
        if "skipped" in r:
            lines.append(f"| {name} | skipped: {r['skipped']} |")
            continue
        s, w = r["step"], r["masking_work"]
        verdict = "met" if r["meets_target"] else f"missed ({r['share_of_step'] / MASK_SHARE_TARGET:.1f}× the target)"
        lines.append(
            f"| {name} | {s['hidden']} / {s['keep']} | {s['microbatches']} × [{s['batch']}, {s['seq_len']}] | "
            f"{_ms(s['masked_step']['median_s'])} | {_ms(s['dense_step']['median_s'])} | "
            f"{_ms(w['index_generation']['median_s'])} | {_ms(w['mask_fwd_bwd']['median_s'])} | "
            f"{100 * r['share_of_step']:.2f} % | {100 * r['masked_minus_dense_share']:+.1f} % | {verdict} |"
        )
    g = m["index_generation_at_1b_shape"]
    lines += [
        "",
        f"Keep-index generation at the paper's shape (T = {g['seq_len']}, H = {g['hidden']}, K = {g['keep']}), CPU, "
        f"per boundary per microbatch: {_ms(g['per_boundary_per_microbatch']['median_s'])} ms "
        "(`keep_indices` always draws on the CPU, also for a GPU run).",
    ]
    return lines


def _optimizer_lines(o: Mapping[str, Any], where: str = "fp32 on CPU") -> list[str]:
    lines = [
        f"{where}; amortised = (SVD step + {o['anchor_every'] - 1} cached steps) / {o['anchor_every']}. "
        "Ratios are medians of per-repetition ratios to an AdamW step timed right beside (see `paired_ratio`).",
        "",
        "| shapes | params | optimizer | step, cached basis (ms) | SVD step (ms) | cached / AdamW | SVD step / AdamW | "
        "amortised / AdamW | ≤ 1.3×? | state / params |",
        "|---|---:|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for label, r in o["sets"].items():
        a = r["adamw"]
        lines.append(
            f"| {label} | {r['num_params'] / 1e6:,.1f} M | AdamW | {_ms(a['step']['median_s'])} | — | 1.00× | — | "
            f"1.00× | — | {a['state_over_params']:.2f} |"
        )
        for name, s in r["spectral"].items():
            verdict = (
                "met"
                if s["meets_target"]
                else f"missed ({s['amortised_over_adamw'] / AMORTISED_TARGET:.1f}× the target)"
            )
            lines.append(
                f"| {label} | | SpectralAdamW {name} | {_ms(s['cached_step']['median_s'])} | "
                f"{_ms(s['svd_step']['median_s'])} | {s['cached_over_adamw']:.2f}× | {s['svd_step_over_adamw']:.1f}× | "
                f"{s['amortised_over_adamw']:.2f}× | {verdict} | {s['state_over_params']:.2f} |"
            )
    return lines


_PROFILE_PARTS = {
    "adamw_loop": "its AdamW loop",
    "diagnostics": "diagnostics (cosines, mean d)",
    "filter": "two-sided filter + mix",
    "svd_per_step": "SVD / A",
}


def _wide_svd_lines(prof: Mapping[str, Mapping[str, Any]]) -> list[str]:
    """A wide [m, n] (m < n) matrix next to its transpose's shape: how much slower its SVD is."""
    lines = []
    for shape, v in prof.items():
        m, n = map(int, shape.split("×"))
        twin = prof.get(f"{n}×{m}")
        if m < n and twin is not None:
            ratio = v["min_s"] / twin["min_s"]
            lines.append(
                f"The wide {shape} basis update takes {ratio:.1f}× as long as the tall {n}×{m} one "
                f"({v['min_s'] - twin['min_s']:+.1f} s per delivery); SpectralAdamW decomposes a wide matrix "
                "through its transpose, since LAPACK's SVD of the wide orientation was several times slower here."
            )
    return lines


def _profile_lines(o: Mapping[str, Any]) -> list[str]:
    """Where the time of every SpectralAdamW that missed its target goes, in AdamW steps."""
    lines = [
        "| shapes | optimizer | " + " | ".join(_PROFILE_PARTS.values()) + " | amortised |",
        "|---|---|" + "---:|" * (len(_PROFILE_PARTS) + 1),
    ]
    for label, r in o["sets"].items():
        for name, s in r["spectral"].items():
            if s["meets_target"] or s["profile_in_adamw_steps"] is None:
                continue
            prof = s["profile_in_adamw_steps"]
            lines.append(
                f"| {label} | {name} | "
                + " | ".join(f"{prof[k]:.2f}" for k in _PROFILE_PARTS)
                + f" | {s['amortised_over_adamw']:.2f} |"
            )
    for label, r in o["sets"].items():
        prof = r.get("svd_profile_full")
        if prof:
            lines += [
                "",
                f"Full SVD (`update_anchor`, fastest of the repetitions) per matrix of {label}: "
                + ", ".join(f"{shape} ({', '.join(v['matrices'])}) {_ms(v['min_s'])} ms" for shape, v in prof.items())
                + ".",
            ]
            lines += _wide_svd_lines(prof)
    return lines if len(lines) > 2 else []


def markdown(data: Mapping[str, Any]) -> str:
    """micro.md: machine, the three tables, and a profile of what misses its target."""
    m = data["machine"]
    out = [
        "# Micro-benchmarks: masking and SpectralAdamW overheads",
        "",
        f"Generated by `python -m benchmarks.wan.micro{' --smoke' if data['smoke'] else ''}` on {m['date']} in "
        f"{data['wall_s']:.1f} s: torch {m['torch']}, {m['cpu_affinity']} CPU cores usable ({m['cpu_count']} on the "
        f"host), {m['torch_threads']} torch threads, {m['platform']}. Times are medians (the JSON has every "
        "repetition); the machine is shared with other jobs, so absolute times are noisy, ratios less so.",
        "",
        "## (a) Masking as a share of a training step (target ≤ 3 %)",
        "",
        *_masking_lines(data["masking"]),
        "",
        "## (b, c) SpectralAdamW vs AdamW (target: amortised ≤ 1.3×)",
        "",
        *_optimizer_lines(data["optimizer"]),
        "",
    ]
    profile = _profile_lines(data["optimizer"])
    if profile:
        out += [
            "### Why the misses",
            "",
            "Amortised cost split into parts, in AdamW steps (they add up to the amortised ratio): SpectralAdamW's "
            "AdamW loop (a step before any delivery), the per-step diagnostics (an α = 1 step, which skips the "
            "filter but not the diagnostics, minus the loop), the filter (cached step minus that), and the SVD "
            "spread over A steps.",
            "",
            *profile,
            "",
            "With a full-rank basis the cached filter U diag(d) (Uᵀ G V) diag(d) Vᵀ is four dense matmuls, "
            "O(m·n·min(m, n)) per matrix, against AdamW's O(m·n) element-wise update; the rank-r cap makes it "
            "O(m·n·r), after which the element-wise passes (the mix α·G + (1-α)·G_filt and the diagnostics' five "
            "reductions over G, G_proj and M_anc) are what remains above AdamW.",
            "",
        ]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Run the micro-benchmarks and write micro.json and micro.md into ``--out-dir``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny shapes, one repetition (seconds)")
    parser.add_argument("--out-dir", default=RESULTS, help="where to write micro.{json,md}")
    args = parser.parse_args(argv)
    data = run(args.smoke)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "micro.json"), "w") as fh:
        json.dump(data, fh, indent=2, default=str)
    with open(os.path.join(args.out_dir, "micro.md"), "w") as fh:
        fh.write(markdown(data))
    print(f"wrote {args.out_dir}/micro.{{json,md}} in {data['wall_s']:.1f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
