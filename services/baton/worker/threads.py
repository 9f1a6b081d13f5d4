"""Work off the event loop on a thread that ends after it, for work that may run OpenMP
parallel regions (torch ops on large tensors, our kernels): libgomp keeps a pool of worker
threads for every thread that ran a parallel region, as long as that thread lives, and once
the process holds more of them than CPUs each barrier of the engine's steps sleeps on a
futex instead of spinning. Such work on the event loop's shared executor left its pool
beside the engine thread's: `baton serve --num-threads 2` on 2 cores (the default there)
decoded 118-129 tokens/s at batch 1 against 317-360 with the loading thread gone."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

T = TypeVar("T")


async def on_a_thread_that_ends(fn: Callable[[], T]) -> T:
    """fn() on a thread of its own, which ends once fn returns (or raises: re-raised)."""
    pool = ThreadPoolExecutor(1, thread_name_prefix="baton-load")
    try:
        return await asyncio.get_running_loop().run_in_executor(pool, fn)
    finally:
        pool.shutdown(wait=False)  # its one thread ends now that fn returned
