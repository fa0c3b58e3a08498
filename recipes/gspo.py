"""GSPO with MeshGRPOTrainer on arithmetic with a verifiable reward: every GRPOConfig flag, TRL's
model/LoRA flags and the mesh knobs.

    python recipes/gspo.py --output_dir runs/gspo --max_steps 50 --num_generations 8
    python recipes/gspo.py --output_dir runs/gspo --model_name_or_path runs/sft-lora --use_peft
    accelerate launch --config_file accelerate_configs/cpu_single_process.yaml recipes/gspo.py --output_dir runs/gspo
    meshtune launch --mesh 3x2 --cpu -- recipes/gspo.py --output_dir runs/gspo-mesh --num_stages 2 --anchor true

The policy (default: the embedded SmolLM2-135M-Instruct; `--model_name_or_path` takes any local
causal LM folder, or a PEFT adapter folder such as `recipes/sft.py --use_peft` writes, which is
merged into its base first) answers generated problems "What is a ± b?"; the reward is 1 for the
exact integer (`hf_meshtune.apps.arithmetic.exact_answer_reward`). Defaults are GSPO's:
importance_sampling_level="sequence", loss_type="grpo". Only the policy's training forward/backward
crosses the masked boundaries; generation, the reference model and the reward are dense.

Prints and returns greedy exact-match accuracy on held-out problems before and after training
(`eval_exact_match_before` / `_after`). Launched on a mesh, every replica generates its own rollouts through
its pipeline (`hf_meshtune.rl`); the first process scores the model before training and the saved result
after it (each process keeps only its own stage once trained), the others report None.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field

from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import ModelConfig, get_peft_config

from hf_meshtune import MeshGRPOTrainer, MeshGSPOConfig
from hf_meshtune.apps import arithmetic
from hf_meshtune.apps.assets import smollm2_checkpoint
from hf_meshtune.runtime.job import is_distributed_job


@dataclass
class GSPOScriptArguments:
    train_items: int = field(default=2000, metadata={"help": "Arithmetic prompts to sample rollouts from."})
    eval_items: int = field(
        default=64, metadata={"help": "Held-out problems scored by greedy exact match before and after."}
    )
    max_operand: int = field(default=20, metadata={"help": "Operands lie in [0, max_operand]."})
    operators: str = field(default="+-", metadata={"help": "Operators to draw from (of + - *)."})


def load_policy(model_args: ModelConfig):
    """The model to train; a PEFT adapter folder is merged into its base (a plain model again)."""
    path = model_args.model_name_or_path or str(smollm2_checkpoint())
    if os.path.isfile(os.path.join(path, "adapter_config.json")):
        from peft import AutoPeftModelForCausalLM

        model = AutoPeftModelForCausalLM.from_pretrained(path).merge_and_unload()
    else:
        model = AutoModelForCausalLM.from_pretrained(path)
    return model, AutoTokenizer.from_pretrained(path)


def trained_policy(trainer, model_args: ModelConfig, output_dir: str):
    """The trained policy, whole: the trainer's own on one process; after a mesh run (each process keeps
    only its stage) what ``save_model`` wrote, on the policy it started from where that is an adapter."""
    if not is_distributed_job():
        return trainer.model
    if getattr(trainer.model, "peft_config", None) is not None:
        from peft import PeftModel

        return PeftModel.from_pretrained(load_policy(model_args)[0], output_dir)
    return AutoModelForCausalLM.from_pretrained(output_dir)


def main(argv: list[str] | None = None) -> dict:
    parser = HfArgumentParser((GSPOScriptArguments, MeshGSPOConfig, ModelConfig))
    script, args, model_args = parser.parse_args_into_dataclasses(argv)
    model, tokenizer = load_policy(model_args)
    problems = dict(max_operand=script.max_operand, operators=script.operators)
    held_out = arithmetic.problems(script.eval_items, seed=1, **problems)  # training prompts use seed 0
    trainer = MeshGRPOTrainer(
        model=model,
        reward_funcs=arithmetic.exact_answer_reward,
        args=args,
        train_dataset=arithmetic.prompt_dataset(script.train_items, seed=0, **problems),
        processing_class=tokenizer,
        peft_config=get_peft_config(model_args),
    )
    scoring = trainer.is_world_process_zero()  # on a mesh: one process scores, the others train only
    before = arithmetic.exact_match(trainer.model, tokenizer, held_out) if scoring else None
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    trainer.save_state()
    after = None
    if scoring:
        after = arithmetic.exact_match(trained_policy(trainer, model_args, args.output_dir), tokenizer, held_out)
    rewards = [e["reward"] for e in trainer.state.log_history if "reward" in e]
    metrics = {
        "eval_exact_match_before": before,
        "eval_exact_match_after": after,
        "train_reward_first": rewards[0] if rewards else None,
        "train_reward_last": rewards[-1] if rewards else None,
    }
    trainer.log_metrics("eval", metrics)
    if trainer.args.should_save:
        with open(os.path.join(args.output_dir, "gspo_results.json"), "w") as handle:
            json.dump(metrics, handle, indent=2)
    return metrics


def _leave_the_mesh() -> None:
    """A launched mesh: leave the process group cleanly."""
    import torch

    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1:])
    _leave_the_mesh()
