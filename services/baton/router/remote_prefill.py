"""Disaggregated requests: pick the decode pod, ask the decider, and run the remote prefill.

    decode = await prefill.plan(api, req, request_id, ctx, tunables)  # None: colocated

With decode pods behind the router, every request is planned as a `DecodeCall` for the
decode pod picked first. When prefill pods exist too and the decider
(`scheduling.disagg`) says remote, a prefill pod (the least loaded, with the longest cached
prefix) gets `POST /internal/prefill` with a `PrefillRequest` and answers a
`PrefillResponse`: the prompt's ids and `kv_transfer_params`, which the decode pod's body
then carries. Any failure before the decode pod has the KV ends in a local prefill on the
decode pod, counted in `baton:fallbacks_total{reason}`: `no_prefill_worker` (none healthy
and not saturated), `prefill_failed` (connection error, timeout, a malformed answer),
`prefill_pod_down` (the health checks marked the pod down while the request waited on it:
it falls back at once, not after the prefill timeout), `prefill_error` (the pod failed:
a 5xx, a 408 or a 429). Every decision is counted in
`baton:disagg_decisions_total{decision="remote"|"local"}`.

A refusal the request itself caused is not a failure of the pod: a 4xx (other than 408 /
429), or a 5xx marked `X-Baton-No-Retry: 1`, goes back to the client as the pod's own
error (a local prefill would refuse it the same way), when it is OpenAI's error JSON. An
answer no Baton worker gives (`router.answers`: such a refusal in another shape, a 200
that is not a PrefillResponse) opens the pod's circuit at once and falls back
(`prefill_failed`). A client that leaves while the
prefill runs cancels the call (the prefill pod aborts the request); one that leaves after
it, before a decode pod took the lease over, has the lease released (`router.handover`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Mapping
from dataclasses import replace

import aiohttp

from baton.common.auth import TENANT_HEADER
from baton.common.errors import OpenAIError
from baton.common.internal import (
    Api,
    KVTransferParams,
    OpenAIBody,
    PrefillRequest,
    PrefillResponse,
)
from baton.common.metrics import RouterMetrics
from baton.common.roles import Role
from baton.common.tracing import Span, Tracing
from baton.router import peer_fetch
from baton.router.answers import error_problem, identity_problem
from baton.router.discovery import Discovery, Upstream
from baton.router.handover import Handover
from baton.router.relay import refused_by_request
from baton.router.resume import DecodeCall
from baton.router.scheduling.context import Phase, RoutingContext
from baton.router.scheduling.pipeline import PREFILL_FILTERS, RoutingPipeline
from baton.router.settings import Tunables

log = logging.getLogger("baton.router")
PREFILL_PATH = "/internal/prefill"


class RemotePrefill:
    def __init__(self, session: aiohttp.ClientSession, discovery: Discovery,
                 metrics: RouterMetrics, tracing: Tracing | None = None) -> None:
        self.session = session
        self.discovery = discovery
        self.metrics = metrics
        self.tracing = tracing or Tracing()
        self.pipeline = RoutingPipeline(filters=PREFILL_FILTERS, picker="max_score",
                                        scorers={"queue": 1.0, "prefix": 1.0})

    async def plan(self, api: Api, req: OpenAIBody, request_id: str, ctx: RoutingContext,
                   tunables: Tunables) -> DecodeCall | None:
        """What the decode pod gets: with the prompt's ids and `kv_transfer_params` when a
        prefill pod ran, with `peer_prefix` when it pulls its prefix from a peer
        (`router.peer_fetch`), with neither to prefill on the decode pod (the fallback);
        None without decode pods (colocated). Raises OpenAIError when the prefill pod
        refused the request itself; any other failure falls back."""
        upstreams = self.discovery.all()
        if not any(u.role == Role.DECODE for u in upstreams):
            return None
        peers = peer_fetch.enabled(ctx, tunables.disagg)
        if peers:
            ctx = replace(ctx, peer_fetch_min_tokens=tunables.disagg.peer_fetch_min_tokens)
        decode_pod = tunables.pipeline.pick(upstreams, ctx)
        lender = peer_fetch.holder(upstreams, decode_pod, ctx, tunables.disagg) \
            if peers and decode_pod is not None else None
        if lender is not None:
            ctx = replace(ctx, peer_tokens=lender[1])
        local = DecodeCall(api, req, preferred=decode_pod)
        if not any(u.role == Role.PREFILL for u in upstreams):
            return await self._peer_fetch(local, lender, request_id, ctx, tunables)
        if not tunables.disagg.decide(decode_pod, ctx):
            self.metrics.disagg_decisions.labels("local").inc()
            return await self._peer_fetch(local, lender, request_id, ctx, tunables)
        prefill_pod = self.pipeline.pick(upstreams, replace(ctx, phase=Phase.PREFILL))
        if prefill_pod is None:
            self._local("no_prefill_worker")
            return await self._peer_fetch(local, lender, request_id, ctx, tunables)
        return await self._remote(local, prefill_pod, upstreams, request_id, ctx, tunables,
                                  peers)

    async def _remote(self, local: DecodeCall, pod: Upstream, upstreams: list[Upstream],
                      request_id: str, ctx: RoutingContext, tunables: Tunables, peers: bool
                      ) -> DecodeCall:
        """The prefill on `pod` (pulling first the prefix another pod holds, when that is
        worth it), or `local` when it fails."""
        message = PrefillRequest(api=local.api, request=local.request)
        lent = None
        lender = peer_fetch.holder(upstreams, pod, ctx, tunables.disagg) if peers else None
        if lender is not None:
            lent = await self._lend(lender, local.request, request_id, ctx, tunables)
        if lent is not None:
            assert ctx.prompt_token_ids is not None  # a lender is found only with the ids
            message = PrefillRequest(api=local.api, request=local.request,
                                     prompt_token_ids=list(ctx.prompt_token_ids),
                                     peer_prefix=lent)
        t0 = time.monotonic()
        with self.tracing.span("router.prefill", kind="client",
                               attributes={"baton.upstream": pod.url}) as span:
            answer = await self._call(pod, message, request_id, ctx, tunables, span)
        took = time.monotonic() - t0
        if answer is None:  # the decode pod prefills; the lent prefix is still its to pull
            local = replace(local, prefill_s=took)
            if lent is None or lender is None:
                return local
            return self._with_peer_prefix(local, lent, lender[0], ctx)
        return replace(local, prompt_token_ids=answer.prompt_token_ids,
                       kv_transfer_params=answer.kv_transfer_params, prefill_s=took,
                       handover=Handover(answer.kv_transfer_params, pod))

    async def _peer_fetch(self, local: DecodeCall, lender: tuple[Upstream, int] | None,
                          request_id: str, ctx: RoutingContext, tunables: Tunables
                          ) -> DecodeCall:
        """`local` with the prefix `lender` lends it (`router.peer_fetch`), or as it is when
        there is none or the lend fails."""
        if lender is None:
            return local
        lent = await self._lend(lender, local.request, request_id, ctx, tunables)
        return local if lent is None else self._with_peer_prefix(local, lent, lender[0], ctx)

    @staticmethod
    def _with_peer_prefix(local: DecodeCall, lent: KVTransferParams, holder: Upstream,
                          ctx: RoutingContext) -> DecodeCall:
        assert ctx.prompt_token_ids is not None  # a lender is found only with the ids
        return replace(local, prompt_token_ids=list(ctx.prompt_token_ids), peer_prefix=lent,
                       handover=Handover(lent, holder))

    async def _lend(self, lender: tuple[Upstream, int], request: OpenAIBody, request_id: str,
                    ctx: RoutingContext, tunables: Tunables) -> KVTransferParams | None:
        """The lease of the prompt's prefix `lender` holds, checked; None when it fails."""
        pod, tokens = lender
        assert ctx.prompt_token_ids is not None  # a lender is found only with the ids
        prefix = ctx.prompt_token_ids[:tokens]
        with self.tracing.span("router.peer_fetch", kind="client",
                               attributes={"baton.upstream": pod.url}) as span:
            answer = await self._call(pod, peer_fetch.lend_request(request, prefix),
                                      request_id, ctx, tunables, span, peer=True)
            if answer is None:
                return None
            problem = peer_fetch.lent_problem(answer.kv_transfer_params,
                                              answer.prompt_token_ids, prefix, ctx.block_tokens)
            if problem is not None:
                self.discovery.record_misbehaviour(pod, problem)
                self._failed(pod, "peer_fetch_failed", request_id, problem, span,
                             breaker=False, peer=True)
                return None
        self.metrics.peer_fetches.labels("lent").inc()
        return answer.kv_transfer_params

    async def _call(self, pod: Upstream, message: PrefillRequest, request_id: str,
                    ctx: RoutingContext, tunables: Tunables,
                    span: Span, peer: bool = False) -> PrefillResponse | None:
        """POST /internal/prefill on `pod`; None (counted, and reported to the pod's circuit
        breaker) when it fails or the pod is marked down meanwhile. Raises OpenAIError, the
        pod's own answer, when the request caused the refusal — unless `peer` (a peer
        fetch's lend: any refusal falls back)."""
        headers = self.tracing.inject({"Content-Type": "application/json",
                                       "X-Request-Id": request_id + ("-peer" if peer
                                                                     else "-prefill")})
        if ctx.tenant is not None:
            headers[TENANT_HEADER] = ctx.tenant
        pod.inflight += 1
        try:
            status, final, raw, imposter = await self._post(pod, message.to_json(), headers,
                                                            tunables)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            reason = "prefill_failed" if pod.healthy else "prefill_pod_down"
            self._failed(pod, "peer_fetch_failed" if peer else reason, request_id, repr(err),
                         span, peer=peer)
            return None
        finally:
            pod.inflight -= 1
        span.set("http.response.status_code", status)
        try:
            answer = PrefillResponse.model_validate_json(raw) if status == 200 else None
            problem = imposter or (error_problem(raw) if final else None)
        except ValueError as err:
            problem = f"a 200 that is not a PrefillResponse ({type(err).__name__})"
        if problem is not None:
            self.discovery.record_misbehaviour(pod, problem)
            self._failed(pod, "peer_fetch_failed" if peer else "prefill_failed", request_id,
                         problem, span, breaker=False, peer=peer)
            return None
        if final and not peer:
            self.metrics.upstream_errors.labels(pod.url, f"status {status}").inc()
            raise _pod_error(status, raw)
        if answer is None:
            self._failed(pod, "peer_fetch_failed" if peer else "prefill_error", request_id,
                         f"status {status}", span, breaker=status >= 500, peer=peer)
            return None
        self.discovery.record_success(pod)
        if not peer:
            if ctx.prefix_index is not None:
                ctx.prefix_index.add(pod, ctx.prefix_hashes)
            self.metrics.disagg_decisions.labels("remote").inc()
        return answer

    async def _post(self, pod: Upstream, body: bytes, headers: Mapping[str, str],
                    tunables: Tunables) -> tuple[int, bool, bytes, str | None]:
        """The pod's status, whether its refusal is final, its body, and what is wrong with
        who answered (`identity_problem`); within the prefill timeout, cut short
        (TimeoutError) if the pod is marked down meanwhile."""
        timeout = aiohttp.ClientTimeout(total=None, connect=tunables.proxy.connect_timeout_s)
        async with asyncio.timeout(tunables.disagg.prefill_timeout_s) as timer:
            stop_watching = pod.on_down(lambda: timer.reschedule(0.0))  # 0.0: expire now
            try:
                async with self.session.post(pod.url + PREFILL_PATH, data=body,
                                             headers=headers, timeout=timeout) as resp:
                    return (resp.status, refused_by_request(resp), await resp.read(),
                            identity_problem(resp.headers, pod.worker_id))
            finally:
                stop_watching()

    def _failed(self, pod: Upstream, reason: str, request_id: str, what: str, span: Span,
                breaker: bool = True, peer: bool = False) -> None:
        if breaker:
            self.discovery.record_failure(pod)
        if peer:  # the decision (local) is counted already
            self.metrics.fallbacks.labels(reason).inc()
            self.metrics.peer_fetches.labels("failed").inc()
        else:
            self._local(reason)
        span.set("baton.fallback", reason)
        log.warning("request %s: %s on %s failed (%s: %s); prefilling on decode",
                    request_id, "peer fetch" if peer else "prefill", pod.url, reason, what)

    def _local(self, reason: str) -> None:
        self.metrics.disagg_decisions.labels("local").inc()
        self.metrics.fallbacks.labels(reason).inc()


def _pod_error(status: int, raw: bytes) -> OpenAIError:
    """The prefill pod's own error answer (OpenAI-shaped), for the client."""
    try:
        error = json.loads(raw)["error"]
        return OpenAIError(status, str(error["message"]), param=error.get("param"),
                           code=error.get("code"))
    except (ValueError, KeyError, TypeError):
        return OpenAIError(status, f"the prefill worker refused the request (HTTP {status})")
