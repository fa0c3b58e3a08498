"""DP sync: Streaming DiLoCo + PowerSGD on torchft (multi-process gloo on loopback) and its pure math.

Two real runs are shared by the multi-process tests (module fixtures): 3 fast replicas × 1 stage with
PowerSGD and τ = 1 (each sync's Q all-reduce overlaps one inner step), and 2 replicas × 2 stages with
dense averaging and τ = 0. Each process trains its stage on its own data
with a local loss (the DP sync does not care where the gradients come from) and records its parameters
around every inner step, every ``OuterUpdate`` and the ``Wire`` counters at each sync.
"""

from __future__ import annotations

import io
import math
import os
import subprocess

import pytest
import torch
from torch import nn

from hf_meshtune.anchor.follower import OuterFollower
from hf_meshtune.comm.listen import DP_HOST_ENV
from hf_meshtune.comm.wire import Wire
from hf_meshtune.dp.diloco import StreamingDiLoCo
from hf_meshtune.dp.ft import host_replica_store, make_manager, start_lighthouse
from hf_meshtune.dp.outer import OuterUpdate, outer_optimizer
from hf_meshtune.dp.powersgd import PowerSGD, decode, power_iteration
from hf_meshtune.ledger import dp_payload_numel
from tests.distributed import launch  # the shared launcher; module fixtures cannot take `launcher`

LR, MU = 0.7, 0.9
SYNC_EVERY, FRAGMENTS, STEPS = 4, 2, 8  # a fragment syncs every 2 inner steps: 0 at 2, 1 at 4, 0 at 6, 1 at 8
RANK = 2


def _model(stage: int) -> nn.Sequential:
    """Stage ``stage``'s module, identical on every replica; stages differ in their init only."""
    torch.manual_seed(100 + stage)
    # shapes cover every case: [32,16] and [16,32] compressed at r=2, [2,16] dense (36 > 32), biases dense
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 16), nn.Tanh(), nn.Linear(16, 2))


def _fragments(model: nn.Sequential) -> list[nn.Module]:
    return [model[:2], model[2:]]


def _flat(fragments: list[nn.Module]) -> list[list[torch.Tensor]]:
    return [[p.detach().clone() for p in f.parameters()] for f in fragments]


def _train_stage(
    rank: int,
    world: int,
    lighthouse: str,
    num_stages: int,
    powersgd_rank: int | None,
    delay: int,
    keep: bool = False,
    sync_every: int = SYNC_EVERY,
    steps: int = STEPS,
    quantize: str | None = None,
    dp_hosts: bool = False,
) -> bytes:
    replica, stage = divmod(rank, num_stages)
    if dp_hosts:  # each process's DiLoCo pairs on an address of its own (the launcher's children: own env)
        os.environ[DP_HOST_ENV] = _dp_host(rank)
    store = host_replica_store(replica, stage, host="127.0.0.1")
    manager = make_manager(
        replica=replica,
        stage=stage,
        num_stages=num_stages,
        lighthouse_addr=lighthouse,
        store_addr=store.addr,
        store_port=store.port,
        timeout_s=20.0,
    )
    model = _model(stage)
    fragments = _fragments(model)
    inner = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1000 * replica + stage)  # every replica and stage: its own data
    wire, record = Wire(), {"init": _flat(fragments), "pre": [], "post": [], "syncs": [], "sync_states": []}
    record["names"] = [[n for n, _ in f.named_parameters()] for f in fragments]
    record["finished"] = []  # (inner step since the last sync, fragment) where P's all-reduces were waited
    inner.register_step_post_hook(lambda *_: record["pre"].append(_flat(fragments)))  # runs before DiLoCo's hook

    def on_update(update: OuterUpdate) -> None:
        record["syncs"].append(
            {
                "step": len(record["pre"]),
                "update": update,
                "handed": wire.handed["dp"],
                "booked": wire.booked["dp"],
                "sent": wire.sent["dp"],
                "messages": wire.messages["dp"],
            }
        )

    diloco = StreamingDiLoCo(
        manager,
        fragments,
        inner,
        sync_every=sync_every,
        fragment_sync_delay=delay,
        keep_overlapped=keep,
        outer_lr=LR,
        outer_momentum=MU,
        powersgd_rank=powersgd_rank,
        quantize=quantize,
        wire=wire,
        on_outer_update=on_update,
    )
    for fragment in diloco._diloco._fragments:
        finish = fragment.finish_factors

        def finish_and_record(fragment=fragment, finish=finish) -> None:
            if fragment._pending:
                record["finished"].append((diloco._diloco._local_step, fragment._fragment_id))
            finish()

        fragment.finish_factors = finish_and_record
    with diloco:
        for _ in range(steps):
            x = torch.randn(8, 16, generator=gen)
            loss = (model(x) - x[:, :2].sin()).pow(2).mean()
            loss.backward()
            inner.step()
            inner.zero_grad()
            record["post"].append(_flat(fragments))
            record.setdefault("dp_messages", []).append(wire.messages["dp"])  # all-reduces issued so far
            # what fast replica 0 sends a rejoining anchor (a SYNC), with the number of syncs it already holds
            record["sync_states"].append((len(record["syncs"]), diloco.sync_tensors()))
    record["global"] = [diloco.global_parameters(i) for i in range(FRAGMENTS)]
    record["connections"] = _established()  # the DP group's pairs are still connected here
    record["shapes"] = [[tuple(p.shape) for p in f.parameters()] for f in fragments]
    manager.shutdown(wait=False)
    torch.distributed.barrier()  # stage 0 hosts its replica's store: nobody leaves before all are done
    return _pack(record)


def _dp_host(rank: int) -> str:
    return f"127.0.0.{2 + rank}"


def _established() -> list[tuple[str, str]]:
    """(local, remote) address of every established TCP socket of this network namespace, as the kernel reports
    them over netlink (``ss``; /proc/net/tcp misses sockets on some kernels here)."""
    out = subprocess.run(["ss", "-Htn", "state", "established"], capture_output=True, text=True, check=True).stdout
    return [tuple(end.rsplit(":", 1)[0].strip("[]") for end in line.split()[2:4]) for line in out.splitlines()]


