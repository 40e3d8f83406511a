"""The `gppo` commands, one module each, built on the library's public functions.

Each module defines `parser()` (a `gppo.options.ArgumentParser` whose flags come from a typed
options dataclass: `TrainConfig`, `EvalConfig`, ...) and `run(args) -> exit status`. `gppo.cli`
dispatches to them and turns every expected error into one line `gppo <command>: error: ...`.
"""

COMMANDS = {
    "train": "run GPPO RL (no arguments: the embedded default, a few CPU minutes)",
    "eval": "score a model on benchmarks or a built-in task",
    "presets": "list the presets (points of Divergence x Estimator x Rule)",
    "warmstart": "supervised warm start of the embedded model",
    "sweep": "a grid of runs (divergences x estimators or presets, x seeds) and its summary",
    "probe": "estimator faithfulness against the exact divergence after one update",
    "geometry": "the ratio interval each divergence x estimator allows a token of probability q",
}
