"""Tool-integrated rollouts (`gppo.rollout.tools`): the HF engine stops where a ```python block
closes, the code sandbox runs it, its output joins the completion as tool tokens (mask 0, no
log-prob), sampling resumes from the whole token sequence, and the budget and call limit hold.
Hostile programs run through the tool path under the code reward's sandbox.

The model's choices are scripted (the sampler is replaced by one that emits a fixed text, the
same for every row), while the forward, the cache and the stop detection are the engine's own.
"""

import string

import pytest
import torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from gppo.models.embedded import build_model
from gppo.rollout import SamplingParams
from gppo.rollout.hf import HFEngine
from gppo.rollout.tools import PythonTool, ToolEngine
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
    """An HFEngine over `model` whose sampler emits `script`, then EOS."""
    ids = iter(tokenizer(script, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id] * 200)

    def sample(logits, params, gen, record_kept):
        token = torch.full((logits.shape[0],), next(ids), dtype=torch.long)
        logp = torch.log_softmax(logits, -1)
        top = logp.topk(params.top_k_logprobs, -1) if params.top_k_logprobs else (None, None)
        return token, logp.gather(-1, token[:, None])[:, 0], top[1], top[0], None

    monkeypatch.setattr(HFEngine, "_sample", staticmethod(sample))
    return HFEngine(model, tokenizer)


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
        ("```py\nx = 1\nprint(x)\n``` \n", "x = 1\nprint(x)"),
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
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=len(block) + 30, seed=0))
    assert len(g.completion_ids) - sum(g.tool_mask) == 10  # the output cut to 10 tokens
    budget = len(block) + 5
    engine = ToolEngine(make(monkeypatch, block), tokenizer, PythonTool())
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=budget, seed=0))
    assert len(g.completion_ids) == budget and g.finish_reason == "length"  # the output cut by the budget


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
    assert says in out.text, out.text
    import os

    assert not os.path.exists("/etc/gppo-tool-escape")


def test_a_flood_of_output_is_cut(scripted, monkeypatch):
    make, tokenizer = scripted
    block = "```python\nwhile True:\n    print('flood' * 100)\n```\n"
    engine = ToolEngine(make(monkeypatch, block), tokenizer, PythonTool(timeout_s=1.0), output_tokens=64)
    (g,) = engine.generate(["go "], SamplingParams(max_new_tokens=400, seed=0))
    assert g.tool_calls == 1 and len(g.completion_ids) - sum(g.tool_mask) == 64


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
    """on_code_block gets (index in the output, code) at the decoding step where the block closes,
    so that ToolEngine starts the call while the other completions decode."""
    make, tokenizer = scripted
    engine = make(monkeypatch, "ok\n```python\nprint(1)\n```\nmore")
    seen, steps = [], []
    params = SamplingParams(
        max_new_tokens=40,
        n=2,
        seed=0,
        stop_at_code_block=True,
        on_code_block=lambda index, code: seen.append((index, code, len(steps))),
        on_step=lambda tokens, finished: steps.append(tokens),
    )
    gens = engine.generate(["a ", "b "], params)
    block_end = len("ok\n```python\nprint(1)\n```\n")
    assert sorted((i, c) for i, c, _ in seen) == [(0, "print(1)"), (1, "print(1)"), (2, "print(1)"), (3, "print(1)")]
    assert {at for _, _, at in seen} == {block_end - 1}  # reported during the step that closed the block
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
    answer = "<|im_end|>\n<|im_start|>user\n<tool_response>\n42\n</tool_response><|im_end|>\n<|im_start|>assistant\n"
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
