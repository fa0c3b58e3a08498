"""The rules between knobs, stated the right way round: ranges, the knobs that need or exclude one another,
and what the distributed mesh does not run (yet). Each raises ``ValueError`` naming the field, its value
and the rule; the order of the checks is the order a user sees the errors in."""

from __future__ import annotations

from .._validation import require
from ..boundary.compose.change import change_spec
from ..boundary.compose.grammar import parse_codec
from ..boundary.fills import require_fill
from ..boundary.hooks import require_stage_layers
from .derived import cadence_bounds, codec_ladder, composed_codec, is_governed
from .presets import ANCHOR_PAYLOADS, CADENCES, DP_QUANTIZERS

__all__ = ["require_knob_rules", "require_mesh_supported"]


def require_knob_rules(cfg) -> None:
    """Every knob's range and every rule between knobs, on knobs whose preset is applied and whose types
    are checked (``MeshArguments.validate_mesh``), mechanism by mechanism."""
    _require_boundary(cfg)
    _require_anchor(cfg)
    _require_spectral(cfg)
    _require_mesh_and_dp(cfg)
    _require_anchor_link(cfg)


def _require_boundary(cfg) -> None:
    require(0.0 <= cfg.mask_ratio < 1.0, "mask_ratio", cfg.mask_ratio, "lie in [0, 1)")
    require(cfg.num_stages >= 1, "num_stages", cfg.num_stages, "be >= 1")
    if cfg.stage_layers is not None:  # their sum is checked against the model where it is split (split_stages)
        require_stage_layers(cfg.stage_layers, cfg.num_stages)
    require_fill(cfg.mask_fill, cfg.mask_rescale)
    require(cfg.mask_protect_dims >= 0, "mask_protect_dims", cfg.mask_protect_dims, "be >= 0")
    _apply_boundary_codec(cfg)
    _require_change_coding(cfg)


def _require_change_coding(cfg) -> None:
    require(cfg.change_cache_gb > 0, "change_cache_gb", cfg.change_cache_gb, "be > 0")
    if cfg.boundary_change_codec is None:
        return
    require(
        composed_codec(cfg) is not None and not is_governed(cfg),
        "boundary_change_codec",
        cfg.boundary_change_codec,
        f"be None unless boundary_codec is a composed codec (not a mask or 'governed'; it is {cfg.boundary_codec!r}): "
        "a first visit sends boundary_codec's message",
    )
    change_spec(cfg.boundary_change_codec)


def _require_anchor(cfg) -> None:
    require(cfg.anchor_every >= 1, "anchor_every", cfg.anchor_every, "be >= 1")
    require(cfg.anchor_delay >= 0, "anchor_delay", cfg.anchor_delay, "be >= 0")
    require(0.0 <= cfg.anchor_beta <= 1.0, "anchor_beta", cfg.anchor_beta, "lie in [0, 1]")
    _require_optional_positive("anchor_microbatches", cfg.anchor_microbatches)
    _require_optional_positive("anchor_max_staleness", cfg.anchor_max_staleness)
    _require_codec_refit(cfg)
    _require_governor(cfg)


def _require_spectral(cfg) -> None:
    require(cfg.spectral_tau > 0, "spectral_tau", cfg.spectral_tau, "be > 0")
    require(0.0 <= cfg.spectral_alpha <= 1.0, "spectral_alpha", cfg.spectral_alpha, "lie in [0, 1]")
    _require_optional_positive("spectral_rank", cfg.spectral_rank)


