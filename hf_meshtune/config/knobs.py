"""The knobs: ``MeshArguments``, every field with its help text and the paper's symbol beside its name.

It is mixed into ``MeshConfig`` (a plain dataclass for code that builds the pieces by hand) and into
``MeshTrainingArguments`` (transformers' ``TrainingArguments`` + these fields, which also accepts
``optim="spectral_adamw"``). TRL configs reuse the same mixin: mixed into any ``TrainingArguments``
subclass it accepts our optimizer name and validates the knobs. Validation runs on construction:
the preset first (``presets``), then each field's type (here), then the rules between knobs (``rules``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

from transformers import TrainingArguments

from .._validation import require
from ..topology import MESH_ENV, in_replica_zero_job, launched_stage_layers, launched_stages
from .presets import (
    DEFAULT_DP_POWERSGD_RANK,
    DEFAULT_DP_QUANTIZE,
    DEFAULT_NUM_STAGES,
    GOVERNED_LADDER,
    QUALITY_CODEC,
    SPECTRAL_ADAMW,
    apply_preset,
)
from .rules import require_knob_rules
from .training import prepare_training_arguments

__all__ = ["TIMING_KNOBS", "MeshArguments", "MeshConfig", "MeshTrainingArguments", "require_saved_knobs"]


@dataclass
class MeshArguments:
    """The mesh knobs (docs/design.md, "The four mechanisms"). ``preset`` fills in the boundary and
    the anchor when they are left unset; the other defaults are the paper's unless stated."""

    preset: str = field(
        default="quality",
        metadata={
            "help": "Defaults for the boundary and the anchor when mask_ratio, boundary_codec and anchor are unset: "
            f"'quality' (default) = boundary_codec {QUALITY_CODEC!r} and no anchor (the cheapest codec measured "
            "to keep every metric within 1 percent of Dense), 'paper' = mask_ratio 0.95, zero fill and the anchor "
            "prior (the literal method, which loses most of the fine-tune's gain: docs/guides/concepts.md, 'Presets: "
            "which compression keeps quality')."
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
    stage_layers: list[int] | None = field(
        default=None,
        metadata={
            "help": "Decoder layers per pipeline stage, one count per stage summing to the model's layers (an "
            "uneven split, e.g. `--stage_layers 20 10` for a second host half as fast). None = balanced: sizes "
            "differ by at most one, earlier stages take the extra layer."
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
            "joined by '+' from outliers<N>, pca<r>/spca<r>, rot[<b>] (a seeded randomized Hadamard rotation in "
            "blocks of b, default 64), int<b>[g<G>|x<K>][e8m0][sr] (b in 2,3,4,5,6,8), fp8[g<G>|x<K>][e8m0] "
            "(g: G values per scale, x: K near-equal groups, e8m0: one-byte power-of-two scales); then optionally "
            "'/' and the backward's own [rot+]quantiser (e.g. 'outliers8+rot+int3g64/rot+int4g64sr'), and last a "
            "lossless coder of the bytes, '+zstd' or '+zlib' (e.g. 'outliers8+rot+int4g64e8m0+zstd'); or "
            "'mask<p>[+fill]' (the paper: 'mask0.95'), which sets mask_ratio and mask_fill; or 'governed': the "
            "anchor measures each boundary's fidelity and the governor picks its level of codec_ladder. Only each "
            "row's real tokens cross (up to its last label). None = the preset's (quality: "
            f"{QUALITY_CODEC!r}) or, with a mask_ratio, the mask_* knobs."
        },
    )
    boundary_change_codec: str | None = field(
        default=None,
        metadata={
            "help": "Per-sample change coding (hf_meshtune.boundary.compose.change): a training row seen before with "
            "the same tokens sends, at every boundary, the change of its activation since its last visit in this "
            "codec (no outliers or projection, e.g. 'rot+int2g64e8m0+zstd'); a first visit sends boundary_codec's "
            "message. Both sides keep each row's last reconstruction (change_cache_gb). Needs a composed "
            "boundary_codec and a map-style training dataset (rows keyed by their index); one process. None = off."
        },
    )
    change_cache_gb: float = field(
        default=8.0,
        metadata={
            "help": "boundary_change_codec: the most the change caches of this process may hold (GB); a run whose "
            "training set would need more (rows × real tokens × hidden size × boundaries × dtype bytes) is "
            "refused before it trains."
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
            "separates the codecs that kept SmolLM2 within 1 percent of Dense from those that did not "
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
            prepare_training_arguments(self, parent)
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
        apply_preset(self)
        if self.num_stages is None:  # one source of truth for Y: the mesh this process was launched on
            self.num_stages = launched_stages() or DEFAULT_NUM_STAGES
        self.stage_layers = launched_stage_layers(self.stage_layers)  # type: ignore[assignment]  # a hosts file's split
        _require_field_types(self)
        require_knob_rules(self)

    @property
    def mesh_config(self) -> MeshConfig:
        """The mesh knobs alone, as a ``MeshConfig``."""
        names = [f.name for f in dataclasses.fields(MeshArguments)]
        return MeshConfig(**{name: getattr(self, name) for name in names})


_TYPE_RULES = {"bool": (bool,), "int": (int,), "float": (int, float), "str": (str,), "list[int]": (list, tuple)}


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


@dataclass
class MeshConfig(MeshArguments):
    """The mesh knobs on their own, validated on construction.

    Example:
        >>> MeshConfig(mask_ratio=0.9, num_stages=2).mask_ratio
        0.9
    """


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
