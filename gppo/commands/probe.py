"""`gppo probe`: how faithful is each estimator to the exact divergence on a real model's tokens?

Procedure: sample one rollout batch from the model (mu), apply one GPPO update with the trainer's
own `update` (preset, lr, epochs and mini-batches from the settings; `PROBE_DEFAULTS` give a few
mini-batch steps at lr 1e-3, enough to move the policy measurably), which gives pi. Then recompute
mu and pi on the same tokens in float64 and, for every divergence and estimator, compare the
estimate D-hat with the exact full-vocabulary D_f(pi || mu) (estimator 'full') on every token:

- bias: mean(D-hat - D_f);
- spearman: rank correlation of D-hat and D_f over tokens (ties share their average rank);
- disagree: fraction of tokens where (D-hat > delta) != (D_f > delta), overall and per
  mu-probability bucket of the sampled token (`gppo.core.Q_BUCKETS`); delta is the
  divergence's matched radius (`gppo.theory.matched_radii`, the binary/full radii), delta_high
  where pi(a) > mu(a) and delta_low elsewhere, as the directional mask uses them;
- violations: tokens where a lower-bound estimator (all but 'sample', which is not a bound)
  exceeds D_f by more than 1e-6; data processing says there are none, so a count > 0 is a bug.

Also reported: the mu-mass covered by mu's top-K (mean over tokens), for K in `mass_ks`, and the
size of the update probed: the mean exact TV(pi, mu) per token and the median and largest
|log pi(a)/mu(a)| of the sampled tokens. The default update (lr 1e-3) is far larger than a
training step on purpose; the unbounded divergences (chi2, KL) then read very large on the few
tokens where mu is tiny, so their mean can reach 1e17 while their median stays small: both are
shown.

mu is the rollout policy: the sampling weights in --rollout_dtype (and --rollout_quantization), as
the trainer's `RolloutPolicy` builds them, so that a probe with --rollout_dtype bfloat16 measures pi
(float32, after the update) against a bfloat16 mu, the real training-inference mismatch. With the
HF engine that is the very model that sampled; another engine (vLLM) samples with its own
kernels, so the probe also reports how far its recomputed log mu(a) is from the log-prob the engine
recorded for the sampled token ("engine gap").

Memory: the exact divergences need mu's and pi's full-vocabulary distributions in float64; they
are computed a few sequences at a time (`chunk_rows`: about `CHUNK_BYTES` per pass; the forward
scores the completion positions only, so a pass holds [T, V] tensors per sequence, never the
prompt's logits), mu's weights wait in a temporary file during the update, and after it the
optimizer state and the gradients are freed and their pages handed back to the OS
(`gppo.allocator.release_free_memory`) before mu's copy is made. The peak is the update (weights,
gradients, AdamW's two moments, one micro-batch's activations; the training forward never holds
[N, T, V] logits), hence the small default micro-batch and rollout batch; on SmolLM2-135M at the
defaults it is about 3.5 GiB of RSS, and the comparison after it about 2 GiB. The probe evaluates
nothing: with --data and no --eval_data, --data itself stands in for the held-out split (one
record, never used), so a small file works.
"""

from __future__ import annotations

import copy
import math
import tempfile
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from rich.console import Console

import gppo
from gppo import ESTIMATORS
from gppo.allocator import release_free_memory
from gppo.commands.common import DEFAULT_DELTA, DEFAULT_DIVERGENCES, DELTA_HELP, make_divergence
from gppo.core import PARAM_DEFAULTS, Q_BUCKETS, drop_unused, q_buckets
from gppo.models.forward import ForwardOptions, policy_outputs
from gppo.options import CLI, ArgumentParser, add_arguments, check, given, option
from gppo.report import fmt, markdown_table, print_table, pyplot, save_figure, text_color, write_csv
from gppo.theory import matched_radii
from gppo.trainer import ConfigError, Trainer
from gppo.trainer.batch import Rollout
from gppo.trainer.config import add_config_arguments, config_values, from_dict
from gppo.trainer.rollout_policy import DTYPES, RolloutPolicy

