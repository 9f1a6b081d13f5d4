"""The KV control plane's framing, shared by every transport built on tcp's (tcp, gloo /
nccl, nixl): a connection opens with `MAGIC` (a tag and the protocol version), then carries
frames of a 4-byte big-endian length and a JSON object.

Nothing read here is trusted before it is bounded: a frame's length is checked against a
limit before a byte of its body is read, the body's buffer grows only as bytes arrive (a
header that lies about its length costs nothing), and a deadline, when given, bounds the
whole read however slowly the bytes trickle in. Block data never travels as a frame: its
size follows from the layout and the block ids each side already knows.
"""

from __future__ import annotations

import json
import socket
import struct
import time
from typing import Any

MAGIC = b"BATONKV\x02"  # tag + protocol version 2 (version 1 had no magic)
MAX_FRAME_BYTES = 1 << 20  # control messages: a hello, a pull's block ids, NIXL metadata
_LEN = struct.Struct(">I")
_CHUNK = 64 << 10


class FrameError(ValueError):
    """The peer broke the framing: not our protocol, a frame over the limit, or a body that
    is not a JSON object. The connection is unusable."""


def send_msg(sock: socket.socket, obj: dict[str, Any], prefix: bytes = b"") -> None:
    data = json.dumps(obj).encode()
    sock.sendall(prefix + _LEN.pack(len(data)) + data)


def recv_exact(sock: socket.socket, n: int, deadline: float | None = None) -> bytes:
    """`n` bytes, read in chunks into a buffer that grows only with what arrived. With a
    deadline (time.monotonic()), raises TimeoutError once it passes; ConnectionError when
    the peer closes first."""
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{len(buf)} of {n} bytes before the deadline")
            sock.settimeout(left)
        chunk = sock.recv(min(n - len(buf), _CHUNK))
        if not chunk:
            raise ConnectionError(f"the peer closed the connection after {len(buf)} of "
                                  f"{n} bytes")
        buf += chunk
    return bytes(buf)


def recv_msg(sock: socket.socket, limit: int = MAX_FRAME_BYTES,
             deadline: float | None = None) -> dict[str, Any]:
    """One frame's JSON object. FrameError for a length over `limit` (checked before the
    body is read) or a body that is not a JSON object."""
    (size,) = _LEN.unpack(recv_exact(sock, _LEN.size, deadline))
    if size > limit:
        raise FrameError(f"a frame of {size} bytes is over the {limit}-byte limit")
    body = recv_exact(sock, size, deadline)
    try:
        obj = json.loads(body)
    except (ValueError, RecursionError) as err:  # RecursionError: deeply nested junk
        raise FrameError(f"a frame that is not JSON: {err}") from None
    if not isinstance(obj, dict):
        raise FrameError(f"a frame holding a {type(obj).__name__}, not an object")
    return obj


def recv_magic(sock: socket.socket, deadline: float) -> None:
    """The connection's first bytes must be MAGIC: anything else (an HTTP request, a port
    scanner, an older Baton) is refused before a length is read, on its first wrong byte."""
    head = b""
    while len(head) < len(MAGIC):
        head += recv_exact(sock, 1, deadline)  # 8 tiny reads, once per connection
        if not MAGIC.startswith(head):
            if head[:-1] == MAGIC[:-1]:
                raise FrameError(f"KV protocol version {head[-1]}, this engine speaks "
                                 f"{MAGIC[-1]}: upgrade both sides")
            raise FrameError(f"not a Baton KV peer (first bytes {head!r})")
