"""Sampling parameters with vLLM's names, defaults and meanings. No torch here: the router
validates requests with the same class."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Literal

_GREEDY_EPS = 1e-5
# The seeds a generator takes (torch.Generator.manual_seed's range); child seeds wrap in it.
SEED_MIN, SEED_MAX = -(1 << 63), (1 << 64) - 1


STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "grammar")
LOGIT_BIAS_MAX = 100.0  # OpenAI's range: -100 bans a token, +100 all but forces it


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the whole output, enforced token by token by a grammar engine
    (`engine.structured`): `json_schema` (`spec` is the schema's JSON text), `json_object`
    (any JSON object; `spec` empty), `regex` (`spec` the pattern) or `grammar` (`spec` an
    EBNF / Lark grammar). The engine compiles it when the request is made; a spec it cannot
    compile is the request's error (a 400), never the engine's.

    `after_token`: the constraint starts after this token id is generated (a reasoning
    model's end of thinking, `</think>`): the tokens up to and including it are free."""

    kind: Literal["json_schema", "json_object", "regex", "grammar"]
    spec: str = ""
    after_token: int | None = None

    def __post_init__(self) -> None:
        _check(self.kind in STRUCTURED_KINDS, "structured.kind", self.kind,
               f"must be one of {STRUCTURED_KINDS}")
        _check(self.kind == "json_object" or bool(self.spec), "structured.spec", self.spec,
               f"must not be empty for {self.kind}")
        _check(self.after_token is None or self.after_token >= 0, "structured.after_token",
               self.after_token, "must be a token id (>= 0) or None")


@dataclass
class SamplingParams:
    """How to sample one completion.

    temperature 0 means greedy. top_k 0 or -1 disables top-k; top_p 1.0 and min_p 0.0 disable
    theirs. `stop` strings are cut from the returned text (unless include_stop_str_in_output);
    `stop_token_ids` end generation on those ids. `logprobs=k` returns the chosen token's logprob
    and the k most likely tokens' logprobs, from the raw model distribution (before temperature
    and truncation, as vLLM v1 does). `seed` makes one request reproducible regardless of what
    it is batched with.
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    skip_special_tokens: bool = True
    # token id -> bias added to its logit (OpenAI's `logit_bias`, in [-100, 100])
    logit_bias: dict[int, float] | None = None
    structured: StructuredOutput | None = None  # grammar-constrained output
    prompt_logprobs: int | None = None  # logprobs of each prompt token (`echo` + logprobs)

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop = list(self.stop or [])
        self.stop_token_ids = list(self.stop_token_ids or [])
        if self.top_k == -1:
            self.top_k = 0
        self._validate()

    def _validate(self) -> None:
        _check(self.n >= 1, "n", self.n, "must be >= 1")
        _check(self.temperature >= 0.0, "temperature", self.temperature, "must be >= 0")
        _check(0.0 < self.top_p <= 1.0, "top_p", self.top_p, "must be in (0, 1]")
        _check(self.top_k >= 0, "top_k", self.top_k, "must be -1 (disabled), 0 (disabled) or >= 1")
        _check(0.0 <= self.min_p <= 1.0, "min_p", self.min_p, "must be in [0, 1]")
        _check(self.max_tokens is None or self.max_tokens >= 1, "max_tokens", self.max_tokens,
               "must be >= 1")
        _check(self.min_tokens >= 0, "min_tokens", self.min_tokens, "must be >= 0")
        _check(self.max_tokens is None or self.min_tokens <= self.max_tokens, "min_tokens",
               self.min_tokens, f"must be <= max_tokens ({self.max_tokens})")
        _check(self.logprobs is None or self.logprobs >= 0, "logprobs", self.logprobs,
               "must be >= 0")
        _check(-2.0 <= self.presence_penalty <= 2.0, "presence_penalty", self.presence_penalty,
               "must be in [-2, 2]")
        _check(-2.0 <= self.frequency_penalty <= 2.0, "frequency_penalty",
               self.frequency_penalty, "must be in [-2, 2]")
        _check(self.repetition_penalty > 0.0, "repetition_penalty", self.repetition_penalty,
               "must be > 0")
        _check(all(isinstance(s, str) and s for s in self.stop), "stop", self.stop,
               "must be non-empty strings")
        _check(all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids),
               "stop_token_ids", self.stop_token_ids, "must be non-negative ints")
        _check(self.seed is None or SEED_MIN <= self.seed <= SEED_MAX, "seed", self.seed,
               f"must be in [{SEED_MIN}, {SEED_MAX}]")
        _check(self.logit_bias is None or all(
            isinstance(t, int) and t >= 0 and -LOGIT_BIAS_MAX <= b <= LOGIT_BIAS_MAX
            for t, b in self.logit_bias.items()), "logit_bias", self.logit_bias,
            f"must map token ids >= 0 to biases in [-{LOGIT_BIAS_MAX:g}, {LOGIT_BIAS_MAX:g}]")
        _check(self.prompt_logprobs is None or self.prompt_logprobs >= 0, "prompt_logprobs",
               self.prompt_logprobs, "must be >= 0")

    @property
    def is_greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    @property
    def needs_penalties(self) -> bool:
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0
                or self.repetition_penalty != 1.0)


def _check(ok: bool, name: str, value: object, rule: str) -> None:
    if not ok:
        raise ValueError(f"SamplingParams.{name}={value!r} {rule}")


def child_params(p: SamplingParams) -> list[SamplingParams]:
    """n samples become n engine requests (the shared prompt hits the prefix cache); a seed
    s gives child i the seed s + i (wrapping within the seed range), so the n samples differ
    but the call is reproducible."""
    if p.n == 1:
        return [p]
    return [replace(p, n=1, seed=None if p.seed is None else _wrap_seed(p.seed + i))
            for i in range(p.n)]


def _wrap_seed(seed: int) -> int:
    return seed if seed <= SEED_MAX else seed - (SEED_MAX + 1)
