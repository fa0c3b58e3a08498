"""One rank of a tiny-Llama mesh on ``meshtune launch`` (one world, or replica jobs with ``--max-restarts``).

    python tests/scripts/mesh_run.py OUT_DIR STEPS [MESH_CONFIG_JSON]

Runs its stage (``runtime.bootstrap.run_worker``; the anchor's too when the config turns it on), writes
``OUT_DIR/progress/r{rank}.g{restart}`` = ``pid step`` after every step (what a test watches to kill
it by PID) and, at the end, ``OUT_DIR/result{rank}.pt``: ``{"result": MeshResult, "params": the stage's
parameters, "global_params": θ_global of every fragment}`` (through a ``StageCallback``, as any caller
would). ``STEP_SECONDS`` in the environment paces the steps (a soak's timeline); ``RESTART_DELAY_S``
holds a restarted process back before it joins (a machine that takes a while to come back: the others
meanwhile sync without it); ``RESTART_AFTER_STEP`` holds it back until another process's progress file
shows that step (the same, as an event rather than a time: at most 180 s); ``HOLD_FOR_RESTART_AT`` makes
the first-generation processes wait after that step until a restarted process has published its PID
(so a restart that is slow to start on a loaded machine still rejoins before the run ends; at most
300 s). ``CHECKPOINT_EVERY`` writes mesh checkpoints to OUT_DIR every that many steps
(``CHECKPOINT_KEEP`` kept); ``RESUME_FROM`` continues from one; ``LINK_TIMEOUT_S`` bounds pipeline
sends/receives (default 30), ``DP_TIMEOUT_S`` the replicas' quorums and all-reduces (default 30).
``VARIABLE_ROWS=1`` cuts each row's labels at a seeded length of its own (rows of different lengths).
``GOVERNOR_SCRIPT`` (a JSON list of [snapshot, levels]) makes a governed anchor decide, at a round on
snapshot s, the levels of the last entry at or before s instead of the governor's rule, after running its
probes as usual: a test's way to force level changes at known rounds.
``KILL_DURING_SAVE`` = ``STEP:RANK`` makes that first-generation rank SIGKILL itself in the middle of writing
its checkpoint file of that step: half the bytes are on disk (fsynced), in the file the checkpoint code
opened, when the signal lands, as when a machine dies mid-save.
"""

from __future__ import annotations

import io
import json
import os
import signal
import sys
import time

import torch
import torch.distributed as dist

from hf_meshtune.boundary.hooks import find_decoder_layers
from hf_meshtune.comm.gate import guard_launched_process
from hf_meshtune.comm.listen import gloo_interface, serve_rendezvous_store
from hf_meshtune.config import MeshConfig
from hf_meshtune.runtime.bootstrap import run_worker
from hf_meshtune.runtime.settings import RunSettings, StageCallback
from hf_meshtune.topology import MeshTopology
from tests.distributed import ParameterRecorder
from tests.tiny import tiny_llama

SEQ, MICRO, MICROBATCHES = 16, 2, 2
# float32 PowerSGD: the tests count its all-reduces (two a sync; int8 codes make four, dp_quantize)
CONFIG = dict(mask_ratio=0.9, anchor=False, dp_sync_every=4, dp_fragments=2, dp_powersgd_rank=2, dp_quantize=None)


def batches(replica: int):
    variable = os.environ.get("VARIABLE_ROWS") == "1"

    def draw(step: int):
        gen = torch.Generator().manual_seed(replica * 100_000 + step)
        start = torch.randint(3, 60, (MICRO * MICROBATCHES, 1), generator=gen)
        ids = (start + torch.arange(SEQ)) % 97 + 3
        labels = ids.clone()
        if variable:  # each row ends at its own length: the padding after it never crosses a boundary
            lengths = torch.randint(2, SEQ + 1, (MICRO * MICROBATCHES,), generator=gen)
            labels[torch.arange(SEQ) >= lengths.unsqueeze(-1)] = -100
        return ids, labels

    return draw


