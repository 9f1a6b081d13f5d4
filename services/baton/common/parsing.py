"""Where a request body is parsed: on the event loop, or on a thread when it is large.

`protocol.parse_request` validates a body whole, schemas included (jsonschema's metaschema
check is Python, seconds per MB of schema). A handler on an event loop calls
`parse_request_off_loop`, so a large body never holds the loop: other streams and `/health`
keep answering while it is checked (the loop takes the GIL back every switch interval,
5 ms). The cost itself is bounded by the body limit and `common.structured_limits`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from pydantic import BaseModel

from baton.common.protocol import parse_request

# Bodies up to this size are parsed on the loop (well under a millisecond, cheaper than a
# thread hop); larger ones on a thread of the loop's default executor (bounded).
INLINE_PARSE_BYTES = 16 << 10

_Model = TypeVar("_Model", bound=BaseModel)
_Parsed = TypeVar("_Parsed")


async def parse_off_loop(parse: Callable[[bytes], _Parsed], body: bytes) -> _Parsed:
    """`parse(body)`, on a thread when `body` is larger than INLINE_PARSE_BYTES; raises
    what `parse` raises."""
    if len(body) <= INLINE_PARSE_BYTES:
        return parse(body)
    return await asyncio.to_thread(parse, body)


async def parse_request_off_loop(model: type[_Model], body: bytes) -> _Model:
    """`parse_request(model, body)` (every failure a 400 OpenAIError), off the loop when
    the body is large."""
    return await parse_off_loop(partial(parse_request, model), body)
