"""Generate and score: the batch an RL step trains on (TRL's generate-and-score side).

`RolloutGenerator(step)` samples group_size completions for each of prompts_per_step prompts and
rewards them. With dynamic sampling (DAPO) the groups whose rewards are all equal are dropped and
new prompts sampled in their place, for at most max_resample_rounds more rounds. The kept groups
get group-relative advantages (`gppo.advantages`) and become a `Rollout`; for an estimator
anchored on mu's whole distribution ('full') the rollout also carries that distribution. The
`Trainer` takes it from there: pi_old and the reference's log-probs, the update.

Round r of step k samples with seed derived_seed(seed, k) * 64 + r, so that a resumed run draws
the completions an uninterrupted one would.

Lengths count the model's tokens (`model_tokens`): a tool's output is context, not length. The
first step in which more than TRUNCATION_WARNING of the completions hit max_new_tokens warns once
per run, naming the flag.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

import gppo
from gppo.advantages import group_advantages, informative_groups
from gppo.models.forward import policy_outputs
from gppo.prompts import PromptBuilder
from gppo.rewards.pipeline import RewardPipeline, load_function, model_tokens
from gppo.rollout import Generation, GroupRequest, RolloutEngine, SamplingParams
from gppo.rollout.hf import encode
from gppo.rollout.tools import tool_stats
from gppo.trainer.batch import Rollout, on_device, pad_to, rollout_from_generations
from gppo.trainer.config import TrainConfig
from gppo.trainer.data import DatasetSource, TaskSource, derived_seed
from gppo.trainer.rollout_policy import RolloutPolicy

TRUNCATION_WARNING = 0.5  # share of a step's completions cut at max_new_tokens beyond which the run warns


@dataclass
class SampledGroups:
    """Every group sampled for one step, over all rounds, and the groups kept for training."""

    generations: list[Generation] = field(default_factory=list)  # every completion, group by group
    rewards: list[torch.Tensor] = field(default_factory=list)  # per round: [groups, group_size]
    accuracy: list[float] = field(default_factory=list)  # per completion: the verifier's score
    reward_fn_warnings: int = 0
    rounds: int = 0
    kept_generations: list[Generation] = field(default_factory=list)
    kept_rewards: list[torch.Tensor] = field(default_factory=list)  # per kept group: [group_size]

    def add(self, gens: list[Generation], rewards: torch.Tensor, accuracy, warnings: int, keep: torch.Tensor) -> None:
        """Groups sampled: their completions (group by group), rewards [groups, group_size], scores,
        reward warnings, and which of them train (`keep`)."""
        size = rewards.shape[1]
        self.generations.extend(gens)
        self.rewards.append(rewards)
        self.accuracy.extend(accuracy)
        self.reward_fn_warnings += warnings
        for group in keep.nonzero().flatten().tolist():
            self.kept_rewards.append(rewards[group])
            self.kept_generations.extend(gens[group * size : (group + 1) * size])


def group_seeds(seed: int, step: int, round_: int, group: int, size: int) -> tuple[int, ...]:
    """The seeds of the `size` completions of group `group` of round `round_` of step `step`: each
    completion draws from a random stream of its own, so that a group samples the same tokens
    whichever groups share the engine's batch (synchronous, or streamed: gppo.trainer.group_stream)."""
    base = derived_seed(derived_seed(seed, step) * 64 + round_, group)
    return tuple((base * size + row) % 2**63 for row in range(size))


def reward_pipeline(config: TrainConfig, verifier) -> RewardPipeline:
    """The run's rewards: the task's `verifier` (None with --reward_funcs alone), the user's reward
    functions, the format reward and DAPO's overlong penalty."""
    return RewardPipeline(
        verifier=verifier,
        user_functions=[(path, load_function(path)) for path in config.reward_funcs],
        weights=list(config.reward_weights),
        format_pattern=config.format_pattern,
        format_reward=config.format_reward,
        max_length=config.max_new_tokens,
        overlong_buffer=config.overlong_buffer,
        max_failures=config.reward_fn_max_failures,
        timeout_s=config.reward_fn_timeout,
    )


