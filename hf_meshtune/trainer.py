"""``MeshTrainer``: a drop-in ``transformers.Trainer`` that trains with the mesh's numerics on one machine.

The mesh logic lives in ``MeshTrainerMixin`` so that TRL trainers can reuse it unchanged:
- masked boundaries are attached to the model with hooks (names and checkpoints unchanged);
- ``optim="spectral_adamw"`` builds a ``SpectralAdamW``;
- an ``AnchorCircuit`` computes dense gradients of snapshots every ``anchor_every`` steps and hands
  them to the optimizer ``anchor_delay`` steps later;
- the logs carry the byte ledger (``comm/*_bytes_per_token``), the spectral diagnostics and the
  anchor staleness; checkpoints carry the mesh state so that a resumed run continues exactly.
"""

from __future__ import annotations

import os
import shutil
from typing import TYPE_CHECKING, cast

import torch
from torch import nn
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import rotate_checkpoints

from ._validation import require
from .anchor.batches import AnchorBatches
from .anchor.circuit import AnchorCircuit
from .boundary.compose.handle import ComposedHandle
from .boundary.hooks import BoundaryHandle
from .config import SPECTRAL_ADAMW, MeshArguments, MeshConfig
from .engine import MeshEngine
from .ledger import Ledger
from .model_card import mesh_card_section, write_mesh_card
from .optim.spectral import SpectralAdamW, spectral_options
from .pipeline.placement import stage_of
from .row_ids import ROW_ID, RowIdCollator, RowIds, require_cache_budget, require_row_ids
from .runtime.checkpoint import atomic_torch_save, load_torch_file
from .runtime.evaluation import evaluate_on_mesh
from .runtime.job import MeshRun, is_distributed_job, train_on_mesh, validate_mesh_job
from .runtime.saving import save_stage_shards
from .topology import in_replica_zero_job

__all__ = ["CHECKPOINT_STAGING", "MESH_STATE_NAME", "MeshCallback", "MeshTrainer", "MeshTrainerMixin"]

MESH_STATE_NAME = "mesh_state.pt"
# Checkpoints are written here, then renamed to checkpoint-N: a process killed mid-save leaves the
# previous checkpoints intact and no half-written checkpoint-N for resume_from_checkpoint=True to pick.
CHECKPOINT_STAGING = ".meshtune-staging"


class MeshCallback(TrainerCallback):
    """Moves the mask clock at each step and runs the anchor just before each optimizer step."""

    def __init__(self, trainer: MeshTrainerMixin) -> None:
        self.trainer = trainer

    def on_train_begin(self, args, state, control, **kwargs):
        self.trainer._set_up_masks()

    def on_step_begin(self, args, state, control, **kwargs):
        self.trainer.mesh_engine.begin_step(state.global_step)

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        optimizer = self.trainer.spectral_optimizer
        if optimizer is not None:  # the filter's cosines cost five reductions a matrix: only for logged steps
            optimizer.diagnostics = logs_after_step(args, state, state.global_step + 1)
        self.trainer.mesh_engine.before_optimizer_step(state.global_step, optimizer)


def logs_after_step(args, state, step: int) -> bool:
    """Whether the Trainer logs after optimizer step ``step`` by its own rule (``DefaultFlowCallback``); True
    when the strategy cannot tell in advance (per epoch). A callback that forces a log on another step gets
    it without ``spectral/*`` keys."""
    strategy = str(getattr(args.logging_strategy, "value", args.logging_strategy))
    if strategy == "no":
        return False
    if strategy != "steps":
        return True
    every = state.logging_steps or args.logging_steps
    return (step == 1 and bool(args.logging_first_step)) or (bool(every) and step % every == 0)


if TYPE_CHECKING:  # the mixin's methods run on a Trainer: let the type checker see its attributes
    _TrainerBase = Trainer
else:
    _TrainerBase = object