def _poll(done, limit_s: float) -> None:
    """Return once ``done()`` holds, or after ``limit_s`` (these waits are events with a hang cap)."""
    deadline = time.monotonic() + limit_s
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)


def _publish(path: str, text: str) -> None:
    """Write ``text`` to ``path`` whole: a watcher that sees the file never reads it empty or half written (the
    temporary name starts with a dot, so no watcher's pattern matches it)."""
    folder, name = os.path.split(path)
    temporary = os.path.join(folder, f".{name}.tmp")
    with open(temporary, "w") as handle:
        handle.write(text)
    os.replace(temporary, path)


def _progress_names(out: str) -> list[str]:
    folder = os.path.join(out, "progress")
    return os.listdir(folder) if os.path.isdir(folder) else []


def _first_generation_steps(out: str) -> list[int]:
    """The steps the first-generation processes' progress files (``r{rank}.g0`` = "pid step") show."""
    steps = []
    for name in _progress_names(out):
        if name.startswith("r") and name.endswith(".g0"):
            try:
                steps.append(int(open(os.path.join(out, "progress", name)).read().split()[1]))
            except (OSError, ValueError, IndexError):
                pass
    return steps


def _wait_for_peer_step(out: str, step: int, limit_s: float = 180.0) -> None:
    """Return once any first-generation process's progress file shows ``step`` (or after ``limit_s``)."""
    _poll(lambda: step <= 0 or max(_first_generation_steps(out), default=0) >= step, limit_s)


def _wait_for_restarted(out: str, limit_s: float = 300.0) -> None:
    """Return once a restarted process (generation >= 1) has published its PID, or after ``limit_s``."""
    _poll(lambda: any(n.startswith("pid") and not n.endswith(".g0") for n in _progress_names(out)), limit_s)


def _script_the_governor(script: list[tuple[int, list[int]]]) -> None:
    from hf_meshtune.anchor.mesh_governor import MeshGovernor

    measured = MeshGovernor.round

    def scripted(self, module, dense, dense_probe, run_pass, step):
        measured(self, module, dense, dense_probe, run_pass, step)
        self.decided = list(max((entry for entry in script if entry[0] <= step), key=lambda entry: entry[0])[1])
        return list(self.decided)

    MeshGovernor.round = scripted


