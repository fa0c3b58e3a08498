"""A user's single-process MeshGRPOTrainer (TRL) script, unchanged, run by tests on a launched mesh.

    python tests/scripts/mesh_grpo.py --output_dir OUT [MeshGSPOConfig flags...]

A tiny random Llama with the tiny 100-word tokenizer is rewarded for the share of its completion tokens
whose id lies below 50: about one half at the start with spread inside every group, so GRPO has a signal
from the first step, and a policy that learns it moves the reward towards 1. Rank 0 writes the logged
rewards to ``OUT/rewards.json``.

With ``$MESHTUNE_TEST_FIXED_COMPLETIONS`` set, the mesh's generation is replaced by ``fixed_completion``
(the equivalence test gives single-process TRL the same ones) and the dataset holds exactly one step's prompts;
``$MESHTUNE_TEST_MODEL`` loads the policy from that folder (TRL builds a reference model from the policy's path)
and ``$MESHTUNE_TEST_LORA`` trains ``LORA`` on it.
"""

from __future__ import annotations

import json
import os
import sys

import datasets
import torch
from transformers import AutoModelForCausalLM, HfArgumentParser

from hf_meshtune import MeshGRPOTrainer, MeshGSPOConfig
from tests.tiny import make_tiny_causal_lm, tiny_word_tokenizer


def low_ids_reward(completion_ids: list[list[int]], **kwargs) -> list[float]:
    """The share of a completion's tokens whose id lies below 50."""
    return [sum(t < 50 for t in ids) / max(len(ids), 1) for ids in completion_ids]


MAX_COMPLETION = 8


def fixed_completion(prompt: list[int], position: int) -> list[int]:
    """A known completion of a prompt's ``position``-th generation, different for every position of a
    group: an even position writes 1 + position words and [EOS] (2); an odd one writes MAX_COMPLETION words."""
    length = 1 + position if position % 2 == 0 else MAX_COMPLETION
    words = [3 + (sum(prompt) * (t + 1) + 11 * position) % 97 for t in range(length)]
    return words + [2] if position % 2 == 0 else words


def _fixed_generation(self, step, prompt_ids, prompt_mask):
    """``MeshRollouts._generate`` replaced: every stage computes the same known completions, padded with 0."""
    g = self.advantages.num_generations
    out = torch.zeros(prompt_ids.shape[0], MAX_COMPLETION, dtype=torch.long)
    for row in range(prompt_ids.shape[0]):
        completion = fixed_completion(prompt_ids[row][prompt_mask[row].bool()].tolist(), row % g)
        out[row, : len(completion)] = torch.tensor(completion)
    return out


LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")


def prompts(count: int) -> datasets.Dataset:
    return datasets.Dataset.from_dict(
        {"prompt": [f"w{3 + i % 97} w{3 + (7 * i) % 97} w{3 + (13 * i) % 97}" for i in range(count)]}
    )


def main(argv: list[str]) -> None:
    (args,) = HfArgumentParser(MeshGSPOConfig).parse_args_into_dataclasses(argv)
    fixed = bool(os.environ.get("MESHTUNE_TEST_FIXED_COMPLETIONS"))
    if fixed:
        from hf_meshtune.rl.rollouts import MeshRollouts

        MeshRollouts._generate = _fixed_generation
    path = os.environ.get("MESHTUNE_TEST_MODEL")
    model = AutoModelForCausalLM.from_pretrained(path) if path else make_tiny_causal_lm("llama", hidden=32, layers=4)
    peft_config = None
    if os.environ.get("MESHTUNE_TEST_LORA"):
        from peft import LoraConfig

        peft_config = LoraConfig(**LORA)
    one_step = args.per_device_train_batch_size * args.gradient_accumulation_steps // args.num_generations
    trainer = MeshGRPOTrainer(
        model=model,
        reward_funcs=low_ids_reward,
        args=args,
        train_dataset=prompts(one_step if fixed else 64),
        processing_class=tiny_word_tokenizer(),
        peft_config=peft_config,
    )
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    trainer.save_state()
    if trainer.is_world_process_zero():
        history = trainer.state.log_history
        with open(os.path.join(args.output_dir, "rewards.json"), "w") as handle:
            json.dump([e["reward"] for e in history if "reward" in e], handle)
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
