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

Launched on X·Y processes (``meshtune launch``, ``torchrun``, ``accelerate launch``), ``MeshGRPOTrainer.train()``
runs the distributed mesh with the same script: every replica generates its own rollouts through its
pipeline (``rl.rollouts``: dense, each stage with its own KV cache), its last stage scores them with the
reward functions and trains on them through the compressed boundaries with TRL's loss (``rl.loss``);
DiLoCo syncs the fast replicas and the anchor replica takes dense gradients on rollouts it samples itself.
There π_old is the training forward's own detached log-probability (one iteration per generation batch) and
π_ref (β > 0) one dense no-grad pass through the stages with the reference weights; ``MeshGRPOConfig``
refuses what the mesh does not run on every rank before any rendezvous.

GSPO (Zheng et al., 2025) is GRPO with sequence-level importance ratios:
``MeshGRPOConfig(importance_sampling_level="sequence", loss_type="grpo")``, i.e. ``MeshGSPOConfig``.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, cast

import torch
from transformers import GenerationConfig
from trl import GRPOConfig, GRPOTrainer, SFTConfig, SFTTrainer

from ._validation import require
from .anchor.batches import AnchorBatches
from .config import SPECTRAL_ADAMW, MeshArguments, composed_codec
from .pipeline.generate import RolloutSettings
from .rl.loss import PolicyLoss, PolicyLossSettings
from .rl.rollouts import REFERENCE_ADAPTER, AdvantageSettings, MeshRollouts
from .runtime.job import is_distributed_job
from .trainer import MeshTrainerMixin

if TYPE_CHECKING:  # the mixin's _anchor_loss wraps MeshTrainerMixin's: let the type checker see it
    _AnchorLossBase = MeshTrainerMixin
else:
    _AnchorLossBase = object

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
        _default_bf16(self)
        super().__post_init__()
        if is_distributed_job():
            self._check_mesh_rl()
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
        assert self.mask_ratio is not None and self.steps_per_generation is not None  # resolved by __post_init__
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

    def _check_mesh_rl(self) -> None:
        """What GRPO/GSPO on the distributed mesh runs, checked on every rank before any collective: one
        optimizer step per generation batch (a replica's step: its per_device_train_batch_size ·
        gradient_accumulation_steps rows, whole groups), π_old from that step's own forward, no π_ref, and
        only the loss terms ``rl.loss.PolicyLoss`` computes."""
        require(
            self.num_iterations == 1,
            "num_iterations",
            self.num_iterations,
            "be 1 on the distributed mesh (each fast step trains once on rollouts it has just generated)",
        )
        require(
            self.steps_per_generation == self.gradient_accumulation_steps,
            "steps_per_generation",
            self.steps_per_generation,
            f"equal gradient_accumulation_steps = {self.gradient_accumulation_steps} on the distributed mesh (a "
            "fast step is one generation batch, trained as that many microbatches)",
        )
        require(
            not self.sync_ref_model,
            "sync_ref_model",
            self.sync_ref_model,
            "be False on the distributed mesh (each stage keeps its own layers of the reference model, never synced)",
        )
        PolicyLossSettings.from_grpo_config(self)  # refuses, by name, a loss term the mesh does not compute
        # refuses, by name, a sampling option the pipeline does not apply (the tokens are TRL's own, set later)
        RolloutSettings.from_generation_config(GenerationConfig(**_generation_kwargs(self), pad_token_id=0))
        rows = {"per_device_train_batch_size · gradient_accumulation_steps": self.gradient_accumulation_steps}
        if self.anchor:
            rows["per_device_train_batch_size · anchor_microbatches"] = (
                self.anchor_microbatches or self.gradient_accumulation_steps
            )
        assert self.num_generations is not None  # TRL's default is 8
        for what, microbatches in rows.items():
            count = self.per_device_train_batch_size * microbatches
            require(
                count % self.num_generations == 0,
                "num_generations",
                self.num_generations,
                f"divide {what} = {count} on the distributed mesh (each replica's step generates whole groups "
                "of completions for its own prompts)",
            )


def _generation_kwargs(args) -> dict:
    """What ``GRPOTrainer`` samples with, from its config (its ``generation_kwargs`` override the fields)."""
    kwargs = {
        "max_new_tokens": args.max_completion_length,
        "do_sample": True,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "min_p": args.min_p,
        "repetition_penalty": args.repetition_penalty,
    }
    return {**kwargs, **(args.generation_kwargs or {})}


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


