"""The rows of ``docs/bad_input.md`` for ``meshtune launch --hosts FILE --this-host NAME`` (``tests.bad_input_cases``
includes them): each writes a hosts file into the row's temporary folder and launches, and is refused before any
process starts; the two-launchers row runs against a store where another launcher for the host beats."""

from __future__ import annotations

import threading
from pathlib import Path

HOSTS = "meshtune launch --hosts FILE --this-host NAME"
TWO = """hosts:
  - {name: a, address: 127.0.0.1, cpu: {processes: 2}}
  - {name: b, address: 127.0.0.2, cpu: {processes: 2}}
"""


def launch_hosts(meshtune, text: str, this_host: str = "a", *flags: str):
    """A trigger: ``meshtune launch --hosts <tmp>/hosts.yaml --this-host THIS -- <tmp>/train.py`` with ``text``
    as the hosts file (``meshtune``: the table's runner of the CLI)."""

    def trigger(tmp: Path) -> None:
        (tmp / "hosts.yaml").write_text(text, encoding="utf-8")
        (tmp / "train.py").write_text("print('never run')\n", encoding="utf-8")
        meshtune(
            "launch", "--hosts", str(tmp / "hosts.yaml"), "--this-host", this_host, *flags, "--", str(tmp / "train.py")
        )

    return trigger


def second_launcher(tmp: Path) -> None:
    """Host a's launcher starts while another launcher for a beats at the coordinator's store (coordinator b,
    whose store this trigger plays: it listens on b's port + 1 and a thread adds to a's beat counter)."""
    import torch.distributed as dist
    import yaml  # type: ignore[import-untyped]

    from hf_meshtune.host_launch import launch_host
    from hf_meshtune.hosts import parse_hosts
    from tests.distributed import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False)
    stop = threading.Event()

    def beat() -> None:
        while not stop.wait(0.1):
            store.add("mt/host/a/beat", 1)

    text = (
        f"mesh: 2x2\ncoordinator: b\nport: {port}\nheartbeat_timeout_s: 1\nhosts:\n"
        "  - {name: a, address: 127.0.0.2, cpu: {processes: 2}}\n"
        "  - {name: b, address: 127.0.0.1, cpu: {processes: 2}}\n"
    )
    (tmp / "train.py").write_text("print('never run')\n", encoding="utf-8")
    thread = threading.Thread(target=beat, daemon=True)
    thread.start()
    try:
        launch_host(parse_hosts(yaml.safe_load(text)), "a", [str(tmp / "train.py")], log_dir=str(tmp))
    finally:
        stop.set()
        thread.join()


def host_cases(Case, CliExit, group: str, meshtune) -> list:  # noqa: N803 (the table's classes, passed in)
    """The rows, built with the table's own ``Case``/``CliExit`` and CLI runner (the table module may run as
    ``__main__``, whose classes are not the importable module's)."""
    err = "meshtune launch: error: <tmp>/hosts.yaml: "

    def row(text: str, shown: str, message: str, this_host: str = "a", note: str = "") -> Case:
        trigger = launch_hosts(meshtune, text, this_host)
        return Case(group, shown, f"`{HOSTS}`", trigger, CliExit, f"exit 2: {err}{message}", note=note)

    return [
        row(
            "hosts:\n  - {name: a, cpu: {processes: 2}}\n",
            "a host without `address:`",
            "hosts[0].address=None is invalid: it must be an IP address or name",
        ),
        row(
            TWO.replace("name: b", "name: a"),
            "two hosts named a",
            "hosts[1].name='a' is invalid: it must be unique: hosts[0] has it already (one entry, one launcher, per "
            "machine)",
        ),
        row(
            "mesh: 3x2\n" + TWO,
            "`mesh: 3x2` on two hosts of 2 CPU processes",
            "mesh='3x2' is invalid: it must fit the hosts' 4 GPUs/CPU processes (it needs 6); add hosts or `runs:`",
        ),
        row(
            "mesh: 2x2\n"
            + TWO.replace("processes: 2}}\n", "processes: 2}, runs: [r0s0, r0s1]}\n", 1).replace(
                "processes: 2}}\n", "processes: 2}, runs: [r0s1, r1s1]}\n"
            ),
            "r0s1 in two hosts' `runs:`",
            "hosts[1].runs='r0s1' is invalid: it must be run by one host only (a runs it)",
        ),
        row(
            "mesh: 2x2\nstage_layers: [3, 0]\n" + TWO,
            "`stage_layers: [3, 0]`",
            "stage_layers=[3, 0] is invalid: it must be a list of 2 integers >= 1 (decoder layers per stage of the "
            "2x2 mesh)",
            note="the sum is checked against the model by the launched script (`MeshTopology`), before any rendezvous",
        ),
        row(
            "mesh: 2x2\nmemory: {model: llama-3.2-1b, seq_len: 1024, microbatches: 8}\n"
            + TWO.replace("cpu: {processes: 2}", "gpus: {count: 2, memory_gib: 16}"),
            "Llama-3.2-1B on GPUs of 16 GiB (`memory:` asks the memory ledger)",
            "hosts.a.gpus.memory_gib=16 is invalid: it must hold r0s0, which the memory ledger predicts at 22.8 GiB "
            "(fast stage 0 of llama-3.2-1b); move it to a larger GPU or add stages",
        ),
        Case(
            group,
            "`--this-host z` not in the file",
            f"`{HOSTS}`",
            launch_hosts(meshtune, "mesh: 2x2\n" + TWO, "z"),
            CliExit,
            "exit 2: meshtune launch: error: --this-host='z' is invalid: it must name a host of the hosts file (a, b)",
        ),
        Case(
            group,
            "a second launcher for host a while the first one beats",
            "`launch_host(...)` (what `meshtune launch --hosts` calls)",
            second_launcher,
            ValueError,
            "this_host='a' is invalid: it must be claimed by one launcher: another launcher for this host beats at "
            "the coordinator's store (stop it first, or give this machine its own entry in the hosts file)",
        ),
    ]
