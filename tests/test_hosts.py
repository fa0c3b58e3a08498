"""The hosts file (``hf_meshtune.hosts``): placement, local boundaries, what the launcher exports per rank.

The launchers themselves, one per network namespace, are ``tests/test_hosts_launch.py`` (slow); the refused
files are rows of ``docs/bad_input.md`` (``tests/bad_input_hosts.py``).
"""

from __future__ import annotations

import json

import pytest

from hf_meshtune.hosts import load_hosts, parse_hosts

THREE = {
    "mesh": "3x2",
    "hosts": [
        {"name": "a", "address": "10.0.0.1", "gpus": {"count": 2, "memory_gib": 80, "speed": 1.0}},
        {"name": "b", "address": "10.0.0.2", "gpus": {"count": 2}, "link": {"up_mbit": 300, "rtt_ms": 40}},
        {"name": "c", "address": "10.0.0.3", "cpu": {"processes": 2, "speed": 0.3}},
    ],
}


def test_default_placement_fills_hosts_in_order_and_pairs_each_replica_on_one_host():
    hosts = parse_hosts(THREE)
    assert hosts.mesh == (3, 2) and hosts.coordinator == "a" and hosts.port == 29400
    assert [h.ranks for h in hosts.hosts] == [(0, 1), (2, 3), (4, 5)]
    assert [hosts.local_boundaries(r) for r in range(3)] == [[0], [0], [0]]
    assert hosts.hosts[2].device == "cpu" and hosts.hosts[2].speed == 0.3
    assert hosts.replicas_of(hosts.host("b")) == [1]
    assert [h.name for h in hosts.hosts_of_replica(2)] == ["c"]


def test_explicit_runs_split_replicas_over_hosts_and_imply_the_mesh():
    data = {
        "coordinator": "b",
        "hosts": [
            {"name": "a", "address": "10.0.0.1", "cpu": {"processes": 2}, "runs": ["r0s0", "r1s0"]},
            {"name": "b", "address": "10.0.0.2", "cpu": {"processes": 2}, "runs": ["r1s1", "r0s1"]},
        ],
    }
    hosts = parse_hosts(data)
    assert hosts.mesh == (2, 2) and hosts.coordinator_host.address == "10.0.0.2"
    assert [h.ranks for h in hosts.hosts] == [(0, 2), (1, 3)]
    assert hosts.local_boundaries(0) == [] and hosts.host_of(3).name == "b"
    assert [h.name for h in hosts.hosts_of_replica(1)] == ["a", "b"]


def test_four_stages_on_two_hosts_mix_local_and_wan_boundaries():
    data = {
        "mesh": "1x4",
        "coordinator": "hub",
        "stage_layers": [10, 10, 6, 4],
        "hosts": [
            {"name": "hub", "address": "10.0.0.9", "cpu": {"processes": 1}, "runs": ["r0s0"]},
            {"name": "gpu", "address": "10.0.0.1", "gpus": {"count": 3}, "runs": ["r0s1", "r0s2", "r0s3"]},
        ],
    }
    hosts = parse_hosts(data)
    assert hosts.local_boundaries(0) == [1, 2]  # stage 0 → 1 crosses the WAN, 1 → 2 → 3 stay on "gpu"
    assert hosts.stage_layers == (10, 10, 6, 4)


