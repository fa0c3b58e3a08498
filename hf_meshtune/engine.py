"""The single-process mesh, wired once for every entry point: ``MeshTrainer`` (and the TRL trainers)
drive it from Trainer callbacks, ``MeshAccelerator`` from optimizer step hooks.

``MeshEngine`` owns what the method adds to a training loop on one process:
- masked boundaries on the model (forward hooks; names and checkpoints unchanged);
- the mask clock: ``begin_step(step)`` starts optimizer step ``step``, every training forward after
  it is the next microbatch (what the distributed pipeline sees for the same data);
- the ``AnchorCircuit``: before every optimizer step, a dense snapshot gradient if one is due, and the
  gradients whose delay Δ has passed go into ``SpectralAdamW``'s anchor momentum;
- the log entries (``comm/*`` ledger and measured boundary bytes, ``spectral/*``, ``anchor/*``) and the
  state an exact resume needs (boundary fills and protected dims, anchor gradients in flight).
One step, for any loop: ``begin_step(t)`` → forwards/backwards → ``before_optimizer_step(t, opt)`` →
``opt.step()``. See ``docs/design.md`` for the data flow.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import torch
from torch import nn

from ._hf_typing import hf_config
from ._validation import require
from .anchor.batches import AnchorBatches
from .anchor.circuit import AnchorCircuit
from .anchor.governor import AnchorCadence, FidelityGovernor
from .boundary.compose.change import change_spec
from .boundary.compose.handle import ComposedHandle, attach_composed
from .boundary.hooks import BoundaryHandle, attach_boundaries
from .config import (
    MeshArguments,
    cadence_bounds,
    codec_ladder,
    codec_refit_every,
    composed_codec,
    is_governed,
    require_ladder_order,
    require_saved_knobs,
)
from .ledger import Ledger, compute_ledger, measured_ratios, param_shapes_of, settings_from_knobs
from .optim.factors import anchor_momentum
from .optim.spectral import SpectralAdamW

__all__ = ["RESUME_KNOBS", "MeshEngine"]

# Knobs that change the numerics of a run: a resumed run must use the values it was saved with.
RESUME_KNOBS = (
    "mask_ratio",
    "num_stages",
    "mask_seed",
    "mask_rescale",
    "mask_fill",
    "mask_protect_dims",
    "boundary_codec",
    "boundary_change_codec",
    "anchor",
    "anchor_every",
    "anchor_delay",
    "anchor_beta",
    "anchor_microbatches",
    "anchor_max_staleness",
    "codec_refit_every",
    "codec_ladder",
    "fidelity_target",
    "fidelity_hysteresis",
    "anchor_cadence",
    "anchor_every_min",
    "anchor_every_max",
    "spectral_tau",
    "spectral_relative_tau",
    "spectral_alpha",
    "spectral_rank",
)


class MeshEngine:
    """Boundaries, anchor, mask clock, logs and resume state of one process (see the module docstring).

    Args:
        model: the model being trained (any HF causal LM, also behind a PEFT wrapper).
        config: the mesh knobs (``MeshArguments``: p, Y, seed, fill, anchor settings, …).
    """

    def __init__(self, model: nn.Module, config: MeshArguments) -> None:
        self.model, self.config = model, config
        codec = composed_codec(config)
        ladder = None
        if is_governed(config):
            ladder = codec_ladder(config)
            hidden = hf_config(model).get_text_config().hidden_size
            require_ladder_order(config, hidden)
        assert config.num_stages is not None and config.mask_ratio is not None  # resolved by __post_init__
        change = change_spec(config.boundary_change_codec) if config.boundary_change_codec is not None else None
        self.boundaries: BoundaryHandle | ComposedHandle = (
            attach_composed(
                model,
                config.num_stages,
                codec,
                config.mask_seed,
                ladder=ladder,
                change=change,
                stage_layers=config.stage_layers,
            )
            if codec is not None
            else attach_boundaries(
                model,
                config.num_stages,
                config.mask_ratio,
                config.mask_seed,
                config.mask_rescale,
                config.mask_fill,
                stage_layers=config.stage_layers,
            )
        )
        self.anchor: AnchorCircuit | None = None
        self._steps_logged = 0
        self._visits_logged = {"first": 0, "revisit": 0}  # change coding: the visits counted by the last log
        # what the last log measured: real tokens per step and the coder's (forward, backward) ratios
        self.measured_tokens_per_step: int | None = None
        self.measured_coding_ratios: tuple[float, float] | None = None

    # --- set-up -------------------------------------------------------------------------------
    def build_anchor(
        self,
        params: Mapping[str, nn.Parameter],
        batches: AnchorBatches | Callable,
        loss_fn: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor],
    ) -> AnchorCircuit:
        """The anchor circuit on ``params`` (the matrices the spectral filter acts on), drawing its own
        ``batches``; governed, it also measures fidelity and picks the boundaries' levels (and runs for that
        alone when ``anchor=False``: its gradients then reach no optimizer)."""
        cfg = self.config
        governor = cadence = None
        if is_governed(cfg):
            governor = FidelityGovernor(len(codec_ladder(cfg)), cfg.fidelity_target, cfg.fidelity_hysteresis)
        if cfg.anchor_cadence == "adaptive":
            cadence = AnchorCadence(*cadence_bounds(cfg))
        self.anchor = AnchorCircuit(
            self.model,
            params,
            self.boundaries,
            cfg.anchor_every,
            cfg.anchor_delay,
            batches,
            loss_fn,
            refit_every=codec_refit_every(cfg),
            governor=governor,
            cadence=cadence,
            feed=bool(cfg.anchor),
            factors=anchor_momentum(cfg),
        )
        return self.anchor

    @property
    def needs_anchor_circuit(self) -> bool:
        """Whether the anchor circuit runs: for the spectral prior (``anchor``), the governor, or both."""
        return bool(self.config.anchor) or is_governed(self.config)

    def set_up_masks(self, first_batch: Callable[[], dict]) -> None:
        """Before training: the protected dims and a first Gaussian-fill estimate on one training batch
        (``first_batch()``, drawn only when needed), or a composed codec's geometry (a calibration pass on
        that batch), unless a checkpoint restored them."""
        cfg = self.config
        if isinstance(self.boundaries, ComposedHandle):
            self.boundaries.set_up(self.model, first_batch)
            return
        self.boundaries.set_up_masks(self.model, first_batch, cfg.mask_protect_dims, cfg.mask_fill)

    # --- one step -------------------------------------------------------------------------------
    def begin_step(self, step: int) -> None:
        """Optimizer step ``step`` starts: the next training forward is its microbatch 0."""
        self.boundaries.set_step(step)

    def before_optimizer_step(self, step: int, optimizer: torch.optim.Optimizer | None) -> None:
        """Just before optimizer step ``step``: an anchor snapshot if due, then the deliveries that are due."""
        if self.anchor is not None:
            with torch.enable_grad():  # the dense snapshot gradient, even if step() runs under no_grad
                self.anchor.on_step(step, optimizer)

    # --- logs -----------------------------------------------------------------------------------
    def log_entries(self, step: int, optimizer: SpectralAdamW | None) -> dict[str, float]:
        """The mesh's log keys since the last call (at optimizer step ``step``): ``comm/*`` (the analytic
        ledger of the whole mesh at this run's tokens per step, and what this process's boundaries
        produced), ``spectral/*`` and ``anchor/staleness_steps``."""
        steps = max(step - self._steps_logged, 1)
        self._steps_logged = step
        entries: dict[str, float] = {}
        counter = self.boundaries.counter
        if counter.tokens:
            # Measured: frozen layers below a boundary mean no backward payload there, so pp_bwd can be lower.
            coded, uncoded = counter.fwd_bytes + counter.bwd_bytes, counter.fwd_uncoded + counter.bwd_uncoded
            ratio = uncoded / coded if coded and coded != uncoded else None  # a coder ends the codec: measured
            ratios = None if ratio is None else measured_ratios(counter.fwd_uncoded, counter.fwd_bytes,
                                                                counter.bwd_uncoded, counter.bwd_bytes)  # fmt: skip
            held = self.measured_coding_ratios
            if ratios is not None and held is not None and not counter.fwd_uncoded:  # every row a revisit
                ratios = (held[0], ratios[1])  # the boundary codec's forward ratio stays the last one measured
            self.measured_tokens_per_step, self.measured_coding_ratios = max(counter.tokens // steps, 1), ratios
            entries.update(self.ledger(self.measured_tokens_per_step, ratios).log_dict())
            if self.boundaries.boundary_layers:
                entries["comm/measured_pp_fwd_bytes_per_token"] = counter.fwd_bytes / counter.tokens
                entries["comm/measured_pp_bwd_bytes_per_token"] = counter.bwd_bytes / counter.tokens
                if ratio is not None:
                    entries["comm/pp_coding_ratio"] = ratio
                entries.update(self._change_entries(counter.tokens))
            counter.reset()
        if optimizer is not None:
            entries.update(getattr(optimizer, "last_diagnostics", {}) or {})
        if self.anchor is not None and self.anchor.last_staleness is not None:
            entries["anchor/staleness_steps"] = float(self.anchor.last_staleness)
        if self.anchor is not None and self.anchor.refit_every:
            entries["anchor/codec_refits"] = float(self.anchor.refits)
        if self.anchor is not None and self.anchor.governor is not None:
            entries.update(self.anchor.fidelity)  # the newest round's measurement, once
            self.anchor.fidelity = {}
            assert isinstance(self.boundaries, ComposedHandle) and self.boundaries.levels is not None  # governed
            for boundary, level in enumerate(self.boundaries.levels):
                entries[f"governor/b{boundary}/level"] = float(level)
        if self.anchor is not None and self.anchor.cadence is not None:
            entries["anchor/gap"] = float(self.anchor.gap)
            if self.anchor.last_drift is not None:
                entries["anchor/drift"] = float(self.anchor.last_drift)
        return entries

    def _change_entries(self, tokens: int) -> dict[str, float]:
        """Change coding since the last log: the revisits' change messages are part of the measured forward
        bytes (``comm/measured_pp_fwd_bytes_per_token``: first visits' boundary-codec messages + changes), and
        ``change/*`` says how much of it they were; the ledger (``comm/pp_*``) stays that of the boundary codec
        alone, the bytes of a run that revisits nothing."""
        handle = self.boundaries
        if not isinstance(handle, ComposedHandle) or handle.changes is None:
            return {}
        changes, visits = handle.change_counter, handle.visits
        seen = self._visits_logged
        first, revisit = visits["first"] - seen["first"], visits["revisit"] - seen["revisit"]
        self._visits_logged = dict(visits)
        entries = {
            "comm/measured_pp_fwd_bytes_per_token": (handle.counter.fwd_bytes + changes.fwd_bytes) / tokens,
            "change/fwd_bytes_per_token": changes.fwd_bytes / tokens,
            "change/revisit_fraction": revisit / max(first + revisit, 1),
            "change/cache_bytes": float(handle.cache_bytes),
        }
        changes.reset()
        return entries

    def ledger(self, tokens_per_step: int, coding_ratio: tuple[float, float] | None = None) -> Ledger:
        """The analytic ledger of this model on the mesh the knobs describe, at ``tokens_per_step`` per fast
        replica (with a coder, its records over ``coding_ratio``, as measured on the run)."""
        cfg = self.config
        dtype = str(next(self.model.parameters()).dtype).removeprefix("torch.")
        settings = settings_from_knobs(cfg, dtype=dtype, tokens_per_step=tokens_per_step, coding_ratio=coding_ratio)
        return compute_ledger(param_shapes_of(self.model), self.boundaries.hidden_size, settings)

    def measured_ledger(self, tokens_per_step: int | None = None) -> Ledger:
        """``ledger`` at ``tokens_per_step`` (None: the real tokens per step the last log measured), a codec's
        coder at the ratios the last log measured."""
        tokens = tokens_per_step if tokens_per_step is not None else self.measured_tokens_per_step
        require(
            tokens is not None,
            "tokens_per_step",
            tokens_per_step,
            "be given before a training log has measured the real tokens per step",
        )
        assert tokens is not None
        return self.ledger(tokens, self.measured_coding_ratios)

    # --- state ----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The knobs, the boundaries' fill state and protected dims, and the anchor gradients in flight
        (the optimizer's own state carries the anchor momentum and its cached bases)."""
        return {
            "config": dataclasses.asdict(self.config.mesh_config),
            "boundaries": self.boundaries.state_dict(),
            "anchor": None if self.anchor is None else self.anchor.state_dict(),
        }

    def load_state_dict(self, state: dict, step: int) -> None:
        """Restore ``state_dict()``'s state of a run resumed at optimizer step ``step`` (same knobs)."""
        require_saved_knobs(state["config"], self.config.mesh_config, RESUME_KNOBS)
        self.boundaries.load_state_dict(state["boundaries"])
        if self.anchor is not None and state["anchor"] is not None:
            self.anchor.load_state_dict(state["anchor"])
        self._steps_logged = step  # the first log after a resume covers the steps since the resume
        if isinstance(self.boundaries, ComposedHandle):
            self._visits_logged = dict(self.boundaries.visits)

    def remove(self) -> None:
        """Detach the boundaries: the model is the plain dense model again."""
        self.boundaries.remove()
