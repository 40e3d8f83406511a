"""Tool-integrated rollouts (`gppo.rollout.tools`): the HF engine stops where a ```python block
closes, the code sandbox runs it, its output joins the completion as tool tokens (mask 0, no
log-prob), sampling resumes from the whole token sequence, and the budget and call limit hold.
Hostile programs run through the tool path under the code reward's sandbox. Both engines close a
block where the one fence rule says, resumed completions draw independently, and calls run
`workers` at a time.

The model's choices are scripted (the sampler is replaced by one that emits a fixed text, the
same for every row, or one per row), while the forward, the cache and the stop detection are the
engine's own; vLLM's request queue is simulated with its stop-string rule (`StopStringEngine`).
"""

import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gppo.models.embedded import build_model
from gppo.rollout import SamplingParams
from gppo.rollout.base import Generation
from gppo.rollout.hf import HFEngine
from gppo.rollout.tools import PythonTool, ToolEngine, ToolOutput
from gppo.tool_format import closed_code_block, output_block
from gppo.trainer import ConfigError
from gppo.trainer.batch import rollout_from_generations


def printable_tokenizer(specials: tuple[str, ...] = ()):
    """One token per printable ASCII character, <pad>/<eos>/<unk> and `specials`."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<eos>", "<unk>", *specials, *string.printable])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("(?m)."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(list(specials))
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>", padding_side="left"
    )


def scripted_engine(model, tokenizer, monkeypatch, script: str) -> HFEngine:
    """An HFEngine over `model` whose sampler emits `script` (as plain text), then EOS."""
    ids = iter(plain_ids(tokenizer, script) + [tokenizer.eos_token_id] * 200)

    def sample(logits, params, gen, record_kept):
        token = torch.full((logits.shape[0],), next(ids), dtype=torch.long)
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(params.top_k_logprobs, -1) if params.top_k_logprobs else (None, None)
        return token, logp.gather(-1, token[:, None])[:, 0], top[1], top[0], None

    monkeypatch.setattr(HFEngine, "_sample", staticmethod(sample))
    return HFEngine(model, tokenizer)


def plain_ids(tokenizer, text: str) -> list[int]:
    """`text`'s tokens, special tokens' strings included as ordinary text."""
    return tokenizer(text, add_special_tokens=False, split_special_tokens=True)["input_ids"]


def vllm_stop_strings() -> list[str]:
    """The stop strings `VLLMEngine` gives vLLM for a segment that stops at code blocks (read from
    its `_sampling`, with vLLM's SamplingParams replaced by a recorder: vLLM is not needed)."""
    import sys
    import types
    from types import SimpleNamespace

    from gppo.rollout.vllm import VLLMEngine

    fake = types.ModuleType("vllm")
    fake.SamplingParams = dict
    saved = sys.modules.get("vllm")
    sys.modules["vllm"] = fake
    try:
        sampling = VLLMEngine._sampling(SimpleNamespace(eos_ids=[1]), SamplingParams(), 10, None, True)
    finally:
        if saved is None:
            del sys.modules["vllm"]
        else:
            sys.modules["vllm"] = saved
    assert sampling["include_stop_str_in_output"]
    return sampling["stop"]


class StopStringEngine:
    """vLLM's request queue (`VLLMEngine.requests`) simulated on a script, for `ToolEngine`'s path
    that resumes each completion on its own. Every completion's model tokens are `script`'s, in
    order, each segment going on where its last one ended; a segment ends as vLLM ends it: with EOS
    after the script, at its max_new_tokens, or (stopping at blocks) with the token that completes
    the first occurrence in the segment's text of any of `stops` (vLLM's stop-string rule)."""

    def __init__(self, tokenizer, script: str, stops: list[str]):
        self.tokenizer, self.script, self.stops = tokenizer, plain_ids(tokenizer, script), stops
        self.pending, self.at = {}, {}  # key -> the request; key -> the script position it reached
        self.seeds = []  # every segment's seed, in the order they were queued

    def requests(self, params: SamplingParams):
        return self

    def add(self, key, prompt_index, prompt_ids, max_new_tokens, seed, stop_at_code_block):
        self.seeds.append(seed)
        self.pending[key] = (prompt_index, prompt_ids, max_new_tokens, stop_at_code_block)

    def step(self) -> list[tuple[object, Generation]]:
        ended = []
        for key, (index, prompt_ids, room, stop) in list(self.pending.items()):
            del self.pending[key]
            ids, finish = [], "length"
            while len(ids) < room:
                if self.at.get(key, 0) == len(self.script):
                    ids.append(self.tokenizer.eos_token_id)
                    finish = "stop"
                    break
                ids.append(self.script[self.at.get(key, 0)])
                self.at[key] = self.at.get(key, 0) + 1
                if stop and any(s in self.tokenizer.decode(ids) for s in self.stops):
                    finish = "tool"
                    break
            text = self.tokenizer.decode(ids, skip_special_tokens=True)
            ended.append((key, Generation(index, prompt_ids, ids, text, [-1.0] * len(ids), finish_reason=finish)))
        return ended


def answer(stdout: str, reason: str | None = None) -> ToolOutput:
    """A tool's answer, as a program that printed `stdout` (and failed for `reason`) gets it."""
    return ToolOutput(stdout, reason)


class Recording:
    """A tool that answers `output` (default "ok") without running anything, recording the code of
    every call."""

    def __init__(self, output: ToolOutput | None = None):
        self.output, self.codes = output or answer("ok"), []

    def __call__(self, code: str) -> ToolOutput:
        self.codes.append(code)
        return self.output


@pytest.fixture(scope="module")
def scripted():
    """(engine factory, tokenizer): an HFEngine over a tiny model whose sampler emits `script`."""
    tokenizer = printable_tokenizer()
    model = build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).eval()
    return (lambda monkeypatch, script: scripted_engine(model, tokenizer, monkeypatch, script)), tokenizer


