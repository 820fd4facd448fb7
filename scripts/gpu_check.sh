#!/usr/bin/env bash
# Measure the TokenCake host-pool copy path (pinned D2H / H2D) against torch peak copies on a CUDA
# machine. One command, a few minutes at most; on a machine without CUDA it says so and exits 0.
# Needs torch (not vLLM). Usage: scripts/gpu_check.sh [--quick] [--json out.json]
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
exec timeout 300 "$PY" scripts/gpu_check.py "$@"
