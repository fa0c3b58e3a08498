"""The ``meshtune`` console entry point.

Each subcommand is one ``_add_<name>_parser`` function that registers its flags and a handler
(``args -> exit code``); ``meshtune ledger``'s lives in ``cli_ledger``. Handlers import what they need
lazily, so ``meshtune --help`` stays fast and one subcommand never pays for another's imports. Bad values
raise ``ValueError`` (via ``require``); ``main`` prints the message and returns 2, like argparse does for
malformed flags.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence
from dataclasses import fields

from hf_meshtune._validation import require
from hf_meshtune.cli_ledger import add_ledger_parser, parse_mesh
from hf_meshtune.launch import launch_mesh


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
        help="start an X×Y mesh of processes running one script: all of it here, or this host's part (--hosts)",
        usage="meshtune launch --mesh XxY [--cpu] [--host ADDR] [--master-port P] [--lighthouse ADDR] "
        "[--log-dir DIR] [--all-ranks] [--max-restarts N] [--optional-replica R] -- SCRIPT [ARGS...]\n"
        "       meshtune launch --hosts FILE --this-host NAME [--log-dir DIR] [--all-ranks] [--max-restarts N] "
        "-- SCRIPT [ARGS...]",
        description="Start X·Y processes `python SCRIPT ARGS` (or `python -m MOD ARGS`) with the torchrun "
        "environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), "
        "MESHTUNE_MESH=XxY and TORCHFT_LIGHTHOUSE. Rank r is replica r // Y, stage r % Y; its "
        "output lines are prefixed [r<replica>s<stage>]. The terminal shows the rank with the loss (replica 0's "
        "last stage), a progress bar (step, ETA, loss, tokens/s, wire bytes per token) and other ranks' warnings "
        "and failures; every rank's whole output goes to --log-dir. The first child to fail stops the "
        "others and sets the exit code; with --max-restarts N every replica is a job of its own "
        "and a failed one is restarted (N times at most) and heals from the others. With MESHTUNE_SECRET "
        "(or MESHTUNE_SECRET_FILE) exported, only processes holding that secret get into the mesh: the "
        "launcher serves a gate where each one proves it, and every server admits admitted addresses only. "
        "With --hosts FILE --this-host NAME (run on every host): this host's ranks of the mesh the hosts file "
        "places, every replica a job of its own; the launchers meet at the file's coordinator host.",
    )
    p.add_argument("--mesh", default=None, help="X replicas x Y stages, anchor included, e.g. 3x2")
    p.add_argument(
        "--hosts",
        default=None,
        metavar="FILE",
        help="a hosts file (YAML: hosts, their GPUs or CPU, links, which ranks each runs); with --this-host",
    )
    p.add_argument("--this-host", default=None, metavar="NAME", help="this machine's name in the --hosts file")
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
        default=None,
        help="restarts per replica; > 0 runs every replica as its own job so a failed one is restarted and "
        "heals from the others, the anchor's included: it rejoins and re-syncs θ_global from fast replica 0 "
        "(default 0: the first failure stops the mesh; with --hosts, the file's max_restarts)",
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
    if args.hosts is not None or args.this_host is not None:
        return _launch_host(args, command)
    require(args.mesh is not None, "mesh", None, "be given (--mesh XxY), or --hosts FILE with --this-host NAME")
    return launch_mesh(
        parse_mesh(args.mesh),
        command,
        cpu=args.cpu,
        master_port=args.master_port,
        lighthouse=args.lighthouse,
        log_dir=args.log_dir,
        all_ranks=args.all_ranks,
        max_restarts=args.max_restarts or 0,
        optional_replicas=args.optional_replicas,
        host=args.host or os.environ.get(HOST_ENV) or "127.0.0.1",
        env={HOST_ENV: args.host} if args.host else None,
    )


def _launch_host(args: argparse.Namespace, command: list[str]) -> int:
    """``meshtune launch --hosts FILE --this-host NAME``: this host's part of a mesh over several hosts."""
    from dataclasses import replace

    from .host_launch import launch_host
    from .hosts import load_hosts

    require(args.hosts is not None, "hosts", None, "be given with --this-host (the hosts file that names it)")
    require(args.this_host is not None, "this_host", None, "be given with --hosts: this machine's name in the file")
    for flag, value in (("mesh", args.mesh), ("host", args.host), ("master_port", args.master_port),
                        ("lighthouse", args.lighthouse), ("optional_replicas", args.optional_replicas or None),
                        ("cpu", args.cpu or None)):  # fmt: skip
        require(value is None, flag, value, "be unset with --hosts: the hosts file says it for every host")
    hosts = load_hosts(args.hosts)
    if args.max_restarts is not None:
        require(args.max_restarts >= 0, "max_restarts", args.max_restarts, "be an integer >= 0 (restarts per replica)")
        hosts = replace(hosts, max_restarts=args.max_restarts)
    return launch_host(hosts, args.this_host, command, log_dir=args.log_dir, all_ranks=args.all_ranks)


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
    add_ledger_parser,
    _add_demo_parser,
    _add_launch_parser,
    _add_report_parser,
)
"""One registration function per subcommand."""


if __name__ == "__main__":
    sys.exit(main())
