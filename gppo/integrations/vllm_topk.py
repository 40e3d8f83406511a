"""mu's top-K of every generated token from a vLLM server's generate requests, for
gppo.integrations.verl_topk (verl's server: verl_topk_server.TopKvLLMHttpServer). Needs neither verl
nor vLLM to import: the server passes its engine and its own generate in."""

from __future__ import annotations

import contextvars

from gppo.rollout.vllm import ranked_topk

TOPK_REQUEST = "gppo_topk"  # key of a generate request's sampling_params: record mu's top-K with this K
TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD = "gppo_topk_ids", "gppo_topk_logprobs"  # TokenOutput.extra_fields
TOKEN_VERSIONS_FIELD = "gppo_token_versions"  # TokenOutput.extra_fields: the weight version of each token
_recording: contextvars.ContextVar = contextvars.ContextVar("gppo_topk_recording", default=None)


class TopKRecording:
    """One generate request's wish for mu's top-K and the last output vLLM streamed for it."""

    def __init__(self, k: int):
        self.k = k
        self.final = None


class RecordingEngine:
    """vLLM's engine client as verl's server uses it, except that `generate` inside a request that
    records (`generate_with_topk`) asks vLLM for logprobs=K and keeps the last output."""

    def __init__(self, engine):
        self._engine = engine

    def __getattr__(self, name):
        return getattr(self._engine, name)

    async def generate(self, *args, sampling_params, **kwargs):
        recording = _recording.get()
        if recording is not None:
            sampling_params.logprobs = max(sampling_params.logprobs or 0, recording.k)
        async for output in self._engine.generate(*args, sampling_params=sampling_params, **kwargs):
            if recording is not None:
                recording.final = output
            yield output


async def generate_with_topk(generate, prompt_ids, sampling_params: dict, request_id, *args, **kwargs):
    """Run a verl server's `generate` (whose engine is a RecordingEngine); when `sampling_params`
    carries TOPK_REQUEST = K, add mu's top-K of every generated token to the TokenOutput's
    extra_fields (TOPK_IDS_FIELD, TOPK_LOGPROBS_FIELD: [T][K], most probable first)."""
    sampling_params = dict(sampling_params)
    k = sampling_params.pop(TOPK_REQUEST, 0)
    if not k:
        return await generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
    recording = TopKRecording(k)
    token = _recording.set(recording)
    try:
        output = await generate(prompt_ids, sampling_params, request_id, *args, **kwargs)
    finally:
        _recording.reset(token)
    if output.token_ids:  # an aborted request returns no tokens
        per_token = recording.final.outputs[0].logprobs[: len(output.token_ids)]
        steps = [ranked_topk(entries, k) for entries in per_token]
        output.extra_fields[TOPK_IDS_FIELD] = [ids for ids, _ in steps]
        output.extra_fields[TOPK_LOGPROBS_FIELD] = [lps for _, lps in steps]
    return output
