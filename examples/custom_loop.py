"""The pieces without the Trainer: masked boundaries, the anchor circuit and SpectralAdamW in a plain loop.

    python examples/custom_loop.py --steps 8

Fine-tunes the last two layers of the embedded SmolLM2-135M-Instruct on GSM8K answers with p = 0.95
on Y = 4 stages, an anchor gradient every 2 steps landing 2 steps late, and prints the masked loss and
how much of the dense (anchor) direction the raw and filtered gradients carry.
"""

from __future__ import annotations

import argparse

import torch
from torch.utils.data import DataLoader
from transformers import DataCollatorForSeq2Seq

from hf_meshtune import AnchorBatches, AnchorCircuit, SpectralAdamW, attach_boundaries
from hf_meshtune.apps.assets import load_smollm2
from hf_meshtune.apps.demo import freeze_all_but_last, gsm8k_splits


def main(argv: list[str] | None = None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=128)
    args = parser.parse_args(argv)

    torch.manual_seed(0)
    model, tokenizer = load_smollm2()
    freeze_all_but_last(model, 2)
    train, _ = gsm8k_splits(tokenizer, args.seq_len, eval_items=8)
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)

    handle = attach_boundaries(model, num_stages=4, mask_ratio=0.95, seed=0)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = SpectralAdamW(trainable, lr=1e-4, alpha=0.3, tau=1e-3, anchor_beta=0.9)
    matrices = {n: p for n, p in model.named_parameters() if p.requires_grad and p.ndim == 2}
    anchor = AnchorCircuit(
        model,
        matrices,
        handle,
        every=2,
        delay=2,
        batches=AnchorBatches(train, collate, args.batch_size, microbatches=1, seed=1),
        loss_fn=lambda m, batch: m(**batch).loss,
    )

    loader = DataLoader(train, batch_size=args.batch_size, shuffle=True, collate_fn=collate)
    model.train()
    losses = []
    for step, batch in zip(range(args.steps), loader):
        handle.set_step(step)  # the mask clock
        loss = model(**batch).loss  # masked forward
        loss.backward()  # masked backward
        anchor.on_step(step, optimizer)  # snapshot every 2 steps, deliveries 2 steps later
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
        print(f"step {step}: masked loss {loss.item():.3f}", optimizer.last_diagnostics or "(no anchor basis yet)")
    return losses


if __name__ == "__main__":
    main()
