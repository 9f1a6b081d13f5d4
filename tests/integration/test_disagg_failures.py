"""Failure paths of a disaggregated deployment with real processes (docs/design.md §3): router +
1 prefill + 2 decode pods. A decode pod killed mid-stream has its stream resumed on the
other one (the client sees one stream, greedy text exact); then a mixed run with a prefill
pod frozen (its transfers time out) and killed, a decode pod killed, and clients that leave
early: every request ends complete or with a clear error within its deadline, and every
pod ends with zero used blocks and zero leases."""

from __future__ import annotations

import asyncio
import json
import random
import signal
import time

import aiohttp
import pytest

from baton import SamplingParams
from tests.conftest import QUESTIONS, make_text
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
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "384", "--num-threads", "1"]
DEADLINE_S = 60.0


@pytest.fixture(scope="module")
def pods(tmp_path_factory):
    port = free_port_run(4)
    logs = tmp_path_factory.mktemp("disagg-failures")
    urls = [f"http://127.0.0.1:{port + i}" for i in range(4)]
    procs = {
        "prefill": Proc(["serve", "--port", str(port + 1), "--role", "prefill",
                         "--kv-lease-ttl", "5", *FLAGS], logs / "prefill.log"),
        "decode-a": Proc(["serve", "--port", str(port + 2), "--role", "decode",
                          "--kv-transfer-timeout", "2", *FLAGS], logs / "decode-a.log"),
        "decode-b": Proc(["serve", "--port", str(port + 3), "--role", "decode",
                          "--kv-transfer-timeout", "2", *FLAGS], logs / "decode-b.log"),
    }
    url_of = {"prefill": urls[1], "decode-a": urls[2], "decode-b": urls[3]}
    for p in procs.values():
        p.start()
    for name, p in procs.items():
        p.wait_ready(url_of[name])
    router = Proc(["router", "--port", str(port), "--workers", ",".join(urls[1:]),
                   "--disagg-min-prefill-tokens", "64", "--check-interval", "0.2",
                   "--prefill-timeout", "3", "--request-timeout", str(DEADLINE_S)],
                  logs / "router.log").start()
    router.wait_ready(urls[0])
    yield {"router": urls[0], "url": url_of, "procs": procs}
    for p in (router, *procs.values()):
        if p.proc.poll() is None:
            assert p.stop()


def restart(pods, name: str) -> None:
    p = pods["procs"][name]
    if p.proc.poll() is None:
        p.proc.send_signal(signal.SIGKILL)
    p.proc.wait()
    p._log.close()
    p.start().wait_ready(pods["url"][name])


def running(url: str) -> int:
    code, body = http_get(url + "/load", 1)
    return json.loads(body)["running"] if code == 200 else 0


def body(content: str, max_tokens: int, stream: bool) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}],
            "temperature": 0, "max_tokens": max_tokens, "stream": stream,
            "stream_options": {"include_usage": True} if stream else None}


async def stream_events(session, url: str, payload: dict, on_event=None,
                        leave_after: int | None = None) -> tuple[int, list[dict], bool]:
    """(status, events, saw [DONE]); `leave_after` closes the connection after that many
    events, as a client that goes away."""
    payload = {k: v for k, v in payload.items() if v is not None}
    events: list[dict] = []
    async with session.post(url + "/v1/chat/completions", json=payload) as resp:
        if resp.status != 200:
            return resp.status, [await resp.json()], False
        async for line in resp.content:
            line = line.strip()
            if not line.startswith(b"data: "):
                continue
            if line == b"data: [DONE]":
                return 200, events, True
            events.append(json.loads(line[6:]))
            if on_event is not None:
                await on_event(len(events))
            if leave_after is not None and len(events) >= leave_after:
                resp.close()
                return 200, events, False
    return 200, events, False


def text_of(events: list[dict]) -> str:
    return "".join(c["delta"].get("content") or "" for e in events
                   for c in e.get("choices", ()))


