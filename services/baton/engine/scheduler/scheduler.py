"""The continuous-batching scheduler.

Each step: running requests get their tokens first (a decode is one token, an unfinished
prompt continues in chunks), then waiting requests are admitted while the token budget,
`max_num_seqs` and the KV pool allow; a prompt that does not fit the remaining budget is
chunked across steps. When the pool runs dry, the lowest-priority (FCFS: newest) running
request not yet scheduled this step is preempted by recompute: its blocks are freed and it
goes back to the waiting queue with its output tokens, to be prefilled again.
"""

from __future__ import annotations

import time

from dataclasses import dataclass

from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.queues import make_queue


@dataclass(frozen=True)
class SchedulerLimits:
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    policy: str = "fcfs"


class Scheduler:
    def __init__(self, limits: SchedulerLimits, kv: KVCacheManager) -> None:
        self.limits = limits
        self.kv = kv
        self.waiting = make_queue(limits.policy)
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self.prefix_hit_tokens = 0  # prompt tokens served from the prefix cache at admission
        self._rejected: list[Request] = []  # ended inside schedule(): can never fit the pool
        # Disaggregation. Decode side: requests whose prompt KV is being pulled (blocks
        # allocated, not yet runnable), those admitted so this step (the engine starts their
        # pulls), and aborted ones whose pull is still writing into their blocks. Prefill
        # side: finished requests whose blocks are leased to a puller.
        self.remote: dict[str, Request] = {}
        self.remote_started: list[Request] = []
        self.zombies: dict[str, Request] = {}
        self.held: dict[str, Request] = {}

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

    def drain_rejected(self) -> list[Request]:
        rejected, self._rejected = self._rejected, []
        return rejected

    def finish_requests(self, request_ids, status: RequestStatus) -> list[Request]:
        """End these requests (abort, stop string) wherever they are; unknown ids are
        ignored. Frees their blocks. Returns the requests that were ended."""
        ended = []
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is None:
                continue
            req.status, previous = status, req.status
            if previous == RequestStatus.RUNNING:
                self.running.remove(req)
            elif previous == RequestStatus.WAITING_FOR_REMOTE_KV:
                # Its pull may still be writing into its blocks: free them when it ends.
                del self.remote[rid]
                del self.requests[rid]
                self.zombies[rid] = req
                ended.append(req)
                continue
            else:
                self.waiting.remove(req)
            self._release(req)
            ended.append(req)
        return ended

    # -- disaggregation --------------------------------------------------------------------
    @property
    def needs_polling(self) -> bool:
        """Work that advances without a model step: pulls in flight, leases to expire."""
        return bool(self.remote or self.zombies or self.held)

    def take_remote_started(self) -> list[Request]:
        started, self.remote_started = self.remote_started, []
        return started

    def finish_remote(self, req: Request, ok: bool) -> None:
        """Its pull ended: join the running batch, or (failed) prefill locally from the
        front of the queue, keeping the first token."""
        del self.remote[req.request_id]
        if ok:
            req.num_computed_tokens = req.num_prompt_tokens
            self.kv.publish(req, req.num_prompt_tokens)
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            return
        self.kv.free(req)
        req.remote_kv = None
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        self.waiting.add_preempted(req)

    def fail_remote(self, req: Request) -> None:
        """Its pull failed and the policy is `fail`: end it."""
        del self.remote[req.request_id]
        req.status = RequestStatus.FINISHED_ABORTED
        self._release(req)

    def reap(self, request_id: str) -> None:
        """An aborted request's pull ended: its blocks can go."""
        req = self.zombies.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    def release_held(self, request_id: str) -> None:
        """A prefill's lease ended (pulled or expired): free its blocks."""
        req = self.held.pop(request_id, None)
        if req is not None:
            self.kv.free(req)

    # -- the step --------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self._schedule_running(out, self.limits.max_num_batched_tokens)
        if not out.preempted:
            self._schedule_waiting(out, budget)
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if self._allocate_or_preempt(req, num_new, i, out):
                out.scheduled.append(ScheduledRequest(req, num_new))
                budget -= num_new
                i += 1
        return budget

    def _allocate_or_preempt(self, req: Request, num_new: int, index: int,
                             out: SchedulerOutput) -> bool:
        """Allocate room for `req`, preempting not-yet-scheduled running requests from
        `index` on until it fits. False when `req` itself had to be preempted."""
        while self.kv.allocate_slots(req, num_new) is None:
            if self.running == [req]:
                # Alone and still out of room: the pool can never hold it. End it rather
                # than preempt and recompute it forever.
                self.running.remove(req)
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                self._rejected.append(req)
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
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.add_preempted(req)

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        while (self.waiting and budget > 0
               and len(self.running) + len(self.remote) < self.limits.max_num_seqs):
            req = self.waiting.peek()
            if req.remote_kv is not None and req.status == RequestStatus.WAITING:
                if not self._admit_remote(req):
                    return
                continue
            computed, num_cached = self.kv.get_computed_blocks(req)
            num_new = min(req.num_tokens - num_cached, budget)
            if self.kv.allocate_slots(req, num_new, computed) is None:
                if not self.running:
                    # The pool is all ours and still too small: it can never run.
                    self.waiting.pop()
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self._rejected.append(req)
                    continue
                return
            self.waiting.pop()
            self._admit(req, num_cached)
            out.scheduled.append(ScheduledRequest(req, num_new))
            budget -= num_new

    def _admit_remote(self, req: Request) -> bool:
        """Allocate blocks for a prompt whose KV will be pulled (local prefix hits are kept
        and not pulled); no token budget is spent. False: no room now."""
        computed, num_cached = self.kv.get_computed_blocks(req)
        n = req.num_prompt_tokens
        if self.kv.allocate_slots(req, n - num_cached, computed, publish=False) is None:
            if not self.running and not self.remote:
                self.waiting.pop()
                self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                self._rejected.append(req)
                return True
            return False
        self.waiting.pop()
        self.prefix_hit_tokens += num_cached
        req.num_cached_tokens = num_cached
        req.status = RequestStatus.WAITING_FOR_REMOTE_KV
        if req.first_scheduled_time is None:
            req.first_scheduled_time = time.monotonic()
        self.remote[req.request_id] = req
        self.remote_started.append(req)
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
    def update_from_output(self, out: SchedulerOutput, sampled: dict[str, int]) -> list[Request]:
        """Advance counters, append sampled tokens, end requests that hit a stop condition
        (EOS, stop token id, max_tokens, context window). Returns those ended this step."""
        finished = []
        for s in out.scheduled:
            if s.is_padding:
                continue
            req = s.request
            req.num_computed_tokens += s.num_new_tokens
            token = sampled.get(req.request_id)
            if token is None:
                continue
            req.output_token_ids.append(token)
            status = self.stop_status(req, token)
            if status is not None:
                self.running.remove(req)
                if req.hold_kv:  # a prefill: its blocks wait for the decode pod's pull
                    req.status = status
                    del self.requests[req.request_id]
                    self.held[req.request_id] = req
                else:
                    self._finish(req, status)
                finished.append(req)
        return finished

    def stop_status(self, req: Request, token: int) -> RequestStatus | None:
        params = req.sampling_params
        if req.num_output_tokens >= params.min_tokens:
            if token == req.eos_token_id and not params.ignore_eos:
                return RequestStatus.FINISHED_STOPPED
            if token in params.stop_token_ids:
                req.stop_reason = token
                return RequestStatus.FINISHED_STOPPED
        if req.num_output_tokens >= req.max_tokens or req.num_tokens >= self.limits.max_model_len:
            return RequestStatus.FINISHED_LENGTH_CAPPED
        return None

    def _finish(self, req: Request, status: RequestStatus) -> None:
        req.status = status
        self._release(req)

    def _release(self, req: Request) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]


def make_scheduler(limits: SchedulerLimits, kv: KVCacheManager) -> Scheduler:
    if limits.policy == "static":
        from baton.engine.scheduler.static import StaticScheduler

        return StaticScheduler(limits, kv)
    return Scheduler(limits, kv)
