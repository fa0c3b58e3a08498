"""``MeshTrainer.train()`` on a distributed mesh: the glue between the Trainer and the mesh workers.

When the job has several processes (``WORLD_SIZE`` > 1: ``meshtune launch``, ``torchrun`` or
``accelerate launch``), every process runs this instead of the Trainer's single-process loop:

1. the mesh topology is validated (``MeshTopology.from_environment``) before any collective;
2. the Trainer's data (train dataset + collator) becomes fixed-shape [B·M, T] batches (T: the longest row;
   the boundaries carry each row only up to its last label, ``pipeline.messages``): fast replica r at step
   t and the anchor at round k each draw their own rows (pure functions of seed and index);
3. the process runs its stage (``runtime.bootstrap.run_worker``);
4. the rank with the loss runs the Trainer's callbacks and prints the run (``runtime.console``);
5. at the end rank 0 writes ``mesh_summary.json``: measured bytes per token by circuit next to the
   analytic ledger, DP bytes per sync, anchor staleness, step times, every process's memory. Every
   process keeps only its stage (``pipeline.placement``): ``save_model`` writes one shard per stage
   (``runtime.saving``) and ``evaluate`` runs the dense pipeline (``runtime.evaluation``); a PEFT
   adapter's trainable tensors are shared to every process, so PEFT saves it whole.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from transformers import get_scheduler
from transformers.trainer_utils import TrainOutput

from .._validation import require
from ..anchor.batches import AnchorBatches
from ..boundary.hooks import find_decoder_layers
from ..comm.jobs import job_store
from ..config import require_mesh_supported
from ..dp.ft import start_lighthouse
from ..memory import MEMORY_PARTS
from ..pipeline.placement import materialise
from ..pipeline.stage import StageModule, untie_embeddings
from ..topology import MeshGroups, MeshTopology
from .bootstrap import run_worker
from .checkpoint import resolve_resume
from .console import TrainerConsole
from .results import MeshResult, gather_results, log_history, predicted_memory, summarize
from .settings import RunSettings

if TYPE_CHECKING:
    from torchft.coordination import LighthouseServer

__all__ = ["LIGHTHOUSE_ENV", "SUMMARY_NAME", "MeshRun", "is_distributed_job", "train_on_mesh", "validate_mesh_job"]

LIGHTHOUSE_ENV = "TORCHFT_LIGHTHOUSE"
SUMMARY_NAME = "mesh_summary.json"


@dataclass(frozen=True)
class MeshRun:
    """What a trainer keeps of its finished mesh run (``trainer.mesh_run``): its groups, and the group
    of the processes still there (None: the whole world), for ``save_model`` and ``evaluate`` after it."""

    groups: MeshGroups
    survivors: object | None = None
    left_out: bool = False  # an anchor process the fast ranks finished without (they saw its link break)


def is_distributed_job() -> bool:
    """True when this process is one of several (a launcher set WORLD_SIZE > 1)."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def validate_mesh_job(model, args) -> MeshTopology:
    """The job's topology, or the same ``ValueError`` on every rank before any collective."""
    _, layers = find_decoder_layers(model)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    topology = MeshTopology.from_environment(
        world, args.num_stages, args.anchor, len(layers), stage_layers=args.stage_layers
    )
    require_mesh_supported(args)
    return topology


def _require_every_stage_trains(model, topology: MeshTopology) -> None:
    """Every process holds the whole model, so each can check every stage (the same verdict on all
    ranks, before any collective): a stage with nothing to train has nothing to sync or filter."""
    for stage in range(topology.stages):
        module = StageModule(model, stage, topology.stages, None, None, stage_layers=topology.stage_layers)
        require(
            any(p.requires_grad for p in module.parameters()),
            "trainable parameters of stage",
            stage,
            "include at least one (freeze fewer layers: every stage of the mesh trains)",
        )


