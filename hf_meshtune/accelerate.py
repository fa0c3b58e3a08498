"""The mesh's numerics in your own Accelerate loop: ``MeshPlugin`` + ``MeshAccelerator``.

accelerate's ``kwargs_handlers`` take only accelerate's own classes, so the plugin comes with an
``Accelerator`` subclass. ``MeshAccelerator.prepare`` does what ``MeshTrainer`` does at set-up:

- masked boundaries on the model (forward hooks: K = round((1-p)·H) of H dims per token cross each
  of the Y-1 boundaries; parameter names and checkpoints unchanged);
- the user's ``torch.optim.AdamW``/``Adam`` becomes a ``SpectralAdamW`` over the same param groups
  (same lr, betas, eps, weight_decay; LR schedulers built on it are moved over), so the optimizer
  accelerate hands back wraps it;
- an ``AnchorCircuit`` whose dense gradients G_anc of parameter snapshots, taken every
  ``anchor_every`` optimizer steps on the anchor's own batches, reach the optimizer Δ steps later.

The loop itself does not change: step hooks on the optimizer drive the mesh. Before each real
optimizer step the anchor runs (snapshot if due, deliveries if due); after it the mask clock moves
to the next step. accelerate's optimizer wrapper only steps on sync steps, so under
``accelerator.accumulate(model)`` the clock counts optimizer steps and the k-th training forward
inside one is microbatch k, as in ``MeshTrainer`` and on the distributed pipeline.

Several processes (``accelerate launch`` with WORLD_SIZE > 1) run plain accelerate DDP around the
masked model: every process draws the same masks from (step, microbatch) and computes the same anchor
gradient. The X×Y distributed mesh (compact pipeline, DiLoCo, an anchor replica) is reached through
``MeshTrainer``.
"""

from __future__ import annotations

import dataclasses
import os
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from accelerate import Accelerator
from accelerate.utils import DistributedType, send_to_device
from torch import nn
from torch.utils.data import DataLoader, IterableDataset

from ._validation import require
from .anchor.batches import AnchorBatches
from .anchor.circuit import AnchorCircuit
from .boundary.compose.handle import ComposedHandle
from .boundary.hooks import BoundaryHandle, find_decoder_layers
from .config import MeshArguments, composed_codec
from .engine import MeshEngine
from .ledger import Ledger
from .optim.replace import move_schedulers, spectral_adamw_like
from .optim.spectral import SpectralAdamW
from .plugin_env import ENV_PREFIX, FROM_ENV, env_backed, env_field, parse_env_value

__all__ = ["ENV_PREFIX", "MeshAccelerator", "MeshPlugin"]


