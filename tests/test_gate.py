"""Only processes holding the mesh's secret get in (``hf_meshtune.comm.gate``).

The gate's handshake against a wrong secret, a silent peer, a peer that breaks off and an impostor
gate; the kernel filter against real connections from other loopback addresses (127.0.0.0/8 is all
this machine's, so 127.0.0.3 is a stranger without root or namespaces); the guard on a real TCPStore,
a torchft lighthouse and a listener created after it; and a real 3×2 mesh with the anchor and
restarts launched with a secret, whose every listening socket is probed from a stranger's address
while it runs and a process is killed and restarted.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import threading
import time
import urllib.request
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from hf_meshtune.comm import gate as gate_module
from hf_meshtune.comm import guard as guard_module
from hf_meshtune.comm.gate import Gate, GateRefused, guard_launched_process, knock, secret_key
from hf_meshtune.comm.guard import Guard, attach_filter, filter_program
from hf_meshtune.comm.listen import bound_store
from hf_meshtune.dp.ft import start_lighthouse
from tests.distributed import mesh_launch
from tests.test_anchor_restart import _step
from tests.test_listen import _process_tree, listening

REPO = Path(__file__).resolve().parents[1]
SECRET = "correct horse battery staple"
KEY = secret_key({"MESHTUNE_SECRET": SECRET})
WRONG = secret_key({"MESHTUNE_SECRET": "a different secret of enough length"})
STRANGER = "127.0.0.3"  # never admitted in these tests


def _reaches(port: int, source: str, host: str = "127.0.0.1", timeout: float = 1.0) -> bool:
    """Whether a TCP connection from ``source`` to host:port opens within ``timeout``."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.bind((source, 0))
        try:
            sock.connect((host, port))
            return True
        except OSError:  # timed out: the filter dropped the SYN
            return False


@pytest.fixture
def gate():
    g = Gate(KEY, "127.0.0.1")
    yield g
    g.close()


def test_the_key_is_derived_from_the_secret_or_its_file(tmp_path):
    path = tmp_path / "secret"
    path.write_text(SECRET + "\n")  # a trailing newline (echo > file) is not part of the secret
    assert secret_key({"MESHTUNE_SECRET_FILE": str(path)}) == KEY
    assert secret_key({}) is None
    assert KEY != WRONG and len(KEY) == 32
    assert SECRET.encode() not in KEY


def test_a_process_with_the_secret_is_admitted_and_gets_the_signed_list(gate):
    assert knock(gate.address, KEY) == ["127.0.0.1"]
    assert gate.admitted() == ["127.0.0.1"]
    assert gate.refusals == []


def test_a_wrong_secret_is_refused_and_the_reason_logged(gate, capfd):
    with pytest.raises(GateRefused, match="refused this process: its MESHTUNE_SECRET .* is not the mesh's secret"):
        knock(gate.address, WRONG)
    assert gate.admitted() == []
    err = capfd.readouterr().err
    assert re.search(r"meshtune gate: refused 127\.0\.0\.1:\d+: its token does not match this mesh's secret", err)


def test_a_silent_or_broken_peer_is_refused_without_blocking_others(gate, monkeypatch, capfd):
    monkeypatch.setattr(gate_module, "HELLO_TIMEOUT_S", 0.5)
    silent = socket.create_connection(("127.0.0.1", int(gate.address.rsplit(":", 1)[1])))
    broken = socket.create_connection(("127.0.0.1", int(gate.address.rsplit(":", 1)[1])))
    broken.sendall(b"x" * 10)
    broken.close()
    assert knock(gate.address, KEY) == ["127.0.0.1"]  # served while the silent one still holds its slot
    time.sleep(1.0)
    silent.close()
    reasons = [reason for _, reason in gate.refusals]
    assert any("sent no token within 0.5 s" in r for r in reasons), reasons
    assert any("broke off the handshake" in r for r in reasons), reasons
    assert "refused" in capfd.readouterr().err


def test_an_impostor_gate_is_not_trusted():
    impostor = Gate(WRONG, "127.0.0.1")
    try:
        with pytest.raises(GateRefused, match="refused this process"):
            knock(impostor.address, KEY)  # it cannot check our token...
        with socket.socket() as plain:  # ...and a server that is no gate at all is named as such
            plain.bind(("127.0.0.1", 0))
            plain.listen()
            port = plain.getsockname()[1]

            def greet():
                conn, _ = plain.accept()
                conn.sendall(b"HTTP/1.1 200 OK\r\n" + b"x" * 40)
                conn.close()

            threading.Thread(target=greet, daemon=True).start()
            with pytest.raises(GateRefused, match="is not a meshtune gate"):
                knock(f"127.0.0.1:{port}", KEY)
    finally:
        impostor.close()


