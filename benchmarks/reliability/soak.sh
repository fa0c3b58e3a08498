#!/usr/bin/env bash
# The reliability soak (~20 min on 2 cores, as root: network namespaces): a 3x2 mesh through scripted
# replica kills, link cuts, a straggler, anchor stops and a crash with resume. Writes
# benchmarks/reliability/results/soak.json, soak.md and soak.png; exits 1 unless every fault was survived and
# no checkpoint was lost.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.reliability.soak "$@"
