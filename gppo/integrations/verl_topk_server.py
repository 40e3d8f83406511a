"""verl 0.9.1's vLLM rollout server and replica, extended to return mu's top-K of every generated token
when a request asks for it (gppo.integrations.verl_topk; this module needs vLLM, so only the rollout
replicas import it)."""

from __future__ import annotations

import ray
from verl.workers.rollout.vllm_rollout.vllm_async_server import vLLMHttpServer, vLLMReplica

from gppo.integrations.vllm_topk import RecordingEngine, generate_with_topk


class TopKvLLMHttpServer(vLLMHttpServer):
    """verl's vLLM server; a request whose sampling_params carry TOPK_REQUEST = K also returns mu's
    top-K ids and log-probs per generated token in TokenOutput.extra_fields (generate_with_topk).
    Requests without it run exactly as in verl."""

    @property
    def engine(self):
        return self.__dict__.get("_gppo_engine")

    @engine.setter
    def engine(self, engine):
        self.__dict__["_gppo_engine"] = None if engine is None else RecordingEngine(engine)

    async def generate(self, prompt_ids, sampling_params, request_id, *args, **kwargs):
        return await generate_with_topk(super().generate, prompt_ids, sampling_params, request_id, *args, **kwargs)


class TopKvLLMReplica(vLLMReplica):
    """verl's vLLM replica, serving with TopKvLLMHttpServer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.server_class = ray.remote(TopKvLLMHttpServer)
