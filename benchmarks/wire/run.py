"""What the wire's last stages cost and buy: the lossless coder's ratio on real boundary messages, and the CPU
time of every new codec stage at Llama-3.2-1B boundary shapes.

    python -m benchmarks.wire.run          # ~3 min on 2 CPU cores; writes benchmarks/wire/results.{json,md}

1. **Ratio (measured on real messages).** SmolLM2-135M-Instruct on 12 GSM8K SFT rows of the embedded data (the
   main job's), Y = 4: the dense activations and activation gradients at the 3 boundaries, real tokens only.
   Each codec is fitted on the first half of the real tokens and codes the rest; its forward and backward
   records are coded by each coder, and the table gives bytes per real token and boundary before and after,
   and the empirical order-0 entropy of int8 codes (what an ideal coder of independent codes would reach).
2. **CPU time (measured, synthetic values).** At the 1B boundary shape (H = 2,048; 8,192 tokens = a quarter of
   a 32 × 2,048 step's microbatches, values Gaussian with 8 dims 50× larger, the outliers), the seconds to
   encode and decode each codec's forward message, and each coder's seconds per MB of records. No GPU was lent:
   these are CPU numbers (one thread, as a stage's codec runs on the sending and the receiving process).
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch

from hf_meshtune.boundary.compose.codec import ComposedCodec, wire_records
from hf_meshtune.boundary.compose.entropy import ZSTD_LEVEL, encode_records
from hf_meshtune.boundary.compose.grammar import parse_codec
from hf_meshtune.boundary.hooks import find_decoder_layers, split_stages

OUT = Path(__file__).resolve().parent
CODECS = [
    "outliers8+int8",
    "outliers8+int4x8",
    "outliers8+rot+int4g64",
    "outliers8+rot+int4g64e8m0",
    "outliers8+rot+int3g64e8m0",
    "outliers8+rot+int3g64e8m0/rot+int4g64e8m0",
    "outliers8+int4x8/int8",
]
CODERS = {"zstd-1": ("zstd", 1), "zstd-3": ("zstd", 3), "zstd-9": ("zstd", 9), "zlib-6": ("zlib", 6)}
ROWS, STAGES = 12, 4


def _code(records: torch.Tensor, coder: str, level: int) -> bytes:
    import zlib

    import zstandard

    columns = records.numpy().T.copy().tobytes()
    if coder == "zlib":
        return zlib.compress(columns, level)
    return zstandard.ZstdCompressor(level=level).compress(columns)


def _entropy_bits(codes: torch.Tensor) -> float:
    counts = torch.bincount(codes.reshape(-1).long(), minlength=256).double()
    p = counts[counts > 0] / counts.sum()
    return float(-(p * p.log2()).sum())


def _boundaries() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Dense activations and their gradients at the Y-1 boundaries, real tokens only, rows in order."""
    from hf_meshtune.apps.assets import load_smollm2
    from hf_meshtune.apps.demo import gsm8k_splits

    model, tokenizer = load_smollm2()
    train, _ = gsm8k_splits(tokenizer, 512, 64)
    rows = [train[i] for i in range(ROWS)]
    width = max(len(r["input_ids"]) for r in rows)
    pad = tokenizer.pad_token_id

    def column(key: str, fill: int) -> torch.Tensor:
        return torch.tensor([r[key] + [fill] * (width - len(r[key])) for r in rows])

    batch = {"input_ids": column("input_ids", pad), "attention_mask": column("attention_mask", 0)}
    batch["labels"] = column("labels", -100)
    _, layers = find_decoder_layers(model)
    ends = [r.stop - 1 for r in split_stages(len(layers), STAGES)[:-1]]
    hidden: list[torch.Tensor] = []

    def keep(module, args, output):
        h = output[0] if isinstance(output, tuple) else output
        h.retain_grad()
        hidden.append(h)

    hooks = [layers[i].register_forward_hook(keep) for i in ends]
    model(**batch).loss.backward()
    for hook in hooks:
        hook.remove()
    real = batch["attention_mask"].bool()
    return [h.detach()[real] for h in hidden], [h.grad[real] for h in hidden]


def ratios() -> list[dict]:
    activations, gradients = _boundaries()
    split = activations[0].shape[0] // 2  # rows are in order: the first half of the tokens fits, the rest codes
    out = []
    for text in CODECS:
        spec = parse_codec(text)
        row = {"codec": text, "tokens": activations[0].shape[0] - split, "record_bytes": {}, "coded": {}}
        for direction, values in (("fwd", activations), ("bwd", gradients)):
            records, bits = [], []
            for boundary, h in enumerate(values):
                codec = ComposedCodec(spec, boundary, h.shape[-1], 0)
                codec.fit(activations[boundary][:split])
                rows = h[split:].to(torch.bfloat16)  # a bf16 wire: outliers in 2 bytes
                message = codec.encode_activation(rows) if direction == "fwd" else codec.encode_gradient(rows, 0, 0)
                record = wire_records(codec, direction, message)
                records.append(record)
                side = spec.side(direction)
                start = side.outliers * 2 + (1 if side.scales == "e8m0" else 2) * side.groups(h.shape[-1])
                bits.append(_entropy_bits(record[:, start:]) if side.bits == 8 else math.nan)
            tokens = sum(r.shape[0] for r in records)
            row["record_bytes"][direction] = records[0].shape[1]
            row.setdefault("byte_entropy_bits", {})[direction] = sum(bits) / len(bits)
            for name, (coder, level) in CODERS.items():
                coded = sum(len(_code(r, coder, level)) for r in records)
                row["coded"].setdefault(name, {})[direction] = coded / tokens
        out.append(row)
    return out