def _die_while_saving(step: int, rank: int) -> None:
    """Make ``torch.save`` of ``rank``'s checkpoint state of ``step`` write half its bytes to whatever file
    the checkpoint code opened, fsync them, then SIGKILL this process: the kill lands inside the
    library's own write (every other save is untouched)."""
    real = torch.save

    def save(obj, f, *args, **kwargs):
        if not (isinstance(obj, dict) and obj.get("step") == step and obj.get("rank") == rank and "mesh" in obj):
            return real(obj, f, *args, **kwargs)
        buffer = io.BytesIO()
        real(obj, buffer, *args, **kwargs)
        data = buffer.getvalue()
        with open(f, "wb") as handle:
            handle.write(data[: len(data) // 2])
            handle.flush()
            os.fsync(handle.fileno())
        os.kill(os.getpid(), signal.SIGKILL)

    torch.save = save


def _die_in_sync(rank: int, sync: int) -> None:
    """SIGKILL this process as it enters its ``sync``-th DiLoCo all-reduce (counting from 1) when its
    mesh rank is ``rank``: its peers are already inside theirs, so it dies mid-sync."""
    import torchft.manager

    real, calls = torchft.manager.Manager.allreduce, [0]

    def allreduce(self, *args, **kwargs):
        calls[0] += 1
        if _mesh_rank() == rank and calls[0] >= sync:
            os.kill(os.getpid(), signal.SIGKILL)
        return real(self, *args, **kwargs)

    torchft.manager.Manager.allreduce = allreduce


def _mesh_rank() -> int:
    stages = int(os.environ["MESHTUNE_MESH"].lower().split("x")[1])
    return int(os.environ.get("MESHTUNE_REPLICA", "0")) * stages + int(os.environ["RANK"])


def main(out: str, steps: int, overrides: dict) -> None:
    torch.set_num_threads(1)
    kill_in_sync = os.environ.get("KILL_IN_SYNC")
    if kill_in_sync and os.environ.get("MESHTUNE_RESTART", "0") == "0":
        _die_in_sync(*(int(v) for v in kill_in_sync.split(":")))
    kill_during_save = os.environ.get("KILL_DURING_SAVE")
    if kill_during_save and os.environ.get("MESHTUNE_RESTART", "0") == "0":
        _die_while_saving(*(int(v) for v in kill_during_save.split(":")))
    if os.environ.get("GOVERNOR_SCRIPT"):
        _script_the_governor(json.loads(os.environ["GOVERNOR_SCRIPT"]))
    if int(os.environ.get("MESHTUNE_RESTART", "0")) > 0:
        time.sleep(float(os.environ.get("RESTART_DELAY_S", "0")))
        _wait_for_peer_step(out, int(os.environ.get("RESTART_AFTER_STEP", "0")))
    guard = guard_launched_process()  # with a secret: admission at the gate, every listener guarded
    gloo_interface()  # what MeshTrainingArguments does in a launched process: gloo and the rendezvous store
    serve_rendezvous_store()  # on $MESHTUNE_HOST's interface and MASTER_ADDR, never every interface
    if guard is not None:
        guard.scan()
    dist.init_process_group("gloo")
    model = tiny_llama(seed=0, layers=4, hidden=64)
    stages = int(os.environ["MESHTUNE_MESH"].lower().split("x")[1])
    cfg = MeshConfig(num_stages=stages, **{**CONFIG, **overrides})
    topology = MeshTopology.from_environment(
        dist.get_world_size(), stages, cfg.anchor, len(find_decoder_layers(model)[1])
    )
    timeout = float(os.environ.get("LINK_TIMEOUT_S", "30"))
    groups = topology.build_groups(timeout_s=timeout)
    rank, restart = groups.rank, os.environ.get("MESHTUNE_RESTART", "0")
    os.makedirs(os.path.join(out, "progress"), exist_ok=True)
    _publish(os.path.join(out, "progress", f"pid{rank}.g{restart}"), str(os.getpid()))  # every role, e.g. the anchor
    pace = float(os.environ.get("STEP_SECONDS", "0"))
    hold_at = int(os.environ.get("HOLD_FOR_RESTART_AT", "0"))

    class Progress(StageCallback):
        def on_step_end(self, view) -> None:
            _publish(os.path.join(out, "progress", f"r{rank}.g{restart}"), f"{os.getpid()} {view.step}")
            with open(os.path.join(out, "progress", f"t{rank}.g{restart}"), "a") as handle:  # the timeline
                handle.write(f"{view.step} {time.time():.3f}\n")
            if pace:
                time.sleep(pace)
            if hold_at and view.step == hold_at and restart == "0":
                _wait_for_restarted(out)

    recorder = ParameterRecorder()

    every = os.environ.get("CHECKPOINT_EVERY")
    keep = os.environ.get("CHECKPOINT_KEEP")
    settings = RunSettings(
        config=cfg,
        microbatch_size=MICRO,
        microbatches=MICROBATCHES,
        seq_len=SEQ,
        max_steps=steps,
        lr=3e-3,
        lighthouse=os.environ["TORCHFT_LIGHTHOUSE"],
        dp_timeout_s=float(os.environ.get("DP_TIMEOUT_S", "30")),
        link_timeout_s=timeout,
        callbacks=[Progress(), recorder],
        checkpoint_dir=out,
        checkpoint_every=int(every) if every else None,
        checkpoint_keep=int(keep) if keep else None,
        resume_from=os.environ.get("RESUME_FROM") or None,
    )
    result = run_worker(model, groups, settings, batches(groups.replica), batches(99))
    torch.save(recorder.record(result), os.path.join(out, f"result{rank}.pt"))
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), json.loads(sys.argv[3]) if len(sys.argv) > 3 else {})
