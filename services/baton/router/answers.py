"""Whether a worker's answer is a Baton worker's answer, before the router believes it.

The registry (or a `--workers` list) may name a server that is not a Baton worker, or one
that broke: its answer must not reach the client as the request's own result or fault.
What every Baton worker answers, and so what is checked:

- an error the request caused (a 4xx other than 408 / 429, a 5xx marked no-retry) is
  OpenAI-shaped JSON, `{"error": {"message": ...}}`: anything else (an nginx 404 page, a
  bare `{"detail": ...}`) is the peer's fault, not the request's;
- a whole 200 answer is a JSON object, with a `choices` list on the APIs that promise one
  (chat, completions, a decode pod's /internal/generate);
- a streamed 200 is `text/event-stream` whose first bytes are an SSE line (a field such as
  `data:` or `event:`, or a `:` comment);
- every answer carries `X-Baton-Worker: <wire version>/<worker id>` (`common.internal.
  WORKER_HEADER`): the router's wire version, and, for a worker the registry named, the id
  of the record (another id at that address is a process the router's view does not know).

Each check returns None for a Baton answer, else what is wrong (for the log). The relay and
the remote prefill open the circuit of a peer that answers wrongly (`Discovery.
record_misbehaviour`) and move the request to another worker, or prefill locally.
"""

from __future__ import annotations

import json
from collections.abc import Mapping

from baton.common.internal import WIRE_VERSION, WORKER_HEADER

CHOICE_PATHS = ("/v1/chat/completions", "/v1/completions", "/internal/generate")
SSE_FIELDS = (b"data:", b"event:", b"id:", b"retry:", b":")  # what an SSE line starts with


def _object(raw: bytes) -> dict[str, object] | None:
    try:
        value = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def error_problem(raw: bytes) -> str | None:
    """What is wrong with a worker's error body, or None: an OpenAI-shaped error."""
    body = _object(raw)
    error = body.get("error") if body is not None else None
    if not isinstance(error, dict) or not isinstance(error.get("message"), str):
        return f"an error answer that is not OpenAI's error JSON: {raw[:80]!r}"
    return None


def whole_problem(path: str, raw: bytes) -> str | None:
    """What is wrong with a worker's whole 200 answer on `path`, or None."""
    body = _object(raw)
    if body is None:
        return f"a 200 that is not a JSON object: {raw[:80]!r}"
    if path in CHOICE_PATHS and not isinstance(body.get("choices"), list):
        return f"a 200 on {path} without choices: {raw[:80]!r}"
    return None


def stream_problem(content_type: str, first: bytes | None) -> str | None:
    """What is wrong with the start of a worker's streamed 200 (its content type, and its
    `first` bytes once they came), or None."""
    if content_type != "text/event-stream":
        return f"a stream of {content_type or 'no content type'}, not text/event-stream"
    if first is not None and not first.lstrip(b"\r\n").startswith(SSE_FIELDS):
        return f"a stream that does not start with an SSE event: {first[:80]!r}"
    return None


def identity_problem(headers: Mapping[str, str], worker_id: str | None) -> str | None:
    """What is wrong with who answered (its WORKER_HEADER), or None: a Baton worker of this
    wire version and, when `worker_id` is known (the registry's), that very worker."""
    value = headers.get(WORKER_HEADER)
    if value is None:
        return f"an answer without {WORKER_HEADER}: not a Baton worker"
    version, _, answered_by = value.partition("/")
    if version != str(WIRE_VERSION):
        return f"a worker of wire version {version[:16]!r}, not {WIRE_VERSION}"
    if worker_id is not None and answered_by != worker_id:
        return f"worker {answered_by[:40]!r} answered, not {worker_id!r} (a stale record)"
    return None
