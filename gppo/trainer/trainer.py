"""The RL loop: rollout (generated and scored by `gppo.trainer.generation`) -> pi_old and reference
log-probs -> GPPO update -> evaluation, with checkpoints.

Every random choice of step k is seeded from (seed, k) or restored from the checkpoint (the data
order), so a run resumed from step k reaches the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import shutil
import time
from collections import defaultdict
from pathlib import Path

import torch
import transformers
import yaml
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from transformers import get_scheduler

import gppo
from gppo.allocator import release_free_memory
from gppo.evaluation import evaluate_problems
from gppo.models.adapters import adapter_base, adapter_base_of, adapter_parameters, add_reference_adapter
from gppo.models.forward import enable_activation_checkpointing, policy_outputs
from gppo.models.loading import load_model_and_tokenizer
from gppo.options import load_yaml
from gppo.prompts import PromptBuilder
from gppo.rollout.options import resolve_device
from gppo.threads import default_threads
from gppo.trainer.async_rollouts import mismatch_by_lag, staleness_metrics
from gppo.trainer.batch import Rollout, on_device, pad_to, token_batch
from gppo.trainer.checkpoint import (
    RunError,
    RunLock,
    atomic_write_text,
    continue_hint,
    load_checkpoint,
    remove_stale_temps,
    resume_with_lower_lr,
    save_checkpoint,
    save_final,
    set_aside,
    set_rng_state,
)
from gppo.trainer.config import ConfigError, TrainConfig, from_dict
from gppo.trainer.data import build_problem_set, check_prompt_lengths, derived_seed
from gppo.trainer.generation import RolloutGenerator, reward_pipeline
from gppo.trainer.group_stream import GroupStream, sampling_worker
from gppo.trainer.logging import MetricsLog, plot_curves, print_final_report, progress_info
from gppo.trainer.policy_loading import base_model_path, load_policy, lora_reference, reference_model
from gppo.trainer.rollout_engine import build_engine
from gppo.trainer.rollout_policy import DTYPES, OffPolicyQueue, RolloutPolicy, mismatch_metrics
from gppo.trainer.update_steps import (
    WEIGHT_GROWTH_LIMIT,
    ZERO_GRADIENT_STEPS_LIMIT,
    MeanOf,
    shuffled_groups,
    total_norm,
)


class UnstableTrainingError(RunError):
    """Training diverged: a non-finite loss, gradient norm or log-prob, an update that blew up the
    weights, or gradients stuck at exactly 0; the message names the step, the metric and the last
    good checkpoint."""


class Trainer:
    """`Trainer(config).train()` runs a whole job; `Trainer.resume(run_dir).train()` continues one.

    A Trainer holds the lock of its run directory from construction until `train()` returns or
    raises (or `close()`), so that no second process writes into the same run."""

    def __init__(self, config: TrainConfig, resume: bool = False, console: Console | None = None):
        self.config = config
        self.console = console or Console()
        self.run_dir = config.run_dir()
        self.lock = RunLock(self.run_dir)
        try:
            self._start(resume)
        except BaseException:
            self.lock.release()
            raise

    def _start(self, resume: bool) -> None:
        config = self.config
        threads = config.threads or default_threads()
        # sampling and training at once share the cores: each runs on half (torch's count is per process)
        torch.set_num_threads(
            max(1, threads // 2) if config.samples_while_training() and config.engine == "hf" else threads
        )
        transformers.utils.logging.disable_progress_bar()
        self.device = resolve_device(config.device)
        if self.device.type == "cuda":  # process-wide, as TRL's --tf32
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = config.uses_tf32(self.device)
        remove_stale_temps(self.run_dir)
        checkpoint, state = load_checkpoint(self.run_dir) or (None, None)
        if checkpoint is not None and not resume:
            raise ConfigError(
                f"{self.run_dir} already holds a run (last checkpoint {checkpoint.name}): continue "
                f"it with `gppo train --resume {self.run_dir}` or choose another --output_dir"
            )
        if checkpoint is None and resume:
            raise ConfigError(
                f"{self.run_dir} has no usable checkpoint to resume from; start it again without "
                f"--resume (the files of the stopped attempt are then moved to {self.run_dir}/aborted/)"
            )

        self.loss_config = config.gppo_config()

        self.base_model_path = base_model_path(config)
        # data and reward functions first: a bad gold or reward file is named before the model loads
        self.problems = build_problem_set(
            config.task,
            config.data,
            config.eval_data,
            config.eval_size,
            config.seed,
            config.data_options(),
            need_answer=not config.reward_funcs,
        )
        rewards = reward_pipeline(config, self.problems.verifier)
        self.model, self.tokenizer = load_policy(config, self.base_model_path, checkpoint)
        self.lora_reference = lora_reference(config, self.base_model_path)
        if self.loss_config.kl_coef > 0 and self.lora_reference == "adapter":
            add_reference_adapter(self.model, self.base_model_path)  # frozen: never in self.trainable
        self.model.to(self.device)
        self.trainable = [p for p in self.model.parameters() if p.requires_grad]  # the adapter alone with LoRA
        if config.gradient_checkpointing:
            enable_activation_checkpointing(self.model)
        self.forward_options = config.forward_options(self.device)
        self.ref_model = None  # with LoRA the reference is an adapter of the model itself (_reference_model)
        if self.loss_config.kl_coef > 0 and not config.use_peft:
            self.ref_model, _ = load_model_and_tokenizer(self.base_model_path, dtype=DTYPES[config.dtype])
            self.ref_model.to(self.device).requires_grad_(False)
        rollout_dtype = config.sampling_dtype(self.device)
        copy_dtype = rollout_dtype if config.engine == "hf" else config.dtype  # vLLM loads its own copy
        self.rollout_policy = RolloutPolicy(
            self.model,
            DTYPES[copy_dtype],
            config.rollout_quantization,
            separate=(config.overlaps_rollouts() or config.samples_while_training()) and config.engine == "hf",
        )
        self.pending = OffPolicyQueue(config.off_policy_steps, background=config.overlaps_rollouts())
        # a resumed run rebuilds vLLM from the checkpoint's weights, which are the model's; with LoRA
        # vLLM loads the base and gets the adapter from update_weights
        model_path = adapter_base_of(self.model) if config.use_peft else checkpoint or self.base_model_path
        self.prompts = self._prompt_builder()
        self.engine = build_engine(
            config,
            self.loss_config,
            self.model,
            self.rollout_policy,
            self.tokenizer,
            self.prompts,
            self.device,
            model_path,
        )
        if config.engine == "vllm" and config.vllm_server:
            self.console.print(
                f"vLLM's server samples this run: {self.engine.base_url}, model {self.engine.served_model!r} "
                f"(log: {self.engine.log_path})"
            )
        check_prompt_lengths(self.problems, self.prompts, self.tokenizer, self.model.config, config.max_new_tokens)
        self.generator = RolloutGenerator(
            config,
            self.loss_config,
            self.problems.train,
            self.prompts,
            self.engine,
            rewards,
            self.tokenizer,
            self.rollout_policy,
            self.device,
        )
        # started by train(), at the run's step
        self.async_rollouts = sampling_worker(config, self.generator, self.sync_rollout_weights)

        self.optimizer = torch.optim.AdamW(self.trainable, lr=config.lr, weight_decay=config.weight_decay)
        sequences = config.prompts_per_step * config.group_size
        updates = config.steps * config.epochs * math.ceil(sequences / config.mini_batch_size)
        self.scheduler = get_scheduler(
            config.lr_schedule, self.optimizer, num_warmup_steps=config.warmup_steps, num_training_steps=updates
        )
        self.step = 0
        self.diverged: str | None = None  # what went wrong, set by the update that saw it
        self.weight_norm = total_norm(self.trainable)
        self.zero_gradient_steps = 0
        if checkpoint is None:
            aside = set_aside(self.run_dir)
            if aside is not None:
                self.console.print(
                    f"{self.run_dir} held an attempt that stopped before its first checkpoint: "
                    f"moved its files to {aside} and started again"
                )
        # written on resume too, so that overrides given with --resume survive the next interruption
        atomic_write_text(self.run_dir / "config.yaml", yaml.safe_dump(config.to_dict(), sort_keys=False))
        self.log = MetricsLog(self.run_dir / "metrics.jsonl", config.report_to, config.to_dict())
        if checkpoint is not None:
            self._restore(checkpoint, state)

    @classmethod
    def resume(cls, run_dir: str | Path, overrides: dict | None = None, console: Console | None = None) -> Trainer:
        """Continue the run in `run_dir` from its last usable checkpoint. `overrides` (e.g. a larger
        `steps`, another preset) are saved in config.yaml, so a later resume keeps them."""
        run_dir = Path(run_dir)
        if not (run_dir / "config.yaml").is_file():
            raise ConfigError(f"{run_dir} has no config.yaml: it is not a gppo run directory")
        values = load_yaml(run_dir / "config.yaml", flag="--resume")
        values.update(overrides or {})
        values["output_dir"] = str(run_dir)
        return cls(from_dict(values), resume=True, console=console)

    def _restore(self, checkpoint: Path, state: dict) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.problems.train.load_state_dict(state["data"])
        if "stream" in state and isinstance(self.async_rollouts, GroupStream):
            self.async_rollouts.restore(state["stream"])
        self.pending.load_state_dict(state.get("pending", []))
        self.zero_gradient_steps = state.get("zero_gradient_steps", 0)
        set_rng_state(state["rng"])
        self.step = state["step"]
        self.log.truncate_after(self.step)
        self.console.print(f"resumed {self.run_dir} from {checkpoint.name} (step {self.step})")

    def save(self) -> Path:
        state = {
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict(),
            # asynchronous: where the first work not trained on began (a resumed run samples it again)
            **(
                self.async_rollouts.checkpoint_state(self.step)
                if self.async_rollouts
                else {"data": self.problems.train.state_dict()}
            ),
            "pending": self.pending.state_dict(),
            "zero_gradient_steps": self.zero_gradient_steps,
        }
        return save_checkpoint(
            self.run_dir, self.step, self.model, self.tokenizer, state, max(self.config.keep_checkpoints, 1)
        )

    def close(self) -> None:
        """Stop sampling and release the run directory (`train()` does both when it returns)."""
        if self.async_rollouts is not None:
            self.async_rollouts.close()
        if self.config.engine == "vllm" and self.config.vllm_server:
            self.engine.close()  # the server process does not outlive its run
        self.lock.release()

    def _prompt_builder(self) -> PromptBuilder:
        try:
            return PromptBuilder(self.tokenizer, self.config.prompt_config())
        except ValueError as err:
            raise ConfigError(f"{err} (model {self.base_model_path})") from None

    # ------------------------------------------------------------------------------ rollout
    def rollout(self, step: int | None = None) -> tuple[Rollout | None, dict]:
        """The batch of `step` (default: the current one) and its rollout metrics: `RolloutGenerator`."""
        return self.generator(self.step if step is None else step)

    @torch.no_grad()
    def prepare(self, rollout: Rollout) -> Rollout:
        """The rollout on the training device, with what the objective needs beyond it: pi_old
        (anchor='old', and for the mismatch metrics when the engine samples from other weights
        than the trained ones) and the reference model's log-probs (KL penalty). mu's full
        distribution (estimator 'full') came with the rollout (`_behavior_distribution`)."""
        rollout = on_device(rollout, self.device)
        cfg, temperature = self.loss_config, self.config.temperature
        need_old = (
            cfg.anchor == "old"
            or self.rollout_policy.is_copy
            or self.config.off_policy_steps > 0
            or self.engine.separate_weights
        )
        need_ref = cfg.kl_coef > 0
        if not (need_old or need_ref):
            return rollout
        width = rollout.token_ids.shape[1]
        parts = defaultdict(list)
        for index in torch.arange(rollout.size, device=self.device).split(self.config.micro_batch_size):
            sub = rollout.select(index)
            if need_old:
                old_full = cfg.anchor_distribution == "logp_old_full"
                out = policy_outputs(
                    self.model, sub, temperature, return_log_probs=old_full, options=self.forward_options
                )
                parts["logp_old"].append(pad_to(out.logp, width))
                if out.topk_logp is not None:
                    parts["topk_logp_old"].append(pad_to(out.topk_logp, width))
                if old_full:
                    parts["logp_old_full"].append(pad_to(out.log_probs, width))
            if need_ref:
                with reference_model(self.model, self.ref_model, self.lora_reference) as reference:
                    ref = policy_outputs(
                        reference,
                        sub,
                        temperature,
                        return_log_probs=cfg.reference_distribution is not None,
                        options=self.forward_options,
                    )
                parts["logp_ref"].append(pad_to(ref.logp, width))
                if cfg.reference_distribution is not None:
                    parts["logp_ref_full"].append(pad_to(ref.log_probs, width))
        return dataclasses.replace(rollout, **{k: torch.cat(v) for k, v in parts.items()})

    # ------------------------------------------------------------------------------ update
    def update(self, rollout: Rollout) -> dict:
        c = self.config
        averages, per_update = MeanOf(), MeanOf()
        shuffle = torch.Generator().manual_seed(derived_seed(c.seed, self.step))
        self.model.train()
        minibatches = (
            minibatch
            for _ in range(c.epochs)
            for minibatch in shuffled_groups(rollout.size, c.group_size, shuffle).split(c.mini_batch_size)
        )
        all_zero = True
        for minibatch in minibatches:
            stats = self._optimizer_step(rollout, minibatch.to(self.device), averages)
            per_update.add(stats)
            if self.diverged:
                break
            all_zero = all_zero and stats["grad_norm"] == 0
        self._check_zero_gradients(all_zero and bool(rollout.advantages.ne(0).any()))
        self.model.eval()
        release_free_memory()  # the activations' freed heap pages, before sampling and evaluation
        return {**averages.result("loss/"), **per_update.result("optim/")}

    def sync_rollout_weights(self) -> None:
        """Give the rollout side the trained weights: the hf engine's copy (a no-op without one),
        vLLM's own weights. Called once the rollout sampling in the background, if any, is done."""
        self.rollout_policy.refresh(self.model)
        self.engine.update_weights(self.model)

    def _optimizer_step(self, rollout: Rollout, minibatch: torch.Tensor, averages: MeanOf) -> dict:
        """One optimizer step on `minibatch` (gradients accumulated over micro-batches). A non-finite
        policy log-prob, loss or gradient norm sets `self.diverged` instead, and the weights stay; an
        update that multiplies the weight norm by more than WEIGHT_GROWTH_LIMIT (or makes it
        non-finite) sets it after the step."""
        c = self.config
        self.optimizer.zero_grad(set_to_none=True)
        tokens = rollout.response_mask[minibatch].sum()
        total = 0.0
        for micro in minibatch.split(c.micro_batch_size):
            sub = rollout.select(micro)
            outputs = policy_outputs(
                self.model, sub, c.temperature, self.loss_config, entropy=True, options=self.forward_options
            )
            for name, logp in (("the policy's", outputs.logp), ("the rollout's", sub.logp_behavior)):
                bad = int((~logp.isfinite() & sub.response_mask.bool()).sum())
                if bad:
                    self.diverged = (
                        f"optim/loss is nan ({name} log-probs of {bad} response tokens are not "
                        f"finite), so training stopped before applying that update"
                    )
                    return {"loss": math.nan}
            loss, metrics = gppo.policy_loss(
                token_batch(sub, outputs), self.loss_config, num_tokens=tokens, num_sequences=len(minibatch)
            )
            loss.backward()
            total += loss.item()
            metrics.pop("loss/policy", None)
            averages.add(metrics, weight=sub.response_mask.sum().item())
        max_norm = c.max_grad_norm if c.max_grad_norm > 0 else math.inf
        grad_norm = torch.nn.utils.clip_grad_norm_(self.trainable, max_norm).item()
        for name, value in (("optim/loss", total), ("optim/grad_norm", grad_norm)):
            if not math.isfinite(value):
                self.diverged = f"{name} is {value}, so training stopped before applying that update"
                return {"loss": total, "grad_norm": grad_norm}
        if grad_norm != 0 or not c.skip_zero_gradient_updates:  # skipped: nothing learned, no move by momentum
            self.optimizer.step()
            self.scheduler.step()
            before, self.weight_norm = self.weight_norm, total_norm(self.trainable)
            if not self.weight_norm <= WEIGHT_GROWTH_LIMIT * before:  # also catches nan and inf
                self.diverged = (
                    f"optim/weight_norm went from {before:.4g} to {self.weight_norm:.4g} in one "
                    f"update (more than {WEIGHT_GROWTH_LIMIT:g}x: the update exploded), so training "
                    f"stopped without saving it"
                )
        return {
            "loss": total,
            "grad_norm": grad_norm,
            "lr": self.scheduler.get_last_lr()[0],
            "weight_norm": self.weight_norm,
        }

    def _check_zero_gradients(self, stuck: bool) -> None:
        """Count RL steps whose every update had a gradient of exactly 0 although some advantage was
        not 0; ZERO_GRADIENT_STEPS_LIMIT of them in a row set `self.diverged`."""
        self.zero_gradient_steps = self.zero_gradient_steps + 1 if stuck else 0
        if self.zero_gradient_steps >= ZERO_GRADIENT_STEPS_LIMIT and not self.diverged:
            self.diverged = (
                f"optim/grad_norm was exactly 0 in every update of the last {self.zero_gradient_steps} "
                f"steps although the advantages were not 0: the policy's log-probs are saturated "
                f"(weights blown up by an earlier update) or every token is outside the trust region, "
                f"so training stopped"
            )

    def train_step(self) -> dict:
        start = time.time()
        rollout, metrics = self._next_rollout()
        if rollout is None:
            self.console.print(f"step {self.step + 1}: every group had equal rewards; no update")
        else:
            rollout = self.prepare(rollout)
            metrics.update(mismatch_metrics(rollout))
            if rollout.versions is not None:  # asynchronous
                metrics.update({**staleness_metrics(rollout, self.step), **mismatch_by_lag(rollout, self.step)})
            update_start = time.time()
            metrics.update(self.update(rollout))
            trained = rollout.response_mask.sum().item() * self.config.epochs
            metrics["perf/update_seconds"] = time.time() - update_start
            metrics["perf/train_tokens_per_s"] = trained / max(metrics["perf/update_seconds"], 1e-9)
        if self.async_rollouts is not None:  # the next version, loaded as soon as the engine allows
            metrics.update(self.async_rollouts.publish(self.step + 1))
        else:
            self.pending.wait()  # the background rollout, if any, is done with the rollout weights
            if rollout is not None:
                self.sync_rollout_weights()
        self.step += 1
        metrics["perf/step_seconds"] = time.time() - start
        return metrics

    def _next_rollout(self) -> tuple[Rollout | None, dict]:
        """The current step's batch: sampled now (on-policy), or taken from the queue of batches
        sampled ahead, after sampling those now due (the last one in the background when
        rollouts overlap the update), or the asynchronous worker's."""
        if self.async_rollouts is not None:
            return self.async_rollouts.take(self.step)
        if not self.config.off_policy_steps:
            return self.rollout()
        for target, background in self.pending.due(self.step):
            if background:
                self.pending.submit(target, self.step, self.generator)
            else:
                self.pending.put(target, self.step, *self.rollout(target))
        return self.pending.take(self.step)

    # ------------------------------------------------------------------------------ evaluation
    def evaluate(self) -> dict:
        """Held-out accuracy: greedy, and sampled avg@k / pass@k with k = eval_samples; asynchronous, once
        the engine is free (it holds the weights of this step)."""
        c, heldout = self.config, self.problems.heldout
        with self.async_rollouts.gate.owned() if self.async_rollouts else contextlib.nullcontext():
            return evaluate_problems(
                self.engine,
                heldout,
                self.problems.verifier or self.generator.reward_score,
                [self.prompts(p.prompt) for p in heldout],
                c.eval_samples,
                c.temperature,
                c.max_new_tokens,
                seed=derived_seed(c.seed, 7_777_777),
                tokenizer=self.tokenizer,
            )

    # ------------------------------------------------------------------------------ main loop
    def train(self, stop_after: int | None = None) -> dict | None:
        """Run to `config.steps`, then release the run directory. `stop_after=k` returns after step k
        as if interrupted (tests). Unstable training raises UnstableTrainingError."""
        if not self.lock.held:
            raise RunError(
                f"this Trainer has released {self.run_dir}; continue the run with Trainer.resume({str(self.run_dir)!r})"
            )
        try:
            return self._train(stop_after)
        except KeyboardInterrupt:  # Ctrl-C, or SIGTERM through gppo.cli: the step in flight is dropped
            self.console.print(f"stopped during step {self.step + 1}; {continue_hint(self.run_dir)}")
            raise
        finally:
            self.close()

    def _train(self, stop_after: int | None) -> dict | None:
        c = self.config
        if self.step == 0:
            first = self.evaluate()
            self.log.write(0, first)
            self._print_eval(0, first)
        if self.async_rollouts is not None:
            self.async_rollouts.start(self.step)
        columns = [
            TextColumn("[bold]gppo[/] {task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            TextColumn("{task.fields[info]}"),
        ]
        piped = c.progress and not self.console.is_terminal  # one plain line per step, never cut to a width
        with Progress(*columns, console=self.console, disable=not c.progress or piped) as progress:
            task = progress.add_task(f"{self.problems.name} {c.preset}", total=c.steps, completed=self.step, info="")
            while self.step < c.steps:
                metrics = self.train_step()
                if self.diverged:
                    self.log.write(self.step, metrics)
                    raise UnstableTrainingError(
                        f"step {self.step}: {self.diverged} (metrics.jsonl records the step; the learning rate may "
                        f"be too high, or the rewards not finite); {resume_with_lower_lr(self.run_dir, c.lr)}"
                    )
                last = self.step == c.steps
                if last or (c.eval_every and self.step % c.eval_every == 0):
                    evaluation = self.evaluate()
                    metrics.update(evaluation)
                    self._print_eval(self.step, evaluation, progress.console)
                self.log.write(self.step, metrics)
                progress.update(task, completed=self.step, info=progress_info(metrics))
                if piped:
                    self.console.print(
                        f"step {self.step}/{c.steps} | {progress_info(metrics)} | "
                        f"{progress.tasks[0].elapsed or 0:.0f} s elapsed",
                        soft_wrap=True,
                        highlight=False,
                    )
                if last or (c.save_every and self.step % c.save_every == 0):
                    self.save()
                if stop_after is not None and self.step >= stop_after and not last:
                    return None
        return self.finish()

    def finish(self) -> dict:
        """Final model, curves and summary (accuracy before and after RL)."""
        save_final(self.run_dir, self.model, self.tokenizer)
        adapter = None
        if self.config.use_peft:
            adapter = {"parameters": adapter_parameters(self.model), "base_model": adapter_base(self.run_dir / "final")}
            if self.config.merge_lora:  # in place: the run is over
                self.model = self.model.merge_and_unload()
                save_final(self.run_dir, self.model, self.tokenizer, name="merged")
        records = self.log.read()
        plot = plot_curves(records, self.run_dir / "curves.png", f"{self.problems.name} | {self.config.preset}")
        evals = [r for r in records if "eval/greedy" in r]
        summary = {
            "run_dir": str(self.run_dir),
            "preset": self.config.preset,
            "steps": self.step,
            "before": {k: v for k, v in evals[0].items() if k.startswith("eval/")} if evals else {},
            "after": {k: v for k, v in evals[-1].items() if k.startswith("eval/")} if evals else {},
            "curves": str(plot) if plot else None,
            "adapter": adapter,
        }
        atomic_write_text(self.run_dir / "summary.json", json.dumps(summary, indent=2) + "\n")
        if self.config.keep_checkpoints == 0:  # the run is complete: its resume state is not needed
            shutil.rmtree(self.run_dir / "checkpoints", ignore_errors=True)
        print_final_report(self.console, self.run_dir, summary, self.config.eval_samples, self.config.merge_lora)
        return summary

    def _print_eval(self, step: int, evaluation: dict, console: Console | None = None) -> None:
        (console or self.console).print(
            f"step {step:>4} | held-out greedy {evaluation['eval/greedy']:.3f} | sampled avg@"
            f"{self.config.eval_samples} {evaluation['eval/avg@k']:.3f}"
        )
