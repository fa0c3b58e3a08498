#!/usr/bin/env bash
# The reliability soak (~35 min on 2 cores, as root: network namespaces): a 3x2 mesh with the anchor on and
# replica restarts, through 26 scripted faults: kills of fast and anchor stages, link cuts shorter and longer
# than the timeout, stragglers, anchor stops and crashes with resume. Writes
# benchmarks/reliability/results/soak.json, soak.md and soak.png; exits 1 unless every fault was survived and
# no checkpoint was lost.
set -euo pipefail
cd "$(dirname "$0")/../.."
[ -x .venv/bin/python ] || bash scripts/setup.sh
exec .venv/bin/python -m benchmarks.reliability.soak "$@"