def test_an_unsigned_admission_list_is_rejected(gate, monkeypatch):
    """A gate that answers OK without the secret (a man in the middle) is caught by the list's signature."""
    real_mac = gate_module._mac

    def forged(key, *parts):  # the gate's side signs with another key; the client checks with the right one
        in_gate = threading.current_thread().name == "meshtune-gate-peer"
        return real_mac(WRONG if in_gate and parts[0] == b"gate" else key, *parts)

    monkeypatch.setattr(gate_module, "_mac", forged)
    with pytest.raises(GateRefused, match="does not hold this mesh's secret"):
        knock(gate.address, KEY)


@pytest.mark.parametrize("addresses", [["127.0.0.2"], ["127.0.0.2", "::1", "127.0.0.9"]])
def test_the_filter_keeps_admitted_sources_only(addresses):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        attach_filter(server, addresses)
        port = server.getsockname()[1]
        assert _reaches(port, "127.0.0.2")
        assert not _reaches(port, STRANGER)
        assert not _reaches(port, "127.0.0.1")


def test_the_filter_reads_ipv6_sources():
    try:
        server = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
        server.bind(("::1", 0))
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with server:
        server.listen()
        port = server.getsockname()[1]
        attach_filter(server, ["::1"])
        assert _reaches(port, "::1", host="::1")
        attach_filter(server, ["::2", "127.0.0.1"])  # a new filter replaces the old
        assert not _reaches(port, "::1", host="::1")
    program = filter_program(["::1", "10.0.0.1"])
    assert len(program) == 4 + 4 + 2 + 9 + 1  # head, v4 (load, 1 compare, drop), v6 (check, drop, 1 address, drop)


def test_the_guard_closes_a_store_and_a_lighthouse_to_strangers(gate):
    store = bound_store("127.0.0.1")
    lighthouse, address = start_lighthouse(host="127.0.0.1")
    lighthouse_port = int(address.rsplit(":", 1)[1])
    ports = {store.port, lighthouse_port}  # this test process's other listeners are none of its business
    guard = Guard(gate.admitted, exempt={gate.inode}, ports=ports)
    try:
        assert not _reaches(store.port, "127.0.0.1")  # nobody admitted yet: closed to all
        knock(gate.address, KEY)
        guard.scan()
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        client.set("k", "v")
        assert client.get("k") == b"v"
        with urllib.request.urlopen(f"{address}/status", timeout=10) as reply:
            assert reply.status == 200
        for port in (store.port, lighthouse_port):
            assert not _reaches(port, STRANGER)
        assert _reaches(int(gate.address.rsplit(":", 1)[1]), STRANGER)  # the gate itself stays open
        with socket.socket() as late:  # a listener opened after the guard started is guarded at its next scan
            late.bind(("127.0.0.1", 0))
            late.listen()
            ports.add(late.getsockname()[1])
            time.sleep(3 * guard_module.SCAN_PERIOD_S)
            assert not _reaches(late.getsockname()[1], STRANGER)
            assert _reaches(late.getsockname()[1], "127.0.0.1")
    finally:
        guard.stop()
        lighthouse.shutdown()


def test_a_port_limited_guard_leaves_other_listeners_alone(gate):
    with socket.socket() as mine, socket.socket() as other:
        for sock in (mine, other):
            sock.bind(("127.0.0.1", 0))
            sock.listen()
        guard = Guard(gate.admitted, ports={mine.getsockname()[1]})
        guard.stop()
        assert not _reaches(mine.getsockname()[1], STRANGER)
        assert _reaches(other.getsockname()[1], STRANGER)


def test_a_launched_process_knocks_first_and_a_wrong_secret_stops_it(gate, monkeypatch):
    monkeypatch.setattr(gate_module, "_GUARD", [])
    monkeypatch.setattr(guard_module, "_listening_sockets", lambda: iter(()))  # leave pytest's own listeners be
    monkeypatch.setenv("MESHTUNE_GATE", gate.address)
    monkeypatch.setenv("MESHTUNE_SECRET", "a different secret of enough length")
    with pytest.raises(GateRefused, match="refused this process"):
        guard_launched_process()
    monkeypatch.setenv("MESHTUNE_SECRET", SECRET)
    guard = guard_launched_process()
    try:
        assert gate.admitted() == ["127.0.0.1"]
        assert guard_launched_process() is guard  # a second call rescans the same guard
    finally:
        guard.stop()