@dataclass
@env_backed
class MeshPlugin(MeshArguments):
    """The mesh knobs for ``MeshAccelerator``: ``MeshArguments``' fields, defaults from the environment.

    Every knob (``mask_ratio`` (p), ``num_stages`` (Y), ``anchor_delay`` (Δ), ``anchor_beta`` (β_anc),
    ``spectral_tau`` (τ_p), ``spectral_alpha`` (α), …; see ``config.MeshArguments``) that is not
    passed takes ``$MESHTUNE_<FIELD>`` (``MESHTUNE_MASK_RATIO=0.9``, ``MESHTUNE_ANCHOR=false``,
    ``MESHTUNE_SPECTRAL_RANK=none``) when that variable is set and not empty, else the library
    default. Explicit arguments win, ``None`` included. Values are validated like ``MeshConfig``'s;
    a bad value from the environment names its variable.

    Plugin-only fields:
        anchor_seed: seed of the anchor's own sampler (``AnchorBatches``: a hash-seeded permutation,
            independent of the training DataLoader's sampler and of torch's RNG).
        anchor_loss_fn: ``(model, batch) → scalar loss`` of the anchor's dense pass; default
            ``model(**batch).loss``.

    Example:
        >>> from hf_meshtune.accelerate import MeshAccelerator, MeshPlugin
        >>> plugin = MeshPlugin(mask_ratio=0.95, num_stages=4, anchor_every=20, anchor_delay=20)
        >>> plugin.num_stages, plugin.anchor_delay
        (4, 20)
        >>> accelerator = MeshAccelerator(mesh_plugin=plugin)          # doctest: +SKIP
    """

    anchor_seed: int = env_field(
        0, "Seed of the anchor's own sampler (AnchorBatches), independent of the training loader's."
    )
    anchor_loss_fn: Callable[[nn.Module, Mapping[str, torch.Tensor]], torch.Tensor] | None = field(
        default=None, metadata={"help": "(model, batch) → loss of the anchor's dense pass; None = model(**batch).loss."}
    )

    def __post_init__(self) -> None:
        from_env = self._resolve_defaults()
        try:
            super().__post_init__()
            require(
                isinstance(self.anchor_seed, int) and not isinstance(self.anchor_seed, bool),
                "anchor_seed",
                self.anchor_seed,
                "be an int",
            )
            require(
                self.anchor_loss_fn is None or callable(self.anchor_loss_fn),
                "anchor_loss_fn",
                self.anchor_loss_fn,
                "be None or a callable (model, batch) → loss",
            )
        except ValueError as error:
            knob = str(error).split("=", 1)[0]
            if knob not in from_env:
                raise
            raise ValueError(f"{error} (the value came from ${from_env[knob]})") from None

    @staticmethod
    def env_var(name: str) -> str:
        """The environment variable that sets field ``name``: ``MESHTUNE_<NAME>``."""
        return ENV_PREFIX + name.upper()

    def _resolve_defaults(self) -> dict[str, str]:
        """Fill every field not passed from its variable, else the library default; returns field → variable read."""
        kinds = typing.get_type_hints(type(self))
        from_env = {}
        for f in dataclasses.fields(self):
            if getattr(self, f.name) is not FROM_ENV:
                continue
            name, text = self.env_var(f.name), os.environ.get(self.env_var(f.name), "")
            if text.strip():
                setattr(self, f.name, parse_env_value(name, text, kinds[f.name]))
                from_env[f.name] = name
            else:
                setattr(self, f.name, f.metadata["library_default"])
        return from_env


def _model_loss(model: nn.Module, batch: Mapping[str, torch.Tensor]) -> torch.Tensor:
    return model(**batch).loss


def _unique(objects: Sequence[Any], kind: type) -> list:
    """The objects of type ``kind`` in order, each once (the same object may be passed twice)."""
    found: list = []
    for obj in objects:
        if isinstance(obj, kind) and all(obj is not seen for seen in found):
            found.append(obj)
    return found


