"""`baton serve --tensor-parallel-size 2` on loopback (CPU, gloo): it answers an OpenAI
completion with the tokens a single-rank engine gives, and a rank killed mid-generation ends
the worker with a non-zero exit within bounded time, leaving no process behind."""

from __future__ import annotations

import os
import signal
import time

import pytest
import transformers

from baton import LLM, SamplingParams
from benchmarks.procs import free_port_run
from tests.integration.conftest import Proc, post_json, wait_for
from tests.unit.engine.models.parity import save_tiny

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, model_dir):
    path = tmp_path_factory.mktemp("tiny-llama")
    config = transformers.LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, max_position_embeddings=1024)
    save_tiny(config, transformers.LlamaForCausalLM, path, model_dir)
    return path


def children_of(pid: int) -> list[int]:
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                out.append(int(entry))
    return out


@pytest.fixture
def tp_worker(tiny, tmp_path):
    port = free_port_run(1)
    proc = Proc(["serve", "--port", str(port), "--model", str(tiny), "--dtype", "float32",
                 "--tensor-parallel-size", "2", "--num-threads", "1", "--num-kv-blocks", "64"],
                tmp_path / "worker.log").start()
    try:
        proc.wait_ready(f"http://127.0.0.1:{port}", timeout=240)
        yield f"http://127.0.0.1:{port}", proc
    finally:
        if proc.proc.poll() is None:
            proc.stop()


def test_serves_a_completion_equal_to_one_rank(tiny, tp_worker):
    url, proc = tp_worker
    [follower] = children_of(proc.proc.pid)
    status, _, body = post_json(url + "/v1/completions", {
        "model": tiny.name, "prompt": PROMPT, "max_tokens": 12, "temperature": 0})
    assert status == 200, body
    llm = LLM(str(tiny), dtype="float32", num_kv_blocks=64, num_threads=1)
    ref = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=12),
                       use_tqdm=False)[0].outputs[0]
    assert body["choices"][0]["text"] == ref.text and body["usage"]["completion_tokens"] == 12
    assert proc.stop()
    assert follower not in children_of(os.getpid()) and not os.path.exists(f"/proc/{follower}")


def test_killed_rank_ends_the_worker(tiny, tp_worker):
    url, proc = tp_worker
    [follower] = children_of(proc.proc.pid)
    os.kill(follower, signal.SIGKILL)
    t0 = time.monotonic()
    status, _, _ = post_json(url + "/v1/completions", {
        "model": tiny.name, "prompt": PROMPT, "max_tokens": 500, "temperature": 0,
        "ignore_eos": True}, timeout=30)
    rc = proc.proc.wait(30)
    assert rc != 0 and time.monotonic() - t0 < 30, proc.log_path.read_text()[-2000:]
    assert status in (None, 500, 503) or status >= 500
    wait_for(lambda: not children_of(proc.proc.pid), 10, "no orphan")