def _pad_rows(batch: dict, seq_len: int, pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    ids = batch["input_ids"]
    labels = batch.get("labels", ids)
    require(ids.shape[1] <= seq_len, "batch sequence length", ids.shape[1], f"be <= the mesh's fixed length {seq_len}")
    extra = seq_len - ids.shape[1]
    if extra:
        ids = torch.nn.functional.pad(ids, (0, extra), value=pad_id)
        labels = torch.nn.functional.pad(labels, (0, extra), value=-100)
    if "attention_mask" in batch:  # padded positions never count in the loss
        mask = torch.nn.functional.pad(batch["attention_mask"], (0, extra), value=0)
        labels = labels.masked_fill(mask == 0, -100)
    return ids.long(), labels.long()


class _ReplicaBatches:
    """Fast replica ``replica``'s rows at step t: its share of the step's global batch, drawn like the
    anchor's (``AnchorBatches``: a fresh permutation per pass, a pure function of seed and index)."""

    def __init__(
        self, dataset, collate, rows: int, replica: int, replicas: int, seed: int, seq_len: int, pad_id: int
    ) -> None:
        self.sampler = AnchorBatches(dataset, collate, rows, 1, seed, tag=b"meshtune-data")
        self.replica, self.replicas, self.seq_len, self.pad_id = replica, replicas, seq_len, pad_id

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        (batch,) = self.sampler(step * self.replicas + self.replica)
        return _pad_rows(batch, self.seq_len, self.pad_id)


def _fixed_length(dataset) -> int:
    require(
        hasattr(dataset, "column_names") and "input_ids" in dataset.column_names,
        "train_dataset",
        type(dataset).__name__,
        "be a tokenized datasets.Dataset with an 'input_ids' column on the mesh "
        "(pipeline stages compute on fixed-shape tensors, so the longest row sets T; only each row's real "
        "tokens cross the links)",
    )
    return max(len(ids) for ids in dataset["input_ids"])


def _lighthouse(rank: int, topology: MeshTopology) -> tuple[str, LighthouseServer | None]:
    """The torchft lighthouse: ``$TORCHFT_LIGHTHOUSE``, or one that rank 0 starts for the job."""
    address = os.environ.get(LIGHTHOUSE_ENV)
    if address:
        return address, None
    require(
        topology.job_replica is None,
        LIGHTHOUSE_ENV,
        address,
        "be set when every replica is a job of its own (the replicas meet only at a shared lighthouse; "
        "`meshtune launch` starts one)",
    )
    store = dist.distributed_c10d._get_default_store()
    server = None
    if rank == 0:
        server, address = start_lighthouse(min_replicas=len(topology.fast_replicas))
        store.set("meshtune/lighthouse", address)
    return store.get("meshtune/lighthouse").decode(), server


def _checkpoint_every(args) -> int | None:
    """``save_strategy``/``save_steps`` → fast steps between mesh checkpoints (None: no checkpoints)."""
    strategy = str(getattr(args.save_strategy, "value", args.save_strategy))
    require(
        strategy in ("no", "steps"),
        "save_strategy",
        strategy,
        "be 'no' or 'steps' on the distributed mesh (it counts fast steps, not epochs or evaluations)",
    )
    if strategy == "no":
        return None
    steps = args.save_steps
    return (
        max(1, math.ceil(steps * args.max_steps)) if steps < 1 else int(steps)
    )  # a float < 1 is a ratio, as in Trainer


def train_on_mesh(trainer, resume_from_checkpoint: bool | str | None = None):
    """Run ``trainer``'s training on the distributed mesh; returns a ``TrainOutput``.

    ``save_strategy="steps"`` writes a mesh checkpoint every ``save_steps`` fast steps
    (``runtime.checkpoint``: ``checkpoint-N/mesh/rank<r>.pt``, ``save_total_limit`` complete ones kept);
    ``resume_from_checkpoint`` (True: the newest complete one in ``output_dir``) continues from one.
    """
    args, model = trainer.args, trainer.model
    topology = validate_mesh_job(model, args)
    require(
        args.max_steps > 0, "max_steps", args.max_steps, "be > 0 on the distributed mesh (epochs are not counted there)"
    )
    checkpoint_every = _checkpoint_every(args)
    resume_from = resolve_resume(resume_from_checkpoint, args.output_dir, topology)
    _require_every_stage_trains(model, topology)
    _require_memory_budget(trainer, topology)
    rank = _join(trainer, topology)
    groups = topology.build_groups(timeout_s=args.ddp_timeout)  # bounds every pipeline and anchor-link transfer
    lighthouse, server = _lighthouse(rank, topology)
    # a trainer may make its own batches and loss (MeshGRPOTrainer: rollouts and TRL's policy loss)
    mesh_data = getattr(trainer, "_mesh_data", None) or (lambda t, r: _mesh_data(trainer, t, r))
    batches, anchor_batches, seq_len = mesh_data(topology, rank)
    console = TrainerConsole(trainer, topology, rank)
    settings = _run_settings(args, topology, seq_len, lighthouse, checkpoint_every, resume_from)
    settings.loss, settings.log, settings.callbacks = getattr(trainer, "_mesh_loss", None), console.log, (console,)
    if args.gradient_checkpointing:  # as Trainer.train() does; the stages call the checkpointed layers
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs=args.gradient_checkpointing_kwargs or {"use_reentrant": False}
        )
    model.train()  # as Trainer.train() does (from_pretrained leaves eval mode: no dropout, no checkpointing)
    torch.manual_seed(args.seed)
    console.begin()
    result = run_worker(model, groups, settings, batches, anchor_batches)
    try:
        output = _finish(trainer, result, groups, settings, seq_len)
        console.end(getattr(trainer, "mesh_summary", None), os.path.join(args.output_dir, SUMMARY_NAME))
        return output
    finally:
        if server is not None:
            server.shutdown()


