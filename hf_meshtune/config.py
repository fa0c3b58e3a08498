"""Every knob of the method in one validated place.

``MeshArguments`` holds the fields (with help text and the paper's symbol beside each name) and their
validation. It is mixed into ``MeshConfig`` (a plain dataclass for code that builds the pieces by
hand) and into ``MeshTrainingArguments`` (transformers' ``TrainingArguments`` + these fields, which
also accepts ``optim="spectral_adamw"``). TRL configs reuse the same mixin: mixed into any
``TrainingArguments`` subclass it accepts our optimizer name and validates the knobs.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import TrainingArguments
from transformers.training_args import OptimizerNames

from ._validation import require
from .boundary.compose.spec import CodecSpec, parse_codec
from .boundary.fills import require_fill
from .topology import MESH_ENV, in_replica_zero_job, launched_stages

__all__ = [
    "ANCHOR_PAYLOADS",
    "GOVERNED",
    "GOVERNED_LADDER",
    "PRESETS",
    "QUALITY_CODEC",
    "SPECTRAL_ADAMW",
    "MeshArguments",
    "MeshConfig",
    "MeshTrainingArguments",
    "codec_ladder",
    "codec_refit_every",
    "is_governed",
    "require_mesh_supported",
    "require_saved_knobs",
]

SPECTRAL_ADAMW = "spectral_adamw"
# Y when neither the knob nor a launched mesh (MESHTUNE_MESH) says: the paper's four stages
DEFAULT_NUM_STAGES = 4

# What `preset` fills in for the knobs left unset (None): "quality" (the default) = the cheapest boundary
# measured to keep every metric within 1 % of Dense on SmolLM2 (benchmarks/quality: the main job's GSM8K
# eval loss, LoRA arithmetic loss and exact match), "paper" = the literal method (M95, zero fill, anchor
# prior). Knobs given explicitly always win.
QUALITY_CODEC = "outliers8+int8"
# boundary_codec="governed": the anchor measures every boundary's fidelity and the governor picks the
# level of this ladder (cheapest first; x8: eight near-equal scale groups, valid at any width).
GOVERNED = "governed"
GOVERNED_LADDER = "outliers8+int3x8,outliers8+int4x8,outliers8+int8"
CADENCES = ("fixed", "adaptive")
# PowerSGD rank and codes of the DP pseudo-gradients, both presets: on the WAN benchmark's fine-tune
# (benchmarks/wan/dp_sweep.md) float32 rank 4 ended at eval loss 1.45 against Dense's 0.85 and uncompressed
# DiLoCo's 0.90, float32 rank 32 at 0.96; rank 128 in int8 codes (dp.quantize) at 0.92 for float32 rank 32's
# bytes. At Llama-3.2-1B shapes (bf16 gradients in the ledger) DP is 1,160 B/token against float rank 32's 572
# (benchmarks/wan/ledger_1b.md: 9 % of the default's 13,508).
DEFAULT_DP_POWERSGD_RANK = 128
DEFAULT_DP_QUANTIZE = "int8"
PRESETS = {
    "quality": {"boundary_codec": QUALITY_CODEC, "mask_ratio": 0.0, "anchor": False},
    "paper": {"boundary_codec": None, "mask_ratio": 0.95, "anchor": True},
}
ANCHOR_PAYLOADS = ("gradient", "factors")
# A built-in optimizer name that lets TrainingArguments.__post_init__ run for ours (its `optim`
# field is a closed enum): swapped in before and back out after.
_STAND_IN_OPTIM = "adamw_torch"


DP_QUANTIZERS = ("int8",)  # MeshConfig.dp_quantize: how dense pseudo-gradients travel (dp.quantize)
DP_QUANT_BLOCK = 256  # values per shared scale of int8 pseudo-gradients: 4 / 256 bytes per value (1.6 %)


@dataclass
class MeshArguments:
    """The mesh knobs (docs/design.md, "The four mechanisms"). ``preset`` fills in the boundary and
    the anchor when they are left unset; the other defaults are the paper's unless stated."""

    preset: str = field(
        default="quality",
        metadata={
            "help": "Defaults for the boundary and the anchor when mask_ratio, boundary_codec and anchor are unset: "
            f"'quality' (default) = boundary_codec {QUALITY_CODEC!r} and no anchor (the cheapest codec measured "
            "to keep every metric within 1 % of Dense), 'paper' = mask_ratio 0.95, zero fill and the anchor prior "
            "(the literal method, which loses most of the fine-tune's gain: README, 'Which compression keeps "
            "quality')."
        },
    )
    # --- pipeline boundaries (PP compression) ---
    mask_ratio: float | None = field(
        default=None,
        metadata={
            "help": "p: fraction of hidden dims dropped per token at every stage boundary; K = round((1-p)·H) are "
            "kept. None = the preset's (paper: 0.95; quality: no mask, its codec)."
        },
    )
    num_stages: int | None = field(
        default=None,
        metadata={
            "help": "Y: pipeline stages the decoder layers are split into (Y-1 boundaries). None = the mesh's Y "
            f"when launched on one (meshtune launch --mesh XxY sets {MESH_ENV}), else {DEFAULT_NUM_STAGES}."
        },
    )
    mask_seed: int = field(
        default=0, metadata={"help": "Base seed of the shared mask function g(ℓ, step, microbatch, T, H, seed)."}
    )
    mask_rescale: bool = field(
        default=False, metadata={"help": "Scale kept values by H/K (dropout-style); off = the paper's plain h ⊙ m."}
    )
    mask_fill: str = field(
        default="zeros",
        metadata={
            "help": "Receiver-side value of dropped dims: 'zeros' (the paper), 'mean' (running per-dim mean; no extra "
            "traffic) or 'gaussian' (conditional mean given the kept dims, from a covariance the anchor "
            "estimates on its dense passes)."
        },
    )
    mask_protect_dims: int = field(
        default=0,
        metadata={
            "help": "Dims of largest RMS (measured once on a training batch at the start) that every token always "
            "keeps at each boundary; 0 = the paper's uniform mask."
        },
    )
    boundary_codec: str | None = field(
        default=None,
        metadata={
            "help": "What crosses every stage boundary, as one string (hf_meshtune.boundary.compose.spec): stages "
            "joined by '+' from outliers<N>, pca<r>/spca<r>, int<b>[g<G>|x<K>][sr] (b in 2,3,4,8), fp8[g<G>|x<K>] "
            "(g: G values per scale, x: K near-equal groups), e.g. 'outliers8+int4x8'; or 'mask<p>[+fill]' (the "
            "paper: 'mask0.95'), which sets mask_ratio and mask_fill; or 'governed': the anchor measures each "
            "boundary's fidelity and the governor picks its level of codec_ladder. None = the preset's (quality: "
            f"{QUALITY_CODEC!r}) or, with a mask_ratio, the mask_* knobs."
        },
    )
    # --- anchor circuit ---
    anchor: bool | None = field(
        default=None,
        metadata={
            "help": "Run the dense anchor circuit that feeds the spectral filter. None = the preset's "
            "(paper: on, quality: off)."
        },
    )
    anchor_every: int = field(
        default=20, metadata={"help": "Fast steps between anchor snapshots (one dense gradient per snapshot)."}
    )
    anchor_delay: int = field(
        default=20, metadata={"help": "Δ: fast steps between a snapshot and the arrival of its dense gradient."}
    )
    anchor_beta: float = field(default=0.9, metadata={"help": "β_anc: EMA coefficient of the anchor momentum M_anc."})
    anchor_microbatches: int | None = field(
        default=None, metadata={"help": "Microbatches per anchor gradient (default: gradient_accumulation_steps)."}
    )
    anchor_lockstep: bool = field(
        default=False,
        metadata={
            "help": "Mesh: take a snapshot every anchor_every fast steps and apply its dense gradient exactly "
            "anchor_delay steps later, fast replicas waiting for a late one, so runs repeat bit for bit, and resumes "
            "too with anchor_delay 0 (the single-process schedule). False = the paper: apply whatever has arrived, "
            "never wait."
        },
    )
    codec_refit_every: int | None = field(
        default=None,
        metadata={
            "help": "Anchor rounds between refits of a fitted boundary_codec's geometry (outlier dims, PCA bases) "
            "from the anchor's dense activations; both sides of a boundary switch to it at the same fast step "
            "(after the step that applied that round's gradient). 0 = keep the calibration made at the start. "
            "None = 1 when the anchor runs and the codec fits geometry, else 0."
        },
    )
    codec_ladder: str | None = field(
        default=None,
        metadata={
            "help": "boundary_codec='governed': the levels the fidelity governor picks from, cheapest first, as "
            f"comma-separated composed codecs. None = {GOVERNED_LADDER!r}."
        },
    )
    fidelity_target: float = field(
        default=0.96,
        metadata={
            "help": "boundary_codec='governed': the gradient cosine (codec vs dense, measured on the anchor's batch "
            "every round) a boundary's level must keep; the governor picks the cheapest level that does. The default "
            "separates the codecs that kept SmolLM2 within 1 % of Dense from those that did not "
            "(benchmarks/quality/fidelity)."
        },
    )
    fidelity_hysteresis: float = field(
        default=0.01,
        metadata={
            "help": "boundary_codec='governed': margin over fidelity_target a cheaper level must show before the "
            "governor moves down to it (a level near the target does not flap)."
        },
    )
    anchor_cadence: str = field(
        default="fixed",
        metadata={
            "help": "'fixed': an anchor round every anchor_every steps. 'adaptive': the gap halves when the anchor "
            "momentum's subspace moves fast (principal angles between consecutive bases), doubles when it is "
            "still, within [anchor_every_min, anchor_every_max] (needs anchor=True; one process)."
        },
    )
    anchor_every_min: int | None = field(
        default=None, metadata={"help": "anchor_cadence='adaptive': the smallest gap. None = anchor_every // 4."}
    )
    anchor_every_max: int | None = field(
        default=None, metadata={"help": "anchor_cadence='adaptive': the largest gap. None = 4 · anchor_every."}
    )
    anchor_max_staleness: int | None = field(
        default=None,
        metadata={
            "help": "Fast steps a basis stays trusted without a fresh anchor gradient: older deliveries are rejected, "
            "and past it the filter fades to plain AdamW over as many steps again. None = never (the paper)."
        },
    )
    # --- spectral optimizer ---
    spectral_tau: float = field(default=1e-3, metadata={"help": "τ_p: Tikhonov filter d = s/(s+τ)."})
    spectral_relative_tau: bool = field(default=False, metadata={"help": "Use τ·s_max instead of an absolute τ."})
    spectral_alpha: float = field(default=0.3, metadata={"help": "α: G_proj = α·G + (1-α)·G_filt."})
    spectral_rank: int | None = field(
        default=None, metadata={"help": "Rank cap of the anchor basis (randomized SVD); None = full SVD."}
    )
    # --- mesh shape and DP sync (used by the byte ledger on one machine) ---
    num_replicas: int = field(default=8, metadata={"help": "X: data-parallel replicas, the anchor replica included."})
    dp_sync_every: int = field(default=20, metadata={"help": "Inner steps between Streaming DiLoCo outer syncs."})
    dp_powersgd_rank: int | None = field(
        default=DEFAULT_DP_POWERSGD_RANK,
        metadata={"help": "PowerSGD rank of the DP pseudo-gradient; None (or 0, for command lines) = uncompressed."},
    )
    dp_quantize: str | None = field(
        default=DEFAULT_DP_QUANTIZE,
        metadata={
            "help": "'int8': every DP all-reduce (PowerSGD's factors, the tensors that go dense) carries int8 codes "
            "with a shared scale per 256 values, summed in int8 by the ring: a quarter of float32's bytes; the "
            "dense tensors keep error feedback of their own. None (or 'none', for command lines) = float32. "
            "Streaming DiLoCo's sync only: the per-step baselines of RunSettings.dp_mode send float32 gradients."
        },
    )
    dp_fragments: int = field(
        default=1,
        metadata={
            "help": "Streaming DiLoCo fragments per stage, synced at staggered steps (must divide dp_sync_every)."
        },
    )
    dp_sync_delay: int = field(
        default=0,
        metadata={
            "help": "Inner steps a fragment's all-reduce overlaps before its outer step is applied (< dp_sync_every / "
            "dp_fragments)."
        },
    )
    dp_keep_overlapped: bool = field(
        default=False,
        metadata={
            "help": "With dp_sync_delay > 0: keep the inner steps a fragment's sync overlapped, adding them on top of "
            "the new θ_global (False: torchft's way, the fragment restarts from θ_global and they are lost)."
        },
    )
    dp_outer_lr: float = field(
        default=0.7,
        metadata={"help": "Learning rate of the outer Nesterov SGD applied to the averaged pseudo-gradient."},
    )
    dp_outer_momentum: float = field(default=0.9, metadata={"help": "Nesterov momentum of the outer optimizer."})
    dp_timeout_s: float = field(
        default=60.0,
        metadata={
            "help": "Mesh: seconds a DP quorum or all-reduce may wait for the other replicas before it gives up on "
            "them (the survivors then go on without them). A cut link is noticed only after this long: lower "
            "it for shorter pauses on lossy links, raise it for slow ones."
        },
    )
    anchor_payload: str = field(
        default="gradient",
        metadata={"help": "What the anchor sends: the 'gradient' or its momentum's rank-r 'factors'."},
    )
    anchor_rate_mbit: float | None = field(
        default=None,
        metadata={
            "help": "Mesh: a cap in Mbit/s on each pair of the anchor link, each way (the anchor's deliveries to "
            "a fast stage, fast replica 0's updates to the anchor): payloads go in 64 KiB chunks spaced to this "
            "rate, so no delivery lands on a fast node's link as one burst ahead of its pipeline and DP traffic. "
            "None = no cap."
        },
    )
    max_memory_per_stage: float | None = field(
        default=None,
        metadata={
            "help": "Mesh: GiB one process may hold (the memory ledger's predicted total for its role and stage: "
            "weights, gradients, optimizer, anchor, DP and codec state, activations; the Python runtime not "
            "included). A stage predicted over it fails the start on every rank, naming its parts. None = no check."
        },
    )

    @property
    def should_save(self) -> bool:
        """TrainingArguments' rule; and when every replica is a job of its own (``MESHTUNE_REPLICA``, see
        ``hf_meshtune.topology``) only replica 0's first process writes, as one process does in one world."""
        return super().should_save and in_replica_zero_job()  # type: ignore[misc]

    def __post_init__(self) -> None:
        parent = getattr(super(), "__post_init__", None)
        if isinstance(self, TrainingArguments):  # also TRL's configs: accept our optimizer name
            _require_gloo_backend(self)
            _bind_mesh_servers()
            _post_init_with_spectral_optim(self, parent)
        elif parent is not None:
            parent()
        self.validate_mesh()
        if isinstance(self, TrainingArguments) and self.anchor:
            require(
                self.optim == SPECTRAL_ADAMW,
                "optim",
                getattr(self.optim, "value", self.optim),
                f"be '{SPECTRAL_ADAMW}' when anchor=True (the anchor's gradients feed its spectral filter); set "
                "anchor=False for another optimizer",
            )

    def validate_mesh(self) -> None:
        """Raise ``ValueError`` naming the field, its value and the rule for any bad knob."""
        if self.dp_powersgd_rank == 0:  # command lines cannot say None
            self.dp_powersgd_rank = None
        if self.dp_quantize == "none":
            self.dp_quantize = None
        _apply_preset(self)
        if self.num_stages is None:  # one source of truth for Y: the mesh this process was launched on
            self.num_stages = launched_stages() or DEFAULT_NUM_STAGES
        _require_field_types(self)
        require(0.0 <= self.mask_ratio < 1.0, "mask_ratio", self.mask_ratio, "lie in [0, 1)")
        require(self.num_stages >= 1, "num_stages", self.num_stages, "be >= 1")
        require_fill(self.mask_fill, self.mask_rescale)
        require(self.mask_protect_dims >= 0, "mask_protect_dims", self.mask_protect_dims, "be >= 0")
        _apply_boundary_codec(self)
        require(self.anchor_every >= 1, "anchor_every", self.anchor_every, "be >= 1")
        require(self.anchor_delay >= 0, "anchor_delay", self.anchor_delay, "be >= 0")
        require(0.0 <= self.anchor_beta <= 1.0, "anchor_beta", self.anchor_beta, "lie in [0, 1]")
        _require_optional_positive("anchor_microbatches", self.anchor_microbatches)
        _require_optional_positive("anchor_max_staleness", self.anchor_max_staleness)
        _require_codec_refit(self)
        _require_governor(self)
        require(self.spectral_tau > 0, "spectral_tau", self.spectral_tau, "be > 0")
        require(0.0 <= self.spectral_alpha <= 1.0, "spectral_alpha", self.spectral_alpha, "lie in [0, 1]")
        _require_optional_positive("spectral_rank", self.spectral_rank)
        require(self.num_replicas >= 1, "num_replicas", self.num_replicas, "be >= 1")
        if self.anchor:
            require(
                self.num_replicas >= 2,
                "num_replicas",
                self.num_replicas,
                "be >= 2 when anchor=True (one replica is the anchor)",
            )
        require(self.dp_sync_every >= 1, "dp_sync_every", self.dp_sync_every, "be >= 1")
        _require_optional_positive("dp_powersgd_rank", self.dp_powersgd_rank)
        require(
            self.max_memory_per_stage is None or self.max_memory_per_stage > 0,
            "max_memory_per_stage",
            self.max_memory_per_stage,
            "be None or > 0 (GiB)",
        )
        require(
            isinstance(self.dp_fragments, int) and self.dp_fragments >= 1,
            "dp_fragments",
            self.dp_fragments,
            "be an int >= 1",
        )
        require(
            self.dp_sync_every % self.dp_fragments == 0,
            "dp_fragments",
            self.dp_fragments,
            f"divide dp_sync_every={self.dp_sync_every} (one fragment syncs every dp_sync_every / dp_fragments steps)",
        )
        interval = self.dp_sync_every // self.dp_fragments
        require(
            isinstance(self.dp_sync_delay, int) and 0 <= self.dp_sync_delay < interval,
            "dp_sync_delay",
            self.dp_sync_delay,
            f"lie in [0, dp_sync_every / dp_fragments = {interval}) (a fragment's sync must land before the next one "
            "starts)",
        )
        require(
            not self.dp_keep_overlapped or self.dp_sync_delay > 0,
            "dp_keep_overlapped",
            self.dp_keep_overlapped,
            "be False when dp_sync_delay=0 (no inner step overlaps a sync: there is nothing to keep)",
        )
        require(
            self.dp_quantize in (None, *DP_QUANTIZERS),
            "dp_quantize",
            self.dp_quantize,
            f"be None or one of {list(DP_QUANTIZERS)}",
        )
        fast = self.num_replicas - int(bool(self.anchor))
        require(
            self.dp_quantize is None or fast <= 127,
            "dp_quantize",
            self.dp_quantize,
            f"be None with {fast} fast replicas (the int8 codes of n replicas sum inside int8 only for n <= 127)",
        )
        require(self.dp_outer_lr > 0, "dp_outer_lr", self.dp_outer_lr, "be > 0")
        require(0.0 <= self.dp_outer_momentum < 1.0, "dp_outer_momentum", self.dp_outer_momentum, "lie in [0, 1)")
        require(self.dp_timeout_s > 0, "dp_timeout_s", self.dp_timeout_s, "be > 0 (seconds)")
        require(
            self.anchor_payload in ANCHOR_PAYLOADS,
            "anchor_payload",
            self.anchor_payload,
            f"be one of {list(ANCHOR_PAYLOADS)}",
        )
        require(
            self.anchor_rate_mbit is None or self.anchor_rate_mbit > 0,
            "anchor_rate_mbit",
            self.anchor_rate_mbit,
            "be None or > 0 (Mbit/s)",
        )
        require(
            self.anchor_payload != "factors" or self.spectral_rank is not None,
            "spectral_rank",
            self.spectral_rank,
            "be set with anchor_payload='factors' (the rank r of the factors U_r, s_r, V_r the anchor sends)",
        )

    @property
    def mesh_config(self) -> MeshConfig:
        """The mesh knobs alone, as a ``MeshConfig``."""
        names = [f.name for f in dataclasses.fields(MeshArguments)]
        return MeshConfig(**{name: getattr(self, name) for name in names})


