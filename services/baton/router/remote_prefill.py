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
from baton.common.internal import Api, OpenAIBody, PrefillRequest, PrefillResponse
from baton.common.metrics import RouterMetrics
from baton.common.roles import Role
from baton.common.tracing import Span, Tracing
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
        prefill pod ran, without them to prefill on the decode pod (the fallback); None
        without decode pods (colocated). Raises OpenAIError when the prefill pod refused
        the request itself; any other failure falls back."""
        upstreams = self.discovery.all()
        if not any(u.role == Role.DECODE for u in upstreams):
            return None
        decode_pod = tunables.pipeline.pick(upstreams, ctx)
        if not any(u.role == Role.PREFILL for u in upstreams):
            return DecodeCall(api, req, preferred=decode_pod)  # nothing to decide
        if not tunables.disagg.decide(decode_pod, ctx):
            self.metrics.disagg_decisions.labels("local").inc()
            return DecodeCall(api, req, preferred=decode_pod)
        prefill_pod = self.pipeline.pick(upstreams, replace(ctx, phase=Phase.PREFILL))
        if prefill_pod is None:
            self._local("no_prefill_worker")
            return DecodeCall(api, req, preferred=decode_pod)
        t0 = time.monotonic()
        with self.tracing.span("router.prefill", kind="client",
                               attributes={"baton.upstream": prefill_pod.url}) as span:
            answer = await self._call(prefill_pod, PrefillRequest(api=api, request=req),
                                      request_id, ctx, tunables, span)
        took = time.monotonic() - t0
        if answer is None:
            return DecodeCall(api, req, preferred=decode_pod, prefill_s=took)
        return DecodeCall(api, req, prompt_token_ids=answer.prompt_token_ids,
                          kv_transfer_params=answer.kv_transfer_params,
                          preferred=decode_pod, prefill_s=took,
                          handover=Handover(answer.kv_transfer_params, prefill_pod))

    async def _call(self, pod: Upstream, message: PrefillRequest, request_id: str,
                    ctx: RoutingContext, tunables: Tunables,
                    span: Span) -> PrefillResponse | None:
        """POST /internal/prefill on `pod`; None (counted, and reported to the pod's circuit
        breaker) when it fails or the pod is marked down meanwhile. Raises OpenAIError, the
        pod's own answer, when the request caused the refusal."""
        headers = self.tracing.inject({"Content-Type": "application/json",
                                       "X-Request-Id": request_id + "-prefill"})
        if ctx.tenant is not None:
            headers[TENANT_HEADER] = ctx.tenant
        pod.inflight += 1
        try:
            status, final, raw, imposter = await self._post(pod, message.to_json(), headers,
                                                            tunables)
        except (aiohttp.ClientError, OSError, TimeoutError) as err:
            reason = "prefill_failed" if pod.healthy else "prefill_pod_down"
            self._failed(pod, reason, request_id, repr(err), span)
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
            self._failed(pod, "prefill_failed", request_id, problem, span, breaker=False)
            return None
        if final:
            self.metrics.upstream_errors.labels(pod.url, f"status {status}").inc()
            raise _pod_error(status, raw)
        if answer is None:
            self._failed(pod, "prefill_error", request_id, f"status {status}", span,
                         breaker=status >= 500)
            return None
        self.discovery.record_success(pod)
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
                breaker: bool = True) -> None:
        if breaker:
            self.discovery.record_failure(pod)
        self._local(reason)
        span.set("baton.fallback", reason)
        log.warning("request %s: prefill on %s failed (%s: %s); prefilling on decode",
                    request_id, pod.url, reason, what)

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
