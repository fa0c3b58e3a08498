"""A replica's RL batches on the mesh: prompts → rollouts through its pipeline → rewards → advantages.

On the mesh a replica's step reads ``batches(step)`` on every stage at once, so for GRPO/GSPO that call
is where the step's rollouts are made (``MeshRollouts``), as TRL's ``_generate_and_score_completions``
makes them on one process:

1. every stage draws the step's prompts itself (a pure function of seed, replica and step, so no stage
   waits for another to learn them), repeats each ``num_generations`` times in a row (TRL's
   ``RepeatSampler``) and tokenizes them with TRL's own ``_tokenize_prompts`` (chat template for
   conversational prompts), left-padded;
2. the completions come from ``pipeline.generate.pipelined_generate``: dense, each stage with the KV
   cache of its own layers, the last stage sampling with TRL's settings from a generator seeded by
   (seed, replica, step); the mask keeps each row up to and including its first EOS, as TRL's does;
3. the last stage (which holds the tokenizer and every column of the prompts' rows) decodes them and
   calls TRL's reward functions with TRL's arguments, weights them and turns them into group advantages
   (``group_advantages``: TRL's formula, ``scale_rewards`` and ``multi_objective_aggregation``);
4. every stage packs the batch as ``rl.loss.pack_rollouts`` does: stage 0 feeds the ids, the last stage
   the loss target. Middle stages need neither; packing is cheap, so all run the same code;
5. with β > 0, π_ref's log-probabilities: one dense no-grad forward of the packed ids through the
   replica's stages with the reference weights (TRL's reference model, each stage holding only its own
   layers of it, or with a PEFT policy the same stage with its adapters disabled); the last stage writes
   them into the target. Left-aligned rows need no padding mask (``rl.loss``).

π_old is the training forward's own detached log-probability (one iteration per generation), so the
importance ratio is 1 at the point of the step and its gradient is the policy's; the codec sits in the
same forward that is differentiated, not between π_old and π_θ.

The step's outcome is cached, so a second call for the same step (the codecs' calibration reads step 0
before training step 0) returns it without generating again.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
from trl.trainer.utils import nanstd, pad, use_adapter

from .._validation import require
from ..boundary.masking import stable_seed
from ..comm.wire import ROLLOUT, Wire
from ..pipeline.generate import RolloutSettings, pipelined_generate
from ..pipeline.placement import release_unowned
from ..pipeline.stage import StageModule
from .loss import TARGET_FIELDS, pack_rollouts

__all__ = [
    "REFERENCE_ADAPTER",
    "REFERENCE_TAG",
    "AdvantageSettings",
    "MeshRollouts",
    "completion_mask",
    "group_advantages",
]

REFERENCE_TAG = 8005  # π_ref's scoring pass between pipeline neighbours
REFERENCE_ADAPTER = "disabled-adapter"  # π_ref is the PEFT policy with its adapters disabled


@dataclass(frozen=True)
class AdvantageSettings:
    """How TRL turns rewards into advantages (``GRPOConfig`` names them the same way)."""

    num_generations: int
    weights: tuple[float, ...]
    scale_rewards: str = "group"
    multi_objective_aggregation: str = "sum_then_normalize"

    def __post_init__(self) -> None:
        require(self.num_generations >= 2, "num_generations", self.num_generations, "be >= 2 (a group needs peers)")
        require(
            self.scale_rewards in ("group", "batch", "none"),
            "scale_rewards",
            self.scale_rewards,
            "be one of ['group', 'batch', 'none']",
        )
        require(
            self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
            "multi_objective_aggregation",
            self.multi_objective_aggregation,
            "be 'sum_then_normalize' or 'normalize_then_sum'",
        )


def group_advantages(rewards_per_func: torch.Tensor, settings: AdvantageSettings) -> tuple[torch.Tensor, torch.Tensor]:
    """TRL's advantages of a batch whose rows come in groups of ``num_generations`` (one prompt each):
    ``rewards_per_func`` [B, F] (NaN where a function returned None) → (advantages [B], the weighted reward
    [B] as TRL logs it, NaN for a row no function scored). A transcription of
    ``GRPOTrainer._generate_and_score_completions``."""
    weights = torch.tensor(settings.weights, dtype=torch.float32)
    g = settings.num_generations
    unscorable = torch.isnan(rewards_per_func).all(dim=1)
    if settings.multi_objective_aggregation == "sum_then_normalize":
        rewards = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        mean = torch.nanmean(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        if settings.scale_rewards == "batch":
            std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        else:
            std = nanstd(rewards.view(-1, g), dim=1).repeat_interleave(g, dim=0)
        advantages = rewards - mean
        if settings.scale_rewards != "none":
            advantages = advantages / (std + 1e-4)
    else:
        grouped = rewards_per_func.view(-1, g, rewards_per_func.shape[1])
        scaled = (grouped - torch.nanmean(grouped, dim=1, keepdim=True)) / (nanstd(grouped, dim=1, keepdim=True) + 1e-4)
        rewards = (scaled.view(-1, rewards_per_func.shape[1]) * weights.unsqueeze(0)).nansum(dim=1)
        rewards[unscorable] = torch.nan
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
        advantages = (rewards - torch.nanmean(rewards)) / (std + 1e-4)
    logged = (rewards_per_func * weights.unsqueeze(0)).nansum(dim=1)
    logged[unscorable] = torch.nan
    return torch.nan_to_num(advantages, nan=0.0), logged


def completion_mask(completion_ids: torch.Tensor, eos_token_ids: Sequence[int]) -> torch.Tensor:
    """1 up to and including each row's first end-of-sequence token, 0 after it (TRL's rule)."""
    is_eos = torch.isin(completion_ids, torch.tensor(list(eos_token_ids), dtype=torch.long))
    first = torch.full((is_eos.size(0),), is_eos.size(1), dtype=torch.long)
    ended = is_eos.any(dim=1)
    first[ended] = is_eos.int().argmax(dim=1)[ended]
    return (torch.arange(is_eos.size(1)).expand_as(is_eos) <= first.unsqueeze(1)).long()


class MeshRollouts:
    """``batches(step)`` of a GRPO/GSPO replica on the mesh (module docstring): ``(ids [B, T], target [B, T, 6])``.

    Args:
        prompts: step → the step's dataset rows (dicts with a ``prompt``), ``B / num_generations`` of them.
        tokenize: prompts → their token ids (lists), as TRL tokenizes them for generation.
        decode: completion token lists → what the reward functions receive as ``completions``.
        reward_funcs, reward_names: TRL's reward functions (callables, sync or async) and their log names.
        advantages: how rewards become advantages.
        rollout: what to sample (``pipeline.generate.RolloutSettings``).
        seq_len: T, the longest prompt plus ``max_new_tokens``.
        rows: B, the rows of a step.
        seed, tag: with the replica and the step, the seed of the last stage's draws.
        mask_truncated_completions: TRL's option: a row that never ended counts nothing in the loss.
        reward_kwargs: extra keyword arguments every reward function receives (TRL's ``trainer_state``).
        reference: None (β = 0), TRL's reference model (every process holds it whole until bound), or
            ``REFERENCE_ADAPTER`` (a PEFT policy: its "ref" adapter where it has one, else adapters disabled,
            as TRL does).
        temperature: what π_ref's logits are divided by (TRL's ``temperature``).
        score_rows: rows per chunk of π_ref's scoring pass (None: the whole step at once).
    """

    def __init__(
        self,
        *,
        prompts: Callable[[int], list[dict]],
        tokenize: Callable[[list], list[list[int]]],
        decode: Callable[[list[list[int]]], list],
        reward_funcs: Sequence[Callable],
        reward_names: Sequence[str],
        advantages: AdvantageSettings,
        rollout: RolloutSettings,
        seq_len: int,
        rows: int,
        seed: int,
        tag: int,
        mask_truncated_completions: bool = False,
        reward_kwargs: dict | None = None,
        reference: torch.nn.Module | str | None = None,
        temperature: float = 1.0,
        score_rows: int | None = None,
    ) -> None:
        g = advantages.num_generations
        require(
            rows % g == 0,
            "num_generations",
            g,
            f"divide the rows a replica trains on per step ({rows} = per_device_train_batch_size · "
            "gradient_accumulation_steps; the anchor: · anchor_microbatches): every prompt's group lies in one replica",
        )
        names = list(reward_names)
        require(len(reward_funcs) == len(names), "reward_names", names, "name every reward function")
        require(
            len(advantages.weights) == len(reward_funcs),
            "reward_weights",
            list(advantages.weights),
            f"hold one weight per reward function ({len(reward_funcs)})",
        )
        self.prompts, self.tokenize, self.decode = prompts, tokenize, decode
        self.reward_funcs, self.reward_names = list(reward_funcs), list(reward_names)
        self.advantages, self.rollout = advantages, rollout
        self.seq_len, self.rows, self.seed, self.tag = seq_len, rows, seed, tag
        self.mask_truncated_completions = mask_truncated_completions
        self.reward_kwargs = dict(reward_kwargs or {})
        self.reference, self.temperature, self.score_rows = reference, temperature, score_rows
        self.reference_module: StageModule | None = None
        self._reference_context: Callable = contextlib.nullcontext
        self.metrics: dict[str, list[float]] = defaultdict(list)
        self._cached: tuple[int, tuple[torch.Tensor, torch.Tensor]] | None = None
        self.module: StageModule | None = None
        self.wire: Wire | None = None
        self.group = None  # the replica's pipeline process group (None: the default group)
        self.stage_ranks: list[int] = []
        self.replica = 0

    def bind(self, worker) -> None:
        """Generate through ``worker``'s stage: its module, Wire and replica's pipeline group."""
        topology, replica = worker.topology, worker.replica
        self.module, self.wire, self.group, self.replica = worker.module, worker.wire, worker.groups.pp_group, replica
        self.stage_ranks = [topology.process_rank(topology.rank(replica, s)) for s in range(topology.stages)]
        if self.reference == REFERENCE_ADAPTER:  # as TRL: its "ref" adapter where it has one, else none
            model = worker.model
            adapter = "ref" if "ref" in model.peft_config else None
            self.reference_module = worker.module
            self._reference_context = lambda: use_adapter(model, adapter_name=adapter)
        elif self.reference is not None:  # TRL's reference model: this stage's layers of it, the rest given back
            assert isinstance(self.reference, torch.nn.Module)  # the one string is REFERENCE_ADAPTER
            stage, stages = worker.stage, topology.stages
            self.reference_module = StageModule(
                self.reference, stage, stages, None, None, stage_layers=topology.stage_layers
            )
            release_unowned(self.reference, self.reference_module, stage, stages)

    def __call__(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self._cached is None or self._cached[0] != step:
            self._cached = (step, self._make(step))
        return self._cached[1]

    def pop_metrics(self) -> dict[str, float]:
        """The means of what the last step made logged (TRL's names), then clears them."""
        out = {name: sum(values) / len(values) for name, values in self.metrics.items() if values}
        self.metrics.clear()
        return out

    # --- one step ---------------------------------------------------------------------------------
    def _make(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        require(self.module is not None, "MeshRollouts", None, "be bound to a stage (bind(worker)) before use")
        assert self.module is not None
        # the metrics are this step's alone: a resumed run's codec calibration made step 0's, never trained on
        self.metrics.clear()
        rows = self._rows(step)
        prompt_ids, prompt_mask = self._prompt_tensors(
            [row["prompt"] for row in rows[:: self.advantages.num_generations]]
        )
        start = time.perf_counter()
        completions = self._generate(step, prompt_ids, prompt_mask)
        self.metrics["time/rollout_s"].append(time.perf_counter() - start)
        full = completion_mask(completions, self.rollout.eos_token_ids)
        # TRL's "ended": the row's last kept token is an end-of-sequence or the pad token
        last = completions.gather(1, (full.sum(1) - 1).unsqueeze(1)).squeeze(1)
        ended = torch.isin(last, torch.tensor([*self.rollout.eos_token_ids, self.rollout.pad_token_id]))
        mask = full * ended.long().unsqueeze(1) if self.mask_truncated_completions else full
        advantages = torch.zeros(len(rows))
        if self.module.stage == self.module.num_stages - 1:
            advantages = self._score(rows, completions, full, mask, ended)
        ids, target = pack_rollouts(
            prompt_ids, prompt_mask, completions, mask, advantages, self.seq_len, self.rollout.pad_token_id
        )
        if self.reference_module is not None:
            start = time.perf_counter()
            self._score_reference(ids, target)
            self.metrics["time/reference_s"].append(time.perf_counter() - start)
        return ids, target

    @torch.no_grad()
    def _score_reference(self, ids: torch.Tensor, target: torch.Tensor) -> None:
        """π_ref's per-token log-probabilities into ``target`` (last stage): a dense forward of ``ids``
        through the replica's stages with the reference weights, ``score_rows`` rows at a time."""
        assert self.reference_module is not None and self.module is not None and self.wire is not None  # bound
        module, stage = self.reference_module, self.module.stage
        first, last = stage == 0, stage == self.module.num_stages - 1
        param = next(module.parameters())
        rows = self.score_rows or ids.shape[0]
        next_id, mask, ref = (TARGET_FIELDS.index(name) for name in ("next_id", "mask", "ref_logp"))
        with self._reference_context(), _dense(module):
            for start in range(0, ids.shape[0], rows):
                chunk = slice(start, start + rows)
                if first:
                    x = ids[chunk].to(param.device)
                else:
                    x = torch.empty(ids[chunk].shape[0], ids.shape[1], module.hidden_size, dtype=param.dtype)
                    self.wire.recv(ROLLOUT, x, self.stage_ranks[stage - 1], group=self.group, tag=REFERENCE_TAG)
                    x = x.to(param.device)
                out = module(x)
                if not last:
                    dst = self.stage_ranks[stage + 1]
                    self.wire.send(ROLLOUT, out.contiguous().cpu(), dst, group=self.group, tag=REFERENCE_TAG)
                    continue
                logps = torch.log_softmax(out.float() / self.temperature, dim=-1)
                picked = logps.gather(-1, target[chunk, :, next_id].long().unsqueeze(-1).to(logps.device))
                target[chunk, :, ref] = picked.squeeze(-1).cpu() * (target[chunk, :, mask] > 0)

    def _generate(self, step: int, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor) -> torch.Tensor:
        """The step's completions [B, n] on every stage, sampled by the last from a per-(replica, step) seed."""
        assert self.module is not None and self.wire is not None  # bound
        generator = None
        if self.rollout.do_sample:
            generator = torch.Generator(device=next(self.module.parameters()).device)
            generator.manual_seed(stable_seed(b"meshtune-rollout", self.seed, self.tag, self.replica, step))
        first = self.module.stage == 0
        completions = pipelined_generate(
            self.module,
            self.wire,
            self.stage_ranks,
            self.rollout,
            prompt_ids if first else None,
            prompt_mask if first else None,
            group=self.group,
            generator=generator,
        )
        return completions.cpu()

    def _rows(self, step: int) -> list[dict]:
        prompts = self.prompts(step)
        g = self.advantages.num_generations
        require(
            len(prompts) * g == self.rows,
            "prompts per step",
            len(prompts),
            f"be rows / num_generations = {self.rows // g}",
        )
        return [dict(row) for row in prompts for _ in range(g)]

    def _prompt_tensors(self, prompts: list) -> tuple[torch.Tensor, torch.Tensor]:
        """The step's distinct prompts tokenized once, left-padded with TRL's ``pad`` as TRL pads them for
        generation, each row then repeated for its group: (ids, mask) [B, P]."""
        ids = [torch.tensor(row, dtype=torch.long) for row in self.tokenize(prompts)]
        padded = pad(ids, padding_value=self.rollout.pad_token_id, padding_side="left")
        mask = pad([torch.ones_like(row) for row in ids], padding_value=0, padding_side="left")
        g = self.advantages.num_generations
        return padded.repeat_interleave(g, dim=0), mask.repeat_interleave(g, dim=0)

    def _score(self, rows: list[dict], completions, full, mask, ended) -> torch.Tensor:
        """The last stage: TRL's reward calls, weights and advantages; the step's reward and length metrics."""
        kept = [ids[m.bool()].tolist() for ids, m in zip(completions, full)]
        texts = self.decode(kept)
        prompts = [row["prompt"] for row in rows]
        columns = {key: [row[key] for row in rows] for key in rows[0] if key not in ("prompt", "completion")}
        kwargs = {**columns, **self.reward_kwargs, "log_metric": self._log_metric, "log_extra": _ignore}
        per_func = torch.zeros(len(rows), len(self.reward_funcs))
        for i, (func, name) in enumerate(zip(self.reward_funcs, self.reward_names)):
            out = func(prompts=prompts, completions=texts, completion_ids=kept, **kwargs)
            if inspect.isawaitable(out):
                out = asyncio.run(_awaited(out))
            out = [torch.nan if value is None else value for value in out]
            require(
                len(out) == len(rows),
                f"reward function {name!r}",
                f"{len(out)} rewards",
                f"return one reward per completion ({len(rows)})",
            )
            per_func[:, i] = torch.tensor(out, dtype=torch.float32)
        advantages, rewards = group_advantages(per_func, self.advantages)
        self._record(per_func, rewards, mask, ended, torch.tensor([len(k) for k in kept], dtype=torch.float32))
        return advantages

    def _log_metric(self, name: str, value: float) -> None:
        self.metrics[name].append(float(value))

    def _record(self, per_func, rewards, mask, ended, lengths) -> None:
        g = self.advantages.num_generations
        for i, name in enumerate(self.reward_names):
            self.metrics[f"rewards/{name}/mean"].append(float(torch.nanmean(per_func[:, i])))
            self.metrics[f"rewards/{name}/std"].append(float(nanstd(per_func[:, i])))
        self.metrics["reward"].append(float(torch.nanmean(rewards)))
        self.metrics["reward_std"].append(float(nanstd(rewards)))
        group_std = nanstd(rewards.view(-1, g), dim=1)
        self.metrics["frac_reward_zero_std"].append(float(torch.isclose(group_std, torch.zeros(())).float().mean()))
        self.metrics["completions/mean_length"].append(float(lengths.mean()))
        self.metrics["completions/min_length"].append(float(lengths.min()))
        self.metrics["completions/max_length"].append(float(lengths.max()))
        self.metrics["completions/clipped_ratio"].append(float((~ended).float().mean()))
        terminated = lengths[ended]
        if terminated.numel():
            self.metrics["completions/mean_terminated_length"].append(float(terminated.mean()))
        self.metrics["num_tokens"].append(float(mask.sum()))
        self.metrics["rollout/decoded_tokens"].append(float(mask.shape[0] * mask.shape[1]))


@contextlib.contextmanager
def _dense(module: StageModule):
    """``module`` run dense for a pass that is not training: no codec or mask on its sides, nothing recorded
    for a geometry refit and no fidelity probe (every stage of the replica runs the same pass so)."""
    names = ("dense", "mask_in", "mask_out", "record", "probe")
    saved = [getattr(module, name) for name in names]
    for name, value in zip(names, (True, None, None, None, None)):
        setattr(module, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(module, name, value)


async def _awaited(value):
    return await value


def _ignore(*args, **kwargs) -> None:
    """TRL's ``log_extra`` (extra columns of the completions table): the mesh keeps no such table."""