def _require_memory_budget(trainer, topology: MeshTopology) -> None:
    """``max_memory_per_stage``: every rank predicts every (role, stage) from the same config (the memory
    ledger) and refuses the same one over the budget, before any collective."""
    budget = trainer.args.mesh_config.max_memory_per_stage
    if budget is None:
        return
    length = getattr(trainer, "_mesh_sequence_length", None)
    seq_len = length() if length is not None else _fixed_length(_train_rows(trainer))
    for row in predicted_memory(trainer, topology, seq_len):
        parts = ", ".join(f"{k} {row[k]:.3g}" for k in MEMORY_PARTS if row[k] > 0)
        require(
            row["total"] <= budget,
            "max_memory_per_stage",
            budget,
            f"be >= the {row['total']:.3g} GiB the memory ledger predicts for the {row['role']} stage "
            f"{row['stage']} ({parts}; the Python runtime not included): use more stages, LoRA, a smaller "
            "batch or gradient checkpointing",
        )


def _join(trainer, topology: MeshTopology) -> int:
    """This process's mesh rank, once its process group exists and the model is ready for the stages."""
    args, model = trainer.args, trainer.model
    _ = args.device  # accelerate creates the default process group for launched jobs
    require(
        args.world_size == topology.job_world_size,
        "TrainingArguments.world_size",
        args.world_size,
        f"equal WORLD_SIZE={topology.job_world_size} (accelerate did not join the launched processes; on CPU "
        "export ACCELERATE_USE_CPU=true or pass --use_cpu, as `meshtune launch --cpu` does)",
    )
    if not dist.is_initialized():
        dist.init_process_group("gloo")
    rank = topology.mesh_rank(dist.get_rank())
    trainer.mesh_boundaries.remove()  # the stages apply the masks themselves
    if untie_embeddings(model) and rank == 0:
        print(
            "hf_meshtune: the LM head was tied to the input embeddings; on the mesh the first and last stages "
            "each train their own copy (tie_word_embeddings=False in the saved config)",
            flush=True,
        )
    return rank


def _train_rows(trainer):
    """The training dataset as the mesh reads it: the Trainer's unused columns removed."""
    dataset = trainer.train_dataset
    if hasattr(dataset, "column_names"):
        dataset = trainer._remove_unused_columns(dataset, description="training")
    return dataset


def _mesh_data(trainer, topology: MeshTopology, rank: int) -> tuple[_ReplicaBatches, Callable, int]:
    """(this replica's batches by step, the anchor's by round, the fixed sequence length T)."""
    args, model = trainer.args, trainer.model
    dataset = _train_rows(trainer)
    seq_len = _fixed_length(dataset)
    pad_id = getattr(getattr(trainer, "processing_class", None), "pad_token_id", None)
    pad_id = pad_id if pad_id is not None else (model.config.pad_token_id or 0)
    seed = args.data_seed if args.data_seed is not None else args.seed
    micro, fast = args.per_device_train_batch_size, topology.fast_replicas
    replica, _ = topology.coords(rank)
    rows = micro * args.gradient_accumulation_steps
    batches = _ReplicaBatches(
        dataset, trainer.data_collator, rows, min(replica, len(fast) - 1), len(fast), seed, seq_len, pad_id
    )
    anchor_rows = micro * (args.anchor_microbatches or args.gradient_accumulation_steps)
    anchor_rounds = AnchorBatches(dataset, trainer.data_collator, anchor_rows, 1, seed)

    def anchor_batches(round_index: int):
        return _pad_rows(anchor_rounds(round_index)[0], seq_len, pad_id)

    return batches, anchor_batches, seq_len


