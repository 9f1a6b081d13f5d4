"""Who is calling: API keys, tenants and their rate limits.

Keys come from `$BATON_API_KEY` (tenant `default`) and from `--api-keys-file` (default
`$BATON_API_KEYS_FILE`), a YAML file:

    tenants:
      - name: team-a
        keys: ["sk-..."]
        requests_per_second: 5      # optional token bucket (burst = max(1, rate))
        tokens_per_minute: 60000    # optional: prompt + max_tokens charged, then usage

With any key configured, a request to `/v1/…` or `/workers` needs `Authorization: Bearer
<key>`; without, every request is tenant `default`, unlimited. A tenant's buckets answer
429 with `Retry-After`. Tokens: a request is charged its prompt (exact when the router
tokenized it, else ~4 bytes a token) plus `max_tokens` × choices when it arrives, and the
charge is corrected to the answer's own `usage` when it reports one (for a stream without a
usage event and without `max_tokens`, one token per content chunk). `max_tokens` counts at
most what the workers' context window leaves the prompt, and a request that is refused or
fails before an answer (a 4xx, a 5xx) gets its whole charge back. Keys are never logged,
printed or put in an error message: a key is kept only as its SHA-256 for look-ups, and
the file's errors name fields, never values.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from baton.common.auth import bearer
from baton.common.errors import OpenAIError
from baton.common.internal import OpenAIBody
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.router.rate_limit import TokenBucket

DEFAULT_TENANT = "default"
KEYS_FILE_ENV = "BATON_API_KEYS_FILE"
_FROZEN = ConfigDict(extra="forbid", frozen=True)
Name = Annotated[str, Field(min_length=1, max_length=64,
                            pattern=r"^[A-Za-z0-9][A-Za-z0-9._-]*$")]
Key = Annotated[str, Field(min_length=1)]


class TenantSpec(BaseModel):
    """One tenant of the keys file (its keys kept out of its repr)."""

    model_config = _FROZEN
    name: Name
    keys: Annotated[tuple[Key, ...], Field(min_length=1, repr=False)]
    requests_per_second: Annotated[float, Field(gt=0)] | None = None
    tokens_per_minute: Annotated[int, Field(gt=0)] | None = None


class TenantsFile(BaseModel):
    model_config = _FROZEN
    tenants: Annotated[tuple[TenantSpec, ...], Field(min_length=1)]

    @model_validator(mode="after")
    def _unique(self) -> TenantsFile:
        owner: dict[str, str] = {}
        for i, spec in enumerate(self.tenants):
            if any(s.name == spec.name for s in self.tenants[:i]):
                raise ValueError(f"tenants[{i}].name: {spec.name!r} is given twice")
            for j, key in enumerate(spec.keys):
                if key in owner:
                    raise ValueError(f"tenants[{i}].keys[{j}]: the same key is already a "
                                     f"key of tenant {owner[key]!r}")
                owner[key] = spec.name
        return self


def load_tenants(path: str) -> tuple[TenantSpec, ...]:
    """The tenants of the keys file at `path`. Raises ValueError naming the file and the
    field, never a key."""
    where = f"--api-keys-file {path}"
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f)
    except OSError as err:
        raise ValueError(f"{where}: cannot read it: {err.strerror}") from None
    except yaml.YAMLError as err:  # its message may quote the line (a key): position only
        mark = getattr(err, "problem_mark", None)
        at = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ValueError(f"{where}: not valid YAML{at}") from None
    try:
        return TenantsFile.model_validate(data).tenants
    except ValidationError as err:
        raise ValueError(f"{where}: {_describe(err)}") from None


def with_api_key(tenants: tuple[TenantSpec, ...],
                 api_key: str | None) -> tuple[TenantSpec, ...]:
    """`tenants`, and tenant `default` for `$BATON_API_KEY`. Raises ValueError when a
    tenant of the file is named `default` or has that key too."""
    if not api_key:
        return tenants
    for i, spec in enumerate(tenants):
        if spec.name == DEFAULT_TENANT:
            raise ValueError(f"--api-keys-file: tenants[{i}].name: {DEFAULT_TENANT!r} is the "
                             "tenant of $BATON_API_KEY; choose another name")
        if api_key in spec.keys:
            raise ValueError(f"--api-keys-file: tenants[{i}].keys: $BATON_API_KEY is also a "
                             f"key of tenant {spec.name!r}")
    return (TenantSpec(name=DEFAULT_TENANT, keys=(api_key,)), *tenants)


def _describe(err: ValidationError) -> str:
    """The first error, by field path and message, without the input value."""
    e = err.errors(include_url=False, include_input=False)[0]
    loc = list(e["loc"])
    msg = e["msg"].removeprefix("Value error, ")
    if e["type"] == "extra_forbidden":  # the unknown name itself could be a pasted key
        loc.pop()
        allowed = TenantSpec.model_fields if loc else TenantsFile.model_fields
        msg = f"an unknown field (allowed: {', '.join(allowed)})"
    path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
    return f"{path}: {msg}" if path else msg


# -- at run time -------------------------------------------------------------------------
@dataclass
class Tenant:
    """A tenant's buckets (None: unlimited); used on the event loop."""

    name: str
    requests: TokenBucket | None = None
    tokens: TokenBucket | None = None

    def admit(self, now: float) -> None:
        """Takes one request from its requests bucket; raises OpenAIError 429 when empty."""
        if self.requests is not None:
            wait = self.requests.take(1, now)
            if wait:
                raise RateLimited(self.name, "requests_per_second", self.requests.rate, wait)

    def charge(self, tokens: int, now: float) -> None:
        """Takes `tokens` from its tokens bucket; raises OpenAIError 429 when it lacks them."""
        if self.tokens is not None:
            wait = self.tokens.take(tokens, now)
            if wait:
                raise RateLimited(self.name, "tokens_per_minute", self.tokens.capacity, wait)

    def settle(self, charged: int, used: int, now: float) -> None:
        """The request used `used` tokens where `charge` took `charged`."""
        if self.tokens is not None and used != charged:
            self.tokens.adjust(used - charged, now)


