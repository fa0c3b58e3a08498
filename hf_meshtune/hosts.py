"""A hosts file: which machines run the mesh, what each has, and which (replica, stage) each runs.

``meshtune launch --hosts hosts.yaml --this-host NAME -- SCRIPT ARGS`` on every host reads the same file
(``load_hosts``); the launchers meet at the ``coordinator`` host's store (``host_launch.py``). A file::

    mesh: 3x2                 # X replicas (the anchor's included) x Y stages
    coordinator: a            # runs the torchft lighthouse and the mesh's store (default: the first host)
    port: 29400               # the lighthouse's port there; the store listens on port+1, the gate on port+2
    heartbeat_timeout_s: 10   # a host whose launcher is silent this long is lost
    max_restarts: 3           # restarts per replica (a failed process, or a lost host it ran on)
    stage_layers: [10, 6]     # optional: decoder layers per stage (exported as MESHTUNE_STAGE_LAYERS)
    hosts:
      - name: a
        address: 10.0.0.1
        gpus: {count: 2, memory_gib: 24, speed: 1.0}
        link: {up_mbit: 300, down_mbit: 300, rtt_ms: 40}
        runs: [r0s0, r0s1]    # optional; default: ranks in order, as many as the host has GPUs
      - name: b
        address: 10.0.0.2
        cpu: {processes: 2, speed: 0.3}

Without ``runs`` the mesh's ranks (r0s0, r0s1, ..., replica-major) fill the hosts in file order, each
host taking as many as it has GPUs (``gpus.count``) or CPU processes (``cpu.processes``). ``memory``
(optional) checks the placement against the memory ledger before anything starts:
``memory: {model: llama-3.2-1b, seq_len: 1024, microbatch_size: 1, microbatches: 8, dtype: bfloat16}``
(``model``: a ``meshtune ledger`` preset or a config.json path); a host whose processes need more than
its ``gpus.memory_gib`` is refused. ``speed`` and ``link`` describe the host for the planner and for
people; the launcher itself only validates them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._validation import require
from .topology import parse_mesh

__all__ = ["HostSpec", "HostsFile", "load_hosts", "parse_hosts"]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
_RANK = re.compile(r"^r(\d+)s(\d+)$")
_TOP_KEYS = {"mesh", "coordinator", "port", "heartbeat_timeout_s", "max_restarts", "stage_layers", "memory", "hosts"}
_HOST_KEYS = {"name", "address", "gpus", "cpu", "link", "runs"}
_MEMORY_KEYS = {"model", "seq_len", "microbatch_size", "microbatches", "dtype", "anchor", "gradient_checkpointing"}


@dataclass(frozen=True)
class HostSpec:
    """One host: its name, address, what it computes on, its link, and the mesh ranks it runs."""

    name: str
    address: str
    device: str  # "gpu" or "cpu"
    slots: int  # GPUs, or CPU processes
    speed: float
    memory_gib: float | None
    link: Mapping[str, float]
    ranks: tuple[int, ...]  # mesh ranks replica · Y + stage, ascending


@dataclass(frozen=True)
class HostsFile:
    """A validated hosts file (``load_hosts``)."""

    mesh: tuple[int, int]
    coordinator: str
    port: int
    heartbeat_timeout_s: float
    max_restarts: int
    stage_layers: tuple[int, ...] | None
    memory: Mapping[str, Any] | None
    hosts: tuple[HostSpec, ...]

    def host(self, name: str, field: str = "this_host") -> HostSpec:
        """The host called ``name``; ``field`` is what the error names when there is none."""
        names = [h.name for h in self.hosts]
        require(name in names, field, name, f"name a host of the hosts file ({', '.join(names)})")
        return self.hosts[names.index(name)]

    def host_of(self, rank: int) -> HostSpec:
        return next(h for h in self.hosts if rank in h.ranks)

    @property
    def coordinator_host(self) -> HostSpec:
        return self.host(self.coordinator, "coordinator")

    def replicas_of(self, host: HostSpec) -> list[int]:
        """The replicas with at least one process on ``host``, ascending."""
        return sorted({rank // self.mesh[1] for rank in host.ranks})

    def hosts_of_replica(self, replica: int) -> list[HostSpec]:
        y = self.mesh[1]
        return [h for h in self.hosts if any(rank // y == replica for rank in h.ranks)]

    def local_boundaries(self, replica: int) -> list[int]:
        """Boundaries b (stage b → b+1) of ``replica`` whose two stages run on one host."""
        y = self.mesh[1]
        first = replica * y
        return [b for b in range(y - 1) if self.host_of(first + b).name == self.host_of(first + b + 1).name]


def load_hosts(path: str) -> HostsFile:
    """Read and validate the hosts file at ``path`` (YAML; JSON is YAML too)."""
    import os

    import yaml  # type: ignore[import-untyped]  # accelerate's dependency

    require(os.path.isfile(path), "hosts", path, "be an existing hosts file (YAML)")
    with open(path, encoding="utf-8") as fh:
        try:
            data = yaml.safe_load(fh)
        except yaml.YAMLError as err:
            raise ValueError(f"hosts={path!r} is invalid: it must be YAML ({str(err).splitlines()[0]})") from err
    try:
        return parse_hosts(data)
    except ValueError as err:  # which file the field is in: every launcher reads its own copy
        raise ValueError(f"{path}: {err}") from err


def parse_hosts(data: Any) -> HostsFile:
    """Validate a hosts file's content (a mapping, as YAML loads it); every error names the field,
    the value and the rule."""
    require(isinstance(data, dict), "hosts file", type(data).__name__, "be a mapping with a `hosts:` list")
    unknown = sorted(set(data) - _TOP_KEYS)
    require(not unknown, "hosts file", unknown, f"use only the keys {sorted(_TOP_KEYS)}")
    raw_hosts = data.get("hosts")
    require(
        isinstance(raw_hosts, list) and len(raw_hosts) > 0, "hosts", raw_hosts, "be a non-empty list of host mappings"
    )
    hosts = [_host(i, h) for i, h in enumerate(raw_hosts)]
    _unique(hosts, "name")
    _unique(hosts, "address")
    mesh = _mesh(data.get("mesh"), hosts, raw_hosts)
    placed = _place(mesh, hosts, raw_hosts)
    coordinator = data.get("coordinator", placed[0].name)
    require(
        coordinator in [h.name for h in placed],
        "coordinator",
        coordinator,
        f"name a host of the file ({', '.join(h.name for h in placed)})",
    )
    port = data.get("port", 29400)
    require(_int(port) and 1 <= port <= 65533, "port", port, "be an integer in [1, 65533] (port+1 and +2 are used)")
    timeout = data.get("heartbeat_timeout_s", 10.0)
    require(_number(timeout) and timeout > 0, "heartbeat_timeout_s", timeout, "be a number of seconds > 0")
    restarts = data.get("max_restarts", 3)
    require(_int(restarts) and restarts >= 0, "max_restarts", restarts, "be an integer >= 0 (restarts per replica)")
    layers = data.get("stage_layers")
    if layers is not None:
        require(
            isinstance(layers, list) and len(layers) == mesh[1] and all(_int(n) and n >= 1 for n in layers),
            "stage_layers",
            layers,
            f"be a list of {mesh[1]} integers >= 1 (decoder layers per stage of the {mesh[0]}x{mesh[1]} mesh)",
        )
    memory = data.get("memory")
    if memory is not None:
        require(
            isinstance(memory, dict) and "model" in memory and not set(memory) - _MEMORY_KEYS,
            "memory",
            memory,
            f"be a mapping with `model` and only the keys {sorted(_MEMORY_KEYS)}",
        )
    result = HostsFile(
        mesh=mesh,
        coordinator=coordinator,
        port=port,
        heartbeat_timeout_s=float(timeout),
        max_restarts=restarts,
        stage_layers=None if layers is None else tuple(layers),
        memory=memory,
        hosts=tuple(placed),
    )
    if memory is not None:
        check_memory(result)
    return result


def _int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _host(i: int, raw: Any) -> dict[str, Any]:
    where = f"hosts[{i}]"
    require(isinstance(raw, dict), where, raw, "be a mapping with name, address and gpus or cpu")
    unknown = sorted(set(raw) - _HOST_KEYS)
    require(not unknown, where, unknown, f"use only the keys {sorted(_HOST_KEYS)}")
    name = raw.get("name")
    require(
        isinstance(name, str) and _NAME.match(name) is not None,
        f"{where}.name",
        name,
        "be given: letters, digits, '_', '.', '-'",
    )
    address = raw.get("address")
    require(isinstance(address, str) and address.strip() != "", f"{where}.address", address, "be an IP address or name")
    require(("gpus" in raw) != ("cpu" in raw), where, name, "give exactly one of `gpus:` and `cpu:`")
    device = "gpu" if "gpus" in raw else "cpu"
    spec = raw[device + "s" if device == "gpu" else device]
    count_key = "count" if device == "gpu" else "processes"
    field = f"{where}.{'gpus' if device == 'gpu' else 'cpu'}"
    allowed = {count_key, "speed"} | ({"memory_gib"} if device == "gpu" else set())
    require(
        isinstance(spec, dict) and not set(spec) - allowed,
        field,
        spec,
        f"be a mapping of {sorted(allowed)}",
    )
    slots = spec.get(count_key)
    require(_int(slots) and slots >= 1, f"{field}.{count_key}", slots, "be an integer >= 1")
    speed = spec.get("speed", 1.0)
    require(_number(speed) and speed > 0, f"{field}.speed", speed, "be a number > 0 (relative compute speed)")
    memory = spec.get("memory_gib")
    if memory is not None:
        require(_number(memory) and memory > 0, f"{field}.memory_gib", memory, "be a number of GiB > 0 (per GPU)")
    link = raw.get("link", {})
    require(
        isinstance(link, dict) and not set(link) - {"up_mbit", "down_mbit", "rtt_ms"},
        f"{where}.link",
        link,
        "be a mapping of up_mbit, down_mbit, rtt_ms",
    )
    for key, value in link.items():
        ok = _number(value) and (value >= 0 if key == "rtt_ms" else value > 0)
        require(ok, f"{where}.link.{key}", value, "be a number >= 0" if key == "rtt_ms" else "be a number > 0")
    return dict(
        name=name, address=address.strip(), device=device, slots=slots, speed=float(speed), memory_gib=memory, link=link
    )


def _unique(hosts: list[dict[str, Any]], key: str) -> None:
    seen: dict[str, int] = {}
    for i, host in enumerate(hosts):
        value = host[key]
        require(
            value not in seen,
            f"hosts[{i}].{key}",
            value,
            f"be unique: hosts[{seen.get(value)}] has it already (one entry, one launcher, per machine)",
        )
        seen[value] = i


def _runs(i: int, raw: Mapping[str, Any]) -> list[tuple[int, int]] | None:
    runs = raw.get("runs")
    if runs is None:
        return None
    require(
        isinstance(runs, list) and len(runs) > 0 and all(isinstance(r, str) and _RANK.match(r) for r in runs),
        f"hosts[{i}].runs",
        runs,
        "be a non-empty list of r<replica>s<stage>, e.g. [r0s0, r0s1]",
    )
    return [(int(m[1]), int(m[2])) for m in (_RANK.match(r) for r in runs) if m]


def _mesh(text: Any, hosts: list[dict[str, Any]], raw_hosts: list[Any]) -> tuple[int, int]:
    if text is None:
        runs = [_runs(i, raw) for i, raw in enumerate(raw_hosts)]
        require(
            all(r is not None for r in runs),
            "mesh",
            None,
            "be given (XxY), unless every host lists the ranks it `runs:`",
        )
        pairs = [p for r in runs for p in r or []]
        return max(r for r, _ in pairs) + 1, max(s for _, s in pairs) + 1
    return parse_mesh(text, "mesh")


def _place(mesh: tuple[int, int], hosts: list[dict[str, Any]], raw_hosts: list[Any]) -> list[HostSpec]:
    x, y = mesh
    world = x * y
    runs = [_runs(i, raw) for i, raw in enumerate(raw_hosts)]
    given = any(r is not None for r in runs)
    require(
        not given or all(r is not None for r in runs),
        "runs",
        [h["name"] for h, r in zip(hosts, runs) if r is None],
        "be given on every host or on none (these hosts lack it)",
    )
    if given:
        owner: dict[int, str] = {}
        ranks_of: list[list[int]] = []
        for i, (host, pairs) in enumerate(zip(hosts, runs)):
            ranks = []
            for replica, stage in pairs or []:
                tag = f"r{replica}s{stage}"
                require(replica < x and stage < y, f"hosts[{i}].runs", tag, f"name a rank of the {x}x{y} mesh")
                rank = replica * y + stage
                require(
                    rank not in owner, f"hosts[{i}].runs", tag, f"be run by one host only ({owner.get(rank)} runs it)"
                )
                owner[rank] = host["name"]
                ranks.append(rank)
            require(
                len(ranks) <= host["slots"],
                f"hosts[{i}].runs",
                [f"r{r // y}s{r % y}" for r in ranks],
                f"fit the host's {host['slots']} {'GPU' if host['device'] == 'gpu' else 'CPU process'}(es)",
            )
            ranks_of.append(sorted(ranks))
        missing = [f"r{r // y}s{r % y}" for r in range(world) if r not in owner]
        require(not missing, "runs", missing, f"place every rank of the {x}x{y} mesh (these run nowhere)")
    else:
        slots = sum(h["slots"] for h in hosts)
        require(
            slots >= world,
            "mesh",
            f"{x}x{y}",
            f"fit the hosts' {slots} GPUs/CPU processes (it needs {world}); add hosts or `runs:`",
        )
        ranks_of, start = [], 0
        for host in hosts:
            take = min(host["slots"], world - start)
            ranks_of.append(list(range(start, start + take)))
            start += take
    return [HostSpec(ranks=tuple(ranks), **host) for host, ranks in zip(hosts, ranks_of)]


def check_memory(hosts: HostsFile) -> None:
    """Refuse a placement a host's GPUs cannot hold, by the memory ledger (``memory:`` of the file)."""
    import os

    from .ledger import PRESETS
    from .memory_ledger import MemorySettings, predict_memory

    memory = dict(hosts.memory or {})
    model = memory.pop("model")
    if model in PRESETS:
        config = PRESETS[model]
    else:
        require(
            isinstance(model, str) and os.path.exists(model),
            "memory.model",
            model,
            f"be a ledger preset ({', '.join(sorted(PRESETS))}) or a config.json path",
        )
        from transformers import AutoConfig

        config = AutoConfig.from_pretrained(model)
    x, y = hosts.mesh
    settings = MemorySettings(
        num_replicas=x,
        num_stages=y,
        microbatch_size=memory.pop("microbatch_size", 1),
        microbatches=memory.pop("microbatches", 1),
        seq_len=memory.pop("seq_len", 1024),
        stage_layers=hosts.stage_layers,
        **memory,
    )
    rows = predict_memory(config, settings)
    need = {(row["role"], row["stage"]): int(row["total"]) for row in rows}
    for i, host in enumerate(hosts.hosts):
        if host.memory_gib is None:
            continue
        for rank in host.ranks:
            replica, stage = divmod(rank, y)
            role = "anchor" if settings.anchor and replica == x - 1 else "fast"
            gib = need[(role, stage)] / 2**30
            require(
                gib <= host.memory_gib,
                f"hosts.{host.name}.gpus.memory_gib",
                host.memory_gib,
                f"hold r{replica}s{stage}, which the memory ledger predicts at {gib:.1f} GiB "
                f"({role} stage {stage} of {model}); move it to a larger GPU or add stages",
            )