_TYPE_RULES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,)}


def _require_field_types(args: MeshArguments) -> None:
    """Each knob has its declared type (a str "0.5" or a float 2.5 for an int would slip through the
    range checks, or fail inside them with a bare TypeError); an int is fine where a float is due."""
    for name, annotation in _FIELD_TYPES.items():
        kinds = annotation.replace(" ", "").split("|")
        value = getattr(args, name)
        if value is None and "None" in kinds:
            continue
        allowed = tuple(t for kind in kinds for t in _TYPE_RULES.get(kind, ()))
        is_bool = isinstance(value, bool)
        ok = isinstance(value, allowed) and (not is_bool or bool in allowed)
        require(ok, name, value, f"be of type {' or '.join(kinds)}")


# The annotations as written ("float", "int | None"), taken now: HfArgumentParser later replaces the
# fields' string annotations with type objects in place.
_FIELD_TYPES = {f.name: str(f.type) for f in dataclasses.fields(MeshArguments)}
_FIELD_DEFAULTS = {f.name: f.default for f in dataclasses.fields(MeshArguments)}


# Knobs that only say how long to wait: a resumed run may change them (they do not shape its numerics)
TIMING_KNOBS = frozenset({"dp_timeout_s"})


def require_saved_knobs(
    saved: dict, config: MeshArguments, knobs: Sequence[str] | None = None, context: str = "to resume exactly"
) -> None:
    """A resumed run uses the knobs it was saved with (``knobs``, default every one that shapes its numerics:
    not ``TIMING_KNOBS``). A knob a checkpoint predates counts at its default (what the run did before the knob
    existed)."""
    current = dataclasses.asdict(config)
    for knob in [k for k in current if k not in TIMING_KNOBS] if knobs is None else knobs:
        value = saved[knob] if knob in saved else _FIELD_DEFAULTS.get(knob)
        require(
            value == current[knob],
            knob,
            current[knob],
            f"equal the checkpoint's value {value!r} {context} (start a new run to change it)",
        )