@pytest.mark.parametrize(
    "text,code",
    [
        ("Let me compute.\n```python\nprint(6*7)\n```\n", "print(6*7)"),
        ("Let me compute.\n```python\nprint(6*7)\n```", None),  # the closing line is not ended yet
        ("```py\nx = 1\nprint(x)\n```\n", "x = 1\nprint(x)"),
        ("```python\nprint(1)\n``` \n", None),  # no stop string ends there: vLLM would sample on
        ("```python\nprint(1)\n```\t\n", None),
        ("```python\nprint(1)```\n", "print(1)"),
        ("```python\nprint(1)\n```\n\n", "print(1)"),  # the rest of the token that wrote the newline
        ("```python\nprint(1)\n```\nso", None),
        ("```python\n```\n", ""),
        ("```python\nprint(1)\n```\n```output\n1\n```\n", None),  # answered already
        ("```python\nprint(1)\n", None),  # still open
        ("no code here ```", None),
        ("```python\nprint(1)\n```\n```output\n1\n```\nagain\n```python\nprint(2)\n```\n", "print(2)"),
        ("```python\nwhile True:\n```python\n", None),  # an opening line does not close
    ],
)
def test_a_pending_block_is_one_the_text_has_just_closed(text, code):
    assert closed_code_block(text) == code


FENCE_CASES = [  # (what the model writes, the code of each call: one fence rule decides)
    ("```python\nprint(1)\n```\ndone", ["print(1)"]),
    ("```python\nprint(1)\n``` \ndone", []),  # "``` " and "```\t" are no closing line
    ("```python\nprint(1)\n```\t\ndone", []),
    ("```python\nprint(1)```\ndone", ["print(1)"]),
    ("```\nplain\n```\n```python\nprint(2)\n```\ndone", ["print(2)"]),  # a plain block runs nothing
    ("```py\nx = 1\n```\nthen\n```python\nprint(3)\n```\n", ["x = 1", "print(3)"]),
    ("```python\nprint('``` \\n')\n```\ndone", []),  # a fence inside the code: no block
    ("```python\nprint(4)\n```python\nprint(5)\n```\ndone", ["print(5)"]),
]


@pytest.mark.parametrize("script,codes", FENCE_CASES)
def test_both_engines_close_a_block_where_the_one_fence_rule_says(scripted, monkeypatch, script, codes):
    """The same texts through the HF engine (which stops where `closed_code_block` says) and
    through the request path with the stop strings VLLMEngine gives vLLM, under vLLM's stop-string
    semantics (`StopStringEngine`): the same calls, the same completions."""
    make, tokenizer = scripted
    stops = vllm_stop_strings()
    assert stops == ["```\n"]
    completions = []
    for engine in (make(monkeypatch, script), StopStringEngine(tokenizer, script, stops)):
        tool = Recording()
        (g,) = ToolEngine(engine, tokenizer, tool).generate(["go "], SamplingParams(max_new_tokens=200, seed=0))
        assert tool.codes == codes and g.tool_calls == len(codes) and g.finish_reason == "stop"
        completions.append((g.text, g.tool_mask))
    assert completions[0] == completions[1]
    assert len(set(engine.seeds)) == len(engine.seeds)  # every request segment draws from a stream of its own
    text, ok = completions[0][0], output_block("ok")
    assert text.replace(ok, "") == script and all(part.endswith("```\n") for part in text.split(ok)[:-1])


