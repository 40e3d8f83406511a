"""Tool-integrated rollouts: the model writes a fenced Python block, the code sandbox runs it, its
output joins the completion as tool tokens, and sampling resumes (ToRA / SimpleTIR style).

The format needs no tool role in the chat template, so it works with any model:

    ```python
    print(123456 * 789)
    ```
    ```output
    97406784
    ```

(a block closes with a ``` line's newline, `gppo.tool_format`; the output block follows it
directly). Where the prompts are rendered by a chat template that has a tool role, the output goes
in the template's tool turn instead (`template_tool_turn`): the assistant's turn ends after the
block, the tool's message follows, and the model continues in a new assistant turn; all of that is
tool tokens.

`ToolEngine` wraps any engine. It samples until EOS, the budget, or a closed ```python block
(`SamplingParams.stop_at_code_block`). It then runs the block (`PythonTool`: a `ProgramPool` of the
code reward's sandbox and limits; `workers` calls at once), appends the answer as tokens, and
continues the completion from its whole token sequence: on vLLM as soon as its tool answers, while
the others decode; on the HF engine, which decodes in batches, together with the others that
called. Every resumed segment draws from a random stream of its own, seeded by (seed, completion,
tokens so far), so that a completion samples the same tokens whatever the others do.

The answer is the turn's text (`ToolTurn`: the fence, or the template's markers) around the
output's own tokens. The output is plain text: a special token's string that a program prints
(`<|im_end|>`, an EOS) is tokenized as ordinary text, so only the turn writes special tokens. It is
cut to `output_tokens` and to the room the turn leaves in the budget before it is wrapped, so the
closing fence (or turn) is always there; stdout is cut before a failed call's reason (the
exception's last line, the time, memory or output limit), which is cut only where it alone is
longer than the room. A block is run only when the room left after it holds the turn and at least
one token of output, and before `max_tool_calls` calls; otherwise it is no call and the completion
samples on without stopping at blocks (or ends, at the budget). Tool tokens count against
`max_new_tokens`. A `Generation`'s `tool_mask` is 1 at the model's tokens and 0 at the tools'
(TRL's convention): tool tokens are context for every forward, and never a term of the objective
(`gppo.trainer.batch`). Their recorded log-prob is 0, their top-K entries are 0, never read, and
their top-p nucleus (with `record_kept_ids`) is the token alone, on which any policy gives it
log-prob 0 too.
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import os
import threading
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field

from gppo.rollout.base import Generation, SamplingParams, groups_room
from gppo.tool_format import ToolTurn, closed_code_block, output_block

TOOL_POLL_S = 0.05  # how long a stream waits for a tool's answer before it asks for new groups again


@dataclass(frozen=True)
class ToolOutput:
    """A call's answer: what the program printed and, for a failed call, why it failed (one line;
    None: it ran to its end)."""

    stdout: str
    reason: str | None = None

    @property
    def failed(self) -> bool:
        return self.reason is not None

    def parts(self) -> tuple[str, str]:
        """(stdout, reason) as the model reads them, one after the other: trailing whitespace
        dropped, the reason on a line of its own."""
        stdout, reason = self.stdout.rstrip(), (self.reason or "").strip()
        return stdout, f"\n{reason}" if stdout and reason else reason


class PythonTool:
    """Runs a block in the code sandbox (`gppo.rewards.code`: a fresh process in fresh namespaces,
    no network, a private file system, `timeout_s`, `memory_mb`) and answers with its stdout; a
    failure adds its reason (the exception's last line, the time, memory or output limit). Calls go
    through a `ProgramPool` (`gppo.rewards.pool`) of `workers` pre-started sandbox servers
    (default: one per CPU core), started at the first call, ended by `close` or when the tool is
    collected: a few milliseconds a call where a fresh interpreter costs about 0.1 s
    (docs/sandbox.md, "The pool")."""

    def __init__(self, timeout_s: float = 5.0, memory_mb: int = 512, workers: int | None = None):
        self.timeout_s, self.memory_mb, self.workers = timeout_s, memory_mb, default_workers(workers)
        self._pool = None
        self._starting = threading.Lock()

    def __call__(self, code: str) -> ToolOutput:
        from gppo.rewards.code import Limits

        limits = Limits(timeout_s=self.timeout_s, memory_mb=self.memory_mb, max_output_bytes=1 << 16)
        run = self._programs().run(code, limits)
        return ToolOutput(run.stdout, run.reason or None)

    def close(self) -> None:
        """End the sandbox servers (a later call starts them again)."""
        with self._starting:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.close()

    def _programs(self):
        with self._starting:
            if self._pool is None:
                from gppo.rewards.pool import ProgramPool

                self._pool = ProgramPool(self.workers)
                weakref.finalize(self, self._pool.close)
            return self._pool


def default_workers(workers: int | None) -> int:
    """Tool calls at once: `workers`, or one per CPU core where it is None."""
    workers = workers if workers is not None else os.cpu_count() or 1
    if workers < 1:
        raise ValueError(f"workers must be >= 1, got {workers}")
    return workers


TOOLS = {"python": PythonTool}

_PROBE_USER, _PROBE_ANSWER, _PROBE_OUTPUT = "What is 6*7?", "```python\nprint(6*7)\n```\n", "PROBE OUTPUT"


def template_tool_turn(tokenizer) -> ToolTurn | None:
    """How the tokenizer's chat template answers a call, when the template has a tool role: the text
    around the tool's output that follows the model's closed block (the end of the assistant's turn,
    the tool's message, the next assistant turn's header), cut out of the template's rendering of
    [user, assistant, tool]; the output goes between as it is. None (fenced output blocks) when the
    template names no "tool" role (SmolLM2's), renders an assistant turn other than as the model
    wrote it (the cut would not line up), or a tool's message other than once, verbatim."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or "tool" not in template:
        return None

    def render(messages, generation_prompt: bool) -> str:
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    try:
        head = render([{"role": "user", "content": _PROBE_USER}], True) + _PROBE_ANSWER
        probe = render(_turns(_PROBE_OUTPUT), True)
    except Exception:  # a template that refuses the probe's roles
        return None
    if not probe.startswith(head) or probe[len(head) :].count(_PROBE_OUTPUT) != 1:
        return None
    return ToolTurn(*probe[len(head) :].split(_PROBE_OUTPUT))


def _turns(output: str) -> list[dict]:
    return [
        {"role": "user", "content": _PROBE_USER},
        {"role": "assistant", "content": _PROBE_ANSWER},
        {"role": "tool", "content": output},
    ]


def tool_stats(gens: list[Generation], prefix: str) -> dict:
    """Tool-call metrics of completions sampled with tools (none otherwise): calls per completion,
    the share of completions that called a tool, the share of calls that failed, tool tokens per
    completion and their share of all completion tokens."""
    if not any(g.tool_mask is not None for g in gens):
        return {}
    calls = sum(g.tool_calls for g in gens)
    tokens = sum(len(g.completion_ids) for g in gens)
    tool_tokens = sum(len(g.tool_mask) - sum(g.tool_mask) for g in gens if g.tool_mask is not None)
    return {
        f"{prefix}tool_calls_mean": calls / len(gens),
        f"{prefix}tool_call_frac": sum(g.tool_calls > 0 for g in gens) / len(gens),
        f"{prefix}tool_failure_frac": sum(g.tool_failures for g in gens) / max(calls, 1),
        f"{prefix}tool_tokens_mean": tool_tokens / len(gens),
        f"{prefix}tool_token_frac": tool_tokens / max(tokens, 1),
    }


@dataclass
class _Completion:
    """A completion being assembled over segments; `number`: its place in the output."""

    number: int
    prompt_index: int
    prompt_ids: list[int]
    ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk_ids: list[list[int]] = field(default_factory=list)
    topk_logprobs: list[list[float]] = field(default_factory=list)
    kept_ids: list[list[int]] = field(default_factory=list)
    tool_mask: list[int] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # with SamplingParams.policy_version
    calls: int = 0
    failures: int = 0
    finish: str = "stop"
    call: Future | None = None  # the tool's output, when its call started while the engine decoded
    seed: int | None = None  # a streamed completion's row seed (`ToolEngine.stream`)

    def add_model(self, g: Generation) -> None:
        self.ids += g.completion_ids
        self.logprobs += g.logprobs
        self.topk_ids += g.topk_ids or []
        self.topk_logprobs += g.topk_logprobs or []
        self.kept_ids += g.kept_ids or []
        self.tool_mask += [1] * len(g.completion_ids)
        self.versions += g.versions or []
        self.finish = g.finish_reason

    def add_tool(self, ids: list[int], top_k: int) -> None:
        self.ids += ids
        self.logprobs += [0.0] * len(ids)
        if top_k:
            self.topk_ids += [[0] * top_k for _ in ids]
            self.topk_logprobs += [[0.0] * top_k for _ in ids]
        self.kept_ids += [[token] for token in ids]
        self.tool_mask += [0] * len(ids)
        self.versions += self.versions[-1:] * len(ids)  # the call's version (a tool token is never trained)


class ToolEngine:
    """An engine whose completions may call `tool` (the module docstring); everything else is the
    wrapped engine's. `tool_turn` writes a call's answer around its output (default: a fenced
    output block; `template_tool_turn` gives the chat template's tool turn); `workers` calls run at
    once (default: one per CPU core)."""

    def __init__(
        self,
        engine,
        tokenizer,
        tool,
        max_tool_calls: int = 4,
        output_tokens: int = 128,
        tool_turn: ToolTurn | None = None,
        workers: int | None = None,
    ):
        workers = default_workers(workers)
        self.engine, self.tokenizer, self.tool = engine, tokenizer, tool
        self.max_tool_calls, self.output_tokens, self.workers = max_tool_calls, output_tokens, workers
        self.tool_turn = tool_turn or output_block
        # outputs are tokenized by a copy: split_special_tokens switches a flag of the tokenizer's
        # backend, which a call in another thread (a prompt's template, say) would read too
        self._text_tokenizer = copy.deepcopy(tokenizer)
        # the turn's text as it is written (a template's role markers are special tokens)
        self._before, self._after = (
            tokenizer(t, add_special_tokens=False)["input_ids"] for t in dataclasses.astuple(self.tool_turn)
        )
        special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
        kept = [tokenizer.decode([i]) for i in sorted(special) if special & set(self._plain(tokenizer.decode([i])))]
        if kept:
            raise ValueError(
                f"this tokenizer keeps {kept} special when it tokenizes text with split_special_tokens=True: "
                "a program could write them into the policy's context, so it cannot sample with tools"
            )

    def close(self) -> None:
        """End the tool's sandbox servers, then the wrapped engine's resources."""
        getattr(self.tool, "close", lambda: None)()
        getattr(self.engine, "close", lambda: None)()

    def __getattr__(self, name):  # max_top_k_logprobs, separate_weights, update_weights, close, ...
        return getattr(self.engine, name)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """`params.n` completions per prompt, grouped by prompt, with their tool calls run: on an
        engine with a request queue (vLLM's `requests`), each completion resumes as soon as its
        tool answers, while the others decode; otherwise (the HF engine's batches) a call starts as
        soon as the engine reports its block, and the completions resume together, in rounds."""
        encoded = self.tokenizer(list(prompts))["input_ids"]
        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            if hasattr(self.engine, "requests"):
                done = self._independently(pool, encoded, params)
            else:
                done = self._in_rounds(pool, encoded, params)
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        return [self._generation(c, params.top_k_logprobs, record_kept) for c in done]

    def _independently(self, pool, encoded: list[list[int]], params: SamplingParams) -> list[_Completion]:
        """Each completion is a request of its own (`_through_requests`), seeded by `_seed`."""
        done = [
            _Completion(number, number // params.n, encoded[number // params.n])
            for number in range(len(encoded) * params.n)
        ]
        waiting = list(done)

        def ended(c: _Completion) -> None:
            if params.on_step is not None:
                params.on_step(len(c.ids), 1)

        def start(_active: int) -> list[_Completion]:
            started, waiting[:] = list(waiting), []
            return started

        self._through_requests(pool, params, start, lambda c: self._seed(params, c, len(done)), ended)
        return done

    def stream(self, feed, params: SamplingParams, done) -> None:
        """Continuous batching with tool calls (`RolloutEngine.stream`) on an engine with a request
        queue (vLLM's `requests`): up to the engine's `slots` completions at once, whether decoding
        or waiting for a tool; a group starts as they free, and `done(key, generations)` gets it once
        its completions have all ended. A completion's first segment draws from its row seed, each
        resumed one from (row seed, tokens so far), so a group samples what it samples alone."""
        if not hasattr(self.engine, "requests"):
            raise ValueError(
                "continuous batching with tool calls needs an engine whose completions resume one by one "
                "(vLLM's request queue); the hf engine resumes them in rounds: sample in waves"
            )
        version = params.policy_version() if params.policy_version is not None else None
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        groups: dict[object, list[_Completion]] = {}
        finished: dict[object, int] = {}
        numbers = itertools.count()

        def start(active: int) -> list[_Completion]:
            room = groups_room(self.engine.slots, active, params.n)
            started = []
            for group in feed(room) if room else []:
                rows = [
                    _Completion(next(numbers), group.key, list(group.prompt_ids), seed=seed) for seed in group.row_seeds
                ]
                groups[group.key], finished[group.key] = rows, 0
                started += rows
            return started

        def seed_of(c: _Completion) -> int | None:
            return c.seed if not c.ids or c.seed is None else (c.seed * params.max_new_tokens + len(c.ids)) % 2**63

        def ended(c: _Completion) -> None:
            if params.policy_version is not None and params.policy_version() != version:
                raise RuntimeError(
                    "new weights reached the engine while tool rollouts were under way (partial rollouts), "
                    "which they do not record per token"
                )
            finished[c.prompt_index] += 1
            if finished[c.prompt_index] == params.n:
                del finished[c.prompt_index]
                gens = [
                    self._generation(each, params.top_k_logprobs, record_kept) for each in groups.pop(c.prompt_index)
                ]
                for g in gens if version is not None else []:
                    g.versions = [version] * len(g.completion_ids)
                done(c.prompt_index, gens)
            if params.on_step is not None:
                params.on_step(len(c.ids), 1)

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            self._through_requests(pool, params, start, seed_of, ended)

    def _through_requests(self, pool, params: SamplingParams, start, seed_of, ended) -> None:
        """Run completions through the engine's request queue until none is left: `start(active)`
        gives new ones (asked at every turn, `active` of them under way); a stopped one waits for its
        tool, then joins the running batch with its whole sequence as the prompt (vLLM's prefix
        cache holds the part it has seen), seeded by `seed_of`; `ended(c)` hears of each that ends."""
        requests = self.engine.requests(dataclasses.replace(params, n=1, on_step=None, stop_at_code_block=True))
        active: dict[int, _Completion] = {}  # number -> a completion under way
        calls: dict[Future, _Completion] = {}

        def submit(c: _Completion) -> None:
            room = params.max_new_tokens - len(c.ids)
            requests.add(
                c.number, c.prompt_index, c.prompt_ids + c.ids, room, seed_of(c), self._calls_open(c.calls, room)
            )

        def after(c: _Completion) -> None:
            if c.finish == "pending":
                submit(c)
            else:
                del active[c.number]
                ended(c)

        while True:
            for c in start(len(active)):
                active[c.number] = c
                submit(c)
            if not active:
                return
            for number, g in requests.step() if requests.pending else []:
                c = active[number]
                c.add_model(g)
                code = self._call(c, params)
                if code is not None:
                    calls[pool.submit(self.tool, code)] = c
                else:
                    after(c)
            answered = (
                [f for f in calls if f.done()]
                if requests.pending
                else wait(calls, timeout=TOOL_POLL_S, return_when=FIRST_COMPLETED).done
            )
            for call in answered:
                c = calls.pop(call)
                self._answer(c, call.result(), params)
                after(c)

    def _in_rounds(self, pool, encoded: list[list[int]], params: SamplingParams) -> list[_Completion]:
        """Sample every completion until it stops; run the calls (started while decoding where the
        engine reports blocks); resume all that called, together; repeat."""
        stop = self._calls_open(0, params.max_new_tokens)
        gens, calls = self._sample(pool, encoded, dataclasses.replace(params, stop_at_code_block=stop))
        done = [_Completion(number, g.prompt_index, g.prompt_ids) for number, g in enumerate(gens)]
        for c, g in zip(done, gens):
            c.add_model(g)
            c.call = calls.get(c.number)
        while pending := [c for c in done if c.finish == "tool"]:
            for c in pending:
                code = self._call(c, params)
                if code is not None:
                    self._answer(c, (c.call or pool.submit(self.tool, code)).result(), params)
                c.call = None
            self._resume(pool, [c for c in pending if c.finish == "pending"], params, len(done))
        return done

    def _calls_open(self, calls: int, room: int) -> bool:
        """Whether a block closed with `room` tokens of the budget left would be run: fewer than
        `max_tool_calls` calls so far, and room for an answer (`_holds_answer`)."""
        return calls < self.max_tool_calls and self._holds_answer(room)

    def _holds_answer(self, room: int) -> bool:
        """Whether `room` tokens hold the turn and at least one token of output."""
        return room > len(self._before) + len(self._after)

    def _call(self, c: _Completion, params: SamplingParams) -> str | None:
        """The code to run when `c` has just stopped at a block that is to be run (`_calls_open`);
        otherwise, where it stopped at none or at one that is not, it samples on ("pending") or has
        used its budget ("length")."""
        if c.finish != "tool":
            return None
        code = closed_code_block(self.tokenizer.decode(c.ids, skip_special_tokens=True))
        if code is None or not self._calls_open(c.calls, params.max_new_tokens - len(c.ids)):
            self._go_on(c, params)
            return None
        return code

    def _answer(self, c: _Completion, out: ToolOutput, params: SamplingParams) -> None:
        """Append the answer: the turn around the output's own tokens, cut to `output_tokens` and to
        the room the turn leaves (stdout first, then the reason); the completion then resumes
        ("pending") or has used its budget ("length")."""
        c.calls += 1
        c.failures += out.failed
        limit = min(self.output_tokens, params.max_new_tokens - len(c.ids) - len(self._before) - len(self._after))
        stdout, reason = (self._plain(part) for part in out.parts())
        reason = reason[:limit]
        c.add_tool(self._before + stdout[: limit - len(reason)] + reason + self._after, params.top_k_logprobs)
        self._go_on(c, params)

    def _plain(self, text: str) -> list[int]:
        """Token ids of `text` as plain text: a special token's string becomes ordinary tokens."""
        return self._text_tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]

    @staticmethod
    def _go_on(c: _Completion, params: SamplingParams) -> None:
        """Resume the completion ("pending") unless it has used its token budget ("length")."""
        c.finish = "length" if len(c.ids) >= params.max_new_tokens else "pending"

    @staticmethod
    def _seed(params: SamplingParams, c: _Completion, total: int) -> int | None:
        """The seed of the segment `c` samples next, one of `total` completions: distinct for every
        (seed, completion, tokens so far), so that no two segments share draws."""
        return None if params.seed is None else (params.seed * total + c.number) * params.max_new_tokens + len(c.ids)

    def _sample(self, pool, prompt_ids, params: SamplingParams):
        """(generations, {index: Future of the tool's output} of the calls the engine reported while
        decoding, started where the room left can hold an answer)."""
        calls = {}

        def start(index: int, code: str, tokens: int) -> None:
            if self._holds_answer(params.max_new_tokens - tokens):  # it stops at blocks only while calls are open
                calls[index] = pool.submit(self.tool, code)

        return self.engine.generate(prompt_ids, dataclasses.replace(params, on_code_block=start)), calls

    def _resume(self, pool, resume: list[_Completion], params: SamplingParams, total: int) -> None:
        """Continue each completion from its whole token sequence, with the room it has left and
        draws of its own (`_seed`); those whose calls are closed (`_calls_open`) sample on without
        stopping at blocks."""
        rooms = {c.number: params.max_new_tokens - len(c.ids) for c in resume}
        for stop in (True, False):
            batch = [c for c in resume if self._calls_open(c.calls, rooms[c.number]) == stop]
            for room in sorted({rooms[c.number] for c in batch}):
                group = [c for c in batch if rooms[c.number] == room]
                seeds = None if params.seed is None else tuple(self._seed(params, c, total) for c in group)
                more, calls = self._sample(
                    pool,
                    [c.prompt_ids + c.ids for c in group],
                    dataclasses.replace(params, n=1, max_new_tokens=room, row_seeds=seeds, stop_at_code_block=stop),
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
            versions=c.versions or None,
        )
