#!/usr/bin/env bash
# The stress preset (issue 9): fan-in agent_mix apps, heterogeneous contexts, heavy-tailed tools with
# median-only hints, staggered arrivals; points `hetero` and `shared` (long common preamble).
# ~8 min per round of baseline, tokencake and ideal on 2 cores; REPEAT rounds, interleaved, shuffled.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/stress}"
repeat="${REPEAT:-3}"
exec .venv/bin/tokencake bench --preset stress --repeat "$repeat" --out "$out"