def _pack(record: dict) -> bytes:
    """Tensors as bytes: tensors put on a multiprocessing queue travel as shared-memory handles that die
    with the child process, which may exit before the parent has read them."""
    buffer = io.BytesIO()
    torch.save(record, buffer)
    return buffer.getvalue()


def _run(
    launcher, replicas: int, stages: int, powersgd_rank: int | None, delay: int, *extra: object
) -> list[list[dict]]:
    server, address = start_lighthouse(min_replicas=replicas)
    try:
        results = launcher(_train_stage, replicas * stages, address, stages, powersgd_rank, delay, *extra, timeout=120)
    finally:
        server.shutdown()
    records = [torch.load(io.BytesIO(r), weights_only=False) for r in results]
    return [records[r * stages : (r + 1) * stages] for r in range(replicas)]  # [replica][stage]


@pytest.fixture(scope="module")
def powersgd_run():
    return [by_stage[0] for by_stage in _run(launch, replicas=3, stages=1, powersgd_rank=RANK, delay=1)]


@pytest.fixture(scope="module")
def dense_run():
    return _run(launch, replicas=2, stages=2, powersgd_rank=None, delay=0)


OVERLAP_EVERY, OVERLAP_DELAY, OVERLAP_STEPS = 6, 2, 12  # a fragment syncs every 3 steps, prepared 2 before


@pytest.fixture(scope="module")
def overlap_run():
    """3 replicas × 1 stage, PowerSGD, τ = 2 with the overlapped steps kept: P is waited 1 step after the
    prepare, Q the step after."""
    runs = _run(launch, 3, 1, RANK, OVERLAP_DELAY, True, OVERLAP_EVERY, OVERLAP_STEPS)
    return [by_stage[0] for by_stage in runs]


@pytest.fixture(scope="module")
def int8_run():
    """3 replicas × 1 stage, int8 pseudo-gradients (no PowerSGD), τ = 1: each sync's codes overlap one step; each
    process's DiLoCo pairs on an address of its own ($MESHTUNE_DP_HOST = 127.0.0.2, .3, .4)."""
    return [by_stage[0] for by_stage in _run(launch, 3, 1, None, 1, False, SYNC_EVERY, STEPS, "int8", True)]


@pytest.fixture(scope="module")
def powersgd_int8_run():
    """3 replicas × 1 stage, PowerSGD r = 2 with int8 codes on every all-reduce, τ = 1."""
    return [by_stage[0] for by_stage in _run(launch, 3, 1, RANK, 1, False, SYNC_EVERY, STEPS, "int8")]


