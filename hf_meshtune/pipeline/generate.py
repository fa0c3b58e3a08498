"""Generation through the distributed pipeline: every stage keeps the KV cache of its own layers.

RL on the mesh samples its rollouts from the policy itself, so generation runs the stages dense (no
boundary codec, no mask). Per decoding step of a replica's pipeline of Y stages:

1. stage 0 embeds the step's tokens (the prompts at the first step, then one token per row), runs its
   layers and sends the hidden state [B, T, H] to stage 1; every stage runs its own layers on what it
   receives (its ``DynamicCache`` holds its layers' keys and values) and sends on;
2. the last stage turns the last position into logits, processes them as ``generate`` does
   (temperature, top-k, top-p, min-p) and picks the next token of every row (argmax, or a draw from
   ``generator``); a row that has produced an end-of-sequence token continues with the pad token;
3. the last stage sends the new tokens and a "finished" flag ([B + 1] int64) to every other stage,
   and the next step starts, until every row has finished or ``max_new_tokens`` are out.

Before the first step stage 0 hands the prompt's shape and padding mask down the pipeline, so only
stage 0 needs the prompts. Positions follow ``generate``: cumulative sum of the padding mask - 1 (0 on
pads) for the prompt, then one more per step. Every message is a measured send on the Wire's
``rollout`` circuit: per step and boundary B·T·H model-dtype words, and 8·(B + 1) bytes to each other
stage for the tokens.

The result on every stage is the completions [B, n] (n ≤ ``max_new_tokens``: the step at which all
rows had finished), the pad token after a row's end, as ``generate`` returns them after the prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import torch
from transformers import DynamicCache, GenerationConfig
from transformers.generation.logits_process import (
    LogitsProcessorList,
    MinPLogitsWarper,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from .._validation import require
from ..comm.wire import ROLLOUT, Wire
from .stage import StageModule

__all__ = ["ROLLOUT_TAGS", "RolloutSettings", "pipelined_generate"]

ROLLOUT_TAGS = {"shape": 8001, "mask": 8002, "hidden": 8003, "tokens": 8004}

# GenerationConfig fields that change what generate() samples, with the value that leaves them off; the
# pipeline does not apply them, so a config that sets one is refused rather than sampled differently
_UNSUPPORTED = {
    "num_beams": 1,
    "num_beam_groups": 1,
    "penalty_alpha": None,
    "repetition_penalty": 1.0,
    "encoder_repetition_penalty": 1.0,
    "no_repeat_ngram_size": 0,
    "bad_words_ids": None,
    "suppress_tokens": None,
    "begin_suppress_tokens": None,
    "forced_bos_token_id": None,
    "forced_eos_token_id": None,
    "sequence_bias": None,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "top_h": None,
    "min_length": 0,
    "min_new_tokens": None,
    "length_penalty": 1.0,
    "exponential_decay_length_penalty": None,
    "renormalize_logits": False,
    "watermarking_config": None,
    "stop_strings": None,
    "max_length": None,  # the pipeline counts new tokens (max_new_tokens), not total length
}


@dataclass(frozen=True)
class RolloutSettings:
    """What a pipelined generation samples: ``generate``'s options that the pipeline applies.

    ``eos_token_ids``: the tokens that end a row (empty: rows end only at ``max_new_tokens``);
    ``pad_token_id``: what a finished row continues with."""

    max_new_tokens: int
    pad_token_id: int
    eos_token_ids: tuple[int, ...] = ()
    do_sample: bool = False
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float | None = None

    def __post_init__(self) -> None:
        ok = isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 1
        require(ok, "max_new_tokens", self.max_new_tokens, "be an int >= 1")
        require(self.temperature > 0, "temperature", self.temperature, "be > 0")
        require(isinstance(self.top_k, int) and self.top_k >= 0, "top_k", self.top_k, "be an int >= 0 (0: off)")
        require(0 < self.top_p <= 1, "top_p", self.top_p, "lie in (0, 1]")
        require(self.min_p is None or 0 <= self.min_p <= 1, "min_p", self.min_p, "be None or lie in [0, 1]")

    @classmethod
    def from_generation_config(cls, config: GenerationConfig, max_new_tokens: int | None = None) -> RolloutSettings:
        """The settings ``generate`` would sample with under ``config`` (TRL builds one from ``GRPOConfig``):
        a field left None takes ``generate``'s default for it (top_k 50 among them), as ``generate`` does;
        an option that ``generate`` would apply and the pipeline does not is refused, naming it."""
        defaults = GenerationConfig._get_default_generation_params()

        def value(name: str, off: object = None) -> Any:
            set_value = getattr(config, name, None)
            return defaults.get(name, off) if set_value is None else set_value

        for name, off in _UNSUPPORTED.items():
            if name == "max_length":
                setting = getattr(config, name, None)  # generate's default 20 yields to max_new_tokens
            else:
                setting = value(name, off)
            require(
                setting == off or (off is None and setting in ((), [])),
                f"generation_config.{name}",
                setting,
                f"be {off!r} for generation through the pipeline (it samples with temperature, top_k, top_p and "
                "min_p only)",
            )
        new_tokens = max_new_tokens if max_new_tokens is not None else config.max_new_tokens
        require(new_tokens is not None, "max_new_tokens", new_tokens, "be set (the number of tokens to generate)")
        assert new_tokens is not None
        eos = config.eos_token_id
        eos_ids = () if eos is None else (int(eos),) if isinstance(eos, int) else tuple(int(e) for e in eos)
        pad = config.pad_token_id if config.pad_token_id is not None else (eos_ids[0] if eos_ids else None)
        require(pad is not None, "generation_config.pad_token_id", pad, "be set (or an eos_token_id to pad with)")
        assert pad is not None
        return cls(
            max_new_tokens=int(new_tokens),
            pad_token_id=int(pad),
            eos_token_ids=eos_ids,
            do_sample=bool(value("do_sample")),
            temperature=float(value("temperature")),
            top_k=int(value("top_k")),
            top_p=float(value("top_p")),
            min_p=config.min_p,
        )

    def processors(self) -> LogitsProcessorList:
        """The warpers ``generate`` applies when sampling, in its order (none for greedy decoding)."""
        out = LogitsProcessorList()
        if not self.do_sample:
            return out
        if self.temperature != 1.0:
            out.append(TemperatureLogitsWarper(self.temperature))
        if self.top_k != 0:
            out.append(TopKLogitsWarper(top_k=self.top_k, min_tokens_to_keep=1))
        if self.top_p < 1.0:
            out.append(TopPLogitsWarper(top_p=self.top_p, min_tokens_to_keep=1))
        if self.min_p is not None:
            out.append(MinPLogitsWarper(min_p=self.min_p, min_tokens_to_keep=1))
        return out


def _positions(attention_mask: torch.Tensor) -> torch.Tensor:
    """``generate``'s prompt positions: cumulative sum of the padding mask - 1, 0 on pads."""
    positions = attention_mask.long().cumsum(-1) - 1
    return positions.masked_fill(attention_mask == 0, 0)


