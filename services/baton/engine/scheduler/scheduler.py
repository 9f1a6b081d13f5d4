"""The continuous-batching scheduler.

Each step: running requests get their tokens first (a decode is one token, an unfinished
prompt continues in chunks), then waiting requests are admitted while the token budget,
`max_num_seqs` and the KV pool allow; a prompt that does not fit the remaining budget is
chunked across steps. When the pool runs dry, the lowest-priority (FCFS: newest) running
request not yet scheduled this step is preempted by recompute: its blocks are freed and it
goes back to the waiting queue with its output tokens, to be prefilled again."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass

from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.base import KVConnector, KVUpdates
from baton.engine.kv_connector.handoff import after_load
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import EngineEnd, ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.queues import make_queue

# How long an engine with only KV loads in flight sleeps between polls (`idle_for`): a load
# (a disk tier read, a pull) takes milliseconds, so this adds little to it.
LOAD_POLL_S = 0.001


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str = "fcfs"
    max_loras: int | None = None  # distinct LoRA adapters a step may hold (None: no LoRA)
    batch_window_s: float = 0.0  # the dynamic policy's collection window


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager,
                 connector: KVConnector | None = None) -> None:
        self.limits = limits
        self.kv = kv
        self.waiting = make_queue(limits.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache at admission
        # Ended inside schedule() (the pool can never hold it; its KV load failed under the
        # `fail` policy): the engine reports them with `drain_ended`.
        self._ended: list[Request] = []
        self.connector = connector  # None: this engine neither holds nor pulls KV
        # Requests loading KV through the connector -> their computed tokens once loaded
        self._load_ends: dict[str, int] = {}

    # -- bookkeeping -----------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    def add_request(self, req: Request) -> None:
        if req.request_id in self.requests:
            raise ValueError(f"request id {req.request_id!r} is already in the engine")
        self.requests[req.request_id] = req
        self.waiting.add(req)

    def drain_ended(self) -> list[Request]:
        ended, self._ended = self._ended, []
        return ended

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """End these requests (abort, stop string) wherever they are; unknown ids are
        ignored. Frees their blocks (or leaves them to the KV connector). Returns the
        requests that were ended."""
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.status, previous = status, req.status
            if previous == RequestStatus.RUNNING:
                self.running.remove(req)
            elif previous != RequestStatus.WAITING_FOR_REMOTE_KV:  # that one: the connector's
                self.waiting.remove(req)
            self._release(req)
            ended.append(req)
        return ended

    def idle_for(self) -> float:
        """Seconds before `schedule()` will have work for a step although requests wait
        (the dynamic policy's window), 0 when it has some now. The engine may sleep that
        long; a new request wakes it. With nothing to run but KV loads in flight, a short
        poll interval: an engine spinning on `poll()` would hold the GIL that the threads
        doing the loads (the disk tier's worker, a transport's) need to finish them. Requests
        still waiting then do not shorten it: `schedule()` tried them and they wait on those
        loads (their blocks, `max_num_seqs` slots, LoRA slots), and one that arrives wakes
        the engine."""
        if self.running or not self._num_loading:
            return 0.0
        return LOAD_POLL_S

    # -- the KV connector ------------------------------------------------------------------
    @property
    def needs_polling(self) -> bool:
        """Work that advances without a model step: KV loads in flight, leases to expire."""
        return self.connector is not None and self.connector.has_pending

    def _apply_kv_updates(self, updates: KVUpdates) -> None:
        for req in updates.freeable:
            self.kv.free(req)
        for req in updates.loaded:  # the loaded KV is in place: run (the rest computes)
            req.kv_handoff = after_load(req.kv_handoff)
            req.num_computed_tokens = self._load_ends.pop(req.request_id)
            self.kv.publish(req, req.num_computed_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
        for req in updates.recompute:  # prefill locally, first in line, keeping its token
            req.kv_handoff = after_load(req.kv_handoff)
            self._load_ends.pop(req.request_id, None)
            self.kv.free(req)
            req.num_computed_tokens = 0
            req.status = RequestStatus.WAITING
            self.waiting.add_preempted(req)
        for req, why in updates.failed:
            req.stop_reason = why
            self._finish(req, RequestStatus.FINISHED_ABORTED)
            self._ended.append(req)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        if self.connector is not None:
            self._apply_kv_updates(self.connector.poll())
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        """Running requests first, in order: a decode is its last token plus its guesses
        (`spec_token_ids`, as many as the budget leaves), a prompt its next chunk."""
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.num_pending and self._ends_by_length(req):
                i += 1  # its token in flight is its last: it ends once that is read
                continue
            known = req.num_tokens - req.num_computed_tokens
            num_new = min(known + len(req.spec_token_ids), budget)
            fits = self._allocate_or_preempt(req, num_new, i, out)
            if fits is None:
                i += 1
            elif fits:
                guesses = req.spec_token_ids[:max(0, num_new - known)]
                out.scheduled.append(ScheduledRequest(req, num_new, guesses))
                budget -= num_new
                i += 1
        return budget

    def _ends_by_length(self, req: Request, ahead: int = 0) -> bool:
        """Its tokens (pending ones counted, `ahead` more) reach max_tokens or the context
        window."""
        return (req.num_output_tokens + ahead >= req.max_tokens
                or req.num_tokens + ahead >= self.limits.max_model_len)

    def _allocate_or_preempt(self, req: Request, num_new: int, index: int,
                             out: SchedulerOutput) -> bool | None:
        """Allocate room for `req`, preempting not-yet-scheduled running requests from
        `index` on until it fits. False when `req` itself had to be preempted; None: left
        out of this step (alone, out of room, a token in flight that may end it first)."""
        while self.kv.allocate_slots(req, num_new) is None:
            if self.running == [req] and req.num_pending:
                return None
            if self.running == [req]:
                # Alone and still out of room: the pool can never hold it. End it rather
                # than preempt and recompute it forever.
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                self._ended.append(req)
                return False
            victim = self._pick_victim(index)
            self._preempt(victim)
            out.preempted.append(victim)
            if victim is req:
                return False
        return True

    def _pick_victim(self, index: int) -> Request:
        candidates = self.running[index:]
        if self.limits.policy == "priority":
            return max(candidates, key=lambda r: r.sort_key)
        return candidates[-1]

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.spec_token_ids = []
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + self._num_loading < self.limits.max_num_seqs):
            req = self.waiting.peek()
            if not self._fits_loras(req):
                return
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_remote = 0 if self.connector is None else \
                self.connector.num_remote_tokens(req, num_cached)
            if num_remote:
                if not self._admit_remote(req, computed, num_cached, num_remote):
                    return
                continue
            num_new = min(req.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                if not self.running and not self._num_loading:
                    # The pool is all ours and still too small: it can never run (blocks
                    # of loads in flight come back once they run or end).
                    self.waiting.pop()
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self._ended.append(req)
                    continue
                return
            self.waiting.pop()
            self._admit(req, num_cached)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _fits_loras(self, req: Request) -> bool:
        """A step holds at most `max_loras` distinct adapters (`engine.lora`'s resident
        slots): a request of another adapter waits until a running (or loading) one
        ends."""
        if req.lora is None or self.limits.max_loras is None:
            return True
        # requests whose KV is loading join the running batch without asking again
        loading = (self.requests.get(rid) for rid in self._load_ends)
        held = {r.lora.load_id for r in (*self.running, *loading)
                if r is not None and r.lora is not None}
        return req.lora.load_id in held or len(held) < self.limits.max_loras

    @property
    def _num_loading(self) -> int:
        return self.connector.num_loading if self.connector is not None else 0

    def _admit_remote(self, req: Request, computed, num_cached: int, num_remote: int) -> bool:
        """Allocate blocks for the `num_remote` tokens whose KV arrives from elsewhere, past
        the `num_cached` local prefix hits (kept, not loaded), and start the load; no token
        budget is spent. False: no room now."""
        assert self.connector is not None  # _schedule_waiting admits remote KV only with one
        if self.kv.allocate_slots(req, num_remote, computed, publish=False) is None:
            if not self.running and not self._num_loading:
                self.waiting.pop()
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                self._ended.append(req)
                return True
            return False
        self.waiting.pop()
        self.prefix_hit_tokens += num_cached
        if req.status == RequestStatus.WAITING:  # a preempted one keeps its first count
            req.num_cached_tokens = num_cached + (
                num_remote if self.connector.loads_locally(req) else 0)
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        self._load_ends[req.request_id] = num_cached + num_remote
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.connector.start_load(req, self.kv.get_block_ids(req.request_id), num_cached)
        return True

    def _admit(self, req: Request, num_cached: int) -> None:
        if req.status == RequestStatus.WAITING:
            req.num_cached_tokens = num_cached
        self.prefix_hit_tokens += num_cached
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        req.num_computed_tokens = num_cached
        req.status = RequestStatus.RUNNING
        self.running.append(req)

    # -- after the model ran ---------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled: Mapping[str, int | list[int]],
                           ends: Mapping[str, EngineEnd] | None = None) -> list[Request]:
        """Advance counters, append sampled tokens, end requests that hit a stop condition
        (EOS, stop token id, max_tokens, context window) or that the engine ended (`ends`:
        a stop string, a complete grammar, the request's own error: these win). Each ends
        here once, with its final status. Returns those ended this step.

        A request may gain several tokens (speculation: its accepted guesses, then the
        target's own token): each accepted guess had its KV written this step, so it
        counts as computed; a stop at one of them drops the tokens after it."""
        finished = []
        for s in out.scheduled:
            req = s.request
            req.num_computed_tokens += s.num_new_tokens - len(s.spec_token_ids)
            got = sampled.get(req.request_id)
            tokens = [got] if isinstance(got, int) else got or []
            end = (ends or {}).get(req.request_id)
            if end is not None and end.at is not None:
                tokens = tokens[:end.at + 1]
            if not tokens and end is None:
                continue
            status = None
            for i, token in enumerate(tokens):
                req.num_computed_tokens += i > 0  # the guess before it: verified, in cache
                req.output_token_ids.append(token)
                status = self.stop_status(req, token)
                if status is not None:
                    break
            if end is not None:
                status = end.status
                if end.reason is not None or status == RequestStatus.FINISHED_ERROR:
                    req.stop_reason = end.reason
            if status is not None:
                self.running.remove(req)
                self._finish(req, status)
                finished.append(req)
        return finished

    def resolve_pending(self, sampling: list[Request], sampled: Mapping[str, list[int]],
                        ends: Mapping[str, EngineEnd]) -> list[Request]:
        """Async scheduling: the results of a launched step, read after the next step was
        scheduled (`engine.step_pipeline`), for the requests it sampled (`sampling`, each
        with a pending token since it launched). Fills each one's oldest pending token and
        ends the requests it (or `ends`) stops, wherever they are now (running, or
        preempted to the waiting queue); ones ended meanwhile (aborted, stopped by the step
        before) are skipped. Returns those ended."""
        finished = []
        for req in sampling:
            if req.is_finished:
                continue
            rid = req.request_id
            tokens = sampled.get(rid)
            end = ends.get(rid)
            status = None
            if tokens:
                req.resolve_pending(tokens[0])
                status = self.stop_status(req, tokens[0], ahead=-req.num_pending)
            elif end is None:  # a sampling row without a token or an error: never so
                end = EngineEnd(RequestStatus.FINISHED_ERROR, "its step sampled no token")
            if end is not None:
                status = end.status
                if end.reason is not None or status == RequestStatus.FINISHED_ERROR:
                    req.stop_reason = end.reason
            if status is not None:
                self.finish_requests([rid], status)
                finished.append(req)
        return finished

    def stop_status(self, req: Request, token: int, ahead: int = 0) -> RequestStatus | None:
        """How `token`, the request's latest output, ends it (None: it does not). `ahead`:
        tokens of this step not appended yet, `token` the last of them."""
        params = req.sampling_params
        if req.num_output_tokens + ahead >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if self._ends_by_length(req, ahead):
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def cut_at_stops(self, sampled: Mapping[str, list[int]]) -> dict[str, list[int]]:
        """Each request's tokens of this step (several only with speculation; not appended
        yet) up to the first that ends it by the scheduler's own conditions — EOS, a stop
        id, max_tokens, the context window: what the detokeniser may see."""
        return {rid: self._cut_at_stop(self.requests[rid], tokens) if len(tokens) > 1
                else tokens for rid, tokens in sampled.items()}

    def _cut_at_stop(self, req: Request, tokens: list[int]) -> list[int]:
        for i, token in enumerate(tokens[:-1]):
            if self.stop_status(req, token, ahead=i + 1) is not None:
                return tokens[:i + 1]
        return tokens

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release(req)

    def _release(self, req: Request) -> None:
        """`req` has ended: its blocks are freed, unless the KV connector keeps them (a
        prefill's blocks leased to a puller, a pull still writing into them)."""
        req.drop_pending()
        del self.requests[req.request_id]
        self._load_ends.pop(req.request_id, None)
        if self.connector is not None:
            keep, req.kv_transfer_params = self.connector.request_finished(
                req, self.kv.get_block_ids(req.request_id))
            if keep:
                return
        self.kv.free(req)