def test_a_tool_call_stops_sampling_runs_in_the_sandbox_and_sampling_resumes(scripted, monkeypatch):
    make, tokenizer = scripted
    call = "I will compute.\n```python\nprint(6*7)\n```\n"
    tail = "so it is 42."
    engine = ToolEngine(make(monkeypatch, call + tail), tokenizer, PythonTool(timeout_s=10))
    prompt = "what is 6*7? "
    (g,) = engine.generate([prompt], SamplingParams(temperature=1.0, max_new_tokens=120, n=1, top_k_logprobs=2, seed=0))
    tool_text = output_block("42\n")
    assert g.text == call + tool_text + tail
    assert (g.tool_calls, g.tool_failures, g.finish_reason) == (1, 0, "stop")
    model, tool, after = len(call), len(tool_text), len(tail) + 1  # + EOS
    assert g.tool_mask == [1] * model + [0] * tool + [1] * after
    assert len(g.completion_ids) == len(g.logprobs) == len(g.topk_ids) == model + tool + after
    assert all(lp == 0.0 for lp, m in zip(g.logprobs, g.tool_mask) if not m)
    assert all(lp < 0.0 for lp, m in zip(g.logprobs, g.tool_mask) if m)
    assert g.prompt_ids == tokenizer(prompt)["input_ids"]
    rollout = rollout_from_generations([g, g], torch.tensor([1.0, -1.0]), tokenizer.pad_token_id, top_k=2)
    assert rollout.response_mask[0].tolist() == [float(m) for m in g.tool_mask]  # the loss sees the model's tokens
    assert rollout.attention_mask[0].sum() == len(g.prompt_ids) + len(g.completion_ids)  # the forward sees all


def test_tool_tokens_count_against_the_budget_and_calls_are_capped(scripted, monkeypatch):
    make, tokenizer = scripted
    block = "```python\nprint('y' * 50)\n```\n"
    engine = ToolEngine(make(monkeypatch, block + block + "done"), tokenizer, PythonTool(), max_tool_calls=1)
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=200, seed=0))
    assert g.tool_calls == 1 and g.text.count("```output") == 1  # the second block is not run
    assert g.text.endswith(block + "done")
    engine = ToolEngine(make(monkeypatch, block), tokenizer, PythonTool(), output_tokens=10)
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=len(block) + 40, seed=0))
    assert g.text == block + output_block("y" * 10)  # the output cut to 10 tokens, then wrapped
    budget = len(block) + len(output_block("")) + 5
    engine = ToolEngine(make(monkeypatch, block), tokenizer, PythonTool())
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=budget, seed=0))
    assert g.text == block + output_block("y" * 5) and g.finish_reason == "length"  # cut to the room the turn leaves


def test_a_block_never_closed_is_cut_at_the_budget(scripted, monkeypatch):
    make, tokenizer = scripted
    engine = ToolEngine(make(monkeypatch, "```python\nwhile True:\n    pass\n" * 10), tokenizer, PythonTool())
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=40, seed=0))
    assert (g.finish_reason, g.tool_calls, len(g.completion_ids), sum(g.tool_mask)) == ("length", 0, 40, 40)


@pytest.mark.parametrize(
    "code,says",
    [
        ("while True:\n    pass", "timeout: wall-clock limit of 1 s"),
        ("raise ValueError('bad input')", "ValueError: bad input"),
        ("import os\nwhile True:\n    os.fork()", ""),  # a fork bomb: stopped by the process limit or the clock
        ("import socket\nsocket.create_connection(('93.184.216.34', 80), timeout=1)", "Error"),
        ("open('/etc/gppo-tool-escape', 'w').write('x')", "Error"),
        ("x = bytearray(4 << 30)", "memory"),
    ],
)
def test_hostile_tool_calls_fail_in_the_sandbox_and_say_why(code, says, tmp_path):
    out = PythonTool(timeout_s=1.0, memory_mb=256)(code)
    assert out.failed, out
    assert says in out.reason, out.reason
    import os

    assert not os.path.exists("/etc/gppo-tool-escape")


