"""The `gppo` command: train, eval, presets, warmstart, sweep, probe, geometry."""

from __future__ import annotations

import argparse
import difflib
import sys


def _reject_unknown(parser: argparse.ArgumentParser, extra: list[str]) -> None:
    """argparse's own message names no alternative; ours names the closest valid flag."""
    if not extra:
        return
    flags = [opt for action in parser._actions for opt in action.option_strings if opt.startswith("--")]
    word = next((e for e in extra if e.startswith("-")), extra[0])
    flag = word.split("=", 1)[0]
    match = difflib.get_close_matches(flag, flags, n=1, cutoff=0.5)
    hint = f" (did you mean {match[0]}?)" if match else ""
    parser.error(f"unknown option {flag}{hint}; see `{parser.prog} --help`" if flag.startswith("-")
                 else f"unexpected argument {word!r}")


def _train(argv: list[str]) -> int:
    from gppo.trainer.config import add_config_arguments, config_from_args, ALL_KEYS

    parser = argparse.ArgumentParser(
        prog="gppo train", allow_abbrev=False, formatter_class=argparse.ArgumentDefaultsHelpFormatter,
        description="Run GPPO reinforcement learning. With no arguments: the embedded tiny Qwen2, "
                    "warm-started on 3-digit addition, trained with the `gppo` preset (a few minutes on a CPU).")
    parser.add_argument("--resume", metavar="RUN_DIR", help="continue the run in RUN_DIR from its last checkpoint "
                        "(flags given with it override the saved config, e.g. a larger --steps)")
    add_config_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    _reject_unknown(parser, extra)

    from gppo.trainer.config import ConfigError
    from gppo.trainer.trainer import Trainer

    try:
        if args.resume:
            overrides = {k: v for k, v in vars(args).items() if k in ALL_KEYS}
            trainer = Trainer.resume(args.resume, overrides)
        else:
            trainer = Trainer(config_from_args(args))
        trainer.train()
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"gppo train: error: {err}", file=sys.stderr)
        return 2
    return 0


def _eval(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gppo eval", allow_abbrev=False,
        description="Score a model on competition benchmarks (avg@n, pass@k) or on a built-in task.")
    parser.add_argument("--model", required=True, help="Hugging Face causal-LM directory (e.g. RUN_DIR/final)")
    parser.add_argument("--benchmark", nargs="+", default=[], help="benchmark names (aime24 aime25 amc23 math500 "
                        "minerva olympiadbench livecodebench codeforces humanevalplus)")
    parser.add_argument("--data", nargs="+", default=[], help="local data files, one per --benchmark, same order")
    parser.add_argument("--task", help="built-in task instead of benchmarks (addition, countdown)")
    parser.add_argument("-n", type=int, help="samples per problem (default: each benchmark's protocol; task: 4)")
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top_p", type=float)
    parser.add_argument("--max_tokens", type=int)
    parser.add_argument("--limit", type=int, help="first N problems of each benchmark")
    parser.add_argument("--from_hub", action="store_true", help="load benchmarks through `datasets` from the Hub")
    parser.add_argument("--engine", default="hf", help="hf or vllm")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--batch_size", type=int, default=16, help="problems generated together")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/eval", help="output directory (resumable)")
    parser.add_argument("--eval_size", type=int, default=1024, help="--task: held-out problems")
    args, extra = parser.parse_known_args(argv)
    _reject_unknown(parser, extra)
    if bool(args.task) == bool(args.benchmark):
        parser.error("give either --benchmark (with --data or --from_hub) or --task")
    if args.data and len(args.data) != len(args.benchmark):
        parser.error(f"--data has {len(args.data)} files for {len(args.benchmark)} benchmarks: give one per benchmark")

    from gppo.evaluation import evaluate, evaluate_problems
    from gppo.models.embedded import load_model_and_tokenizer
    from gppo.rollout import make_engine
    from gppo.trainer.trainer import _resolve_device

    try:
        model, tokenizer = load_model_and_tokenizer(args.model)
        device = _resolve_device(args.device)
        engine = make_engine(args.engine, model.to(device), tokenizer, model_path=args.model, device=device,
                             seed=args.seed)
        if args.task:
            from gppo.tasks import get_task, heldout_problems

            task = get_task(args.task)
            problems = heldout_problems(task, args.eval_size)
            result = evaluate_problems(
                engine, problems, lambda ps, cs: [task.score(p, c) for p, c in zip(ps, cs)],
                [p.prompt for p in problems], args.n or 4, args.temperature if args.temperature is not None else 1.0,
                args.max_tokens or 32, args.seed)
            for key, value in result.items():
                print(f"{key:<20} {value:.4f}")
        else:
            evaluate(engine, args.benchmark, dict(zip(args.benchmark, args.data)), n=args.n, out_dir=args.out,
                     temperature=args.temperature, top_p=args.top_p, max_tokens=args.max_tokens, seed=args.seed,
                     from_hub=args.from_hub, limit=args.limit, batch_size=args.batch_size)
    except (FileNotFoundError, ValueError) as err:
        print(f"gppo eval: error: {err}", file=sys.stderr)
        return 2
    return 0