class MeshTrainerMixin(_TrainerBase):
    """Mesh behaviour for any ``transformers.Trainer`` subclass whose args are ``MeshArguments``: a
    ``MeshEngine`` driven by ``MeshCallback``, the optimizer name, logs, checkpoints and the mesh run."""

    mesh_engine: MeshEngine
    mesh_run: MeshRun  # set by a mesh run (runtime.job.train_on_mesh); absent before one

    @property
    def mesh_boundaries(self) -> BoundaryHandle | ComposedHandle:
        return self.mesh_engine.boundaries

    @property
    def mesh_anchor(self) -> AnchorCircuit | None:
        return self.mesh_engine.anchor

    def is_world_process_zero(self) -> bool:
        """The Trainer's rule; in replica jobs (``MESHTUNE_REPLICA``) only replica 0's first process."""
        return super().is_world_process_zero() and in_replica_zero_job()

    # --- set-up -------------------------------------------------------------------------------
    # Whether ``train()`` runs the distributed X·Y mesh when launched on several processes.
    _mesh_runs_distributed = True

    def _validate_mesh_job_early(self, model, args) -> None:
        """Before the Trainer's own set-up: an impossible launched job fails on every rank, before any rendezvous."""
        if not is_distributed_job() or model is None or not isinstance(args, MeshArguments):
            return
        require(
            self._mesh_runs_distributed,
            "WORLD_SIZE",
            os.environ.get("WORLD_SIZE"),
            f"be 1 for {type(self).__name__}: it trains on one process (the distributed X×Y mesh runs "
            "supervised objectives: MeshTrainer, MeshSFTTrainer)",
        )
        if not isinstance(model, str):
            validate_mesh_job(model, args)

    def _setup_mesh(self) -> None:
        require(
            isinstance(self.args, MeshArguments),
            "args",
            type(self.args).__name__,
            "be a MeshTrainingArguments (or another MeshArguments config) for a Mesh trainer",
        )
        assert isinstance(self.args, MeshArguments) and self.model is not None  # the Trainer built the model
        _check_peft_for_spectral(self.model, self.args)
        self.mesh_engine = MeshEngine(self.model, self.args)
        self.add_callback(MeshCallback(self))

    @property
    def mesh_config(self) -> MeshConfig:
        return cast(MeshArguments, self.args).mesh_config  # required by _setup_mesh

    @property
    def spectral_optimizer(self) -> SpectralAdamW | None:
        """The ``SpectralAdamW`` behind accelerate's optimizer wrapper, if that is the optimizer."""
        optimizer = getattr(self.optimizer, "optimizer", self.optimizer)
        return optimizer if isinstance(optimizer, SpectralAdamW) else None

    @staticmethod
    def get_optimizer_cls_and_kwargs(args, model=None):
        if getattr(args, "optim", None) != SPECTRAL_ADAMW:
            return Trainer.get_optimizer_cls_and_kwargs(args, model)
        return SpectralAdamW, {
            "lr": args.learning_rate,
            "betas": (args.adam_beta1, args.adam_beta2),
            "eps": args.adam_epsilon,
            "overwrite_grads": True,  # the Trainer zeroes the gradients right after each optimizer step
            **spectral_options(args),
        }

    def create_optimizer(self, model=None):
        optimizer = super().create_optimizer(model)
        if self.mesh_engine.needs_anchor_circuit and self.mesh_anchor is None:
            self._build_anchor()
        return optimizer

    def _build_anchor(self) -> AnchorCircuit:
        assert self.model is not None  # the Trainer built it
        params = {name: p for name, p in self.model.named_parameters() if p.requires_grad and p.ndim == 2}
        if not self.mesh_config.anchor:  # the governor's circuit: it feeds no optimizer
            return self.mesh_engine.build_anchor(params, self._anchor_batches(), self._anchor_loss)
        if self.spectral_optimizer is None and self.args.optim == SPECTRAL_ADAMW:  # optimizers=(opt, sched) given
            require(
                False,
                "optimizers[0]",
                type(getattr(self.optimizer, "optimizer", self.optimizer)).__name__,
                "be a SpectralAdamW when anchor=True (the anchor's gradients feed its spectral filter); "
                "pass none (optim='spectral_adamw' builds one) or set anchor=False",
            )
        require(
            self.spectral_optimizer is not None,
            "optim",
            self.args.optim,
            f"be '{SPECTRAL_ADAMW}' when anchor=True (the anchor's gradients feed its spectral filter)",
        )
        return self.mesh_engine.build_anchor(params, self._anchor_batches(), self._anchor_loss)

    def _anchor_batches(self, microbatches: int | None = None) -> AnchorBatches:
        dataset, collate = self.train_dataset, self.data_collator
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description="anchor")
        else:
            collate = self._get_collator_with_removed_columns(collate, description="anchor")
        microbatches = microbatches or self.mesh_config.anchor_microbatches or self.args.gradient_accumulation_steps
        return AnchorBatches(
            dataset,
            collate,
            self.args.per_device_train_batch_size,
            microbatches,
            self.args.data_seed if self.args.data_seed is not None else self.args.seed,
            self._prepare_inputs,
        )

    def _set_up_masks(self) -> None:
        """Protected dims and a first Gaussian-fill estimate on a fixed training batch, unless restored."""
        self.mesh_engine.set_up_masks(lambda: self._anchor_batches(microbatches=1)(0)[0])

    def _anchor_loss(self, model: nn.Module, batch) -> torch.Tensor:
        return cast(torch.Tensor, self.compute_loss(model, batch))  # a tuple only with return_outputs=True

    # --- change coding: every training row keeps its index (row_ids) ----------------------------------
    def _get_dataloader(
        self, dataset, description, batch_size, sampler_fn=None, is_training=False, dataloader_key=None
    ):
        keyed = {"dataloader_key": dataloader_key}
        if not (is_training and self.mesh_config.boundary_change_codec is not None):
            return super()._get_dataloader(dataset, description, batch_size, sampler_fn, is_training, **keyed)
        boundaries = self.mesh_boundaries
        require_row_ids(dataset)
        if hasattr(dataset, "column_names"):
            dataset = self._remove_unused_columns(dataset, description=description)
        dtype = next(self.model.parameters()).dtype  # type: ignore[union-attr]
        require_cache_budget(dataset, boundaries.hidden_size, len(boundaries.boundary_layers),
                             torch.empty((), dtype=dtype).element_size(), self.mesh_config.change_cache_gb)  # fmt: skip
        self._set_signature_columns_if_needed()
        columns: list[str] = list(self._signature_columns or [])
        self._signature_columns = columns if ROW_ID in columns else [*columns, ROW_ID]  # type: ignore[assignment]
        plain, self.data_collator = self.data_collator, RowIdCollator(self.data_collator)
        try:
            return super()._get_dataloader(RowIds(dataset), description, batch_size, sampler_fn, is_training, **keyed)
        finally:
            self.data_collator = plain

    def compute_loss(self, model, inputs, *args, **kwargs):
        if ROW_ID in inputs:  # a training batch of a change-coded run: its rows' ids go to the boundaries
            boundaries = self.mesh_boundaries
            assert isinstance(boundaries, ComposedHandle)  # boundary_change_codec needs a composed codec
            boundaries.set_rows(inputs[ROW_ID])
            inputs = {k: v for k, v in inputs.items() if k != ROW_ID}
        return super().compute_loss(model, inputs, *args, **kwargs)

    # --- training -----------------------------------------------------------------------------
    def train(self, resume_from_checkpoint=None, *args, **kwargs):
        """The Trainer's loop on one process; the distributed mesh when launched on several."""
        if not is_distributed_job():
            return super().train(resume_from_checkpoint, *args, **kwargs)
        return train_on_mesh(self, resume_from_checkpoint)

    def _move_model_to_device(self, model, device):
        """A model that holds one mesh stage (``pipeline.placement``) moves only the tensors it holds."""
        if stage_of(model) is None:
            return super()._move_model_to_device(model, device)
        for module in model.modules():
            for store in (module._parameters, module._buffers):
                for tensor in store.values():
                    if tensor is not None and not tensor.is_meta:
                        tensor.data = tensor.data.to(device)
        return None

    def _on_mesh_stage(self) -> bool:
        """True after a mesh run, where this process holds one stage of the model."""
        return getattr(self, "mesh_run", None) is not None and stage_of(self.model) is not None

    def evaluate(self, eval_dataset=None, ignore_keys=None, metric_key_prefix: str = "eval"):
        """The Trainer's evaluation; after a mesh run, the dense pipeline of the stages
        (``runtime.evaluation``), the same metrics on every process."""
        if not self._on_mesh_stage():
            return super().evaluate(eval_dataset, ignore_keys, metric_key_prefix)
        if self.mesh_run.left_out:
            return {}
        return evaluate_on_mesh(self, eval_dataset, metric_key_prefix)

    # --- logs ---------------------------------------------------------------------------------
    def log(self, logs: dict[str, float], start_time: float | None = None) -> None:
        if "loss" in logs:
            logs.update(self.mesh_log_entries())
        super().log(logs, start_time)

    def mesh_log_entries(self) -> dict[str, float]:
        """Byte ledger, spectral diagnostics and anchor staleness since the last training log."""
        return self.mesh_engine.log_entries(self.state.global_step, self.spectral_optimizer)

    def mesh_ledger(self, tokens_per_step: int | None = None) -> Ledger:
        """The analytic ledger of this model and mesh at ``tokens_per_step`` tokens per fast replica (None: the
        real tokens per step the last log measured); a codec's coder at the ratios the last log measured."""
        return self.mesh_engine.measured_ledger(tokens_per_step)

    # --- checkpoints --------------------------------------------------------------------------
    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """The Trainer's save, plus a model card naming the mesh settings (``model_card.py``). After a
        mesh run each stage writes its own shard of a normal sharded checkpoint (``runtime.saving``); a
        PEFT adapter is written whole by PEFT on rank 0."""
        if self._on_mesh_stage() and getattr(self.model, "peft_config", None) is None:
            if self.mesh_run.left_out:
                return
            output_dir = output_dir or self.args.output_dir
            assert output_dir is not None  # TrainingArguments fills in its default
            save_stage_shards(self, self.mesh_run.groups, output_dir, self.mesh_run.survivors)
            if self.args.should_save:
                self.write_model_card(output_dir)
            return
        super().save_model(output_dir, _internal_call)
        if self.args.should_save:
            card_dir = output_dir or self.args.output_dir
            assert card_dir is not None  # TrainingArguments fills in its default
            self.write_model_card(card_dir)

    def write_model_card(self, output_dir: str) -> str:
        """Add the "Trained with hf_meshtune" section to ``output_dir/README.md``."""
        engine = getattr(self, "mesh_engine", None)
        hidden = engine.boundaries.hidden_size if engine is not None else None
        # the ledger at the run's own tokens per step, as last logged
        logged = [e for e in self.state.log_history if "comm/total_bytes_per_token" in e]
        ledger = (
            {
                k.removeprefix("comm/").removesuffix("_bytes_per_token"): v
                for k, v in logged[-1].items()
                if k.startswith("comm/") and k.endswith("bytes_per_token") and "measured" not in k
            }
            if logged
            else None
        )
        config = getattr(self.model, "config", None)
        base = getattr(config, "_name_or_path", None) or None
        section = mesh_card_section(self.mesh_config, hidden, type(self).__name__, ledger)
        return write_mesh_card(output_dir, section, base_model=base if base and not os.path.isdir(base) else None)

    def _save_checkpoint(self, model, trial) -> None:
        """The Trainer's checkpoint, written in ``CHECKPOINT_STAGING`` and renamed into place whole."""
        run_dir = super()._get_output_dir(trial)
        name = f"checkpoint-{self.state.global_step}"
        staging = os.path.join(run_dir, CHECKPOINT_STAGING)
        if self.args.should_save:
            shutil.rmtree(staging, ignore_errors=True)  # what a killed save left behind
        self._mesh_staging_dir: str | None = staging
        try:
            super()._save_checkpoint(model, trial)
        finally:
            self._mesh_staging_dir = None
        if self.args.should_save:
            self._publish_checkpoint(run_dir, staging, name)

    def _publish_checkpoint(self, run_dir: str, staging: str, name: str) -> None:
        final = os.path.join(run_dir, name)
        if os.path.isdir(final):  # the same step saved again
            shutil.rmtree(final)
        os.replace(os.path.join(staging, name), final)  # atomic on one filesystem
        shutil.rmtree(staging, ignore_errors=True)
        best = self.state.best_model_checkpoint
        if best and best.startswith(staging):  # the Trainer saw the staged path: point at the real one
            self.state.best_model_checkpoint = os.path.join(run_dir, os.path.basename(best))
            self.state.save_to_json(os.path.join(final, "trainer_state.json"))
        rotate_checkpoints(
            output_dir=run_dir,
            save_total_limit=self.args.save_total_limit,
            best_model_checkpoint=self.state.best_model_checkpoint,
            use_mtime=True,
        )

    def _get_output_dir(self, trial) -> str:
        return getattr(self, "_mesh_staging_dir", None) or super()._get_output_dir(trial)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            atomic_torch_save(self.mesh_state_dict(), os.path.join(output_dir, MESH_STATE_NAME))

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        super()._load_optimizer_and_scheduler(checkpoint)
        if checkpoint is None:
            return
        path = os.path.join(checkpoint, MESH_STATE_NAME)
        require(
            os.path.isfile(path),
            "resume_from_checkpoint",
            checkpoint,
            f"contain {MESH_STATE_NAME} (written by a Mesh trainer) to resume a mesh run exactly",
        )
        self.load_mesh_state_dict(_read_mesh_state(path))

    def mesh_state_dict(self) -> dict:
        """``mesh_state.pt``: the engine's state (knobs, boundary fills, anchor gradients in flight)."""
        return self.mesh_engine.state_dict()

    def load_mesh_state_dict(self, state: dict) -> None:
        self.mesh_engine.load_state_dict(state, self.state.global_step)


