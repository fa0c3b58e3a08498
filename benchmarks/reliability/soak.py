"""Soak: a mesh on emulated WAN links through a scripted series of real faults, and what it survived.

    sudo bash benchmarks/reliability/soak.sh        # ~35 min on 2 cores → results/soak.{json,md,png}
    sudo .venv/bin/python -m benchmarks.reliability.soak --smoke   # ~6 min → results/soak_smoke.*

One mesh runs with everything on, on a star of network namespaces (``benchmarks/wan/netns.py``; 8
nodes: the 6 ranks of a 3x2 tiny-Llama mesh, a service node where ``meshtune launch``'s gate,
lighthouse and store run, and an intruder's node), each rank in its own namespace, steps paced so that
the faults land mid-run: replica jobs (``--max-restarts``) with the anchor on (its link restartable,
``comm.pairlink``), a shared secret (``comm.gate``: every process knocks at the launcher's gate, every
listening socket admits the admitted addresses only), a checkpoint every 20 steps, and the faults,
injected by PID and by interface:

* ``kill``: a fast stage process SIGKILLed (its replica is restarted and heals from a peer);
* ``kill_anchor``: an anchor stage SIGKILLed (the anchor replica is restarted, its links come up again
  and it rejoins from fast replica 0's SYNC, without a resume);
* ``cut``: a node's link down for less than the pipeline timeout (the mesh waits) or longer (that
  replica fails, is restarted and heals; the anchor's pairs are rebuilt);
* ``straggler``: a node's link at a tenth of the rate;
* ``sigstop_anchor``: the anchor replica SIGSTOPped, then SIGCONTinued;
* ``crash``: the launcher and every process SIGKILLed at once, and the mesh relaunched from its newest
  complete checkpoint;
* ``intruder``: a process on the intruder's node, with a secret of its own, knocks at the gate and then
  tries to connect to every listening socket of every mesh namespace (``benchmarks/reliability/intruder.py``);
  survived when the gate refused and logged it and no socket let it connect.

Reported per fault and in total: faults injected, faults survived, optimizer steps lost (steps the
mesh recomputed after a resume; a replica kill loses none of the survivors' steps, and the steps the
restarted replica skipped by adopting a peer's state are reported apart), the survivors' pause (the
longest gap between two step ends of the fast replicas the fault did not touch, from the fault to 10 s
after it ended; a paced step is ~0.5 s), checkpoints lost (a complete checkpoint that vanished other
than by rotation or became unreadable; must be 0), intruders refused.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import signal
import subprocess
import sys
import threading
import time
from dataclasses import asdict, dataclass, field

from benchmarks.wan import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "benchmarks", "reliability", "results")
MESH, NODES, SERVICE, INTRUDER = (3, 2), 6, 6, 7
SECRET = secrets.token_hex(32)  # the mesh's, for this soak (every launch and relaunch gets it)
RATE_MBIT, DELAY_MS = 50.0, 5.0
LINK_TIMEOUT_S, CHECKPOINT_EVERY, CHECKPOINT_KEEP = 10.0, 20, 3
STEP_SECONDS = 0.3  # pacing added to every step, so a phase lasts minutes at a modest step count
MAX_RESTARTS = 12  # per replica: more than the faults that can hit one
_RESTART = re.compile(r"restarting replica (\d+)")


@dataclass
class Fault:
    at_s: float  # seconds after the phase's mesh took its 5th step
    kind: str  # kill | cut | straggler | sigstop_anchor | kill_anchor | crash | intruder
    target: int  # mesh rank (kill, kill_anchor) or node (cut, straggler); unused for sigstop_anchor, crash
    duration_s: float = 0.0
    injected_at_step: int | None = None
    outcome: str = "not injected (the run ended first)"
    survived: bool = False
    steps_lost: int = 0
    replica_steps_skipped: int = 0
    survivor_pause_s: float | None = None  # longest step gap of the untouched fast replicas (None: none)


@dataclass
class Phase:
    name: str
    replica_jobs: bool
    config: dict
    steps: int
    faults: list[Fault]
    out: str = ""
    lines: list[tuple[float, str]] = field(default_factory=list)
    complete_seen: dict[int, float] = field(default_factory=dict)
    checkpoints_lost: list[int] = field(default_factory=list)
    launches: int = 0
    wall_s: float = 0.0
    final: dict = field(default_factory=dict)
    timeline: list[list[float]] = field(default_factory=list)  # [seconds, step of every rank (-1: none)] each second
    fault_windows: list[tuple[float, float, str]] = field(default_factory=list)  # (start s, end s, kind)
    archived: int = 0  # progress folders set aside at relaunches (a resumed mesh counts its generations anew)


# ---------------------------------------------------------------------------------------------
# Watching the mesh
# ---------------------------------------------------------------------------------------------
def _latest(out: str, prefix: str, rank: int) -> tuple[int, str] | None:
    """(restart generation, file text) of the newest ``progress/{prefix}{rank}.g{n}`` file."""
    folder = os.path.join(out, "progress")
    best = None
    try:
        names = os.listdir(folder)
    except FileNotFoundError:
        return None
    for name in names:
        match = re.fullmatch(rf"{prefix}{rank}\.g(\d+)", name)
        if match and (best is None or int(match.group(1)) > best):
            best = int(match.group(1))
    if best is None:
        return None
    try:
        with open(os.path.join(folder, f"{prefix}{rank}.g{best}")) as handle:
            return best, handle.read()
    except OSError:
        return None


def step_of(out: str, rank: int) -> tuple[int, int, int] | None:
    """(generation, pid, step) of fast rank ``rank``'s newest process."""
    seen = _latest(out, "r", rank)
    if seen is None or not seen[1].strip():
        return None
    pid, step = seen[1].split()
    return seen[0], int(pid), int(step)