def _check_mesh_rewards(reward_funcs, kwargs: dict) -> None:
    """Before TRL's set-up, on every rank of a launched job: the rewards and rollouts the mesh computes."""
    funcs = reward_funcs if isinstance(reward_funcs, (list, tuple)) else [reward_funcs]
    for func in funcs:
        require(
            callable(func) and not isinstance(func, (str, torch.nn.Module)),
            "reward_funcs",
            func if isinstance(func, str) else type(func).__name__,
            "hold only functions on the distributed mesh (a reward model is not run on the last stage yet)",
        )
    for name in ("tools", "environment_factory", "rollout_func"):
        require(
            not kwargs.get(name),
            name,
            type(kwargs.get(name)).__name__,
            "be None on the distributed mesh (its rollouts are single-turn generations through the pipeline)",
        )


class _QuietAnchorLossMixin(_AnchorLossBase):
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

    args: MeshSFTConfig  # what _mesh_args makes of the args given

    def __init__(self, model, args: MeshSFTConfig | None = None, *positional, **kwargs) -> None:
        args = _mesh_args(type(self), MeshSFTConfig, args, model, "SFT")
        self._validate_mesh_job_early(model, args)
        super().__init__(model, args, *positional, **kwargs)
        self._setup_mesh()


class MeshGRPOTrainer(_QuietAnchorLossMixin, MeshTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer`` (GRPO or GSPO) whose policy trains through the masked boundaries.

    Generation, the reference model and the rewards stay dense (see the module docstring); the
    anchor's dense gradient is taken on the rollouts being trained on. ``args`` must be a
    ``MeshGRPOConfig``. Launched on X·Y processes, ``train()`` runs the distributed mesh (module docstring).

    Example:
        >>> from hf_meshtune import MeshGRPOConfig, MeshGRPOTrainer
        >>> from hf_meshtune.apps.arithmetic import exact_answer_reward
        >>> args = MeshGSPOConfig("out", num_generations=8, max_completion_length=32)  # doctest: +SKIP
        >>> trainer = MeshGRPOTrainer(model=model, reward_funcs=exact_answer_reward, args=args,
        ...                           train_dataset=prompts)                               # doctest: +SKIP
        >>> trainer.train()                                                                # doctest: +SKIP
    """

    args: MeshGRPOConfig  # what _mesh_args makes of the args given

    def __init__(self, model, reward_funcs=None, args: MeshGRPOConfig | None = None, *positional, **kwargs) -> None:
        args = _mesh_args(type(self), MeshGRPOConfig, args, model, "GRPO")
        require(
            args.boundary_change_codec is None,
            "boundary_change_codec",
            args.boundary_change_codec,
            "be None for GRPO/GSPO: a row's completions are new at every visit, so no row is revisited with the "
            "same tokens (change coding is for SFT data seen more than once)",
        )
        self._validate_mesh_job_early(model, args)
        if is_distributed_job():
            _check_mesh_rewards(reward_funcs, kwargs)
        super().__init__(model, reward_funcs, args, *positional, **kwargs)
        self._setup_mesh()
        if is_distributed_job():  # every rank, after the same set-up and before any collective of the mesh
            tokenizer = self._tokenizer
            for attribute in ("response_template", "response_schema"):
                require(
                    getattr(tokenizer, attribute, None) is None,
                    f"processing_class.{attribute}",
                    "set",
                    "be None on the distributed mesh (completions are decoded as text, not parsed into tool calls)",
                )

    # --- the distributed mesh (``rl.rollouts``, ``rl.loss``) -----------------------------------

    def _rollout_settings(self) -> RolloutSettings:
        return RolloutSettings.from_generation_config(self.generation_config, self.args.max_completion_length)

    def _mesh_sequence_length(self) -> int:
        """T on the mesh: the longest tokenized training prompt plus ``max_completion_length``."""
        if getattr(self, "_mesh_seq_len", None) is None:
            dataset: Any = self.train_dataset  # a datasets.Dataset of prompts (untyped), as GRPOTrainer requires
            longest = 0
            for start in range(0, len(dataset), 256):
                prompts = dataset[start : start + 256]["prompt"]
                longest = max(longest, max(len(ids) for ids in self._tokenize_prompts(prompts)[0]))
            assert self.args.max_completion_length is not None  # TRL's default is 256
            self._mesh_seq_len = longest + self.args.max_completion_length
        return self._mesh_seq_len

    def _mesh_loss(self, model, microbatches: int) -> PolicyLoss:
        """TRL's policy loss on the last stage, for a step of ``microbatches``."""
        return PolicyLoss(PolicyLossSettings.from_grpo_config(self.args), microbatches)

    def _mesh_data(self, topology, rank: int) -> tuple[MeshRollouts, MeshRollouts, int]:
        """(fast replica's rollouts by step, the anchor's own rollouts by round, T): each replica, the anchor
        included, generates from its own prompts with its own parameters (``rl.rollouts``)."""
        args = self.args
        seed = args.data_seed if args.data_seed is not None else args.seed
        fast = topology.fast_replicas
        replica, _ = topology.coords(rank)
        g = args.num_generations
        assert g is not None  # TRL's default is 8
        rows = args.per_device_train_batch_size * args.gradient_accumulation_steps
        anchor_rows = args.per_device_train_batch_size * (args.anchor_microbatches or args.gradient_accumulation_steps)
        fast_prompts = AnchorBatches(self.train_dataset, list, rows // g, 1, seed, tag=b"meshtune-data")
        anchor_prompts = AnchorBatches(self.train_dataset, list, anchor_rows // g, 1, seed)
        seq_len = self._mesh_sequence_length()
        reference = None  # π_ref (β > 0): TRL's reference model, or the PEFT policy's adapter switched as TRL does
        if self.beta != 0.0:
            ref = self.ref_model
            reference = self.accelerator.unwrap_model(ref) if ref is not None else REFERENCE_ADAPTER
        advantages = AdvantageSettings(
            num_generations=g,
            weights=tuple(float(w) for w in self.reward_weights.tolist()),
            scale_rewards=str(args.scale_rewards),
            multi_objective_aggregation=str(args.multi_objective_aggregation),
        )

        def rollouts(draw, count: int, tag: int) -> MeshRollouts:
            return MeshRollouts(
                prompts=draw,
                tokenize=lambda prompts: self._tokenize_prompts(prompts)[0],
                decode=self._decode_completions,
                reward_funcs=cast("list[Callable]", self.reward_funcs),  # functions only here (_check_mesh_rewards)
                reward_names=self.reward_func_names,
                advantages=advantages,
                rollout=self._rollout_settings(),
                seq_len=seq_len,
                rows=count,
                seed=seed,
                tag=tag,
                mask_truncated_completions=bool(args.mask_truncated_completions),
                reward_kwargs={"trainer_state": self.state},
                reference=reference,
                temperature=float(args.temperature),
                score_rows=args.per_device_train_batch_size,
            )

        replica_index = min(replica, len(fast) - 1)
        fast_rollouts = rollouts(lambda step: fast_prompts(step * len(fast) + replica_index)[0], rows, 0)
        anchor_rollouts = rollouts(lambda index: anchor_prompts(index)[0], anchor_rows, 1)
        return fast_rollouts, anchor_rollouts, seq_len

    def _decode_completions(self, completion_ids: list[list[int]]) -> list:
        """As TRL decodes completions for the reward functions: text, or one assistant message where the
        prompts are conversations."""
        from trl.data_utils import is_conversational

        processing: Any = self.processing_class  # a tokenizer or a processor: either decodes
        dataset: Any = self.train_dataset  # a datasets.Dataset of prompts (untyped), as GRPOTrainer requires
        texts = processing.batch_decode(completion_ids, skip_special_tokens=True)
        if is_conversational({"prompt": dataset[0]["prompt"]}):
            return [[{"role": "assistant", "content": text}] for text in texts]
        return texts

    def _set_up_masks(self) -> None:
        """Before the first rollout exists: a composed codec's geometry is fitted on a dense forward of
        the first training prompts, rendered as TRL renders them for generation (unless restored)."""
        self.mesh_engine.set_up_masks(self._prompt_batch)

    def _prompt_batch(self) -> dict:
        """The first ``CALIBRATION_PROMPTS`` training prompts, chat-templated where conversational,
        tokenized and padded (input_ids, attention_mask) on the model's device."""
        from trl.data_utils import maybe_apply_chat_template

        dataset: Any = self.train_dataset  # a datasets.Dataset of prompts (untyped), as GRPOTrainer requires
        processing: Any = self.processing_class  # a tokenizer, or a processor holding one
        rows = [dataset[i] for i in range(min(CALIBRATION_PROMPTS, len(dataset)))]
        texts = [maybe_apply_chat_template(row, processing)["prompt"] for row in rows]
        tokenizer = getattr(processing, "tokenizer", processing)
        encoded = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        assert self.model is not None  # the Trainer built it
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
            assert self._buffered_inputs is not None
            return list(self._buffered_inputs)

        return rollouts