def test_a_flood_of_output_is_cut(scripted, monkeypatch):
    make, tokenizer = scripted
    block = "```python\nwhile True:\n    print('flood' * 100)\n```\n"
    engine = ToolEngine(make(monkeypatch, block), tokenizer, PythonTool(timeout_s=1.0), output_tokens=64)
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=400, seed=0))
    assert g.tool_calls == 1 and len(g.completion_ids) - sum(g.tool_mask) == 64 + len(output_block(""))


def test_tool_settings_are_checked(micro_model, tmp_path):
    from tests.test_trainer import micro_config

    with pytest.raises(ConfigError, match=r"'bash' is not one of \['python'\]"):
        micro_config(micro_model, tmp_path / "a", tools=["bash"])
    with pytest.raises(ConfigError, match="--max_tool_calls 2 would be ignored: it applies with --tools python"):
        micro_config(micro_model, tmp_path / "b", max_tool_calls=2)


def test_a_training_run_with_tools_logs_the_tool_metrics(micro_model, tmp_path):
    """The embedded micro model never writes a code block: the run trains as without tools, and the
    tool metrics say so."""
    import json

    from gppo.trainer import Trainer
    from tests.test_trainer import micro_config

    run = Trainer(micro_config(micro_model, tmp_path / "run", tools=["python"], steps=1))
    run.train()
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    step = next(r for r in rows if "rollout/tool_calls_mean" in r)
    assert step["rollout/tool_calls_mean"] == 0 and step["rollout/tool_token_frac"] == 0
    assert all("eval/tool_call_frac" in r for r in rows if "eval/greedy" in r)


def test_the_shipped_multiplication_warm_start_calls_the_tool_half_the_time():
    """Sampled with the python tool, the warm start calls it on about half of the problems and is
    right exactly when it does (it copies the output; in its head it is wrong): the teacher's
    habit, which RL has to turn into always."""
    from gppo.models.assets import embedded_checkpoint
    from gppo.models.loading import load_model_and_tokenizer
    from gppo.tasks import get_task, heldout_problems

    model, tokenizer = load_model_and_tokenizer(embedded_checkpoint("multiplication"))
    task = get_task("multiplication")
    problems = heldout_problems(task, 128)
    engine = ToolEngine(HFEngine(model, tokenizer), tokenizer, PythonTool())
    gens = engine.generate([p.prompt for p in problems], SamplingParams(temperature=1.0, max_new_tokens=64, seed=0))
    called = [g.tool_calls > 0 for g in gens]
    right = [task.score(p, g.text) == 1.0 for p, g in zip(problems, gens)]
    assert 0.3 < sum(called) / len(gens) < 0.7
    assert sum(r and not c for r, c in zip(right, called)) <= 2  # in its head it is (almost) never right
    assert sum(r for r, c in zip(right, called) if c) >= 0.9 * sum(called)  # with the tool it copies the output


def test_the_hf_engine_reports_each_block_as_it_closes(scripted, monkeypatch):
    """on_code_block gets (index in the output, code, tokens so far) at the decoding step where the block closes,
    so that ToolEngine starts the call while the other completions decode."""
    make, tokenizer = scripted
    engine = make(monkeypatch, "ok\n```python\nprint(1)\n```\nmore")
    seen, steps = [], []
    params = SamplingParams(
        max_new_tokens=40,
        n=2,
        seed=0,
        stop_at_code_block=True,
        on_code_block=lambda index, code, tokens: seen.append((index, code, tokens, len(steps))),
        on_step=lambda tokens, finished: steps.append(tokens),
    )
    gens = engine.generate(["a ", "b "], params)
    block_end = len("ok\n```python\nprint(1)\n```\n")
    assert sorted((i, c) for i, c, _, _ in seen) == [(i, "print(1)") for i in range(4)]
    assert {(tokens, at) for _, _, tokens, at in seen} == {(block_end, block_end - 1)}  # during the closing step
    assert all(g.finish_reason == "tool" and len(g.completion_ids) == block_end for g in gens)