def test_load_hosts_reads_yaml_and_json_and_names_the_file_in_errors(tmp_path):
    (tmp_path / "h.json").write_text(json.dumps(THREE))
    assert load_hosts(str(tmp_path / "h.json")).mesh == (3, 2)
    (tmp_path / "h.yaml").write_text("mesh: 3x2\nhosts:\n  - {name: a, address: x, cpu: {processes: 1}}\n")
    with pytest.raises(ValueError, match=r"h\.yaml: mesh='3x2' is invalid: it must fit the hosts' 1"):
        load_hosts(str(tmp_path / "h.yaml"))
    (tmp_path / "bad.yaml").write_text("hosts: [\n")
    with pytest.raises(ValueError, match=r"hosts='.*bad\.yaml' is invalid: it must be YAML"):
        load_hosts(str(tmp_path / "bad.yaml"))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"hosts": []}, "hosts=[] is invalid: it must be a non-empty list"),
        ({"port": 65535}, "port=65535 is invalid: it must be an integer in [1, 65533]"),
        ({"heartbeat_timeout_s": 0}, "heartbeat_timeout_s=0 is invalid"),
        ({"max_restarts": -1}, "max_restarts=-1 is invalid"),
        ({"coordinator": "z"}, "coordinator='z' is invalid: it must name a host of the file (a, b, c)"),
        ({"stage_layers": [1]}, "stage_layers=[1] is invalid: it must be a list of 2 integers >= 1"),
        ({"extra": 1}, "hosts file=['extra'] is invalid: it must use only the keys"),
        ({"mesh": "3by2"}, "mesh='3by2' is invalid: it must look like XxY, e.g. 3x2 (X replicas, Y stages)"),
    ],
)
def test_bad_top_level_fields_name_the_field_value_and_rule(change, message):
    with pytest.raises(ValueError) as info:
        parse_hosts({**THREE, **change})
    assert message in str(info.value)


@pytest.mark.parametrize(
    ("host", "message"),
    [
        ({"name": "a b", "address": "x", "cpu": {"processes": 1}}, "hosts[2].name='a b' is invalid"),
        ({"name": "c", "address": "x", "cpu": {"processes": 1}, "gpus": {"count": 1}}, "give exactly one of"),
        ({"name": "c", "address": "x", "gpus": {"count": 0}}, "hosts[2].gpus.count=0 is invalid"),
        ({"name": "c", "address": "x", "gpus": {"count": 1, "speed": -1}}, "hosts[2].gpus.speed=-1 is invalid"),
        ({"name": "c", "address": "x", "cpu": {"processes": 1, "memory_gib": 8}}, "hosts[2].cpu={"),
        ({"name": "c", "address": "x", "cpu": {"processes": 2}, "link": {"up_mbit": 0}}, "link.up_mbit=0"),
        ({"name": "c", "address": "10.0.0.1", "cpu": {"processes": 2}}, "hosts[2].address='10.0.0.1' is invalid"),
    ],
)
def test_bad_host_entries_name_the_host_and_field(host, message):
    data = {**THREE, "hosts": [*THREE["hosts"][:2], host]}
    with pytest.raises(ValueError) as info:
        parse_hosts(data)
    assert message in str(info.value)


def test_runs_must_place_every_rank_once_and_fit_the_host():
    def two(runs_a, runs_b, slots=2):
        return {
            "mesh": "2x2",
            "hosts": [
                {"name": "a", "address": "1", "cpu": {"processes": slots}, "runs": runs_a},
                {"name": "b", "address": "2", "cpu": {"processes": 2}, "runs": runs_b},
            ],
        }

    with pytest.raises(ValueError, match=r"runs=\['r1s1'\] is invalid: it must place every rank"):
        parse_hosts(two(["r0s0", "r0s1"], ["r1s0"]))
    with pytest.raises(ValueError, match=r"hosts\[0\]\.runs=\['r0s0', 'r0s1'\] is invalid: it must fit the host's 1"):
        parse_hosts(two(["r0s0", "r0s1"], ["r1s0", "r1s1"], slots=1))
    with pytest.raises(ValueError, match=r"hosts\[1\]\.runs='r2s0' is invalid: it must name a rank of the 2x2 mesh"):
        parse_hosts(two(["r0s0", "r0s1"], ["r2s0"]))
    with pytest.raises(ValueError, match=r"runs=\['b'\] is invalid: it must be given on every host or on none"):
        parse_hosts({**two(["r0s0"], ["r1s0"]), "hosts": [two(["r0s0"], [])["hosts"][0], {**THREE["hosts"][1]}]})


