#!/usr/bin/env bash
# The ci preset: stock vLLM vs TokenCake vs the ideal on 6 synthetic multi-turn agents (~2 min on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/ci}"
exec .venv/bin/tokencake bench --preset ci --out "$out"
