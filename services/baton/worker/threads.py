"""Work off the event loop on a thread that ends after it, for work that may run OpenMP
parallel regions (torch ops on large tensors, our kernels): libgomp keeps a pool of worker
threads for every thread that ran a parallel region, as long as that thread lives, and once
the process holds more of them than CPUs each barrier of the engine's steps sleeps on a
futex instead of spinning. Such work on the event loop's shared executor left its pool
beside the engine thread's: `baton serve --num-threads 2` on 2 cores (the default there)
decoded 118-129 tokens/s at batch 1 against 317-360 with the loading thread gone."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from typing import TypeVar

T = TypeVar("T")


# How much lower than the engine's a background load's scheduling priority is (Linux nice):
# on a machine with few cores a run-time LoRA load competes with the engine thread for a core
BACKGROUND_NICE = 19


async def on_a_thread_that_ends(fn: Callable[[], T], background: bool = False) -> T:
    """fn() on a thread of its own, which ends once fn returns (or raises: re-raised).
    `background`: the thread runs at a lower priority than the engine's (work that must
    not slow the running streams, such as loading an adapter beside them)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="baton-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(
            pool, partial(_at_lower_priority, fn) if background else fn)
    finally:
        pool.shutdown(wait=False)  # its one thread ends now that fn returned


def _at_lower_priority(fn: Callable[[], T]) -> T:
    try:  # Linux: a thread's nice value is its own (the thread ends after fn)
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(),
                       os.getpriority(os.PRIO_PROCESS, 0) + BACKGROUND_NICE)
    except (AttributeError, OSError):  # elsewhere: the priority it has
        pass
    return fn()
