"""Tool-integrated rollouts: the model writes a fenced Python block, the code sandbox runs it, its
output joins the completion as tool tokens, and sampling resumes (ToRA / SimpleTIR style).

The format needs no tool role in the chat template, so it works with any model:

    ```python
    print(123456 * 789)
    ```
    ```output
    97406784
    ```

(a block closes with its ``` line's newline; the output block follows it directly).

`ToolEngine` wraps any engine. It samples until EOS, the budget, or a closed ```python block
(`SamplingParams.stop_at_code_block`). It then runs the block (`PythonTool`: `run_program`, the
code reward's sandbox and limits), appends the output as tokens, and continues each such completion
from its whole token sequence. Tool tokens count against `max_new_tokens`; after
`max_tool_calls` calls a completion samples on without stopping at blocks. A `Generation`'s
`tool_mask` is 1 at the model's tokens and 0 at the tools' (TRL's convention): tool tokens are
context for every forward, and never a term of the objective (`gppo.trainer.batch`). Their
recorded log-prob is 0, and their top-K entries are 0, never read.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from gppo.rollout.base import Generation, SamplingParams
from gppo.tool_format import closed_code_block, output_block


@dataclass(frozen=True)
class ToolOutput:
    text: str
    failed: bool


@dataclass(frozen=True)
class PythonTool:
    """Runs a block with `gppo.rewards.code.run_program` (fresh sandboxed process: no network,
    private file system, `timeout_s`, `memory_mb`), and answers with its stdout; a failure adds
    its reason (the exception's last line, the time or memory limit)."""

    timeout_s: float = 5.0
    memory_mb: int = 512

    def __call__(self, code: str) -> ToolOutput:
        from gppo.rewards.code import CaseStatus, Limits, run_program

        run = run_program(code, Limits(timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_bytes=1 << 16))
        if run.status is CaseStatus.PASSED:
            return ToolOutput(run.stdout, failed=False)
        if run.status is CaseStatus.RUNTIME_ERROR:
            lines = run.stderr.strip().splitlines()
            reason = lines[-1] if lines else run.detail
        else:
            reason = f"{run.status.value}: {run.detail}"
        return ToolOutput(
            f"{run.stdout}{'' if run.stdout.endswith(chr(10)) or not run.stdout else chr(10)}{reason}\n", True
        )


TOOLS = {"python": PythonTool}


def tool_stats(gens: list[Generation], prefix: str) -> dict:
    """Tool-call metrics of completions sampled with tools (none otherwise): calls per completion,
    the share of completions that called a tool, the share of calls that failed, and the share of
    completion tokens that came from tools."""
    if not any(g.tool_mask is not None for g in gens):
        return {}
    calls = sum(g.tool_calls for g in gens)
    tokens = sum(len(g.completion_ids) for g in gens)
    return {
        f"{prefix}tool_calls_mean": calls / len(gens),
        f"{prefix}tool_call_frac": sum(g.tool_calls > 0 for g in gens) / len(gens),
        f"{prefix}tool_failure_frac": sum(g.tool_failures for g in gens) / max(calls, 1),
        f"{prefix}tool_token_frac": sum(len(g.tool_mask) - sum(g.tool_mask) for g in gens) / max(tokens, 1),
    }


@dataclass
class _Completion:
    """A completion being assembled over segments."""

    first: Generation
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    calls: int = 0
    failures: int = 0
    finish: str = "stop"
    call: Future | None = None  # the tool's output, when its call started while the engine decoded

    def add_model(self, g: Generation) -> None:
        self.ids += g.completion_ids
        self.logprobs += g.logprobs
        self.topk_ids += g.topk_ids or []
        self.topk_logprobs += g.topk_logprobs or []
        self.tool_mask += [1] * len(g.completion_ids)
        self.finish = g.finish_reason

    def add_tool(self, ids: list[int], top_k: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        if top_k:
            self.topk_ids += [[0] * top_k for _ in ids]
            self.topk_logprobs += [[0.0] * top_k for _ in ids]
        self.tool_mask += [0] * len(ids)


class ToolEngine:
    """An engine whose completions may call `tool` (the module docstring); everything else is the
    wrapped engine's."""

    def __init__(self, engine, tokenizer, tool, max_tool_calls: int = 4, output_tokens: int = 128):
        self.engine, self.tokenizer, self.tool = engine, tokenizer, tool
        self.max_tool_calls, self.output_tokens = max_tool_calls, output_tokens

    def __getattr__(self, name):  # max_top_k_logprobs, separate_weights, update_weights, close, ...
        return getattr(self.engine, name)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, grouped by prompt, with their tool calls run. A call
        starts as soon as the engine reports its block (the HF engine does, while the other
        completions decode); the rest start when the engine returns."""
        encoded = self.tokenizer(list(prompts))["input_ids"]
        with ThreadPoolExecutor(max_workers=4) as pool:
            gens, calls = self._sample(pool, encoded, dataclasses.replace(params, stop_at_code_block=True))
            done = [_Completion(g) for g in gens]
            for i, (c, g) in enumerate(zip(done, gens)):
                c.add_model(g)
                c.call = calls.get(i)
            round_ = 0
            while pending := [c for c in done if c.finish == "tool"]:
                round_ += 1
                resume = []
                for c in pending:
                    code = closed_code_block(self.tokenizer.decode(c.ids, skip_special_tokens=True))
                    if code is None:  # vLLM's stop string: a closing ``` line of no ```python block
                        resume.append(c)
                        continue
                    out = (c.call or pool.submit(self.tool, code)).result()
                    c.call = None
                    c.calls += 1
                    c.failures += out.failed
                    ids = self.tokenizer(output_block(out.text), add_special_tokens=False)["input_ids"]
                    c.add_tool(
                        ids[: min(self.output_tokens, params.max_new_tokens - len(c.ids))], params.top_k_logprobs
                    )
                    resume.append(c)
                for c in resume:
                    c.finish = "length" if len(c.ids) >= params.max_new_tokens else "pending"
                self._resume(pool, [c for c in resume if c.finish == "pending"], params, round_)
        return [self._generation(c, params.top_k_logprobs) for c in done]

    def _sample(self, pool, prompt_ids, params: SamplingParams):
        """(generations, {index: Future of the tool's output} of the calls the engine reported while
        decoding)."""
        calls = {}

        def start(index: int, code: str) -> None:
            calls[index] = pool.submit(self.tool, code)

        return self.engine.generate(prompt_ids, dataclasses.replace(params, on_code_block=start)), calls

    def _resume(self, pool, resume: list[_Completion], params: SamplingParams, round_: int) -> None:
        """Continue each completion from its whole token sequence, with the room it has left; those
        at `max_tool_calls` sample on without stopping at blocks."""
        for stop in (True, False):
            batch = [c for c in resume if (c.calls < self.max_tool_calls) == stop]
            seed = None if params.seed is None else params.seed * 1009 + 2 * round_ + stop
            for room in sorted({params.max_new_tokens - len(c.ids) for c in batch}):
                group = [c for c in batch if params.max_new_tokens - len(c.ids) == room]
                more, calls = self._sample(
                    pool,
                    [c.first.prompt_ids + c.ids for c in group],
                    dataclasses.replace(params, n=1, max_new_tokens=room, seed=seed, stop_at_code_block=stop),
                )
                for i, (c, g) in enumerate(zip(group, more)):
                    c.add_model(g)
                    c.call = calls.get(i)

    def _generation(self, c: _Completion, top_k: int) -> Generation:
        return dataclasses.replace(
            c.first,
            completion_ids=c.ids,
            text=self.tokenizer.decode(c.ids, skip_special_tokens=True),
            logprobs=c.logprobs,
            topk_ids=c.topk_ids if top_k else None,
            topk_logprobs=c.topk_logprobs if top_k else None,
            finish_reason=c.finish,
            tool_mask=c.tool_mask,
            tool_calls=c.calls,
            tool_failures=c.failures,
        )
