"""The engine core in its own process (`python -m baton.engine.core_process FD`): the same
engine loop as `AsyncEngine`'s thread, fed by the front's commands over a `core_channel`
socket and answering with one `Step` message per step, so the front's event loop (HTTP,
SSE) and this loop never share a GIL.

Three threads: the engine loop; the intake, which reads commands and builds requests
(grammars compiled there, off the loop); and the main thread, which waits on the loop and
sends stats when no step has for a while. The process exits 0 after a `Stop` or when the
front's end closes, 1 when the loop crashed (after a `Died`)."""

from __future__ import annotations

import gc
import logging
import signal
import sys
import threading
import time
from collections import deque
from multiprocessing.connection import Connection

from baton.engine import core_channel as ch
from baton.engine.async_engine import AsyncEngine, name_os_thread
from baton.engine.errors import InvalidRequestError
from baton.engine.outputs import EngineOutput

log = logging.getLogger(__name__)

# How often stats reach the front: with a step's outputs at most this often, and from the
# main thread when no step came for this long (an idle engine's gauges settle).
STATS_INTERVAL_S = 0.05


class CoreServer(AsyncEngine):
    """`AsyncEngine`'s loop, its outputs and failure sent over `channel`."""

    def __init__(self, config, channel: ch.Channel) -> None:
        super().__init__(config)
        self.channel = channel
        pool = self.core.kv.pool
        pool.record_events()  # the front mirrors what the pool holds
        assert pool.events is not None  # record_events made it
        self._events: deque = pool.events
        self._stats_at = 0.0
        self._num_rejected = 0  # adds that failed to build (the intake's count)

    # -- the engine thread's sink ----------------------------------------------------------
    def _post(self, outputs) -> None:
        self._send_step(list(outputs))

    def _died(self, err: BaseException) -> None:
        self.dead_error = err
        try:
            self.channel.send(ch.Died(repr(err)))
        except OSError:
            pass  # the front is gone too

    def _send_step(self, outputs: list[EngineOutput], force_stats: bool = False) -> None:
        """One message: these outputs, the block events since the last, and the stats and
        KV pull durations when due. Events are taken under the send lock, so they reach
        the front in the order the pool made them."""
        core = self.core
        with self.channel.lock:
            now = time.monotonic()
            due = force_stats or now - self._stats_at >= STATS_INTERVAL_S
            if not (outputs or due or self._events):
                return
            events = [self._events.popleft() for _ in range(len(self._events))]
            applied = self._num_applied + self._num_rejected
            msg = ch.Step(outputs, applied, core.metrics_snapshot() if due else None,
                          core.take_kv_transfer_durations() if due else [], events)
            if due:
                self._stats_at = now
            self.channel.conn.send_bytes(ch.dumps(msg))

    # -- the intake thread -----------------------------------------------------------------
    def intake(self) -> None:
        """Read commands until `Stop` or the front's end closes, then stop the loop."""
        name_os_thread("baton-intake")
        try:
            while True:
                msg = self.channel.recv()
                if isinstance(msg, ch.Stop):
                    break
                try:
                    self._apply(msg)
                except Exception:  # one command's failure is not the engine's
                    log.exception("engine core: %s failed", type(msg).__name__)
        except ch.ChannelError as err:
            log.info("engine core: the front's channel ended (%s)", err)
        finally:
            self._stopping = True
            self._commands.put(("stop", None))

    def _apply(self, msg) -> None:
        if isinstance(msg, ch.Add):
            self._add_from(msg)
        elif isinstance(msg, ch.Abort):
            self._commands.put(("abort", msg.request_id))
        elif isinstance(msg, ch.Reconfigure):
            self.reconfigure(msg.live)
        elif isinstance(msg, ch.ReleaseLease):
            connector = self.core.connector
            released = connector is not None and connector.release_lease(msg.lease_id)
            self.channel.send(ch.Reply(msg.call_id, released))
        elif isinstance(msg, ch.SyncStats):
            self._send_step([], force_stats=True)
            self.channel.send(ch.Reply(msg.call_id, None))

    def _add_from(self, msg: ch.Add) -> None:
        try:
            req = self.core.make_request(
                msg.request_id, msg.prompt_token_ids, msg.params, msg.priority,
                arrival_time=msg.arrival_time, kv=msg.kv, presampled=msg.presampled)
        except (InvalidRequestError, ValueError) as err:  # the front checked it: rare
            self._num_rejected += 1
            self._send_step([EngineOutput(msg.request_id, [], "", None, finish_reason="error",
                                          stop_reason=str(err))])
            return
        self._num_sent += 1
        self._commands.put(("add", req))

    # -- the main thread -------------------------------------------------------------------
    def serve(self) -> int:
        """Run until the loop ends; the exit code: 1 when it crashed."""
        self.start()
        threading.Thread(target=self.intake, name="baton-intake", daemon=True).start()
        thread = self._thread
        assert thread is not None  # start() made it
        while thread.is_alive():
            thread.join(STATS_INTERVAL_S)
            if self.dead_error is None and thread.is_alive():
                try:
                    self._send_step([])
                except OSError:
                    break  # the front is gone: intake sees EOF and stops the loop
        thread.join(30)
        return 1 if self.dead_error is not None else 0


def main(argv: list[str]) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s core: %(message)s")
    channel = ch.Channel(Connection(int(argv[0])), ch.FRONT_MESSAGES)
    start = channel.recv()
    if not isinstance(start, ch.Start):
        raise ch.ChannelError(f"the first message is {type(start).__name__}, not Start")
    # The front stops it (Stop, or its end closing): a signal to the process group (Ctrl-C,
    # a supervisor's SIGTERM) is the front's to drain by, not this process's to die of.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        server = CoreServer(start.config, channel)
    except Exception as err:
        log.exception("engine core: building the engine failed")
        channel.send(ch.Died(f"{type(err).__name__}: {err}"))
        return 1
    gc.collect()  # the model's and the engine's objects out of the collector's reach, as
    gc.freeze()  # the worker freezes its heap: a full collection scans only what serving makes
    channel.send(ch.Ready(server.core.requests.facts))
    return server.serve()


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
