"""Which running requests guess this step, and what: the engine calls `propose` before each
schedule and `record` after each verification.

A request guesses when it is decoding (its last token is the only one without KV), has no
penalties and is past its `min_tokens` (those depend on the tokens before a row in ways the
rows of one verification do not see). A request with a structured output guesses too: its
guesses are cut at the first its grammar rejects, and each verification row is masked by
the grammar as it stands after the guesses before that row (`structured.masks`); greedy
rows keep the target's argmax, sampled ones go through rejection sampling. Guesses never overrun `max_tokens` or the context window (each step adds the
accepted guesses plus the target's own token). Nobody guesses in a step with more running
requests than `disable_by_batch_size`, and a request whose recent guesses were mostly
rejected pauses for `backoff_steps` steps."""

from __future__ import annotations

from dataclasses import dataclass, field

from baton.common.stats import SpecStats
from baton.engine.request import Request
from baton.engine.spec.config import SpeculativeConfig
from baton.engine.spec.draft import DraftModel
from baton.engine.spec.ngram import TokenHistory, lookup
from baton.engine.spec.suffix import SuffixIndex
from baton.engine.structured.masks import guesses_allowed

EMA = 0.3  # weight of the latest step in a request's acceptance rate


@dataclass
class SpecCounters:
    """Totals since start (read by the engine's stats)."""

    proposed_tokens: int = 0
    accepted_tokens: int = 0
    verified_requests: int = 0  # (request, step) pairs that verified a guess
    accepted_by_position: list[int] = field(default_factory=list)  # guesses accepted at i


@dataclass
class _State:
    history: TokenHistory
    acceptance: float = 1.0
    paused_until: int = 0


class Speculator:
    def __init__(self, config: SpeculativeConfig, max_model_len: int,
                 draft: DraftModel | None = None) -> None:
        """`draft`: the loaded draft model when the engine started with method
        `draft_model`."""
        self.max_model_len = max_model_len
        self.draft = draft
        self.counters = SpecCounters(accepted_by_position=[0] * config.num_speculative_tokens)
        self._state: dict[str, _State] = {}
        self._step = 0
        self.suffixes: SuffixIndex | None = None
        self.reconfigure(config)

    def reconfigure(self, config: SpeculativeConfig) -> None:
        """Live tuning: method, k and on/off between steps."""
        self.config = config
        if config.method != "suffix":
            self.suffixes = None
        elif self.suffixes is None or self.suffixes.capacity != config.suffix_cache_tokens:
            self.suffixes = SuffixIndex(config.suffix_cache_tokens, config.prompt_lookup_min,
                                        config.prompt_lookup_max)
        grow = config.num_speculative_tokens - len(self.counters.accepted_by_position)
        self.counters.accepted_by_position += [0] * max(0, grow)

    def propose(self, running: list[Request]) -> None:
        """Set each running request's `spec_token_ids` for the coming step ([] for those
        that do not guess)."""
        self._step += 1
        on = self.config.enabled and len(running) <= self.config.disable_by_batch_size
        guessing = [r for r in running if on and self._may_guess(r)]
        for req in running:
            req.spec_token_ids = []
        if self.config.method == "draft_model" and self.draft is not None:
            drafted = self.draft.propose(guessing, {r.request_id: self._room(r)
                                                    for r in guessing})
            for req in guessing:
                req.spec_token_ids = guesses_allowed(req, drafted[req.request_id])
            return
        for req in guessing:
            req.spec_token_ids = guesses_allowed(req, self._guess(req))

    def record(self, req: Request, proposed: int, accepted: int) -> None:
        """`accepted` of the `proposed` guesses of `req` were the target's own tokens."""
        c = self.counters
        c.proposed_tokens += proposed
        c.accepted_tokens += accepted
        c.verified_requests += 1
        for i in range(min(accepted, len(c.accepted_by_position))):
            c.accepted_by_position[i] += 1
        state = self._state.get(req.request_id)
        if state is None:
            return
        state.acceptance = (1 - EMA) * state.acceptance + EMA * accepted / proposed
        if state.acceptance < self.config.min_acceptance:
            state.paused_until = self._step + self.config.backoff_steps
            state.acceptance = self.config.min_acceptance  # one more chance after the pause

    def stats(self) -> SpecStats | None:
        """The counters for /metrics (None while speculation was never on)."""
        c, method = self.counters, self.config.method
        if method is None and not c.proposed_tokens:
            return None
        return SpecStats(method or "ngram", c.proposed_tokens, c.accepted_tokens,
                         c.verified_requests, tuple(c.accepted_by_position))

    def finish(self, req: Request) -> None:
        """`req` ended: forget it; with `suffix`, index its output for later requests."""
        self._state.pop(req.request_id, None)
        if self.draft is not None:
            self.draft.finish(req.request_id)
        if self.suffixes is not None and req.output_token_ids:
            self.suffixes.add(req.output_token_ids)

    def _may_guess(self, req: Request) -> bool:
        p = req.sampling_params
        state = self._state.get(req.request_id)
        return (req.num_tokens - req.num_computed_tokens == 1
                and not p.needs_penalties
                and req.num_output_tokens >= p.min_tokens and req.kv_handoff is None
                and (state is None or state.paused_until <= self._step))

    def _room(self, req: Request) -> int:
        """Guesses `req` may take: k, less what max_tokens and the context window leave
        (a step adds the kept guesses and the target's own token)."""
        return min(self.config.num_speculative_tokens,
                   req.max_tokens - req.num_output_tokens - 1,
                   self.max_model_len - req.num_tokens - 1)

    def _guess(self, req: Request) -> list[int]:
        c = self.config
        room = self._room(req)
        if room <= 0:
            return []
        state = self._state.get(req.request_id)
        if state is None:
            state = self._state[req.request_id] = _State(TokenHistory(req.all_token_ids))
        history = state.history
        if history.len < req.num_tokens:
            history.extend(req.token_ids(history.len, req.num_tokens))
        guess = lookup(history.tokens, room, c.prompt_lookup_min, c.prompt_lookup_max)
        if not guess and self.suffixes is not None:
            guess = self.suffixes.lookup(history.tokens[-c.prompt_lookup_max:].tolist(), room)
        return guess
