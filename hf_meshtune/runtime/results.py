"""What a mesh run did: every process's ``MeshResult``, gathered, and the run's summary.

``summarize`` puts the bytes every process put on its links per fast token, by circuit, next to the
analytic ledger, with DP bytes per sync, anchor rounds and staleness, and step times; it is what
``mesh_summary.json`` holds and what ``meshtune report`` reads.
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import statistics
from dataclasses import dataclass, field
from datetime import timedelta

import torch.distributed as dist

from ..boundary.hooks import find_decoder_layers, split_stages
from ..comm.wire import CIRCUITS, LOCAL, ROLLOUT
from ..ledger import LedgerSettings, compute_ledger, measured_ratios, param_shapes_of, settings_from_knobs
from ..memory import MEMORY_PARTS
from ..memory_ledger import MemorySettings, predict_memory
from ..topology import MESH_ENV, MeshTopology

__all__ = ["MeshResult", "gather_results", "log_history", "summarize"]


@dataclass
class MeshResult:
    """What one process did: role, losses (last stages), wire bytes, syncs, anchor traffic."""

    rank: int
    replica: int
    stage: int
    role: str
    steps: int = 0
    tokens: int = 0
    losses: list[float] = field(default_factory=list)
    step_seconds: list[float] = field(default_factory=list)
    pipeline_seconds: list[float] = field(default_factory=list)  # fast: per step, the pipeline's forward/backward
    compute_seconds: list[float] = field(default_factory=list)  # of which this stage computed (the rest: waits)
    wire: dict = field(default_factory=dict)
    dp_syncs: int = 0
    dp_sync_bytes: list[float] = field(default_factory=list)
    dp_participants: list[int] = field(default_factory=list)  # replicas averaged by every committed DiLoCo sync
    arrivals: list[tuple[int, int]] = field(default_factory=list)  # (fast step on arrival, snapshot step)
    anchor_rounds: list[int] = field(default_factory=list)  # snapshot step of every round (anchor)
    delivery_seconds: list[float] = field(default_factory=list)  # anchor: per round, sending its messages
    heals: list[tuple[int, int]] = field(default_factory=list)  # (own step, peer's step) of every heal
    first_step: int = 0  # the step this process started from (a resumed run's checkpoint step)
    anchor_lost_at: int | None = None  # fast step at which the anchor link broke (fast ranks; None: it held)
    # restartable anchor link (replica jobs): steps of the SYNCs fast replica 0 sent / the anchor loaded, and
    # the anchor's deliveries a down link dropped, (snapshot, fast rank)
    anchor_syncs: list[int] = field(default_factory=list)
    anchor_skipped: list[tuple[int, int]] = field(default_factory=list)
    calibration_bytes: float = 0.0  # of wire["sent"]["pp_fwd"]: the codecs' one-off calibration pass (sent)
    # codec refits from the anchor: fast, (step after which it switched, snapshot, digest in, digest out);
    # anchor, (snapshot, digest of the geometry it sent)
    geometry: list[tuple] = field(default_factory=list)
    released_bytes: int = 0  # model tensors given back at the start: the stages this process does not hold
    # governed: fast, (step after which it switched, snapshot, levels); anchor, (snapshot, counts_after, levels)
    # of every decision it sent; and per round the anchor's fidelity/* and governor/* entries
    levels: list[tuple] = field(default_factory=list)
    fidelity: list[dict] = field(default_factory=list)
    memory: dict = field(default_factory=dict)  # bytes by part (``memory``), counted and measured
    # last stages of fast replicas: per step, what the batches and the loss logged besides the loss (RL's
    # rewards, completion lengths, clip ratios) and the step's time split (``time/*_s``)
    step_metrics: list[dict] = field(default_factory=list)


def gather_results(
    result: MeshResult, topology: MeshTopology, timeout_s: float, group=None, store: dist.Store | None = None
) -> list[MeshResult]:
    """Every process's ``MeshResult``: over the job's world (or ``group``: the fast ranks when the
    anchor was lost), and in replica jobs also through the launcher's ``store`` (``$MESHTUNE_JOB_STORE``:
    mesh rank 0 waits for all X·Y). Without that store a replica job only knows its own replica's
    results (the summary says how many replicas it covers)."""
    results: list[MeshResult] = [None] * dist.get_world_size(group)  # type: ignore[list-item]
    dist.all_gather_object(results, result, group=group)
    if topology.job_replica is None:
        return results
    if store is None:
        return results
    key = "hf_meshtune/result/{}".format
    store.set(key(result.rank), pickle.dumps(result))  # type: ignore[arg-type]  # torch's stub: str only; bytes work
    if result.rank != 0:
        return results
    store.wait([key(r) for r in range(topology.world_size)], timedelta(seconds=timeout_s))
    return [pickle.loads(store.get(key(r))) for r in range(topology.world_size)]


def log_history(results: list[MeshResult], summary: dict) -> list[dict]:
    """The Trainer's log history for the mesh run: the fast replicas' mean loss per step, and the
    measured bytes per token by circuit on the last line (what ``meshtune report`` and
    ``trainer_state.json`` readers expect)."""
    per_replica = [r.losses for r in results if r.role == "fast" and r.losses]
    steps = min((len(losses) for losses in per_replica), default=0)
    first = min((r.first_step for r in results if r.role == "fast"), default=0)  # > 0 in a resumed run
    history = [
        {"step": first + i + 1, "loss": statistics.fmean(losses[i] for losses in per_replica)} for i in range(steps)
    ]
    _step_metric_entries(results, history)
    _governor_entries(results, history, first)
    if history:
        for kind in ("measured", "booked", "wire"):
            figures = summary[f"{kind}_bytes_per_token"]
            history[-1].update({f"comm/{kind}_{name}_bytes_per_token": float(v) for name, v in figures.items()})
        for name, value in summary.get("memory_max_gib", {}).items():  # the largest process's, by part
            history[-1][f"memory/{name}(GiB)"] = value
    return history


def _step_metric_entries(results: list[MeshResult], history: list[dict]) -> None:
    """Each step's other metrics (RL's rewards, lengths, clip ratios, time split), the mean over the fast
    replicas that logged them, on that step's line under the names TRL logs them by."""
    per_replica = [r.step_metrics for r in results if r.role == "fast" and r.step_metrics]
    for i, line in enumerate(history[: min((len(m) for m in per_replica), default=0)]):
        names = {name for metrics in per_replica for name in metrics[i]}
        for name in sorted(names):
            values = [metrics[i][name] for metrics in per_replica if name in metrics[i]]
            line[name] = statistics.fmean(values)