def test_a_process_with_a_dp_host_knocks_from_it_too(gate, monkeypatch):
    """Its DiLoCo pairs connect from $MESHTUNE_DP_HOST: the guards of the other processes must admit it."""
    monkeypatch.setattr(gate_module, "_GUARD", [])
    monkeypatch.setattr(guard_module, "_listening_sockets", lambda: iter(()))  # leave pytest's own listeners be
    monkeypatch.setenv("MESHTUNE_GATE", gate.address)
    monkeypatch.setenv("MESHTUNE_SECRET", SECRET)
    monkeypatch.setenv("MESHTUNE_DP_HOST", "127.0.0.4")
    guard = guard_launched_process()
    try:
        assert sorted(gate.admitted()) == ["127.0.0.1", "127.0.0.4"]
    finally:
        guard.stop()


@pytest.mark.slow
def test_a_mesh_launched_with_a_secret_keeps_strangers_out_through_a_restart(tmp_path):
    """3×2, the anchor on, one job per replica: every listening socket of every process (stores,
    lighthouse, torchft's servers, gloo's pairs, the anchor's pair links) is probed from a stranger's
    address while the mesh runs and the anchor's stage 1 is killed and restarted; none lets it in, a
    stranger knocking with a wrong secret is refused and logged, and the mesh ends on one θ_global."""
    out = tmp_path / "run"
    command = [*mesh_launch("3x2", "--max-restarts", "1"), "tests/scripts/mesh_run.py", str(out), "40"]
    command.append('{"anchor": true, "anchor_every": 4}')
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO),
        "MESHTUNE_SECRET": SECRET,
        "RESTART_AFTER_STEP": "16",
        "HOLD_FOR_RESTART_AT": "22",
        "STEP_SECONDS": "0.15",
    }
    launcher = subprocess.Popen(command, cwd=REPO, env=env, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(launcher.stdout), daemon=True)
    reader.start()
    first_seen: dict[tuple[int, str, int], float] = {}
    let_in: list[tuple[int, str, int]] = []
    probed: set[tuple[int, str, int]] = set()
    killed = knocked = False
    deadline = time.monotonic() + 300
    try:
        while launcher.poll() is None and time.monotonic() < deadline:
            gate_port = next(
                (int(m.group(1)) for m in map(re.compile(r"gate 127\.0\.0\.1:(\d+)").search, lines) if m), None
            )
            now = time.monotonic()
            for sock in listening(_process_tree(launcher.pid)):
                first_seen.setdefault(sock, now)
                # a listener torch or torchft just opened is guarded at the guard's next scan: probe after it
                if sock not in probed and now - first_seen[sock] > 1.0 and sock[2] != gate_port:
                    probed.add(sock)
                    host = "127.0.0.1" if sock[1] in ("0.0.0.0", "::") else sock[1]  # a wildcard: its IPv4 side
                    if _reaches(sock[2], STRANGER, host=host, timeout=0.5):
                        let_in.append(sock)
            if gate_port is not None and not knocked and len(probed) >= 8:
                with pytest.raises(GateRefused):
                    knock(f"127.0.0.1:{gate_port}", WRONG)
                knocked = True
            pid_file = out / "progress" / "pid5.g0"
            if not killed and _step(out, 2) >= 8 and pid_file.exists():
                os.kill(int(pid_file.read_text()), signal.SIGKILL)  # the anchor's stage 1
                killed = True
            time.sleep(0.2)
        launcher.wait(timeout=max(1, deadline - time.monotonic()))
    finally:
        if launcher.poll() is None:
            launcher.kill()
    reader.join(timeout=10)
    output = "".join(lines)
    assert launcher.returncode == 0, output[-5000:]
    assert killed and knocked
    assert len(probed) >= 12, probed  # the mesh's servers and gloo pairs were probed at all
    assert let_in == [], let_in
    assert re.search(r"meshtune gate: refused 127\.0\.0\.1:\d+: its token does not match", output), output[-3000:]
    assert "restarting replica 2" in output
    results = [torch.load(out / f"result{r}.pt", weights_only=False) for r in range(6)]
    for stage in (0, 1):
        for replica in (1, 2):
            for mine, theirs in zip(
                results[stage].global_params, results[replica * 2 + stage].global_params, strict=True
            ):
                assert torch.equal(mine, theirs), (stage, replica)
