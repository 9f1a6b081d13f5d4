"""Static batching, kept only as the benchmark baseline from the literature.

A fixed group (up to `max_num_seqs`, FCFS, each with KV reserved for prompt + max_tokens) is
prefilled whole in one step and decoded in lock-step until its longest member finishes;
nobody new joins until the whole group is done. Padding is computed and thrown away, as in a
padded batch: the prefill step pads every prompt to the group's longest (a padding entry of
the missing length, which writes no KV and samples nothing), and members that finish early
keep their slot as padding rows until the group ends. What is not reproduced is a padded
batch's longer attention in decode (each row attending over the longest prompt): the paged
kernels read only a sequence's own tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput
from baton.engine.scheduler.scheduler import Scheduler

# What a padding row of a prompt feeds (any id works: nothing it computes is kept, and its
# attention reads only rows of the batch's block table).
PAD_TOKEN_ID = 0


@dataclass
class PaddingRow(ScheduledRequest):
    """The waste of a padded static batch, computed without writing KV or sampling: on a
    finished member, one row re-feeding its last token (the slot it keeps until the group
    ends); on a member whose prompt runs this step, `num_new_tokens` pad tokens at
    positions 0.. (its prompt padded to the group's longest)."""

    writes_kv = False

    @property
    def start(self) -> int:
        computed = self.request.num_computed_tokens
        return 0 if computed == 0 else computed - 1

    def input_ids(self, start: int, end: int) -> list[int]:
        if self.request.num_computed_tokens == 0:
            return [PAD_TOKEN_ID] * (end - start)
        return self.request.token_ids(start, end)

    @property
    def samples(self) -> bool:
        return False


class StaticScheduler(Scheduler):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._group: list[Request] = []
        self._done: list[Request] = []  # finished members still holding their blocks

    def schedule(self) -> SchedulerOutput:
        if not self.running:
            self._release_group()
            self._admit_group()
        out = SchedulerOutput()
        width = max(r.num_prompt_tokens for r in self._group) if self._group else 0
        for req in self._group:
            if req.is_finished:
                if req.num_computed_tokens > 0:
                    out.padding.append(PaddingRow(req, 1))
                continue
            num_new = req.num_tokens - req.num_computed_tokens
            if self.kv.allocate_slots(req, num_new) is None:
                raise RuntimeError(f"static batch lost its reservation for {req.request_id}")
            out.scheduled.append(ScheduledRequest(req, num_new))
            if req.num_computed_tokens == 0 and req.num_prompt_tokens < width:
                out.padding.append(PaddingRow(req, width - req.num_prompt_tokens))
        return out

    def _admit_group(self) -> None:
        free = self.kv.num_free_blocks
        while self.waiting and len(self.running) < self.limits.max_num_seqs:
            req = self.waiting.peek()
            need = self.kv.blocks_for(min(req.num_prompt_tokens + req.max_tokens,
                                          self.limits.max_model_len))
            if need > free:
                if not self.running:
                    self.waiting.pop()
                    self._finish(req, RequestStatus.FINISHED_LENGTH_CAPPED)
                    self._ended.append(req)
                    continue
                break
            free -= need
            self.waiting.pop()
            self._admit(req, 0)
            self._group.append(req)

    def _release(self, req: Request) -> None:
        if req in self._group:
            self._done.append(req)  # keep the blocks: the slot stays padded until group end
            del self.requests[req.request_id]
            if not self.running:
                self._release_group()
        else:
            super()._release(req)

    def _release_group(self) -> None:
        for req in self._done:
            self.kv.free(req)
        self._group, self._done = [], []
