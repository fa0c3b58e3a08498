"""The WAN benchmark's emulated network (benchmarks/wan/netns.py) and one real row through it.

Needs root and ``ip``/``tc`` (CI runs as root); the namespaces use a prefix of this process's own, so a
benchmark or another test run on the same machine is left alone.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from benchmarks.wan import netns

_UNAVAILABLE = netns.unavailable()
pytestmark = [pytest.mark.slow, pytest.mark.skipif(_UNAVAILABLE is not None, reason=_UNAVAILABLE or "")]

# this process's own star: two suites at once (or a benchmark) each get theirs
PREFIX = f"mtwt{os.getpid()}"

_SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 5009)); s.listen(1)
c, _ = s.accept(); c.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
while True:
    b = c.recv(1 << 16)
    if not b: break
    if b.endswith(b"p"): c.sendall(b"p")
"""
_CLIENT = """
import json, socket, sys, time
for _ in range(50):
    try: s = socket.create_connection((sys.argv[1], 5009)); break
    except OSError: time.sleep(0.1)
s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
rtts = []
for _ in range(7):
    t = time.perf_counter(); s.sendall(b"p"); s.recv(1); rtts.append(time.perf_counter() - t)
n = int(sys.argv[2]); t = time.perf_counter(); s.sendall(b"x" * n); s.sendall(b"p"); s.recv(1)
print(json.dumps({"rtt_ms": sorted(rtts)[3] * 1000, "mbit": n * 8 / (time.perf_counter() - t) / 1e6}))
"""