def _presets(argv: list[str]) -> int:
    argparse.ArgumentParser(prog="gppo presets", description="List the presets and their points in the "
                            "design space.").parse_args(argv)
    from rich.console import Console
    from rich.table import Table

    import gppo

    table = Table(title="GPPO presets (gppo train --preset NAME; any field can be overridden)")
    for column in ("preset", "divergence", "estimator", "rule", "delta low/high", "other", "method", "source"):
        table.add_column(column)
    point = {"divergence", "estimator", "rule", "delta_low", "delta_high"}
    for name, p in gppo.PRESETS.items():
        cfg = gppo.preset(name)
        other = ", ".join(f"{k}={v}" for k, v in p.fields.items() if k not in point and v is not None)
        table.add_row(name, str(cfg.divergence), str(cfg.estimator), cfg.rule,
                      " / ".join("-" if d is None else f"{d:.4g}" for d in (cfg.delta_low, cfg.delta_high)), other, p.summary, p.source)
    Console(width=200).print(table)
    return 0


def _warmstart(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="gppo warmstart", allow_abbrev=False,
                                     description="Supervised warm start of the embedded model on a built-in task.")
    parser.add_argument("--task", default="addition")
    parser.add_argument("--out", required=True, help="output folder (HF format)")
    parser.add_argument("--steps", type=int)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=int)
    args = parser.parse_args(argv)
    from gppo.warmstart import warm_start

    warm_start(args.task, args.out, steps=args.steps, seed=args.seed, threads=args.threads)
    return 0


DELTA_HELP = ("reference TV radius at q = 0.5: every (divergence, estimator) gets the radii whose ratio interval "
              "for a token of probability 0.5 is [1 - 2 delta, 1 + 2 delta], the one TV allows there (matched with "
              "gppo.theory's estimate at the boundary ratio). topk, topp and full have no ratio interval and get "
              "the binary radii: a finer partition never estimates less than binary, so at those radii they allow "
              "at most the binary interval")


def _sweep(argv: list[str]) -> int:
    from gppo.trainer.config import ConfigError, add_config_arguments, config_values

    parser = argparse.ArgumentParser(
        prog="gppo sweep", allow_abbrev=False,
        description="Run a grid of GPPO runs (divergences x estimators x seeds with the directional mask, or "
                    "presets x seeds) in parallel, resumably, and summarize it over seeds (sweep.csv, sweep.md, "
                    "heatmap.png). Training flags below apply to every run, e.g. --steps 60 --task countdown.")
    grid = parser.add_argument_group("sweep")
    grid.add_argument("--divergences", nargs="+", help="grid rows (default: every divergence but alpha)")
    grid.add_argument("--estimators", nargs="+", help="grid columns (default: every estimator)")
    grid.add_argument("--presets", nargs="+", help="run these presets (with their own radii) instead of a grid")
    grid.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2], help="seeds of every cell (default: 0 1 2)")
    grid.add_argument("--delta", type=float, help=DELTA_HELP + " (default: 0.15; presets keep their own radii)")
    grid.add_argument("--workers", type=int, help="runs at once (default: the number of cores; each run uses "
                      "--threads, default 1)")
    grid.add_argument("--target", type=float, help="report the first step whose sampled avg@k reaches this accuracy")
    grid.add_argument("--out", default="runs/sweep",
                      help="sweep directory; rerun the same command to resume (default: runs/sweep)")
    add_config_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    _reject_unknown(parser, extra)

    from gppo.sweep import run_sweep

    try:
        result = run_sweep(config_values(args), args.out, args.seeds, args.divergences, args.estimators, args.presets,
                           args.delta, args.workers, args.target)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"gppo sweep: error: {err}", file=sys.stderr)
        return 2
    return 1 if result["failed"] else 0


