"""`--speculative-config`: how a decode pod speculates, in vLLM's spirit (a JSON object:
`{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4,
"prompt_lookup_min": 2}`)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

METHODS = ("ngram", "suffix", "draft_model")
# Methods not built here: refused by name at start
NOT_BUILT = ("eagle", "eagle3", "medusa", "mtp")


@dataclass(frozen=True)
class SpeculativeConfig:
    """`method` None: no speculation; `ngram`: prompt lookup (`ngram.py`); `suffix`: prompt
    lookup, else the outputs of recently finished requests (`suffix.py`, at most
    `suffix_cache_tokens` tokens); `draft_model`: k greedy steps of a smaller model of the
    same tokenizer (`draft.py`; `draft_model` names it as `--model` would, its KV pool
    `draft_num_kv_blocks` blocks). `num_speculative_tokens` (k): guesses per request per
    step. `prompt_lookup_min/max`: the n-gram sizes matched against the request's own
    prompt and output (and the suffix index). `disable_by_batch_size`: no speculation in a step with more running
    requests than this (verifying costs more than it saves there; `benchmarks/spec_bench.py`
    measures the crossover). `min_acceptance`: a request whose recent guesses were accepted
    less than this often stops guessing for `backoff_steps` steps."""

    method: str | None = None
    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    suffix_cache_tokens: int = 1 << 18
    draft_model: str | None = None
    draft_num_kv_blocks: int = 2048
    disable_by_batch_size: int = 4  # the crossover measured on CPU (docs/benchmarks.md)
    min_acceptance: float = 0.2
    backoff_steps: int = 16

    def __post_init__(self) -> None:
        if self.method in NOT_BUILT:
            raise ValueError(f"speculative_config.method={self.method!r} is not built; "
                             f"choose one of {METHODS}")
        if self.method is not None and self.method not in METHODS:
            raise ValueError(f"speculative_config.method={self.method!r} is unknown; choose "
                             f"one of {METHODS}")
        checks = [("num_speculative_tokens", 1 <= self.num_speculative_tokens <= 16,
                   "must be in [1, 16]"),
                  ("prompt_lookup_min", 1 <= self.prompt_lookup_min <= self.prompt_lookup_max,
                   "must be in [1, prompt_lookup_max]"),
                  ("prompt_lookup_max", self.prompt_lookup_max <= 64, "must be <= 64"),
                  ("suffix_cache_tokens", 64 <= self.suffix_cache_tokens <= 1 << 24,
                   "must be in [64, 16M]"),
                  ("draft_model", (self.method == "draft_model") == bool(self.draft_model),
                   "must name the draft exactly when method is 'draft_model'"),
                  ("draft_num_kv_blocks", self.draft_num_kv_blocks >= 16, "must be >= 16"),
                  ("disable_by_batch_size", self.disable_by_batch_size >= 1, "must be >= 1"),
                  ("min_acceptance", 0.0 <= self.min_acceptance <= 1.0, "must be in [0, 1]"),
                  ("backoff_steps", self.backoff_steps >= 0, "must be >= 0")]
        for name, ok, rule in checks:
            if not ok:
                raise ValueError(f"speculative_config.{name}={getattr(self, name)!r} {rule}")

    @property
    def enabled(self) -> bool:
        return self.method is not None

    @classmethod
    def parse(cls, value: Any) -> SpeculativeConfig:
        """From None (off), a JSON object's text, a dict, or a SpeculativeConfig. Raises
        ValueError naming what is wrong."""
        if value is None or isinstance(value, SpeculativeConfig):
            return value or cls()
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as err:
                raise ValueError(f"speculative_config is not JSON: {err}") from None
        if not isinstance(value, dict):
            raise ValueError("speculative_config must be a JSON object")
        unknown = sorted(set(value) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"speculative_config has no field {unknown[0]!r}; known: "
                             f"{', '.join(cls.__dataclass_fields__)}")
        return cls(**value)

    def to_json(self) -> str | None:
        """The flat argument that rebuilds it (None when off)."""
        return json.dumps(asdict(self)) if self.enabled else None
