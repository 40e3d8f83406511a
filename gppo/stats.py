"""The statistics that evaluation, the trainer's summary and the sweep report: pass@k, avg@k,
standard errors and 95% t-intervals."""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from c correct out of n samples: 1 - C(n-c, k)/C(n, k), as a stable product."""
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def avg_at_k(scores: Sequence[Sequence[float]]) -> float:
    """Mean over problems of the mean score of each problem's k samples."""
    if not scores or any(len(s) == 0 for s in scores):
        raise ValueError("avg@k needs at least one problem and one sample per problem")
    return sum(sum(s) / len(s) for s in scores) / len(scores)


def standard_error(values: Sequence[float]) -> float:
    """Standard error of the mean: sample standard deviation (n - 1) / sqrt(n); NaN below 2 values."""
    return statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else math.nan


def difference_standard_error(se_a: float, se_b: float) -> float:
    """Standard error of the difference of two independent means of standard errors se_a, se_b."""
    return math.sqrt(se_a**2 + se_b**2)


# t_{0.975, df} for df = 1..30 (two-sided 95%); larger df use the expansion in `t_quantile_975`.
_T975 = (
    12.706,
    4.303,
    3.182,
    2.776,
    2.571,
    2.447,
    2.365,
    2.306,
    2.262,
    2.228,
    2.201,
    2.179,
    2.160,
    2.145,
    2.131,
    2.120,
    2.110,
    2.101,
    2.093,
    2.086,
    2.080,
    2.074,
    2.069,
    2.064,
    2.060,
    2.056,
    2.052,
    2.048,
    2.045,
    2.042,
)
_Z975 = 1.959964


def t_quantile_975(df: int) -> float:
    """Student-t 97.5% quantile: table for df <= 30, else z + (z^3 + z)/(4 df) + (5z^5 + 16z^3 + 3z)/(96 df^2)
    (Abramowitz & Stegun 26.7.5; error < 1e-3 for df > 30)."""
    if df < 1:
        raise ValueError(f"df must be >= 1 (got {df})")
    if df <= len(_T975):
        return _T975[df - 1]
    z = _Z975
    return z + (z**3 + z) / (4 * df) + (5 * z**5 + 16 * z**3 + 3 * z) / (96 * df**2)


def mean_ci(values) -> tuple[float, float]:
    """(mean, half width of the 95% t-interval) of the finite values; NaN where undefined."""
    x = np.array([v for v in values if v is not None and math.isfinite(v)], dtype=np.float64)
    if len(x) == 0:
        return math.nan, math.nan
    if len(x) == 1:
        return float(x[0]), math.nan
    return float(x.mean()), t_quantile_975(len(x) - 1) * standard_error(x.tolist())