# PEFT methods whose trainable weights are matrices [out, r] / [r, in] that the spectral filter can
# act on. Others train vectors or scalings (IA3), virtual tokens (prompt learning), … .
SPECTRAL_PEFT_TYPES = ("LORA",)


def _check_peft_for_spectral(model, args) -> None:
    """``optim="spectral_adamw"`` filters weight matrices: refuse PEFT methods that train none."""
    configs = getattr(model, "peft_config", None)
    if not isinstance(configs, dict) or getattr(args, "optim", None) != SPECTRAL_ADAMW:
        return
    for name, config in configs.items():
        kind = str(getattr(config.peft_type, "value", config.peft_type))
        require(
            kind in SPECTRAL_PEFT_TYPES,
            f"peft_config[{name!r}].peft_type",
            kind,
            f"be one of {list(SPECTRAL_PEFT_TYPES)} with optim='{SPECTRAL_ADAMW}' (the spectral filter acts on "
            "weight matrices such as lora_A [r, in] and lora_B [out, r]); use another optim with anchor=False",
        )


def _read_mesh_state(path: str) -> dict:
    """``mesh_state.pt``, or a ValueError naming the file when it is truncated, empty or foreign."""
    state = load_torch_file(path, MESH_STATE_NAME, "a Mesh trainer")
    keys = {"config", "boundaries", "anchor"}
    require(
        isinstance(state, dict) and keys <= set(state),
        MESH_STATE_NAME,
        path,
        f"hold a dict with keys {sorted(keys)} as a Mesh trainer writes it",
    )
    return state


