"""TRL trainers on the mesh: ``MeshSFTTrainer`` and ``MeshGRPOTrainer`` (GSPO included).

Each is TRL's own trainer with ``MeshTrainerMixin`` in front (the mixin ``MeshTrainer`` uses) and a
config that is TRL's config plus the mesh knobs (``MeshArguments``), so ``optim="spectral_adamw"``
and every flag of ``SFTConfig`` / ``GRPOConfig`` parse with ``HfArgumentParser``. No training loop
is copied: TRL runs its loop, the mixin moves the mask clock, runs the anchor before each optimizer
step and logs the byte ledger.

What is masked in RL: only the policy's training forward/backward (train mode with autograd on).
Generation, the reference model's log-probs, the old-policy log-probs and the reward functions all
run under ``no_grad`` and therefore see the dense model. Two consequences are enforced here:

- TRL must not compute π_old in a separate (dense) forward: that happens when
  ``gradient_accumulation_steps`` is not a multiple of ``steps_per_generation · num_iterations``,
  and the ratio π_θ/π_old would then measure the mask, not the update. Such configs are refused
  when ``mask_ratio > 0``; with the defaults π_old is the detached masked forward itself.
- The anchor's data in RL are rollouts, not prompts: each anchor round takes the dense gradient of
  the GRPO/GSPO loss on the rollouts the fast circuit is training on (the current generation batch).

GSPO (Zheng et al., 2025) is GRPO with sequence-level importance ratios:
``MeshGRPOConfig(importance_sampling_level="sequence", loss_type="grpo")``, i.e. ``MeshGSPOConfig``.
"""

from __future__ import annotations

import copy
import os
from dataclasses import dataclass, field

import torch
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from ._validation import require
from .config import SPECTRAL_ADAMW, MeshArguments, composed_codec
from .trainer import MeshTrainerMixin

__all__ = ["MeshGRPOConfig", "MeshGRPOTrainer", "MeshGSPOConfig", "MeshSFTConfig", "MeshSFTTrainer"]

CALIBRATION_PROMPTS = 64  # prompts a fitted boundary codec's geometry is fitted on before the first rollout
_OPTIM_HELP = f"Optimizer: '{SPECTRAL_ADAMW}' (the anchor-filtered AdamW) or any transformers optimizer name."


def _default_bf16(args) -> None:
    """TRL turns bf16 on unless told otherwise, which transformers refuses on a machine without a GPU
    unless ``use_cpu`` is set; there the default is fp32 (an explicit ``bf16=True`` is kept)."""
    if args.bf16 is None and not args.fp16 and not torch.cuda.is_available():
        args.bf16 = False


@dataclass
class MeshSFTConfig(MeshArguments, SFTConfig):
    """TRL's ``SFTConfig`` plus the mesh knobs; ``optim`` defaults to ``"spectral_adamw"``.

    ``bf16`` keeps TRL's default (on) where a GPU is present and is off on a CPU-only machine.

    Example:
        >>> args = MeshSFTConfig("out", mask_ratio=0.95, num_stages=4, max_length=512)  # doctest: +SKIP
    """

    optim: str = field(default=SPECTRAL_ADAMW, metadata={"help": _OPTIM_HELP})

    def __post_init__(self) -> None:
        _default_bf16(self)
        super().__post_init__()


@dataclass
class MeshGRPOConfig(MeshArguments, GRPOConfig):
    """TRL's ``GRPOConfig`` plus the mesh knobs; ``optim`` defaults to ``"spectral_adamw"``.

    GSPO is this config with ``importance_sampling_level="sequence"`` and ``loss_type="grpo"``
    (``MeshGSPOConfig`` has those defaults). TRL's own checks (batch sizes divisible by
    ``num_generations``, …) run at construction, then the mesh's.

    Example:
        >>> args = MeshGRPOConfig("out", num_generations=8, mask_ratio=0.95)  # doctest: +SKIP
    """

    optim: str = field(default=SPECTRAL_ADAMW, metadata={"help": _OPTIM_HELP})

    def __post_init__(self) -> None:
        world = os.environ.get("WORLD_SIZE", "1")
        require(
            world == "1",
            "WORLD_SIZE",
            world,
            f"be 1 for {type(self).__name__}: GRPO/GSPO trains on one process (the distributed X×Y mesh runs "
            "supervised objectives: MeshTrainer, MeshSFTTrainer)",
        )
        _default_bf16(self)
        super().__post_init__()
        # both are set up from a tokenized training batch before the first step; RL has only prompts then
        require(
            self.mask_protect_dims == 0,
            "mask_protect_dims",
            self.mask_protect_dims,
            "be 0 for GRPO/GSPO (protected dims are chosen on a training batch before the first rollout exists)",
        )
        require(
            self.mask_fill != "gaussian",
            "mask_fill",
            self.mask_fill,
            "be 'zeros' or 'mean' for GRPO/GSPO (the Gaussian fill is calibrated on a training batch before the first "
            "rollout exists)",
        )
        codec = composed_codec(self)
        if self.mask_ratio > 0 or codec is not None:
            every = self.steps_per_generation * self.num_iterations
            require(
                self.gradient_accumulation_steps % every == 0,
                "gradient_accumulation_steps",
                self.gradient_accumulation_steps,
                f"be a multiple of steps_per_generation·num_iterations = {every} when the boundaries compress "
                "(otherwise TRL computes π_old in a separate dense forward and the importance ratio "
                "compares the dense model with the masked one)",
            )