def _require_mesh_and_dp(cfg) -> None:
    require(cfg.num_replicas >= 1, "num_replicas", cfg.num_replicas, "be >= 1")
    if cfg.anchor:
        require(
            cfg.num_replicas >= 2,
            "num_replicas",
            cfg.num_replicas,
            "be >= 2 when anchor=True (one replica is the anchor)",
        )
    require(cfg.dp_sync_every >= 1, "dp_sync_every", cfg.dp_sync_every, "be >= 1")
    _require_optional_positive("dp_powersgd_rank", cfg.dp_powersgd_rank)
    require(
        cfg.max_memory_per_stage is None or cfg.max_memory_per_stage > 0,
        "max_memory_per_stage",
        cfg.max_memory_per_stage,
        "be None or > 0 (GiB)",
    )
    require(
        isinstance(cfg.dp_fragments, int) and cfg.dp_fragments >= 1,
        "dp_fragments",
        cfg.dp_fragments,
        "be an int >= 1",
    )
    require(
        cfg.dp_sync_every % cfg.dp_fragments == 0,
        "dp_fragments",
        cfg.dp_fragments,
        f"divide dp_sync_every={cfg.dp_sync_every} (one fragment syncs every dp_sync_every / dp_fragments steps)",
    )
    interval = cfg.dp_sync_every // cfg.dp_fragments
    require(
        isinstance(cfg.dp_sync_delay, int) and 0 <= cfg.dp_sync_delay < interval,
        "dp_sync_delay",
        cfg.dp_sync_delay,
        f"lie in [0, dp_sync_every / dp_fragments = {interval}) (a fragment's sync must land before the next one "
        "starts)",
    )
    require(
        not cfg.dp_keep_overlapped or cfg.dp_sync_delay > 0,
        "dp_keep_overlapped",
        cfg.dp_keep_overlapped,
        "be False when dp_sync_delay=0 (no inner step overlaps a sync: there is nothing to keep)",
    )
    require(
        cfg.dp_quantize in (None, *DP_QUANTIZERS),
        "dp_quantize",
        cfg.dp_quantize,
        f"be None or one of {list(DP_QUANTIZERS)}",
    )
    fast = cfg.num_replicas - int(bool(cfg.anchor))
    require(
        cfg.dp_quantize is None or fast <= 127,
        "dp_quantize",
        cfg.dp_quantize,
        f"be None with {fast} fast replicas (the int8 codes of n replicas sum inside int8 only for n <= 127)",
    )
    require(cfg.dp_outer_lr > 0, "dp_outer_lr", cfg.dp_outer_lr, "be > 0")
    require(0.0 <= cfg.dp_outer_momentum < 1.0, "dp_outer_momentum", cfg.dp_outer_momentum, "lie in [0, 1)")
    require(cfg.dp_timeout_s > 0, "dp_timeout_s", cfg.dp_timeout_s, "be > 0 (seconds)")


def _require_anchor_link(cfg) -> None:
    """What the anchor sends, at what rate (the ``factors`` payload needs a rank)."""
    require(
        cfg.anchor_payload in ANCHOR_PAYLOADS,
        "anchor_payload",
        cfg.anchor_payload,
        f"be one of {list(ANCHOR_PAYLOADS)}",
    )
    require(
        cfg.anchor_rate_mbit is None or cfg.anchor_rate_mbit > 0,
        "anchor_rate_mbit",
        cfg.anchor_rate_mbit,
        "be None or > 0 (Mbit/s)",
    )
    require(
        cfg.anchor_payload != "factors" or cfg.spectral_rank is not None,
        "spectral_rank",
        cfg.spectral_rank,
        "be set with anchor_payload='factors' (the rank r of the factors U_r, s_r, V_r the anchor sends)",
    )


def _require_codec_refit(cfg) -> None:
    """A refit asked for with nothing to refit or no anchor to fit it is refused (it would never happen)."""
    every = cfg.codec_refit_every
    if every is None:
        return
    require(every >= 0, "codec_refit_every", every, "be >= 0")
    if every == 0:
        return
    spec = composed_codec(cfg)
    require(
        spec is not None and spec.needs_fit,
        "codec_refit_every",
        every,
        f"be 0 or None with boundary_codec={cfg.boundary_codec!r} (only a codec with outliers<N> or a projection "
        "fits geometry to refit)",
    )
    require(
        bool(cfg.anchor),
        "codec_refit_every",
        every,
        "be 0 or None when anchor=False (the anchor's dense passes supply the refit; without the anchor the codec "
        "keeps the calibration made at the start)",
    )