@pytest.fixture
def star(monkeypatch):
    monkeypatch.setenv(netns.PREFIX_ENV, PREFIX)
    monkeypatch.chdir(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    yield netns
    netns.down()
    assert netns.namespaces() == []


def _measure(server_node: int, client_node: int, nbytes: int) -> dict:
    server = subprocess.Popen(
        [*netns.exec_prefix(server_node), sys.executable, "-c", _SERVER, netns.node_ip(server_node)]
    )
    try:
        out = subprocess.run(
            [*netns.exec_prefix(client_node), sys.executable, "-c", _CLIENT, netns.node_ip(server_node), str(nbytes)],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)
    finally:
        server.kill()
        server.wait()


def test_links_get_the_set_rate_and_the_delay_bridge_adds_its_delay_each_way(star):
    links = star.up(3, rate_mbit=16.0, delay_ms=30.0)
    assert links.bridge_pid is not None
    assert sorted(star.namespaces()) == [f"{PREFIX}-{name}" for name in ("hub", "n0", "n1", "n2")]
    seen = _measure(0, 2, 2_000_000)
    # 2 × 30 ms through the bridge: never less; the user-space bridge adds its forwarding time, a few ms
    # idle and tens of ms on a loaded machine, so the upper bound is loose
    assert 58 <= seen["rtt_ms"] <= 110, seen
    assert 8.0 <= seen["mbit"] <= 16.5, seen  # tbf caps at 16 Mbit/s; TCP gets most of it (half at worst)
    before = star.tx_bytes(2)
    _measure(0, 2, 500_000)
    assert star.tx_bytes(2) - before >= 500_000  # the kernel counter sees what the node sent


def test_up_is_idempotent_and_the_kernel_bridge_serves_zero_delay(star):
    star.up(2, rate_mbit=8.0, delay_ms=30.0)
    links = star.up(2, rate_mbit=40.0, delay_ms=0.0)  # rebuilt, not stacked on the first
    assert links.bridge_pid is None and star.read_state() == links
    seen = _measure(1, 0, 4_000_000)
    assert seen["rtt_ms"] < 20 and 20.0 <= seen["mbit"] <= 41.0, seen  # the cap of 40, no 30 ms delay
    star.down()
    star.down()  # idempotent
    assert star.namespaces() == [] and star.read_state() is None


def test_bad_settings_and_a_non_root_user_are_refused_naming_the_rule(star, monkeypatch):
    with pytest.raises(ValueError, match=r"nodes=1 is invalid: it must be an integer in \[2, 200\]"):
        star.up(1, rate_mbit=8.0)
    with pytest.raises(ValueError, match=r"rate_mbit=0 is invalid: it must be > 0"):
        star.up(2, rate_mbit=0)
    with pytest.raises(ValueError, match=r"delay_ms=-1 is invalid"):
        star.up(2, rate_mbit=1.0, delay_ms=-1)
    with pytest.raises(
        ValueError, match=r"rate_mbit=-4 is invalid: it must be > 0 \(Mbit/s of the link, each direction\)"
    ):
        star.set_rate(0, -4)
    with (
        monkeypatch.context() as patch,
        pytest.raises(ValueError, match=r"it must be root: network namespaces and tc need CAP_NET_ADMIN"),
    ):
        patch.setattr(os, "geteuid", lambda: 1000)
        star.up(2, rate_mbit=8.0)


def test_a_mesh_row_trains_across_namespaces_and_the_wire_matches_the_kernel_counters(star, tmp_path):
    """Rank k in node k's namespace: gloo on eth0, torchft's stores and lighthouse on MESHTUNE_HOST."""
    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import ROWS, Shape, prepare_data, scratch_model
    from benchmarks.wan.run import read_run
    from hf_meshtune.boundary.compose.grammar import parse_codec

    star.up(6, rate_mbit=200.0, delay_ms=0.0)
    data = prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    start = time.perf_counter()
    run_row("default", str(tmp_path / "default"), str(tmp_path / "data.pt"), 4, save_every=2, timeout_s=240)
    result = read_run(str(tmp_path / "default"), "default")
    assert result["steps"] == 4 and time.perf_counter() - start < 240
    b = result["bytes_per_token"]
    codec = parse_codec(ROWS["default"].boundary_codec)
    # the composed codec's record (fp32 outliers, a bf16 scale, int8 codes) per real token across the one boundary,
    # plus a 24-byte header per microbatch message; its one-off calibration pass (a dense forward and the fitted
    # geometry) counted apart
    record = codec.message_bytes(data["config"]["hidden_size"], 4)
    headers = 24 * 3 * Shape().microbatches * 4 / (result["tokens_per_step"] * 4)  # 3 replicas, 4 steps
    assert b["pp_fwd"] == pytest.approx(record + headers, rel=1e-9)
    assert result["calibration_bytes"] > 0
    assert b["anchor"] == 0
    # per process: what eth0 sent, less 66 header bytes per packet counted, is the Wire's bytes (measured sends,
    # the calibration among them, and booked all-reduces) plus what no Wire sees (gloo's framing, torchft's
    # quorum and heartbeats), never less and within 10 %
    checks = result["kernel_per_process"]
    assert [c["rank"] for c in checks] == list(range(6))
    for c in checks:
        assert c["headers"] == 66 * c["tx_packets"] and c["payload"] == c["tx_bytes"] - c["headers"]
        assert 1.0 <= c["payload_over_wire"] <= 1.10, c
    assert sorted(os.listdir(tmp_path / "default" / "params")) == [
        f"step0000{s}_stage{t}.pt" for s in (2, 4) for t in (0, 1)
    ]


def test_a_variable_size_coded_wire_matches_the_kernel_counters(star, tmp_path):
    """The rotated int4 codec with zstd on rows of different lengths (the WAN task's SFT rows, right-padded): each
    boundary message is a header and the coded records of the carried positions, so the pipeline's bytes per real
    token fall below the codec's record, and the interfaces' counters (less frame headers) are within 5 % of what
    the Wires booked, the coded messages among it."""
    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import ROWS, Shape, prepare_data, scratch_model
    from benchmarks.wan.run import read_run
    from hf_meshtune.boundary.compose.grammar import parse_codec

    star.up(6, rate_mbit=200.0, delay_ms=0.0)
    data = prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    run_row("coded", str(tmp_path / "coded"), str(tmp_path / "data.pt"), 12, timeout_s=300)
    result = read_run(str(tmp_path / "coded"), "coded")
    hidden = data["config"]["hidden_size"]
    spec = parse_codec(ROWS["coded"].boundary_codec)
    assert result["steps"] == 12 and result["tokens_per_step"] < 3 * Shape().tokens_per_replica_step
    assert result["bytes_per_token"]["pp_fwd"] < spec.message_bytes(hidden, 4)  # coded below the record
    ranks = [json.load(open(tmp_path / "coded" / f"rank{r}.json")) for r in range(6)]
    stage0 = [r for r in ranks if r["stage"] == 0]
    assert all(r["wire"]["coded"]["pp_fwd"] < r["wire"]["uncoded"]["pp_fwd"] for r in stage0)
    # what the interfaces sent (frame headers off) against what the Wires booked: within 5 % over the mesh, and
    # per process within 10 % (torchft's quorums and heartbeats, gloo's framing and, on rank 0, the lighthouse
    # and the store are traffic no Wire sees: a fixed few KB a process that a short run does not amortise)
    checks = result["kernel_per_process"]
    total = sum(c["payload"] for c in checks) / sum(c["wire"] for c in checks)
    assert 1.0 <= total <= 1.05, total
    for check in checks:
        assert 1.0 <= check["payload_over_wire"] <= 1.10, check


def test_a_low_priority_sync_sends_the_dp_bytes_and_nothing_else_from_the_low_priority_class(star, tmp_path):
    """With dp_low_priority each process's DiLoCo pairs bind its node's second address (MESHTUNE_DP_HOST), and
    the links' filter puts what goes to those addresses in the class served last: per process, that class's
    payload is the Wire's DP bytes (gloo's framing over them, ≤ 10 %), the other class's is the rest."""
    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import ROWS, Shape, prepare_data, scratch_model
    from benchmarks.wan.run import read_run

    assert ROWS["default_low"].dp_low_priority and ROWS["default_low"].dp_mode == "streaming_diloco"
    star.up(6, rate_mbit=200.0, delay_ms=0.0)
    prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    steps = Shape().sync_every // Shape().fragments  # the first fragment's sync ends the run
    run_row("default_low", str(tmp_path / "run"), str(tmp_path / "data.pt"), steps, timeout_s=300)
    result = read_run(str(tmp_path / "run"), "default_low")
    assert result["steps"] == steps and result["bytes_per_token"]["dp"] > 0
    for c in result["kernel_per_process"]:
        assert 1.0 <= c["low_over_dp"] <= 1.10, c
        rest = c["payload"] - c["low_priority_payload"]
        assert 1.0 <= rest / (c["wire"] - c["dp_wire"]) <= 1.10, c
    # the hub's ports, the nodes' downlinks, classify the same packets on their way in
    hub = sum(star.low_priority_sent(star.hub_ns(), f"p{i}")["bytes"] for i in range(6))
    sent = sum(star.low_priority_sent(star.node_ns(i))["bytes"] for i in range(6))
    assert hub == pytest.approx(sent, rel=0.02)


def test_netns_refuses_a_row_larger_than_the_network(star, tmp_path):
    from benchmarks.wan.mesh import run_row

    star.up(2, rate_mbit=10.0)
    with pytest.raises(RuntimeError, match="row m95_ap needs 8 nodes but the emulated network has 2"):
        run_row("m95_ap", str(tmp_path), str(tmp_path / "data.pt"), 2)


def test_a_cut_link_fails_the_mesh_within_the_timeout_naming_the_unreachable_peer(star, tmp_path):
    """Node 3 (replica 1, stage 1) loses its link for longer than the pipeline timeout: its neighbour
    fails the step with a message that names it (and it names its neighbour), well before any
    default 30-minute timeout; bringing the link back does not matter any more."""
    import threading

    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import Shape, prepare_data, scratch_model

    star.up(6, rate_mbit=200.0, delay_ms=0.0)
    prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    out = tmp_path / "dp"
    outcome: dict = {}

    def run() -> None:
        try:
            run_row("dp", str(out), str(tmp_path / "data.pt"), 500, save_every=2, timeout_s=240, link_timeout_s=8.0)
        except RuntimeError as err:
            outcome["error"] = str(err)
        outcome["end"] = time.monotonic()

    thread = threading.Thread(target=run)
    thread.start()
    deadline = time.monotonic() + 120
    while not (out / "params" / "step00004_stage1.pt").exists():  # the mesh is training
        assert time.monotonic() < deadline and thread.is_alive(), outcome
        time.sleep(0.2)
    star.set_link(3, up=False)
    cut = time.monotonic()
    thread.join(timeout=60)  # the link stays cut until the mesh has failed (or a minute: a hang)
    star.set_link(3, up=True)
    thread.join(timeout=120)
    assert not thread.is_alive() and "exited with code 1" in outcome["error"], outcome
    assert outcome["end"] - cut < 60  # the 8 s timeout, then the launcher's stop: no hang (default: 30 min)
    logs = {rank: (out / f"rank{rank}.log").read_text() for rank in range(6)}
    neighbour = "lost its pipeline link"
    assert neighbour in logs[2] and "rank 3 (replica 1, stage 1) at 10.77.0.13" in logs[2], logs[2][-2000:]
    assert "(timeout 8.0 s: TrainingArguments.ddp_timeout, RunSettings.link_timeout_s)" in logs[2]


def test_a_straggler_link_at_a_tenth_of_the_rate_slows_the_mesh_but_it_completes(star, tmp_path):
    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import Shape, prepare_data, scratch_model
    from benchmarks.wan.run import read_run

    star.up(6, rate_mbit=40.0, delay_ms=0.0)
    star.set_rate(5, 4.0)  # replica 2's last stage behind a link 10x slower than the others
    prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    run_row("codec20", str(tmp_path / "codec20"), str(tmp_path / "data.pt"), 6, timeout_s=240, link_timeout_s=60.0)
    result = read_run(str(tmp_path / "codec20"), "codec20")
    assert result["steps"] == 6 and len(result["losses"]) == 6
    shaped = subprocess.run(
        [*star.exec_prefix(5), "tc", "qdisc", "show", "dev", "eth0"], capture_output=True, text=True, check=True
    ).stdout
    assert "rate 4Mbit" in shaped, shaped


def test_the_dense_row_all_reduces_every_gradient_every_step_across_namespaces(star, tmp_path):
    """dp_mode='allreduce' on the mesh: one ring all-reduce of each stage's gradients per step."""
    import torch

    from benchmarks.wan.mesh import run_row
    from benchmarks.wan.rows import Shape, prepare_data, scratch_model
    from benchmarks.wan.run import read_run

    star.up(6, rate_mbit=200.0, delay_ms=0.0)
    data = prepare_data(Shape(), str(tmp_path / "data.pt"), load=scratch_model)
    run_row("dense", str(tmp_path / "dense"), str(tmp_path / "data.pt"), 3, timeout_s=240)
    result = read_run(str(tmp_path / "dense"), "dense")
    params = sum(t.numel() for name, t in data["init"].items() if "rotary" not in name)
    replicas, tokens = 3, result["tokens_per_step"]
    assert result["bytes_per_token"]["dp"] == pytest.approx(
        replicas * params * 4 * 2 * (replicas - 1) / replicas / tokens, rel=1e-9
    )
    # the DP bytes are booked (tensor bytes × a ring's 2(n-1)/n), not seen; here they are 89 % of the
    # traffic, so the nodes' kernel counters check the factor: never less than booked, and only TCP/IP
    # headers and the control traffic on top (the committed WAN runs: 0.3-1.2 %)
    total = result["bytes_per_token"]["total"]
    assert total <= result["kernel_bytes_per_token"] <= 1.05 * total, (result["kernel_bytes_per_token"], total)
    records = [json.loads((tmp_path / "dense" / f"rank{r}.json").read_text()) for r in range(6)]
    assert all(r["dp_syncs"] == 3 and len(r["dp_sync_bytes"]) == 3 for r in records)
    assert torch.isfinite(torch.tensor(result["losses"])).all()
