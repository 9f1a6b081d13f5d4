"""A tensor-parallel rank that dies ends its engine within bounded time, never a hang, and
no process outlives the one it belongs to."""

from __future__ import annotations

import os
import select
import signal
import subprocess
import sys
import time

import pytest
import transformers

from baton import SamplingParams
from baton.engine.async_engine import AsyncEngine
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore, EngineStepError
from baton.engine.runner.tp import TPWorkerDied
from tests.unit.engine.models.parity import prompts_for, save_tiny

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    # the bundled tokenizer's vocabulary: AsyncEngine builds its grammar engine over it
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=2048)
    save_tiny(config, transformers.LlamaForCausalLM, path, model_dir)
    return path


def tp_config(path, **kw) -> EngineConfig:
    return EngineConfig.from_args(model=str(path), dtype="float32", tensor_parallel_size=2,
                        num_threads=1, num_kv_blocks=64, **kw)


def gone(pid: int) -> bool:
    """No such process, or a zombie (exited, waiting for its reaper)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def test_killed_follower_mid_generation_ends_the_engine(tiny):
    core = EngineCore(tp_config(tiny))
    follower = core.runner.tp_leader.procs[0]
    try:
        for i, ids in enumerate(prompts_for(1001, (20, 30, 40))):
            core.add_request(str(i), ids, SamplingParams(max_tokens=1000, ignore_eos=True))
        for _ in range(3):
            assert any(o.new_token_ids for o in core.step())
        follower.send_signal(signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(EngineStepError) as err:
            while time.monotonic() - t0 < 30:
                core.step()
        assert time.monotonic() - t0 < 30
        assert "steps in a row failed" in str(err.value)
    finally:
        core.close()
    assert follower.poll() == -signal.SIGKILL


def test_killed_follower_ends_an_idle_async_engine(tiny):
    engine = AsyncEngine(tp_config(tiny))
    engine.start()
    follower = engine.core.runner.tp_leader.procs[0]
    follower.send_signal(signal.SIGKILL)
    deadline = time.monotonic() + 10
    while engine.dead_error is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert isinstance(engine.dead_error, TPWorkerDied), engine.dead_error
    assert "rank 1" in str(engine.dead_error)
    engine.shutdown()
    assert not engine.is_alive


def test_followers_exit_when_rank0_is_killed(tiny):
    script = ("import sys; from baton import LLM; "
              f"llm = LLM({str(tiny)!r}, dtype='float32', tensor_parallel_size=2, "
              "num_threads=1, num_kv_blocks=64); "
              "print(llm.engine.runner.tp_leader.procs[0].pid, flush=True); "
              "import time; time.sleep(120)")
    rank0 = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE)
    try:
        ready, _, _ = select.select([rank0.stdout], [], [], 120)
        assert ready, "rank 0 did not start"
        follower = int(rank0.stdout.readline())
        assert not gone(follower)
        os.kill(rank0.pid, signal.SIGKILL)
        rank0.wait(10)
        deadline = time.monotonic() + 15
        while not gone(follower) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert gone(follower), f"follower {follower} outlived rank 0"
    finally:
        if rank0.poll() is None:
            rank0.kill()
            rank0.wait(10)


def test_a_stopped_follower_fails_the_engine_within_the_step_timeout(tiny):
    # SIGSTOP: alive, so no watcher sees it exit; rank 0 waits in a collective. The step
    # timeout fails the engine (a worker's /health then answers 503 and it exits non-zero).
    engine = AsyncEngine(tp_config(tiny, tp_step_timeout_s=2.0))
    engine.start()
    follower = engine.core.runner.tp_leader.procs[0]
    try:
        engine.call_soon(lambda: engine.core.add_request(
            "r", prompts_for(7, (30,))[0], SamplingParams(max_tokens=100_000,
                                                            ignore_eos=True)))
        time.sleep(1.0)  # generating
        follower.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        while engine.dead_error is None and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert engine.dead_error is not None, "the engine still looks alive"
        assert time.monotonic() - t0 < 8
        assert "no progress" in str(engine.dead_error) or isinstance(
            engine.dead_error, EngineStepError), engine.dead_error
        assert not engine.is_alive
    finally:
        engine.shutdown()
        if follower.poll() is None:
            follower.send_signal(signal.SIGKILL)
    assert gone(follower.pid)
