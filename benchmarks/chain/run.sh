#!/usr/bin/env bash
# SFT → GSPO on the embedded SmolLM2-135M-Instruct, LoRA (all linear layers, r = 16), arithmetic with
# the exact-answer reward: preset quality (its boundary codec, no anchor, Y = 4) and the
# paper's M95+AP (p = 0.95, anchor every 10 steps, Δ = 10) beside Dense (p = 0, no anchor, AdamW), same
# data, steps and schedule; and the default with Y = 2 and the anchor, on one process and on a launched
# 3×2 mesh (`--mesh 3x2`: two fast replicas, each with its own prompts and rollouts, DiLoCo between them,
# the anchor replica). ~60 min on 2 CPU cores; ROWS="quality" runs only the named rows.
#   bash benchmarks/chain/run.sh            → benchmarks/chain/results/{quality,m95_ap,dense}/ + report.md, loss.png, bytes_per_token.png
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
RUNS=${RUNS:-runs/chain}
OUT=benchmarks/chain/results
COMMON=(--use_peft --sft_steps 60 --gspo_steps 30 --num_generations 8 --eval_items 64)
MESH=(--report_to tensorboard --logging_steps 5 --seed 0)
ROWS=${ROWS:-quality m95_ap dense single_y2_anchor mesh_3x2}
run() {  # name, then flags for both recipes (EXAMPLE: flags of the example itself)
  local name=$1; shift
  [[ " $ROWS " == *" $name "* ]] || return 0
  rm -rf "$RUNS/$name"
  $PY examples/sft_to_gspo.py --output_dir "$RUNS/$name" "${COMMON[@]}" ${EXAMPLE:-} -- "${MESH[@]}" "$@"
  mkdir -p "$OUT/$name/sft" "$OUT/$name/gspo"
  cp "$RUNS/$name/chain.json" "$OUT/$name/"
  cp "$RUNS/$name/sft/trainer_state.json" "$OUT/$name/sft/"
  cp "$RUNS/$name/gspo/trainer_state.json" "$RUNS/$name/gspo/gspo_results.json" "$OUT/$name/gspo/"
}
run quality --num_stages 4 --preset quality
run m95_ap --num_stages 4 --preset paper --anchor_every 10 --anchor_delay 10
run dense --num_stages 4 --mask_ratio 0 --anchor false --optim adamw_torch
# the mesh row and its single-process twin: the default codec, Y = 2, the anchor on
run single_y2_anchor --num_stages 2 --preset quality --anchor true
EXAMPLE="--mesh 3x2" run mesh_3x2 --preset quality --anchor true
if [[ " $ROWS " == *" mesh_3x2 "* ]]; then
  cp "$RUNS/mesh_3x2/sft/mesh_summary.json" "$OUT/mesh_3x2/sft/"
  cp "$RUNS/mesh_3x2/gspo/mesh_summary.json" "$OUT/mesh_3x2/gspo/"
fi
$PY -m hf_meshtune.cli report "$OUT"