def _probe(argv: list[str]) -> int:
    from gppo.trainer.config import ConfigError, add_config_arguments, config_values

    parser = argparse.ArgumentParser(
        prog="gppo probe", allow_abbrev=False,
        description="Estimator faithfulness: sample from the model (mu), apply one GPPO update (pi), and compare "
                    "every estimator of every divergence with the exact full-vocabulary D_f on each token (bias, "
                    "Spearman, decision disagreement by mu-probability bucket, lower-bound violations). Training "
                    "flags set the model, data and update (probe defaults: --lr 0.001 --epochs 1 "
                    "--mini_batch_size 64).")
    probe = parser.add_argument_group("probe")
    probe.add_argument("--delta", type=float, default=0.15, help=DELTA_HELP + "; the probe's decisions use the binary "
                       "radii of each divergence (default: 0.15)")
    probe.add_argument("--divergences", nargs="+", help="default: every divergence but alpha")
    probe.add_argument("--mass_k", nargs="+", type=int, default=[1, 5, 20, 50],
                       help="K of the top-K mu-mass report (default: 1 5 20 50)")
    probe.add_argument("--out", help="output directory (default: runs/probe-<task>)")
    add_config_arguments(parser)
    args, extra = parser.parse_known_args(argv)
    _reject_unknown(parser, extra)

    from gppo.geometry import DEFAULT_DIVERGENCES
    from gppo.probe import run_probe

    try:
        base = config_values(args)
        run_probe(base, args.out or f"runs/probe-{base.get('task', 'addition')}", args.delta,
                  args.divergences or DEFAULT_DIVERGENCES, args.mass_k)
    except (ConfigError, FileNotFoundError, ValueError) as err:
        print(f"gppo probe: error: {err}", file=sys.stderr)
        return 2
    return 0


def _geometry(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(
        prog="gppo geometry", allow_abbrev=False,
        description="The ratio interval [lo, hi] of pi/mu that a token of probability q may reach within the "
                    "trust region, per divergence and estimator (sample, cell, binary), for q in [1e-4, 1]: "
                    "geometry.csv and geometry.png (hi - 1 and 1 - lo on log-log axes).")
    parser.add_argument("--delta", type=float, default=0.15, help=DELTA_HELP + " (default: 0.15)")
    parser.add_argument("--raw", action="store_true", help="use --delta itself as every radius instead of matching")
    parser.add_argument("--divergences", nargs="+", help="default: every divergence but alpha")
    parser.add_argument("--alpha", type=float, default=0.5, help="alpha of divergence 'alpha' (default: 0.5)")
    parser.add_argument("--points", type=int, default=81, help="probabilities q on the log grid (default: 81)")
    parser.add_argument("--out", default="runs/geometry", help="output directory (default: runs/geometry)")
    args, extra = parser.parse_known_args(argv)
    _reject_unknown(parser, extra)

    from gppo.geometry import DEFAULT_DIVERGENCES, run_geometry

    try:
        run_geometry(args.out, args.delta, args.divergences or DEFAULT_DIVERGENCES, args.raw, args.points, args.alpha)
    except ValueError as err:
        print(f"gppo geometry: error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {args.out}/geometry.csv and {args.out}/geometry.png")
    return 0


COMMANDS = {"train": _train, "eval": _eval, "presets": _presets, "warmstart": _warmstart, "sweep": _sweep,
            "probe": _probe, "geometry": _geometry}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: gppo {" + ",".join(COMMANDS) + "} [options]\n\n"
              "  train      run GPPO RL (no arguments: the embedded default, a few CPU minutes)\n"
              "  eval       score a model on benchmarks or a built-in task\n"
              "  presets    list the presets (points of Divergence x Estimator x Rule)\n"
              "  warmstart  supervised warm start of the embedded model\n"
              "  sweep      a grid of runs (divergences x estimators or presets, x seeds) and its summary\n"
              "  probe      estimator faithfulness against the exact divergence after one update\n"
              "  geometry   the ratio interval each divergence x estimator allows a token of probability q\n")
        return 0
    command, rest = argv[0], argv[1:]
    if command not in COMMANDS:
        match = difflib.get_close_matches(command, COMMANDS, n=1)
        print(f"gppo: unknown command {command!r}" + (f" (did you mean {match[0]!r}?)" if match else ""),
              file=sys.stderr)
        return 2
    return COMMANDS[command](rest)


if __name__ == "__main__":
    sys.exit(main())