def rollout_stats(sampled: SampledGroups, seconds: float) -> dict:
    """The rollout/ metrics of a step, over every group sampled (kept or not), and the sampling
    speed in sampled tokens per second of the `seconds` it took; lengths are the model's tokens."""
    rewards = torch.cat(sampled.rewards)
    gens = sampled.generations
    lengths = torch.tensor([model_tokens(g.completion_ids, g.tool_mask) for g in gens], dtype=torch.float)
    return {
        "rollout/reward_mean": rewards.mean().item(),
        "rollout/reward_std": rewards.std().item(),
        "rollout/accuracy": sum(sampled.accuracy) / len(sampled.accuracy),
        "rollout/zero_variance_groups": 1 - informative_groups(rewards).float().mean().item(),
        "rollout/length_mean": lengths.mean().item(),
        "rollout/length_max": lengths.max().item(),
        "rollout/truncated_frac": sum(g.finish_reason == "length" for g in gens) / len(gens),
        "rollout/reward_fn_warnings": sampled.reward_fn_warnings,
        "rollout/rounds": sampled.rounds,
        "rollout/groups_kept": len(sampled.kept_rewards),
        "perf/rollout_tokens_per_s": lengths.sum().item() / max(seconds, 1e-9),
        "perf/rollout_seconds": seconds,
        **tool_stats(gens, "rollout/"),
    }


