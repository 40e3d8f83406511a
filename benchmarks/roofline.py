"""Roofline of one RL step: per phase, the work it does (FLOPs counted from the model's shapes and
the real token counts; for decoding also the bytes it reads), its time, and the share of this
machine's own rate it reaches, all measured in one run:

    matmul rate   x @ W.T at the model's shapes (each distinct linear layer of a decoder layer and
                  the output layer, 512 rows, weighted by how often the model runs it), float32
                  and bfloat16
    bandwidth     bytes per second of one read of a 1 GiB float32 tensor (a sum)

Phases (the README quickstart's sizes by default: SmolLM2, word-problems, 8 prompts x 8, 64 new
tokens, micro-batches of 8, mini-batches of 32; one step):

    evaluation     the step-0 evaluation: greedy and one sampled completion of each held-out problem
    sampling       the engine's prefill and decoding of the step's completions
    scoring        the verifier on them (no FLOPs)
    pi_old pass    one no-grad forward of the policy over the batch: what anchor='old', a separate
                   rollout copy or a KL penalty's reference pass each add
    update         forward and backward of every micro-batch, and AdamW
    weight sync    the engine's copy of the weights refreshed (none with the hf engine)

FLOPs of one position of a forward, at context c (keys it attends to): 2 x the decoder's linear
parameters + 4 x layers x c x heads x head_dim (scores and values), plus 2 x H x V where the output
layer scores it; the backward does twice the forward's work, except the output layer, which
`gppo.token_stats` recomputes in its backward (4 x 2HV in all). The forward runs each distinct
prompt once (share_prompt) and every row's completion after it; padding is what it computes
beyond each row's real tokens, counted apart. Decoding reads every weight once per step and each
active row's key/value cache.

    python benchmarks/roofline.py                   # the quickstart's model and batch, 2 threads
    python benchmarks/roofline.py --model tiny      # the embedded model (a smoke run)
    python benchmarks/roofline.py --device cuda     # on a GPU: gppo's defaults there (bf16 autocast, TF32)

On CUDA every timing waits for the device (torch.cuda.synchronize), and the rates are measured
after the trainer has set TF32 as its config says.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from dataclasses import dataclass

import torch

ROWS = 512  # rows of the matmul-rate probe: a micro-batch's tokens


@dataclass
class Work:
    """FLOPs on real tokens, FLOPs on padding, bytes read (decoding), seconds."""

    flops: float = 0.0
    padding: float = 0.0
    bytes: float = 0.0
    seconds: float = 0.0


DEVICE = torch.device("cpu")  # main() sets it from --device


def now() -> float:
    """time.perf_counter() once the device's queued work has finished."""
    if DEVICE.type == "cuda":
        torch.cuda.synchronize(DEVICE)
    return time.perf_counter()


def timed(fn, repeats: int = 3) -> float:
    """The fastest of `repeats` runs of fn(), in seconds, after one warm-up."""
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = now()
        fn()
        best = min(best, now() - start)
    return best


def linear_shapes(model) -> dict[tuple[int, int], int]:
    """(out, in) of every Linear the model runs per token -> how many there are (the output layer
    once)."""
    shapes: dict[tuple[int, int], int] = {}
    for module in model.get_decoder().modules():
        if isinstance(module, torch.nn.Linear):
            shapes[tuple(module.weight.shape)] = shapes.get(tuple(module.weight.shape), 0) + 1
    head = tuple(model.get_output_embeddings().weight.shape)
    shapes[head] = shapes.get(head, 0) + 1
    return shapes


def matmul_rate(shapes: dict[tuple[int, int], int], dtype: torch.dtype) -> float:
    """FLOP/s of x [ROWS, in] @ W.T over the model's linear shapes, each weighted by its count."""
    flops = seconds = 0.0
    for (out_features, in_features), count in shapes.items():
        x = torch.randn(ROWS, in_features, device=DEVICE).to(dtype)
        w = torch.randn(out_features, in_features, device=DEVICE).to(dtype)
        seconds += count * timed(lambda x=x, w=w: torch.nn.functional.linear(x, w))
        flops += count * 2 * ROWS * in_features * out_features
    return flops / seconds


def bandwidth() -> float:
    """Bytes per second of one read of a 1 GiB float32 tensor."""
    x = torch.ones(1 << 28, device=DEVICE)
    return x.numel() * 4 / timed(lambda: x.sum())


