"""The ``meshtune`` console entry point.

Each subcommand is one ``_add_<name>_parser`` function that registers its flags and a handler
(``args -> exit code``). Handlers import what they need lazily, so ``meshtune --help`` stays fast and
one subcommand never pays for another's imports. Bad values raise ``ValueError`` (via ``require``);
``main`` prints the message and returns 2, like argparse does for malformed flags.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields, replace
from types import SimpleNamespace
from typing import TYPE_CHECKING

from hf_meshtune._validation import require
from hf_meshtune.launch import launch_mesh

if TYPE_CHECKING:
    from transformers import PreTrainedConfig

_DEFAULT_PRESET = "llama-3.2-1b"
_DEFAULT_ROWS = "Dense,+DP,M95,M90+AP,M95+AP"


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``meshtune <subcommand> ...`` with ``argv`` (default ``sys.argv[1:]``); return the exit code."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exit_:  # argparse: --help (0) or malformed flags (2)
        return exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
    try:
        return args.handler(args)
    except ValueError as err:
        print(f"meshtune {args.command}: error: {_as_flag(parser, args.command, str(err))}", file=sys.stderr)
        return 2


def _as_flag(parser: argparse.ArgumentParser, command: str, message: str) -> str:
    """A library message about field ``name=value`` speaks of the flag the user typed: ``--flag=value``."""
    subparsers = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for action in subparsers.choices[command]._actions:
        longs = [o for o in action.option_strings if o.startswith("--")]
        if longs and message.startswith(f"{action.dest}="):
            return longs[0] + message[len(action.dest) :]
    return message


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with one subparser per subcommand."""
    parser = argparse.ArgumentParser(
        prog="meshtune", description="Communication-efficient fine-tuning over X×Y GPU meshes."
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in _SUBCOMMANDS:
        add(subparsers)
    return parser


# ---------------------------------------------------------------------------------------------------
# meshtune ledger
# ---------------------------------------------------------------------------------------------------


def _add_ledger_parser(subparsers: argparse._SubParsersAction) -> None:
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
    num_replicas, num_stages = _parse_mesh(args.mesh)
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


def _parse_mesh(text: str) -> tuple[int, int]:
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


# ---------------------------------------------------------------------------------------------------
# meshtune demo
# ---------------------------------------------------------------------------------------------------


def _add_demo_parser(subparsers: argparse._SubParsersAction) -> None:
    from hf_meshtune.apps.demo import DemoSettings  # lazy: the demo module pulls in torch and transformers

    p = subparsers.add_parser(
        "demo",
        help="fine-tune the embedded SmolLM2-135M on GSM8K through compressed boundaries (default --preset "
        "quality: the outlier-aware int8 codec; --preset paper: M95 + anchor prior)",
        description="The main job on the embedded default (no hub access): prints the dense eval loss "
        "before/after, the training loss through the compressed boundaries and the byte ledger; writes summary.json.",
    )
    for f in fields(DemoSettings):
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) in ("bool", "bool | None"):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default)
        else:
            kinds = {
                "int": int,
                "int | None": int,
                "float": float,
                "float | None": float,
                "str": str,
                "str | None": str,
            }
            kind = kinds[str(f.type)]
            p.add_argument(flag, type=kind, default=f.default, help=f"(default {f.default})")
    p.set_defaults(handler=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    """Handler of ``meshtune demo``."""
    from hf_meshtune.apps.demo import DemoSettings  # lazy, as in _add_demo_parser
    from hf_meshtune.apps.demo import run_demo as run

    run(DemoSettings(**{f.name: getattr(args, f.name) for f in fields(DemoSettings)}))
    return 0


# ---------------------------------------------------------------------------------------------------
# meshtune launch
# ---------------------------------------------------------------------------------------------------


def _add_launch_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "launch",
        help="start a local X×Y mesh of processes running one script",
        usage="meshtune launch --mesh XxY [--cpu] [--host ADDR] [--master-port P] [--lighthouse ADDR] "
        "[--log-dir DIR] [--all-ranks] [--max-restarts N] [--optional-replica R] -- SCRIPT [ARGS...]",
        description="Start X·Y processes `python SCRIPT ARGS` (or `python -m MOD ARGS`) with the torchrun "
        "environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
        "MESHTUNE_MESH=XxY and TORCHFT_LIGHTHOUSE. Rank r is replica r // Y, stage r % Y; its "
        "output lines are prefixed [r<replica>s<stage>]. The terminal shows the rank with the loss (replica 0's "
        "last stage), a progress bar (step, ETA, loss, tokens/s, wire bytes per token) and other ranks' warnings "
        "and failures; every rank's whole output goes to --log-dir. The first child to fail stops the "
        "others and sets the exit code; with --max-restarts N every replica is a job of its own "
        "and a failed one is restarted (N times at most) and heals from the others. With MESHTUNE_SECRET "
        "(or MESHTUNE_SECRET_FILE) exported, only processes holding that secret get into the mesh: the "
        "launcher serves a gate where each one proves it, and every server admits admitted addresses only.",
    )
    p.add_argument("--mesh", required=True, help="X replicas x Y stages, anchor included, e.g. 3x2")
    p.add_argument(
        "--cpu",
        action="store_true",
        help="CPU only: ACCELERATE_USE_CPU=true, no CUDA device, cores split over processes",
    )
    p.add_argument("--master-port", type=int, default=None, help="torch.distributed port (default: a free one)")
    p.add_argument(
        "--host",
        default=None,
        help="the address the launcher's lighthouse and store listen on and the processes' servers bind to "
        "(exported to them as MESHTUNE_HOST; default $MESHTUNE_HOST, else 127.0.0.1); never every interface",
    )
    p.add_argument(
        "--lighthouse", default=None, help="host:port of a running torchft lighthouse (default: start one on loopback)"
    )
    p.add_argument(
        "--log-dir",
        default=None,
        help="write each rank's whole output to DIR/rank<N>.log (default: a new temporary folder)",
    )
    p.add_argument(
        "--all-ranks", action="store_true", help="show every rank's output on the terminal, not only the loss rank's"
    )
    p.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="restarts per replica; > 0 runs every replica as its own job so a failed one is restarted and "
        "heals from the others, the anchor's included: it rejoins and re-syncs θ_global from fast replica 0 "
        "(default 0: the first failure stops the mesh)",
    )
    p.add_argument(
        "--optional-replica",
        dest="optional_replicas",
        type=int,
        action="append",
        default=[],
        metavar="R",
        help="a replica whose failure does not stop the others, e.g. the anchor replica X-1 "
        "(repeatable; its remaining processes are stopped)",
    )
    p.add_argument(
        "script",
        nargs=argparse.REMAINDER,
        metavar="-- SCRIPT [ARGS...]",
        help="a Python file or `-m module`, then its arguments",
    )
    p.set_defaults(handler=run_launch)


