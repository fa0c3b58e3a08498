"""``meshtune launch`` and the accelerate configs: real processes, tiny scripts, no models.

The children are small Python scripts written to ``tmp_path``; they report their environment and
PIDs through files, so the tests can check what every rank saw and that nothing outlives the launcher.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
import urllib.parse
from pathlib import Path

import pytest

from hf_meshtune import cli
from hf_meshtune.dp.ft import start_lighthouse
from hf_meshtune.launch import child_env, free_port, launch_mesh

REPO = Path(__file__).resolve().parents[1]

# Writes its env, argv and a verdict on the lighthouse to OUT/rank{RANK}.json. The socket connect
# fails (and the rank exits 1) when nothing listens at TORCHFT_LIGHTHOUSE.
_REPORT_SCRIPT = """
import json, os, socket, sys, urllib.parse
out = sys.argv[1]
url = urllib.parse.urlsplit(os.environ["TORCHFT_LIGHTHOUSE"])
with socket.create_connection((url.hostname, url.port), timeout=5):
    pass
keys = ["RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
        "MESHTUNE_MESH", "TORCHFT_LIGHTHOUSE", "ACCELERATE_USE_CPU", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS"]
report = {"env": {k: os.environ.get(k) for k in keys}, "argv": sys.argv[2:], "lighthouse_connectable": True}
with open(os.path.join(out, "rank%s.json" % os.environ["RANK"]), "w") as f:
    json.dump(report, f)
print("hello from rank", os.environ["RANK"])
print("warning from rank", os.environ["RANK"], file=sys.stderr)
"""

# Every rank starts a grandchild (`sleep 60`) and publishes both PIDs; rank FAIL (argv[2]) exits 3 once
# every rank has published, the others sleep. With argv[3] == "stubborn" the sleepers ignore SIGTERM.
_SLEEPER_SCRIPT = """
import os, signal, subprocess, sys, time
out, fail, mode = sys.argv[1], int(sys.argv[2]), sys.argv[3]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
grandchild = subprocess.Popen(["sleep", "60"])
tmp = os.path.join(out, "tmp%d" % rank)
with open(tmp, "w") as f:
    f.write("%d %d %s" % (os.getpid(), grandchild.pid, os.environ["TORCHFT_LIGHTHOUSE"]))
os.replace(tmp, os.path.join(out, "pid%d" % rank))
if rank == fail:
    deadline = time.time() + 300
    while sum(n.startswith("pid") for n in os.listdir(out)) < world and time.time() < deadline:
        time.sleep(0.05)
    print("the reason rank", rank, "gives up", flush=True)  # a quiet rank's line: shown once it fails
    sys.exit(3)
if mode == "stubborn":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
time.sleep(60)
"""


def _script(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _meshtune(*args: str) -> list[str]:
    return [sys.executable, "-m", "hf_meshtune.cli", *args]


def _gone(pid: int) -> bool:
    """True when ``pid`` no longer runs (a zombie whose parent has not reaped it counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def _wait_all_gone(pids: list[int], timeout: float = 5.0) -> list[int]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and not all(_gone(p) for p in pids):
        time.sleep(0.05)
    return [p for p in pids if not _gone(p)]


def _published(out: Path, world: int, timeout: float) -> list[tuple[int, int, str]]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and len(list(out.glob("pid*"))) < world:
        time.sleep(0.05)
    records = [(out / f"pid{r}").read_text().split() for r in range(world)]
    return [(int(a), int(b), addr) for a, b, addr in records]


def _port_closed(address: str, timeout: float = 5.0) -> bool:
    url = urllib.parse.urlsplit(address)
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((url.hostname, url.port), timeout=1):
                pass
        except OSError:
            return True
        time.sleep(0.1)
    return False


# ---------------------------------------------------------------------------------------------------
# Pure parts
# ---------------------------------------------------------------------------------------------------


def test_child_env_is_torchrun_style_and_splits_cores() -> None:
    env = child_env(
        (3, 2),
        5,
        cpu=True,
        master_port=1234,
        lighthouse="http://127.0.0.1:9",
        base={"PATH": "/bin", "RANK": "stale"},
        cpu_count=16,
    )
    assert env["PATH"] == "/bin"
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"], env["LOCAL_WORLD_SIZE"]) == ("5", "6", "5", "6")
    assert (env["MASTER_ADDR"], env["MASTER_PORT"], env["MESHTUNE_MESH"]) == ("127.0.0.1", "1234", "3x2")
    assert env["TORCHFT_LIGHTHOUSE"] == "http://127.0.0.1:9"
    assert (env["ACCELERATE_USE_CPU"], env["CUDA_VISIBLE_DEVICES"], env["OMP_NUM_THREADS"]) == ("true", "", "2")
    one_core_each = child_env((8, 1), 0, cpu=True, master_port=1, lighthouse=None, base={}, cpu_count=2)
    assert one_core_each["OMP_NUM_THREADS"] == "1"
    exported = child_env((2, 1), 0, cpu=True, master_port=1, lighthouse=None, base={"OMP_NUM_THREADS": "7"})
    assert exported["OMP_NUM_THREADS"] == "7"
    gpu = child_env((2, 2), 0, cpu=False, master_port=1, lighthouse=None, base={})
    assert "ACCELERATE_USE_CPU" not in gpu and "CUDA_VISIBLE_DEVICES" not in gpu and "TORCHFT_LIGHTHOUSE" not in gpu


def test_child_env_of_a_replica_job_is_its_own_world() -> None:
    env = child_env(
        (3, 2),
        5,
        cpu=True,
        master_port=1234,
        lighthouse=None,
        base={},
        cpu_count=12,
        replica_jobs=True,
        restart=2,
        job_store="127.0.0.1:7",
    )
    assert (env["RANK"], env["WORLD_SIZE"], env["MESHTUNE_REPLICA"], env["MESHTUNE_RESTART"]) == ("1", "2", "2", "2")
    assert (env["LOCAL_RANK"], env["MASTER_PORT"], env["MESHTUNE_JOB_STORE"], env["OMP_NUM_THREADS"]) == (
        "5",
        "1234",
        "127.0.0.1:7",
        "2",
    )
    plain = child_env((3, 2), 5, cpu=True, master_port=1234, lighthouse=None, base={})
    assert "MESHTUNE_REPLICA" not in plain and "MESHTUNE_RESTART" not in plain


def test_local_lighthouse_answers_a_torchft_client_and_stops() -> None:
    from datetime import timedelta

    from torchft.coordination import LighthouseClient

    server, address = start_lighthouse(host="127.0.0.1")
    try:
        assert address.startswith("http://127.0.0.1:")
        LighthouseClient(address, connect_timeout=timedelta(seconds=5)).heartbeat("probe")
    finally:
        server.shutdown()
    assert _port_closed(address)


@pytest.mark.parametrize(
    ("args", "needles"),
    [
        (["--mesh", "3x0"], ["--mesh='3x0'", "X >= 1 replicas and Y >= 1 stages"]),
        (["--mesh", "abc"], ["--mesh='abc'", "be XxY"]),
        (["--mesh", "2x2", "--"], ["script=''", "be given after `--`"]),
        (["--mesh", "2x2", "--", "no_such_script.py"], ["script='no_such_script.py'", "existing Python file"]),
        (["--mesh", "2x2", "--lighthouse", "nowhere", "--", __file__], ["--lighthouse='nowhere'", "host:port"]),
        (["--mesh", "2x2", "--max-restarts", "-1", "--", __file__], ["--max-restarts=-1", "integer >= 0"]),
        (
            ["--mesh", "2x2", "--max-restarts", "1", "--master-port", "2900", "--", __file__],
            ["--master-port=2900", "unset with max_restarts > 0"],
        ),
    ],
)
def test_bad_input_exits_2_naming_field_value_and_rule(args, needles, capsys) -> None:
    assert cli.main(["launch", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("meshtune launch: error: ")
    for needle in needles:
        assert needle in err


# ---------------------------------------------------------------------------------------------------
# Real meshes
# ---------------------------------------------------------------------------------------------------


def test_cli_starts_every_rank_with_its_env_and_prefixes_output(tmp_path: Path) -> None:
    script = _script(tmp_path, "report.py", _REPORT_SCRIPT)
    out, logs = tmp_path / "out", tmp_path / "logs"
    out.mkdir()
    done = subprocess.run(
        _meshtune(
            "launch", "--mesh", "2x2", "--cpu", "--log-dir", str(logs), "--", str(script), str(out), "arg", "--flag"
        ),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,  # a hang guard: 5 Python processes start on 2 cores, slowly when the machine is loaded
    )
    assert done.returncode == 0, done.stderr
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in range(4)]
    envs = [rep["env"] for rep in reports]
    assert sorted(int(e["RANK"]) for e in envs) == [0, 1, 2, 3]
    assert [e["LOCAL_RANK"] for e in envs] == ["0", "1", "2", "3"]
    for key in ("WORLD_SIZE", "MASTER_PORT", "MESHTUNE_MESH", "TORCHFT_LIGHTHOUSE", "OMP_NUM_THREADS"):
        assert len({e[key] for e in envs}) == 1, key
    assert (envs[0]["WORLD_SIZE"], envs[0]["MESHTUNE_MESH"], envs[0]["MASTER_ADDR"]) == ("4", "2x2", "127.0.0.1")
    assert (envs[0]["ACCELERATE_USE_CPU"], envs[0]["CUDA_VISIBLE_DEVICES"]) == ("true", "")
    assert envs[0]["TORCHFT_LIGHTHOUSE"].startswith("http://127.0.0.1:")
    assert all(rep["argv"] == ["arg", "--flag"] and rep["lighthouse_connectable"] for rep in reports)
    for rank, tag in enumerate(["r0s0", "r0s1", "r1s0", "r1s1"]):  # rank r = replica r // Y, stage r % Y
        # the terminal shows the loss rank (replica 0's last stage) whole, process 0's prints, the others' warnings
        assert (f"[{tag}] hello from rank {rank}\n" in done.stdout) == (tag in ("r0s1", "r0s0"))
        assert f"[{tag}] warning from rank {rank}\n" in done.stderr
        assert f"[{tag}] hello from rank {rank}" in (logs / f"rank{rank}.log").read_text()
    assert f"every rank's output: {logs}/rank<N>.log; showing r0s1 (the loss), r0s0's prints" in done.stderr
    assert _port_closed(envs[0]["TORCHFT_LIGHTHOUSE"])  # the launcher stopped its lighthouse


def test_module_form_and_given_lighthouse_are_passed_through(tmp_path: Path, capsys) -> None:
    _script(
        tmp_path,
        "mesh_probe.py",
        """
        import os, sys
        print(os.environ["RANK"], os.environ["TORCHFT_LIGHTHOUSE"], *sys.argv[1:])
    """,
    )
    code = launch_mesh(
        (1, 2),
        ["-m", "mesh_probe", "x"],
        cpu=False,
        lighthouse="127.0.0.1:1",
        env={"PYTHONPATH": str(tmp_path)},
        all_ranks=True,
    )
    assert code == 0
    out = capsys.readouterr().out
    assert "[r0s0] 0 http://127.0.0.1:1 x\n" in out and "[r0s1] 1 http://127.0.0.1:1 x\n" in out


def test_failing_rank_stops_the_mesh_and_sets_the_exit_code(tmp_path: Path, capsys) -> None:
    script = _script(tmp_path, "sleeper.py", _SLEEPER_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    # Rank 2 fails once every rank has published its PID; the others ignore SIGTERM, so only the SIGKILL
    # after grace_s ends them: timed from the failure (the last PID file), not from the processes' start
    code = launch_mesh((2, 2), [str(script), str(out), "2", "stubborn"], cpu=True, grace_s=1.0)
    ended = time.time()
    failed = max(path.stat().st_mtime for path in out.glob("pid*"))
    assert code == 3
    assert ended - failed < 30, ended - failed  # the grace (1 s), then the kill: never the sleepers' 60 s
    err = capsys.readouterr().err
    assert "rank 2 (r1s0) failed first with exit code 3" in err
    tail = "[r1s0] ... its last 1 line(s) not shown above:\n[r1s0] the reason rank 2 gives up\n"
    assert tail in err and err.index(tail) < err.index("failed first")  # the failed rank's tail, then the verdict
    records = _published(out, 4, timeout=0)
    survivors = _wait_all_gone([pid for rec in records for pid in rec[:2]])
    assert survivors == []
    assert _port_closed(records[0][2])


# A replica job: rank FAIL (argv[2]) exits 3 on its first FAILS starts (argv[3]); everyone else
# records its start and exits 0 after a moment, so a restart must leave the other replicas alone.
_RESTART_SCRIPT = """
import os, sys, time
out, fail, fails = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
mesh_rank = int(os.environ["MESHTUNE_REPLICA"]) * int(os.environ["WORLD_SIZE"]) + int(os.environ["RANK"])
restart = int(os.environ["MESHTUNE_RESTART"])
with open(os.path.join(out, "start%d.g%d" % (mesh_rank, restart)), "w") as f:
    f.write("%s %s" % (os.environ["MASTER_PORT"], os.environ["MESHTUNE_JOB_STORE"]))
if mesh_rank == fail and restart < fails:
    stages = int(os.environ["WORLD_SIZE"])
    first = mesh_rank - mesh_rank % stages
    mates = [os.path.join(out, "start%d.g%d" % (r, restart)) for r in range(first, first + stages)]
    deadline = time.time() + 300
    while not all(os.path.exists(m) for m in mates) and time.time() < deadline:  # they started: now fail
        time.sleep(0.02)
    sys.exit(3)
time.sleep(1.5)
"""


def test_max_restarts_restarts_only_the_failed_replica(tmp_path: Path, capsys) -> None:
    script = _script(tmp_path, "restart.py", _RESTART_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    code = launch_mesh((3, 2), [str(script), str(out), "3", "2"], cpu=True, max_restarts=2, grace_s=1.0)
    assert code == 0
    starts = sorted(p.name for p in out.iterdir())
    # replica 1 (ranks 2, 3) started three times, the others once; a fresh port per start of a replica
    assert starts == [
        "start0.g0",
        "start1.g0",
        "start2.g0",
        "start2.g1",
        "start2.g2",
        "start3.g0",
        "start3.g1",
        "start3.g2",
        "start4.g0",
        "start5.g0",
    ]
    ports = {name: (out / name).read_text().split()[0] for name in starts}
    assert ports["start2.g0"] == ports["start3.g0"] and ports["start2.g1"] == ports["start3.g1"]
    assert (
        len({ports["start0.g0"], ports["start2.g0"], ports["start2.g1"], ports["start2.g2"], ports["start4.g0"]}) == 5
    )
    err = capsys.readouterr().err
    assert "rank 3 (r1s1) failed with exit code 3: restarting replica 1 (1/2)" in err
    assert "restarting replica 1 (2/2)" in err


def test_rank_hook_prefixes_argv_and_adds_env_per_rank(tmp_path: Path, capsys) -> None:
    """The hook's prefix runs before the interpreter (here `env NAME=VALUE`, as `ip netns exec NS` would)."""
    _script(
        tmp_path,
        "hooked.py",
        """
        import os
        print(os.environ["RANK"], os.environ["FROM_PREFIX"], os.environ["FROM_ENV"])
    """,
    )

    def hook(rank: int):
        return ["env", f"FROM_PREFIX=p{rank}"], {"FROM_ENV": f"e{rank}"}

    code = launch_mesh((1, 2), [str(tmp_path / "hooked.py")], cpu=True, rank_hook=hook, all_ranks=True)
    assert code == 0
    out = capsys.readouterr().out
    assert "[r0s0] 0 p0 e0\n" in out and "[r0s1] 1 p1 e1\n" in out


def test_a_replica_past_its_restarts_fails_the_mesh(tmp_path: Path, capsys) -> None:
    script = _script(tmp_path, "restart.py", _RESTART_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    code = launch_mesh((2, 1), [str(script), str(out), "1", "5"], cpu=True, max_restarts=1, grace_s=1.0)
    assert code == 3
    assert sorted(p.name for p in out.iterdir() if p.name.startswith("start1")) == ["start1.g0", "start1.g1"]
    assert "rank 1 (r1s0) failed first with exit code 3; stopping the others" in capsys.readouterr().err


def test_sigint_stops_every_child_and_the_lighthouse(tmp_path: Path) -> None:
    script = _script(tmp_path, "sleeper.py", _SLEEPER_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    command = _meshtune("launch", "--mesh", "2x2", "--cpu", "--", str(script), str(out), "-1", "polite")
    launcher = subprocess.Popen(command, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        records = _published(out, 4, timeout=300)  # start-up, slow on a loaded machine; the claim is timed below
        launcher.send_signal(signal.SIGINT)
        start = time.monotonic()
        _, err = launcher.communicate(timeout=20)
        elapsed = time.monotonic() - start
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode == 130, err
    assert elapsed < 30, elapsed  # polite children die on the first SIGTERM, not after the sleepers' 60 s
    assert "got SIGINT" in err
    assert _wait_all_gone([pid for rec in records for pid in rec[:2]]) == []
    assert _port_closed(records[0][2])


# ---------------------------------------------------------------------------------------------------
# accelerate configs
# ---------------------------------------------------------------------------------------------------

_ALLREDUCE_SCRIPT = """
import json, os, sys
import torch
import torch.distributed as dist
from accelerate import Accelerator
torch.set_num_threads(1)
state = Accelerator().state
value = torch.tensor([float(state.process_index)])
dist.all_reduce(value)
report = {"rank": state.process_index, "world": state.num_processes, "sum": value.item(),
          "type": str(state.distributed_type), "backend": dist.get_backend(), "env_rank": os.environ["RANK"],
          "mesh": os.environ.get("MESHTUNE_MESH")}
with open(os.path.join(sys.argv[1], "rank%d.json" % state.process_index), "w") as f:
    json.dump(report, f)
dist.destroy_process_group()  # without it gloo's threads abort the exit (SIGABRT) on torch 2.13
"""


def test_cpu_mesh_yaml_starts_six_gloo_ranks(tmp_path: Path) -> None:
    script = _script(tmp_path, "allreduce.py", _ALLREDUCE_SCRIPT)
    out = tmp_path / "out"
    out.mkdir()
    env = dict(os.environ, ACCELERATE_USE_CPU="true", MESHTUNE_MESH="3x2")
    accelerate = Path(sys.executable).with_name("accelerate")
    config = REPO / "accelerate_configs" / "cpu_mesh_3x2.yaml"
    done = subprocess.run(
        [
            str(accelerate),
            "launch",
            "--config_file",
            str(config),
            "--main_process_port",
            str(free_port()),
            str(script),
            str(out),
        ],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    reports = [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]
    assert sorted(r["rank"] for r in reports) == [0, 1, 2, 3, 4, 5]
    for r in reports:
        assert (r["world"], r["sum"], r["backend"], r["mesh"]) == (6, 15.0, "gloo", "3x2")
        assert r["type"] == "DistributedType.MULTI_CPU" and r["env_rank"] == str(r["rank"])


def test_step_progress_follows_the_loss_rank_step_lines() -> None:
    import io

    from hf_meshtune.console import StepProgress

    out = io.StringIO()
    progress = StepProgress(["recipes/sft.py", "--max_steps", "12"], "r0s1", file=out, disable=False)
    assert progress.bar.total == 12
    progress.feed("r0s0", '{"mesh": "3x2", "step": 5, "loss": 1.0}')  # another rank: ignored
    progress.feed("r0s1", "Loading weights ...")
    assert progress.bar.n == 0
    progress.feed("r0s1", '{"mesh": "3x2", "step": 3, "loss": 2.5, "lr": 0.001}')
    progress.feed("r0s1", '{"mesh": "3x2", "step": 2, "loss": 2.5}')  # never backwards
    assert progress.bar.n == 3
    progress.close()
    assert "3/12" in out.getvalue()
    assert StepProgress(["x.py"], "r0s1", file=io.StringIO(), disable=False).bar.total is None


def test_the_console_shows_the_loss_rank_warnings_and_keeps_a_failed_ranks_tail() -> None:
    import io

    from hf_meshtune.console import TAIL_LINES, Console, StepProgress

    out = io.StringIO()
    progress = StepProgress(["s.py", "--max_steps", "10"], "r0s1", file=out, disable=False)
    console = Console("r0s1", progress)
    assert console.shows("r0s1", "Loading weights", False)  # the loss rank: everything
    assert not console.shows("r1s0", "Map: 100%|####| 64/64", True)  # another rank's progress bar: quiet
    assert console.shows("r1s0", "UserWarning: something is off", True)  # ... unless it warns
    assert not console.shows("r2s1", "UserWarning: something is off", True)  # the same warning: said once
    assert console.shows("r2s0", "Traceback (most recent call last):", True)  # or fails
    assert console.shows("r0s0", '  File "x.py", line 3', True) is False  # process 0's stderr: quiet
    assert console.shows("r0s0", "exact match after training: 0.58", False)  # its prints: shown
    step = '{"mesh": "3x2", "step": 4, "loss": 2.5, "mesh_tokens_per_s": 1234.5, "comm/rank_bytes_per_token": 56789}'
    assert console.shows("r0s1", step, False) and progress.bar.n == 4
    assert progress.bar.postfix == "loss=2.5, tok/s=1.23k, wire B/tok=56.8k"
    assert console.tail("r1s0") == ["Map: 100%|####| 64/64"] and console.tail("r1s0") == []  # emptied
    assert console.tail("r2s1") == ["UserWarning: something is off"]  # kept for its tail, though not shown
    for i in range(TAIL_LINES + 5):
        console.shows("r1s1", f"line {i}", False)
    assert console.tail("r1s1") == [f"line {i}" for i in range(5, TAIL_LINES + 5)]  # the last TAIL_LINES
    assert Console("r0s1", all_ranks=True).shows("r1s0", "Map: 10%", True)  # --all-ranks: everything
    console.close()
    assert "4/10" in out.getvalue()