def _int8_mean(tensors: list[list[torch.Tensor]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """One int8 round over replicas, transcribed from ``dp.quantize`` in float32 (the codes must come out the
    same): each replica's tensors flattened into blocks, coded under the blocks' max over replicas, summed.
    Returns the decoded mean (float32, each tensor's shape) and each replica's flat error M − q·s/L."""
    from hf_meshtune.dp.quantize import BLOCK

    n = len(tensors)
    top = 127 // n
    flats = [torch.cat([t.reshape(-1) for t in replica]) for replica in tensors]
    size = flats[0].numel()
    blocks = [torch.nn.functional.pad(f, (0, (-size) % BLOCK)).view(-1, BLOCK) for f in flats]
    scale = torch.stack([b.abs().amax(1) for b in blocks]).amax(0).unsqueeze(1)
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = [torch.round(b * (top / safe)).clamp(-top, top) for b in blocks]
    total = torch.stack(codes).sum(0)
    assert total.abs().max() <= 127  # the sum fits int8
    mean = (total * (scale / (n * top))).reshape(-1)
    errors = [(b - q * (safe / top)).reshape(-1)[:size] for b, q in zip(blocks, codes)]
    out, start = [], 0
    for t in tensors[0]:
        out.append(mean[start : start + t.numel()].view(t.shape))
        start += t.numel()
    return out, errors


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return all(torch.equal(x, y) for x, y in zip(a, b))


# ---------------------------------------------------------------------------------------------
# 1. staggered fragments: after fragment f's sync only fragment f is equal across replicas
# ---------------------------------------------------------------------------------------------


def test_synced_fragment_is_identical_across_replicas_and_only_it(powersgd_run):
    syncs = powersgd_run[0]["syncs"]
    assert [(s["update"].fragment, s["step"]) for s in syncs] == [(0, 2), (1, 4), (0, 6), (1, 8)]
    assert [s["update"].step for s in syncs] == [1, 2, 3, 4]  # manager step after each commit
    for sync in syncs:
        after = [run["post"][sync["step"] - 1] for run in powersgd_run]
        synced, other = sync["update"].fragment, 1 - sync["update"].fragment
        assert all(_equal(after[0][synced], a[synced]) for a in after[1:])
        assert not any(_equal(after[0][other], a[other]) for a in after[1:])
    assert all(_equal(powersgd_run[0]["global"][f], run["global"][f]) for run in powersgd_run for f in (0, 1))


# ---------------------------------------------------------------------------------------------
# 2. compression off: the outer step is Nesterov SGD on the plain mean of θ_global − θ_local
# ---------------------------------------------------------------------------------------------


def _nesterov_replay(runs: list[dict]) -> None:
    """Replay every sync in float64 from the replicas' pre-sync params; compare with what they hold after."""
    global_ = [[t.double() for t in frag] for frag in runs[0]["init"]]
    momentum: list = [None] * FRAGMENTS
    for sync in runs[0]["syncs"]:
        f, k = sync["update"].fragment, sync["step"]
        deltas = [
            torch.stack([g - run["pre"][k - 1][f][i].double() for run in runs]).mean(0)
            for i, g in enumerate(global_[f])
        ]
        momentum[f] = deltas if momentum[f] is None else [MU * b + d for b, d in zip(momentum[f], deltas)]
        global_[f] = [g - LR * (d + MU * b) for g, d, b in zip(global_[f], deltas, momentum[f])]
        for run in runs:
            for got, want in zip(run["post"][k - 1][f], global_[f]):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)


def test_dense_sync_equals_outer_nesterov_step_on_mean_pseudo_gradient(dense_run):
    for stage in range(2):
        runs = [by_stage[stage] for by_stage in dense_run]
        assert [s["step"] for s in runs[0]["syncs"]] == [2, 4, 6, 8]
        _nesterov_replay(runs)


def test_an_overlapped_powersgd_sync_keeps_its_steps_and_matches_a_float64_replay(overlap_run):
    """τ = 2, overlapped steps kept: each sync's pseudo-gradient is θ_global − θ_local at the prepare, sent
    as PowerSGD (error feedback, warm-started Q) and replayed here in float64 from the recorded parameters;
    after the outer step each replica holds the new θ_global plus its own 2 overlapped steps. The P
    all-reduces were waited 1 inner step after the prepare, not at it."""
    runs, interval = overlap_run, OVERLAP_EVERY // FRAGMENTS
    syncs = runs[0]["syncs"]
    assert [(s["update"].fragment, s["step"]) for s in syncs] == [(0, 3), (1, 6), (0, 9), (1, 12)]
    finish_step = interval - OVERLAP_DELAY + OVERLAP_DELAY // 2
    assert all(run["finished"] == [(finish_step, f) for f in (0, 1, 0, 1)] for run in runs)
    codec = PowerSGD(RANK, seed=0)  # StreamingDiLoCo's seed: the Q every round of a matrix starts from
    global_ = [[t.double() for t in frag] for frag in runs[0]["init"]]
    momentum: list = [None] * FRAGMENTS
    q: dict = {}
    error: dict = {}
    for sync in syncs:
        f, k = sync["update"].fragment, sync["step"]
        prepared = [run["pre"][k - OVERLAP_DELAY - 1][f] for run in runs]  # θ_local at the prepare
        deltas = []
        for i, (g, name) in enumerate(zip(global_[f], runs[0]["names"][f])):
            ms = [g - prep[i].double() for prep in prepared]
            if not codec.compresses(g.shape):
                deltas.append(torch.stack(ms).mean(0))
                continue
            key = f"{f}.{name}"
            q.setdefault(key, codec.factor_q(key, g.shape).double())
            ms = [m + e for m, e in zip(ms, error.get(key, [0.0] * len(ms)))]
            p_hat = torch.linalg.qr(torch.stack([m @ q[key] for m in ms]).mean(0))[0]
            q[key] = torch.stack([m.T @ p_hat for m in ms]).mean(0)
            approx = p_hat @ q[key].T
            error[key] = [m - approx for m in ms]
            deltas.append(approx)
        momentum[f] = deltas if momentum[f] is None else [MU * b + d for b, d in zip(momentum[f], deltas)]
        global_[f] = [g - LR * (d + MU * b) for g, d, b in zip(global_[f], deltas, momentum[f])]
        for run, prep in zip(runs, prepared):
            kept = [now.double() - before.double() for now, before in zip(run["pre"][k - 1][f], prep)]
            assert all(d.abs().max() > 0 for d in kept)  # the 2 overlapped steps did move the fragment
            for got, want, step in zip(run["post"][k - 1][f], global_[f], kept):
                torch.testing.assert_close(got.double(), want + step, rtol=0, atol=1e-5)
    for run in runs:
        for f in range(FRAGMENTS):
            for got, want in zip(run["global"][f], global_[f]):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_an_int8_sync_matches_a_replay_of_shared_scales_int8_sums_and_error_feedback(int8_run):
    """Each replica's M = θ_global − θ_local (at the prepare, τ = 1 step before the sync) + e is coded per block
    of 256 values with the block's max |M| over the replicas, q = round(M·L/s), L = ⌊127/3⌋; the codes
    are summed in int8 and the average Σq·s/(3L) takes the outer Nesterov step; e ← M − q·s/L. The codes
    are transcribed in float32, as the library computes them (a float64 M could round a code the other
    way); the average, the outer step and the parameters are compared in float64."""
    from hf_meshtune.dp.quantize import BLOCK

    runs, top = int8_run, 127 // 3
    syncs = runs[0]["syncs"]
    assert [(s["update"].fragment, s["step"]) for s in syncs] == [(0, 2), (1, 4), (0, 6), (1, 8)]
    global32 = [list(frag) for frag in runs[0]["init"]]  # θ_global in float32, as the replicas hold it
    global_ = [[t.double() for t in frag] for frag in runs[0]["init"]]
    momentum: list = [None] * FRAGMENTS
    error: list = [[None] * len(runs) for _ in range(FRAGMENTS)]
    for sync in syncs:
        f, k = sync["update"].fragment, sync["step"]
        ms = []
        for r, run in enumerate(runs):
            m = torch.cat([(g - p).reshape(-1) for g, p in zip(global32[f], run["pre"][k - 2][f])])
            ms.append(m if error[f][r] is None else m + error[f][r])
        pad = (-ms[0].numel()) % BLOCK
        blocks = [torch.nn.functional.pad(m, (0, pad)).view(-1, BLOCK) for m in ms]
        scale = torch.stack([b.abs().amax(1) for b in blocks]).amax(0).unsqueeze(1)
        codes = [torch.round(b * (top / scale)).clamp(-top, top) for b in blocks]
        total = torch.stack(codes).sum(0)
        assert total.abs().max() <= 127  # the sum fits int8
        error[f] = [(b - q * (scale / top)).reshape(-1)[: ms[0].numel()] for b, q in zip(blocks, codes)]
        mean = (total.double() * scale.double() / (3 * top)).reshape(-1)
        deltas, start = [], 0
        for g in global_[f]:
            deltas.append(mean[start : start + g.numel()].view(g.shape))
            start += g.numel()
        for got, want in zip(sync["update"].tensors, deltas):  # the averaged pseudo-gradients the anchor gets
            torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-7)
        exact = [
            torch.stack([g - run["pre"][k - 2][f][i].double() for run in runs]).mean(0)
            for i, g in enumerate(global_[f])
        ]
        assert all((d - e).abs().max() <= scale.max() / top for d, e in zip(deltas, exact))  # within a code step
        momentum[f] = deltas if momentum[f] is None else [MU * b + d for b, d in zip(momentum[f], deltas)]
        global_[f] = [g - LR * (d + MU * b) for g, d, b in zip(global_[f], deltas, momentum[f])]
        for run in runs:  # α = 0: the fragment restarts from the new θ_global
            for got, want in zip(run["post"][k - 1][f], global_[f]):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-6)
        global32[f] = list(runs[0]["post"][k - 1][f])


