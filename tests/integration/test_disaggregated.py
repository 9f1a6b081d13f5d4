"""Router -> prefill worker -> KV pull over TCP -> decode worker, as real processes: greedy
text equals colocated generation, short prompts stay local, a dead prefill worker means
local prefill on decode, and both pods end with zero blocks."""

from __future__ import annotations

import signal

import pytest

from baton import SamplingParams
from tests.conftest import make_text
from tests.integration.conftest import (
    MODEL,
    Proc,
    assert_idle,
    free_port_run,
    http_get,
    metric_value,
    post_json,
    wait_for,
)

pytestmark = pytest.mark.slow
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "256", "--num-threads", "1"]


@pytest.fixture(scope="module")
def disagg(tmp_path_factory):
    port = free_port_run(3)
    logs = tmp_path_factory.mktemp("disagg")
    urls = [f"http://127.0.0.1:{port + i}" for i in range(3)]
    prefill = Proc(["serve", "--port", str(port + 1), "--role", "prefill", *FLAGS],
                   logs / "prefill.log").start()
    decode = Proc(["serve", "--port", str(port + 2), "--role", "decode", *FLAGS],
                  logs / "decode.log").start()
    prefill.wait_ready(urls[1])
    decode.wait_ready(urls[2])
    router = Proc(["router", "--port", str(port), "--workers", f"{urls[1]},{urls[2]}",
                   "--disagg-min-prefill-tokens", "64", "--check-interval", "0.2"],
                  logs / "router.log").start()
    router.wait_ready(urls[0])
    yield {"router": urls[0], "prefill": urls[1], "decode": urls[2], "procs": {
        "prefill": prefill, "decode": decode, "router": router}}
    for p in (router, decode, prefill):
        if p.proc.poll() is None:
            assert p.stop()


def chat(router: str, content: str, **kw):
    code, _, body = post_json(router + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": content}],
        "temperature": 0, "max_tokens": 16} | kw)
    assert code == 200, body
    return body


def test_remote_and_local_prefill_match_colocated(disagg, reference_llm):
    router = disagg["router"]
    long_text = make_text(3, 2) + "\nSummarise it."
    ref = reference_llm.chat([{"role": "user", "content": long_text}],
                             SamplingParams(temperature=0, max_tokens=16),
                             use_tqdm=False)[0].outputs[0].text
    assert chat(router, long_text)["choices"][0]["message"]["content"] == ref
    local_before = metric_value(router, 'baton:disagg_decisions_total{decision="local"}', 0)
    # The same prompt again: the decode pod has it cached, so it stays local (and exact).
    code, _, sse = post_json(router + "/v1/chat/completions", {
        "model": MODEL, "messages": [{"role": "user", "content": long_text}],
        "temperature": 0, "max_tokens": 16, "stream": True})
    assert metric_value(router, 'baton:disagg_decisions_total{decision="local"}', 0) \
        == local_before + 1
    assert code == 200 and sse.endswith("data: [DONE]\n\n")
    import json

    text = "".join(json.loads(line[6:])["choices"][0]["delta"].get("content") or ""
                   for line in sse.splitlines()
                   if line.startswith("data: {") and '"choices":[{' in line)
    assert text == ref
    other = make_text(3, 4) + "\nSummarise it."
    other_ref = reference_llm.chat([{"role": "user", "content": other}],
                                   SamplingParams(temperature=0, max_tokens=16),
                                   use_tqdm=False)[0].outputs[0].text
    assert chat(router, other)["choices"][0]["message"]["content"] == other_ref
    short_ref = reference_llm.chat([{"role": "user", "content": "Hi there"}],
                                   SamplingParams(temperature=0, max_tokens=16),
                                   use_tqdm=False)[0].outputs[0].text
    assert chat(router, "Hi there")["choices"][0]["message"]["content"] == short_ref
    assert metric_value(router, 'baton:disagg_decisions_total{decision="remote"}') >= 2
    assert metric_value(router, 'baton:disagg_decisions_total{decision="local"}', 0) >= 1
    assert metric_value(disagg["decode"], "baton:kv_transfer_bytes_total") > 0
    assert metric_value(disagg["decode"], "baton:kv_transfer_seconds_count") >= 2
    assert_idle([disagg["prefill"], disagg["decode"]])
    assert metric_value(disagg["prefill"], "baton:kv_leases_held") == 0


