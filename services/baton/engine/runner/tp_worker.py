"""A tensor-parallel follower: rank r of N, spawned by rank 0's `TPLeader` (`tp.py`).

    python -m baton.engine.runner.tp_worker --parent-pid PID   (stdin: the spec, then steps)

It joins the process group, builds the model's rank-r slice and its KV heads through the
same `ModelRunner` as rank 0, says it is ready (one JSON line on stdout), then runs each
step rank 0 sends: the forward and the `compute_logits` calls, whose collectives pair with
rank 0's. It never samples. It exits at the stop frame, when its stdin closes, when its
parent changes (rank 0 killed) or when a collective fails (a peer gone).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import BinaryIO

import torch

from baton.engine.distributed import TPGroup
from baton.engine.runner.ahead import fill_follower_pending
from baton.engine.runner.tp import (
    COLLECTIVE_TIMEOUT_S,
    WATCH_INTERVAL_S,
    make_process_group,
    threads_per_rank,
)
from baton.engine.runner.tp_wire import Control, FollowerSpec, read_message
from baton.engine.staging import HostStaging

log = logging.getLogger("baton.tp_worker")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="baton.engine.runner.tp_worker")
    parser.add_argument("--parent-pid", type=int, required=True)
    args = parser.parse_args(argv)
    # stdout carries the ready line only: anything else printed goes to stderr.
    ready_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    _exit_with_parent(args.parent_pid)
    steps = sys.stdin.buffer
    spec = FollowerSpec.from_line(steps.readline())
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format=f"%(asctime)s tp-rank{spec.rank} %(levelname)s %(message)s")
    runner = build_runner(spec)
    ready_out.write((json.dumps({"rank": spec.rank, "num_blocks": runner.num_blocks}) + "\n")
                    .encode())
    ready_out.flush()
    from baton.engine.runner.tp_kv import FollowerKV

    kv = FollowerKV(runner, spec.rank, spec.size, ready_out)
    try:
        serve(runner, steps, kv)
    finally:
        kv.close()
    log.info("rank %d stopping", spec.rank)
    return 0


def build_runner(spec: FollowerSpec):
    """Join the group and build this rank's model and KV cache."""
    import torch.distributed as dist

    from baton.engine.runner.model_runner import ModelRunner, resolve_device

    config = spec.engine_config()
    torch.set_num_threads(threads_per_rank(config))
    device = resolve_device(config.compute.device)
    if device.type == "cuda":
        torch.cuda.set_device(spec.rank)  # one GPU per rank
    store = dist.TCPStore("127.0.0.1", spec.store_port, spec.size, is_master=False,
                          timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    pg = make_process_group(store, spec.rank, spec.size, device)
    group = TPGroup(spec.rank, spec.size, pg)
    return ModelRunner(config, Path(spec.model_dir), spec.max_model_len, tp=group)


@torch.inference_mode()
def serve(runner, steps: BinaryIO, kv=None) -> None:
    """Run rank 0's steps (and KV control messages, handed to `kv`) until the stop frame
    or end of file."""
    staging = HostStaging(runner.device)
    while (msg := read_message(steps)) is not None:
        if isinstance(msg, Control):
            kv.handle(msg.body)
            continue
        batch, calls = msg.to_device(runner.device, staging)
        fill_follower_pending(batch, runner.tp)  # a step launched ahead: rank 0's tokens
        hidden = runner._forward(batch)  # (T, h), this rank's part of every collective
        for index in calls:
            runner.model.compute_logits(hidden.index_select(0, index))  # all-gather


def _exit_with_parent(parent_pid: int) -> None:
    """Exit when rank 0 is gone, even while blocked in a collective that would wait for
    it (NCCL). Polling the parent id: PR_SET_PDEATHSIG would fire when the *thread* that
    spawned us exits, and rank 0 may spawn from a loader thread."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCH_INTERVAL_S * 5)
        log.error("rank 0 (pid %d) is gone; exiting", parent_pid)
        os._exit(1)

    if os.getppid() != parent_pid:
        os._exit(1)
    threading.Thread(target=watch, name="baton-tp-parent", daemon=True).start()


if __name__ == "__main__":
    sys.exit(main())