def test_the_memory_ledger_admits_a_placement_the_gpus_hold():
    data = {
        "mesh": "2x2",
        "memory": {"model": "smollm2-135m", "seq_len": 256, "microbatches": 2},
        "hosts": [
            {"name": "a", "address": "1", "gpus": {"count": 2, "memory_gib": 24}},
            {"name": "b", "address": "2", "gpus": {"count": 2, "memory_gib": 24}},
        ],
    }
    assert parse_hosts(data).mesh == (2, 2)  # a 135M model's stages fit 24 GiB GPUs
    data["hosts"][1]["gpus"]["memory_gib"] = 0.1
    with pytest.raises(ValueError, match=r"hosts\.b\.gpus\.memory_gib=0\.1 is invalid: it must hold r1s0"):
        parse_hosts(data)


@pytest.mark.parametrize("flag", [["--mesh", "2x2"], ["--cpu"], ["--master-port", "1234"], ["--host", "10.0.0.1"]])
def test_launch_flags_the_hosts_file_owns_are_refused_with_hosts(tmp_path, capsys, flag):
    from hf_meshtune.cli import main

    (tmp_path / "h.json").write_text(json.dumps(THREE))
    (tmp_path / "t.py").write_text("")
    code = main(
        ["launch", "--hosts", str(tmp_path / "h.json"), "--this-host", "a", *flag, "--", str(tmp_path / "t.py")]
    )
    assert code == 2
    assert "is invalid: it must be unset with --hosts: the hosts file says it for every host" in capsys.readouterr().err


def test_this_host_needs_hosts_and_hosts_needs_this_host(tmp_path, capsys):
    from hf_meshtune.cli import main

    assert main(["launch", "--this-host", "a", "--", "t.py"]) == 2
    assert "--hosts=None is invalid: it must be given with --this-host" in capsys.readouterr().err
    assert main(["launch", "--hosts", "h.yaml", "--", "t.py"]) == 2
    assert "--this-host=None is invalid: it must be given with --hosts" in capsys.readouterr().err


def test_the_hosts_files_split_reaches_the_knobs_and_a_different_one_is_refused(monkeypatch):
    from hf_meshtune import MeshConfig

    monkeypatch.setenv("MESHTUNE_STAGE_LAYERS", "3,1")  # what the launcher exports from `stage_layers:`
    assert MeshConfig(num_stages=2).stage_layers == [3, 1]
    assert MeshConfig(num_stages=2, stage_layers=[3, 1]).stage_layers == [3, 1]
    with pytest.raises(ValueError, match=r"stage_layers=\[2, 2\] is invalid: it must equal the launcher's "):
        MeshConfig(num_stages=2, stage_layers=[2, 2])
    monkeypatch.setenv("MESHTUNE_STAGE_LAYERS", "3;1")
    with pytest.raises(ValueError, match="MESHTUNE_STAGE_LAYERS='3;1' is invalid"):
        MeshConfig(num_stages=2)


# --- two launchers on loopback addresses (127.0.0.1 and 127.0.0.2: no namespaces, no torch world) ---------------
_SCRIPT = """
import json, os, sys, time
out, rank, attempt = sys.argv[1], int(os.environ["RANK"]), int(os.environ["MESHTUNE_RESTART"])
keys = ("MASTER_ADDR", "MASTER_PORT", "MESHTUNE_HOST", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MESHTUNE_REPLICA",
        "MESHTUNE_LOCAL_BOUNDARIES", "MESHTUNE_STAGE_LAYERS", "MESHTUNE_JOB_STORE", "TORCHFT_LIGHTHOUSE")
with open(os.path.join(out, f"env-s{rank}-a{attempt}.json"), "w") as fh:
    json.dump({k: os.environ.get(k) for k in keys}, fh)
mode = os.environ["TEST_MODE"]
if mode == "restart" and attempt == 0:
    if rank == 1:
        sys.exit(1)  # stage 1 fails at once: the replica starts again on both hosts
    time.sleep(60)  # stage 0 would wait for it: its launcher stops it
if mode == "late" and rank == 0:
    time.sleep(3)
    sys.exit(3)  # stage 1 has finished already: the replica cannot start again
"""