@torch.no_grad()
def pipelined_generate(
    module: StageModule,
    wire: Wire,
    stage_ranks: list[int],
    settings: RolloutSettings,
    prompt_ids: torch.Tensor | None = None,
    attention_mask: torch.Tensor | None = None,
    *,
    group=None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Generate completions through a replica's pipeline; every stage of it calls this together.

    Args:
        module: this process's stage (``module.stage`` of ``len(stage_ranks)``).
        wire: this process's Wire; every send is booked on its ``rollout`` circuit.
        stage_ranks: the global rank of each stage of the replica, stage order.
        settings: what to sample (``RolloutSettings``).
        prompt_ids, attention_mask: [B, T] left-padded prompts and their padding mask, on stage 0 only
            (``attention_mask`` None: no padding); the other stages receive what they need.
        group: the replica's pipeline process group (None: the default group).
        generator: the last stage's draws (sampling); None uses torch's global generator, as ``generate``.

    Returns:
        The completions [B, n] on every stage, ``settings.pad_token_id`` after a row's end.
    """
    stages = len(stage_ranks)
    stage = module.stage
    require(
        module.num_stages == stages and 0 <= stage < stages,
        "stage_ranks",
        stage_ranks,
        f"name the {module.num_stages} stages of this replica's pipeline (this is stage {stage})",
    )
    first, last = stage == 0, stage == stages - 1
    prev_rank = stage_ranks[stage - 1] if not first else None
    next_rank = stage_ranks[stage + 1] if not last else None
    param = next(module.parameters())
    device, dtype = param.device, param.dtype

    if first:
        require(
            prompt_ids is not None and prompt_ids.dim() == 2 and prompt_ids.shape[1] >= 1,
            "prompt_ids",
            None if prompt_ids is None else tuple(prompt_ids.shape),
            "be a [B, T] tensor of token ids on the first stage",
        )
        assert prompt_ids is not None
        prompt_ids = prompt_ids.to(device)
        mask = (
            torch.ones_like(prompt_ids, dtype=torch.long)
            if attention_mask is None
            else attention_mask.to(device=device, dtype=torch.long)
        )
        require(
            mask.shape == prompt_ids.shape,
            "attention_mask",
            tuple(mask.shape),
            f"have the prompts' shape {tuple(prompt_ids.shape)}",
        )
        shape = torch.tensor(prompt_ids.shape, dtype=torch.long)
    else:
        assert prev_rank is not None  # not the first stage
        shape = torch.empty(2, dtype=torch.long)
        wire.recv(ROLLOUT, shape, prev_rank, group=group, tag=ROLLOUT_TAGS["shape"])
        mask = torch.empty(int(shape[0]), int(shape[1]), dtype=torch.long)
        wire.recv(ROLLOUT, mask, prev_rank, group=group, tag=ROLLOUT_TAGS["mask"])
        mask = mask.to(device)
    if not last:  # hand the shape and the padding down before the first hidden state
        assert next_rank is not None
        wire.send(ROLLOUT, shape, next_rank, group=group, tag=ROLLOUT_TAGS["shape"])
        wire.send(ROLLOUT, mask.cpu(), next_rank, group=group, tag=ROLLOUT_TAGS["mask"])

    batch, prompt_len = int(shape[0]), int(shape[1])
    hidden_size = module.hidden_size
    padded = bool((mask == 0).any())
    cache = DynamicCache(config=module.config)
    positions = _positions(mask)
    processors = settings.processors() if last else None
    eos = torch.tensor(settings.eos_token_ids, dtype=torch.long, device=device)
    unfinished = torch.ones(batch, dtype=torch.long, device=device)
    tokens_in = prompt_ids if first else None
    completions: list[torch.Tensor] = []
    message = torch.empty(batch + 1, dtype=torch.long)  # the new tokens, then "every row finished"
    for step in range(settings.max_new_tokens):
        length = prompt_len if step == 0 else 1
        if first:
            assert tokens_in is not None  # the prompts, then each step's new tokens
            x = tokens_in
        else:
            assert prev_rank is not None  # not the first stage
            x = torch.empty(batch, length, hidden_size, dtype=dtype)
            wire.recv(ROLLOUT, x, prev_rank, group=group, tag=ROLLOUT_TAGS["hidden"])
            x = x.to(device)
        out = module.decode(x, cache, mask if padded else None, positions[:, -length:])
        if not last:
            assert next_rank is not None
            wire.send(ROLLOUT, out.contiguous().cpu(), next_rank, group=group, tag=ROLLOUT_TAGS["hidden"])
            wire.recv(ROLLOUT, message, stage_ranks[-1], group=group, tag=ROLLOUT_TAGS["tokens"])
            new, done = message[:batch].clone().to(device), bool(message[batch])  # the buffer is reused
        else:
            scores = out[:, -1, :].to(dtype=torch.float32)
            history = torch.cat(completions, dim=1) if completions else torch.empty(batch, 0, dtype=torch.long)
            assert processors is not None  # the last stage's
            # transformers annotates input_ids as the legacy torch.LongTensor class, which no tensor is statically
            scores = processors(cast(torch.LongTensor, history.to(device)), scores)
            if settings.do_sample:
                probs = torch.softmax(scores, dim=-1)
                new = torch.multinomial(probs, num_samples=1, generator=generator).squeeze(1)
            else:
                new = torch.argmax(scores, dim=-1)
            new = new * unfinished + settings.pad_token_id * (1 - unfinished)
            if eos.numel():
                unfinished = unfinished * (~torch.isin(new, eos)).long()
            done = bool(unfinished.max() == 0) or step == settings.max_new_tokens - 1
            message[:batch] = new.cpu()
            message[batch] = int(done)
            for rank in stage_ranks[:-1]:
                wire.send(ROLLOUT, message, rank, group=group, tag=ROLLOUT_TAGS["tokens"])
        completions.append(new.view(batch, 1))
        if done:
            break
        tokens_in = new.view(batch, 1) if first else None
        mask = torch.cat([mask, torch.ones(batch, 1, dtype=mask.dtype, device=device)], dim=1)
        positions = torch.cat([positions, positions[:, -1:] + 1], dim=1)
    return torch.cat(completions, dim=1)