class MeshTrainer(MeshTrainerMixin, Trainer):
    """``transformers.Trainer`` with masked pipeline boundaries, the anchor circuit and SpectralAdamW.

    Swap ``Trainer`` for ``MeshTrainer`` and ``TrainingArguments`` for ``MeshTrainingArguments``;
    ``peft_config=`` wraps the model in a PEFT adapter as TRL's trainers do; everything else (gradient
    accumulation, evaluation, callbacks, ``report_to``, checkpoints and resume) is the Trainer's own.
    Evaluation and generation run the dense model.

    Example:
        >>> from hf_meshtune import MeshTrainer, MeshTrainingArguments
        >>> args = MeshTrainingArguments("out", mask_ratio=0.95, num_stages=4, anchor_every=20,
        ...                              anchor_delay=20, max_steps=100)          # doctest: +SKIP
        >>> trainer = MeshTrainer(model=model, args=args, train_dataset=train)    # doctest: +SKIP
        >>> trainer.train()                                                       # doctest: +SKIP
    """

    def __init__(self, model=None, args=None, *positional, peft_config=None, **kwargs) -> None:
        if peft_config is not None:  # as TRL's trainers do: wrap the model in the adapter first
            require(
                model is not None and not isinstance(model, str),
                "model",
                type(model).__name__,
                "be a loaded PreTrainedModel when peft_config is given",
            )
            from peft import get_peft_model  # optional dependency (the [trl] extra)

            model = get_peft_model(model, peft_config)
        self._validate_mesh_job_early(model, args)
        super().__init__(model, args, *positional, **kwargs)
        self._setup_mesh()
