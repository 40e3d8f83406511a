"""`gppo presets`: the presets and their points in the design space."""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

import gppo
from gppo.options import ArgumentParser


def parser() -> ArgumentParser:
    return ArgumentParser(prog="gppo presets", description="List the presets and their points in the design space.")


def run(args) -> int:
    table = Table(title="GPPO presets (gppo train --preset NAME; any field can be overridden)")
    for column in ("preset", "divergence", "estimator", "rule", "delta low/high", "other", "method", "source"):
        table.add_column(column)
    point = {"divergence", "estimator", "rule", "delta_low", "delta_high"}
    for name, p in gppo.PRESETS.items():
        cfg = gppo.preset(name)
        other = ", ".join(f"{k}={v}" for k, v in p.fields.items() if k not in point and v is not None)
        cells = (
            name,
            str(cfg.divergence),
            str(cfg.estimator),
            cfg.rule,
            " / ".join("-" if d is None else f"{d:.4g}" for d in (cfg.delta_low, cfg.delta_high)),
            other,
            p.summary,
            p.source,
        )
        table.add_row(*map(escape, cells))  # the texts are plain: "sg[min(r, 5)]" is no markup
    Console(width=200).print(table)
    return 0
