"""Paired ratios and their 95% intervals: the one statistics module of the
benches.

Every bench compares variants measured in lockstep (interleaved blocks on
the same machine at the same time), so each statistic takes pairs, one
measurement of each variant per pair, and states which ratio it estimates:

- ``mean_ratio``: sum(b) / sum(a), the ratio of mean costs that throughput
  follows, with a delta-method t-interval;
- ``geometric_mean_ratio``: the geometric mean of the pairs' b / a, with a
  t-interval on the log ratios;
- ``median_ratio``: the median of the pairs' b / a, with a distribution-free
  interval (order statistics of the sign test), for heavy-tailed noise;
- ``mean_product``: a product of several paired means and their inverses
  (a speedup: tokens per step over step cost, where both vary), with a
  delta-method t-interval on its log.
"""

import math
import statistics
from typing import Dict, Optional, Sequence, Tuple

Interval = Tuple[float, Optional[float], Optional[float]]  # estimate, lo, hi


def t_quantile_975(df: int) -> float:
    """Student's t 97.5% quantile (Cornish-Fisher series; within 1% from df=2,
    the least any interval here takes: 3 pairs)."""
    if df < 2:
        raise ValueError(f"degrees of freedom must be >= 2, got {df}")
    z = 1.959963984540054
    g = (
        (z**3 + z) / 4,
        (5 * z**5 + 16 * z**3 + 3 * z) / 96,
        (3 * z**7 + 19 * z**5 + 17 * z**3 - 15 * z) / 384,
        (79 * z**9 + 776 * z**7 + 1482 * z**5 - 1920 * z**3 - 945 * z) / 92160,
    )
    return z + sum(gi / df ** (i + 1) for i, gi in enumerate(g))


def _check(pairs: Sequence[Tuple[float, float]]) -> None:
    if not pairs:
        raise ValueError("no pairs")
    for a, b in pairs:
        if not (0 < a < math.inf and 0 < b < math.inf and 0 < b / a < math.inf):
            raise ValueError(
                f"every measurement must be finite and > 0, and their ratio "
                f"finite and > 0, got {a!r}, {b!r}"
            )


def geometric_mean_ratio(pairs: Sequence[Tuple[float, float]]) -> Interval:
    """(b / a) over (a, b) pairs: the geometric mean of the ratios and its 95%
    t-interval; no interval from fewer than 3 pairs."""
    _check(pairs)
    logs = [math.log(b / a) for a, b in pairs]
    mean = statistics.fmean(logs)
    if len(logs) < 3:
        return math.exp(mean), None, None
    half = t_quantile_975(len(logs) - 1) * statistics.stdev(logs) / len(logs) ** 0.5
    return math.exp(mean), math.exp(mean - half), math.exp(mean + half)


def mean_ratio(pairs: Sequence[Tuple[float, float]]) -> Interval:
    """sum(b) / sum(a) over (a, b) pairs and its 95% interval (the ratio
    estimator's delta method: residuals b - R a); no interval from fewer
    than 3 pairs."""
    _check(pairs)
    n = len(pairs)
    mean_a = statistics.fmean(a for a, _ in pairs)
    ratio = statistics.fmean(b for _, b in pairs) / mean_a
    if n < 3:
        return ratio, None, None
    residuals = [b - ratio * a for a, b in pairs]
    se = math.sqrt(sum(r * r for r in residuals) / (n - 1) / n) / mean_a
    half = t_quantile_975(n - 1) * se
    return ratio, ratio - half, ratio + half


def mean_product(columns: Sequence[Sequence[float]], powers: Sequence[int]) -> Interval:
    """prod_k mean(columns[k]) ** powers[k] (each power 1 or -1), the columns
    measured in pairs (item i of every column from the same pair), and its
    95% interval: a t-interval on its log by the delta method, from each
    pair's residual sum_k powers[k] * x_ik / mean_k, so that every column's
    noise, and how the columns move together, is in it. No interval from
    fewer than 3 pairs."""
    if len(columns) != len(powers) or not columns:
        raise ValueError(f"{len(columns)} columns for {len(powers)} powers")
    if any(p not in (1, -1) for p in powers):
        raise ValueError(f"powers must be 1 or -1, got {list(powers)}")
    n = len(columns[0])
    if n == 0 or any(len(c) != n for c in columns):
        raise ValueError(f"columns must be non-empty and of one length, got {n}")
    if any(not (x >= 0 and math.isfinite(x)) for c in columns for x in c):
        raise ValueError("every measurement must be finite and >= 0")
    means = [statistics.fmean(c) for c in columns]
    if any(m == 0 for m in means):
        raise ValueError("every column's mean must be > 0")
    estimate = math.prod(m**p for m, p in zip(means, powers))
    if n < 3:
        return estimate, None, None
    residuals = [
        sum(p * c[i] / m for c, m, p in zip(columns, means, powers)) for i in range(n)
    ]
    half = t_quantile_975(n - 1) * statistics.stdev(residuals) / n**0.5
    return estimate, estimate * math.exp(-half), estimate * math.exp(half)


def median_ratio(num: Sequence[float], den: Sequence[float]) -> Dict:
    """Median of the per-pair ratios num / den and its distribution-free 95%
    interval: a pair of order statistics (the sign-test interval), which
    holds for any noise distribution; it needs at least 6 pairs.
    ``resolvable``: the interval excludes 1."""
    if len(num) != len(den):
        raise ValueError(f"{len(num)} measurements paired with {len(den)}")
    _check(list(zip(den, num)))
    ratios = [a / b for a, b in zip(num, den)]
    ordered, n = sorted(ratios), len(ratios)
    out = {"ratios": ratios, "median": statistics.median(ratios)}
    # Largest k with P(Binomial(n, 1/2) < k) <= 2.5%: [x_(k), x_(n + 1 - k)].
    k, tail = 0, 0.0
    while k < n and tail + math.comb(n, k) / 2**n <= 0.025:
        tail += math.comb(n, k) / 2**n
        k += 1
    if k == 0:
        return dict(out, ci95=None, coverage=None, resolvable=False)
    lo, hi = ordered[k - 1], ordered[n - k]
    return dict(
        out, ci95=[lo, hi], coverage=1 - 2 * tail, resolvable=not lo <= 1.0 <= hi
    )
