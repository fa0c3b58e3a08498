"""One rank of a WAN-benchmark mesh (started by ``run.py`` inside its node's network namespace).

    RANK=.. WORLD_SIZE=.. MASTER_ADDR=.. MASTER_PORT=.. GLOO_SOCKET_IFNAME=eth0 MESHTUNE_HOST=<node ip> \\
        python -m benchmarks.wan.worker --row m95_ap --data DIR/data.pt --out DIR/m95_ap --steps 120

Runs this rank's part of the X × Y mesh (``hf_meshtune.runtime.bootstrap.run_worker``, the code
``MeshTrainer`` runs on a launched mesh) on the row's configuration, fine-tuning the data file's
model (``rows.prepare_data``) on its train rows, and writes ``rank{R}.json``: step times, losses, the
Wire's bytes per circuit (the codecs' one-off calibration pass counted apart), DP syncs, anchor
arrivals and the node's kernel byte counter. Fast replica 0 also saves its stage's parameters every
``--save-every`` steps and at the last, so ``run.py`` can evaluate the dense model along the run after
the timed part is over.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from dataclasses import asdict

import torch
import torch.distributed as dist

from hf_meshtune.config import MeshConfig
from hf_meshtune.dp.diloco import fragment as diloco_fragment
from hf_meshtune.runtime.bootstrap import run_worker
from hf_meshtune.runtime.job import _lighthouse
from hf_meshtune.runtime.settings import RunSettings, StageCallback
from hf_meshtune.topology import MeshTopology

from . import netns
from .rows import ROWS, Shape, batches, build_model


def _counters() -> dict[str, int]:
    """The node's eth0 counters: bytes and packets sent and received (frames, Ethernet headers included), and
    what eth0 sent from its low-priority class (to the nodes' low-priority addresses: netns._shape)."""
    out = {}
    for name in ("tx_bytes", "tx_packets", "rx_bytes", "rx_packets"):
        with open(f"/sys/class/net/eth0/statistics/{name}") as fh:
            out[name] = int(fh.read())
    low = netns.low_priority_sent()
    return out | {"tx_low_bytes": low["bytes"], "tx_low_packets": low["packets"]}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--row", required=True, choices=sorted(ROWS))
    parser.add_argument("--data", required=True)
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=0)
    parser.add_argument("--link-timeout", type=float, default=None, help="seconds a pipeline message may wait")
    args = parser.parse_args()

    row, shape = ROWS[args.row], Shape()
    if not row.dp_buckets:  # every tensor a bucket of its own: the per-tensor all-reduces of before
        diloco_fragment.BUCKET_BYTES = 0
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    topology = MeshTopology(row.replicas, shape.stages, anchor=row.anchor)
    groups = topology.build_groups(timeout_s=args.link_timeout, dp_peers=row.dp_mode != "streaming_diloco")
    lighthouse, server = _lighthouse(rank, topology)

    data = torch.load(args.data)
    torch.manual_seed(0)
    model = build_model(data)
    cfg = MeshConfig(
        num_stages=shape.stages,
        num_replicas=row.replicas,
        mask_ratio=row.mask_ratio,
        boundary_codec=row.boundary_codec,
        anchor=row.anchor,
        anchor_payload=row.anchor_payload,
        spectral_rank=row.spectral_rank,
        anchor_rate_mbit=row.anchor_rate_mbit,
        anchor_every=shape.anchor_every,
        dp_sync_every=row.sync_every or shape.sync_every,
        dp_fragments=shape.fragments,
        dp_sync_delay=row.sync_delay,
        dp_keep_overlapped=row.keep_overlapped,
        dp_powersgd_rank=row.powersgd_rank,
        dp_quantize=row.dp_quantize,
        mask_seed=0,
        **{f"dp_{k}": v for k in ("outer_lr", "outer_momentum") if (v := getattr(row, k)) is not None},
    )
    warmup = max(1, args.steps // 10)

    def scheduler(optimizer):
        def factor(step: int) -> float:
            if step < warmup:
                return (step + 1) / warmup
            progress = (step - warmup) / max(1, args.steps - warmup)
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

        return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)

    replica, stage = topology.coords(rank)
    params_dir = os.path.join(args.out, "params")

    class SaveParameters(StageCallback):
        def on_step_end(self, view) -> None:
            step = view.step
            if args.save_every and replica == 0 and (step % args.save_every == 0 or step == args.steps):
                os.makedirs(params_dir, exist_ok=True)
                torch.save(view.parameters(), os.path.join(params_dir, f"step{step:05d}_stage{stage}.pt"))

    microbatches = row.microbatches or shape.microbatches  # the same rows per replica step in every row
    settings = RunSettings(
        config=cfg,
        microbatch_size=shape.microbatch_size * shape.microbatches // microbatches,
        microbatches=microbatches,
        seq_len=shape.seq_len,
        max_steps=args.steps,
        lr=row.lr or shape.lr,
        weight_decay=0.0,
        max_grad_norm=1.0,
        scheduler=scheduler,
        lighthouse=lighthouse,
        dp_timeout_s=600.0,
        dp_mode=row.dp_mode,
        callbacks=[SaveParameters()],
        link_timeout_s=args.link_timeout,
    )
    rows = shape.microbatch_size * shape.microbatches
    fast = len(topology.fast_replicas)
    train = data["train_ids"], data["train_labels"]
    before, start = _counters(), time.perf_counter()
    result = run_worker(
        model,
        groups,
        settings,
        batches(*train, rows, min(replica, fast - 1), fast, seed=0),
        batches(*train, rows, 0, 1, seed=999),  # the anchor's rounds: an order of their own
    )
    wall, after = time.perf_counter() - start, _counters()
    record = asdict(result) | {k: after[k] - before[k] for k in after}
    record |= {"wall_seconds": wall, "tokens_per_step": rows * shape.seq_len}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as fh:
        json.dump(record, fh)
    dist.barrier()
    if server is not None:
        server.shutdown()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