class RolloutGenerator:
    """The batch of each step, sampled by `engine` from the rollout policy and rewarded by
    `rewards` (see the module docstring)."""

    def __init__(
        self,
        config: TrainConfig,
        loss_config: gppo.GPPOConfig,
        source: TaskSource | DatasetSource,
        prompts: PromptBuilder,
        engine: RolloutEngine,
        rewards: RewardPipeline,
        tokenizer,
        rollout_policy: RolloutPolicy,
        device: torch.device,
    ):
        self.config, self.loss_config, self.source, self.prompts = config, loss_config, source, prompts
        self.engine, self.rewards, self.tokenizer = engine, rewards, tokenizer
        self.rollout_policy, self.device = rollout_policy, device
        self.top_k = loss_config.rollout_top_k
        self.warned_truncation = False

    def __call__(self, step: int, policy_version: Callable[[], int] | None = None) -> tuple[Rollout | None, dict]:
        """Step `step`'s batch (None when no group was kept) and its rollout metrics. `policy_version`:
        the engine may take new weights between decoding steps (SamplingParams.policy_version)."""
        start = time.time()
        sampled = self._sample_groups(step, policy_version)
        return self.batch(step, sampled, time.time() - start)

    def batch(self, step: int, sampled: SampledGroups, seconds: float) -> tuple[Rollout | None, dict]:
        """The batch of the groups `sampled` kept (None when none was), with group-relative
        advantages, and the rollout metrics of every group sampled, in `seconds`."""
        stats = rollout_stats(sampled, seconds)
        self._warn_truncation(step, stats["rollout/truncated_frac"])
        if not sampled.kept_rewards:
            return None, stats
        advantages = group_advantages(torch.stack(sampled.kept_rewards), self.config.advantage).flatten()
        rollout = rollout_from_generations(
            sampled.kept_generations, advantages, self.tokenizer.pad_token_id, self.top_k
        )
        if self.loss_config.anchor_distribution == "logp_behavior_full":
            rollout = dataclasses.replace(rollout, logp_behavior_full=self._behavior_distribution(rollout))
        return rollout, stats

    def score(self, problems, gens: list[Generation]) -> tuple[torch.Tensor, list[float], int]:
        """Rewards [groups, group_size] of `gens` (group_size completions of each problem, in order;
        `problems` is indexed by their prompt_index: a list, or a group's {key: problem}), the
        verifier's score of each, and the reward functions' warnings."""
        scored = self.rewards(
            [problems[g.prompt_index] for g in gens],
            [g.text for g in gens],
            [g.completion_ids for g in gens],
            [g.tool_mask for g in gens],
            self.tokenizer,
        )
        return (
            torch.tensor(scored.rewards).view(len(problems), self.config.group_size),
            scored.accuracy,
            scored.warnings,
        )

    def informative(self, rewards: torch.Tensor) -> torch.Tensor:
        """Which groups of `rewards` [groups, group_size] train: every one, or with dynamic sampling
        those whose rewards are not all equal."""
        return (
            informative_groups(rewards) if self.config.dynamic_sampling else torch.ones(len(rewards), dtype=torch.bool)
        )

    def request(self, problem, key: int) -> GroupRequest:
        """Group `key` of a stream (gppo.trainer.group_stream): `problem`'s prompt with the row seeds of
        group key % prompts_per_step of step key // prompts_per_step's first round, the seeds the
        synchronous run gives that group."""
        c = self.config
        ids = encode(self.tokenizer, [self.prompts(problem.prompt)])[0]
        step, group = divmod(key, c.prompts_per_step)
        return GroupRequest(key, ids, group_seeds(c.seed, step, 0, group, c.group_size))

    def sampling(
        self, seed: int | None, policy_version: Callable[[], int] | None, row_seeds: tuple[int, ...] | None = None
    ) -> SamplingParams:
        """How rollouts are sampled: group_size completions per prompt, with mu's top-K log-probs
        (and the top-p nucleus) when the estimator reads them. `row_seeds` seed the completions,
        `seed` the tool engine's resumed segments (gppo.rollout.tools)."""
        c = self.config
        return SamplingParams(
            temperature=c.temperature,
            max_new_tokens=c.max_new_tokens,
            n=c.group_size,
            top_k_logprobs=self.top_k,
            seed=seed,
            top_p=c.rollout_top_p,
            record_kept_ids=c.rollout_top_p < 1,
            policy_version=policy_version,
            row_seeds=row_seeds,
        )

    def _warn_truncation(self, step: int, truncated: float) -> None:
        """Once per run: most of a step's completions were cut at max_new_tokens (no answer, and
        with tools no room for a call), so the run may learn nothing."""
        if truncated <= TRUNCATION_WARNING or self.warned_truncation:
            return
        self.warned_truncation = True
        c = self.config
        tools = " (tool calls and their outputs count against it)" if c.tools else ""
        warnings.warn(
            f"{truncated:.0%} of the completions of step {step + 1} hit --max_new_tokens {c.max_new_tokens}{tools}: "
            f"a cut completion has no answer to reward (rollout/truncated_frac); raise --max_new_tokens, "
            f"e.g. --max_new_tokens {2 * c.max_new_tokens} (said once per run)",
            RuntimeWarning,
            stacklevel=2,
        )

    def _sample_groups(self, step: int, policy_version: Callable[[], int] | None) -> SampledGroups:
        """Sample and reward groups until prompts_per_step are kept: every group, or with dynamic
        sampling the informative ones, for at most max_resample_rounds rounds after the first."""
        c = self.config
        sampled = SampledGroups()
        while True:
            need = c.prompts_per_step - len(sampled.kept_rewards)
            problems = self.source.take(need)
            seeds = [
                seed for group in range(need) for seed in group_seeds(c.seed, step, sampled.rounds, group, c.group_size)
            ]
            params = self.sampling(
                derived_seed(c.seed, step) * 64 + sampled.rounds, policy_version, row_seeds=tuple(seeds)
            )
            gens = self.engine.generate([self.prompts(p.prompt) for p in problems], params)
            rewards, accuracy, warnings_ = self.score(problems, gens)
            sampled.add(gens, rewards, accuracy, warnings_, self.informative(rewards))
            sampled.rounds += 1
            if len(sampled.kept_rewards) == c.prompts_per_step or sampled.rounds > c.max_resample_rounds:
                return sampled

    @torch.no_grad()
    def _behavior_distribution(self, rollout: Rollout) -> torch.Tensor:
        """mu's whole distribution [B,T,V] at every response position (estimator 'full'), from the
        weights that sampled the rollout, i.e. the rollout policy now: kept with the rollout (on the
        CPU, in the checkpoint with the batches sampled ahead), since with off_policy_steps > 0 those
        weights are gone by the time the batch trains. Costs B*T*V values per batch in the queue."""
        parts = []
        for index in torch.arange(rollout.size).split(self.config.micro_batch_size):
            sub = on_device(rollout.select(index), self.device)
            log_probs = policy_outputs(
                self.rollout_policy.model, sub, self.config.temperature, return_log_probs=True
            ).log_probs
            parts.append(pad_to(log_probs, rollout.token_ids.shape[1]).cpu())
        return torch.cat(parts)

    def reward_score(self, problems, completions) -> list[float]:
        """Held-out score of data without answers: the reward functions' weighted sum."""
        ids = self.tokenizer(list(completions), add_special_tokens=False)["input_ids"]
        return self.rewards(problems, completions, ids).accuracy