def run_launch(args: argparse.Namespace) -> int:
    """Handler of ``meshtune launch``: the exit code of the mesh (see ``hf_meshtune.launch``)."""
    from .comm.listen import HOST_ENV

    command = args.script[1:] if args.script[:1] == ["--"] else args.script  # `args.command` is "launch"
    return launch_mesh(
        _parse_mesh(args.mesh),
        command,
        cpu=args.cpu,
        master_port=args.master_port,
        lighthouse=args.lighthouse,
        log_dir=args.log_dir,
        all_ranks=args.all_ranks,
        max_restarts=args.max_restarts,
        optional_replicas=args.optional_replicas,
        host=args.host or os.environ.get(HOST_ENV) or "127.0.0.1",
        env={HOST_ENV: args.host} if args.host else None,
    )


# ---------------------------------------------------------------------------------------------------
# meshtune report
# ---------------------------------------------------------------------------------------------------


def _add_report_parser(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser(
        "report",
        help="plot and tabulate the runs in a folder: loss, bytes/token by circuit",
        description="Find every run under RUN_DIR (a folder holding trainer_state.json, a checkpoint-N with one, "
        "mesh_summary.json or the demo's summary.json) and write loss.png (training loss vs step), "
        "bytes_per_token.png (pp_fwd, pp_bwd, dp, anchor per run: the logged ledger and, from "
        "mesh_summary.json, what the mesh measured on the wire), fidelity.png when a run's anchor measured its "
        "boundary codecs (gradient cosine per boundary and codec vs step, the governed levels) and report.md "
        "(a table per run, the plots embedded).",
    )
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run's output_dir, or a folder of runs at any depth")
    p.add_argument("--out", default=None, metavar="DIR", help="where to write the report (default RUN_DIR)")
    p.set_defaults(handler=run_report)


def run_report(args: argparse.Namespace) -> int:
    """Handler of ``meshtune report``: prints the paths it wrote, one per line."""
    from hf_meshtune.report import write_report  # lazy: pulls in matplotlib, torch and transformers

    written = write_report(args.run_dir, args.out)
    for key in ("report", "loss_plot", "bytes_plot", "fidelity_plot"):
        if key in written:
            print(written[key])
    return 0


_SUBCOMMANDS: tuple[Callable[[argparse._SubParsersAction], None], ...] = (
    _add_ledger_parser,
    _add_demo_parser,
    _add_launch_parser,
    _add_report_parser,
)
"""One registration function per subcommand."""


if __name__ == "__main__":
    sys.exit(main())