class RateLimited(OpenAIError):
    """A 429 from a tenant's own limit (`limit`: the keys file's field)."""

    def __init__(self, tenant: str, limit: str, value: float, wait_s: float) -> None:
        super().__init__(429, f"tenant {tenant!r} is over its {limit} limit ({value:g}); "
                              f"retry in {wait_s:.2f}s", code="rate_limit_exceeded",
                         headers={"Retry-After": str(max(1, math.ceil(wait_s)))})
        self.limit = limit


class Tenants:
    """The tenants of a router, found by key (constant-time in the key's content: the
    look-up is by its SHA-256)."""

    def __init__(self, specs: tuple[TenantSpec, ...], now: float) -> None:
        self._by_key: dict[bytes, Tenant] = {}
        for spec in specs:
            tenant = Tenant(spec.name, _bucket(spec.requests_per_second, 1.0, now),
                            _bucket(spec.tokens_per_minute, 60.0, now))
            for key in spec.keys:
                self._by_key[_digest(key)] = tenant
        self.anonymous = None if specs else Tenant(DEFAULT_TENANT)

    @property
    def required(self) -> bool:
        """Whether requests must present a key."""
        return self.anonymous is None

    def identify(self, authorization: str | None) -> Tenant | None:
        """The tenant of an `Authorization: Bearer <key>` header, else None."""
        key = bearer(authorization)
        return None if key is None else self._by_key.get(_digest(key))


def _bucket(limit: float | None, per_s: float, now: float) -> TokenBucket | None:
    """A bucket for `limit` units per `per_s` seconds: refilled evenly, holding one
    period's worth (at least one unit)."""
    if limit is None:
        return None
    return TokenBucket(limit / per_s, max(1.0, float(limit)), now)


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


@dataclass(frozen=True)
class TokenCharge:
    """What a request is charged when it arrives: its prompt (the routing context's count,
    else ~4 bytes a token of the body) and `max_tokens` for each choice of each prompt
    (0 when it sets none), at most what the context window leaves each of them: a request
    asking for a million tokens is charged what it could use, not what it asked."""

    prompt: int
    completion: int

    @classmethod
    def of(cls, api: str, req: OpenAIBody, prompt_tokens: int | None,
           body_bytes: int, context: int | None = None) -> TokenCharge:
        """`context`: the largest context window (`max_model_len`) of the workers serving
        the model, when they report one."""
        if api == "chat":
            assert isinstance(req, ChatCompletionRequest)  # the body of its api
            prompts, limit = 1, req.max_completion_tokens or req.max_tokens
        else:
            assert isinstance(req, CompletionRequest)  # the body of its api
            prompts, limit = len(req.prompts()), req.max_tokens
        prompt = prompt_tokens if prompt_tokens is not None else body_bytes // 4
        per_sequence = limit or 0
        if context is not None:
            per_sequence = min(per_sequence, max(0, context - prompt // prompts))
        return cls(prompt, per_sequence * req.n * prompts)

    @property
    def total(self) -> int:
        return self.prompt + self.completion

    def used(self, usage_tokens: int | None, content_chunks: int) -> int:
        """What the answer used: its `usage.total_tokens` when it reported one, else the
        charge, or (no `max_tokens`) the prompt plus one token per content chunk sent."""
        if usage_tokens is not None:
            return usage_tokens
        return self.total if self.completion else self.prompt + content_chunks