def test_internal_endpoints_are_not_routed(disagg):
    code, _, _ = post_json(disagg["router"] + "/internal/prefill", {"api": "chat"})
    assert code == 404


def test_ttft_breakdown_on_request(disagg):
    import json
    import urllib.request

    def ask(content: str, stream: bool, timing: bool):
        req = urllib.request.Request(disagg["router"] + "/v1/chat/completions", data=json.dumps({
            "model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": 4, "stream": stream}).encode(),
            headers={"Content-Type": "application/json"} | (
                {"X-Baton-Timing": "1"} if timing else {}))
        with urllib.request.urlopen(req, timeout=60) as r:
            raw = r.read().decode()
        if not stream:
            return json.loads(raw)
        return [json.loads(line[6:]) for line in raw.splitlines()
                if line.startswith("data: {")]

    keys = {"router_queue_s", "prefill_s", "transfer_s", "decode_queue_s", "first_token_s",
            "total_s"}
    whole = ask(make_text(3, 3) + "\nTitle?", False, True)["baton_ttft"]
    assert set(whole) == keys and whole["prefill_s"] > 0 and whole["transfer_s"] > 0
    assert whole["total_s"] == pytest.approx(sum(v for k, v in whole.items()
                                                 if k not in ("total_s", "transfer_s")),
                                             abs=1e-5)
    events = ask(make_text(3, 5) + "\nTitle?", True, True)
    timed = [e for e in events if "baton_ttft" in e]
    assert len(timed) == 1 and timed[0]["baton_ttft"]["transfer_s"] > 0
    assert timed[0]["choices"][0]["finish_reason"] is not None  # on the last event
    local = ask("Hi", False, True)["baton_ttft"]  # short: prefilled on the decode pod
    assert local["prefill_s"] == 0 and local["transfer_s"] == 0
    assert "baton_ttft" not in ask("Hi again", False, False)  # only when asked for
    assert_idle([disagg["prefill"], disagg["decode"]])


def test_dead_prefill_worker_falls_back_to_local_prefill(disagg, reference_llm):
    router, prefill = disagg["router"], disagg["procs"]["prefill"]
    long_text = make_text(4, 3) + "\nWhat is it about?"
    ref = reference_llm.chat([{"role": "user", "content": long_text}],
                             SamplingParams(temperature=0, max_tokens=16),
                             use_tqdm=False)[0].outputs[0].text
    prefill.proc.send_signal(signal.SIGKILL)
    prefill.proc.wait()
    assert chat(router, long_text)["choices"][0]["message"]["content"] == ref
    wait_for(lambda: http_get(router + "/workers")[1].count(b'"healthy": true') == 1, 5,
             "the router to mark the prefill worker down")
    other = make_text(4, 5) + "\nWhat is it about?"  # not cached on decode: worth a prefill
    other_ref = reference_llm.chat([{"role": "user", "content": other}],
                                   SamplingParams(temperature=0, max_tokens=16),
                                   use_tqdm=False)[0].outputs[0].text
    assert chat(router, other)["choices"][0]["message"]["content"] == other_ref
    fallbacks = sum(metric_value(router, f'baton:fallbacks_total{{reason="{r}"}}')
                    for r in ("prefill_failed", "prefill_pod_down", "no_prefill_worker")
                    if f'reason="{r}"'.encode() in http_get(router + "/metrics")[1])
    assert fallbacks >= 2
    assert_idle([disagg["decode"]])
