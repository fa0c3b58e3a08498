#!/usr/bin/env bash
# Regenerate every WAN-benchmark table and plot under benchmarks/wan/results/ (as root: network
# namespaces and tc need CAP_NET_ADMIN). About 3 h 50 min on 2 idle CPU cores (the steps' measured times,
# summed), plus ~25 min once if the quality benchmark's pretrained tiny Llama is not cached yet
# (benchmarks/quality/pretrain.py); set up .venv first with `bash scripts/setup.sh`. Every training run is
# cached under $HF_MESHTUNE_CACHE/wan, so an interrupted run.sh, started again, picks up where it stopped.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PYTHON:-.venv/bin/python}
"$PY" -m benchmarks.wan.ledger_1b      # 1B-shape byte ledger next to the paper's row (seconds)
"$PY" -m benchmarks.wan.micro          # masking share of a step, SpectralAdamW vs AdamW, optimizer memory (~4 min)
"$PY" -m benchmarks.wan.dp_sweep       # which DP sync keeps the fine-tune's quality, at what bytes, at what lr (~55 min)
"$PY" -m benchmarks.wan.run            # every row fine-tunes on shaped links: tokens/s, bytes/token, quality (~50 min)
"$PY" -m benchmarks.wan.anchor_pacing  # fast step times without the anchor, with it, with its link capped (~11 min; after run: its links)
"$PY" -m benchmarks.wan.throughput     # where the default's shaped step goes: microbatches, overlapped DP syncs, DP at low priority (~24 min; after run)
"$PY" -m benchmarks.wan.equal_quality  # longer step budgets, 2 lrs: time to tuned Dense's final quality (~82 min; after dp_sweep, run, throughput)
