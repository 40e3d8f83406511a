"""mu's top-K from a vLLM server's generate requests (gppo.integrations.vllm_topk), the server side of
the top-K estimators in verl (docs/verl.md).

`generate_with_topk` runs around a stand-in for verl 0.9.1's `vLLMHttpServer.generate` and vLLM's
engine that follows their code: SamplingParams with logprobs 0 (or None) built inside the server,
the engine's streamed outputs, `logprobs[token]` per generated token. It runs in the main suite,
without verl or vLLM (verl's real server on vLLM's CPU build is tests/test_verl_vllm_server.py, in
CI's vLLM stage): checked here are that K reaches vLLM on the requests that ask only, that the
returned top-K equals mu's `topk`, that the sampled token's log-probs stay what verl returns, and
that concurrent requests do not mix.
"""

from __future__ import annotations

import asyncio
from collections import namedtuple
from dataclasses import dataclass, field

import pytest
import torch

from gppo.integrations import vllm_topk

Logprob = namedtuple("Logprob", "logprob rank")  # the two fields of vLLM's Logprob that are read


def vllm_step(log_mu: torch.Tensor, sampled: int, k: int) -> dict:
    """vLLM's logprobs dict of one generated position asked for logprobs=k: the top k (ranks 1..k)
    and the sampled token with its rank."""
    order = log_mu.argsort(descending=True).tolist()
    return {t: Logprob(float(log_mu[t]), order.index(t) + 1) for t in set(order[:k]) | {sampled}}


class StandInEngine:
    """vLLM's AsyncLLM.generate as verl's server calls it: streams outputs whose last holds, per
    generated token, the logprobs dict for the requested sampling_params.logprobs."""

    def __init__(self, log_mu: torch.Tensor, tokens: list[int]):
        self.log_mu, self.tokens, self.requested = log_mu, tokens, []

    async def generate(self, *, prompt, sampling_params, request_id):
        self.requested.append(sampling_params.logprobs)
        k = sampling_params.logprobs
        steps = None if k is None else [vllm_step(self.log_mu[t], tok, k) for t, tok in enumerate(self.tokens)]
        for n in (1, len(self.tokens)):
            await asyncio.sleep(0)
            completion = namedtuple("Completion", "token_ids logprobs")(self.tokens[:n], steps and steps[:n])
            yield namedtuple("RequestOutput", "outputs")([completion])


class SamplingParams:
    def __init__(self, logprobs):
        self.logprobs = logprobs


@dataclass
class TokenOutput:
    token_ids: list[int]
    log_probs: list[float] | None
    extra_fields: dict = field(default_factory=dict)


class StandInServer:
    """What verl's vLLMHttpServer.generate does around the engine: SamplingParams with logprobs 0 when
    the sampled token's log-prob is asked for (else None), the stream, logprobs[token] per token."""

    def __init__(self, engine):
        self.engine = vllm_topk.RecordingEngine(engine)

    async def generate(self, prompt_ids, sampling_params, request_id):
        params = SamplingParams(0 if sampling_params.pop("logprobs", False) else None)
        assert not sampling_params, sampling_params  # anything else would reach vLLM's SamplingParams
        final = None
        async for output in self.engine.generate(prompt=prompt_ids, sampling_params=params, request_id=request_id):
            final = output
        tokens = final.outputs[0].token_ids
        log_probs = (
            None
            if params.logprobs is None
            else [entries[tokens[i]].logprob for i, entries in enumerate(final.outputs[0].logprobs)]
        )
        return TokenOutput(tokens, log_probs, {"global_steps": 0})


def sampled_rollout(seed, steps, vocab):
    gen = torch.Generator().manual_seed(seed)
    log_mu = torch.log_softmax(torch.randn(steps, vocab, generator=gen), -1)
    return log_mu, torch.multinomial(log_mu.exp(), 1, generator=gen)[:, 0].tolist()


def test_topk_comes_back_ranked_and_requests_without_it_are_unchanged():
    log_mu, tokens = sampled_rollout(0, 6, 50)
    engine = StandInEngine(log_mu, tokens)
    server = StandInServer(engine)

    async def both():
        return await asyncio.gather(
            vllm_topk.generate_with_topk(server.generate, [1, 2], {"logprobs": True, vllm_topk.TOPK_REQUEST: 5}, "a"),
            vllm_topk.generate_with_topk(server.generate, [1, 2], {"logprobs": True}, "b"),
        )

    with_topk, without = asyncio.run(both())
    assert sorted(engine.requested) == [0, 5]  # K reached vLLM for one request only
    want_lps, want_ids = log_mu.topk(5, dim=-1)
    assert with_topk.extra_fields[vllm_topk.TOPK_IDS_FIELD] == want_ids.tolist()
    assert torch.allclose(torch.tensor(with_topk.extra_fields[vllm_topk.TOPK_LOGPROBS_FIELD]), want_lps)
    sampled = log_mu.gather(-1, torch.tensor(tokens)[:, None])[:, 0]
    for output in (with_topk, without):
        assert output.token_ids == tokens
        assert torch.allclose(torch.tensor(output.log_probs), sampled)  # the sampled token's, as verl returns
    assert without.extra_fields == {"global_steps": 0}


def test_topk_is_recorded_when_the_sampled_logprob_is_not_asked_for():
    log_mu, tokens = sampled_rollout(1, 3, 30)
    server = StandInServer(StandInEngine(log_mu, tokens))
    request = {vllm_topk.TOPK_REQUEST: 4}
    out = asyncio.run(vllm_topk.generate_with_topk(server.generate, [1], request, "c"))
    assert out.extra_fields[vllm_topk.TOPK_IDS_FIELD] == log_mu.topk(4, dim=-1).indices.tolist()
    assert request == {vllm_topk.TOPK_REQUEST: 4}  # the caller's dict is not consumed


def test_ranked_topk_refuses_a_short_answer():
    from gppo.rollout.vllm import ranked_topk

    with pytest.raises(RuntimeError, match="2 top log-probs for a token, 3 requested"):
        ranked_topk({5: Logprob(-0.1, 1), 6: Logprob(-2.0, 2)}, 3)
