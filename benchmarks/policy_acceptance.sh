#!/usr/bin/env bash
# Issue 9's acceptance runs, one after another on an otherwise idle machine (~1 h on 2 cores):
#   ci and headroom, stress (two points), and the no-pressure check (tokencake-roomy vs ideal and
#   ideal-priority, 5 rounds, on ci);
#   REPEAT (default 3) interleaved rounds each, systems shuffled per round, 95 % CIs in summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/acceptance}"
repeat="${REPEAT:-3}"
bin=.venv/bin/tokencake
$bin bench --preset ci --repeat "$repeat" --systems baseline,tokencake,ideal --out "$out/ci"
$bin bench --preset headroom --repeat "$repeat" --systems baseline,tokencake,ideal --out "$out/headroom"
$bin bench --preset ci --repeat "${REPEAT_ROOMY:-5}" --systems ideal,ideal-priority,tokencake-roomy \
    --out "$out/no-pressure"
$bin bench --preset stress --repeat "$repeat" --out "$out/stress"
