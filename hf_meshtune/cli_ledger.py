"""``meshtune ledger``: bytes per token by circuit (``hf_meshtune.ledger``), or with ``--memory`` the predicted
memory of every process (``hf_meshtune.memory_ledger``), for a built-in model config or a ``config.json``,
no weights loaded. Registered by ``hf_meshtune.cli``; the handler imports the ledgers lazily."""

from __future__ import annotations

import argparse
import json
import os
import re
from dataclasses import replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

from hf_meshtune._validation import require

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

_DEFAULT_PRESET = "llama-3.2-1b"
_DEFAULT_ROWS = "Dense,+DP,M95,M90+AP,M95+AP"


def add_ledger_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "ledger",
        help="print bytes/token by circuit for the standard configurations",
        description="Exact bytes per fast-circuit token (pp_fwd, pp_bwd, dp, anchor) from the model's "
        "real parameter shapes; no weights are loaded.",
    )
    source = p.add_mutually_exclusive_group()
    source.add_argument("--preset", default=None, help=f"built-in model config (default {_DEFAULT_PRESET})")
    source.add_argument("--config", default=None, help="a config.json or a model directory")
    p.add_argument("--mesh", default="8x4", help="X replicas x Y stages, anchor included (default 8x4)")
    p.add_argument("--seq-len", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument(
        "--batch-size", type=int, default=32, help="global batch in sequences over the fast replicas (default 32)"
    )
    p.add_argument("--dtype", default="bfloat16", help="activation, gradient and parameter dtype")
    p.add_argument("--sync-every", type=int, default=20, help="DiLoCo outer period S (default 20)")
    p.add_argument("--powersgd-rank", type=rank_or_none, default=4, help="PowerSGD rank r, or 'none' (default 4)")
    p.add_argument(
        "--dp-quantize",
        type=lambda v: None if v == "none" else v,
        default=None,
        help="int8: DP all-reduces as int8 codes (MeshConfig.dp_quantize), or 'none' (default: float, the paper's)",
    )
    p.add_argument("--anchor-every", type=int, default=20, help="fast steps per anchor round A (default 20)")
    p.add_argument("--anchor-payload", default="gradient", help="gradient | factors (default gradient)")
    p.add_argument("--anchor-rank", type=int, default=8, help="rank of the anchor's factors (default 8)")
    p.add_argument("--rows", default=_DEFAULT_ROWS, help=f"comma-separated rows (default {_DEFAULT_ROWS})")
    p.add_argument(
        "--boundary-codec",
        default=None,
        help="also the rows of this composed codec (e.g. outliers8+int4g71) with DiLoCo + PowerSGD, without and "
        "with the anchor: the M95 and M95+AP rows with the codec's message at every boundary",
    )
    p.add_argument(
        "--coding-ratio",
        type=float,
        default=None,
        help="bytes before / after the codec's lossless coder (+zstd) as a run measured it (mesh_summary.json's "
        "pp_coding_ratio, or benchmarks/wire); without it a coded codec's records are booked uncoded",
    )
    p.add_argument("--json", action="store_true", help="print {row: ledger dict} as JSON")
    memory = p.add_argument_group(
        "memory", "--memory: the predicted memory of every process instead of bytes per token (memory_ledger)"
    )
    memory.add_argument("--memory", action="store_true", help="print the per-stage memory ledger")
    memory.add_argument("--microbatch-size", type=int, default=1, help="rows per microbatch (default 1)")
    memory.add_argument("--microbatches", type=int, default=4, help="microbatches per step M (default 4)")
    memory.add_argument(
        "--anchor", action=argparse.BooleanOptionalAction, default=False, help="replica X-1 is the anchor"
    )
    memory.add_argument(
        "--gradient-checkpointing",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="the decoder layers are checkpointed (activations then count what is saved outside them)",
    )
    memory.add_argument(
        "--stage-layers",
        default=None,
        help="decoder layers per stage, comma-separated (an uneven split, e.g. 20,10); default balanced",
    )
    memory.add_argument(
        "--lora-r", type=int, default=None, help="a LoRA adapter of this rank trains instead of the whole model"
    )
    memory.add_argument(
        "--lora-target-modules",
        default="all-linear",
        help="the adapter's target modules, comma-separated, or all-linear (default; with --lora-r)",
    )
    p.set_defaults(handler=run_ledger)


def _stage_layers(text: str) -> tuple[int, ...]:
    """ "20,10" → (20, 10); the counts are checked against Y and the model where the split is made."""
    parts = [p.strip() for p in text.split(",")]
    require(
        all(p.isdigit() for p in parts),
        "--stage-layers",
        text,
        "be comma-separated decoder-layer counts, one per stage (e.g. 20,10)",
    )
    return tuple(int(p) for p in parts)


def run_ledger(args: argparse.Namespace) -> int:
    """Handler of ``meshtune ledger``: one ledger per requested standard row, as a table or JSON."""
    from hf_meshtune import ledger as L  # lazy: pulls in torch and transformers
    from hf_meshtune.config import codec_refit_every

    config, preset = _ledger_config(args, L.PRESETS)
    num_replicas, num_stages = parse_mesh(args.mesh)
    layers = getattr(config.get_text_config(), "num_hidden_layers", None)
    require(
        layers is None or num_stages <= layers,
        "mesh",
        args.mesh,
        f"have Y <= the model's {layers} decoder layers (each stage holds at least one)",
    )
    if args.memory:
        return _print_memory_ledger(args, config, num_replicas, num_stages)
    knobs = dict(
        num_replicas=num_replicas,
        num_stages=num_stages,
        activation_dtype=args.dtype,
        grad_dtype=args.dtype,
        param_dtype=args.dtype,
        sync_every=args.sync_every,
        powersgd_rank=args.powersgd_rank,
        dp_quantize=args.dp_quantize,
        anchor_every=args.anchor_every,
        anchor_payload=args.anchor_payload,
        anchor_rank=args.anchor_rank,
    )
    rows = [row.strip() for row in args.rows.split(",") if row.strip()]
    require(len(rows) > 0, "rows", args.rows, f"name at least one of {list(L.STANDARD_ROWS)}")
    ledgers = {}
    for row in rows:
        settings = L.settings_for_row(row, global_batch=args.batch_size, seq_len=args.seq_len, **knobs)
        ledgers[row] = L.ledger_for_config(config, settings)
    if args.boundary_codec is not None:
        for row, name in (("M95", args.boundary_codec), ("M95+AP", f"{args.boundary_codec}+AP")):
            settings = L.settings_for_row(row, global_batch=args.batch_size, seq_len=args.seq_len, **knobs)
            # the knob's own default: refits every round with the anchor and a codec that fits geometry
            refit = codec_refit_every(SimpleNamespace(anchor=settings.anchor, boundary_codec=args.boundary_codec))
            ledgers[name] = L.ledger_for_config(
                config,
                replace(
                    settings,
                    boundary_codec=args.boundary_codec,
                    codec_refit_every=refit,
                    coding_ratio=args.coding_ratio,
                ),
            )
    if args.json:
        print(json.dumps({name: led.to_dict() for name, led in ledgers.items()}, indent=2))
    else:
        reference = L.PAPER_BYTES_PER_TOKEN if preset == _DEFAULT_PRESET else None
        print(L.format_table(ledgers, reference))
    return 0


def _print_memory_ledger(args: argparse.Namespace, config, num_replicas: int, num_stages: int) -> int:
    from hf_meshtune.memory_ledger import MemorySettings, format_memory_table, predict_memory

    settings = MemorySettings(
        num_replicas=num_replicas,
        num_stages=num_stages,
        microbatch_size=args.microbatch_size,
        microbatches=args.microbatches,
        seq_len=args.seq_len,
        dtype=args.dtype,
        anchor=args.anchor,
        powersgd_rank=args.powersgd_rank,
        dp_quantize=args.dp_quantize,
        boundary_codec=args.boundary_codec,
        gradient_checkpointing=args.gradient_checkpointing,
        stage_layers=None if args.stage_layers is None else _stage_layers(args.stage_layers),
    )
    rows = predict_memory(config, settings, peft_config=_lora_config(args))
    print(json.dumps(rows, indent=2) if args.json else format_memory_table(rows, settings))
    return 0


def _lora_config(args: argparse.Namespace):
    """The ``LoraConfig`` of ``--lora-r``/``--lora-target-modules``, or None for a full fine-tune."""
    if args.lora_r is None:
        return None
    require(args.lora_r >= 1, "--lora-r", args.lora_r, "be an integer >= 1")
    from peft import LoraConfig

    targets = args.lora_target_modules
    modules = targets if targets == "all-linear" else [t.strip() for t in targets.split(",") if t.strip()]
    require(bool(modules), "--lora-target-modules", targets, "name at least one module, or all-linear")
    return LoraConfig(r=args.lora_r, target_modules=modules, task_type="CAUSAL_LM")


def _ledger_config(args: argparse.Namespace, presets: dict) -> tuple[PreTrainedConfig, str | None]:
    if args.config is not None:
        require(
            os.path.exists(args.config), "config", args.config, "be an existing config.json file or model directory"
        )
        from transformers import AutoConfig  # lazy: only `ledger --config` needs transformers here

        try:
            return AutoConfig.from_pretrained(args.config), None
        except OSError as err:  # e.g. a config.json that is not JSON
            raise ValueError(
                f"config={args.config!r} is invalid: it must be a readable transformers config ({err})"
            ) from err
    preset = args.preset or _DEFAULT_PRESET
    require(preset in presets, "preset", preset, f"be one of {sorted(presets)}")
    return presets[preset], preset


def parse_mesh(text: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text)
    require(
        match is not None and int(match[1]) >= 1 and int(match[2]) >= 1,
        "mesh",
        text,
        "be XxY with X >= 1 replicas and Y >= 1 stages, e.g. 8x4",
    )
    assert match is not None
    return int(match[1]), int(match[2])


def rank_or_none(text: str) -> int | None:
    return None if text.lower() == "none" else int(text)
