"""One launcher per host: ``meshtune launch --hosts FILE --this-host NAME -- SCRIPT ARGS``.

Every host runs the same command with its own name. The hosts file (``hosts.py``) says which mesh
ranks each host runs; the launchers meet at the coordinator host's store (``port`` + 1 there), where
the coordinator's launcher also runs the torchft lighthouse (``port``) and, with a secret, the gate
(``port`` + 2). Every replica is a job of its own, as with ``meshtune launch --max-restarts``: its Y
processes form one torch.distributed world whose rendezvous the host of its stage 0 serves, on a
fresh port per attempt, published in the store. Replicas meet through torchft as on one machine.

What the launchers agree on, in the store (keys ``mt/...``):

* ``mt/r{r}/attempt``: replica r's attempt. A launcher whose process of replica r fails bumps it
  (compare-and-set, so two failures of one attempt count once); every launcher with processes of r
  sees the new attempt, stops its processes of r and starts them again. Attempt a > ``max_restarts``
  stops the mesh (``mt/stop``).
* ``mt/host/{name}/beat``: a counter each launcher adds to every ``beat_s``. A host whose counter has
  not moved for ``heartbeat_timeout_s`` is lost: every launcher with processes of a replica that host
  served stops them and bumps the attempt; the replica starts again once all its hosts beat again.
  The other replicas go on (torchft's quorum shrinks, then grows back when the replica heals).
* A launcher started again for a host that ran before (``mt/host/{name}/starts`` > 1) bumps its
  replicas' attempts unless the other hosts already did, so no process of the old attempt is joined.
* Two launchers for one host: a starting launcher that sees the host's counter move refuses to run.

The run ends when every replica has finished an attempt with all its processes exiting 0, and every
launcher then exits 0; a replica waiting for a lost host that never comes back is given up once every
other replica is done, and a replica whose process fails after another of its processes finished cannot
start again (``mt/stop``: every launcher exits with that code). A host whose replicas are done stops
beating and waits with the others; the coordinator keeps its store until the others have left. Losing the
coordinator host ends the mesh: it holds the lighthouse and the store.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from ._validation import require
from .console import Console, StepProgress
from .hosts import HostsFile, HostSpec
from .launch import DEFAULT_GRACE_S, _cpu_count, _Gatekeeper, _rank_tag, child_argv, child_env, free_port
from .processes import _Child, _Mesh, _SignalTrap
from .topology import LOCAL_BOUNDARIES_ENV, STAGE_LAYERS_ENV

__all__ = ["launch_host"]
CONNECT_TIMEOUT_S = 600.0  # how long a launcher waits for the coordinator's store to appear


def _say(message: str) -> None:
    print(f"meshtune launch: {message}", file=sys.stderr, flush=True)


def launch_host(
    hosts: HostsFile,
    this_host: str,
    command: list[str],
    *,
    log_dir: str | None = None,
    env: dict[str, str] | None = None,
    grace_s: float = DEFAULT_GRACE_S,
    all_ranks: bool = False,
) -> int:
    """Run this host's ranks of the mesh ``hosts`` describes; the exit code (module docstring).

    ``this_host``: this machine's name in the file. ``command``: ``["script.py", *args]`` or
    ``["-m", "module", *args]``. ``env`` is added to every child's environment last."""
    from .launch import _validate

    me = hosts.host(this_host)
    _validate(hosts.mesh, command, None, None)
    log_dir = log_dir if log_dir is not None else tempfile.mkdtemp(prefix="meshtune-logs-")
    os.makedirs(log_dir, exist_ok=True)
    coordinator = hosts.coordinator_host
    services = _Services(hosts, me) if me.name == coordinator.name else None
    try:
        host = _HostLauncher(hosts, me, command, log_dir, dict(env or {}), grace_s, all_ranks)
        return host.run()
    finally:
        if services is not None:
            services.close()


class _Services:
    """What the coordinator host serves: the lighthouse, the mesh's store and, with a secret, the gate."""

    def __init__(self, hosts: HostsFile, me: HostSpec) -> None:
        from .comm.gate import secret_key
        from .comm.listen import bound_store, listen_address
        from .dp.ft import start_lighthouse

        key = secret_key()
        self.gatekeeper = None if key is None else _Gatekeeper(key, me.address, port=hosts.port + 2)
        self.lighthouse, _ = start_lighthouse(host=me.address, port=hosts.port)
        self.store = bound_store(listen_address(me.address), hosts.port + 1)
        if self.gatekeeper is not None:
            self.gatekeeper.guard(hosts.port, hosts.port + 1)
        _say(f"coordinator: lighthouse {me.address}:{hosts.port}, store {me.address}:{hosts.port + 1}")

    def close(self) -> None:
        self.lighthouse.shutdown()
        if self.gatekeeper is not None:
            self.gatekeeper.close()
        del self.store