def timings() -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(8192, 2048, generator=gen)
    hidden[:, :8] *= 50
    out: dict = {"tokens": hidden.shape[0], "hidden_size": 2048, "codecs": {}, "coders_s_per_mb": {}}
    for text in CODECS:
        codec = ComposedCodec(parse_codec(text), 0, 2048, 0)
        codec.fit(hidden[:512])
        rows = hidden.to(torch.bfloat16)
        start = time.perf_counter()
        message = codec.encode_activation(rows)
        encoded = time.perf_counter()
        codec.decode_activation(message)
        decoded = time.perf_counter()
        out["codecs"][text] = {"encode_s": encoded - start, "decode_s": decoded - encoded}
    codec = ComposedCodec(parse_codec("outliers8+rot+int4g64e8m0"), 0, 2048, 0)
    codec.fit(hidden[:512])
    records = wire_records(codec, "fwd", codec.encode_activation(hidden.to(torch.bfloat16)))
    megabytes = records.numel() / 1e6
    for name, (coder, level) in CODERS.items():
        start = time.perf_counter()
        data = _code(records, coder, level)
        coded = time.perf_counter() - start
        import zlib

        import zstandard

        start = time.perf_counter()
        if coder == "zlib":
            zlib.decompress(data)
        else:
            zstandard.ZstdDecompressor().decompress(data, max_output_size=records.numel())
        out["coders_s_per_mb"][name] = {
            "encode": coded / megabytes,
            "decode": (time.perf_counter() - start) / megabytes,
            "ratio": records.numel() / len(data),
        }
    out["library_coder"] = f"zstd-{ZSTD_LEVEL}"
    # the library's own path on the same records, for its cost per MB as the wire pays it
    start = time.perf_counter()
    encode_records(records, "zstd")
    out["library_encode_s_per_mb"] = (time.perf_counter() - start) / megabytes
    return out


def table(data: dict) -> str:
    lines = [
        "# The wire's lossless coder and codec stages",
        "",
        "Generated by `python -m benchmarks.wire.run` (see its docstring for what is measured and how).",
        "",
        "## Bytes per real token and boundary on a bf16 wire, SmolLM2 GSM8K boundaries (measured)",
        "",
        "| codec | direction | record | " + " | ".join(CODERS) + " | best ratio | code entropy (bits, int8) |",
        "|---|---|---:|" + "---:|" * len(CODERS) + "---:|---:|",
    ]
    for row in data["ratios"]:
        for direction in ("fwd", "bwd"):
            record = row["record_bytes"][direction]
            coded = [row["coded"][name][direction] for name in CODERS]
            entropy = row["byte_entropy_bits"][direction]
            lines.append(
                f"| `{row['codec']}` | {direction} | {record} | "
                + " | ".join(f"{c:.1f}" for c in coded)
                + f" | {record / min(coded):.2f}× | {'–' if math.isnan(entropy) else f'{entropy:.2f}'} |"
            )
    t = data["timings"]
    lines += [
        "",
        f"## CPU seconds at the 1B boundary shape ({t['tokens']} tokens × H = {t['hidden_size']}, one thread, "
        "synthetic values; no GPU was lent)",
        "",
        "| codec | encode s | decode s | encode µs/token |",
        "|---|---:|---:|---:|",
    ]
    for text, row in t["codecs"].items():
        lines.append(
            f"| `{text}` | {row['encode_s']:.3f} | {row['decode_s']:.3f} | {row['encode_s'] / t['tokens'] * 1e6:.1f} |"
        )
    lines += ["", "| coder | encode s/MB | decode s/MB | ratio |", "|---|---:|---:|---:|"]
    for name, row in t["coders_s_per_mb"].items():
        lines.append(f"| {name} | {row['encode']:.4f} | {row['decode']:.4f} | {row['ratio']:.3f} |")
    lines.append("")
    lines.append(
        f"The library codes with {t['library_coder']} (`compose.entropy.ZSTD_LEVEL`): "
        f"{t['library_encode_s_per_mb']:.4f} s/MB through `encode_records`."
    )
    return "\n".join(lines) + "\n"


def main() -> None:
    data = {"ratios": ratios()}
    (OUT / "results.json").write_text(json.dumps(data, indent=2))
    data["timings"] = timings()
    (OUT / "results.json").write_text(json.dumps(data, indent=2))
    (OUT / "results.md").write_text(table(data))
    print(table(data))


if __name__ == "__main__":
    main()
