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
`prefill_error` (the pod answered an error status). Every decision is counted in
`baton:disagg_decisions_total{decision="remote"|"local"}`.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import replace

import aiohttp

from baton.common.internal import Api, OpenAIBody, PrefillRequest, PrefillResponse
from baton.common.metrics import RouterMetrics
from baton.common.roles import Role
from baton.router.discovery import Discovery, Upstream
from baton.router.resume import DecodeCall
from baton.router.scheduling.context import Phase, RoutingContext
from baton.router.scheduling.pipeline import PREFILL_FILTERS, RoutingPipeline
from baton.router.settings import Tunables

log = logging.getLogger("baton.router")
PREFILL_PATH = "/internal/prefill"


class RemotePrefill:
    def __init__(self, session: aiohttp.ClientSession, discovery: Discovery,
                 metrics: RouterMetrics) -> None:
        self.session = session
        self.discovery = discovery
        self.metrics = metrics
        self.pipeline = RoutingPipeline(filters=PREFILL_FILTERS, picker="max_score",
                                        scorers={"queue": 1.0, "prefix": 1.0})

    async def plan(self, api: Api, req: OpenAIBody, request_id: str, ctx: RoutingContext,
                   tunables: Tunables) -> DecodeCall | None:
        """What the decode pod gets: with the prompt's ids and `kv_transfer_params` when a
        prefill pod ran, without them to prefill on the decode pod (the fallback); None
        without decode pods (colocated). Raises nothing: a failed prefill falls back."""
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
        answer = await self._call(prefill_pod, PrefillRequest(api=api, request=req),
                                  request_id, ctx, tunables)
        took = time.monotonic() - t0
        if answer is None:
            return DecodeCall(api, req, preferred=decode_pod, prefill_s=took)
        return DecodeCall(api, req, prompt_token_ids=answer.prompt_token_ids,
                          kv_transfer_params=answer.kv_transfer_params,
                          preferred=decode_pod, prefill_s=took)

    async def _call(self, pod: Upstream, message: PrefillRequest, request_id: str,
                    ctx: RoutingContext, tunables: Tunables) -> PrefillResponse | None:
        """POST /internal/prefill on `pod`; None (counted, and reported to the pod's circuit
        breaker) when it fails."""
        timeout = aiohttp.ClientTimeout(total=None, connect=tunables.proxy.connect_timeout_s)
        pod.inflight += 1
        try:
            async with asyncio.timeout(tunables.disagg.prefill_timeout_s):
                async with self.session.post(
                        pod.url + PREFILL_PATH, data=message.to_json(), timeout=timeout,
                        headers={"Content-Type": "application/json",
                                 "X-Request-Id": request_id + "-prefill"}) as resp:
                    status = resp.status
                    answer = (PrefillResponse.model_validate_json(await resp.read())
                              if status == 200 else None)
        except (aiohttp.ClientError, OSError, TimeoutError, ValueError) as err:
            self.discovery.record_failure(pod)
            self._local("prefill_failed")
            log.warning("request %s: prefill on %s failed (%r); prefilling on decode",
                        request_id, pod.url, err)
            return None
        finally:
            pod.inflight -= 1
        if answer is None:
            if status >= 500:
                self.discovery.record_failure(pod)
            self._local("prefill_error")
            return None
        self.discovery.record_success(pod)
        if ctx.prefix_index is not None:
            ctx.prefix_index.add(pod, ctx.prefix_hashes)
        self.metrics.disagg_decisions.labels("remote").inc()
        return answer

    def _local(self, reason: str) -> None:
        self.metrics.disagg_decisions.labels("local").inc()
        self.metrics.fallbacks.labels(reason).inc()