@dataclass
class MeshGSPOConfig(MeshGRPOConfig):
    """GSPO (group sequence policy optimisation): ``MeshGRPOConfig`` whose defaults are sequence-level
    importance ratios, π_θ(y|x)/π_old(y|x) normalised by length, with the GRPO loss.

    Example:
        >>> args = MeshGSPOConfig("out", num_generations=8, max_completion_length=32)  # doctest: +SKIP
    """

    importance_sampling_level: str = field(
        default="sequence", metadata={"help": "GSPO: 'sequence' (one ratio per completion)."}
    )
    loss_type: str = field(default="grpo", metadata={"help": "GSPO uses the GRPO loss."})


def _mesh_args(trainer_cls: type, config_cls: type, args, model, suffix: str):
    """``args`` checked to be the trainer's Mesh config (TRL would silently convert anything else)."""
    if args is None:
        name = model if isinstance(model, str) else model.config._name_or_path or type(model).__name__
        return config_cls(f"{str(name).rstrip('/').split('/')[-1]}-{suffix}")
    require(
        isinstance(args, config_cls),
        "args",
        type(args).__name__,
        f"be a {config_cls.__name__} for {trainer_cls.__name__} (its mesh knobs and optim='{SPECTRAL_ADAMW}' "
        f"live there; TRL's own config does not accept optim='{SPECTRAL_ADAMW}')",
    )
    return args


class _QuietAnchorLossMixin:
    """TRL's ``compute_loss`` books training metrics (token accuracy, entropy, clip ratios, token
    counts); the anchor's extra dense passes must not show up in them."""

    def _anchor_loss(self, model, batch):
        metrics = copy.deepcopy(getattr(self, "_metrics", None))
        tokens = getattr(self, "_total_train_tokens", None)
        try:
            return super()._anchor_loss(model, batch)
        finally:
            if metrics is not None:
                self._metrics = metrics
            if tokens is not None:
                self._total_train_tokens = tokens


class MeshSFTTrainer(_QuietAnchorLossMixin, MeshTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer`` with masked pipeline boundaries, the anchor circuit and SpectralAdamW.

    Takes everything ``SFTTrainer`` takes (datasets in any TRL format, ``peft_config=``, packing,
    completion-only loss); ``args`` must be a ``MeshSFTConfig``. Launched on X·Y processes,
    ``train()`` runs the distributed mesh like ``MeshTrainer``.

    Example:
        >>> from hf_meshtune import MeshSFTConfig, MeshSFTTrainer
        >>> args = MeshSFTConfig("out", max_steps=100, mask_ratio=0.95, num_stages=4)  # doctest: +SKIP
        >>> trainer = MeshSFTTrainer(model=model, args=args, train_dataset=dataset,
        ...                          peft_config=LoraConfig(r=16, task_type="CAUSAL_LM"))  # doctest: +SKIP
        >>> trainer.train()                                                           # doctest: +SKIP
    """

    def __init__(self, model, args: MeshSFTConfig | None = None, *positional, **kwargs) -> None:
        args = _mesh_args(type(self), MeshSFTConfig, args, model, "SFT")
        self._validate_mesh_job_early(model, args)
        super().__init__(model, args, *positional, **kwargs)
        self._setup_mesh()


class MeshGRPOTrainer(_QuietAnchorLossMixin, MeshTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` (GRPO or GSPO) whose policy trains through the masked boundaries.

    Generation, the reference model and the rewards stay dense (see the module docstring); the
    anchor's dense gradient is taken on the rollouts being trained on. ``args`` must be a
    ``MeshGRPOConfig``. One process per run: the distributed X·Y mesh runs supervised objectives.

    Example:
        >>> from hf_meshtune import MeshGRPOConfig, MeshGRPOTrainer
        >>> from hf_meshtune.apps.arithmetic import exact_answer_reward
        >>> args = MeshGSPOConfig("out", num_generations=8, max_completion_length=32)  # doctest: +SKIP
        >>> trainer = MeshGRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=args,
        ...                           train_dataset=prompts)                               # doctest: +SKIP
        >>> trainer.train()                                                                # doctest: +SKIP
    """

    _mesh_runs_distributed = False

    def __init__(self, model, reward_funcs=None, args: MeshGRPOConfig | None = None, *positional, **kwargs) -> None:
        args = _mesh_args(type(self), MeshGRPOConfig, args, model, "GRPO")
        self._validate_mesh_job_early(model, args)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._setup_mesh()

    def _set_up_masks(self) -> None:
        """Before the first rollout exists: a composed codec's geometry is fitted on a dense forward of
        the first training prompts, rendered as TRL renders them for generation (unless restored)."""
        self.mesh_engine.set_up_masks(self._prompt_batch)

    def _prompt_batch(self) -> dict:
        """The first ``CALIBRATION_PROMPTS`` training prompts, chat-templated where conversational,
        tokenized and padded (input_ids, attention_mask) on the model's device."""
        from trl.data_utils import maybe_apply_chat_template

        dataset = self.train_dataset
        rows = [dataset[i] for i in range(min(CALIBRATION_PROMPTS, len(dataset)))]
        texts = [maybe_apply_chat_template(row, self.processing_class)["prompt"] for row in rows]
        tokenizer = getattr(self.processing_class, "tokenizer", self.processing_class)
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        device = next(self.model.parameters()).device
        return {"input_ids": encoded["input_ids"].to(device), "attention_mask": encoded["attention_mask"].to(device)}

    def _anchor_batches(self, microbatches: int | None = None):
        """Round r → the rollouts of the current generation batch (TRL buffers one slice per
        accumulation step); the anchor differentiates the same loss on them, densely."""

        def rollouts(round_index: int) -> list:
            require(
                self._buffered_inputs is not None,
                "anchor rollouts",
                None,
                "exist before the first optimizer step (the anchor reads the generation batch being trained on)",
            )
            return list(self._buffered_inputs)

        return rollouts
