#!/usr/bin/env bash
# The research digest's headroom setup (6 agents x 6 turns, 3 s tools, 40 device blocks): the larger run.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/headroom}"
exec .venv/bin/tokencake bench --preset headroom --out "$out"
