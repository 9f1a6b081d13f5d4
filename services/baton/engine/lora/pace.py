"""Loading an adapter beside a running engine gives way to it: the load's Python holds the
GIL between its many small torch ops, and a thread that wants the GIL (the engine's, between
two steps) waits for the holder to let go — up to the interpreter's switch interval (5 ms)
when the holder does not, a stall every running stream sees. `give_way` lets go for a
moment after each module the load reads or lays out, so the engine waits at most one
module's work (tens of microseconds), at the price of a few tens of ms per load."""

from __future__ import annotations

import time

PAUSE_S = 0.0002  # a sleep long enough for a waiting thread to take the GIL


def give_way() -> None:
    time.sleep(PAUSE_S)