def step_ends(phase: Phase, rank: int) -> list[float]:
    """Wall times (``time.time()``) at which fast rank ``rank``'s processes ended a step, every generation
    and every launch (``progress/t{rank}.g{n}``, which ``tests/scripts/mesh_run.py`` appends to)."""
    times: list[float] = []
    folders = [os.path.join(phase.out, f"progress.{n}") for n in range(phase.archived)]
    for folder in [*folders, os.path.join(phase.out, "progress")]:
        try:
            names = os.listdir(folder)
        except FileNotFoundError:
            continue
        for name in names:
            if re.fullmatch(rf"t{rank}\.g\d+", name):
                with open(os.path.join(folder, name)) as handle:
                    times += [float(line.split()[1]) for line in handle if len(line.split()) == 2]
    return sorted(times)


def survivor_pause(phase: Phase, touched: set[int], start: float, end: float) -> float | None:
    """The longest gap between two step ends of a fast replica outside ``touched`` within [start, end]
    (wall times; the last step before ``start`` opens the window)."""
    gaps = []
    for rank in fast_ranks(phase):
        if rank // MESH[1] in touched:
            continue
        times = step_ends(phase, rank)
        window = [t for t in times if t < start][-1:] + [t for t in times if start <= t <= end]
        if len(window) >= 2:
            gaps.append(max(b - a for a, b in zip(window, window[1:])))
    return round(max(gaps), 2) if gaps else None


def pid_of(out: str, rank: int) -> int | None:
    seen = _latest(out, "pid", rank)
    return int(seen[1]) if seen and seen[1].strip() else None