PROBE_DEFAULTS = dict(
    lr=1e-3,
    epochs=1,
    prompts_per_step=32,
    group_size=8,
    mini_batch_size=64,
    micro_batch_size=4,
    rollout_batch_size=64,
    progress=False,
)
CHUNK_BYTES = 256 * 2**20  # memory of the full-vocabulary tensors of one pass of `token_values`
MASS_KS = (1, 5, 20, 50)
VIOLATION_TOL = 1e-6


def average_ranks(x: torch.Tensor) -> torch.Tensor:
    """Ranks 1..n of the values of x (float64); tied values share the mean of their positions."""
    sorted_x, order = torch.sort(x)
    _, inverse, counts = torch.unique_consecutive(sorted_x, return_inverse=True, return_counts=True)
    last = counts.cumsum(0).to(torch.float64)  # 1-based position of each tie group's last member
    ranks = torch.empty(len(x), dtype=torch.float64, device=x.device)
    ranks[order] = (last - (counts - 1) / 2)[inverse]
    return ranks


def spearman(x: torch.Tensor, y: torch.Tensor) -> float:
    """Spearman's rho: Pearson correlation of the average ranks; NaN when x or y is constant."""
    rx, ry = average_ranks(x), average_ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denominator = (rx.square().sum() * ry.square().sum()).sqrt()
    return float((rx * ry).sum() / denominator) if denominator > 0 else math.nan


