"""The deployment's internal secret: one shared token that routers present to workers and
that keys the KV port's handshake (`baton.kv_transfer`).

It comes from `$BATON_INTERNAL_TOKEN`, or from the file `$BATON_INTERNAL_TOKEN_FILE` names (a
mounted Kubernetes Secret); unset, internal endpoints are open (a local cluster on loopback).
It is never logged: `describe()` says whether one is set, nothing more.

On the wire a router sends it as `X-Baton-Token` on every call to a worker (`/v1`,
`/internal/*`); a client's own `Authorization` header is never passed on.
"""

from __future__ import annotations

import hmac
import os

TOKEN_ENV = "BATON_INTERNAL_TOKEN"
TOKEN_FILE_ENV = "BATON_INTERNAL_TOKEN_FILE"
TOKEN_HEADER = "X-Baton-Token"
MIN_TOKEN_CHARS = 16


def internal_token(environ: dict[str, str] | None = None) -> str | None:
    """The internal token, or None when none is configured. Raises ValueError for a token
    file that cannot be read or a token shorter than MIN_TOKEN_CHARS (a guessable secret is
    a configuration error, not a weaker mode)."""
    env = os.environ if environ is None else environ
    token = env.get(TOKEN_ENV) or None
    path = env.get(TOKEN_FILE_ENV)
    if token is None and path:
        try:
            with open(path, encoding="utf-8") as f:
                token = f.read().strip() or None
        except OSError as err:
            raise ValueError(f"${TOKEN_FILE_ENV}: cannot read {path!r}: {err.strerror}") from None
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"the internal token (${TOKEN_ENV} / ${TOKEN_FILE_ENV}) must be at "
                         f"least {MIN_TOKEN_CHARS} characters")
    return token


def token_matches(given: str | None, expected: str) -> bool:
    """Constant-time comparison of a presented token with the expected one."""
    return given is not None and hmac.compare_digest(given.encode(), expected.encode())


def bearer(header: str | None) -> str | None:
    """The token of an `Authorization: Bearer <token>` header, else None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    return token.strip() or None if scheme.lower() == "bearer" else None


# The caller's tenant on a router -> worker call (a worker believes it only from a caller
# that proved the internal token; from anyone else it is dropped).
TENANT_HEADER = "X-Baton-Tenant"


def upstream_headers(token: str | None) -> dict[str, str]:
    """Headers a router adds to its calls to workers."""
    return {TOKEN_HEADER: token} if token else {}


def describe(token: str | None) -> str:
    return "set" if token else "not set (internal endpoints are open)"
