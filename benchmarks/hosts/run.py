"""Hosts as a user runs them: one `meshtune launch --hosts FILE --this-host NAME` per host, each host a
network namespace with its own address and a shaped link, running `recipes/sft.py` unchanged.

    python -m benchmarks.hosts.run                     # every row, ~20 min on 2 CPU cores
    python -m benchmarks.hosts.run --rows slow_even,slow_uneven

Rows (SmolLM2-135M-Instruct, GSM8K, the default codec, 200 Mbit/s per host each way, no added delay):
  split        3x2, each replica's two stages on two hosts (6 hosts of one process): every boundary on the WAN
  colo         3x2, each replica's two stages on one host (3 hosts of two): local boundaries, dense
  slow_even    1x2 on hosts a (1 CPU) and b (a third of a CPU, a cgroup quota): 15 + 15 layers
  slow_uneven  the same with stage_layers [27, 3]: the slow host holds 3 layers and the LM head
  lost_host    colo for 40 steps, with host c killed (every process in its namespace, SIGKILL) once replica 0
               logged step 3, then its launcher started again: the others' pause, the heal, the final loss
  colo_40      the same 40 steps without the loss: the reference for lost_host's final loss

Measured per row: the launchers' exit codes and wall time; the loss rank's step times (the median of
steps 2..N); every host's bytes sent on its link (the kernel's eth0 counter, headers included) next to
the mesh summary's booked bytes; the final eval loss. Results go to benchmarks/hosts/results/<row>.json
as each row finishes, and results.md / step_seconds.png are rebuilt from all of them.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time

from benchmarks.wan import netns

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "benchmarks", "hosts", "results")
RATE_MBIT = 200.0
PREFIX = "mthb"
CGROUP = "/sys/fs/cgroup/cpu"  # cgroup v1's cpu controller here (cpu.cfs_quota_us)
COMMON = ["--num_stages", "2", "--max_length", "64", "--per_device_train_batch_size", "1",
          "--gradient_accumulation_steps", "2", "--learning_rate", "5e-5", "--eval_items", "4", "--logging_steps", "1",
          "--freeze_embeddings", "--dp_sync_every", "4", "--save_strategy", "no", "--report_to", "none"]  # fmt: skip


def _hosts(names_slots: list[tuple[str, int]], mesh: str, extra: str = "") -> str:
    lines = [f"mesh: {mesh}", "heartbeat_timeout_s: 10", "max_restarts: 2", extra, "hosts:"]
    for i, (name, slots) in enumerate(names_slots):
        lines.append(
            f"  - {{name: {name}, address: {netns.node_ip(i)}, cpu: {{processes: {slots}}}, "
            f"link: {{up_mbit: {RATE_MBIT:g}, down_mbit: {RATE_MBIT:g}, rtt_ms: 0}}}}"
        )
    return "\n".join(line for line in lines if line) + "\n"


ROWS = {
    "split": dict(hosts=_hosts([(f"h{i}", 1) for i in range(6)], "3x2"), steps=8),
    "colo": dict(hosts=_hosts([(n, 2) for n in "abc"], "3x2"), steps=8),
    "slow_even": dict(hosts=_hosts([("a", 1), ("b", 1)], "1x2"), steps=6, quota={"b": 1 / 3, "a": 1.0}),
    "slow_uneven": dict(
        hosts=_hosts([("a", 1), ("b", 1)], "1x2", "stage_layers: [27, 3]"), steps=6, quota={"b": 1 / 3, "a": 1.0}
    ),
    "lost_host": dict(hosts=_hosts([(n, 2) for n in "abc"], "3x2"), steps=40, kill=("c", 3)),
    "colo_40": dict(hosts=_hosts([(n, 2) for n in "abc"], "3x2"), steps=40),  # lost_host's run without the loss
}


def _launcher(node: int, name: str, hosts: str, work: str, steps: int, quota: float | None) -> subprocess.Popen:
    meshtune = os.path.join(os.path.dirname(sys.executable), "meshtune")
    command = [*netns.exec_prefix(node), meshtune, "launch", "--hosts", hosts, "--this-host", name,
               "--log-dir", os.path.join(work, f"logs-{name}"), "--", "recipes/sft.py",
               "--output_dir", os.path.join(work, "out"), "--max_steps", str(steps), *COMMON]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    log = open(os.path.join(work, f"launcher-{name}.txt"), "a")
    preexec = None
    if quota is not None:  # the launcher, and so everything it starts, in the host's cgroup
        group = os.path.join(CGROUP, f"{PREFIX}-{name}")
        os.makedirs(group, exist_ok=True)
        with open(os.path.join(group, "cpu.cfs_period_us"), "w") as fh:
            fh.write("100000")
        with open(os.path.join(group, "cpu.cfs_quota_us"), "w") as fh:
            fh.write(str(int(100000 * quota)))

        def preexec() -> None:
            with open(os.path.join(group, "cgroup.procs"), "w") as fh:
                fh.write(str(os.getpid()))

    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, preexec_fn=preexec)


def _step_lines(work: str) -> list[dict]:
    """The loss rank's per-step JSON lines (r0s1), from whichever host's log holds them."""
    steps: dict[int, dict] = {}
    for folder in sorted(d for d in os.listdir(work) if d.startswith("logs-")):
        for name in os.listdir(os.path.join(work, folder)):
            with open(os.path.join(work, folder, name), errors="replace") as fh:
                for line in fh:
                    match = re.match(r"\[r0s1\] (\{\"mesh\".*\})$", line.strip())
                    if match:
                        record = json.loads(match[1])
                        steps[record["step"]] = record
    return [steps[k] for k in sorted(steps)]


def _eval_loss(work: str) -> float | None:
    with open(os.path.join(work, "out", "trainer_state.json")) as fh:
        history = json.load(fh)["log_history"]
    losses = [h["eval_loss"] for h in history if "eval_loss" in h]
    return losses[-1] if losses else None


def _rank_step(work: str, host: str, rank: int) -> int:
    """The last step rank ``rank`` logged (its training progress lines ``"step": N``), from its host's log."""
    path = os.path.join(work, f"logs-{host}", f"rank{rank}.log")
    if not os.path.exists(path):
        return 0
    with open(path, errors="replace") as fh:
        steps = [int(m[1]) for m in re.finditer(r'"step": (\d+)', fh.read())]
    return max(steps, default=0)