def _governor_entries(results: list[MeshResult], history: list[dict], first: int) -> None:
    """Governed: each anchor round's ``fidelity/*`` and ``governor/*`` entries on the line of the step after
    its snapshot, and on every line the level each boundary's forward used (``governor/b<k>/level``, from
    fast replica 0's switches), as the single-process run logs them."""
    anchor = next((r for r in results if r.role == "anchor" and r.stage == 0 and r.fidelity), None)
    fast = next((r for r in results if r.role == "fast" and r.replica == 0 and r.stage == 0), None)
    if anchor is None or fast is None or not history:
        return
    by_step = {line["step"]: line for line in history}
    for entries in anchor.fidelity:
        line = by_step.get(int(entries["fidelity/step"]) + 1)
        if line is not None:
            line.update(entries)
    if first > 0 or not anchor.levels:  # a resumed run starts at its checkpoint's levels, not the richest
        return
    ladder = {
        key.split("/")[2] for key in anchor.fidelity[0] if key.startswith("fidelity/b0/") and key.endswith("/cos")
    }
    levels = [len(ladder) - 1] * len(anchor.levels[0][2])  # the first forward runs at the richest level
    changes = {step: list(new) for step, _, new in fast.levels}
    for line in history:  # the line of step s + 1 logs the forward of step s
        for b, level in enumerate(levels):
            line[f"governor/b{b}/level"] = float(level)
        levels = changes.get(line["step"] - 1, levels)


GIB = 1024**3


def memory_table(results: list[MeshResult]) -> list[dict]:
    """Every process's memory (``memory``) in GiB, with its rank, replica, stage and role."""
    rows = []
    for r in sorted(results, key=lambda r: r.rank):
        if r.memory:
            rows.append(
                {"rank": r.rank, "replica": r.replica, "stage": r.stage, "role": r.role}
                | {name: value / GIB for name, value in r.memory.items()}
            )
    return rows


