"""From SFT into RL: MeshSFTTrainer (LoRA optional) → save → GSPO with MeshGRPOTrainer → save.

    python examples/sft_to_gspo.py --output_dir runs/chain --use_peft --sft_steps 60 --gspo_steps 30 -- --num_stages 4
    python examples/sft_to_gspo.py --output_dir runs/chain-mesh --use_peft --mesh 3x2 -- --anchor true

Step 1 runs `recipes/sft.py --dataset arithmetic` (answers "The answer is N."), step 2 runs
`recipes/gspo.py` from what step 1 saved (a LoRA adapter is merged into its base first) with the
exact-answer reward. Flags after `--` go to both recipes (mesh knobs, TrainingArguments: `--mask_ratio`,
`--num_stages`, `--report_to`, ...). Prints greedy exact-match accuracy on 64 held-out problems for
the base model, after SFT and after GSPO, and writes them to OUTPUT_DIR/chain.json.

With `--mesh XxY` both recipes run on a launched X×Y mesh (`meshtune launch`, one launch each, `--cpu`
where no GPU is present, `--num_stages Y` added): SFT, then GSPO from what SFT saved, on the same mesh.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _recipe(name: str):
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", ROOT / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--model_name_or_path", default=None, help="local causal LM folder (default: embedded SmolLM2)")
    parser.add_argument("--use_peft", action="store_true", help="LoRA for both stages")
    parser.add_argument("--sft_steps", type=int, default=60)
    parser.add_argument("--gspo_steps", type=int, default=30)
    parser.add_argument("--sft_lr", type=float, default=2e-4)
    parser.add_argument("--gspo_lr", type=float, default=2e-5)
    parser.add_argument("--num_generations", type=int, default=8)
    parser.add_argument("--eval_items", type=int, default=64)
    parser.add_argument("--mesh", default=None, help="XxY: run both recipes on a launched X×Y mesh")
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    args, shared = parser.parse_args(argv[:split]), argv[split + 1 :]
    model = ["--model_name_or_path", args.model_name_or_path] if args.model_name_or_path else []
    peft = ["--use_peft", "--lora_target_modules", "all-linear"] if args.use_peft else []
    sft_dir, gspo_dir = os.path.join(args.output_dir, "sft"), os.path.join(args.output_dir, "gspo")
    if args.mesh and "--num_stages" not in shared:
        shared = [*shared, "--num_stages", args.mesh.lower().split("x")[1]]

    sft_metrics = _run(
        "sft",
        args.mesh,
        [
            "--output_dir",
            sft_dir,
            "--dataset",
            "arithmetic",
            "--eval_items",
            "16",
            "--max_steps",
            str(args.sft_steps),
            "--learning_rate",
            str(args.sft_lr),
            "--per_device_train_batch_size",
            "8",
            "--save_strategy",
            "no",
            *model,
            *peft,
            *shared,
        ],
    )
    gspo_metrics = _run(
        "gspo",
        args.mesh,
        [
            "--output_dir",
            gspo_dir,
            "--model_name_or_path",
            sft_dir,
            "--max_steps",
            str(args.gspo_steps),
            "--learning_rate",
            str(args.gspo_lr),
            "--num_generations",
            str(args.num_generations),
            "--per_device_train_batch_size",
            str(args.num_generations),
            "--max_completion_length",
            "16",
            "--eval_items",
            str(args.eval_items),
            "--save_strategy",
            "no",
            *peft,
            *shared,
        ],
    )
    base = _base_accuracy(args.model_name_or_path, args.eval_items)
    result = {
        "exact_match_base": base,
        "exact_match_after_sft": gspo_metrics["eval_exact_match_before"],
        "exact_match_after_gspo": gspo_metrics["eval_exact_match_after"],
        "sft_eval_loss": sft_metrics["eval_loss"],
        "gspo_reward_first": gspo_metrics["train_reward_first"],
        "gspo_reward_last": gspo_metrics["train_reward_last"],
    }
    print(json.dumps(result, indent=2))
    with open(os.path.join(args.output_dir, "chain.json"), "w") as handle:
        json.dump({**result, "argv": argv}, handle, indent=2)
    return result


def _run(name: str, mesh: str | None, argv: list[str]) -> dict:
    """Recipe ``name``'s metrics: run here, or on a launched mesh and read back from what its first
    process wrote (SFT: the eval loss in trainer_state.json; GSPO: gspo_results.json)."""
    if mesh is None:
        return _recipe(name).main(argv)
    import torch

    cpu = [] if torch.cuda.is_available() else ["--cpu"]
    launch = [sys.executable, "-m", "hf_meshtune.cli", "launch", "--mesh", mesh, *cpu, "--"]
    subprocess.run([*launch, str(ROOT / "recipes" / f"{name}.py"), *argv], check=True)
    out = Path(argv[argv.index("--output_dir") + 1])
    if name == "gspo":
        return json.loads((out / "gspo_results.json").read_text())
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    return {"eval_loss": next(e["eval_loss"] for e in reversed(history) if "eval_loss" in e)}


def _base_accuracy(path: str | None, count: int) -> float:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from hf_meshtune.apps import arithmetic
    from hf_meshtune.apps.assets import smollm2_checkpoint

    path = path or str(smollm2_checkpoint())
    model, tokenizer = AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    return arithmetic.exact_match(model, tokenizer, arithmetic.problems(count, seed=1))


if __name__ == "__main__":
    main()
