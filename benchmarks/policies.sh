#!/usr/bin/env bash
# Issue 10: the KV policies side by side in the same server (~1.5 h on 2 cores, REPEAT=3):
#   1. stress/hetero with an ample host pool: stock vLLM, offload-all, continuum, infercept, tokencake, ideal;
#   2. the same workload with a host pool smaller than the sessions' working set (HOST_BLOCKS, default 32
#      of ~55 distinct blocks): offload-all (an LRU tier) vs tokencake (events say who returns);
#   3. headroom: stock vLLM, offload-all, tokencake, ideal.
# Interleaved rounds, systems shuffled per round, t and paired-bootstrap 95 % CIs in summary.md.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/policies}"
repeat="${REPEAT:-3}"
bin=.venv/bin/tokencake
stress=(--preset stress --points hetero --apps 1 --workers 4 --repeat "$repeat")
$bin bench "${stress[@]}" --systems baseline,offload-all,continuum,infercept,tokencake,ideal --out "$out/stress"
$bin bench "${stress[@]}" --host-pool-blocks "${HOST_BLOCKS:-32}" --systems offload-all,tokencake \
    --out "$out/stress-small-host"
$bin bench --preset headroom --repeat "$repeat" --systems baseline,offload-all,tokencake,ideal --out "$out/headroom"