def _run_settings(args, topology: MeshTopology, seq_len: int, lighthouse: str, checkpoint_every: int | None,
                  resume_from: str | None) -> RunSettings:  # fmt: skip
    """The Trainer's arguments as the mesh process's ``RunSettings``."""

    def scheduler(optimizer):
        return get_scheduler(
            args.lr_scheduler_type,
            optimizer,
            num_warmup_steps=args.get_warmup_steps(args.max_steps),
            num_training_steps=args.max_steps,
            scheduler_specific_kwargs=args.lr_scheduler_kwargs,
        )

    return RunSettings(
        config=args.mesh_config,
        microbatch_size=args.per_device_train_batch_size,
        microbatches=args.gradient_accumulation_steps,
        seq_len=seq_len,
        max_steps=args.max_steps,
        lr=args.learning_rate,
        betas=(args.adam_beta1, args.adam_beta2),
        eps=args.adam_epsilon,
        weight_decay=args.weight_decay,
        max_grad_norm=args.max_grad_norm or None,
        scheduler=scheduler,
        anchor_microbatches=args.anchor_microbatches or args.gradient_accumulation_steps,
        lighthouse=lighthouse,
        log_every=max(1, int(args.logging_steps)),
        link_timeout_s=args.ddp_timeout,
        checkpoint_dir=args.output_dir,
        checkpoint_every=checkpoint_every,
        checkpoint_keep=args.save_total_limit,
        resume_from=resume_from,
    )


def _finish(trainer, result: MeshResult, groups: MeshGroups, settings: RunSettings, seq_len: int):
    """After the last step: agree on who is left, gather every result, share the final parameters,
    write ``mesh_summary.json`` (rank 0) and fill the Trainer's state; returns the ``TrainOutput``."""
    args, topology = trainer.args, groups.topology
    assert settings.dp_timeout_s is not None  # RunSettings resolves it
    survivors = _survivors(result, topology, groups.fast_group, settings.dp_timeout_s)
    if survivors is not None and result.role == "anchor":  # given up by the fast ranks: nothing to share
        trainer.mesh_run = MeshRun(groups, survivors, left_out=True)
        return TrainOutput(args.max_steps, math.nan, {})
    store = job_store(settings.dp_timeout_s) if topology.job_replica is not None else None
    results = gather_results(result, topology, settings.dp_timeout_s, survivors, store)
    _share_final_parameters(trainer.model, topology, survivors)
    trainer.mesh_run = MeshRun(groups, survivors)
    summary = summarize(results, topology, trainer, seq_len)
    if groups.rank == 0:
        os.makedirs(args.output_dir, exist_ok=True)
        path = os.path.join(args.output_dir, SUMMARY_NAME)
        with open(f"{path}.tmp", "w") as handle:  # write then rename: never a half-written summary
            json.dump(summary, handle, indent=2)
        os.replace(f"{path}.tmp", path)
    trainer.state.global_step = trainer.state.max_steps = args.max_steps
    trainer.state.log_history.extend(log_history(results, summary))
    trainer.mesh_summary = summary
    dist.barrier(group=survivors)
    losses = [loss for r in results if r.role == "fast" for loss in r.losses]
    train_loss = float(statistics.fmean(losses)) if losses else math.nan
    numbers = {k: v for k, v in summary.items() if isinstance(v, (int, float))}
    return TrainOutput(args.max_steps, train_loss, {"train_loss": train_loss, **numbers})


def _survivors(result: MeshResult, topology: MeshTopology, fast_group, timeout_s: float):
    """None when every process of the world is there to finish together; the fast ranks' group when
    any of them lost the anchor link (its processes died: ``meshtune launch --optional-replica``).
    The fast ranks agree (max over their group) and mesh rank 0 tells the anchor ranks through the
    store, so every live process takes the same way out."""
    if fast_group is None:
        return None
    store, key = dist.distributed_c10d._get_default_store(), "hf_meshtune/anchor_lost"
    if result.role == "fast":
        flag = torch.tensor([0 if result.anchor_lost_at is None else 1])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=fast_group)
        lost = bool(flag.item())
        if result.rank == 0:
            store.set(key, "1" if lost else "0")
    else:
        store.wait([key], timedelta(seconds=timeout_s))
        lost = store.get(key) == b"1"
    return fast_group if lost else None


def _share_final_parameters(model, topology: MeshTopology, group=None) -> None:
    """A PEFT adapter's trainable tensors (small beside the model) go from fast replica 0 (in a replica
    job: its own replica; they share θ_global) to every process, stage by stage, so PEFT's own
    ``save_pretrained`` writes the whole adapter on rank 0. A full model is never gathered: each stage
    keeps its own tensors and ``save_model`` writes them as shards (``runtime.saving``)."""
    if getattr(model, "peft_config", None) is None:
        return
    source = topology.job_replica or 0
    names = {id(p): n for n, p in model.named_parameters()}
    with torch.no_grad():
        for stage in range(topology.stages):
            owned = StageModule(model, stage, topology.stages, None, None, stage_layers=topology.stage_layers)
            for param in owned.parameters():
                if param.requires_grad:
                    held = materialise(model, names[id(param)], "cpu")
                    dist.broadcast(held.data, src=topology.process_rank(topology.rank(source, stage)), group=group)