def _two_launchers(tmp_path, mode: str) -> tuple[list[int], str]:
    import subprocess
    import sys

    from tests.distributed import free_port

    port = free_port()
    (tmp_path / "hosts.yaml").write_text(
        f"mesh: 1x2\nport: {port}\nheartbeat_timeout_s: 5\nmax_restarts: 1\nstage_layers: [3, 1]\nhosts:\n"
        "  - {name: a, address: 127.0.0.1, cpu: {processes: 1}}\n"
        "  - {name: b, address: 127.0.0.2, cpu: {processes: 1}}\n"
    )
    (tmp_path / "job.py").write_text(_SCRIPT)
    env = {**__import__("os").environ, "TEST_MODE": mode}
    env.pop("MESHTUNE_SECRET", None)
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "hf_meshtune.cli",
                "launch",
                "--hosts",
                str(tmp_path / "hosts.yaml"),
                "--this-host",
                name,
                "--log-dir",
                str(tmp_path / f"logs-{name}"),
                "--",
                str(tmp_path / "job.py"),
                str(tmp_path),
            ],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for name in "ab"
    ]
    outputs = [p.communicate(timeout=120)[0] for p in procs]
    return [p.returncode for p in procs], "\n".join(outputs)


@pytest.mark.slow  # two launchers and their processes
def test_each_hosts_processes_get_their_place_and_a_failed_replica_restarts_on_both_hosts(tmp_path):
    codes, output = _two_launchers(tmp_path, "restart")
    assert codes == [0, 0], output
    first = [json.loads((tmp_path / f"env-s{s}-a0.json").read_text()) for s in (0, 1)]
    second = [json.loads((tmp_path / f"env-s{s}-a1.json").read_text()) for s in (0, 1)]
    for env, host in zip(first, ("127.0.0.1", "127.0.0.2")):
        assert env["MESHTUNE_HOST"] == host and env["MASTER_ADDR"] == "127.0.0.1"  # stage 0's host serves it
        assert env["LOCAL_RANK"] == "0" and env["LOCAL_WORLD_SIZE"] == "1" and env["MESHTUNE_REPLICA"] == "0"
        assert env["MESHTUNE_LOCAL_BOUNDARIES"] == "" and env["MESHTUNE_STAGE_LAYERS"] == "3,1"
        assert env["MESHTUNE_JOB_STORE"].startswith("127.0.0.1:") and env["TORCHFT_LIGHTHOUSE"].startswith("http://")
    assert first[0]["MASTER_PORT"] == first[1]["MASTER_PORT"] != second[0]["MASTER_PORT"] == second[1]["MASTER_PORT"]
    assert "replica 0 moves to attempt 1" in output and "replica 0 attempt 1: started r0s0" in output


@pytest.mark.slow  # two launchers and their processes
def test_a_replica_that_fails_after_a_process_finished_stops_the_mesh_on_every_host(tmp_path):
    codes, output = _two_launchers(tmp_path, "late")
    assert codes == [3, 3], output
    assert "after other processes of replica 0 finished" in output


@pytest.mark.slow  # a launcher process
def test_a_launcher_whose_coordinator_goes_away_says_so_and_exits_1(tmp_path):
    import subprocess
    import sys
    import time

    import torch.distributed as dist

    from tests.distributed import free_port

    port = free_port()
    store = dist.TCPStore("127.0.0.1", port + 1, is_master=True, wait_for_workers=False)  # coordinator a's store
    (tmp_path / "hosts.yaml").write_text(
        f"mesh: 1x2\nport: {port}\nheartbeat_timeout_s: 5\nhosts:\n"
        "  - {name: a, address: 127.0.0.1, cpu: {processes: 1}}\n"
        "  - {name: b, address: 127.0.0.2, cpu: {processes: 1}}\n"
    )
    (tmp_path / "job.py").write_text("")
    env = {k: v for k, v in __import__("os").environ.items() if k != "MESHTUNE_SECRET"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "hf_meshtune.cli", "launch", "--hosts", str(tmp_path / "hosts.yaml"),
         "--this-host", "b", "--", str(tmp_path / "job.py")],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    deadline = time.monotonic() + 60
    while store.add("mt/host/b/beat", 0) == 0:  # b is up and beating, waiting for a
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    del store  # the coordinator host is gone
    output = proc.communicate(timeout=60)[0]
    assert proc.returncode == 1, output
    assert f"lost the mesh's store at 127.0.0.1:{port + 1}" in output and "the coordinator host is gone" in output