def run_row(name: str, spec: dict, work: str) -> dict:
    hosts_text = spec["hosts"]
    names = re.findall(r"name: (\w+)", hosts_text)
    netns.up(len(names), RATE_MBIT)
    hosts = os.path.join(work, "hosts.yaml")
    with open(hosts, "w") as fh:
        fh.write(hosts_text)
    quota = spec.get("quota", {})
    before = [netns.tx_bytes(i) for i in range(len(names))]
    start = time.perf_counter()
    procs = {n: _launcher(i, n, hosts, work, spec["steps"], quota.get(n)) for i, n in enumerate(names)}
    event: dict = {}
    if "kill" in spec:
        victim, at = spec["kill"]
        node = names.index(victim)
        while _rank_step(work, "a", 1) < at:  # replica 0's loss rank logs its steps; the replicas keep pace
            if time.perf_counter() - start > 900 or any(p.poll() is not None for p in procs.values()):
                raise RuntimeError(f"{name}: host {victim} did not reach step {at}; see {work}")
            time.sleep(0.2)
        event["survivor_step_at_kill"] = event["killed_at_step"] = _rank_step(work, "a", 1)
        event["killed_at_s"] = time.perf_counter() - start
        for pid in netns.pids(node):  # the machine dies: every process on it, no goodbye
            os.kill(pid, signal.SIGKILL)
        procs[victim].wait()
        time.sleep(5.0)
        event["restarted_at_s"] = time.perf_counter() - start
        procs[victim] = _launcher(node, victim, hosts, work, spec["steps"], None)
    codes = {}
    for n, proc in procs.items():
        try:
            codes[n] = proc.wait(timeout=max(1.0, 1500 - (time.perf_counter() - start)))
        except subprocess.TimeoutExpired:
            proc.kill()
            codes[n] = proc.wait()
    wall = time.perf_counter() - start
    tx = [netns.tx_bytes(i) - b for i, b in enumerate(before)]
    if any(codes.values()):
        raise RuntimeError(f"{name}: launcher exit codes {codes}; see {work}/launcher-*.txt")
    with open(os.path.join(work, "out", "mesh_summary.json")) as fh:
        summary = json.load(fh)
    lines = _step_lines(work)
    seconds = [line["step_seconds"] for line in lines]
    tokens = summary["fast_tokens"]
    row = {
        "row": name,
        "hosts_file": hosts_text,
        "command": "meshtune launch --hosts hosts.yaml --this-host NAME -- recipes/sft.py --output_dir OUT "
        f"--max_steps {spec['steps']} " + " ".join(COMMON),
        "cpu_quota": quota,
        "codes": codes,
        "wall_s": wall,
        "steps": len(seconds),
        "step_seconds": seconds,
        "median_step_s": statistics.median(seconds[1:]) if len(seconds) > 1 else None,
        "losses": [line["loss"] for line in lines],
        "eval_loss": _eval_loss(work),
        "stage_layers": summary["stage_layers"],
        "local_boundaries": summary.get("local_boundaries"),
        "compute_s_per_stage": summary.get("compute_s_per_stage"),
        "step_split_per_rank": summary.get("step_split_per_rank"),  # step, pipeline, compute and wait seconds
        "slowest_stage": summary.get("slowest_stage"),
        "heals": summary["heals"],
        "fast_tokens": tokens,
        "kernel_tx_bytes_per_host": dict(zip(names, tx)),  # measured: eth0, headers included
        "kernel_tx_bytes_per_token": sum(tx) / max(tokens, 1),
        "wire_bytes_per_token": summary["wire_bytes_per_token"],  # measured sends + booked all-reduces
        "local_bytes_per_token": summary.get("local_bytes_per_token"),
        **event,
    }
    if "kill" in spec:
        after = [
            (line["step"], line["step_seconds"]) for line in lines if line["step"] > event["survivor_step_at_kill"]
        ]
        row["survivor_longest_step_after_kill_s"] = max((s for _, s in after), default=None)
    return row


