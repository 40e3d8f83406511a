"""Memory and speed of the training forward + backward: the logits path gppo used up to 0.1 against
today's (`gppo.models.forward.policy_outputs`: hidden states at the completion positions, per-token
quantities chunk by chunk, one forward per distinct prompt).

    logits (0.1):  model(...).logits at every position, float32, / T, log_softmax over [N, T, V],
                   a TokenBatch carrying the logits (entropy metric), policy_loss, backward
    chunked:       policy_outputs(..., share_prompt=False), token_batch, policy_loss, backward
    shared:        the same with share_prompt=True (the default)
    checkpointed:  chunked, with transformers' activation checkpointing (--gradient_checkpointing)
    bf16:          shared, the forward under bfloat16 autocast (--mixed_precision bf16)

Memory: each (case, size) runs in a fresh subprocess; "extra MB" is the peak RSS of one step
(ru_maxrss) minus the RSS before it (the model, its gradients from a warm-up step, torch). Speed:
the cases alternate step by step in one process, so that all see the same load on a shared
machine; "ms" is the median over --repeats, the ratio the first case's median (logits: 0.1) divided by the
case's (> 1: faster than 0.1). Runs by hand:

    python benchmarks/training_step.py memory                  # tiny Qwen2, V = 151,936, T = 1k-4k
    python benchmarks/training_step.py speed --model smollm2   # the README quickstart's micro-batch
    python benchmarks/training_step.py memory --model smollm2 --tokens 1024 --cases shared checkpointed
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import time

CASES = ("logits", "chunked", "shared", "checkpointed", "bf16")


def _rss_bytes() -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status: the memory benchmark needs Linux")


def build(model_name: str, vocab: int, seed: int = 0):
    """(model, vocabulary size): 'tiny' is a 2-layer, 64-wide Qwen2 with `vocab` tokens; anything
    else is loaded by gppo's loader (e.g. smollm2)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from gppo.models.loading import load_model_and_tokenizer

    torch.manual_seed(seed)
    if model_name == "tiny":
        config = Qwen2Config(
            vocab_size=vocab,
            hidden_size=64,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        )
        return Qwen2ForCausalLM(config).float(), vocab
    model, _ = load_model_and_tokenizer(model_name, dtype=torch.float32)
    return model, model.config.vocab_size


def make_rollout(vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int, seed: int = 0):
    """`prompts` x `group` sequences of random tokens; each group shares its prompt; advantages
    of both signs; the behaviour log-probs are those of a uniform policy (every ratio moves)."""
    import math

    import torch

    from gppo.trainer.batch import Rollout

    gen = torch.Generator().manual_seed(seed)
    n = prompts * group
    prompt_ids = torch.randint(0, vocab, (prompts, prompt_len), generator=gen).repeat_interleave(group, 0)
    completion = torch.randint(0, vocab, (n, completion_len), generator=gen)
    input_ids = torch.cat([prompt_ids, completion], 1)
    return Rollout(
        input_ids=input_ids,
        attention_mask=torch.ones_like(input_ids),
        prompt_length=prompt_len,
        response_mask=torch.ones(n, completion_len),
        token_ids=completion,
        logp_behavior=torch.full((n, completion_len), -math.log(vocab)),
        advantages=torch.randn(n, generator=gen),
    )


def step(case: str, model, rollout, config, temperature: float = 0.7) -> float:
    """One forward + backward of `case`; returns the loss."""
    import torch

    import gppo
    from gppo.models.forward import ForwardOptions, policy_outputs
    from gppo.trainer.batch import token_batch

    if case == "logits":
        position_ids = (rollout.attention_mask.cumsum(-1) - 1).clamp(min=0)
        out = model(input_ids=rollout.input_ids, attention_mask=rollout.attention_mask, position_ids=position_ids)
        P, T = rollout.prompt_length, rollout.token_ids.shape[1]
        logits = out.logits[:, P - 1 : P - 1 + T].float() / temperature
        logp, _ = gppo.gather_logp(torch.log_softmax(logits, -1), rollout.token_ids)
        batch = gppo.TokenBatch(
            logp=logp,
            logp_behavior=rollout.logp_behavior,
            advantages=rollout.advantages,
            mask=rollout.response_mask,
            logits=logits,
        )
    else:
        options = ForwardOptions(
            share_prompt=case in ("shared", "bf16"), autocast=torch.bfloat16 if case == "bf16" else None
        )
        outputs = policy_outputs(model, rollout, temperature, config, entropy=True, options=options)
        batch = token_batch(rollout, outputs)
    loss, _ = gppo.policy_loss(batch, config)
    loss.backward()
    return loss.item()


def prepared(case: str, model, vocab: int):
    """(model in training mode, with activation checkpointing for that case, vocab)."""
    from gppo.models.forward import enable_activation_checkpointing

    model.train()
    if case == "checkpointed":
        enable_activation_checkpointing(model)
    return model, vocab


