"""`gppo geometry`: how far a token of probability q may move under each divergence and estimator.

For the estimators that depend only on the sampled token (sample, cell, binary), the trust region
{D-hat <= delta} is an interval [lo, hi] of the ratio r = pi/mu (`gppo.theory.ratio_interval`).
Its half-widths hi - 1 and 1 - lo show the geometry: constant in q for PPO (TV, sample),
~ q^(-1/2) for RIPO (chi^2, cell), ~ q^(-1) for DPPO's binary TV (until the cap p <= 1).

Matched radii (`gppo.theory.matched_radii`, also used by `gppo sweep` and `gppo probe`): radii of different
divergences are not comparable as numbers (a KL of 0.05 is not a TV of 0.05). We read `delta`
as a reference TV radius at q = 0.5, i.e. the ratio interval [1 - 2 delta, 1 + 2 delta] that TV
allows a token of probability 0.5 under the sample and binary estimators (1/2 |r - 1| <= delta and
|p - q| <= delta coincide there; PPO's eps = 2 delta). Each (divergence, estimator) gets the radii
whose interval at q = 0.5 is exactly that one: delta_side = D-hat(q = 0.5, r = 1 -/+ 2 delta),
the estimate at the reference boundary ratio (`gppo.theory.estimate_at_ratio`). At delta = 0.15:
TV keeps 0.15 (sample, binary) and gets 0.075 with the cell estimator; binary KL gets 0.047
(DPPO pairs 0.05 with TV 0.15); chi^2-cell gets 2 delta^2 = 0.045 (RIPO uses 0.05).
Estimators without a ratio interval (topk, topp, full) get the binary estimator's radii: they are
finer partitions, so by data processing their estimate is >= the binary one and they never allow
more movement than binary does at the same radius.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from gppo import theory
from gppo.commands.common import DEFAULT_DELTA, DEFAULT_DIVERGENCES, DELTA_HELP, make_divergence
from gppo.options import CLI, ArgumentParser, add_arguments, check, option
from gppo.report import pyplot, save_figure, write_csv
from gppo.theory import REFERENCE_Q, matched_radii


def geometry_rows(divergences, delta: float, q, raw: bool = False, alpha: float = 0.5) -> list[dict]:
    """One row per (divergence, estimator, q): the radii used and the interval [lo, hi] of r."""
    rows = []
    for name in divergences:
        div = make_divergence(name, alpha)
        for est in theory.ratio_interval_estimators():
            low, high = (delta, delta) if raw else matched_radii(div, est, delta)
            lo, hi = theory.ratio_interval(div, est, q, low, high)
            rows += [
                dict(
                    divergence=name, estimator=est, delta_low=low, delta_high=high, q=float(x), lo=float(a), hi=float(b)
                )
                for x, a, b in zip(q, lo, hi)
            ]
    return rows


def plot_geometry(rows: list[dict], path: Path, title: str) -> Path:
    """One log-log panel per estimator: hi - 1 (solid) and 1 - lo (dashed) against q, per divergence."""
    plt = pyplot()
    names = list(dict.fromkeys(r["divergence"] for r in rows))
    colors = dict(zip(names, plt.cm.tab10.colors))
    estimators = list(dict.fromkeys(r["estimator"] for r in rows))
    fig, axes = plt.subplots(1, len(estimators), figsize=(15, 4.2), sharey=True, squeeze=False)
    axes = axes[0]
    for ax, est in zip(axes, estimators):
        for name in names:
            part = [r for r in rows if r["divergence"] == name and r["estimator"] == est]
            q = np.array([r["q"] for r in part])
            ax.loglog(q, [r["hi"] - 1 for r in part], color=colors[name], label=name)
            ax.loglog(q, [1 - r["lo"] for r in part], color=colors[name], linestyle="--")
        ax.set_title(f"estimator: {est}")
        ax.set_xlabel("q = mu(token)")
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel("hi - 1 (solid), 1 - lo (dashed)")
    axes[-1].legend(fontsize=8)
    fig.suptitle(title)
    return save_figure(fig, path)


def run_geometry(
    out: str | Path,
    delta: float = DEFAULT_DELTA,
    divergences=DEFAULT_DIVERGENCES,
    raw: bool = False,
    points: int = 81,
    alpha: float = 0.5,
) -> list[dict]:
    """Write OUT/geometry.csv and OUT/geometry.png; return the rows."""
    if points < 2 or not delta > 0:
        raise ValueError(f"need points >= 2 and delta > 0 (got points={points}, delta={delta})")
    rows = geometry_rows(divergences, delta, np.logspace(-4, 0, points), raw, alpha)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    write_csv(rows, out / "geometry.csv")
    radius = f"raw delta = {delta:g}" if raw else f"radii matched to TV delta = {delta:g} at q = {REFERENCE_Q:g}"
    plot_geometry(rows, out / "geometry.png", f"ratio interval [lo, hi] of a token of probability q ({radius})")
    return rows


# ------------------------------------------------------------------------------ command
@dataclass
class GeometryOptions:
    """Options of `gppo geometry`."""

    delta: float = option(DEFAULT_DELTA, DELTA_HELP, gt=0)
    raw: bool = option(False, "use --delta itself as every radius instead of matching")
    divergences: list[str] = option(list(DEFAULT_DIVERGENCES), "divergences to plot", example=["tv", "kl"])
    alpha: float = option(0.5, "alpha of divergence 'alpha'")
    points: int = option(81, "probabilities q on the log grid", ge=2)
    out: str = option("runs/geometry", "output directory")


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gppo geometry",
        description="The ratio interval [lo, hi] of pi/mu that a token of probability q may reach within the "
        "trust region, per divergence and estimator (sample, cell, binary), for q in [1e-4, 1]: "
        "geometry.csv and geometry.png (hi - 1 and 1 - lo on log-log axes).",
    )
    add_arguments(p, GeometryOptions)
    return p


def run(args) -> int:
    o = GeometryOptions(**check(GeometryOptions, vars(args), CLI))
    run_geometry(o.out, o.delta, o.divergences, o.raw, o.points, o.alpha)
    print(f"wrote {o.out}/geometry.csv and {o.out}/geometry.png")
    return 0
