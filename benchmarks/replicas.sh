#!/usr/bin/env bash
# Issue 15's bench point: the stress preset (point `hetero`) on two TokenCake replicas behind
# vllm-router (one core each on a 2-core machine), sessions kept on their replica
# (`--policy consistent_hash` on the X-Session-ID header) vs the router's round robin.
# Same replicas, same device KV (40 blocks each), stalls derived from the requests in both.
# Needs the `router` extra (vllm-router). REPEAT rounds, interleaved, shuffled.
set -euo pipefail
cd "$(dirname "$0")/.."
out="${1:-bench-out/replicas}"
repeat="${REPEAT:-3}"
exec .venv/bin/tokencake bench --preset stress --points "${POINTS:-hetero}" --repeat "$repeat" \
    --systems replicas-affinity,replicas-round-robin --out "$out"
