"""Float numerics shared by the objective: the working dtype and cancellation-free elementary
functions (docs/design.md section 8). A leaf of gppo.core: it imports torch only."""

from __future__ import annotations

import math

import torch

LOG2 = math.log(2.0)


def work_dtype(*tensors: torch.Tensor) -> torch.dtype:
    """float64 stays float64; everything else (bf16, fp16, fp32) is computed in float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in tensors) else torch.float32


def upcast(x: torch.Tensor) -> torch.Tensor:
    """x in its working dtype (float32, or float64 if it already is)."""
    return x.to(work_dtype(x))


def log1mexp(log_x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(log_x)) for log_x <= 0, accurate near both ends (Maechler 2012)."""
    log_x = log_x.clamp(max=0.0)
    return torch.where(log_x > -LOG2, torch.log(-torch.expm1(log_x)), torch.log1p(-torch.exp(log_x)))


def expm1_minus(y: torch.Tensor) -> torch.Tensor:
    """e^y - 1 - y without cancellation: its Taylor series y^2/2! + y^3/3! + ... (Horner) for
    |y| <= 1/2, where expm1(y) - y would lose log2(2/|y|) bits, and expm1(y) - y beyond."""
    terms = 15 if y.dtype == torch.float64 else 9  # the series' tail is below the dtype's eps
    series = torch.ones_like(y)
    for n in range(terms + 1, 2, -1):
        series = 1 + series * y / n
    return torch.where(y.abs() <= 0.5, y * y / 2 * series, torch.expm1(y) - y)