def test_powersgd_with_int8_codes_matches_a_float32_transcription(powersgd_int8_run):
    """PowerSGD's P factors go as int8 codes with the dense tensors (these with their own error feedback), the
    Q factors as a second int8 round, from orth(P̄) decoded; PowerSGD's error feedback is taken on the decoded
    P̄·Q̄ᵀ, so what the factors' codes left out is sent later. Replayed in float32 as the library computes it;
    the outer Nesterov step and the parameters in float64."""
    runs = powersgd_int8_run
    codec = PowerSGD(RANK, seed=0)
    syncs = runs[0]["syncs"]
    assert [(s["update"].fragment, s["step"]) for s in syncs] == [(0, 2), (1, 4), (0, 6), (1, 8)]
    global32 = [list(frag) for frag in runs[0]["init"]]
    global_ = [[t.double() for t in frag] for frag in runs[0]["init"]]
    momentum: list = [None] * FRAGMENTS
    q: dict = {}
    power_error: dict = {}  # (replica, key) → PowerSGD's e
    int8_error: dict = {}  # (replica, fragment) → the dense tensors' flat e
    for sync in syncs:
        f, k = sync["update"].fragment, sync["step"]
        names, shapes = runs[0]["names"][f], [g.shape for g in global32[f]]
        compressed = [codec.compresses(shape) for shape in shapes]
        ms = []
        for r, run in enumerate(runs):
            deltas = [g - p for g, p in zip(global32[f], run["pre"][k - 2][f])]
            dense_error = int8_error.get((r, f))
            m_r, start = [], 0
            for name, delta, packed in zip(names, deltas, compressed):
                if packed:
                    m_r.append(delta + power_error[(r, f"{f}.{name}")] if (r, f"{f}.{name}") in power_error else delta)
                else:
                    e = None if dense_error is None else dense_error[start : start + delta.numel()].view(delta.shape)
                    m_r.append(delta if e is None else delta + e)
                    start += delta.numel()
            ms.append(m_r)
        for name, shape, packed in zip(names, shapes, compressed):
            if packed:
                q.setdefault(f"{f}.{name}", codec.factor_q(f"{f}.{name}", shape))
        first = [
            [m @ q[f"{f}.{name}"] if packed else m for name, m, packed in zip(names, m_r, compressed)] for m_r in ms
        ]
        averaged, errors = _int8_mean(first)
        for r in range(len(runs)):  # the dense tensors' error feedback: their part of the flat error
            parts, start = [], 0
            for t, packed in zip(first[r], compressed):
                if not packed:
                    parts.append(errors[r][start : start + t.numel()])
                start += t.numel()
            int8_error[(r, f)] = torch.cat(parts)
        orth = {
            name: torch.linalg.qr(p, mode="reduced").Q for name, p, packed in zip(names, averaged, compressed) if packed
        }
        packed_names = [name for name, packed in zip(names, compressed) if packed]
        q_bar, _ = _int8_mean(
            [[ms[r][names.index(name)].T @ orth[name] for name in packed_names] for r in range(len(runs))]
        )
        deltas = []
        for name, average, packed in zip(names, averaged, compressed):
            if not packed:
                deltas.append(average.double())
                continue
            q_new = q_bar[packed_names.index(name)]
            approx = orth[name] @ q_new.T
            for r in range(len(runs)):
                power_error[(r, f"{f}.{name}")] = ms[r][names.index(name)] - approx
            q[f"{f}.{name}"] = q_new
            deltas.append(approx.double())
        exact = [
            torch.stack([g - run["pre"][k - 2][f][i].double() for run in runs]).mean(0)
            for i, g in enumerate(global_[f])
        ]
        assert any((d - e).abs().max() > 1e-6 for d, e in zip(deltas, exact))  # compressed: not the exact mean
        momentum[f] = deltas if momentum[f] is None else [MU * b + d for b, d in zip(momentum[f], deltas)]
        global_[f] = [g - LR * (d + MU * b) for g, d, b in zip(global_[f], deltas, momentum[f])]
        for run in runs:
            for got, want in zip(run["post"][k - 1][f], global_[f]):
                torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
        global32[f] = list(runs[0]["post"][k - 1][f])