def wire_bytes_per_token(summary: dict) -> dict[str, float] | None:
    """A ``mesh_summary.json``'s traffic per fast token by circuit (measured sends + booked all-reduces).

    Summaries written before the two kinds were told apart have no ``wire_bytes_per_token``; their
    ``measured_bytes_per_token`` held the same sum under that name. None when neither is there.
    """
    return summary.get("wire_bytes_per_token") or summary.get("measured_bytes_per_token")


def summarize(results: list[MeshResult], topology: MeshTopology, trainer, seq_len: int) -> dict:
    """Bytes per fast token by circuit (all ranks) next to the analytic ledger, and more.

    Three figures per circuit: ``measured`` (payload of point-to-point sends, counted from the
    tensors), ``booked`` (all-reduces as ring traffic, 2·(n-1)/n × the tensor bytes: a formula) and
    ``wire`` (their sum, what the ledger predicts).
    """
    fast = [r for r in results if r.role == "fast"]
    tokens = sum(r.tokens for r in fast if r.stage == 0)
    calibration = sum(r.calibration_bytes for r in results)
    measured = {c: sum(r.wire["sent"][c] for r in results) / max(tokens, 1) for c in CIRCUITS}
    measured["pp_fwd"] -= calibration / max(tokens, 1)  # the one-off pass is reported on its own below
    booked = {c: sum(r.wire["booked"][c] for r in results) / max(tokens, 1) for c in CIRCUITS}
    wire = {c: measured[c] + booked[c] for c in CIRCUITS}
    for figures in (measured, booked, wire):
        figures["total"] = sum(figures.values())
    steps = max((r.steps for r in fast), default=0)
    rounds = max((len(r.anchor_rounds) for r in results if r.role == "anchor"), default=0)
    before = {c: sum(r.wire.get("uncoded", {}).get(c, 0.0) for r in fast) for c in ("pp_fwd", "pp_bwd")}
    after = {c: sum(r.wire.get("coded", {}).get(c, 0.0) for r in fast) for c in ("pp_fwd", "pp_bwd")}
    uncoded, coded = sum(before.values()), sum(after.values())
    # measured: the fast boundaries' records before / after the coder, per direction (None: no coder)
    ratios = measured_ratios(before["pp_fwd"], after["pp_fwd"], before["pp_bwd"], after["pp_bwd"]) if coded else None
    settings = _ledger_settings(topology, trainer, seq_len, tokens // max(steps * len(topology.fast_replicas), 1))
    settings = dataclasses.replace(settings, coding_ratio=ratios)
    analytic = _analytic(trainer.model, settings, rounds, max(steps, 1))
    syncs = [(r.dp_syncs, sum(r.dp_sync_bytes)) for r in fast]
    sync_count = sum(n for n, _ in syncs)
    staleness = [arrival - snapshot for r in fast for arrival, snapshot in r.arrivals]
    step_seconds = [s for r in fast for s in r.step_seconds[1:]] or [s for r in fast for s in r.step_seconds]
    memory = memory_table(results)
    num_layers = len(find_decoder_layers(trainer.model)[1])
    return {
        "mesh": f"{topology.replicas}x{topology.stages}",
        "stage_layers": [len(r) for r in split_stages(num_layers, topology.stages, topology.stage_layers)],
        # boundaries between stages on one host (this process's replica): dense, counted apart from the WAN
        "local_boundaries": list(topology.local_boundaries),
        "local_bytes_per_token": sum(r.wire["sent"].get(LOCAL, 0) + r.wire["booked"].get(LOCAL, 0) for r in results)
        / max(tokens, 1),
        "fast_replicas": len(topology.fast_replicas),
        "replicas_reported": len({r.replica for r in results}),
        "heals": [{"rank": r.rank, "own_step": own, "peer_step": peer} for r in results for own, peer in r.heals],
        "anchor": topology.anchor,
        "steps": steps,
        "fast_tokens": tokens,  # real tokens: each row up to its last labelled position (what the wire carries)
        "seq_len": seq_len,
        "measured_bytes_per_token": measured,  # point-to-point payloads, counted
        "booked_bytes_per_token": booked,  # all-reduces at the ring's 2(n-1)/n, a formula
        "wire_bytes_per_token": wire,  # the two together: the analytic ledger's counterpart
        "codec_calibration_bytes": calibration,  # sent once before the first step, not in pp_fwd above
        # the lossless coder (+zstd): the boundary records' bytes before / after it, measured; per token
        # "pp_uncoded_bytes_per_token" is what the boundaries would have sent without it
        "pp_coding_ratio": uncoded / coded if coded else None,
        "pp_coding_ratios": ratios,  # (forward, backward), what the analytic ledger above divides the records by
        "pp_uncoded_bytes_per_token": measured["pp_fwd"] + measured["pp_bwd"] + (uncoded - coded) / max(tokens, 1)
        if coded
        else None,
        "analytic_bytes_per_token": analytic,
        "analytic_settings": dataclasses.asdict(settings),
        "dp_syncs_per_rank": sync_count / max(len(fast), 1),
        "dp_bytes_per_sync_per_rank": (sum(b for _, b in syncs) / sync_count) if sync_count else 0.0,
        "anchor_rounds": rounds,
        "anchor_arrivals": len(staleness),
        "anchor_staleness_mean": statistics.fmean(staleness) if staleness else None,
        "anchor_staleness_max": max(staleness) if staleness else None,
        "codec_refits": max((len(r.geometry) for r in fast), default=0),  # geometry switches from the anchor's fits
        "step_seconds_mean": statistics.fmean(step_seconds) if step_seconds else None,
        **stage_time_split(fast),
        "final_loss": fast[-1].losses[-1] if fast and fast[-1].losses else None,
        "mesh_env": os.environ.get(MESH_ENV),
        "resumed_from_step": min((r.first_step for r in fast), default=0),
        "anchor_lost_at_step": min((r.anchor_lost_at for r in fast if r.anchor_lost_at is not None), default=None),
        "memory_gib": memory,  # per process: counted parts, the kernel's peak RSS (memory)
        "memory_predicted_gib": predicted_memory(trainer, topology, seq_len),  # memory_ledger, per (role, stage)
        "memory_max_gib": {k: max(row[k] for row in memory) for k in _MEMORY_KEYS} if memory else {},
        **_rollout_summary(results),
    }


def stage_time_split(fast: list[MeshResult]) -> dict:
    """Per fast rank, the mean step and its pipeline part split into this stage's computing (its chunks'
    forwards and backwards, coding and decoding) and waiting on its neighbours; the first step (warm-up) left
    out where there are more. ``slowest_stage``: the stage that computes longest, averaged over the replicas,
    the one the others wait for (a straggler: give its host fewer layers, ``stage_layers``)."""

    def mean(values: list[float]) -> float:
        kept = values[1:] or values
        return statistics.fmean(kept) if kept else 0.0

    split = []
    for r in sorted(fast, key=lambda r: r.rank):
        pipeline, compute = mean(r.pipeline_seconds), mean(r.compute_seconds)
        split.append(
            {
                "rank": r.rank,
                "replica": r.replica,
                "stage": r.stage,
                "step_s": mean(r.step_seconds),
                "pipeline_s": pipeline,
                "compute_s": compute,
                "wait_s": max(pipeline - compute, 0.0),
            }
        )
    if not split:
        return {}
    stages = sorted({row["stage"] for row in split})
    per_stage = {s: statistics.fmean(row["compute_s"] for row in split if row["stage"] == s) for s in stages}
    slowest = max(stages, key=lambda s: per_stage[s])
    return {
        "step_split_per_rank": split,
        "compute_s_per_stage": [per_stage[s] for s in stages],
        "slowest_stage": {"stage": slowest, "compute_s": per_stage[slowest]},
    }


def _rollout_summary(results: list[MeshResult]) -> dict:
    """RL: the ``rollout`` circuit (generation through the pipelines, sent bytes counted from the tensors)
    per decoded position of the fast replicas (rows × decoding steps), and the fast steps' mean time split."""
    fast = [r for r in results if r.role == "fast"]
    metrics = [m for r in fast for m in r.step_metrics]
    sent = {role: sum(r.wire["sent"].get(ROLLOUT, 0) for r in results if r.role == role) for role in ("fast", "anchor")}
    if not sent["fast"] and not sent["anchor"]:
        return {}
    decoded = sum(m.get("rollout/decoded_tokens", 0.0) for m in metrics)

    def mean(name: str) -> float | None:
        values = [m[name] for m in metrics if name in m]
        return statistics.fmean(values) if values else None

    return {
        "rollout_bytes": sent,  # every process's sends on the rollout circuit, by role
        "rollout_decoded_tokens": decoded,
        "rollout_bytes_per_decoded_token": sent["fast"] / decoded if decoded else None,
        "step_time_split_s": {
            "rollout": mean("time/rollout_s"),
            "pipeline": mean("time/pipeline_s"),
            "update_and_sync": mean("time/update_s"),
        },
    }


_MEMORY_KEYS = ("peak_rss", *MEMORY_PARTS, "counted")


def predicted_memory(trainer, topology: MeshTopology, seq_len: int) -> list[dict]:
    """The memory ledger's prediction for this run: the model's own trainable parameters, or its PEFT
    adapter (the ledger wraps its meta model with the same adapter config)."""
    model, args = trainer.model, trainer.args
    peft_config = (getattr(model, "peft_config", None) or {}).get(getattr(model, "active_adapter", "default"))
    cfg = args.mesh_config
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    settings = MemorySettings(
        num_replicas=topology.replicas,
        num_stages=topology.stages,
        microbatch_size=args.per_device_train_batch_size,
        microbatches=args.gradient_accumulation_steps,
        seq_len=seq_len,
        dtype=str(next(model.parameters()).dtype).removeprefix("torch."),
        anchor=topology.anchor,
        anchor_microbatches=cfg.anchor_microbatches or args.gradient_accumulation_steps,
        powersgd_rank=cfg.dp_powersgd_rank,
        dp_quantize=cfg.dp_quantize,
        spectral_rank=cfg.spectral_rank,
        boundary_codec=cfg.boundary_codec,
        mask_seed=cfg.mask_seed,
        gradient_checkpointing=bool(getattr(args, "gradient_checkpointing", False)),
        stage_layers=topology.stage_layers,
    )
    rows = predict_memory(model.config, settings, trainable.__contains__, peft_config=peft_config)
    return [{k: (v / GIB if isinstance(v, int) and k != "stage" else v) for k, v in row.items()} for row in rows]


def _ledger_settings(topology: MeshTopology, trainer, seq_len: int, tokens_per_step: int) -> LedgerSettings:
    """The ledger's settings for this run: its mesh, knobs, dtype and tokens per step and anchor round."""
    cfg, args = trainer.args.mesh_config, trainer.args
    dtype = str(next(trainer.model.parameters()).dtype).removeprefix("torch.")
    anchor_tokens = args.per_device_train_batch_size * (cfg.anchor_microbatches or args.gradient_accumulation_steps)
    return settings_from_knobs(
        cfg,
        dtype=dtype,
        tokens_per_step=max(tokens_per_step, 1),
        num_replicas=topology.replicas,
        num_stages=topology.stages,
        anchor_every=1,
        anchor_tokens_per_round=anchor_tokens * seq_len,
    )


def _analytic(model, settings: LedgerSettings, rounds: int, steps: int) -> dict[str, float]:
    """The ledger's bytes per token by circuit, the anchor's at the rounds it really ran per fast step.

    The anchor's rounds follow its own pace, not a fixed anchor_every: its per-round part (dense
    pipeline + gradient delivery) scales with the rounds per fast step, R/S (``rounds``/``steps``);
    the outer-update part does not. A(e) = updates + per_round/e, so per_round = 2·(A(1) − A(2)).
    """
    shapes, hidden = param_shapes_of(model), model.config.get_text_config().hidden_size
    ledger = compute_ledger(shapes, hidden, settings)
    anchor = 0.0
    if settings.anchor:
        every2 = compute_ledger(shapes, hidden, dataclasses.replace(settings, anchor_every=2)).anchor
        per_round = 2.0 * (ledger.anchor - every2)
        anchor = (ledger.anchor - per_round) + per_round * rounds / steps
    return {"pp_fwd": ledger.pp_fwd, "pp_bwd": ledger.pp_bwd, "dp": ledger.dp, "anchor": anchor,
            "total": ledger.pp_fwd + ledger.pp_bwd + ledger.dp + anchor}  # fmt: skip
