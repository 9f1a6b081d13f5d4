"""The typed channel between an HTTP front and its engine core in another process
(`engine.process_engine` / `engine.core_process`): one message per command one way, one
message per engine step the other (every request's new tokens of that step together), each
a frozen dataclass, framed and pickled over a private socket pair the front made.

Each side accepts only its peer's message types and frames no larger than `MAX_FRAME`
(a larger or unknown one is a broken peer: `ChannelError`)."""

from __future__ import annotations

import pickle
import threading
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

from baton.common.sampling_params import SamplingParams
from baton.common.stats import EngineStats
from baton.engine.config import EngineConfig, LiveSettings
from baton.engine.kv_connector.handoff import KVHandoff
from baton.engine.outputs import EngineOutput
from baton.engine.request_factory import EngineFacts

# The largest frame either side takes: a long prompt's ids or a large batch's step.
MAX_FRAME = 256 << 20


class ChannelError(RuntimeError):
    """The peer sent what this side does not accept, or the channel closed."""


# -- front -> core ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Start:
    """The first message: the engine to build."""

    config: EngineConfig


@dataclass(frozen=True)
class Add:
    """A request the front validated (`RequestFactory`); the core builds it again, its
    grammar compiled from `params.structured` off the engine thread."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int
    arrival_time: float
    presampled: int = 0
    kv: KVHandoff | None = None


@dataclass(frozen=True)
class Abort:
    request_id: str


@dataclass(frozen=True)
class Reconfigure:
    live: LiveSettings


@dataclass(frozen=True)
class ReleaseLease:
    """Answered by a `Reply` with the same `call_id`."""

    call_id: int
    lease_id: str


@dataclass(frozen=True)
class SyncStats:
    """Send a stats snapshot now (a `Step`), then a `Reply` with the same `call_id`."""

    call_id: int


@dataclass(frozen=True)
class Stop:
    pass


# -- core -> front ---------------------------------------------------------------------------
@dataclass(frozen=True)
class Ready:
    """The core is built: what the front validates requests with."""

    facts: EngineFacts


@dataclass(frozen=True)
class Step:
    """What the engine produced since the last message: outputs of one step (or of
    commands applied between steps), the requests added so far (`applied`), and, when due,
    a stats snapshot, KV pull durations and the KV pool's block hash events."""

    outputs: list[EngineOutput]
    applied: int
    stats: EngineStats | None = None
    kv_durations: list[float] = field(default_factory=list)
    block_events: list[tuple[bool, int | None, str]] = field(default_factory=list)


@dataclass(frozen=True)
class Reply:
    call_id: int
    value: object


@dataclass(frozen=True)
class Died:
    """The engine loop crashed (the core process exits non-zero after sending it)."""

    error: str


FRONT_MESSAGES = (Start, Add, Abort, Reconfigure, ReleaseLease, SyncStats, Stop)
CORE_MESSAGES = (Ready, Step, Reply, Died)


def dumps(msg) -> bytes:
    """One message's frame."""
    return pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)


class Channel:
    """One end: `send` from any thread (one frame at a time), `recv` from one reader."""

    def __init__(self, conn: Connection, accepts: tuple[type, ...]) -> None:
        self.conn = conn
        self.accepts = accepts
        self.lock = threading.Lock()  # held while a frame is written

    def send(self, msg) -> None:
        data = dumps(msg)
        with self.lock:
            self.conn.send_bytes(data)

    def recv(self):
        """The next message; ChannelError when the peer closed it or broke the protocol."""
        try:
            data = self.conn.recv_bytes(MAX_FRAME)
        except (EOFError, OSError) as err:
            raise ChannelError(f"the channel closed ({err!r})") from None
        msg = pickle.loads(data)
        if not isinstance(msg, self.accepts):
            raise ChannelError(f"unexpected message {type(msg).__name__}")
        return msg

    def close(self) -> None:
        self.conn.close()
