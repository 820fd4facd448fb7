#!/usr/bin/env bash
# The paper's setting: Code-Writer + Deep-Research, paper tool times, Poisson arrivals swept over RATES
# (default 0.05,0.1,0.2,0.5,1.0 apps/s). About two hours on 2 CPU cores; pass fewer rates to cut it down.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/paper}"
rates="${2:-0.05,0.1,0.2,0.5,1.0}"
exec .venv/bin/tokencake bench --preset paper --rates "$rates" --out "$out"
