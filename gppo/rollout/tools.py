"""Tool-integrated rollouts: the model writes a fenced Python block, the code sandbox runs it, its
output joins the completion as tool tokens, and sampling resumes (ToRA / SimpleTIR style).

The format needs no tool role in the chat template, so it works with any model:

    ```python
    print(123456 * 789)
    ```
    ```output
    97406784
    ```

(a block closes with its ``` line's newline; the output block follows it directly). Where the
prompts are rendered by a chat template that has a tool role, the output goes in the template's
tool turn instead (`template_tool_turn`): the assistant's turn ends after the block, the tool's
message follows, and the model continues in a new assistant turn; all of that is tool tokens.

`ToolEngine` wraps any engine. It samples until EOS, the budget, or a closed ```python block
(`SamplingParams.stop_at_code_block`). It then runs the block (`PythonTool`: `run_program`, the
code reward's sandbox and limits), appends the output as tokens, and continues the completion from
its whole token sequence: on vLLM as soon as its tool answers, while the others decode; on the HF
engine, which decodes in batches, together with the others that called. Tool tokens count against
`max_new_tokens`; after
`max_tool_calls` calls a completion samples on without stopping at blocks. A `Generation`'s
`tool_mask` is 1 at the model's tokens and 0 at the tools' (TRL's convention): tool tokens are
context for every forward, and never a term of the objective (`gppo.trainer.batch`). Their
recorded log-prob is 0, their top-K entries are 0, never read, and their top-p nucleus (with
`record_kept_ids`) is the token alone, on which any policy gives it log-prob 0 too.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
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

_PROBE_USER, _PROBE_ANSWER = "What is 6*7?", "```python\nprint(6*7)\n```\n"


def template_tool_turn(tokenizer) -> Callable[[str], str] | None:
    """How the tokenizer's chat template answers a call, when the template has a tool role: a
    function from the tool's output to the text that follows the model's closed block (the end of
    the assistant's turn, the tool's message, the next assistant turn's header), cut out of the
    template's rendering of [user, assistant, tool]. None (fenced output blocks) when the template
    names no "tool" role (SmolLM2's), or renders an assistant turn other than as the model wrote it
    (the cut would not line up)."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tool" not in template:
        return None

    def render(messages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        head = render([{"role": "user", "content": _PROBE_USER}], True) + _PROBE_ANSWER
        probe = render(_turns("PROBE OUTPUT"), True)
    except Exception:  # a template that refuses the probe's roles
        return None
    if not probe.startswith(head) or "PROBE OUTPUT" not in probe[len(head) :]:
        return None

    def turn(output: str) -> str:
        return render(_turns(output), True)[len(head) :]

    return turn


def _turns(output: str) -> list[dict]:
    return [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ANSWER},
        {"role": "tool", "content": output},
    ]


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

    prompt_index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    kept_ids: list[list[int]] = field(default_factory=list)
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
        self.kept_ids += g.kept_ids or []
        self.tool_mask += [1] * len(g.completion_ids)
        self.finish = g.finish_reason

    def add_tool(self, ids: list[int], top_k: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        if top_k:
            self.topk_ids += [[0] * top_k for _ in ids]
            self.topk_logprobs += [[0.0] * top_k for _ in ids]
        self.kept_ids += [[token] for token in ids]
        self.tool_mask += [0] * len(ids)


class ToolEngine:
    """An engine whose completions may call `tool` (the module docstring); everything else is the
    wrapped engine's. `tool_turn(output)` writes a call's answer (default: a fenced output block;
    `template_tool_turn` gives the chat template's tool turn)."""

    def __init__(self, engine, tokenizer, tool, max_tool_calls: int = 4, output_tokens: int = 128, tool_turn=None):
        self.engine, self.tokenizer, self.tool = engine, tokenizer, tool
        self.max_tool_calls, self.output_tokens = max_tool_calls, output_tokens
        self.tool_turn = tool_turn or output_block  # output -> the tool tokens' text

    def __getattr__(self, name):  # max_top_k_logprobs, separate_weights, update_weights, close, ...
        return getattr(self.engine, name)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, grouped by prompt, with their tool calls run: on an
        engine with a request queue (vLLM's `requests`), each completion resumes as soon as its
        tool answers, while the others decode; otherwise (the HF engine's batches) a call starts as
        soon as the engine reports its block, and the completions resume together, in rounds."""
        encoded = self.tokenizer(list(prompts))["input_ids"]
        with ThreadPoolExecutor(max_workers=4) as pool:
            if hasattr(self.engine, "requests"):
                done = self._independently(pool, encoded, params)
            else:
                done = self._in_rounds(pool, encoded, params)
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        return [self._generation(c, params.top_k_logprobs, record_kept) for c in done]

    def _independently(self, pool, encoded: list[list[int]], params: SamplingParams) -> list[_Completion]:
        """Each completion is a request of its own; a stopped one waits for its tool, then joins the
        running batch with its whole sequence as the prompt (vLLM's prefix cache holds the part it
        has seen). Request seeds derive from (seed, prompt, sample, segment), so that a completion
        samples the same tokens whatever the others do."""
        requests = self.engine.requests(dataclasses.replace(params, n=1, on_step=None, stop_at_code_block=True))
        done = [_Completion(i, ids) for i, ids in enumerate(encoded) for _ in range(params.n)]

        def submit(number: int, c: _Completion) -> None:
            room = params.max_new_tokens - len(c.ids)
            seed = (
                None if params.seed is None else (params.seed * len(done) + number) * params.max_new_tokens + len(c.ids)
            )
            requests.add(number, c.prompt_index, c.prompt_ids + c.ids, room, seed, c.calls < self.max_tool_calls)

        for number, c in enumerate(done):
            submit(number, c)
        calls: dict[Future, int] = {}
        while requests.pending or calls:
            for number, g in requests.step() if requests.pending else []:
                c = done[number]
                c.add_model(g)
                code = closed_code_block(self.tokenizer.decode(c.ids, skip_special_tokens=True))
                if c.finish == "tool" and code is not None:
                    calls[pool.submit(self.tool, code)] = number
                elif c.finish == "tool":  # the stop string closed no ```python block
                    self._go_on(c, params)
                if c.finish == "pending":
                    submit(number, c)
                elif c.finish != "tool" and params.on_step is not None:
                    params.on_step(len(c.ids), 1)
            answered = (
                [f for f in calls if f.done()] if requests.pending else wait(calls, return_when=FIRST_COMPLETED).done
            )
            for call in answered:
                number = calls.pop(call)
                c = done[number]
                self._answer(c, call.result(), params)
                if c.finish == "pending":
                    submit(number, c)
                elif params.on_step is not None:
                    params.on_step(len(c.ids), 1)
        return done

    def _in_rounds(self, pool, encoded: list[list[int]], params: SamplingParams) -> list[_Completion]:
        """Sample every completion until it stops; run the calls (started while decoding where the
        engine reports blocks); resume all that called, together; repeat."""
        gens, calls = self._sample(pool, encoded, dataclasses.replace(params, stop_at_code_block=True))
        done = [_Completion(g.prompt_index, g.prompt_ids) for g in gens]
        for i, (c, g) in enumerate(zip(done, gens)):
            c.add_model(g)
            c.call = calls.get(i)
        round_ = 0
        while pending := [c for c in done if c.finish == "tool"]:
            round_ += 1
            resume = []
            for c in pending:
                code = closed_code_block(self.tokenizer.decode(c.ids, skip_special_tokens=True))
                if code is None:  # the stop string closed no ```python block
                    self._go_on(c, params)
                else:
                    self._answer(c, (c.call or pool.submit(self.tool, code)).result(), params)
                    c.call = None
                resume.append(c)
            self._resume(pool, [c for c in resume if c.finish == "pending"], params, round_)
        return done

    def _answer(self, c: _Completion, out: ToolOutput, params: SamplingParams) -> None:
        """Append the tool's output block (cut to `output_tokens` and to the room left); the
        completion then resumes ("pending") or has used its budget ("length")."""
        c.calls += 1
        c.failures += out.failed
        ids = self.tokenizer(self.tool_turn(out.text), add_special_tokens=False)["input_ids"]
        c.add_tool(ids[: min(self.output_tokens, params.max_new_tokens - len(c.ids))], params.top_k_logprobs)
        self._go_on(c, params)

    @staticmethod
    def _go_on(c: _Completion, params: SamplingParams) -> None:
        """Resume the completion ("pending") unless it has used its token budget ("length")."""
        c.finish = "length" if len(c.ids) >= params.max_new_tokens else "pending"

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
                    [c.prompt_ids + c.ids for c in group],
                    dataclasses.replace(params, n=1, max_new_tokens=room, seed=seed, stop_at_code_block=stop),
                )
                for i, (c, g) in enumerate(zip(group, more)):
                    c.add_model(g)
                    c.call = calls.get(i)

    def _generation(self, c: _Completion, top_k: int, record_kept: bool) -> Generation:
        return Generation(
            c.prompt_index,
            c.prompt_ids,
            completion_ids=c.ids,
            text=self.tokenizer.decode(c.ids, skip_special_tokens=True),
            logprobs=c.logprobs,
            topk_ids=c.topk_ids if top_k else None,
            topk_logprobs=c.topk_logprobs if top_k else None,
            finish_reason=c.finish,
            kept_ids=c.kept_ids if record_kept else None,
            tool_mask=c.tool_mask,
            tool_calls=c.calls,
            tool_failures=c.failures,
        )