def codec_refit_every(cfg) -> int:
    """Anchor rounds between refits of the codec's geometry: ``codec_refit_every``, or when unset 1 with
    the anchor and a codec that fits geometry, else 0 (never)."""
    every = getattr(cfg, "codec_refit_every", None)
    if every is not None:
        return every
    spec = composed_codec(cfg)
    return 1 if getattr(cfg, "anchor", False) and spec is not None and spec.needs_fit else 0


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


def _apply_preset(cfg) -> None:
    """Fill in the unset boundary and anchor knobs from ``preset`` (idempotent: once filled, they are set).

    The boundary: a mask ratio or a codec given explicitly is kept (and the other comes from it); with
    neither, the preset's boundary. The anchor: the preset's unless given.
    """
    require(isinstance(cfg.preset, str) and cfg.preset in PRESETS, "preset", cfg.preset, f"be one of {list(PRESETS)}")
    chosen = PRESETS[cfg.preset]
    if cfg.mask_ratio is None:
        if cfg.boundary_codec is None:
            cfg.boundary_codec = chosen["boundary_codec"]
            cfg.mask_ratio = chosen["mask_ratio"]
            cfg._boundary_from_preset = True  # for the errors that follow: the user did not name this codec
        else:  # a composed codec sends no mask; a mask spec sets mask_ratio itself (_apply_boundary_codec)
            cfg.mask_ratio = 0.0
    if cfg.anchor is None:
        cfg.anchor = chosen["anchor"]


