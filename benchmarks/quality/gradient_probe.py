"""How much of the dense gradient does training through a compressed boundary keep? One-batch probe.

For each boundary scheme: the training loss through the scheme and cos(∇θ through the scheme,
dense ∇θ) on the same batch, at the base model before any fine-tuning (mean over 4 mask draws).
A weight update can only follow the dense direction if this cosine is well above 0; the anchor's
filter reweights the masked gradient but cannot add a direction it lacks (benchmarks/quality/README.md).

    python -m benchmarks.quality.gradient_probe            # tiny Llama + SmolLM2-135M, ~3 min

Writes ``results/gradient_probe.json`` and ``results/gradient_probe.md``.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from hf_meshtune import attach_boundaries
from hf_meshtune.boundary.codecs import attach_codec

from .evaluate import sft_row
from .tasks import arithmetic

RESULTS = Path(__file__).resolve().parent / "results"
DRAWS = 4
SCHEMES: dict[str, dict] = {
    "M50": dict(mask=dict(mask_ratio=0.5)),
    "M90": dict(mask=dict(mask_ratio=0.9)),
    "M95": dict(mask=dict(mask_ratio=0.95)),
    "M99": dict(mask=dict(mask_ratio=0.99)),
    "M95 Y=2": dict(mask=dict(mask_ratio=0.95), stages=2),
    "M95 rescale": dict(mask=dict(mask_ratio=0.95, rescale=True)),
    "M95 gaussian fill": dict(mask=dict(mask_ratio=0.95, fill="gaussian")),
    "pca (20×)": dict(codec=dict(codec="pca")),
    "bottleneck at init (20×)": dict(codec=dict(codec="bottleneck")),
    "topk (20× fwd)": dict(codec=dict(codec="topk")),
    "quant4 (4×)": dict(codec=dict(codec="quant4", bits=4)),
    "quant2 (8×)": dict(codec=dict(codec="quant4", bits=2)),
}


def _pad(rows: list[dict], pad: int) -> dict:
    """Right-pad SFT rows into a batch (labels -100, attention 0 on the padding)."""
    width = max(len(r["input_ids"]) for r in rows)
    fill = lambda key, value: torch.tensor([r[key] + [value] * (width - len(r[key])) for r in rows])  # noqa: E731
    return {
        "input_ids": fill("input_ids", pad),
        "attention_mask": fill("attention_mask", 0),
        "labels": fill("labels", -100),
    }


def _without_labels(batch: dict) -> dict:
    return {k: v for k, v in batch.items() if k != "labels"}


def _grad(model, batch, params: list) -> tuple[float, torch.Tensor]:
    loss = model(**batch).loss
    grads = torch.autograd.grad(loss, params, allow_unused=True)
    return loss.item(), torch.cat(
        [(g if g is not None else torch.zeros_like(p)).flatten() for g, p in zip(grads, params)]
    )


def probe(model, batch: dict, calibration: dict, stages: int = 4) -> dict[str, dict]:
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]  # the model's own, not a codec's
    dense_loss, dense = _grad(model, batch, params)
    out = {"Dense": {"loss": dense_loss, "cos": 1.0}}
    for name, scheme in SCHEMES.items():
        losses, cosines = [], []
        y = scheme.get("stages", stages)
        for draw in range(DRAWS):
            if "mask" in scheme:
                handle = attach_boundaries(model, y, seed=draw, **scheme["mask"])
                handle.set_step(draw)
                if scheme["mask"].get("fill") == "gaussian":
                    handle.calibrate_fills(model, calibration)
            else:
                handle = attach_codec(model, y, **scheme["codec"])
                handle.fit(model, calibration)
            try:
                loss, grad = _grad(model, batch, params)
            finally:
                handle.remove()
            losses.append(loss)
            cosines.append(torch.nn.functional.cosine_similarity(grad, dense, dim=0).item())
            if "codec" in scheme:
                break  # deterministic: one draw is all of them
        out[name] = {"loss": sum(losses) / len(losses), "cos": sum(cosines) / len(cosines)}
    return out


def tiny() -> dict:
    from .pretrain import load_tiny_llama

    model, tokenizer = load_tiny_llama()
    rows = [sft_row(tokenizer, e.prompt, e.answer, 128) for e in arithmetic(0, 48, 8).train]
    pad = tokenizer.eos_token_id
    return probe(model, _pad(rows[:16], pad), _without_labels(_pad(rows[16:48], pad)))


def smollm2() -> dict:
    from hf_meshtune.apps.assets import gsm8k_items, load_smollm2, sft_features
    from hf_meshtune.apps.demo import freeze_all_but_last

    model, tokenizer = load_smollm2()
    freeze_all_but_last(model, 8)  # as in the main job
    items = gsm8k_items()
    rows = [sft_features(tokenizer, it["question"], it["answer"], 160) for it in items[:24]]
    both = _pad(rows, tokenizer.pad_token_id or 0)  # one width for both halves
    return probe(model, {k: v[:8] for k, v in both.items()}, _without_labels({k: v[8:] for k, v in both.items()}))


def write(results: dict[str, dict]) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "gradient_probe.json").write_text(json.dumps(results, indent=1))
    models = list(results)
    lines = [
        "One batch at the base model, Y = 4 unless named; loss through the scheme / cos(∇θ, dense ∇θ).",
        "",
        "| scheme | " + " | ".join(f"{m} loss | {m} cos" for m in models) + " |",
        "|---|" + "---:|---:|" * len(models),
    ]
    for scheme in results[models[0]]:
        cells = [f"{results[m][scheme]['loss']:.2f} | {results[m][scheme]['cos']:.3f}" for m in models]
        lines.append(f"| {scheme} | " + " | ".join(cells) + " |")
    (RESULTS / "gradient_probe.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    torch.manual_seed(0)
    write({"tiny Llama (H=256)": tiny(), "SmolLM2-135M (H=576, last 8 layers)": smollm2()})