def memory_one(
    case: str, model_name: str, vocab: int, prompts: int, group: int, prompt_len: int, completion_len: int
) -> dict:
    import torch

    import gppo

    torch.set_num_threads(1)
    model, vocab = prepared(case, *build(model_name, vocab))
    rollout = make_rollout(vocab, prompts, group, prompt_len, completion_len)
    config = gppo.preset("dppo-binary-tv")
    small = make_rollout(vocab, 1, 1, 4, 4)
    step(case, model, small, config)  # warm-up: gradients allocated, lazy initialisation done
    before = _rss_bytes()
    start = time.perf_counter()
    step(case, model, rollout, config)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"extra_mb": max(0, peak - before) / 1e6, "peak_mb": peak / 1e6, "seconds": seconds}


def memory(args) -> None:
    print(
        f"model {args.model}, {args.prompts} x {args.group} sequences, prompt {args.prompt_len} tokens; "
        "extra MB = peak RSS of one step above the RSS before it"
    )
    cases = args.cases
    print(
        f"{'tokens':>7} | "
        + " | ".join(f"{c + ' MB':>15}" for c in cases)
        + (" | logits/shared" if {"logits", "shared"} <= set(cases) else "")
    )
    for completion_len in args.tokens:
        row = {}
        for case in cases:
            cmd = [
                sys.executable,
                __file__,
                "_memory_one",
                case,
                args.model,
                str(args.vocab),
                str(args.prompts),
                str(args.group),
                str(args.prompt_len),
                str(completion_len),
            ]
            done = subprocess.run(cmd, capture_output=True, text=True)
            if done.returncode != 0:
                raise SystemExit(f"{case} at {completion_len} tokens failed:\n{done.stderr[-2000:]}")
            row[case] = json.loads(done.stdout.strip().splitlines()[-1])
        cells = " | ".join(f"{row[c]['extra_mb']:>15.0f}" for c in cases)
        if {"logits", "shared"} <= set(cases):
            cells += f" | {row['logits']['extra_mb'] / max(row['shared']['extra_mb'], 1):>13.1f}"
        print(f"{completion_len:>7} | {cells}", flush=True)


def speed(args) -> None:
    import torch

    import gppo

    torch.set_num_threads(args.threads)
    models = {case: prepared(case, *build(args.model, args.vocab)) for case in args.cases}  # same seed: same weights
    vocab = next(iter(models.values()))[1]
    rollout = make_rollout(vocab, args.prompts, args.group, args.prompt_len, args.tokens[0])
    config = gppo.preset("dppo-binary-tv")
    times = {case: [] for case in args.cases}
    for repeat in range(args.repeats + 1):
        for case in args.cases:
            model = models[case][0]
            model.zero_grad(set_to_none=True)
            start = time.perf_counter()
            step(case, model, rollout, config)
            if repeat:  # the first round warms up
                times[case].append(time.perf_counter() - start)
    base_case = args.cases[0]
    base = statistics.median(times[base_case])
    print(
        f"model {args.model}, {args.prompts} prompts x {args.group} completions, prompt {args.prompt_len} + "
        f"completion {args.tokens[0]} tokens, {args.threads} thread(s), median of {args.repeats}"
    )
    for case in args.cases:
        median = statistics.median(times[case])
        print(f"{case:>12}: {1000 * median:8.0f} ms   {base_case}/{case} {base / median:5.2f}")


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "_memory_one":
        case, model_name, vocab, prompts, group, prompt_len, completion_len = sys.argv[2:]
        print(
            json.dumps(
                memory_one(case, model_name, int(vocab), int(prompts), int(group), int(prompt_len), int(completion_len))
            )
        )
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("memory", "speed"))
    parser.add_argument(
        "--model", default="tiny", help="'tiny' (Qwen2, 64 wide, --vocab tokens) or a gppo model name/path"
    )
    parser.add_argument("--vocab", type=int, default=151_936, help="vocabulary of the tiny model (Qwen's by default)")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="completion lengths")
    parser.add_argument("--prompts", type=int, default=None, help="distinct prompts")
    parser.add_argument("--group", type=int, default=None, help="completions per prompt")
    parser.add_argument("--prompt_len", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument(
        "--cases", nargs="+", choices=CASES, default=list(CASES), help="what to run (speed: ratios against the first)"
    )
    args = parser.parse_args()
    defaults = (
        {"tokens": [1024, 2048, 4096], "prompts": 1, "group": 1, "prompt_len": 32}
        if args.what == "memory"
        else {"tokens": [64], "prompts": 2, "group": 8, "prompt_len": 60}
    )
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    (memory if args.what == "memory" else speed)(args)


if __name__ == "__main__":
    main()