def test_powersgd_with_int8_codes_sends_factors_and_dense_tensors_as_bytes_in_four_all_reduces(powersgd_int8_run):
    from hf_meshtune.dp.quantize import BLOCK

    for run in powersgd_int8_run:
        before = {"handed": 0, "messages": 0}
        for sync in run["syncs"]:
            shapes = run["shapes"][sync["update"].fragment]
            packed = [s for s in shapes if len(s) == 2 and RANK * sum(s) < math.prod(s)]
            dense = sum(math.prod(s) for s in shapes if s not in packed)
            rounds = (sum(RANK * s[0] for s in packed) + dense, sum(RANK * s[1] for s in packed))  # P + dense, Q
            blocks = [-(-size // BLOCK) for size in rounds]
            assert sync["handed"] - before["handed"] == sum(b * BLOCK + 4 * b for b in blocks)  # codes + maxima
            # the first round's maxima and codes, then the Q factors' maxima and codes
            assert sync["messages"] - before["messages"] == 4
            # the first round's codes leave with the maxima in the step that prepares the sync (τ = 1 step before
            # it commits), so they travel while the overlapped step runs
            assert run["dp_messages"][sync["step"] - 2] - before["messages"] == 2
            before = sync


def test_the_diloco_pairs_connect_the_addresses_meshtune_dp_host_names(int8_run):
    """Every pair of replicas' DP group is connected at an address $MESHTUNE_DP_HOST names: what a network filter
    on those addresses needs to tell the sync's traffic from the pipeline's (the sync's math: the int8 tests).
    On loopback the connecting end's source is 127.0.0.1 whatever it binds, so the check is the listening end:
    one socket at a DP address per pair of replicas; with the variable ignored there would be none."""
    hosts = {_dp_host(r) for r in range(len(int8_run))}
    seen = int8_run[0]["connections"]  # one network namespace: every process sees every connection
    at_dp = [(local, remote) for local, remote in seen if local in hosts]
    assert len(at_dp) == len(hosts) * (len(hosts) - 1) // 2, seen


def test_an_int8_sync_sends_a_byte_per_value_and_four_per_block_in_two_all_reduces(int8_run):
    from hf_meshtune.dp.quantize import BLOCK

    n = len(int8_run)
    for run in int8_run:
        before = {"handed": 0, "booked": 0, "messages": 0}
        for sync in run["syncs"]:
            numel = sum(math.prod(s) for s in run["shapes"][sync["update"].fragment])
            blocks = -(-numel // BLOCK)
            assert sync["handed"] - before["handed"] == blocks * BLOCK + 4 * blocks  # int8 codes, float32 maxima
            assert sync["booked"] - before["booked"] == pytest.approx((blocks * BLOCK + 4 * blocks) * 2 * (n - 1) / n)
            assert sync["messages"] - before["messages"] == 2  # the block maxima (MAX), then the codes (SUM)
            before = sync


def test_int8_codes_sum_inside_int8_and_error_feedback_keeps_the_running_mean_within_a_step():
    """Three replicas with fixed pseudo-gradients: the codes of each sync sum inside int8 even at the block
    maximum, and over 50 syncs the mean of the decoded averages converges on the true mean (error feedback:
    the total misses it by less than one code step, where rounding without it would drift 50×)."""
    from hf_meshtune.dp.quantize import Int8Sum, levels

    gen = torch.Generator().manual_seed(0)
    deltas = [torch.randn(300, generator=gen) * (r + 1) for r in range(3)]
    deltas[2][7] = 50.0  # one block's maximum, on one replica only
    coders = [Int8Sum(block=128) for _ in range(3)]
    true_mean = torch.stack(deltas).double().mean(0)
    total = torch.zeros(300, dtype=torch.float64)
    rounds = 50
    for _ in range(rounds):
        maxima = torch.stack([c.start([("w", d)]) for c, d in zip(coders, deltas)]).amax(0)
        codes = [c.codes(maxima, 3) for c in coders]
        wide = torch.stack([q.int() for q in codes]).sum(0)
        assert wide.abs().max() <= 127 and torch.equal(torch.stack(codes).sum(0, dtype=torch.int8).int(), wide)
        (avg,) = coders[0].decode(wide.to(torch.int8), maxima)
        total += avg.double()
        for c in coders:
            c.commit()
    step = maxima.double().repeat_interleave(128)[:300] / (3 * levels(3))
    assert ((total - rounds * true_mean).abs() <= 3 * step).all()
    assert (total / rounds - true_mean).abs().max() < 0.05 * step.max()
    with pytest.raises(ValueError, match=r"participants=128 is invalid: it must lie in \[1, 127\]"):
        levels(128)


# ---------------------------------------------------------------------------------------------
# 3. bytes: r·(m+n) per compressed matrix, numel otherwise, 4 bytes each; ring factor booked
# ---------------------------------------------------------------------------------------------


def test_powersgd_bytes_per_sync_match_rank(powersgd_run):
    n = len(powersgd_run)
    for run in powersgd_run:
        before = {"handed": 0, "booked": 0, "messages": 0}
        for sync in run["syncs"]:
            shapes = run["shapes"][sync["update"].fragment]
            payload = sum(
                RANK * (s[0] + s[1]) if len(s) == 2 and RANK * (s[0] + s[1]) < math.prod(s) else math.prod(s)
                for s in shapes
            )
            assert payload == sum(dp_payload_numel(s, RANK) for s in shapes)  # the ledger's rule
            compressed = sum(1 for s in shapes if len(s) == 2 and RANK * sum(s) < math.prod(s))
            assert sync["handed"] - before["handed"] == payload * 4
            # the tensors handed to the all-reduce are counted; the ring's traffic is booked on them
            assert sync["booked"] - before["booked"] == pytest.approx(payload * 4 * 2 * (n - 1) / n)
            assert sync["sent"] == 0  # DP sends nothing point to point
            # one bucket: the P factors with the dense tensors; then one: the Q factors
            assert sync["messages"] - before["messages"] == (2 if compressed else 1)
            before = sync
    assert [len(run["shapes"][0]) for run in powersgd_run] == [2] * n


def test_the_p_round_gets_the_overlapped_steps_in_proportion_to_its_values():
    from hf_meshtune.dp.diloco import p_round_steps

    tall, wide = nn.Linear(256, 4096, bias=False), nn.Linear(1024, 256, bias=False)  # weights [4096,256], [256,1024]
    codec = PowerSGD(128, 0)
    assert codec.compresses(tall.weight.shape) and codec.compresses(wide.weight.shape)
    # P + dense : Q values, by hand: tall 4096·128 : 256·128 (P 94 %); wide 256·128 : 1024·128 (P 20 %)
    assert [p_round_steps([tall], codec, tau) for tau in (0, 1, 2, 5, 9)] == [0, 1, 1, 4, 8]  # Q keeps one step
    assert [p_round_steps([wide], codec, tau) for tau in (2, 5, 9)] == [1, 1, 2]  # round(9 · 0.2) = 2
    both = nn.Sequential(tall, nn.LayerNorm(256), wide)  # (524,288 + 512 + 32,768) : (32,768 + 131,072)
    assert p_round_steps([both[:2], both[2:]], codec, 5) == round(5 * 557_568 / 721_408)


def test_buckets_flatten_runs_of_one_dtype_up_to_the_cap_and_average_every_view_in_place(monkeypatch):
    from hf_meshtune.dp.diloco import fragment as diloco

    monkeypatch.setattr(diloco, "BUCKET_BYTES", 64)  # 16 float32 numbers
    a, b, c = torch.ones(2, 3), torch.full((4,), 2.0), torch.full((3,), 3.0, dtype=torch.float64)
    big, d = torch.arange(20.0), torch.full((2, 2), 4.0)
    buckets = diloco._buckets([("a", a), ("b", b), ("c", c), ("big", big), ("d", d)])
    assert [[key for key, _ in views] for _, views in buckets] == [["a", "b"], ["c"], ["big"], ["d"]]
    (ab, ab_views), (c_flat, _), (big_flat, _), _ = buckets
    assert ab.shape == (10,) and c_flat is c and big_flat is big  # a tensor alone goes uncopied
    assert [tuple(v.shape) for _, v in ab_views] == [(2, 3), (4,)]
    ab.div_(2)  # what an all-reduce's average does in place
    assert torch.equal(ab_views[0][1], a / 2) and torch.equal(ab_views[1][1], b / 2)
    assert diloco._buckets([]) == []


# ---------------------------------------------------------------------------------------------
# 4. PowerSGD math against a float64 transcription (one process, no torchft)
# ---------------------------------------------------------------------------------------------


def _reference_round(m: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """PowerSGD (Vogels et al., Alg. 1) in float64, one replica: P = MQ, P̂ = orth(P), Q = MᵀP̂, M̂ = P̂Qᵀ."""
    p, _ = torch.linalg.qr(m @ q)
    return p @ (m.T @ p).T


def test_powersgd_round_with_error_feedback_matches_float64_reference():
    gen = torch.Generator().manual_seed(3)
    grads = [torch.randn(12, 10, generator=gen) for _ in range(3)]
    codec = PowerSGD(rank=2, seed=5)
    assert torch.equal(codec.factor_q("w", (12, 10)), PowerSGD(rank=2, seed=5).factor_q("w", (12, 10)))
    q, error, total = codec.factor_q("w", (12, 10)).double(), torch.zeros(12, 10, dtype=torch.float64), 0
    for g in grads:
        approx = codec.round("w", g)
        m = g.double() + error
        want = _reference_round(m, q)
        torch.testing.assert_close(approx.double(), want, rtol=1e-5, atol=1e-5)
        q = m.T @ torch.linalg.qr(m @ q)[0]  # warm start from the averaged Q
        error = m - want
        torch.testing.assert_close(codec.error["w"].double(), error, rtol=1e-5, atol=1e-5)
        total = total + approx.double()
    # error feedback loses nothing: what was sent plus what is still owed equals what was produced
    torch.testing.assert_close(total + codec.error["w"].double(), sum(g.double() for g in grads), rtol=0, atol=1e-4)


def test_a_consumed_pseudo_gradient_becomes_m_in_place_with_the_same_rounds():
    """``consume=True`` (torchft's own pseudo-gradient) turns Δ into M = Δ + e in place and e ← M − Δ̂ reuses
    M: three rounds give bitwise the factors and errors of the copying path, with no new M or e storage."""
    gen = torch.Generator().manual_seed(3)
    deltas = [torch.randn(12, 10, generator=gen) for _ in range(3)]
    copying, consuming = PowerSGD(2, seed=1), PowerSGD(2, seed=1)
    for delta in deltas:
        mine, before = delta.clone(), delta.clone()
        p_ref, p = copying.p_factor("w", delta), consuming.p_factor("w", mine, consume=True)
        assert torch.equal(p, p_ref) and torch.equal(delta, before)  # the copy path reads only
        assert consuming._m["w"].data_ptr() == mine.data_ptr()  # M is the consumed tensor
        (p_ref, q_ref), (p, q) = copying.q_factor("w", p_ref), consuming.q_factor("w", p)
        assert torch.equal(q, q_ref)
        copying.commit("w", decode(p_ref, q_ref), q_ref)
        consuming.commit("w", decode(p, q), q)
        assert (
            torch.equal(consuming.error["w"], copying.error["w"]) and consuming.error["w"].data_ptr() == mine.data_ptr()
        )
    bf16 = PowerSGD(2, seed=1)
    half = deltas[0].to(torch.bfloat16)
    bf16.p_factor("w", half, consume=True)
    assert bf16._m["w"].dtype == torch.float32 and bf16._m["w"].data_ptr() != half.data_ptr()  # M stays float32


def test_powersgd_full_rank_reconstructs_and_small_shapes_go_dense():
    gen = torch.Generator().manual_seed(4)
    m = torch.randn(6, 4, generator=gen)
    p, q = power_iteration(m, torch.randn(4, 4, generator=gen))  # r = min(m, n)
    torch.testing.assert_close(decode(p, q), m, rtol=1e-5, atol=1e-5)
    codec = PowerSGD(rank=4)
    assert not codec.compresses((6, 4)) and not codec.compresses((24,)) and codec.compresses((40, 30))
    assert torch.equal(codec.round("m", m), m) and codec.error == {}


def test_outer_update_decodes_factors_and_passes_dense_through():
    p, q, b = torch.randn(40, 2), torch.randn(30, 2), torch.randn(30)
    update = OuterUpdate(fragment=0, step=1, tensors=[p, q, b], rank=2)
    grad, bias = update.pseudo_gradients([(40, 30), (30,)])
    assert torch.equal(grad, p @ q.T) and bias is b
    with pytest.raises(ValueError, match=r"shapes=\[\(40, 30\)\] is invalid: it must describe all 3 tensors"):
        update.pseudo_gradients([(40, 30)])


@pytest.mark.parametrize("momentum", [0.0, 0.9])
def test_outer_optimizer_steps_by_hand_with_and_without_momentum(momentum):
    """dp_outer_momentum lies in [0, 1): 0 is plain SGD on the pseudo-gradient (torch refuses Nesterov
    without momentum), above it the Nesterov step θ -= η (Δ + μ b), b = μ b + Δ."""
    theta = nn.Parameter(torch.randn(5, 3, dtype=torch.float64))
    start, deltas = theta.detach().clone(), [torch.randn(5, 3, dtype=torch.float64) for _ in range(3)]
    opt = outer_optimizer([theta], lr=0.7, momentum=momentum)
    want, buf = start.clone(), None
    for delta in deltas:
        theta.grad = delta.clone()
        opt.step()
        buf = delta if buf is None else momentum * buf + delta
        want -= 0.7 * (delta + momentum * buf) if momentum else 0.7 * delta
        torch.testing.assert_close(theta.detach(), want, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# 5. the anchor's follower reaches θ_global from the OuterUpdates alone
# ---------------------------------------------------------------------------------------------


def test_outer_follower_tracks_global_parameters_with_powersgd(powersgd_run):
    model = _model(0)
    follower = OuterFollower(_fragments(model), outer_lr=LR, outer_momentum=MU)
    for sync in powersgd_run[0]["syncs"]:
        follower.apply(sync["update"])
    for run in powersgd_run:
        for f in range(FRAGMENTS):
            for got, want in zip(_flat(follower.fragments)[f], run["global"][f]):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
        assert all(
            _equal(u["update"].tensors, v["update"].tensors) for u, v in zip(powersgd_run[0]["syncs"], run["syncs"])
        )


def test_a_follower_loading_a_sync_mid_run_then_replaying_the_rest_ends_on_global_parameters(powersgd_run):
    # a restarted anchor (comm.pairlink) takes a SYNC (θ_global and the outer momentum as committed so far)
    # instead of every update it missed; with fragment_sync_delay=1 a fragment's sync is in flight at most
    # steps, so the SYNC must leave it out and the update that commits it must still apply on top
    run = powersgd_run[0]
    for done, state in run["sync_states"]:
        model = _model(1)  # another init: everything must come from the SYNC
        follower = OuterFollower(_fragments(model), outer_lr=LR, outer_momentum=MU)
        follower.load_sync(state)
        for sync in run["syncs"][done:]:
            follower.apply(sync["update"])
        for f in range(FRAGMENTS):
            for got, want in zip(_flat(follower.fragments)[f], run["global"][f]):
                assert torch.equal(got, want), (done, f)


@pytest.mark.parametrize("fixture", ["int8_run", "powersgd_int8_run"])
def test_an_int8_update_travels_to_the_anchor_as_its_codes_and_the_follower_ends_on_global_parameters(fixture, request):
    """With int8 codes fast replica 0 forwards each committed sync as it travelled (``Int8Codes.pack``):
    the anchor rebuilds the replicas' tensors bitwise from it and its follower ends on θ_global exactly,
    the payload is a byte per value (a quarter of the float32 tensors) plus the block maxima."""
    from hf_meshtune.anchor.follower import read_update, update_numel

    run = request.getfixturevalue(fixture)
    rank = RANK if fixture == "powersgd_int8_run" else None
    shapes = [[torch.Size(s) for s in fragment] for fragment in run[0]["shapes"]]
    follower = OuterFollower(_fragments(_model(0)), outer_lr=LR, outer_momentum=MU)
    for sync in run[0]["syncs"]:
        update = sync["update"]
        assert update.codes is not None and update.codes.participants == 3
        payload = update.codes.pack().clone()  # what the link carries: float32 words
        fragment = shapes[update.fragment]
        assert payload.numel() == update_numel(fragment, rank, "int8")
        rebuilt = read_update(payload, update.fragment, update.step, fragment, rank, "int8")
        assert len(rebuilt.tensors) == len(update.tensors)
        assert all(torch.equal(a, b) for a, b in zip(rebuilt.tensors, update.tensors))
        rounds = update.codes.rounds  # a byte per code, 4 per block of 256 and 4 for the count of replicas
        assert len(rounds) == (2 if rank else 1)
        assert all(c.dtype == torch.int8 and c.numel() == 256 * m.numel() for c, m in rounds)
        assert payload.numel() * 4 == 4 + sum(c.numel() + 4 * m.numel() for c, m in rounds)
        follower.apply(rebuilt)
    for f in range(FRAGMENTS):
        for got, want in zip(_flat(follower.fragments)[f], run[0]["global"][f]):
            assert torch.equal(got, want), f


def test_int8_codes_pack_every_byte_as_it_is_and_refuse_a_payload_of_the_wrong_size():
    """The codes travel as the bytes of float32 words: all 256 byte values, NaN and infinity patterns among
    the words, come back unchanged through a copy, and a payload that does not fit the rounds is refused."""
    from hf_meshtune.dp.quantize import Int8Codes, coded_words

    codes = torch.arange(-128, 128, dtype=torch.int8).repeat(4)  # 1,024 codes: 4 blocks
    codes[:4] = torch.tensor([1, 0, -128, 127], dtype=torch.int8)  # 0x7f800001 little-endian: a signalling NaN
    scales = torch.rand(4)
    sent = Int8Codes(5, [(codes, scales)]).pack()
    assert sent.numel() == coded_words([1000]) == 1 + 256 + 4 and torch.isnan(sent[1])
    got = Int8Codes.unpack(torch.cat([sent[:100], sent[100:]]), [1000])  # copied, as a link's chunks are
    ((back, back_scales),) = got.rounds
    assert got.participants == 5 and torch.equal(back, codes) and torch.equal(back_scales, scales)
    with pytest.raises(ValueError, match=r"int8 sync size=261 is invalid: it must equal 326 words for rounds"):
        Int8Codes.unpack(sent, [1000, 10])
    sent[0] = 0.0
    with pytest.raises(ValueError, match=r"int8 sync participants=0 is invalid: it must lie in \[1, 127\]"):
        Int8Codes.unpack(sent, [1000])


def test_a_sync_holds_two_tensors_per_parameter_of_every_fragment(powersgd_run):
    from hf_meshtune.anchor.follower import sync_shapes

    shapes = [[torch.Size(s) for s in fragment] for fragment in powersgd_run[0]["shapes"]]
    for _, state in powersgd_run[0]["sync_states"]:
        assert [tuple(t.shape) for t in state] == sync_shapes(shapes)
    follower = OuterFollower(_fragments(_model(0)), outer_lr=LR, outer_momentum=MU)
    with pytest.raises(ValueError, match="sync tensors"):
        follower.load_sync(powersgd_run[0]["sync_states"][0][1] + [torch.zeros(1)])


# ---------------------------------------------------------------------------------------------
# 6. stage j syncs with stage j only
# ---------------------------------------------------------------------------------------------


def test_stages_sync_only_with_the_same_stage(dense_run):
    (r0s0, r0s1), (r1s0, r1s1) = dense_run
    for f in range(FRAGMENTS):
        assert _equal(r0s0["global"][f], r1s0["global"][f]) and _equal(r0s1["global"][f], r1s1["global"][f])
        assert not any(torch.allclose(a, b) for a, b in zip(r0s0["global"][f], r0s1["global"][f]))
    assert not _equal(r0s0["post"][0][0], r1s0["post"][0][0])  # replicas did train on different data


# ---------------------------------------------------------------------------------------------
# 7. bad input: ValueError naming field, value and rule (validated before torchft is touched)
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"powersgd_rank": 0}, "powersgd_rank=0 is invalid: it must be None or an integer >= 1"),
        ({"sync_every": 5}, r"sync_every=5 is invalid: it must be a multiple of the number of fragments \(2\)"),
        ({"fragment_sync_delay": 2}, r"fragment_sync_delay=2 is invalid: it must be an integer in \[0, sync_every"),
        ({"outer_momentum": 1.0}, r"outer_momentum=1.0 is invalid: it must lie in \[0, 1\)"),
        ({"outer_lr": 0.0}, "outer_lr=0.0 is invalid: it must be > 0"),
        ({"quantize": "fp8"}, r"quantize='fp8' is invalid: it must be None or one of \['int8'\]"),
    ],
)
def test_streaming_diloco_rejects_bad_settings(kwargs, message):
    model = _model(0)
    settings = {"sync_every": 4, "powersgd_rank": 2, **kwargs}
    with pytest.raises(ValueError, match=message):
        StreamingDiLoCo(object(), _fragments(model), torch.optim.SGD(model.parameters(), lr=0.1), **settings)


def test_other_entry_points_reject_bad_input():
    with pytest.raises(ValueError, match="powersgd_rank=0 is invalid: it must be an integer >= 1"):
        PowerSGD(rank=0)
    with pytest.raises(ValueError, match=r"stage=2 is invalid: it must lie in \[0, 2\)"):
        make_manager(replica=0, stage=2, num_stages=2, lighthouse_addr="x", store_addr="x", store_port=1)
    with pytest.raises(ValueError, match=r"fragments\[0\]='Tanh' is invalid: it must own at least one parameter"):
        StreamingDiLoCo(object(), [nn.Tanh()], None, sync_every=2, powersgd_rank=None)
    with pytest.raises(ValueError, match="min_replicas=0 is invalid"):
        start_lighthouse(0)
    follower = OuterFollower(_fragments(_model(0)), outer_lr=LR, outer_momentum=MU)
    with pytest.raises(ValueError, match=r"update.fragment=2 is invalid: it must lie in \[0, 2\)"):
        follower.apply(OuterUpdate(fragment=2, step=1, tensors=[]))


def test_the_advertised_host_is_meshtune_host_when_set(monkeypatch):
    """Peers in other network namespaces or machines reach the lighthouse and stores at MESHTUNE_HOST
    (an address of this machine, which the servers listen on: 127.0.0.2, loopback but not the hostname's)."""
    import socket

    from hf_meshtune.dp.ft import advertised_host, start_lighthouse

    monkeypatch.delenv("MESHTUNE_HOST", raising=False)
    assert advertised_host() == socket.gethostname()
    server, plain = start_lighthouse(min_replicas=1)
    server.shutdown()
    monkeypatch.setenv("MESHTUNE_HOST", "127.0.0.2")
    assert advertised_host() == "127.0.0.2"
    server, address = start_lighthouse(min_replicas=1)
    try:
        port = address.rsplit(":", 1)[1]
        assert (
            address == f"http://127.0.0.2:{port}"
            and port.isdigit()
            and plain.split("://")[1].split(":")[0] != "127.0.0.2"
        )
    finally:
        server.shutdown()


def test_the_checkpoint_server_a_restarted_replica_heals_from_is_named_by_meshtune_host():
    """torchft names its checkpoint server by hostname; from another namespace that may be unreachable
    ("Connection refused" in the heal). The mesh's managers name it by MESHTUNE_HOST, and it serves there."""
    from datetime import timedelta

    from hf_meshtune.dp.diloco import AdvertisedHTTPTransport

    timeout = timedelta(seconds=10)
    elsewhere = AdvertisedHTTPTransport("127.0.0.2", timeout=timeout, num_chunks=0)
    served = AdvertisedHTTPTransport("127.0.0.1", timeout=timeout, num_chunks=0)
    try:
        assert elsewhere.metadata().startswith("http://127.0.0.2:") and elsewhere.metadata().endswith("/checkpoint/")
        state = {"mesh_stage": {"step": 7, "w": torch.arange(6.0)}}
        served.send_checkpoint(dst_ranks=[1], step=3, state_dict=state, timeout=timeout)
        fetched = served.recv_checkpoint(src_rank=0, metadata=served.metadata(), step=3, timeout=timeout)
        assert fetched["mesh_stage"]["step"] == 7 and torch.equal(fetched["mesh_stage"]["w"], torch.arange(6.0))
    finally:
        elsewhere.shutdown()
        served.shutdown()


def test_diloco_state_is_refused_mid_sync_and_for_another_fragment_count():
    """The checkpoint state of a stage's Streaming DiLoCo exists only between syncs (an all-reduce in
    flight would be lost), and loads only into as many fragments as it was taken from."""
    from types import SimpleNamespace

    from hf_meshtune.dp.diloco import StreamingDiLoCo
    from hf_meshtune.dp.diloco.fragment import _CompressedFragment

    def fragment(work: list, pending: list) -> _CompressedFragment:
        made = _CompressedFragment.__new__(_CompressedFragment)
        made._allreduce_work, made._pending, made._first_round = work, pending, None
        return made

    diloco = StreamingDiLoCo.__new__(StreamingDiLoCo)
    diloco.codec = None
    # fragment 0 with only its P all-reduces issued (τ >= 2); then fragment 1 with all-reduces in flight
    for fragments, busy in (([fragment([], [object()])], 0), ([fragment([], []), fragment([object()], [])], 1)):
        diloco._diloco = SimpleNamespace(_fragments=fragments)
        with pytest.raises(
            ValueError, match=rf"DiLoCo state='fragments \[{busy}\] syncing' is invalid: it must be taken between syncs"
        ):
            diloco.state_dict()
    with pytest.raises(ValueError, match=r"dp_fragments=2 is invalid: it must equal the checkpoint's 3 fragments"):
        diloco.load_state_dict({"fragments": [{}, {}, {}]})
