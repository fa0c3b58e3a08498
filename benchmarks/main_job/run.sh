#!/usr/bin/env bash
# Regenerate the main-job table (docs/benchmarks/main_job.md): Dense, the default (preset quality) and the paper's M95 and
# M95+AP runs of `meshtune demo`, side by side (same data order, steps, lr schedule). About 14 minutes
# on 2 CPU cores; ROWS="quality" runs only the named rows.
#   bash benchmarks/main_job/run.sh
set -euo pipefail
cd "$(dirname "$0")"
MESHTUNE=${MESHTUNE:-../../.venv/bin/meshtune}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
ROWS=${ROWS:-dense quality m95 m95_ap}
row() {  # name, then the demo's flags
  local name=$1; shift
  [[ " $ROWS " == *" $name "* ]] || return 0
  "$MESHTUNE" demo "$@" --output-dir "$work/$name" && cp "$work/$name/summary.json" "$name.json"
}
row dense --mask-ratio 0 --no-anchor
row quality  # the default: preset quality
row m95 --preset paper --no-anchor
row m95_ap --preset paper
python3 - <<'PY'
import json
for name in ("dense", "quality", "m95", "m95_ap"):
    s = json.load(open(f"{name}.json"))
    print(f"{name:7s} dense eval loss {s['dense_eval_loss_before']:.3f} -> {s['dense_eval_loss_after']:.3f}  "
          f"train loss through the boundaries (last log) {s['masked_train_loss_last_log']:.2f}  train {s['train_runtime_s']:.0f} s")
PY