def chunk_rows(rollout: Rollout, vocab: int, budget: int = CHUNK_BYTES) -> int:
    """Sequences per pass of `token_values` so that its full-vocabulary tensors stay near `budget`
    bytes. The forward (`policy_outputs`) scores the T completion positions only, from the last
    hidden states, so per sequence a pass holds [T, V] tensors: the float32 log-distribution the
    forward returns (its rows, then padded to [T, V]) before the float64 cast, and about 8 float64
    ones (log mu, log pi, mu, its sort and cumulative sum, |pi - mu|, the estimators' temporaries).
    The forward's own [rows, V] chunk (`gppo.token_stats`) does not grow with the pass."""
    per_row = (2 * 4 + 8 * 8) * rollout.token_ids.shape[1] * vocab
    return max(1, budget // per_row)


@torch.no_grad()
def token_values(
    mu_model,
    pi_model,
    rollout: Rollout,
    temperature: float,
    divergences,
    config: gppo.GPPOConfig,
    mass_ks=MASS_KS,
    chunk: int | None = None,
) -> dict:
    """Per generated token (1-D tensors): q = mu(a), up = pi(a) > mu(a), logratio = log pi(a) - log mu(a),
    the exact TV(pi, mu) 'tv_exact', mu's top-K mass 'mass@K', 'engine_gap' = |log mu(a) - the log-prob
    the rollout engine recorded|, and every estimate, keyed (divergence, estimator). top_k, top_p and
    alpha come from `config`; `chunk` sequences per pass (default: `chunk_rows`)."""
    parts = defaultdict(list)
    chunk = chunk or chunk_rows(rollout, mu_model.get_output_embeddings().weight.shape[0])
    for index in torch.arange(rollout.size, device=rollout.input_ids.device).split(chunk):
        sub = rollout.select(index)
        # each sequence alone (no prompt sharing): the values do not depend on which rows share a pass
        log_mu, log_pi = (
            policy_outputs(
                model, sub, temperature, return_log_probs=True, options=ForwardOptions(share_prompt=False)
            ).log_probs.double()
            for model in (mu_model, pi_model)
        )
        vocab = log_mu.shape[-1]
        top_k = min(config.top_k or PARAM_DEFAULTS["top_k"], vocab)
        topk_logq, topk_ids = log_mu.topk(top_k, -1)
        ids = sub.token_ids[..., None]
        batch = gppo.TokenBatch(
            logp=log_pi.gather(-1, ids).squeeze(-1),
            logp_behavior=log_mu.gather(-1, ids).squeeze(-1),
            advantages=torch.zeros(len(index), device=log_mu.device),
            mask=sub.response_mask,
            token_ids=sub.token_ids,
            topk_ids=topk_ids,
            topk_logp_behavior=topk_logq,
            topk_logp=log_pi.gather(-1, topk_ids),
            logits=log_pi,
            logp_behavior_full=log_mu,
        )
        valid = sub.response_mask.bool()
        parts["q"].append(batch.logp_behavior.exp()[valid])
        parts["up"].append((batch.logp > batch.logp_behavior)[valid])
        parts["logratio"].append((batch.logp - batch.logp_behavior)[valid])
        parts["engine_gap"].append((batch.logp_behavior - sub.logp_behavior.double())[valid].abs())
        mu = log_mu.exp()
        parts["tv_exact"].append(0.5 * (log_pi.exp() - mu).abs().sum(-1)[valid])
        covered = mu.sort(-1, descending=True).values.cumsum(-1)
        del mu
        for k in mass_ks:
            parts[f"mass@{k}"].append(covered[..., min(k, vocab) - 1][valid])
        for div in divergences:
            for est in ESTIMATORS:
                settings = dict(
                    divergence=div, estimator=est, rule="mask", alpha=config.alpha, top_k=top_k, top_p=config.top_p
                )
                point = gppo.GPPOConfig(**drop_unused({k: v for k, v in settings.items() if v is not None}))
                parts[(div, est)].append(gppo.estimate(point, batch)[valid])
    return {key: torch.cat(values) for key, values in parts.items()}


def faithfulness(tokens: dict, delta: float, alpha: float = 0.5) -> list[dict]:
    """One row per (divergence, estimator): bias, Spearman, decision disagreement and violations
    against the exact D_f (see the module docstring)."""
    divergences = list(dict.fromkeys(key[0] for key in tokens if isinstance(key, tuple)))
    buckets = q_buckets(tokens["q"])
    rows = []
    for div in divergences:
        low, high = matched_radii(make_divergence(div, alpha), "full", delta)
        threshold = torch.where(tokens["up"], high, low)
        exact = tokens[(div, "full")]
        for est in ESTIMATORS:
            value = tokens[(div, est)]
            disagree = (value > threshold) != (exact > threshold)
            row = {
                "divergence": div,
                "estimator": est,
                "delta_low": low,
                "delta_high": high,
                "tokens": len(value),
                "exact_mean": exact.mean().item(),
                "exact_median": exact.median().item(),
                "estimate_mean": value.mean().item(),
                "bias": (value - exact).mean().item(),
                "spearman": spearman(value, exact),
                "disagree": disagree.double().mean().item(),
                "violations": None if est == "sample" else int((value - exact > VIOLATION_TOL).sum()),
            }
            for name, member in buckets.items():
                row[f"disagree {name}"] = disagree[member].double().mean().item() if member.any() else math.nan
            rows.append(row)
    return rows


def plot_probe(rows: list[dict], path: Path, title: str) -> Path:
    """Two Divergence x Estimator images: Spearman with the exact D_f, and the disagreement fraction."""
    plt = pyplot()
    divs = list(dict.fromkeys(r["divergence"] for r in rows))
    ests = list(ESTIMATORS)
    fig, axes = plt.subplots(1, 2, figsize=(13, 0.5 * len(divs) + 2.2))
    for ax, key, cmap, limits in zip(axes, ("spearman", "disagree"), ("viridis", "magma_r"), ((-1, 1), (0, None))):
        grid = np.full((len(divs), len(ests)), np.nan)
        for r in rows:
            grid[divs.index(r["divergence"]), ests.index(r["estimator"])] = r[key]
        image = ax.imshow(grid, cmap=cmap, vmin=limits[0], vmax=limits[1], aspect="auto")
        for (i, j), value in np.ndenumerate(grid):
            ax.text(j, i, f"{value:.2f}", ha="center", va="center", fontsize=8, color=text_color(image, value))
        fig.colorbar(image, ax=ax)
        ax.set_xticks(range(len(ests)), ests)
        ax.set_yticks(range(len(divs)), divs)
        ax.set_title(f"{key} vs exact D_f")
    fig.suptitle(title, fontsize=9)
    return save_figure(fig, path)


def run_probe(
    base: dict,
    out: str | Path,
    delta: float = DEFAULT_DELTA,
    divergences=DEFAULT_DIVERGENCES,
    mass_ks=MASS_KS,
    console: Console | None = None,
) -> dict:
    """Sample, update once, compare every estimator with the exact D_f; write probe.csv, probe.md and
    probe.png into `out`. Returns {"rows", "mass", "token_share", "update"}."""
    console = console or Console()
    if "output_dir" in base:
        raise ConfigError("the probe writes into `out` (--out), not output_dir: remove output_dir")
    matched_radii("tv", "full", delta)  # checks delta before any work
    out = Path(out)
    # The probe evaluates nothing: a one-record held-out split read from --data itself, so that no
    # training record is held out and a small file works.
    no_heldout = {
        "eval_size": 1,
        **({"eval_data": base["data"], "eval_split": base.get("data_split", "train")} if base.get("data") else {}),
    }
    config = from_dict({**PROBE_DEFAULTS, **no_heldout, **base, "output_dir": str(out)})
    trainer = Trainer(config, console=console)
    rollout, rollout_stats = trainer.rollout()
    if rollout is None or not rollout.advantages.abs().max() > 0:
        truncated = rollout_stats.get("rollout/truncated_frac", 0.0)
        cut = (
            f"; {truncated:.0%} of the completions hit --max_new_tokens {config.max_new_tokens}: a real model "
            "may need more (e.g. --max_new_tokens 40 --temperature 0.7 on word-problems)"
            if truncated >= 0.5
            else ""
        )
        raise ValueError(
            "every group of the rollout had equal rewards, so the update would not move the policy: "
            "use a model that solves some problems (the embedded warm start), more prompts "
            f"(--prompts_per_step) or a graded reward (--reward_funcs){cut}"
        )
    rollout = trainer.prepare(rollout)
    with tempfile.TemporaryDirectory() as scratch:  # mu's weights wait on disk while the update holds AdamW's state
        torch.save(trainer.model.state_dict(), Path(scratch) / "mu.pt")
        update = trainer.update(rollout)
        trainer.optimizer.state.clear()  # AdamW's two moments (twice the weights) are not needed any more
        trainer.model.zero_grad(set_to_none=True)
        release_free_memory()  # their pages (and the update's activations') back to the OS before mu's copy
        mu_weights = copy.deepcopy(trainer.model)
        mu_weights.load_state_dict(torch.load(Path(scratch) / "mu.pt", mmap=True))
    rollout_dtype = config.sampling_dtype(trainer.device)
    mu_model = RolloutPolicy(mu_weights, DTYPES[rollout_dtype], config.rollout_quantization).model
    del mu_weights  # the rollout copy (when the dtype differs) is all that is needed
    loss_config = config.gppo_config()
    tokens = token_values(mu_model, trainer.model, rollout, config.temperature, divergences, loss_config, mass_ks)
    rows = faithfulness(tokens, delta, loss_config.alpha)
    mass = {k: tokens[f"mass@{k}"].mean().item() for k in mass_ks}
    share = {name: member.double().mean().item() for name, member in q_buckets(tokens["q"]).items()}
    size = update_size(tokens)
    mu_note = (", int8 weights" if config.rollout_quantization == "int8" else "") + (
        " (recomputed by transformers; the engine sampled with its own kernels)" if config.engine != "hf" else ""
    )

    write_csv(rows, out / "probe.csv")
    header = [
        "divergence",
        "estimator",
        "δ low / high",
        "exact mean",
        "exact median",
        "bias",
        "spearman",
        "disagree",
        *Q_BUCKETS,
        "violations",
    ]
    body = [
        [
            r["divergence"],
            r["estimator"],
            f"{r['delta_low']:.4g} / {r['delta_high']:.4g}",
            f"{r['exact_mean']:.3g}",
            f"{r['exact_median']:.3g}",
            f"{r['bias']:.3g}",
            f"{r['spearman']:.3f}",
            f"{r['disagree']:.3f}",
            *(fmt(r[f"disagree {b}"], missing="–") for b in Q_BUCKETS),
            "" if r["violations"] is None else str(r["violations"]),
        ]
        for r in rows
    ]
    setting = (
        f"{len(tokens['q'])} tokens; update: preset {config.preset}, lr {config.lr:g}, epochs {config.epochs}, "
        f"{math.ceil(rollout.size / config.mini_batch_size)} mini-batches of {config.mini_batch_size} sequences "
        f"(masked fraction {update.get('loss/masked_frac', math.nan):.3f}, rollout accuracy "
        f"{rollout_stats['rollout/accuracy']:.3f}); decisions at radii matched to TV delta={delta:g} at q=0.5. "
        f"Update size: mean exact TV(pi, mu) per token {size['tv_mean']:.3g}, |log pi(a)/mu(a)| of the sampled "
        f"tokens median {size['logratio_median']:.3g}, max {size['logratio_max']:.3g} (lr {config.lr:g}, far above a "
        f"training step's on purpose: lower --lr for a smaller one; unbounded divergences such as chi2 read "
        f"huge on tokens where mu is tiny: compare the exact medians). mu: the rollout policy in "
        f"{rollout_dtype}{mu_note}; its log mu(a) against the log-prob engine {config.engine} recorded: "
        f"|difference| median {size['engine_gap_median']:.2g}, max {size['engine_gap_max']:.2g}"
    )
    mass_table = markdown_table(
        ["K", *map(str, mass_ks)], [["mu-mass of mu's top-K", *(f"{v:.4f}" for v in mass.values())]]
    )
    share_table = markdown_table(
        ["bucket of mu(a)", *Q_BUCKETS], [["share of tokens", *(f"{v:.3f}" for v in share.values())]]
    )
    (out / "probe.md").write_text(
        f"# gppo probe: {out}\n\n{setting}\n\n" + markdown_table(header, body) + "\n" + mass_table + "\n" + share_table
    )
    plot_probe(rows, out / "probe.png", setting)
    print_table(console, "estimator faithfulness (disagree per bucket of mu(a))", header, body)
    console.print(
        f"{setting}\nmu-mass of mu's top-K: " + ", ".join(f"K={k}: {v:.4f}" for k, v in mass.items()), soft_wrap=True
    )
    console.print(f"results in {out}/: probe.md, probe.csv, probe.png", soft_wrap=True)
    return {"rows": rows, "mass": mass, "token_share": share, "update": update, "update_size": size}


def update_size(tokens: dict) -> dict:
    """How far the probed update moved pi from mu: the mean exact TV per token and the median and
    largest |log pi(a) - log mu(a)| of the sampled tokens; and the median and largest engine gap."""
    logratio, gap = tokens["logratio"].abs(), tokens["engine_gap"]
    return {
        "tv_mean": tokens["tv_exact"].mean().item(),
        "logratio_median": logratio.median().item(),
        "logratio_max": logratio.max().item(),
        "engine_gap_median": gap.median().item(),
        "engine_gap_max": gap.max().item(),
    }


# ------------------------------------------------------------------------------ command
@dataclass
class ProbeOptions:
    """Options of `gppo probe` (the training flags set the model, data and update)."""

    delta: float = option(
        DEFAULT_DELTA, DELTA_HELP + "; the probe's decisions use the binary radii of each divergence", "probe", gt=0
    )
    divergences: list[str] = option(list(DEFAULT_DIVERGENCES), "divergences to compare", "probe", example=["tv", "kl"])
    mass_k: list[int] = option(list(MASS_KS), "K of the top-K mu-mass report", "probe", ge=1)
    out: str | None = option(None, "output directory (default: runs/probe-<task>)", "probe")


def parser() -> ArgumentParser:
    p = ArgumentParser(
        prog="gppo probe",
        description="Estimator faithfulness: sample from the model (mu), apply one GPPO update (pi), and compare "
        "every estimator of every divergence with the exact full-vocabulary D_f on each token (bias, "
        "Spearman, decision disagreement by mu-probability bucket, lower-bound violations). Training "
        "flags set the model, data and update (probe defaults: --lr 0.001 --epochs 1 "
        "--mini_batch_size 64 --micro_batch_size 4 --rollout_batch_size 64; no held-out split is "
        "needed); mu is the rollout policy in --rollout_dtype.",
    )
    add_arguments(p.add_argument_group("probe"), ProbeOptions)
    add_config_arguments(p)
    return p


def run(args) -> int:
    o = ProbeOptions(**check(ProbeOptions, given(args, ProbeOptions), CLI))
    base = config_values(args)
    run_probe(base, o.out or f"runs/probe-{base.get('task', 'addition')}", o.delta, o.divergences, o.mass_k)
    return 0