def test_top_p_tool_rollouts_score_pi_on_the_nucleus_at_the_models_tokens(tmp_path):
    """Top-p 0.9 rollouts of the multiplication warm start with the python tool: every token has a
    nucleus (the sampled token in it; a tool token's is the token alone), and the trainer's forward
    on those nuclei gives r = pi/mu = 1 within 1e-5 at the model's tokens on the first update (the
    HF engine samples from the trained weights), where scoring the whole vocabulary gives r = pi(S)."""
    import dataclasses

    from gppo.models.forward import policy_outputs
    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict

    trainer = Trainer(
        from_dict(
            dict(
                task="multiplication",
                tools=["python"],
                rollout_top_p=0.9,
                max_new_tokens=64,
                prompts_per_step=8,
                group_size=4,
                output_dir=str(tmp_path / "run"),
                progress=False,
                threads=1,
            )  # fmt: skip
        )
    )
    from gppo.tasks import get_task, heldout_problems

    prompts = [p.prompt for p in heldout_problems(get_task("multiplication"), 8)]
    params = SamplingParams(temperature=1.0, top_p=0.9, max_new_tokens=64, n=4, seed=0, record_kept_ids=True)
    gens = trainer.engine.generate(prompts, params)
    called = [g for g in gens if g.tool_calls]
    assert called and all(len(g.kept_ids) == len(g.completion_ids) for g in gens)
    for g in gens:
        for token, mine, kept in zip(g.completion_ids, g.tool_mask, g.kept_ids):
            assert token in kept and (mine or kept == [token])
    rollout, _ = trainer.rollout()
    rollout = trainer.prepare(rollout)
    valid = rollout.response_mask.bool()
    assert (valid.sum() < (rollout.kept_sizes > 0).sum()) and valid.any()  # tool tokens are out of the loss
    with torch.no_grad():
        out = policy_outputs(trainer.model, rollout, trainer.config.temperature)
        whole = policy_outputs(
            trainer.model, dataclasses.replace(rollout, kept_sizes=None, kept_ids=None), trainer.config.temperature
        )
    ratio = (out.logp - rollout.logp_behavior).exp()[valid]
    torch.testing.assert_close(ratio, torch.ones_like(ratio), atol=1e-5, rtol=0)
    assert ((whole.logp - rollout.logp_behavior).exp()[valid] < 1 - 1e-3).any()


CHATML = (  # SmolLM2's kind: no tool role
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CHATML_WITH_TOOL_ROLE = CHATML.replace(  # Qwen2.5's kind: a tool's message is a user turn in <tool_response>
    "{{ '<|im_start|>' + m['role']",
    "{% if m['role'] == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + m['content'] + "
    "'</tool_response><|im_end|>\\n' }}{% else %}{{ '<|im_start|>' + m['role']",
).replace("'<|im_end|>\\n' }}{% endfor %}", "'<|im_end|>\\n' }}{% endif %}{% endfor %}")
REWRITING = CHATML_WITH_TOOL_ROLE.replace(
    "'\\n' + m['content'] + '<|im_end|>", "'\\n' + m['content'] | trim + '<|im_end|>"
)


def test_a_chat_templates_tool_role_answers_a_call(monkeypatch):
    """With a chat template that has a tool role, a call's output is the template's tool turn: the
    assistant's turn ends after the block, the tool's message follows, a new assistant turn opens,
    all of it tool tokens (mask 0). Templates without a tool role (SmolLM2's is plain ChatML), or
    that rewrite the assistant's text, keep the fenced output block."""
    from gppo.rollout.tools import template_tool_turn

    tokenizer = printable_tokenizer(("<|im_start|>", "<|im_end|>"))
    tokenizer.chat_template = CHATML_WITH_TOOL_ROLE
    turn = template_tool_turn(tokenizer)
    answer = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42</tool_response><|im_end|>\n<|im_start|>assistant\n"
    assert turn("42\n") == answer
    model = build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).eval()
    call, tail = "```python\nprint(6*7)\n```\n", "42"
    engine = ToolEngine(
        scripted_engine(model, tokenizer, monkeypatch, call + tail), tokenizer, PythonTool(), tool_turn=turn
    )
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "6*7?"}], tokenize=False, add_generation_prompt=True
    )
    (g,) = engine.generate([prompt], SamplingParams(max_new_tokens=200, seed=0))
    assert tokenizer.decode(g.completion_ids) == call + answer + tail + "<eos>"
    tool_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
    assert g.tool_mask == [1] * len(call) + [0] * tool_tokens + [1] * (len(tail) + 1) and g.tool_calls == 1
    for template in (CHATML, REWRITING, None):
        tokenizer.chat_template = template
        assert template_tool_turn(tokenizer) is None