def composed_codec(cfg) -> CodecSpec | None:
    """The composed codec the knobs name (``boundary_codec`` other than a mask spec), else None. Governed:
    the ladder's richest level (what a boundary can cost at most)."""
    text = getattr(cfg, "boundary_codec", None)
    if text is None:
        return None
    if text == GOVERNED:
        return codec_ladder(cfg)[-1]
    spec = parse_codec(text)
    return None if spec.is_mask else spec


def is_governed(cfg) -> bool:
    """Whether the fidelity governor picks each boundary's codec (``boundary_codec="governed"``)."""
    return getattr(cfg, "boundary_codec", None) == GOVERNED


def codec_ladder(cfg) -> list[CodecSpec]:
    """The governed ladder's levels, cheapest first (``codec_ladder`` or ``GOVERNED_LADDER``)."""
    text = getattr(cfg, "codec_ladder", None) or GOVERNED_LADDER
    require(isinstance(text, str), "codec_ladder", text, "be a comma-separated string of composed codecs")
    levels = [part.strip() for part in text.split(",")]
    specs = []
    for level in levels:
        require(bool(level), "codec_ladder", text, "name a codec between every two commas")
        try:
            spec = parse_codec(level)
        except ValueError as err:
            raise ValueError(
                f"codec_ladder={text!r} is invalid: it must hold valid codecs (level {level!r}: {err})"
            ) from err
        require(not spec.is_mask, "codec_ladder", text, f"hold composed codecs only ({level!r} is a mask)")
        specs.append(spec)
    require(len(specs) >= 2, "codec_ladder", text, "name at least two levels for the governor to choose from")
    require(len(set(levels)) == len(levels), "codec_ladder", text, "name every level once")
    return specs


