"""``evaluate`` after a mesh run: the dense pipeline over the Trainer's eval data, each stage its own layers.

Fast replica 0's Y processes (in a replica job: the job's own replica) read the same eval batches, in
order (``per_device_eval_batch_size`` rows, the Trainer's collator); stage 0 embeds, every stage runs
its layers dense (no mask or codec: evaluation measures the model, not the wire) and sends the
[B, T, H] hidden states on, with their shape first; the last stage computes the model's own loss per
batch. ``eval_loss`` is the mean over rows of the batch losses, as the Trainer's evaluation loop
reports it. The result goes to every process, so each returns the same metrics (and rank 0 logs them).
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader
from transformers.trainer_utils import speed_metrics

from .._validation import require
from ..comm.wire import recv_tensor, send_tensor
from ..pipeline.stage import StageModule, causal_lm_loss

__all__ = ["EVAL_TAG", "evaluate_on_mesh"]

EVAL_TAG = 7101


def evaluate_on_mesh(trainer, eval_dataset=None, metric_key_prefix: str = "eval") -> dict[str, float]:
    """The Trainer's ``evaluate`` for a model that each process holds one stage of (module docstring)."""
    run = trainer.mesh_run
    groups, topology = run.groups, run.groups.topology
    model = trainer.model
    source = topology.job_replica or 0
    start = time.time()
    totals = torch.zeros(3, dtype=torch.float64)  # Σ loss · rows, rows, batches
    if groups.replica == source:
        totals = _run_pipeline(trainer, model, groups, eval_dataset)
    last = topology.process_rank(topology.rank(source, topology.stages - 1))
    dist.broadcast(totals, src=last, group=run.survivors)
    loss_sum, rows, batches = totals.tolist()
    metrics = {f"{metric_key_prefix}_loss": loss_sum / rows if rows else math.nan}
    metrics.update(speed_metrics(metric_key_prefix, start, num_samples=int(rows), num_steps=int(batches)))
    if trainer.state.epoch is not None:
        metrics["epoch"] = trainer.state.epoch
    trainer.log(metrics)
    trainer.control = trainer.callback_handler.on_evaluate(trainer.args, trainer.state, trainer.control, metrics)
    return metrics


def _eval_batches(trainer, eval_dataset) -> DataLoader:
    """The eval rows in order, whole on every stage (the Trainer's own eval dataloader would give each
    process of the world a different share: the stages of one pipeline must see the same batches)."""
    dataset = eval_dataset if eval_dataset is not None else trainer.eval_dataset
    require(
        dataset is not None and not isinstance(dataset, dict),
        "eval_dataset",
        type(dataset).__name__,
        "be one dataset (not None, not a dict of them) to evaluate after a mesh run",
    )
    collate = trainer.data_collator
    if hasattr(dataset, "column_names"):
        dataset = trainer._remove_unused_columns(dataset, description="evaluation")
    else:
        collate = trainer._get_collator_with_removed_columns(collate, description="evaluation")
    args = trainer.args
    return DataLoader(
        dataset,
        batch_size=args.per_device_eval_batch_size,
        collate_fn=collate,
        shuffle=False,
        drop_last=args.dataloader_drop_last,
    )


def _run_pipeline(trainer, model, groups, eval_dataset) -> torch.Tensor:
    topology, stage, stages = groups.topology, groups.stage, groups.topology.stages
    module = StageModule(model, stage, stages, None, None, stage_layers=topology.stage_layers)  # dense both sides
    loss_fn = causal_lm_loss(model)
    first = next(module.parameters())
    device, dtype = first.device, first.dtype
    prev = topology.process_rank(topology.rank(groups.replica, stage - 1)) if stage > 0 else None
    nxt = topology.process_rank(topology.rank(groups.replica, stage + 1)) if stage < stages - 1 else None
    totals = torch.zeros(3, dtype=torch.float64)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in _eval_batches(trainer, eval_dataset):
                batch = trainer._prepare_inputs(batch)
                ids = batch["input_ids"]
                labels = batch.get("labels", ids)
                if "attention_mask" in batch:  # padded positions never count in the loss
                    labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
                if prev is None:
                    x = ids.to(device)
                else:
                    shape = torch.zeros(2, dtype=torch.int64)
                    dist.recv(shape, src=prev, group=groups.pp_group, tag=EVAL_TAG)
                    x = torch.empty(*shape.tolist(), module.hidden_size, dtype=dtype, device=device)
                    recv_tensor(x, prev, group=groups.pp_group, tag=EVAL_TAG)
                out = module(x)
                if nxt is not None:
                    dist.send(
                        torch.tensor(out.shape[:2], dtype=torch.int64), dst=nxt, group=groups.pp_group, tag=EVAL_TAG
                    )
                    send_tensor(out.contiguous(), nxt, group=groups.pp_group, tag=EVAL_TAG)
                    continue
                loss = loss_fn(out, labels.to(out.device))
                totals += torch.tensor([float(loss) * ids.shape[0], ids.shape[0], 1], dtype=torch.float64)
    finally:
        model.train(was_training)
    return totals
