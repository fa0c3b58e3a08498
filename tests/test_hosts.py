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
        ({"mesh": "3by2"}, "mesh='3by2' is invalid: it must be XxY"),
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
