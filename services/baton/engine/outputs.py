"""What the engine returns: per-step deltas (EngineOutput) and the vLLM-shaped cumulative
RequestOutput / CompletionOutput that users see."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.engine.sampler import TokenLogprobs

if TYPE_CHECKING:
    from baton.common.internal import KVTransferParams


@dataclass
class EngineOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    queue_time: float | None = None  # arrival -> first scheduled; first and final outputs
    kv_transfer_time: float | None = None  # decode role: the KV pull; first and final
    # prefill role: where a decode pod pulls the KV
    kv_transfer_params: KVTransferParams | None = None
    # sampling_params.prompt_logprobs: one entry per prompt token (the first None), on the
    # request's first output that carries a token only
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class CompletionOutput:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[TokenLogprobs] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    # What the latest update added (for streaming consumers).
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)
    delta_logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, outs: list[EngineOutput]) -> None:
        """Merge one or more consecutive deltas; the delta_* fields then hold their sum."""
        self.delta_text = "".join(o.new_text for o in outs)
        self.delta_token_ids = [t for o in outs for t in o.new_token_ids]
        lps = [lp for o in outs for lp in (o.new_logprobs or ())]
        self.delta_logprobs = lps if any(o.new_logprobs is not None for o in outs) else None
        self.text += self.delta_text
        self.token_ids.extend(self.delta_token_ids)
        if self.delta_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs.extend(self.delta_logprobs)  # not a new list a token: linear
            self.cumulative_logprob = (self.cumulative_logprob or 0.0) + sum(
                lp.logprob for lp in self.delta_logprobs)
        last = outs[-1]
        if last.finish_reason is not None:
            self.finish_reason, self.stop_reason = last.finish_reason, last.stop_reason


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    num_cached_tokens: int = 0
    queue_time: float | None = None
    kv_transfer_time: float | None = None
    kv_transfer_params: KVTransferParams | None = None
    # vLLM's RequestOutput.prompt_logprobs: each prompt token's logprobs (the first None)
    prompt_logprobs: list[TokenLogprobs | None] | None = None

    @property
    def finished(self) -> bool:
        return all(o.finished for o in self.outputs)
