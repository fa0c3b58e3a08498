#!/usr/bin/env bash
# Regenerate the README's main-job table: Dense, preset quality and the paper's M95 and
# M95+AP runs of `meshtune demo`, side by side (same data order, steps, lr schedule). About 14 minutes
# on 2 CPU cores.
#   bash benchmarks/main_job/run.sh
set -euo pipefail
cd "$(dirname "$0")"
MESHTUNE=${MESHTUNE:-../../.venv/bin/meshtune}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
"$MESHTUNE" demo --mask-ratio 0 --no-anchor --output-dir "$work/dense" && cp "$work/dense/summary.json" dense.json
"$MESHTUNE" demo --preset quality --output-dir "$work/quality" && cp "$work/quality/summary.json" quality.json
"$MESHTUNE" demo --preset paper --no-anchor --output-dir "$work/m95" && cp "$work/m95/summary.json" m95.json
"$MESHTUNE" demo --preset paper --output-dir "$work/m95_ap" && cp "$work/m95_ap/summary.json" m95_ap.json
python3 - <<'PY'
import json
for name in ("dense", "quality", "m95", "m95_ap"):
    s = json.load(open(f"{name}.json"))
    print(f"{name:7s} dense eval loss {s['dense_eval_loss_before']:.3f} -> {s['dense_eval_loss_after']:.3f}  "
          f"masked train loss (last log) {s['masked_train_loss_last_log']:.2f}  train {s['train_runtime_s']:.0f} s")
PY