def test_decode_pod_killed_mid_stream_resumes_on_the_other(pods, reference_llm):
    router = pods["router"]
    prompt = make_text(3, 1) + "\nWrite a long story about it."
    ref = reference_llm.chat([{"role": "user", "content": prompt}],
                             SamplingParams(temperature=0, max_tokens=64), use_tqdm=False)[0]
    killed = []

    async def kill_serving_pod(n_events: int) -> None:
        if n_events == 8 and not killed:
            for name in ("decode-a", "decode-b"):
                if running(pods["url"][name]):
                    pods["procs"][name].proc.send_signal(signal.SIGKILL)
                    killed.append(name)
                    return

    async def go():
        async with aiohttp.ClientSession() as s:
            return await stream_events(s, router, body(prompt, 64, True), kill_serving_pod)

    t0 = time.monotonic()
    status, events, done = asyncio.run(go())
    assert killed, "no decode pod was running the request"
    assert status == 200 and done, events[-3:]
    assert not any("error" in e for e in events), events[-3:]
    assert text_of(events) == ref.outputs[0].text  # one uninterrupted stream, exact
    assert len({e["id"] for e in events}) == 1
    assert sum(1 for e in events for c in e["choices"] if "role" in c["delta"]) == 1
    finish = [c["finish_reason"] for e in events for c in e["choices"] if c["finish_reason"]]
    assert finish == [ref.outputs[0].finish_reason]
    usage = events[-1]["usage"]
    assert usage["prompt_tokens"] == len(ref.prompt_token_ids)
    assert usage["completion_tokens"] == len(ref.outputs[0].token_ids)
    assert time.monotonic() - t0 < DEADLINE_S
    assert metric_value(router, 'baton:fallbacks_total{reason="decode_lost"}') >= 1
    survivor = "decode-b" if killed[0] == "decode-a" else "decode-a"
    assert_idle([pods["url"][survivor], pods["url"]["prefill"]])
    restart(pods, killed[0])


@pytest.mark.parametrize("how", ["freeze", "kill"])
def test_stalled_or_dead_holder_means_recompute_on_decode(pods, reference_llm, how):
    """The prefill pod answers, then freezes (the pull times out) or dies (the pull loses
    its peer) before the decode pod pulls: the decode pod recomputes, the answer is exact,
    and the prefill pod's lease expires to zero blocks."""
    url, procs = pods["url"], pods["procs"]
    prompt = make_text(2, 4) + "\nExplain."
    request = {"model": MODEL, "messages": [{"role": "user", "content": prompt}],
               "temperature": 0, "max_tokens": 12}
    code, _, prefilled = post_json(url["prefill"] + "/internal/prefill",
                                   {"api": "chat", "request": request})
    assert code == 200, prefilled
    reason = "transfer_timeout" if how == "freeze" else "kv_peer_lost"
    decode = url["decode-a"]
    before = _fallbacks(decode, reason)
    procs["prefill"].proc.send_signal(signal.SIGSTOP if how == "freeze" else signal.SIGKILL)
    try:
        t0 = time.monotonic()
        code, _, answer = post_json(decode + "/internal/generate", {
            "api": "chat", "request": request, "prompt_token_ids": prefilled["prompt_token_ids"],
            "kv_transfer_params": prefilled["kv_transfer_params"]}, timeout=DEADLINE_S)
        assert code == 200, answer
        assert time.monotonic() - t0 < 2.0 + 10  # the 2 s transfer timeout, then compute
    finally:
        if how == "freeze":
            procs["prefill"].proc.send_signal(signal.SIGCONT)
    ref = reference_llm.chat([{"role": "user", "content": prompt}],
                             SamplingParams(temperature=0, max_tokens=12), use_tqdm=False)
    assert answer["choices"][0]["message"]["content"] == ref[0].outputs[0].text
    assert _fallbacks(decode, reason) == before + 1
    if how == "kill":
        restart(pods, "prefill")
    assert_idle([decode, url["prefill"]], timeout=10)  # the 5 s lease has expired
    assert metric_value(url["prefill"], "baton:kv_leases_held") == 0


def _fallbacks(url: str, reason: str) -> float:
    return metric_value(url, f'baton:fallbacks_total{{reason="{reason}"}}', 0)