@dataclass(frozen=True)
class Shapes:
    linear_params: int  # the decoder's linear weights
    layers: int
    attention_width: int  # heads x head_dim
    kv_width: int  # key/value heads x head_dim
    hidden: int
    vocab: int
    weight_bytes: int  # every parameter the decoding step reads

    @classmethod
    def of(cls, model) -> Shapes:
        c = model.config
        head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
        linear = sum(m.weight.numel() for m in model.get_decoder().modules() if isinstance(m, torch.nn.Linear))
        return cls(linear, c.num_hidden_layers, c.num_attention_heads * head_dim,
                   getattr(c, "num_key_value_heads", c.num_attention_heads) * head_dim, c.hidden_size,
                   c.vocab_size, sum(p.numel() * p.element_size() for p in model.parameters()))  # fmt: skip

    def position(self, context: int) -> float:
        """Forward FLOPs of one decoder position attending to `context` keys (no output layer)."""
        return 2 * self.linear_params + 4 * self.layers * context * self.attention_width

    @property
    def head(self) -> float:
        return 2 * self.hidden * self.vocab


def forward_work(shapes: Shapes, rollout, share_prompt: bool = True) -> tuple[float, float]:
    """(real, padding) forward FLOPs of `gppo.models.forward.policy_outputs` on a micro-batch:
    each distinct prompt once (share_prompt), each row's completion after its prompt, the output
    layer at the real completion tokens only."""
    ids, mask, P = rollout.input_ids, rollout.attention_mask, rollout.prompt_length
    T = rollout.token_ids.shape[1]
    real = padding = 0.0
    prompt_rows = torch.unique(torch.cat([ids[:, :P], mask[:, :P]], 1), dim=0) if share_prompt else mask[:, :P]
    for row in prompt_rows[:, -P:] if share_prompt else prompt_rows:
        for j, is_real in enumerate(row.tolist(), start=1):
            cost = shapes.position(j)
            real, padding = (real + cost, padding) if is_real else (real, padding + cost)
    for length in rollout.response_mask.sum(-1).long().tolist():  # positions P .. P + T - 2
        for j in range(1, T):
            cost = shapes.position(P + j)
            real, padding = (real + cost, padding) if j < length else (real, padding + cost)
    real += shapes.head * rollout.response_mask.sum().item()
    return real, padding


def decoding_work(shapes: Shapes, generations) -> Work:
    """Prefill (each distinct prompt once) and decoding of `generations`: FLOPs, and bytes
    read per step (every weight once, each active row's key/value cache)."""
    work = Work()
    prompts = {tuple(g.prompt_ids) for g in generations}
    width = max(len(p) for p in prompts)
    for prompt in prompts:  # left-padded to the longest prompt of the call
        for j in range(1, width + 1):
            cost = shapes.position(j)
            if j > width - len(prompt):
                work.flops += cost
            else:
                work.padding += cost
        work.flops += shapes.head
    lengths = [len(g.completion_ids) for g in generations]
    kv_bytes_per_position = 2 * shapes.layers * shapes.kv_width * 4
    for step in range(1, max(lengths, default=0)):  # step 0's token comes from the prefill
        active = sum(length > step for length in lengths)
        work.bytes += shapes.weight_bytes + active * (width + step) * kv_bytes_per_position
        work.flops += active * (shapes.position(width + step) + shapes.head)
    return work


