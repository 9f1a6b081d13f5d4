"""One request through the engine: token counters and a status, no phase objects."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from baton.common.hashing import ROOT_HASH
from baton.common.internal import KVTransferParams
from baton.common.sampling_params import SamplingParams
from baton.engine.kv_connector.handoff import KVHandoff
from baton.engine.structured.base import GrammarMatcher

if TYPE_CHECKING:
    from baton.engine.lora.adapter import LoRAAdapter


# The id a token sampled by a step still in flight holds until its step's results are read
# (async scheduling); never a vocabulary id, so a host path that reads one fails loudly.
PENDING = -1


class RequestStatus(enum.IntEnum):
    WAITING = enum.auto()
    WAITING_FOR_REMOTE_KV = enum.auto()
    RUNNING = enum.auto()
    PREEMPTED = enum.auto()
    # Everything after this line is finished.
    FINISHED_STOPPED = enum.auto()
    FINISHED_LENGTH_CAPPED = enum.auto()
    FINISHED_ABORTED = enum.auto()
    FINISHED_ERROR = enum.auto()  # its own sampling or stop logic raised: it alone ends

    @property
    def is_finished(self) -> bool:
        return self >= RequestStatus.FINISHED_STOPPED

    @property
    def finish_reason(self) -> str | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH_CAPPED: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}
# A finish reason's status (a front's copy of a request that runs elsewhere ends by it)
FINISHED_BY_REASON = {reason: status for status, reason in _FINISH_REASONS.items()}


@dataclass(eq=False)
class Request:
    """A prompt, the tokens generated so far and how many of all of them have KV in the cache.

    `num_computed_tokens` counts tokens whose KV is written; the scheduler advances it.
    `max_tokens` is the resolved output cap (params capped by the model's context window).
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    max_tokens: int
    eos_token_id: int | None = None
    priority: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    first_scheduled_time: float | None = None
    kv_transfer_time: float | None = None  # decode role: how long the KV pull took
    # Draws a seeded sampler already made for this request elsewhere (a remote prefill's
    # first token, tokens a resumed stream had sent): ours skips them to continue the seed.
    num_presampled: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    num_preemptions: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    block_hashes: list[int] = field(default_factory=list)
    detokenize: bool = True
    # Disaggregation (engine.kv_connector): what this request asks of the KV connector
    # (hold my KV for a puller / pull this KV), and on a held one, where a puller finds it.
    kv_handoff: KVHandoff | None = None
    kv_transfer_params: KVTransferParams | None = None
    # Structured output (sampling_params.structured): where the output is in its grammar.
    grammar: GrammarMatcher | None = None
    # The token id the grammar waits for before it starts (`structured.after_token`: the
    # end of a reasoning model's thinking); None once it has come, or when none is awaited.
    grammar_after: int | None = None
    # sampling_params.prompt_logprobs: the sampler's TokenLogprobs of each prompt token
    # computed so far (the first token has none: None), across prefill chunks; handed to
    # the request's first output, then None.
    prompt_logprobs: list | None = None
    # Speculative decoding (`engine.spec`): the guesses to verify in the coming step, set
    # before each schedule; never part of the tokens until the target model accepts them.
    spec_token_ids: list[int] = field(default_factory=list)
    # The LoRA adapter it runs with (`engine.lora`: its host copy), None: the base model.
    lora: LoRAAdapter | None = None
    # Async scheduling (`EngineCore`): tokens of steps launched but not read yet, held as
    # PENDING at the end of `output_token_ids` until their step's results fill them in.
    num_pending: int = 0

    def __post_init__(self) -> None:
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        if self.sampling_params.structured is not None:
            self.grammar_after = self.sampling_params.structured.after_token

    @property
    def active_grammar(self) -> GrammarMatcher | None:
        """The grammar that constrains the next token: None while it waits for its start
        token (the model still thinks) or when the request has none."""
        return self.grammar if self.grammar_after is None else None

    def see_grammar_start(self, token_id: int) -> None:
        """A token was generated while the grammar waits: its start token opens it (the
        grammar constrains the tokens after it)."""
        if token_id == self.grammar_after:
            self.grammar_after = None

    def add_prompt_logprobs(self, lps: list | None) -> None:
        """The next prompt tokens' logprobs, from the step that computed their positions."""
        if lps and self.prompt_logprobs is not None:
            self.prompt_logprobs += lps

    def take_prompt_logprobs(self) -> list | None:
        """The prompt logprobs, once (for the first output that carries a token)."""
        lps, self.prompt_logprobs = self.prompt_logprobs, None
        return lps

    @property
    def skips_prefix_cache(self) -> bool:
        """Its prompt must be computed whole: prompt logprobs come from the prompt's own
        logits, which a prefix-cache hit never produces (vLLM skips the cache likewise)."""
        return self.sampling_params.prompt_logprobs is not None

    @property
    def hash_root(self) -> int:
        """Where its KV block hashes chain from: an adapter's KV never serves another's."""
        return ROOT_HASH if self.lora is None else self.lora.root_hash

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids are known (the pending ones are not)."""
        return self.num_tokens - self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def add_pending(self) -> None:
        """A step that samples this request was launched: its token is a placeholder until
        the step's results are read."""
        self.output_token_ids.append(PENDING)
        self.num_pending += 1

    def resolve_pending(self, token: int) -> None:
        """The oldest pending token is `token`."""
        self.output_token_ids[len(self.output_token_ids) - self.num_pending] = token
        self.num_pending -= 1

    def drop_pending(self) -> None:
        """The request ended: tokens of steps still in flight are not its output."""
        if self.num_pending:
            del self.output_token_ids[-self.num_pending:]
            self.num_pending = 0

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + output without building the whole list."""
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt:end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[:end - n_prompt]

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    @property
    def sort_key(self) -> tuple[int, float]:
        """Smaller is served first and preempted last (vLLM's priority convention)."""
        return (self.priority, self.arrival_time)
