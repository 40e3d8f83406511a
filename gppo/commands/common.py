"""Settings shared by `gppo sweep`, `gppo probe` and `gppo geometry`: default radius and divergences."""

from __future__ import annotations

import gppo

DEFAULT_DELTA = 0.15  # DPPO's TV radius
# alpha = 0.5 is twice the squared Hellinger distance: left out unless asked for (--divergences alpha).
DEFAULT_DIVERGENCES = tuple(name for name in gppo.DIVERGENCES if name != "alpha")

DELTA_HELP = (
    "reference TV radius at q = 0.5: every (divergence, estimator) gets the radii whose ratio interval "
    "for a token of probability 0.5 is [1 - 2 delta, 1 + 2 delta], the one TV allows there (matched with "
    "gppo.theory's estimate at the boundary ratio). topk, topp and full have no ratio interval and get "
    "the binary radii: a finer partition never estimates less than binary, so at those radii they allow "
    "at most the binary interval"
)


def make_divergence(name: str, alpha: float | None = 0.5) -> gppo.Divergence:
    """The divergence `name`; alpha goes to the divergences that declare it (None: their default)."""
    uses_alpha = alpha is not None and "alpha" in gppo.DIVERGENCES.lookup(name).params
    return gppo.divergence(name, **({"alpha": alpha} if uses_alpha else {}))