def require_mesh_supported(cfg) -> None:
    """The knobs the distributed mesh does not run (yet), refused by every rank before any collective."""
    require(
        cfg.mask_fill in ("zeros", "mean"),
        "mask_fill",
        cfg.mask_fill,
        "be 'zeros' or 'mean' on the distributed mesh (the 'gaussian' fill needs the anchor's dense "
        "activations on every receiving stage, which the mesh does not send)",
    )
    require(
        cfg.mask_protect_dims == 0,
        "mask_protect_dims",
        cfg.mask_protect_dims,
        "be 0 on the distributed mesh (choosing the dims needs a dense forward of the whole model)",
    )
    require(
        not is_governed(cfg) or bool(cfg.anchor),
        "anchor",
        cfg.anchor,
        "be True with boundary_codec='governed' on the distributed mesh (the governor's fidelity probes run on "
        "the anchor replica's pipeline)",
    )
    require(
        cfg.anchor_cadence == "fixed",
        "anchor_cadence",
        cfg.anchor_cadence,
        "be 'fixed' on the distributed mesh (the adaptive cadence runs on one process)",
    )
    require(
        getattr(cfg, "boundary_change_codec", None) is None,
        "boundary_change_codec",
        getattr(cfg, "boundary_change_codec", None),
        "be None on the distributed mesh (change coding runs on one process in this version)",
    )


def _require_governor(cfg) -> None:
    """The governor's and the cadence's knobs; a ladder or cadence bound given for nothing is refused."""
    if not is_governed(cfg):
        require(
            cfg.codec_ladder is None,
            "codec_ladder",
            cfg.codec_ladder,
            "be None unless boundary_codec='governed' (the ladder is what the governor picks from)",
        )
    else:
        codec_ladder(cfg)
    require(
        isinstance(cfg.fidelity_target, (int, float)) and 0.0 < cfg.fidelity_target <= 1.0,
        "fidelity_target",
        cfg.fidelity_target,
        "lie in (0, 1] (a gradient cosine)",
    )
    require(
        isinstance(cfg.fidelity_hysteresis, (int, float)) and 0.0 <= cfg.fidelity_hysteresis < 1.0,
        "fidelity_hysteresis",
        cfg.fidelity_hysteresis,
        "lie in [0, 1)",
    )
    require(cfg.anchor_cadence in CADENCES, "anchor_cadence", cfg.anchor_cadence, f"be one of {list(CADENCES)}")
    _require_optional_positive("anchor_every_min", cfg.anchor_every_min)
    _require_optional_positive("anchor_every_max", cfg.anchor_every_max)
    if cfg.anchor_cadence == "fixed":
        for knob in ("anchor_every_min", "anchor_every_max"):
            require(
                getattr(cfg, knob) is None,
                knob,
                getattr(cfg, knob),
                "be None unless anchor_cadence='adaptive' (a fixed cadence is anchor_every)",
            )
        return
    require(
        bool(cfg.anchor),
        "anchor_cadence",
        cfg.anchor_cadence,
        "be 'fixed' when anchor=False (the adaptive cadence reads the drift of the anchor momentum's subspace)",
    )
    low, high = cadence_bounds(cfg)
    require(low <= high, "anchor_every_max", high, f"be >= anchor_every_min={low}")


def _apply_boundary_codec(cfg) -> None:
    """A mask spec sets mask_ratio and mask_fill; a composed codec refuses the knobs that act on masks."""
    if cfg.boundary_codec is None:
        return
    spec = composed_codec(cfg) if is_governed(cfg) else parse_codec(cfg.boundary_codec)
    assert spec is not None  # a governed boundary_codec has a ladder
    if spec.is_mask:
        cfg.mask_ratio, cfg.mask_fill = spec.mask_ratio, spec.fill
        require_fill(cfg.mask_fill, cfg.mask_rescale)
        return
    from_preset = getattr(cfg, "_boundary_from_preset", False)
    hint = (
        f"; it is preset={cfg.preset!r}'s boundary: give a mask_ratio or preset='paper' for masks"
        if from_preset
        else ""
    )
    for knob, default in (
        ("mask_ratio", 0.0),
        ("mask_fill", "zeros"),
        ("mask_rescale", False),
        ("mask_protect_dims", 0),
    ):
        require(
            getattr(cfg, knob) == default,
            knob,
            getattr(cfg, knob),
            f"stay {default!r} with boundary_codec={cfg.boundary_codec!r} (it acts on masks, and a composed codec "
            f"sends none; outliers<N> is the codec's way to keep the largest dims{hint})",
        )


def _require_optional_positive(name: str, value: int | None) -> None:
    require(value is None or (isinstance(value, int) and value >= 1), name, value, "be None or an int >= 1")
