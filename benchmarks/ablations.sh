#!/usr/bin/env bash
# What each mechanism buys on the ci workload: full extension vs offload + demand load only
# (prefetch off) vs offload + prefetch only (demand load off).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/ablations}"
exec .venv/bin/tokencake bench --preset ci --systems baseline,tokencake,prefetch-off,demand-off --out "$out"