def per_row_scripted_engine(model, tokenizer, monkeypatch, scripts: list[str]) -> HFEngine:
    """An HFEngine over `model` whose segments that stop at blocks emit scripts[row] on each row
    (all of one length); the others sample from the model."""
    rows = [plain_ids(tokenizer, s) for s in scripts]
    step = iter(range(len(rows[0])))
    sample_from_model = HFEngine._sample

    def sample(logits, params, gen, record_kept):
        if not params.stop_at_code_block:
            return sample_from_model(logits, params, gen, record_kept)
        t = next(step)
        token = torch.tensor([ids[t] for ids in rows[: logits.shape[0]]])
        return token, torch.log_softmax(logits, -1).gather(-1, token[:, None])[:, 0], None, None, None

    monkeypatch.setattr(HFEngine, "_sample", staticmethod(sample))
    return HFEngine(model, tokenizer)


class Repeats:
    """A tool that answers "x" repeated as often as the last digit of the code says."""

    def __call__(self, code: str) -> ToolOutput:
        return answer("x" * int(code[-2]))


def resumed_after_the_call(g) -> list[int]:
    """The model's tokens after a completion's last tool token."""
    last_tool = max(i for i, m in enumerate(g.tool_mask) if not m)
    return g.completion_ids[last_tool + 1 :]


def test_resumed_completions_draw_independently_of_each_other(monkeypatch):
    """Four completions of one prompt call the tool at the same step; their outputs differ in
    length, so each resumes with a different budget left (on the HF engine, in a generate call of its
    own). Each resumed segment draws from its own random stream: the four share no draws (tokens
    agree about as often as independent samples do, not step for step), and a completion samples the
    same tokens whatever the others do (here: whether they resume beside it, in one call)."""
    tokenizer = printable_tokenizer()
    model = build_model(tokenizer, seed=0, hidden=32, layers=1, heads=2).eval()
    params = SamplingParams(temperature=1.0, max_new_tokens=80, n=4, seed=3)

    def rollout(codes: list[str]) -> list[list[int]]:
        scripts = [f"```python\n{code}\n```\n" for code in codes]
        engine = per_row_scripted_engine(model, tokenizer, monkeypatch, scripts)
        gens = ToolEngine(engine, tokenizer, Repeats(), max_tool_calls=1).generate(["go "], params)
        assert [g.tool_calls for g in gens] == [1] * 4
        return [resumed_after_the_call(g) for g in gens]

    apart = rollout(["print(1)", "print(2)", "print(3)", "print(4)"])  # four budgets left: four generate calls
    pairs = [(a, b) for i, a in enumerate(apart) for b in apart[i + 1 :]]
    same = sum(x == y for a, b in pairs for x, y in zip(a, b))
    positions = sum(min(len(a), len(b)) for a, b in pairs)
    assert positions >= 60 and same / positions < 0.2, (same, positions)
    together = rollout(["print(1)"] * 4)  # the others now resume beside the first, in one call
    assert together[0] == apart[0]
    assert len({tuple(t) for t in together}) == 4  # the same context, four different continuations


def test_tool_calls_run_at_most_workers_at_once(scripted, monkeypatch):
    """Eight completions close a block in the same step: their calls start together, and at most
    `workers` of them run at once; by default, one per CPU core."""
    import os
    import threading
    import time

    make, tokenizer = scripted
    running, peak, lock = 0, 0, threading.Lock()

    def slow(code: str) -> ToolOutput:
        nonlocal running, peak
        with lock:
            running += 1
            peak = max(peak, running)
        time.sleep(0.2)
        with lock:
            running -= 1
        return answer("ok")

    engine = ToolEngine(make(monkeypatch, "```python\nprint(1)\n```\n"), tokenizer, slow, workers=3)
    gens = engine.generate(["go "], SamplingParams(max_new_tokens=60, n=8, seed=0))
    assert [g.tool_calls for g in gens] == [1] * 8 and peak == 3
    assert ToolEngine(engine.engine, tokenizer, slow).workers == os.cpu_count()
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ToolEngine(engine.engine, tokenizer, slow, workers=0)


def test_tool_stats_count_tool_tokens_per_completion():
    """tool_tokens_mean: tool tokens (mask 0) per completion; tool_token_frac: their share of all
    completion tokens."""
    from gppo.rollout.tools import tool_stats

    gens = [
        Generation(0, [5], [1, 2, 3, 4, 5], "", tool_mask=[1, 0, 0, 0, 1], tool_calls=1),
        Generation(0, [5], [1, 2, 3], "", tool_mask=[1, 1, 1]),
    ]
    stats = tool_stats(gens, "rollout/")
    assert stats["rollout/tool_tokens_mean"] == 1.5 and stats["rollout/tool_token_frac"] == 3 / 8
    assert stats["rollout/tool_calls_mean"] == 0.5 and tool_stats([Generation(0, [5], [1], "")], "x/") == {}