def report(results: dict[str, dict]) -> str:
    lines = [
        "# Hosts: one launcher per host (network namespaces, 200 Mbit/s each way, 2 CPU cores in all)",
        "",
        "Generated by `python -m benchmarks.hosts.run`; every number is measured. Step time: the loss rank's median "
        "over steps 2..N. Bytes: each host's eth0 counter (the kernel's, headers and the mesh's control traffic "
        "included) per fast token, next to the mesh summary's WAN circuits (sends counted, all-reduces booked) "
        "and its local circuit.",
        "",
        "| row | hosts | steps | step s (median) | wall s | eval loss | kernel B/token | WAN circuits B/token "
        "| of which pp | local B/token | stage_layers | compute s per stage |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for name, r in results.items():
        compute = r.get("compute_s_per_stage")
        wan = r["wire_bytes_per_token"]
        lines.append(
            f"| {name} | {len(r['kernel_tx_bytes_per_host'])} | {r['steps']} | {r['median_step_s']:.2f} | "
            f"{r['wall_s']:.0f} | {r['eval_loss']:.4f} | {r['kernel_tx_bytes_per_token']:,.0f} | "
            f"{wan['total']:,.0f} | {wan['pp_fwd'] + wan['pp_bwd']:,.0f} | "
            f"{(r.get('local_bytes_per_token') or 0):,.0f} | {r['stage_layers']} | "
            f"{'' if compute is None else [round(c, 2) for c in compute]} |"
        )
    if "slow_even" in results and "slow_uneven" in results:
        ratio = results["slow_even"]["median_step_s"] / results["slow_uneven"]["median_step_s"]
        lines += ["", f"Uneven vs even on the slow host: {ratio:.2f}x faster per step (target >= 1.3x)."]
    if "split" in results and "colo" in results:
        s, c = results["split"], results["colo"]
        lines += [
            "",
            f"Co-located vs split replicas: {s['median_step_s'] / c['median_step_s']:.2f}x the step rate; "
            f"kernel bytes per token {c['kernel_tx_bytes_per_token']:,.0f} vs {s['kernel_tx_bytes_per_token']:,.0f}.",
        ]
    if "lost_host" in results:
        r = results["lost_host"]
        beyond = (r["kernel_tx_bytes_per_token"] - r["wire_bytes_per_token"]["total"]) * r["fast_tokens"] / 1e9
        lines += [
            "",
            f"Lost host: c killed once replica 0 had logged step {r['killed_at_step']}, "
            f"started again {r['restarted_at_s'] - r['killed_at_s']:.0f} s later. Replica 0's longest step after the "
            f"kill: {r['survivor_longest_step_after_kill_s']:.1f} s (median {r['median_step_s']:.1f} s). Heals: "
            f"{r['heals']}. Final eval loss {r['eval_loss']:.4f}"
            + (
                f" (the same 40 steps without the loss, colo_40: {results['colo_40']['eval_loss']:.4f})."
                if "colo_40" in results
                else "."
            )
            + " Bytes the kernel counted beyond the circuits (mostly the heal's state transfer, which no circuit "
            f"books): {beyond:.2f} GB.",
        ]
    return "\n".join(lines) + "\n"


def plot(results: dict[str, dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    names = list(results)
    ax.bar(names, [results[n]["median_step_s"] for n in names], color="#4a7ab5")
    ax.set_ylabel("median step (s)")
    ax.set_title("recipes/sft.py on emulated hosts (2 CPU cores in all)")
    fig.tight_layout()
    fig.savefig(os.path.join(OUT, "step_seconds.png"), dpi=110)
    plt.close(fig)


def _load_all() -> dict[str, dict]:
    results = {}
    for name in ROWS:
        path = os.path.join(OUT, f"{name}.json")
        if os.path.exists(path):
            with open(path) as fh:
                results[name] = json.load(fh)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.hosts.run", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default=",".join(ROWS), help=f"comma-separated, of {list(ROWS)}")
    args = parser.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    unknown = [r for r in rows if r not in ROWS]
    if unknown:
        parser.error(f"rows={unknown} is invalid: it must name rows of {list(ROWS)}")
    os.environ[netns.PREFIX_ENV] = PREFIX
    os.makedirs(OUT, exist_ok=True)
    try:
        for name in rows:
            work = tempfile.mkdtemp(prefix=f"meshtune-hosts-{name}-")
            print(f"row {name}: {work}", flush=True)
            result = run_row(name, ROWS[name], work)
            with open(os.path.join(OUT, f"{name}.json"), "w") as fh:
                json.dump(result, fh, indent=2)
            shutil.rmtree(os.path.join(work, "out"), ignore_errors=True)  # a checkpoint: hundreds of MB
            results = _load_all()
            with open(os.path.join(OUT, "results.md"), "w") as fh:
                fh.write(report(results))
            plot(results)
            print(
                f"row {name}: median step {result['median_step_s']:.2f} s, eval loss {result['eval_loss']}", flush=True
            )
    finally:
        netns.down()
        for name in ("a", "b"):
            group = os.path.join(CGROUP, f"{PREFIX}-{name}")
            if os.path.isdir(group):
                os.rmdir(group)
    return 0


if __name__ == "__main__":
    sys.exit(main())