def fast_ranks(phase: Phase) -> list[int]:
    anchor = MESH[0] - 1 if phase.config.get("anchor") else None
    return [r for r in range(NODES) if r // MESH[1] != anchor]


class Launch:
    """One ``benchmarks.reliability.launch`` run in the service namespace, its output timestamped."""

    def __init__(self, phase: Phase, env: dict[str, str], resume_from: str | None = None) -> None:
        argv = [
            *netns.exec_prefix(SERVICE),
            sys.executable,
            "-m",
            "benchmarks.reliability.launch",
            "--mesh",
            f"{MESH[0]}x{MESH[1]}",
            "--out",
            phase.out,
            "--steps",
            str(phase.steps),
            "--max-restarts",
            str(MAX_RESTARTS) if phase.replica_jobs else "0",
            "--config",
            json.dumps(phase.config),
            "--service-node",
            str(SERVICE),
        ]
        if phase.config.get("anchor") and not phase.replica_jobs:
            argv += ["--optional-replica", str(MESH[0] - 1)]  # the fast circuit trains on without a dead anchor
        full_env = {**os.environ, **env, "PYTHONPATH": ROOT, "RUST_LOG": "warn"}
        if resume_from:
            full_env["RESUME_FROM"] = resume_from
        self.phase = phase
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, env=full_env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self.log = open(os.path.join(phase.out, f"launcher{phase.launches}.log"), "w")
        phase.launches += 1
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.phase.lines.append((time.monotonic(), line.rstrip("\n")))
            self.log.write(line)
        self.log.flush()

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        finally:
            self.reader.join(timeout=5)
            self.log.close()


def _sample_steps(phase: Phase, stop: threading.Event, start: float) -> None:
    """Every second: the step every rank's newest process has reported (the plot's timeline)."""
    while not stop.is_set():
        steps = [float(seen[2]) if (seen := step_of(phase.out, r)) is not None else -1.0 for r in range(NODES)]
        phase.timeline.append([round(time.monotonic() - start, 1), *steps])
        stop.wait(1.0)


def _checkpoint_watch(phase: Phase, stop: threading.Event, keep: int) -> None:
    """Every second: which checkpoints are complete; a complete one that disappears while fewer than
    ``keep`` newer complete ones exist was lost (rotation only removes those with ``keep`` newer)."""
    from hf_meshtune.runtime.checkpoint import complete_checkpoints
    from hf_meshtune.topology import MeshTopology

    topology = MeshTopology(*MESH, anchor=phase.config.get("anchor", False))
    previous: set[int] = set()
    while not stop.is_set():
        now = {step for step, _ in complete_checkpoints(phase.out, topology)}
        for step in now - previous:
            phase.complete_seen.setdefault(step, time.monotonic())
        for step in previous - now:
            newer = [s for s in now if s > step]
            if len(newer) < keep:
                phase.checkpoints_lost.append(step)
        previous = now
        stop.wait(1.0)


def _verify_checkpoints(phase: Phase) -> int:
    """Load every fast rank's file of every complete checkpoint left; count the unreadable ones."""
    from hf_meshtune.runtime.checkpoint import complete_checkpoints, read_rank_state
    from hf_meshtune.topology import MeshTopology

    topology = MeshTopology(*MESH, anchor=phase.config.get("anchor", False))
    bad = 0
    for step, path in complete_checkpoints(phase.out, topology):
        for replica in topology.fast_replicas:
            for stage in range(topology.stages):
                try:
                    state = read_rank_state(path, topology.rank(replica, stage), topology)
                    assert state["step"] == step
                except Exception:  # noqa: BLE001 - counted, and named in the report
                    bad += 1
                    phase.checkpoints_lost.append(step)
    return bad


# ---------------------------------------------------------------------------------------------
# Faults
# ---------------------------------------------------------------------------------------------
def _fast_step(phase: Phase) -> int:
    """Where the mesh is: the largest step any fast process has reported."""
    steps = [seen[2] for r in fast_ranks(phase) if (seen := step_of(phase.out, r)) is not None]
    return max(steps, default=0)


def _lines_since(phase: Phase, since: float, text: str) -> bool:
    return any(text in line for t, line in phase.lines if t >= since)


def _await_line(phase: Phase, since: float, text: str, timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not _lines_since(phase, since, text):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def _restarts_since(phase: Phase, since: float) -> list[int]:
    return [int(m.group(1)) for t, line in phase.lines if t >= since and (m := _RESTART.search(line))]


def _await_heal(phase: Phase, replica: int, after_step: int, timeout: float) -> int | None:
    """The step replica ``replica``'s restarted processes took over from a peer (None: not yet)."""
    deadline = time.monotonic() + timeout
    ranks = [replica * MESH[1] + s for s in range(MESH[1])]
    while time.monotonic() < deadline:
        seen = [step_of(phase.out, r) for r in ranks]
        if all(s is not None and s[0] > 0 and s[2] > after_step for s in seen):
            return min(s[2] for s in seen)
        time.sleep(0.5)
    return None


def inject(phase: Phase, fault: Fault, launch: Launch) -> Launch:
    """Inject one fault, judge how the mesh got through it and how long its survivors paused; returns
    the launch that runs now."""
    fault.injected_at_step = _fast_step(phase)
    wall = time.time()
    launch = _inject(phase, fault, launch)
    touched = {fault.target // MESH[1]} if fault.kind in ("kill", "cut", "straggler") else set()
    if fault.kind != "crash":
        fault.survivor_pause_s = survivor_pause(phase, touched, wall, wall + fault.duration_s + 10)
    print(
        f"[soak {phase.name}] {fault.kind}: {fault.outcome} → {'survived' if fault.survived else 'NOT survived'}"
        f" (survivors' longest step gap: {fault.survivor_pause_s} s)",
        flush=True,
    )
    return launch


def _inject(phase: Phase, fault: Fault, launch: Launch) -> Launch:
    start = time.monotonic()
    if fault.kind == "kill":
        pid, replica = pid_of(phase.out, fault.target), fault.target // MESH[1]
        os.kill(pid, signal.SIGKILL)
        healed = _await_heal(phase, replica, fault.injected_at_step, timeout=120)
        fault.survived = healed is not None and replica in _restarts_since(phase, start)
        fault.replica_steps_skipped = healed - fault.injected_at_step if healed is not None else 0
        fault.outcome = (
            f"rank {fault.target} (pid {pid}) SIGKILLed at step {fault.injected_at_step}; replica {replica} "
            f"restarted and healed from a peer at step {healed}"
            if fault.survived
            else f"rank {fault.target} SIGKILLed; replica {replica} did not heal within 120 s"
        )
    elif fault.kind in ("cut", "straggler"):
        before = _fast_step(phase)
        if fault.kind == "cut":
            netns.set_link(fault.target, False)
        else:
            netns.set_rate(fault.target, RATE_MBIT / 10)
        time.sleep(fault.duration_s)
        during = _fast_step(phase) - before
        netns.set_link(fault.target, True) if fault.kind == "cut" else netns.set_rate(fault.target, RATE_MBIT)
        time.sleep(LINK_TIMEOUT_S + 5)
        restarted = sorted(set(_restarts_since(phase, start)))
        anchor = MESH[0] - 1 if phase.config.get("anchor") else None
        healed = [
            _await_heal(phase, r, fault.injected_at_step, timeout=120)
            if r != anchor  # a restarted anchor replica has no steps of its own: its links come up again
            else (_await_line(phase, start, "the anchor link to mesh rank", timeout=120) or None)
            for r in restarted
        ]
        moving = _fast_step(phase) > fault.injected_at_step
        fault.survived = moving and all(h is not None for h in healed) and launch.proc.poll() in (None, 0)
        what = "link cut" if fault.kind == "cut" else "link at a tenth of the rate"
        back = [
            f"replica {r} healed at step {h}" if r != anchor else "the anchor replica's links came up again"
            for r, h in zip(restarted, healed)
            if h is not None
        ]
        how = (
            f"replica(s) {restarted} failed past the {LINK_TIMEOUT_S:.0f} s timeout and were restarted; "
            + ("; ".join(back) if back else "none came back within 120 s")
            if restarted
            else "no process failed; the mesh waited it out"
        )
        fault.outcome = (
            f"node {fault.target}: {what} for {fault.duration_s:.0f} s ({during} fast steps meanwhile); {how}"
        )
        fault.replica_steps_skipped = sum(
            h - fault.injected_at_step for r, h in zip(restarted, healed) if r != anchor and h is not None
        )
    elif fault.kind == "sigstop_anchor":
        pids = [pid_of(phase.out, r) for r in range(NODES - MESH[1], NODES)]
        before = _fast_step(phase)
        for pid in pids:
            os.kill(pid, signal.SIGSTOP)
        time.sleep(fault.duration_s)
        during = _fast_step(phase) - before
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
        fault.survived = during > 0 and launch.proc.poll() in (None, 0)
        fault.outcome = (
            f"anchor replica (pids {pids}) SIGSTOPped for {fault.duration_s:.0f} s: the fast circuit took "
            f"{during} steps meanwhile; SIGCONT"
        )
    elif fault.kind == "kill_anchor":
        pid = pid_of(phase.out, fault.target)
        os.kill(pid, signal.SIGKILL)
        back = _await_line(phase, start, f"the anchor link to mesh rank {fault.target} is up again", timeout=120)
        restarted = MESH[0] - 1 in _restarts_since(phase, start)
        after = _fast_step(phase)
        fault.survived = restarted and back and after > fault.injected_at_step and launch.proc.poll() is None
        fault.outcome = (
            f"anchor rank {fault.target} (pid {pid}) SIGKILLed at step {fault.injected_at_step}: the anchor replica "
            f"{'was restarted' if restarted else 'was not restarted'} and its links "
            f"{'came up again' if back else 'did not come back within 120 s'} (it rejoins from fast replica 0's "
            f"SYNC); the fast circuit was at step {after} by then"
        )
    elif fault.kind == "crash":
        crashed_at = _fast_step(phase)
        pids = [pid_of(phase.out, r) for r in range(NODES)]
        launch.proc.kill()  # the launcher (and its lighthouse and store), then every process of the mesh
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, TypeError):
                pass
        code = launch.wait(timeout=120)
        for pid in pids:  # gone before the relaunch binds its ports
            while pid is not None and os.path.exists(f"/proc/{pid}") and _state(pid) != "Z":
                time.sleep(0.1)
        from hf_meshtune.runtime.checkpoint import latest_complete_checkpoint
        from hf_meshtune.topology import MeshTopology

        checkpoint = latest_complete_checkpoint(
            phase.out, MeshTopology(*MESH, anchor=phase.config.get("anchor", False))
        )
        resumed_from = int(checkpoint.rsplit("-", 1)[1]) if checkpoint else 0
        # the relaunch counts restarts from 0 again: the old progress files go aside (their timelines stay read)
        os.rename(os.path.join(phase.out, "progress"), os.path.join(phase.out, f"progress.{phase.archived}"))
        phase.archived += 1
        launch = Launch(phase, _env(phase), resume_from=checkpoint)
        fault.steps_lost = crashed_at - resumed_from
        resumed = _await_progress(phase, resumed_from, timeout=180)
        fault.survived = checkpoint is not None and resumed
        fault.outcome = (
            f"the launcher and all {NODES} processes SIGKILLed at step {crashed_at} (launcher exit {code}); "
            f"relaunched from {os.path.basename(checkpoint or 'nothing')}, recomputing {fault.steps_lost} steps"
            + ("" if resumed else "; the relaunch did not train within 180 s")
        )
    elif fault.kind == "intruder":
        fault.survived, fault.outcome = _intrude(phase, start, launch)
    else:
        raise ValueError(
            f"fault kind={fault.kind!r} is invalid: it must be kill, cut, straggler, sigstop_anchor, "
            "kill_anchor, crash or intruder"
        )
    return launch


def _mesh_listeners(gate: tuple[str, int] | None) -> list[tuple[str, int]]:
    """Every listening TCP socket of the mesh's namespaces (the ranks' and the service node's) that
    another node could reach, as the kernel lists them; the gate, open by design, left out."""
    found = []
    for node in range(NODES + 1):
        out = subprocess.run([*netns.exec_prefix(node), "ss", "-Hltn"], capture_output=True, text=True).stdout
        for line in out.splitlines():
            address, port = line.split()[3].rsplit(":", 1)
            address = address.strip("[]").split("%")[0]
            if address in ("*", "0.0.0.0", "::"):
                address = netns.node_ip(node)
            if address.startswith("127.") or address == "::1":
                continue  # loopback: no other node can reach it
            if (address, int(port)) != gate:
                found.append((address, int(port)))
    return sorted(set(found))


def _intrude(phase: Phase, start: float, launch: Launch) -> tuple[bool, str]:
    gates = [m for _, line in phase.lines if (m := re.search(r"gate (\S+):(\d+): only processes", line))]
    if not gates:
        return False, "no gate in the launcher's output: the mesh runs without a secret"
    gate = (gates[-1].group(1), int(gates[-1].group(2)))
    targets = _mesh_listeners(gate)
    before = _fast_step(phase)
    proc = subprocess.run(
        [*netns.exec_prefix(INTRUDER), sys.executable, "-m", "benchmarks.reliability.intruder",
         "--gate", f"{gate[0]}:{gate[1]}", "--targets", json.dumps(targets)],
        cwd=ROOT, env={**os.environ, "PYTHONPATH": ROOT}, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    try:
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, ValueError):
        return False, f"the intruder did not report (exit {proc.returncode}): {proc.stderr[-500:]}"
    logged = _await_line(phase, start, "meshtune gate: refused", timeout=10)
    time.sleep(5)
    moving = _fast_step(phase) > before and launch.proc.poll() is None
    survived = seen["refused_at_gate"] and logged and not seen["reached"] and moving
    outcome = (
        f"a process without the secret on node {INTRUDER} was "
        + ("refused at the gate" if seen["refused_at_gate"] else f"NOT refused at the gate ({seen['gate_said']})")
        + (" (logged by the launcher)" if logged else " (no refusal logged)")
        + f"; {len(seen['reached'])} of {seen['tried']} listening sockets of the mesh let it connect"
        + (f": {seen['reached']}" if seen["reached"] else "")
        + ("; the mesh trained on" if moving else "; the mesh did not train on")
    )
    return survived, outcome


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "Z"


def _await_progress(phase: Phase, past: int, timeout: float) -> bool:
    """Whether every fast rank of the relaunched mesh reports a step past ``past`` within ``timeout``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        seen = [step_of(phase.out, r) for r in fast_ranks(phase)]
        if all(s is not None and s[2] > past for s in seen):
            return True
        time.sleep(0.5)
    return False


def _env(phase: Phase) -> dict[str, str]:
    return {
        "STEP_SECONDS": str(STEP_SECONDS),
        "CHECKPOINT_EVERY": str(CHECKPOINT_EVERY),
        "CHECKPOINT_KEEP": str(CHECKPOINT_KEEP),
        "LINK_TIMEOUT_S": str(LINK_TIMEOUT_S),
        # quorums and all-reduces give up as soon as the links do: a replica whose stage is cut keeps
        # heartbeating from its other stage, and the lighthouse holds the survivors' quorum for it until
        # their own quorum times out (with 30 s, a 25 s cut stopped every replica for 28 s)
        "DP_TIMEOUT_S": str(LINK_TIMEOUT_S),
        "RESTART_DELAY_S": "5",
        "MESHTUNE_SECRET": SECRET,
    }


def run_phase(phase: Phase) -> None:
    os.makedirs(phase.out, exist_ok=True)
    stop = threading.Event()
    watcher = threading.Thread(target=_checkpoint_watch, args=(phase, stop, CHECKPOINT_KEEP), daemon=True)
    watcher.start()
    start = time.monotonic()
    sampler = threading.Thread(target=_sample_steps, args=(phase, stop, start), daemon=True)
    sampler.start()
    launch = Launch(phase, _env(phase))
    while _fast_step(phase) < 5:
        if launch.proc.poll() is not None:
            raise RuntimeError(
                f"phase {phase.name}: the mesh exited with {launch.proc.returncode} before step 5; "
                f"see {phase.out}/launcher0.log"
            )
        time.sleep(0.5)
    t0 = time.monotonic()
    for fault in sorted(phase.faults, key=lambda f: f.at_s):
        while time.monotonic() - t0 < fault.at_s and launch.proc.poll() is None:
            time.sleep(0.2)
        if launch.proc.poll() is not None:
            break
        began = time.monotonic() - start
        launch = inject(phase, fault, launch)
        phase.fault_windows.append((round(began, 1), round(began + max(fault.duration_s, 1.0), 1), fault.kind))
    code = launch.wait(timeout=3600)
    phase.wall_s = time.monotonic() - start
    stop.set()
    watcher.join()
    sampler.join()
    unreadable = _verify_checkpoints(phase)
    phase.final = _final(phase, code, unreadable)
    if code != 0:
        for fault in phase.faults:
            fault.survived = False


def _final(phase: Phase, code: int, unreadable: int) -> dict:
    import torch

    results = []
    for rank in range(NODES):
        try:
            results.append(torch.load(os.path.join(phase.out, f"result{rank}.pt"), weights_only=False))
        except OSError:
            results.append(None)
    fast = [r for r in results if r is not None and r.role == "fast"]
    equal = None
    if fast and all(r.global_params is not None for r in fast):
        equal = all(
            all(torch.equal(a, b) for a, b in zip(fast[0 if r.stage == 0 else 1].global_params, r.global_params))
            for r in fast
        )
    losses = [r.losses for r in fast if r.losses]
    return {
        "exit_code": code,
        "steps": phase.steps,
        "fast_steps_done": [r.steps for r in fast],
        "identical_theta_global_across_replicas": equal,
        "unreadable_checkpoint_files": unreadable,
        "complete_checkpoints_seen": sorted(phase.complete_seen),
        "first_last_loss": [[round(x[0], 3), round(x[-1], 3)] for x in losses],
        "heals_in_final_processes": [r.heals for r in fast],
        "launches": phase.launches,
    }


# ---------------------------------------------------------------------------------------------
# The two phases and the report
# ---------------------------------------------------------------------------------------------
def phases(smoke: bool, out: str) -> list[Phase]:
    """One phase, everything on: replica jobs with the anchor, a fault every ~70 s after the 5th step."""
    if smoke:
        faults = [
            Fault(15, "kill", 3),
            Fault(60, "kill_anchor", 5),
            Fault(110, "cut", 2, 3.0),
            Fault(140, "sigstop_anchor", 0, 8.0),
            Fault(170, "crash", 0),
            Fault(230, "kill", 1),
            Fault(270, "intruder", INTRUDER),
        ]
        steps = 700
    else:
        script = [
            ("kill", 3, 0.0),
            ("sigstop_anchor", 0, 20.0),
            ("kill_anchor", 5, 0.0),
            ("cut", 4, 4.0),
            ("kill", 1, 0.0),  # fast replica 0's stage 1: the stage that forwards the outer updates
            ("intruder", INTRUDER, 0.0),
            ("straggler", 2, 30.0),
            ("cut", 1, 25.0),  # past the 10 s timeout: replica 0 fails and is restarted
            ("kill_anchor", 4, 0.0),
            ("cut", 3, 3.0),
            ("sigstop_anchor", 0, 10.0),
            ("crash", 0, 0.0),
            ("kill", 2, 0.0),
            ("cut", 5, 25.0),  # the anchor's stage 1, past the timeout
            ("kill", 0, 0.0),
            ("cut", 0, 4.0),
            ("sigstop_anchor", 0, 15.0),
            ("kill_anchor", 5, 0.0),
            ("straggler", 1, 30.0),
            ("cut", 2, 25.0),
            ("kill", 3, 0.0),
            ("cut", 4, 3.0),
            ("crash", 0, 0.0),
            ("kill_anchor", 4, 0.0),
            ("kill", 1, 0.0),
            ("sigstop_anchor", 0, 20.0),
            ("intruder", INTRUDER, 0.0),  # after two crashes: the relaunched mesh's new gate
            ("cut", 3, 4.0),
        ]
        faults = [Fault(40 + 65 * i, kind, target, duration) for i, (kind, target, duration) in enumerate(script)]
        steps = 3900
    anchor = {"anchor": True, "anchor_every": 4, "anchor_delay": 0, "spectral_tau": 1e-3, "anchor_max_staleness": 40}
    return [Phase("all-on", True, anchor, steps, faults, out=os.path.join(out, "all_on"))]


def report(ran: list[Phase]) -> dict:
    faults = [(p.name, f) for p in ran for f in p.faults]
    injected = [f for _, f in faults if f.injected_at_step is not None]
    return {
        "setup": {
            "mesh": f"{MESH[0]}x{MESH[1]}",
            "model": "tiny Llama (H=64, 4 layers)",
            "rate_mbit": RATE_MBIT,
            "delay_ms": DELAY_MS,
            "link_timeout_s": LINK_TIMEOUT_S,
            "dp_timeout_s": LINK_TIMEOUT_S,
            "checkpoint_every": CHECKPOINT_EVERY,
            "checkpoint_keep": CHECKPOINT_KEEP,
            "step_pacing_s": STEP_SECONDS,
        },
        "faults_injected": len(injected),
        "faults_survived": sum(f.survived for f in injected),
        "optimizer_steps_lost": sum(f.steps_lost for f in injected),
        "replica_steps_skipped_by_healing": sum(f.replica_steps_skipped for f in injected),
        "longest_survivor_pause_s": max((f.survivor_pause_s or 0.0 for f in injected), default=None),
        "checkpoints_lost": sum(len(p.checkpoints_lost) for p in ran),
        "intruders_refused": sum(f.survived for f in injected if f.kind == "intruder"),
        "intruders": sum(f.kind == "intruder" for f in injected),
        "wall_minutes": round(sum(p.wall_s for p in ran) / 60, 1),
        "phases": [
            {
                "name": p.name,
                "replica_jobs": p.replica_jobs,
                "config": p.config,
                "wall_s": round(p.wall_s, 1),
                "checkpoints_lost": p.checkpoints_lost,
                **p.final,
                "faults": [asdict(f) for f in p.faults],
                "fault_windows": p.fault_windows,
                "timeline": p.timeline,
            }
            for p in ran
        ],
    }


def plot(summary: dict, path: str) -> None:
    """Step of every fast replica against time, one panel per phase, the faults shaded and named."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(summary["phases"]), 1, figsize=(10, 3.6 * len(summary["phases"])), squeeze=False)
    for ax, phase in zip(axes[:, 0], summary["phases"]):
        rows = phase["timeline"]
        if not rows:
            continue
        anchor = phase["config"].get("anchor")
        for replica in range(MESH[0] - 1 if anchor else MESH[0]):  # the anchor reports no fast steps
            rank = replica * MESH[1] + MESH[1] - 1  # its last stage (the stages of a replica step together)
            points = [(row[0], row[1 + rank]) for row in rows if row[1 + rank] >= 0]
            ax.plot([t for t, _ in points], [s for _, s in points], lw=1.2, label=f"replica {replica} (rank {rank})")
        for begin, end, kind in phase["fault_windows"]:
            ax.axvspan(begin, end, color="tab:red", alpha=0.15)
            ax.text(begin, ax.get_ylim()[1] * 0.97, kind, rotation=90, va="top", fontsize=7)
        mode = ("replica jobs" if phase["replica_jobs"] else "one world") + (", anchor on" if anchor else ", no anchor")
        ax.set(title=f"phase {phase['name']} ({mode})", xlabel="seconds", ylabel="fast step")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def markdown(summary: dict) -> str:
    """The report; a summary written before the survivors' pauses were measured (the two-phase soak of
    stop 33, ``results/soak.json``) renders as it did then."""
    paused = "longest_survivor_pause_s" in summary
    guarded = "intruders" in summary  # soaks with a shared secret
    command = summary.get("command", "sudo bash benchmarks/reliability/soak.sh")
    lines = [
        "# Soak",
        "",
        f"{summary['wall_minutes']} min on 2 CPU cores; `{command}`.",
        "",
        "| faults injected | survived | optimizer steps lost | replica steps skipped by healing | checkpoints lost "
        + ("| longest survivor pause (s) |" if paused else "|")
        + (" intruders refused |" if guarded else ""),
        "|---:|---:|---:|---:|---:|" + ("---:|" if paused else "") + ("---:|" if guarded else ""),
        f"| {summary['faults_injected']} | {summary['faults_survived']} | {summary['optimizer_steps_lost']} | "
        f"{summary['replica_steps_skipped_by_healing']} | {summary['checkpoints_lost']} |"
        + (f" {summary['longest_survivor_pause_s']} |" if paused else "")
        + (f" {summary['intruders_refused']} of {summary['intruders']} |" if guarded else ""),
        "",
        "| phase | fault | at step | survived | steps lost | survivor pause (s) | outcome |"
        if paused
        else "| phase | fault | at step | survived | outcome |",
        "|---|---|---:|---|---:|---:|---|" if paused else "|---|---|---:|---|---|",
    ]
    for phase in summary["phases"]:
        for f in phase["faults"]:
            pause = "n/a" if f.get("survivor_pause_s") is None else f["survivor_pause_s"]
            measured = f"{f['steps_lost']} | {pause} | " if paused else ""
            lines.append(
                f"| {phase['name']} | {f['kind']} | {f['injected_at_step']} | {'yes' if f['survived'] else 'no'} | "
                f"{measured}{f['outcome']} |"
            )
    lines += ["", "Setup: " + json.dumps(summary["setup"]), ""]
    for phase in summary["phases"]:
        lines.append(
            f"Phase {phase['name']}: exit {phase['exit_code']}, {phase['launches']} launch(es), "
            f"{phase['wall_s']} s, identical θ_global across replicas: "
            f"{phase['identical_theta_global_across_replicas']}, complete checkpoints seen: "
            f"{len(phase['complete_checkpoints_seen'])}, first/last loss per fast last stage: "
            f"{phase['first_last_loss']}."
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.reliability.soak", description=__doc__.split("\n\n")[0])
    parser.add_argument("--smoke", action="store_true", help="six faults in ~6 min")
    parser.add_argument("--out", default=os.path.join(ROOT, ".cache", "soak"))
    args = parser.parse_args(argv)
    netns.up(NODES + 2, RATE_MBIT, DELAY_MS)  # the ranks, the service node, the intruder's node
    try:
        ran = phases(args.smoke, args.out)
        for phase in ran:
            if os.path.isdir(phase.out):
                import shutil

                shutil.rmtree(phase.out)
            run_phase(phase)
    finally:
        netns.down()
    summary = report(ran)
    summary["command"] = (
        "sudo .venv/bin/python -m benchmarks.reliability.soak --smoke" if args.smoke
        else "sudo bash benchmarks/reliability/soak.sh"
    )  # fmt: skip
    os.makedirs(RESULTS, exist_ok=True)
    name = "soak_smoke" if args.smoke else "soak"
    with open(os.path.join(RESULTS, f"{name}.json"), "w") as handle:
        json.dump(summary, handle, indent=2)
    with open(os.path.join(RESULTS, f"{name}.md"), "w") as handle:
        handle.write(markdown(summary))
    plot(summary, os.path.join(RESULTS, f"{name}.png"))
    print(markdown(summary))
    ok = summary["faults_survived"] == summary["faults_injected"] and summary["checkpoints_lost"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