def test_mixed_run_with_failures_ends_clean(pods):
    """Concurrent long and short requests, streamed and not, some clients leaving early,
    while the prefill pod is frozen (transfers time out), a decode pod is killed and
    restarted, and the prefill pod is killed and restarted."""
    router, url, procs = pods["router"], pods["url"], pods["procs"]
    rng = random.Random(7)
    plans = []
    for i in range(32):
        long = rng.random() < 0.6
        content = (make_text(2 + i % 3, i) + "\n" if long else "") + QUESTIONS[i % 4]
        plans.append({"content": content, "stream": rng.random() < 0.6,
                      "leave": rng.random() < 0.2, "max_tokens": rng.choice([8, 24, 48])})

    async def one(session, plan) -> dict:
        t0 = time.monotonic()
        payload = body(plan["content"], plan["max_tokens"], plan["stream"])
        try:
            if plan["stream"]:
                status, events, done = await stream_events(
                    session, router, payload, leave_after=3 if plan["leave"] else None)
                result = {"status": status, "events": events, "done": done}
            else:
                async with session.post(router + "/v1/chat/completions",
                                        json={k: v for k, v in payload.items()
                                              if v is not None}) as resp:
                    result = {"status": resp.status, "json": await resp.json()}
        except aiohttp.ClientError as err:
            result = {"status": None, "exception": repr(err)}
        return result | {"plan": plan, "elapsed": time.monotonic() - t0}

    async def chaos() -> None:
        await asyncio.sleep(1.0)
        procs["prefill"].proc.send_signal(signal.SIGSTOP)  # its transfers stall
        await asyncio.sleep(3.0)
        procs["prefill"].proc.send_signal(signal.SIGCONT)
        for _ in range(100):  # kill a decode pod that is busy
            busy = [n for n in ("decode-a", "decode-b") if running(url[n])]
            if busy:
                procs[busy[0]].proc.send_signal(signal.SIGKILL)
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.5)
        procs["prefill"].proc.send_signal(signal.SIGKILL)  # leases held die with it
        await asyncio.to_thread(restart, pods, "prefill")

    async def run_all():
        timeout = aiohttp.ClientTimeout(total=DEADLINE_S + 10)
        async with aiohttp.ClientSession(timeout=timeout) as s:
            sem = asyncio.Semaphore(6)

            async def limited(plan):
                async with sem:
                    await asyncio.sleep(rng.random() * 0.3)
                    return await one(s, plan)
            chaos_task = asyncio.create_task(chaos())
            results = await asyncio.gather(*(limited(p) for p in plans))
            await chaos_task
            return results

    results = asyncio.run(run_all())
    for r in results:
        plan = r["plan"]
        assert r["elapsed"] < DEADLINE_S, r
        assert r["status"] is not None, r  # the router always answered
        if plan["stream"] and plan["leave"]:
            continue  # the client left; the pods must still free its blocks (below)
        if r["status"] != 200:
            err = (r.get("json") or r["events"][0])["error"]
            assert err["message"] and err["type"], r  # a clear error
            continue
        if plan["stream"]:
            in_band = [e["error"] for e in r["events"] if "error" in e]
            assert r["done"], r
            if in_band:
                assert in_band[0]["message"], r
                continue
            finishes = [c["finish_reason"] for e in r["events"] for c in e["choices"]
                        if c["finish_reason"]]
        else:
            finishes = [c["finish_reason"] for c in r["json"]["choices"]]
        assert finishes and all(f in ("stop", "length") for f in finishes), r
    complete = sum(1 for r in results if r["status"] == 200 and not r["plan"]["leave"])
    assert complete >= len(results) // 2, "most requests should survive the failures"
    fallbacks = http_get(router + "/metrics")[1].decode()
    assert 'baton:fallbacks_total{reason="' in fallbacks
    # The killed decode pod restarts; then every pod holds zero blocks and zero leases.
    for name in ("decode-a", "decode-b"):
        if procs[name].proc.poll() is not None:
            restart(pods, name)
    wait_for(lambda: http_get(router + "/workers")[1].count(b'"healthy": true') == 3, 10,
             "the router to see every pod again")
    assert_idle(list(url.values()), timeout=20)
    assert metric_value(url["prefill"], "baton:kv_leases_held") == 0