class Recorder:
    """Wraps the engine's generate and the reward pipeline: the work and time of each call go to
    the phase now current."""

    def __init__(self, shapes: Shapes, phases: dict[str, Work], generate, rewards):
        self.shapes, self.phases, self.phase = shapes, phases, "evaluation"
        self._generate, self._rewards = generate, rewards

    def generate(self, prompts, params):
        start = now()
        out = self._generate(prompts, params)
        phase = self.phases[self.phase]
        phase.seconds += now() - start
        work = decoding_work(self.shapes, out)
        phase.flops, phase.padding, phase.bytes = (phase.flops + work.flops, phase.padding + work.padding,
                                                   phase.bytes + work.bytes)  # fmt: skip
        return out

    def __call__(self, *args, **kwargs):  # the reward pipeline
        start = now()
        out = self._rewards(*args, **kwargs)
        self.phases["scoring" if self.phase == "sampling" else self.phase].seconds += now() - start
        return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2", help="smollm2 (the quickstart) or tiny (the embedded model)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    global DEVICE
    DEVICE = torch.device(args.device)

    from gppo.models.forward import policy_outputs
    from gppo.trainer import Trainer
    from gppo.trainer.config import from_dict

    quickstart = dict(task="word-problems", prompts_per_step=8, group_size=8, max_new_tokens=64, temperature=0.7,
                      lr=2e-5, epochs=1, mini_batch_size=32, micro_batch_size=8, eval_size=64, eval_samples=1)  # fmt: skip
    if args.model == "tiny":
        quickstart = dict(prompts_per_step=8, group_size=8, mini_batch_size=32, micro_batch_size=8, eval_size=64)
    else:
        quickstart["model"] = args.model
    run_dir = tempfile.mkdtemp(prefix="gppo-roofline-")
    config = from_dict({**quickstart, "steps": 1, "eval_every": 0, "seed": args.seed, "threads": args.threads, "device": args.device,
                        "progress": False, "output_dir": run_dir})  # fmt: skip
    trainer = Trainer(config)
    model, device = trainer.model, trainer.device
    shapes = Shapes.of(model)
    linears = linear_shapes(model)
    rates = {"float32": matmul_rate(linears, torch.float32), "bfloat16": matmul_rate(linears, torch.bfloat16)}
    read_rate = bandwidth()

    phases = {name: Work() for name in ("evaluation", "sampling", "scoring", "pi_old pass", "update", "weight sync")}
    recorder = Recorder(shapes, phases, trainer.engine.generate, trainer.generator.rewards)
    trainer.engine.generate, trainer.generator.rewards = recorder.generate, recorder
    total = now()
    trainer.evaluate()
    phases["evaluation"].seconds = now() - total  # its scoring included
    recorder.phase = "sampling"
    rollout, _ = trainer.rollout(0)
    rollout = trainer.prepare(rollout)
    micro_batches = [
        rollout.select(index) for index in torch.arange(rollout.size, device=device).split(config.micro_batch_size)
    ]
    with torch.no_grad():
        start = now()
        for sub in micro_batches:
            policy_outputs(model, sub, config.temperature, options=trainer.forward_options)
        phases["pi_old pass"].seconds = now() - start
    start = now()
    trainer.update(rollout)
    phases["update"].seconds = now() - start
    start = now()
    trainer.sync_rollout_weights()
    phases["weight sync"].seconds = now() - start
    total = now() - total
    for sub in micro_batches:
        real, padding = forward_work(shapes, sub, trainer.forward_options.share_prompt)
        head = shapes.head * sub.response_mask.sum().item()
        phases["pi_old pass"].flops += real
        phases["pi_old pass"].padding += padding
        phases["update"].flops += 3 * real + head  # backward: 2x, and the output layer's recompute
        phases["update"].padding += 3 * padding
    trainer.close()

    precision = config.resolved_mixed_precision(device)
    update_rate = rates["bfloat16" if precision == "bf16" else "float32"]
    print(f"model {args.model}: {shapes.linear_params / 1e6:.1f}M decoder linear parameters, V = {shapes.vocab:,}; "
          f"{args.threads} threads; {DEVICE}, mixed precision {precision}, tf32 {config.uses_tf32(device)}")  # fmt: skip
    print(f"this machine: float32 matmul {rates['float32'] / 1e9:.0f} GFLOP/s, bfloat16 {rates['bfloat16'] / 1e9:.0f} "
          f"GFLOP/s (the model's shapes, {ROWS} rows), read bandwidth {read_rate / 1e9:.1f} GB/s")  # fmt: skip
    print()
    print("| phase | s | share of the step | GFLOP real | GFLOP padding | GFLOP/s | of the matmul rate | GB read | "
          "of the bandwidth |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for name, w in phases.items():
        rate = w.flops / w.seconds if w.seconds > 0 else 0.0
        reference = update_rate if name in ("update", "pi_old pass") else rates["float32"]
        share = f"{rate / reference:.0%}" if w.flops else "-"
        read = f"{w.bytes / 1e9:.3g}" if w.bytes else "-"
        of_bandwidth = f"{w.bytes / w.seconds / read_rate:.0%}" if w.bytes and w.seconds else "-"
        print(f"| {name} | {w.seconds:.3g} | {w.seconds / total:.0%} | {w.flops / 1e9:.3g} | {w.padding / 1e9:.3g} | "
              f"{rate / 1e9:.3g} | {share} | {read} | {of_bandwidth} |")  # fmt: skip
    print(f"\ntotal {total:.1f} s (the step-0 evaluation included)")


if __name__ == "__main__":
    main()
