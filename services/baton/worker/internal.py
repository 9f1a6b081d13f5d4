"""Internal endpoints of the prefill and decode roles (docs/design.md §2). Routers call
them; they are not part of the OpenAI surface and the router does not expose them. Bodies
are the typed messages of `common.internal`; one that does not validate is a 400.

    POST /internal/prefill   PrefillRequest  -> PrefillResponse      (roles prefill, decode)
    POST /internal/release   ReleaseRequest  -> {"released": bool}   (roles prefill, decode)
    POST /internal/generate  GenerateRequest -> the OpenAI answer    (role decode)

A decode pod answers prefills too: that is how it lends a peer a prompt's prefix it holds
(a router's peer fetch asks it to "prefill" those whole blocks, which its prefix cache or
offload tier already has, and the peer pulls them under the lease).

A prefill samples the first token with the request's own sampling settings (greedy stays
greedy, a seed is used) but never stops on it: stop conditions are the decode pod's, which
applies them to the first token too. Its KV stays held (`HoldKV`) for a decode pod to pull.

A generate with `kv_transfer_params` pulls the prompt's KV (`PullKV`); one with `peer_prefix`
pulls that prefix from the peer that lent it and prefills the rest (`PullPrefix`); else the
decode pod prefills locally. Each goes through the same pipeline as a public request
(`pipeline.py`).
`return_token_ids` adds `TokenEvent`s to the stream (`openai_api`); `resume` continues a
stream another decode pod started: its prompt is the original prompt + the tokens already
sent, a seeded sampler skips the draws those tokens took, and the usage, id, `created` and
text offsets go on from the interrupted stream.
"""

from __future__ import annotations

import time
from dataclasses import replace

from fastapi import FastAPI, Request
from starlette.responses import Response

from baton.common.errors import OpenAIError
from baton.common.internal import (
    FirstTokenLogprobs,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    ReleaseRequest,
)
from baton.common.parsing import parse_request_off_loop
from baton.common.protocol import parse_request
from baton.common.roles import Role
from baton.common.sampling_params import SamplingParams
from baton.common.tracing import NO_SPAN, Span
from baton.engine.kv_connector import HoldKV, PullKV, PullPrefix
from baton.worker import traces
from baton.worker.fair_share import DEFAULT_TENANT
from baton.worker.openai_api import Internal
from baton.worker.pipeline import Call, Pipeline, constraint_field, tenant_of
from baton.worker.serving import engine_error, new_id
from baton.worker.state import WorkerState


def install_internal_routes(app: FastAPI, state: WorkerState) -> None:
    """Add the internal endpoint of `state`'s role (none for `both`)."""
    role = state.settings.role
    if role in (Role.PREFILL, Role.DECODE):  # a decode pod lends its prefixes to peers
        @app.post("/internal/prefill")
        async def internal_prefill(request: Request):
            msg = await parse_request_off_loop(PrefillRequest, await request.body())
            pipeline = state.require_pipeline()
            span = traces.start_request(pipeline.tracing, "worker.prefill", request.headers)
            answer = await prefill(pipeline, msg, new_id("prefill"), span, tenant_of(request))
            return Response(answer.model_dump_json(), media_type="application/json")

        @app.post("/internal/release")
        async def internal_release(request: Request):
            """A router's word that nobody will pull this lease (its client left)."""
            msg = parse_request(ReleaseRequest, await request.body())
            if state.engine is None:
                return {"released": False}
            return {"released": await state.engine.release_lease(msg.lease_id)}

    if role == Role.DECODE:
        @app.post("/internal/generate")
        async def internal_generate(request: Request):
            msg = await parse_request_off_loop(GenerateRequest, await request.body())
            return await state.require_pipeline().serve(request, generate_call(msg))


def prefill_params(params: SamplingParams) -> SamplingParams:
    """The request's sampling settings for its first token only, with no stop conditions
    (its logprobs, logit bias and output constraint kept: the first token is the
    request's own)."""
    return replace(params, n=1, max_tokens=1, min_tokens=0, stop=[], stop_token_ids=[],
                   ignore_eos=True)


async def prefill(pipeline: Pipeline, msg: PrefillRequest, request_id: str,
                  span: Span = NO_SPAN, tenant: str = DEFAULT_TENANT) -> PrefillResponse:
    """Compute the prompt's KV and hold it; `span` (the request's) ends with it. Raises
    OpenAIError: 400 for a bad request or more than one prompt, 429 when the queue is
    full, 5xx when the engine fails or ends without KV to hand over."""
    jobs: list = []
    try:
        jobs = await _prefill_jobs(pipeline, msg, request_id)
        answer = await _run_prefill(pipeline.serving, jobs, request_id, tenant)
    except BaseException as err:
        traces.end_request(pipeline.tracing, span, jobs, err)
        raise
    traces.end_request(pipeline.tracing, span, jobs)
    return answer


async def _prefill_jobs(pipeline: Pipeline, msg: PrefillRequest, request_id: str) -> list:
    req = msg.request
    pipeline.check_model(req.model)
    lora = await pipeline.lora.adapter_for(req.model)  # None: the base model
    prompts = [list(msg.prompt_token_ids)] if msg.prompt_token_ids is not None \
        else await pipeline.tokenize_prompts(msg.api, req)
    if len(prompts) != 1:
        raise OpenAIError(400, "remote prefill takes one prompt per request")
    params = prefill_params(pipeline.sampling_params(msg.api, req))
    grammar = await pipeline.serving.compile_grammar(params.structured, constraint_field(req))
    return pipeline.serving.make_jobs(request_id, prompts, params, "prompt",
                                      kv=HoldKV(peer=msg.peer_prefix), priority=req.priority,
                                      grammar=grammar, lora=lora)


async def _run_prefill(serving, jobs: list, request_id: str, tenant: str) -> PrefillResponse:
    serving.admit(jobs, tenant)
    t0 = time.monotonic()
    first: list = []  # the first token's logprobs, when asked for
    try:
        async for _, batch in serving.run(jobs):
            first += [lp for out in batch for lp in out.new_logprobs or ()]
    except Exception as err:  # noqa: BLE001 - engine death: a clean 5xx
        raise engine_error(err) from None
    finally:
        serving.abort(jobs)
    kv = jobs[0].kv_transfer_params
    if kv is None:
        raise OpenAIError(500, f"the prefill of {request_id} ended without KV to hand over",
                          code="prefill_failed")
    if first:
        lp = first[0]
        kv = kv.model_copy(update={"first_token_logprobs": FirstTokenLogprobs(
            logprob=lp.logprob, rank=lp.rank, top=list(lp.top))})
    return PrefillResponse(prompt_token_ids=jobs[0].prompt_ids, kv_transfer_params=kv,
                           prefill_s=time.monotonic() - t0)


def generate_call(msg: GenerateRequest) -> Call:
    """What the pipeline serves for a decode pod's GenerateRequest. A resumed stream always
    carries token events (its router tracks it)."""
    ids = msg.prompt_token_ids
    kv: PullKV | PullPrefix | None = None
    if msg.kv_transfer_params is not None:
        kv = PullKV(msg.kv_transfer_params)
    elif msg.peer_prefix is not None:
        kv = PullPrefix(msg.peer_prefix)
    internal = Internal(return_token_ids=msg.return_token_ids or msg.resume is not None,
                        resume=msg.resume)
    return Call(msg.api, msg.request, [list(ids)] if ids is not None else None, kv, internal)
