#!/usr/bin/env bash
# Issue 47's release run set: every release workload on its systems, 5 rounds in balanced order, at one
# serving code; resumable (rerun to continue). The servers import this checkout's tokencake/.
#   benchmarks/release.sh [--plan-only | --status | --summarize] [--out DIR] [--workloads A,B] [--hours H]
# A plain run ends by writing docs/bench/release/*.json and the README/docs release tables.
# See benchmarks/release.py for the manifest, the plan and the time it takes (~5 h on 2 cores).
set -euo pipefail
cd "$(dirname "$0")/.."
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
exec .venv/bin/python benchmarks/release.py "$@"