def _client(address: str, port: int, timeout_s: float) -> dist.TCPStore:
    return dist.TCPStore(address, port, is_master=False, timeout=timedelta(seconds=timeout_s))


class _HostLauncher:
    """This host's processes and its part in the launchers' agreement (module docstring)."""

    def __init__(self, hosts: HostsFile, me: HostSpec, command: list[str], log_dir: str, env: dict[str, str],
                 grace_s: float, all_ranks: bool) -> None:  # fmt: skip
        from .comm.gate import GATE_ENV, secret_key

        self.hosts, self.me, self.command, self.log_dir, self.env = hosts, me, command, log_dir, env
        self.x, self.y = hosts.mesh
        coord = hosts.coordinator_host
        key = secret_key()
        if key is not None:
            gate = f"{coord.address}:{hosts.port + 2}"
            _knock_until_open(gate, key, me.address)
            self.env[GATE_ENV] = gate
        self.store_address = f"{coord.address}:{hosts.port + 1}"
        self.lighthouse = f"http://{coord.address}:{hosts.port}"
        self.store = _client(coord.address, hosts.port + 1, CONNECT_TIMEOUT_S)
        self.beat_s = min(1.0, hosts.heartbeat_timeout_s / 5)
        self._refuse_a_second_launcher()
        self.stop_beating = threading.Event()
        beat_store = _client(coord.address, hosts.port + 1, CONNECT_TIMEOUT_S)
        threading.Thread(target=self._beat, args=(beat_store,), daemon=True, name="meshtune-beat").start()
        self.replicas = hosts.replicas_of(me)
        self.running: dict[int, int | None] = dict.fromkeys(self.replicas)  # replica → attempt started here
        self.seen: dict[str, tuple[int, float]] = {}  # host → (beat counter, when it last moved)
        loss = self.y - 1
        tag = _rank_tag(hosts.mesh, loss if loss in me.ranks else (me.ranks[0] if me.ranks else 0))
        self.console = Console(tag, StepProgress(command, tag), all_ranks)
        self.mesh = _Mesh(grace_s, console=self.console)
        starts = self.store.add(f"mt/host/{me.name}/starts", 1)
        if starts > 1:
            self._rejoin()
        _say(
            f"host {me.name} ({me.address}): {hosts.mesh[0]}x{hosts.mesh[1]} mesh, runs "
            f"{', '.join(_rank_tag(hosts.mesh, r) for r in me.ranks) or 'no rank'}; store {self.store_address}; "
            f"every rank's output: {os.path.join(log_dir, 'rank<N>.log')}"
        )

    # --- the agreement ----------------------------------------------------------------------------

    def _refuse_a_second_launcher(self) -> None:
        key = f"mt/host/{self.me.name}/beat"
        before = self.store.add(key, 0)
        time.sleep(3 * self.beat_s)
        now = self.store.add(key, 0)
        require(
            now == before,
            "this_host",
            self.me.name,
            "be claimed by one launcher: another launcher for this host beats at the coordinator's store "
            "(stop it first, or give this machine its own entry in the hosts file)",
        )

    def _beat(self, store: dist.TCPStore) -> None:
        key = f"mt/host/{self.me.name}/beat"
        while not self.stop_beating.wait(self.beat_s):
            try:
                store.add(key, 1)
            except Exception:  # the coordinator is gone: the main loop finds out and says so
                return

    def _attempt(self, replica: int) -> int:
        return self.store.add(f"mt/r{replica}/attempt", 0)

    def _bump(self, replica: int, attempt: int) -> None:
        self.store.compare_set(f"mt/r{replica}/attempt", str(attempt), str(attempt + 1))

    def _rejoin(self) -> None:
        """A launcher started again for a host that ran before: its replicas' old attempts are void."""
        for replica in self.replicas:
            attempt = self._attempt(replica)
            key = f"mt/host/{self.me.name}/r{replica}/started"
            last = int(self.store.get(key)) if self.store.check([key]) else -1
            if last == attempt:  # the old launcher had started this very attempt
                self._bump(replica, attempt)
                _say(f"host {self.me.name} rejoins: replica {replica} starts again (attempt {attempt + 1})")

    def _alive(self, host: HostSpec) -> bool:
        """Whether ``host``'s launcher beats: its counter moved within the heartbeat timeout (a counter
        seen for the first time counts as moving; a host that never beat is not alive)."""
        if host.name == self.me.name:
            return True
        count = self.store.add(f"mt/host/{host.name}/beat", 0)
        now, last = time.monotonic(), self.seen.get(host.name)
        if last is None or last[0] != count:
            self.seen[host.name] = (count, now)
            return count > 0
        return count > 0 and now - last[1] < self.hosts.heartbeat_timeout_s

    def _lost(self, host: HostSpec) -> bool:
        """Beat once, then fell silent past the timeout, without saying it was done (a host not yet
        started is not lost: its replicas wait for it)."""
        alive = self._alive(host)
        return not alive and self.seen[host.name][0] > 0 and not self.store.check([f"mt/host/{host.name}/done"])

    def _done(self, replica: int) -> bool:
        attempt = self._attempt(replica)
        return self.store.add(f"mt/r{replica}/a{attempt}/ok", 0) >= self.y

    # --- this host's processes --------------------------------------------------------------------

    def _children(self, replica: int) -> list[_Child]:
        return [c for c in self.mesh.children if not c.retired and c.rank // self.y == replica]

    def _stop_replica(self, replica: int) -> None:
        mates = self._children(replica)
        for mate in mates:  # their exits (ours to cause) are not failures
            mate.retired = True
        self.mesh.stop(mates)
        self.running[replica] = None

    def _try_start(self, replica: int, attempt: int) -> bool:
        """Start this host's processes of ``replica``'s ``attempt`` once all its hosts beat and its port is out."""
        if self.store.check(["mt/stop"]):
            return False
        hosts = self.hosts.hosts_of_replica(replica)
        if not all(self._alive(h) for h in hosts):
            return False
        first = self.hosts.host_of(replica * self.y)
        port_key = f"mt/r{replica}/a{attempt}/port"
        if first.name == self.me.name and not self.store.check([port_key]):
            self.store.set(port_key, str(free_port(self.me.address)))
        if not self.store.check([port_key]):
            return False
        port = int(self.store.get(port_key))
        mine = [r for r in self.me.ranks if r // self.y == replica]
        for rank in mine:
            self.mesh.start(rank, _rank_tag(self.hosts.mesh, rank), self._argv(), self._env(rank, attempt, port, first),
                            self.log_dir, append=attempt > 0)  # fmt: skip
        self.store.set(f"mt/host/{self.me.name}/r{replica}/started", str(attempt))
        self.running[replica] = attempt
        _say(f"replica {replica} attempt {attempt}: started {', '.join(_rank_tag(self.hosts.mesh, r) for r in mine)}")
        return True

    def _argv(self) -> list[str]:
        return child_argv(self.command)

    def _env(self, rank: int, attempt: int, port: int, first: HostSpec) -> dict[str, str]:
        from .comm.listen import HOST_ENV

        cpu = self.me.device == "cpu"
        env = child_env(self.hosts.mesh, rank, cpu=cpu, master_port=port, lighthouse=self.lighthouse,
                        base=os.environ, replica_jobs=True, restart=attempt, job_store=self.store_address)  # fmt: skip
        local = len(self.me.ranks)
        env.update(MASTER_ADDR=first.address, LOCAL_RANK=str(self.me.ranks.index(rank)), LOCAL_WORLD_SIZE=str(local))
        env[HOST_ENV] = self.me.address
        if cpu and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(max(1, _cpu_count() // local))
        if self.hosts.stage_layers is not None:
            env[STAGE_LAYERS_ENV] = ",".join(str(n) for n in self.hosts.stage_layers)
        boundaries = self.hosts.local_boundaries(rank // self.y)
        env[LOCAL_BOUNDARIES_ENV] = ",".join(str(b) for b in boundaries)
        return env | self.env

    # --- the loop ---------------------------------------------------------------------------------

    def run(self) -> int:
        with _SignalTrap() as trap:
            try:
                code = self._loop(trap)
                self.mesh.stop()  # this host's processes are gone before the others are told it left
                self._leave(code)
                return code
            except (RuntimeError, OSError) as err:  # the store went away: the coordinator host is lost
                _say(f"lost the mesh's store at {self.store_address} ({err}): the coordinator host is gone")
                return 1
            finally:
                self.stop_beating.set()
                self.mesh.stop()
                self.console.close()

    def _loop(self, trap: _SignalTrap) -> int:
        finished: set[int] = set()  # replicas whose every process here exited 0 in its current attempt
        while True:
            if trap.signum is not None:
                _say(f"got signal {trap.signum}: stopping this host's processes")
                return 128 + trap.signum
            if self.store.check(["mt/stop"]):
                code, _, why = self.store.get("mt/stop").decode().partition(" ")
                _say(f"the mesh stops: {why}")
                return int(code)
            self._reap(finished)
            for replica in self.replicas:
                if replica in finished:
                    continue
                attempt = self._attempt(replica)
                if attempt > self.hosts.max_restarts:
                    why = f"replica {replica} failed {attempt} times (max_restarts={self.hosts.max_restarts})"
                    self.store.set("mt/stop", f"1 {why}")
                    _say(why)
                    return 1
                if self.running[replica] is not None and self.running[replica] != attempt:
                    _say(f"replica {replica} moves to attempt {attempt}: stopping its processes here")
                    self._stop_replica(replica)
                if self.running[replica] is None:
                    self._try_start(replica, attempt)
                else:
                    self._watch_hosts(replica, attempt)
            verdict = self._finished(finished)
            if verdict is not None:
                return verdict
            time.sleep(0.1)

    def _reap(self, finished: set[int]) -> None:
        while not self.mesh.exits.empty():
            child, code = self.mesh.exits.get()
            if child.retired:
                continue
            replica = child.rank // self.y
            attempt = self.running[replica]
            if code == 0:
                child.retired = True
                self.store.add(f"mt/r{replica}/a{attempt}/ok", 1)
                if not self._children(replica):
                    finished.add(replica)
                continue
            self.mesh.show_tail(child)
            if attempt is not None and self.store.add(f"mt/r{replica}/a{attempt}/ok", 0) > 0:
                # a process of this attempt already finished: the replica cannot start again as one unit
                why = f"{child.tag} failed with exit code {code} after other processes of replica {replica} finished"
                self.store.set("mt/stop", f"{code} {why}")
                continue
            _say(f"{child.tag} failed with exit code {code}: replica {replica} restarts; the others go on")
            self._stop_replica(replica)
            if attempt is not None:
                self._bump(replica, attempt)

    def _watch_hosts(self, replica: int, attempt: int) -> None:
        for host in self.hosts.hosts_of_replica(replica):
            if self._lost(host):
                _say(
                    f"host {host.name} is lost (no heartbeat for {self.hosts.heartbeat_timeout_s:g} s): "
                    f"replica {replica} stops here and starts again when it is back"
                )
                self._stop_replica(replica)
                self._bump(replica, attempt)
                return

    def _finished(self, finished: set[int]) -> int | None:
        """The mesh's exit code once it is over, None while it runs (module docstring). Over: every replica
        finished an attempt (0), or every replica left waits for a lost host while some other one finished
        (1, for every host: ``mt/stop``). A host whose own replicas are done stops beating and waits with
        the others, so every launcher exits with the mesh's code."""
        done_key = f"mt/host/{self.me.name}/done"
        if len(finished) == len(self.replicas) and not self.store.check([done_key]):
            self.store.set(done_key, "0")
            self.stop_beating.set()  # done, not lost: the others read the key
            _say("this host's replicas are done; waiting for the others")
        undone = [r for r in range(self.x) if not self._done(r)]
        if not undone:
            _say("every replica is done")
            return 0
        mine_running = [r for r in undone if r in self.replicas and r not in finished and self.running[r] is not None]
        stuck = [r for r in undone if any(self._lost(h) for h in self.hosts.hosts_of_replica(r))]
        if mine_running or len(stuck) < len(undone) or len(undone) == self.x:
            return None  # a lost host that every replica needs may come back: wait
        lost = sorted({h.name for r in stuck for h in self.hosts.hosts_of_replica(r) if self._lost(h)})
        why = f"replica(s) {stuck} wait for lost host(s) {lost} and every other replica is done: giving up"
        self.store.set("mt/stop", f"1 {why}")
        _say(why)
        return 1

    def _leave(self, code: int) -> None:
        """Say this launcher is leaving; the coordinator, whose store the others read, waits for every
        other host with ranks to say so too (or to fall silent) before its store goes."""
        self.store.set(f"mt/host/{self.me.name}/exit", str(code))
        if self.me.name != self.hosts.coordinator:
            return
        deadline = time.monotonic() + self.hosts.heartbeat_timeout_s + 10
        pending = [h for h in self.hosts.hosts if h.ranks and h.name != self.me.name]
        while pending and time.monotonic() < deadline:
            pending = [h for h in pending if not self.store.check([f"mt/host/{h.name}/exit"]) and not self._lost(h)]
            time.sleep(0.1)


def _knock_until_open(gate: str, key: bytes, source: str, timeout_s: float = CONNECT_TIMEOUT_S) -> None:
    """Knock at the coordinator's gate until it answers (hosts may start before the coordinator)."""
    from .comm.gate import GateRefused, knock

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            knock(gate, key, source=source)
            return
        except GateRefused:
            raise
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)
