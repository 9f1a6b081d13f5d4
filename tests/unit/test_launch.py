"""`baton up`: every worker flag reaches the workers, and a process that exits is started
again with backoff while the others keep running."""

from __future__ import annotations

import argparse
import threading
import time

import pytest

from baton import launch
from baton.cli import build_parser
from baton.cli_common import WORKER_GROUP
from baton.launch import Cluster


def _subparser(name: str) -> argparse.ArgumentParser:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[name]


def _worker_group(p: argparse.ArgumentParser) -> dict[str, argparse.Action]:
    group = next(g for g in p._action_groups if g.title == WORKER_GROUP)
    return {a.option_strings[0]: a for a in group._group_actions}


def test_up_takes_every_worker_flag_serve_has():
    serve, up = _worker_group(_subparser("serve")), _worker_group(_subparser("up"))
    assert set(serve) == set(up)
    assert {"--kv-transfer-timeout", "--kv-lease-ttl", "--kv-failure-policy", "--kv-host",
            "--kv-port", "--device", "--attention-backend", "--enforce-eager",
            "--drain-timeout"} <= set(serve)


# a value other than the default for every flag of the worker group
NON_DEFAULTS = ["--dtype", "float32", "--block-size", "32", "--max-num-seqs", "7",
                "--max-num-batched-tokens", "333", "--max-model-len", "1024",
                "--num-kv-blocks", "99", "--kv-cache-gib", "0.5", "--no-prefix-caching",
                "--gpu-memory-utilization", "0.45",
                "--scheduling-policy", "priority", "--batch-window-ms", "25", "--async-scheduling", "on", "--stream-interval", "4", "--engine-process", "on", "--num-threads", "1", "--device", "cpu",
                "--attention-backend", "torch", "--enforce-eager",
                "--served-model-name", "m", "--max-waiting", "5", "--drain-timeout", "7",
                "--kv-transport", "tcp", "--kv-host", "127.0.0.2", "--kv-port", "0",
                "--kv-lease-ttl", "11", "--kv-transfer-timeout", "12",
                "--kv-failure-policy", "fail", "--model", "/some/model",
                "--tool-call-parser", "mistral", "--tensor-parallel-size", "2",
                "--revision", "v2", "--skip-tokenizer-init", "--kv-cache-dtype", "fp8_e5m2",
                "--reasoning-parser", "qwen3", "--tp-step-timeout", "33", "--quantization", "auto", "--deterministic",
                "--speculative-config", '{"method": "ngram"}', "--kv-offload-gib", "0.25",
                "--kv-disk-dir", "/var/kv", "--kv-disk-gib", "8",
                "--sim-profile", "h100-llama3-8b", "--enable-lora",
                "--lora-modules", "sql=/adapters/sql", "chat=/adapters/chat",
                "--max-loras", "3", "--max-lora-rank", "32", "--max-cpu-loras", "5"]


def test_up_passes_every_flag_it_was_given_to_its_workers():
    up_args = build_parser().parse_args(["up", *NON_DEFAULTS])
    worker_args = Cluster.from_args(up_args).worker_args
    serve_args = build_parser().parse_args(["serve", *worker_args])
    direct = build_parser().parse_args(["serve", *NON_DEFAULTS])
    for dest in {a.dest for a in _worker_group(_subparser("serve")).values()}:
        assert getattr(serve_args, dest) == getattr(direct, dest), dest
    missing = [f for f in _worker_group(_subparser("serve")) if f not in NON_DEFAULTS
               and f not in ("--transport",)]
    assert not missing, f"add a non-default value for {missing} to NON_DEFAULTS"


def test_tensor_parallel_flags():
    args = build_parser().parse_args(["serve", "-tp", "2"])
    assert args.tensor_parallel_size == 2
    assert launch._ranks(["--x", "--tensor-parallel-size", "2", "--tensor-parallel-size", "4"]
                         ) == 4  # cores are split over every rank of every worker
    assert launch._ranks(["--x"]) == 1
    up = build_parser().parse_args(["up", "--prefill", "1", "--decode", "1"])
    assert (up.prefill_tp, up.decode_tp) == (1, 1)
    assert Cluster.from_args(up).tp_args(launch.Role.PREFILL) == []
    with pytest.raises(ValueError, match="colocated workers take --tensor-parallel-size"):
        Cluster(num_workers=2, decode_tp=2)
    with pytest.raises(ValueError, match="runs over tcp only"):
        Cluster(num_prefill=1, num_decode=1, prefill_tp=2, worker_args=["--kv-transport",
                                                                        "nixl"])
    tp = Cluster(num_prefill=1, num_decode=1, prefill_tp=2)  # P TP=2 -> D TP=1 over tcp
    assert tp.tp_args(launch.Role.PREFILL) == ["--tensor-parallel-size", "2",
                                               "--kv-transport", "tcp"]
    assert tp.tp_args(launch.Role.DECODE) == ["--kv-transport", "tcp"]


def test_a_fixed_kv_port_becomes_one_port_per_worker():
    assert launch._kv_port_of(["--kv-port", "7000", "--x"], 2) == ["--kv-port", "7002", "--x"]
    assert launch._kv_port_of(["--kv-port", "0"], 3) == ["--kv-port", "0"]
    # tensor-parallel workers: rank r listens on the worker's port + r
    assert launch._kv_port_of(["--kv-port", "7000"], 2, ranks=2) == ["--kv-port", "7004"]


def test_an_exited_process_is_restarted_with_backoff(monkeypatch):
    monkeypatch.setattr(launch, "RESTART_BACKOFF_S", 0.2)
    cluster = Cluster(num_workers=1)
    # a real `baton` process that exits at once (code 2: no such file)
    cluster.procs.append(cluster._start_process(
        "flaky", ["config", "validate", "/nonexistent/baton.yaml"], 0.2))
    first = cluster.procs[0].proc
    stop = launch._StopSignal()
    try:
        threading.Timer(4.0, lambda: setattr(stop, "requested", True)).start()
        t0 = time.monotonic()
        cluster._supervise(stop)
        assert time.monotonic() - t0 == pytest.approx(4.0, abs=1.5)
        child = cluster.procs[0]
        assert child.proc is not first  # started again
        assert child.backoff_s >= 0.4  # 0.2, doubled at each restart
    finally:
        stop.restore()
        cluster.stop(grace_s=2)


def test_kv_pool_flags_reach_the_engine_config():
    from baton.cli_common import engine_config

    def config(*flags):
        return engine_config(build_parser().parse_args(["serve", *flags]))

    plain = config()  # off CUDA the engine's 2 GiB, on CUDA its 0.9 of the device
    assert (plain.cache.kv_cache_memory_bytes, plain.cache.gpu_memory_utilization) == (None, None)
    assert config("--kv-cache-gib", "0.5").cache.kv_cache_memory_bytes == 1 << 29
    assert plain.cache.kv_offload_gib == 0  # no host tier unless asked
    assert config("--kv-offload-gib", "4").cache.kv_offload_gib == 4.0
    disk = config("--kv-offload-gib", "4", "--kv-disk-dir", "/d", "--kv-disk-gib", "64")
    assert (disk.cache.kv_disk_dir, disk.cache.kv_disk_gib) == ("/d", 64.0)
    shared = config("--device", "cuda", "--gpu-memory-utilization", "0.45")
    assert shared.cache.pool_fraction("cuda") == 0.45 and shared.compute.device == "cuda"
