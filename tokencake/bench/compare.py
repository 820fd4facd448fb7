"""The systems of one workload point compared: E2E ratios of the headline pairs, the captured
fraction of the ideal's gain, recompute avoided, and the ``tokencake`` system's extension shares."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from tokencake.bench.metrics import ratio


def compare(systems: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Ratios and recompute savings of one point (keys absent when a system was not run)."""

    def e2e(name: str, stat: str) -> float | None:
        s = systems.get(name)
        return s["client"]["e2e_s"][stat] if s else None

    def mean_ratio(a: str, b: str) -> float | None:
        """Mean E2E of ``a`` over ``b``'s on the apps that finished on both: when an app was lost
        on one, the two means would otherwise be over different apps."""
        both = _common_apps(systems, (a, b))
        if both is None:
            return ratio(e2e(a, "mean"), e2e(b, "mean"))
        return ratio(sum(both[a]), sum(both[b])) if both[a] else None

    def computed(name: str) -> float | None:
        s = systems.get(name)
        return s["server"]["computed_prompt_tokens"] if s else None

    out: dict[str, Any] = {}
    for a, b in pairs_of(systems):
        if a in systems and b in systems:
            out[f"{a}/{b}"] = {
                "mean": mean_ratio(a, b),
                **{stat: ratio(e2e(a, stat), e2e(b, stat)) for stat in ("p50", "p95", "p99")},
            }
    for name in systems:
        if name not in ("baseline", "tokencake", "ideal") and "baseline" in systems:
            out[f"{name}/baseline"] = {
                "mean": mean_ratio(name, "baseline"),
                "p95": ratio(e2e(name, "p95"), e2e("baseline", "p95")),
            }
    three = ("baseline", "tokencake", "ideal")
    if all(n in systems for n in three):
        common = _common_apps(systems, three)
        if common is None:
            means = [e2e(n, "mean") for n in three]
        else:
            means = [sum(common[n]) / len(common[n]) if common[n] else None for n in three]
        out["captured_fraction"] = captured_fraction(*means)
    base, tc_, ideal = computed("baseline"), computed("tokencake"), computed("ideal")
    if base is not None and tc_ is not None:
        out["recomputed_tokens_avoided"] = base - tc_
        if ideal is not None:
            out["avoidable_recompute"] = {
                "baseline": base - ideal,
                "tokencake": tc_ - ideal,
                "fraction_avoided": ratio(base - tc_, base - ideal),
            }
    ext = (systems.get("tokencake") or {}).get("extension") or {}
    if ext.get("summary"):
        for key in EXTENSION_HEADLINES:
            out[key] = ext["summary"].get(key)
    return out


def _common_apps(
    systems: Mapping[str, Mapping[str, Any]], names: tuple[str, ...]
) -> dict[str, list[float]] | None:
    """Each named system's E2E of the apps (by run id) that finished on all of them, in one order;
    None when a system lists no apps (pooled statistics: the means are all there is)."""
    ok: list[dict[Any, float]] = []
    for name in names:
        apps = systems[name].get("apps")
        if apps is None:
            return None
        done = [x for x in apps if x.get("status") == "ok"]
        by_id = {x.get("run_id"): x["e2e_s"] for x in done}
        if None in by_id or len(by_id) < len(done):
            return None  # apps not told apart by run id: nothing to match on
        ok.append(by_id)
    shared = [r for r in ok[0] if all(r in other for other in ok[1:])]
    return {name: [e[r] for r in shared] for name, e in zip(names, ok, strict=True)}


#: E2E ratios of every point (when both systems ran); ``tokencake-roomy/ideal`` is the extension's cost
#: without KV pressure (the target is <= 1.02).
HEADLINE_PAIRS: tuple[tuple[str, str], ...] = (
    ("tokencake", "baseline"),
    ("tokencake", "ideal"),
    ("baseline", "ideal"),
    ("tokencake-roomy", "ideal"),
    ("tokencake-roomy", "ideal-priority"),
    ("tokencake", "baseline-priority"),
    ("ideal-priority", "ideal"),
    # Against the true reference, TokenCake's own scheduler with KV that never evicts: what eviction
    # costs TokenCake, and what it costs stock vLLM with the same (priority) and with its default order.
    ("tokencake", "tokencake-roomy"),
    ("baseline-priority", "tokencake-roomy"),
    ("baseline", "tokencake-roomy"),
    # The literature's policies in the same server (issue 10): tokencake against each, each against the ideal.
    ("tokencake", "offload-all"),
    ("tokencake", "continuum"),
    ("tokencake", "infercept"),
    ("offload-all", "ideal"),
    ("continuum", "ideal"),
    ("infercept", "ideal"),
    ("stock-connector", "baseline"),
    ("tokencake", "hold-off"),
    ("return-reserve", "tokencake"),
    ("return-reserve", "ideal"),
    ("return-reserve", "baseline"),
    ("continuum-queue", "continuum"),
    ("tokencake", "continuum-queue"),
    # The spatial scheduler's ablation (issue 12), and the policies under the same (vLLM's) scheduler.
    ("tokencake", "spatial-off"),
    ("spatial-off", "ideal"),
    ("spatial-off", "offload-all"),
    ("spatial-off", "continuum"),
    ("spatial-off", "infercept"),
    ("spatial-order", "spatial-off"),
    ("reserve-off", "spatial-off"),
    ("tokencake", "reserve-off"),
    ("spare-late", "spatial-off"),
    ("spare-late", "tokencake"),
    ("reserve-arrival", "spatial-off"),
    ("tokencake", "reserve-arrival"),
    # Two replicas behind a router (issue 15): session affinity against round robin.
    ("replicas-affinity", "replicas-round-robin"),
    # The spatial score's weights against the earlier app-side-by-side weights.
    ("tokencake", "apps-side-by-side"),
    ("apps-side-by-side", "ideal"),
    ("tokencake", "static-slack"),
    ("static-slack", "ideal"),
    ("tokencake", "remaining-depth-first"),
    ("remaining-depth-first", "spatial-off"),
)


def revision_pairs(names: Iterable[str]) -> list[tuple[str, str]]:
    """``(NAME, NAME@REV)`` for each system served from a git revision whose running-code system
    NAME is among ``names``: the running code over the revision's (after / before a change)."""
    names = list(names)
    return [(n.partition("@")[0], n) for n in names if "@" in n and n.partition("@")[0] in names]


def pairs_of(names: Iterable[str]) -> list[tuple[str, str]]:
    """The pairs compared among systems ``names``: :data:`HEADLINE_PAIRS`, then :func:`revision_pairs`."""
    return [*HEADLINE_PAIRS, *revision_pairs(names)]


#: Extension summary fields of the ``tokencake`` system copied into each point's comparison.
EXTENSION_HEADLINES: tuple[str, ...] = (
    "prefetch_on_time_rate",
    "next_turn_recomputed_share",
    "ready_rate",
    "ready_rate_with_room",
    "on_time_rate_excl_not_needed",
)


def captured_fraction(baseline: float | None, tokencake: float | None, ideal: float | None) -> float | None:
    """(baseline − tokencake) / (baseline − ideal): the share of the ideal's gain TokenCake captured.

    None when any is missing or the ideal was not faster than the baseline (nothing to capture).
    """
    if baseline is None or tokencake is None or ideal is None or baseline <= ideal:
        return None
    return (baseline - tokencake) / (baseline - ideal)
