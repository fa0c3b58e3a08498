"""A plain Accelerate training loop on the mesh: one import and one argument differ.

    python examples/accelerate_loop.py --steps 8

Fine-tunes the last two layers of the embedded SmolLM2-135M-Instruct on GSM8K answers with the paper's
method (``preset="paper"``: p = 0.95, the anchor prior) on Y = 4 stages, an anchor gradient every 2 steps
landing 2 steps late, gradient accumulation 2. ``MeshPlugin(num_stages=4)`` alone gives the default,
quality-keeping boundary (``outliers8+int8+zstd``, no anchor) instead.
Against the same loop on plain accelerate, only these lines change:

    -from accelerate import Accelerator
    +from hf_meshtune.accelerate import MeshAccelerator as Accelerator, MeshPlugin

    -accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum)
    +accelerator = Accelerator(gradient_accumulation_steps=args.grad_accum,
    +                          mesh_plugin=MeshPlugin(preset="paper", num_stages=4, anchor_every=2, anchor_delay=2))

The AdamW below becomes a SpectralAdamW inside ``prepare`` (the scheduler follows it); the optimizer
step hooks move the mask clock and run the anchor. ``accelerator.log`` adds the mesh's ``comm/*``,
``spectral/*`` and ``anchor/*`` entries to a line that carries ``loss``; plain accelerate leaves it as is.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq, get_scheduler

from hf_meshtune.accelerate import MeshAccelerator as Accelerator
from hf_meshtune.accelerate import MeshPlugin
from hf_meshtune.apps.assets import load_smollm2
from hf_meshtune.apps.demo import freeze_all_but_last, gsm8k_splits


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--grad-accum", type=int, default=2)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    freeze_all_but_last(model, 2)
    train, _ = gsm8k_splits(tokenizer, args.seq_len, eval_items=8)
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    scheduler = get_scheduler("cosine", optimizer, num_warmup_steps=0, num_training_steps=args.steps)

    accelerator = Accelerator(
        gradient_accumulation_steps=args.grad_accum,
        mesh_plugin=MeshPlugin(preset="paper", num_stages=4, anchor_every=2, anchor_delay=2),
    )
    model, optimizer, loader, scheduler = accelerator.prepare(model, optimizer, loader, scheduler)

    model.train()
    losses: list[float] = []
    total = 0.0
    for i, batch in zip(range(args.steps * args.grad_accum), loader):
        with accelerator.accumulate(model):
            loss = model(**batch).loss
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        total += loss.item() / args.grad_accum
        if accelerator.sync_gradients:
            logs = {"loss": total, "lr": scheduler.get_last_lr()[0]}
            accelerator.log(logs, step=len(losses))
            print(f"step {len(losses)}: " + ", ".join(f"{k} {v:.4g}" for k, v in logs.items()))
            losses.append(total)
            total = 0.0
    accelerator.end_training()
    return losses


if __name__ == "__main__":
    main()