def require_ladder_order(cfg, hidden_size: int) -> None:
    """The governed ladder must get dearer level by level at this model's width (bf16 bytes per token)."""
    ladder = codec_ladder(cfg)
    sizes = [spec.payload_bytes(hidden_size, 2) for spec in ladder]
    require(
        all(a < b for a, b in zip(sizes, sizes[1:])),
        "codec_ladder",
        cfg.codec_ladder or GOVERNED_LADDER,
        f"list levels cheapest first, each dearer than the one before (bf16 bytes per token at H={hidden_size}: "
        f"{sizes})",
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


def cadence_bounds(cfg) -> tuple[int, int]:
    """[min, max] gap of the adaptive cadence (defaults: anchor_every // 4 and 4 · anchor_every)."""
    low = cfg.anchor_every_min if cfg.anchor_every_min is not None else max(1, cfg.anchor_every // 4)
    high = cfg.anchor_every_max if cfg.anchor_every_max is not None else 4 * cfg.anchor_every
    return low, high


def _apply_boundary_codec(cfg) -> None:
    """A mask spec sets mask_ratio and mask_fill; a composed codec refuses the knobs that act on masks."""
    if cfg.boundary_codec is None:
        return
    spec = composed_codec(cfg) if is_governed(cfg) else parse_codec(cfg.boundary_codec)
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


@dataclass
class MeshConfig(MeshArguments):
    """The mesh knobs on their own, validated on construction.

    Example:
        >>> MeshConfig(mask_ratio=0.9, num_stages=2).mask_ratio
        0.9
    """


def _post_init_with_spectral_optim(args: TrainingArguments, parent_post_init) -> None:
    """Run ``TrainingArguments.__post_init__`` on args whose ``optim`` may be ``"spectral_adamw"``.

    transformers validates ``optim`` against its closed ``OptimizerNames`` enum there; a built-in
    name stands in for ours during that call and ours is put back after.
    """
    optim = getattr(args.optim, "value", args.optim)
    known = {name.value for name in OptimizerNames}
    require(
        optim == SPECTRAL_ADAMW or optim in known,
        "optim",
        optim,
        f"be '{SPECTRAL_ADAMW}' or one of transformers' OptimizerNames",
    )
    if optim != SPECTRAL_ADAMW:
        parent_post_init()
        return
    args.optim = _STAND_IN_OPTIM
    try:
        parent_post_init()
    finally:
        args.optim = SPECTRAL_ADAMW


def _require_gloo_backend(args) -> None:
    """The mesh's process group is gloo's, on GPUs too: in a launched process (LOCAL_RANK set, where
    accelerate would create an NCCL group on a GPU machine) ``ddp_backend`` unset becomes ``"gloo"``;
    any other backend is refused. Gloo runs over any TCP link, across the internet, and the mesh stages
    GPU tensors through CPU memory for its point-to-point sends."""
    if args.ddp_backend is None and int(os.environ.get("LOCAL_RANK", "-1")) != -1:
        args.ddp_backend = "gloo"
    require(
        args.ddp_backend in (None, "gloo"),
        "ddp_backend",
        args.ddp_backend,
        "be 'gloo' or unset: every link of the mesh (pipeline boundaries, DiLoCo syncs, the anchor) runs on "
        "gloo, over any TCP link, with GPU tensors staged through CPU memory; NCCL needs one fabric",
    )


def _bind_mesh_servers() -> None:
    """In a launched process, before accelerate creates its process group: with a secret, admission at
    the mesh's gate and a guard on every listener (``comm.gate``); gloo on ``$MESHTUNE_HOST``'s
    interface, and rank 0's rendezvous store on MASTER_ADDR only (``comm.listen``)."""
    if int(os.environ.get("LOCAL_RANK", "-1")) == -1:
        return
    from .comm.gate import guard_launched_process
    from .comm.listen import gloo_interface, serve_rendezvous_store

    guard = guard_launched_process()
    gloo_interface()
    serve_rendezvous_store()
    if guard is not None:
        guard.scan()


@dataclass
class MeshTrainingArguments(MeshArguments, TrainingArguments):
    """``TrainingArguments`` plus the mesh knobs; ``optim`` defaults to ``"spectral_adamw"``.

    Example:
        >>> args = MeshTrainingArguments(output_dir="out", mask_ratio=0.95, num_stages=4)  # doctest: +SKIP
        >>> args.optim                                                                     # doctest: +SKIP
        'spectral_adamw'
    """

    optim: str = field(
        default=SPECTRAL_ADAMW,
        metadata={
            "help": f"Optimizer: '{SPECTRAL_ADAMW}' (the anchor-filtered AdamW) or any transformers optimizer name."
        },
    )
