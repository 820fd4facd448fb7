"""95 % confidence intervals over benchmark rounds (Student t), without scipy.

With ``--repeat N`` every headline number is measured once per round. Rounds are few (2-5), so the
interval uses Student's t with N − 1 degrees of freedom rather than the normal 1.96: with 3 rounds the
half width is 4.30 × s / √3, which is honest about how little three runs pin down. The critical values
are the two-sided 95 % quantiles t₀.₉₇₅ (a fixed table; scipy is not a dependency).
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

#: t₀.₉₇₅ by degrees of freedom (two-sided 95 %); beyond 30 the next smaller listed df is used, which
#: widens the interval slightly (conservative).
T_975: dict[int, float] = {
    1: 12.706,
    2: 4.303,
    3: 3.182,
    4: 2.776,
    5: 2.571,
    6: 2.447,
    7: 2.365,
    8: 2.306,
    9: 2.262,
    10: 2.228,
    11: 2.201,
    12: 2.179,
    13: 2.160,
    14: 2.145,
    15: 2.131,
    16: 2.120,
    17: 2.110,
    18: 2.101,
    19: 2.093,
    20: 2.086,
    21: 2.080,
    22: 2.074,
    23: 2.069,
    24: 2.064,
    25: 2.060,
    26: 2.056,
    27: 2.052,
    28: 2.048,
    29: 2.045,
    30: 2.042,
    40: 2.021,
    60: 2.000,
    120: 1.980,
}


def t_critical(df: int) -> float:
    """Two-sided 95 % Student-t critical value for ``df`` >= 1 degrees of freedom."""
    if df < 1:
        raise ValueError(f"degrees of freedom must be >= 1, got {df}")
    return T_975[max(k for k in T_975 if k <= df)]


def mean_ci(values: Iterable[float | None]) -> dict[str, Any]:
    """Mean of the per-round values with its 95 % t interval; None entries (not measured) are skipped.

    Returns ``per_round`` (as given), ``n``, ``mean``, ``sd`` (sample, n − 1), ``half_width`` and
    ``ci95`` ``[low, high]``; the interval fields are None with fewer than two values.
    """
    given = list(values)
    data = [float(v) for v in given if v is not None and not math.isnan(v)]
    n = len(data)
    out: dict[str, Any] = {"per_round": given, "n": n, "mean": None, "sd": None, "half_width": None}
    out["ci95"] = None
    if not n:
        return out
    mean = sum(data) / n
    out["mean"] = mean
    if n < 2:
        return out
    sd = math.sqrt(sum((x - mean) ** 2 for x in data) / (n - 1))
    half = t_critical(n - 1) * sd / math.sqrt(n)
    out.update(sd=sd, half_width=half, ci95=[mean - half, mean + half])
    return out


def paired_ratio_bootstrap(
    pairs: list[tuple[float, float]],
    *,
    resamples: int = 2000,
    seed: int = 0,
    clusters: list[str] | None = None,
) -> dict[str, Any]:
    """Ratio of means ``Σa / Σb`` over paired observations with a percentile bootstrap 95 % interval.

    A pair is the same app (same run id, same round) measured on two systems, so machine drift
    between rounds cancels inside each pair. The rounds of one app are not independent samples,
    though: the same app replays the same workload every round, so its pairs move together.
    With ``clusters`` (each pair's app) the resample is two-stage — apps with replacement, then
    that app's pairs with replacement — which keeps that dependence and so does not understate
    the spread as resampling pairs alone does; with one app (or no ``clusters``) it resamples
    pairs. The interval is None with fewer than 3 pairs (a bootstrap of two points says nothing).
    """
    import random

    if clusters is not None and len(clusters) != len(pairs):
        raise ValueError("clusters must name one app per pair")
    keys = clusters if clusters is not None else [""] * len(pairs)  # no apps named: one group
    groups: dict[str, list[tuple[float, float]]] = {}
    data: list[tuple[float, float]] = []  # in the order given (the ratio's sums are too)
    for key, (a, b) in zip(keys, pairs, strict=True):
        if math.isfinite(a) and math.isfinite(b):
            data.append((float(a), float(b)))
            groups.setdefault(key, []).append(data[-1])
    n = len(data)
    by_app = len(groups) > 1
    out: dict[str, Any] = {"n_pairs": n, "n_apps": len(groups) if clusters is not None else None}
    out.update(ratio=None, ci95=None, resamples=0)
    out["resampled"] = "apps, then each app's rounds" if by_app else "pairs"
    total_b = sum(b for _a, b in data)
    if not n or total_b <= 0:
        return out
    out["ratio"] = sum(a for a, _b in data) / total_b
    if n < 3:
        return out
    rng = random.Random(seed)
    units = list(groups.values()) if by_app else [data]
    stats: list[float] = []
    for _ in range(resamples):
        sa = sb = 0.0
        for _j in range(len(units)):
            unit = units[rng.randrange(len(units))] if len(units) > 1 else units[0]
            for _i in range(len(unit)):
                a, b = unit[rng.randrange(len(unit))]
                sa += a
                sb += b
        if sb > 0:
            stats.append(sa / sb)
    stats.sort()
    if stats:
        lo = stats[int(0.025 * (len(stats) - 1))]
        hi = stats[math.ceil(0.975 * (len(stats) - 1))]
        out.update(ci95=[lo, hi], resamples=len(stats))
    return out