class MeshAccelerator(Accelerator):
    """``accelerate.Accelerator`` whose ``prepare`` puts the model, optimizer and loader on the mesh.

    Masked boundaries (p, Y), SpectralAdamW (α, τ_p, β_anc) and the anchor circuit (every
    ``anchor_every`` steps, Δ = ``anchor_delay``) are set from ``mesh_plugin`` (None: a
    ``MeshPlugin()`` from the environment). The first ``prepare`` call that holds a model sets the
    mesh up; it must hold the model's one optimizer and, with ``anchor=True``, its training
    ``DataLoader`` (the first one passed) over a map-style dataset, which the anchor draws its own
    batches from. Later calls (evaluation loaders, a reference model) are plain accelerate.

    With ``anchor=True`` the optimizer must be ``torch.optim.AdamW``/``Adam`` (replaced) or a
    ``SpectralAdamW`` (kept); with ``anchor=False`` any optimizer is kept and only drives the clock.
    After ``prepare``: ``mesh_boundaries`` (``BoundaryHandle``), ``mesh_anchor`` (``AnchorCircuit``
    or None), ``spectral_optimizer`` (or None), ``mesh_step`` (optimizer steps taken) and
    ``mesh_log_entries()``; ``log({"loss": ...})`` adds those entries, as ``MeshTrainer`` does.
    ``save_state``/``load_state`` carry the mesh state (clock, pending anchor gradients, fills).
    Single device or DDP; DeepSpeed, FSDP and Megatron-LM are refused. On several processes this is
    data parallelism around the masked model; the X×Y mesh runs through ``MeshTrainer``.

    Example:
        >>> from hf_meshtune.accelerate import MeshAccelerator as Accelerator, MeshPlugin
        >>> accelerator = Accelerator(mesh_plugin=MeshPlugin(mask_ratio=0.95, num_stages=4))   # doctest: +SKIP
        >>> model, optimizer, loader, scheduler = accelerator.prepare(
        ...     model, optimizer, loader, scheduler)                                                # doctest: +SKIP
        >>> for batch in loader:                                                                # doctest: +SKIP
        ...     with accelerator.accumulate(model):
        ...         accelerator.backward(model(**batch).loss)
        ...         optimizer.step(); scheduler.step(); optimizer.zero_grad()
    """

    def __init__(self, *args, mesh_plugin: MeshPlugin | None = None, **kwargs) -> None:
        plugin = (
            MeshPlugin() if mesh_plugin is None else mesh_plugin
        )  # a bad environment fails before accelerate starts
        require(isinstance(plugin, MeshPlugin), "mesh_plugin", type(plugin).__name__, "be a MeshPlugin (or None)")
        super().__init__(*args, **kwargs)
        self.mesh_plugin = plugin
        self.mesh_engine: MeshEngine | None = None
        self.spectral_optimizer: SpectralAdamW | None = None
        self.mesh_step = 0
        self._mesh_hooks: list = []

    @property
    def mesh_boundaries(self) -> BoundaryHandle | ComposedHandle | None:
        return None if self.mesh_engine is None else self.mesh_engine.boundaries

    @property
    def mesh_anchor(self) -> AnchorCircuit | None:
        return None if self.mesh_engine is None else self.mesh_engine.anchor

    @property
    def _engine(self) -> MeshEngine:
        """``mesh_engine`` where ``prepare`` has built it: the step hooks and the saved state use it only then."""
        assert self.mesh_engine is not None
        return self.mesh_engine

    # --- set-up -------------------------------------------------------------------------------
    def prepare(self, *args, device_placement=None):
        """accelerate's ``prepare``, with the mesh set up on the first call that holds a model.

        Returns the objects in the order given, the optimizer being accelerate's wrapper around the
        ``SpectralAdamW`` that replaced a torch AdamW/Adam.
        """
        if self.mesh_engine is not None or not any(isinstance(obj, nn.Module) for obj in args):
            return super().prepare(*args, device_placement=device_placement)
        model, optimizer, loader = self._training_objects(args)
        mesh_optimizer = self._mesh_optimizer(optimizer)
        engine = MeshEngine(model, self.mesh_plugin)
        try:
            if engine.needs_anchor_circuit:
                self._build_anchor(engine, mesh_optimizer, loader)
            if mesh_optimizer is not optimizer:
                move_schedulers(args, optimizer, mesh_optimizer)
                args = tuple(mesh_optimizer if obj is optimizer else obj for obj in args)
            result = super().prepare(*args, device_placement=device_placement)
        except BaseException:
            engine.remove()
            raise
        if mesh_optimizer is not optimizer:
            # a scheduler left out of prepare() still holds the old optimizer: hand it the SpectralAdamW's
            # groups (as placed by accelerate, which rebuilds them) so its lr changes reach the real optimizer
            optimizer.param_groups = mesh_optimizer.param_groups
        self.mesh_engine = engine
        self.spectral_optimizer = mesh_optimizer if isinstance(mesh_optimizer, SpectralAdamW) else None
        self._wire_clock(mesh_optimizer)
        engine.set_up_masks(lambda: self._anchor_batches(loader, microbatches=1)(0)[0])
        self.register_for_checkpointing(_MeshState(self))
        return result

    def _training_objects(self, args: Sequence[Any]) -> tuple[nn.Module, torch.optim.Optimizer, DataLoader | None]:
        """(model, its optimizer, the first DataLoader or None), validated before anything changes."""
        require(
            self.distributed_type not in (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.MEGATRON_LM),
            "distributed_type",
            str(self.distributed_type),
            "be a single device or DDP for MeshAccelerator (the spectral filter needs whole matrices); "
            "the distributed mesh runs through MeshTrainer",
        )
        modules = _unique(args, nn.Module)
        optimizers = _unique(args, torch.optim.Optimizer)
        loaders = _unique(args, DataLoader)
        require(
            len(optimizers) == 1,
            "optimizers passed with the model",
            len(optimizers),
            "be exactly 1 in the first prepare() call that holds the model (its steps drive the mask clock and the "
            "anchor)",
        )
        optimizer = optimizers[0]
        model = modules[0] if len(modules) == 1 else self._model_of(modules, optimizer)
        find_decoder_layers(model)  # a model without a decoder-layer list fails here, naming its class
        plugin = self.mesh_plugin
        needs = [
            why
            for why, wanted in (
                ("anchor=True", plugin.anchor),
                ("mask_protect_dims > 0", plugin.mask_protect_dims > 0),
                ("mask_fill='gaussian'", plugin.mask_fill == "gaussian"),
                (f"boundary_codec={plugin.boundary_codec!r}", _codec_needs_fit(plugin)),
            )
            if wanted
        ]
        if needs:
            require(
                bool(loaders),
                "DataLoader",
                None,
                f"be passed to the same prepare() call as the model when {needs[0]} (the mesh draws its own "
                "batches from the training loader's dataset); pass the training DataLoader there",
            )
        return model, optimizer, (loaders[0] if loaders else None)

    @staticmethod
    def _model_of(modules: Sequence[nn.Module], optimizer: torch.optim.Optimizer) -> nn.Module:
        trained = {id(p) for group in optimizer.param_groups for p in group["params"]}
        owners = [m for m in modules if any(id(p) in trained for p in m.parameters())]
        require(
            len(owners) == 1,
            "models holding the optimizer's parameters",
            len(owners),
            "be exactly 1 (the model that trains on the mesh)",
        )
        return owners[0]

    def _mesh_optimizer(self, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """The optimizer to prepare: the user's, or a SpectralAdamW in place of a torch Adam/AdamW."""
        if not self.mesh_plugin.anchor or isinstance(optimizer, SpectralAdamW):
            return optimizer
        require(
            isinstance(optimizer, (torch.optim.AdamW, torch.optim.Adam)),
            "optimizer",
            type(optimizer).__name__,
            "be torch.optim.AdamW or Adam (replaced by SpectralAdamW) or a SpectralAdamW when anchor=True "
            "(the anchor's gradients feed SpectralAdamW's spectral filter); set anchor=False to keep another optimizer",
        )
        return spectral_adamw_like(optimizer, self.mesh_plugin)

    def _anchor_batches(self, loader: DataLoader | None, microbatches: int) -> AnchorBatches:
        """The anchor's own batches: same dataset, collate_fn and batch size as the training loader
        (``_training_objects`` has made sure there is one whenever these are needed)."""
        assert loader is not None
        dataset = loader.dataset
        require(
            not isinstance(dataset, IterableDataset) and hasattr(dataset, "__getitem__"),
            "train DataLoader dataset",
            type(dataset).__name__,
            "be map-style (__len__ and __getitem__) so the anchor can draw its own batches; "
            "use anchor=False with an iterable dataset",
        )
        batch_size = loader.batch_size or getattr(loader.batch_sampler, "batch_size", None)
        require(
            isinstance(batch_size, int) and batch_size >= 1,
            "train DataLoader batch_size",
            batch_size,
            "be a positive int (the anchor draws batches of the same size)",
        )
        assert isinstance(batch_size, int)
        return AnchorBatches(
            dataset,
            loader.collate_fn,
            batch_size,
            microbatches,
            self.mesh_plugin.anchor_seed,
            prepare=lambda batch: send_to_device(batch, self.device),
        )

    def _build_anchor(
        self, engine: MeshEngine, optimizer: torch.optim.Optimizer, loader: DataLoader | None
    ) -> AnchorCircuit:
        """The anchor on the trainable matrices the optimizer holds (the ones its filter acts on)."""
        plugin = self.mesh_plugin
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        params = {
            name: p for name, p in engine.model.named_parameters() if p.requires_grad and p.ndim == 2 and id(p) in held
        }
        batches = self._anchor_batches(loader, plugin.anchor_microbatches or self.gradient_accumulation_steps)
        return engine.build_anchor(params, batches, plugin.anchor_loss_fn or _model_loss)

    # --- the clock: optimizer step hooks ------------------------------------------------------
    def _wire_clock(self, optimizer: torch.optim.Optimizer) -> None:
        """Anchor before, clock after every real optimizer step; the loop calls nothing of ours."""
        self._mesh_hooks = [
            optimizer.register_step_pre_hook(self._before_optimizer_step),
            optimizer.register_step_post_hook(self._after_optimizer_step),
        ]
        self._engine.begin_step(self.mesh_step)

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self._engine.before_optimizer_step(self.mesh_step, optimizer)

    def _after_optimizer_step(self, optimizer: torch.optim.Optimizer, args, kwargs) -> None:
        self.mesh_step += 1
        self._engine.begin_step(self.mesh_step)

    # --- logs ---------------------------------------------------------------------------------
    def log(self, values: dict, step: int | None = None, log_kwargs: dict | None = None) -> None:
        """accelerate's ``log``; a training line (one with ``"loss"``) gains the mesh entries, in place."""
        if "loss" in values:
            values.update({k: v for k, v in self.mesh_log_entries().items() if k not in values})
        super().log(values, step=step, log_kwargs=log_kwargs)

    def mesh_log_entries(self) -> dict[str, float]:
        """``MeshTrainer``'s log keys since the last call: ``comm/*`` (analytic ledger of the whole
        mesh at this run's tokens per step, and what this process's boundaries produced),
        ``spectral/*`` (cosines of G and G_proj with M_anc, mean d) and ``anchor/staleness_steps``."""
        if self.mesh_engine is None:
            return {}
        return self.mesh_engine.log_entries(self.mesh_step, self.spectral_optimizer)

    def mesh_ledger(self, tokens_per_step: int | None = None) -> Ledger:
        """The analytic ledger of this model and the plugin's mesh at ``tokens_per_step`` tokens per fast replica
        (None: the real tokens per step the last log measured); a codec's coder at the ratios it measured."""
        return self._engine.measured_ledger(tokens_per_step)


class _MeshState:
    """What ``save_state`` must keep for an exact resume beyond model and optimizer: the clock, the
    boundaries' fill state and the anchor gradients in flight (the optimizer carries M_anc and U, d, V)."""

    def __init__(self, accelerator: MeshAccelerator) -> None:
        self.accelerator = accelerator

    def state_dict(self) -> dict:
        acc = self.accelerator
        return {"step": acc.mesh_step, **acc._engine.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        acc = self.accelerator
        acc._engine.load_state_dict(state, state["step"])
        acc.mesh_step = state["step"]


def _codec_needs_fit(plugin) -> bool:
    """A composed codec whose geometry (outlier dims, a basis) is fitted on a training batch."""
    codec = composed_codec(plugin)
    return codec is not None and codec.needs_fit
