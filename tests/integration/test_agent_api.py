"""The agent-facing API end to end with the real `openai` client and the real model, through
a disaggregated cluster (`baton up --prefill 1 --decode 2`, every prompt prefilled remotely)
and, for the colocated answers, a decode worker called directly (it prefills locally):
forced tool calls whose arguments validate, JSON schemas that always validate when sampled,
a tool round trip through the chat template, logit_bias, the first token's logprob in P/D
equal to colocated, and a constrained stream that survives its decode pod's death."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
import urllib.error
import urllib.request

import aiohttp
import jsonschema
import pytest

from tests.integration.conftest import MODEL, Proc, free_port_run, http_get, wait_for

pytestmark = pytest.mark.slow
FLAGS = ["--dtype", "float32", "--num-kv-blocks", "384"]

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 24},
        "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The time in a time zone.",
    "parameters": {"type": "object", "properties": {
        "zone": {"type": "string", "maxLength": 24}}, "required": ["zone"],
        "additionalProperties": False}}}
PERSON = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 20},
    "age": {"type": "integer", "minimum": 0, "maximum": 120},
    "role": {"type": "string", "enum": ["admin", "user", "guest"]},
    "tags": {"type": "array", "items": {"type": "string", "maxLength": 10}, "maxItems": 3},
    "address": {"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 20},
        "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
        "required": ["city", "zip"], "additionalProperties": False}},
    "required": ["name", "age", "role", "address"], "additionalProperties": False}
ASK = "What is the weather in Paris? Use the tool."


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    port = free_port_run(4)
    logs = tmp_path_factory.mktemp("agent-api")
    up = Proc(["up", "--port", str(port), "--prefill", "1", "--decode", "2",
               "--disagg-min-prefill-tokens", "0", *FLAGS], logs / "up.log").start()
    urls = {"router": f"http://127.0.0.1:{port}",
            "decode": [f"http://127.0.0.1:{port + 2}", f"http://127.0.0.1:{port + 3}"]}
    up.wait_ready(urls["router"], timeout=300)
    for u in urls["decode"]:
        up.wait_ready(u, timeout=30)
    yield urls | {"up": up}
    assert up.stop(), (logs / "up.log").read_text()[-3000:]


def client(base: str):
    from openai import OpenAI

    return OpenAI(base_url=base + "/v1", api_key="unused", max_retries=0, timeout=120)


def _arguments(call) -> dict:
    return json.loads(call.function.arguments)


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("choice", ["required", "named"])
def test_a_forced_tool_call_validates(cluster, choice, stream):
    tool_choice = "required" if choice == "required" else {
        "type": "function", "function": {"name": "get_weather"}}
    c = client(cluster["router"])
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": ASK}],
                  tools=[WEATHER, TIME], tool_choice=tool_choice, max_tokens=120,
                  temperature=0)
    if stream:
        calls: dict[int, dict] = {}
        finish = None
        for chunk in c.chat.completions.create(stream=True, **kwargs):
            for ch in chunk.choices:
                for d in ch.delta.tool_calls or ():
                    entry = calls.setdefault(d.index, {"id": d.id, "name": "", "args": ""})
                    if d.function and d.function.name:
                        entry["name"] += d.function.name
                    if d.function and d.function.arguments:
                        entry["args"] += d.function.arguments
                finish = ch.finish_reason or finish
        got = [(e["name"], json.loads(e["args"])) for e in calls.values()]
        assert all(e["id"] for e in calls.values())
    else:
        answer = c.chat.completions.create(**kwargs)
        msg, finish = answer.choices[0].message, answer.choices[0].finish_reason
        got = [(t.function.name, _arguments(t)) for t in msg.tool_calls]
        assert all(t.id and t.type == "function" for t in msg.tool_calls)
    assert finish in ("tool_calls", "stop") if choice == "named" else finish == "tool_calls"
    assert got, "no tool call"
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for name, args in got:
        assert name in schemas if choice == "required" else name == "get_weather"
        jsonschema.validate(args, schemas[name])


def test_json_schema_always_validates_when_sampled(cluster):
    c = client(cluster["router"])
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON,
                                                  "strict": True}}
    for seed in range(10):
        answer = c.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
            response_format=fmt, temperature=1.0, seed=seed, max_tokens=300)
        choice = answer.choices[0]
        assert choice.finish_reason == "stop", (seed, choice.message.content)
        jsonschema.validate(json.loads(choice.message.content), PERSON)


def test_json_object_parses(cluster):
    answer = client(cluster["router"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"}, temperature=0, max_tokens=200)
    assert isinstance(json.loads(answer.choices[0].message.content), dict)


def test_a_tool_round_trip_renders_through_the_template(cluster):
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": None, "tool_calls": [{
            "id": "call_1", "type": "function",
            "function": {"name": "get_weather",
                         "arguments": json.dumps({"city": "Paris", "unit": "celsius"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "18 degrees and sunny"},
    ]
    answer = client(cluster["router"]).chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], max_tokens=24, temperature=0)
    assert answer.choices[0].message.content
    assert answer.usage.prompt_tokens > 30  # the tool call and its result are in the prompt


def test_logit_bias_forces_and_bans(cluster):
    c = client(cluster["router"])
    base = dict(model=MODEL, messages=[{"role": "user", "content": "Say something."}],
                temperature=0, max_tokens=4, logprobs=True)
    plain = c.chat.completions.create(**base)
    first = plain.choices[0].logprobs.content[0]
    banned = _token_id(cluster, first.token)
    answer = c.chat.completions.create(**base, logit_bias={str(banned): -100})
    assert answer.choices[0].logprobs.content[0].token != first.token
    forced = _token_id(cluster, " banana")
    answer = c.chat.completions.create(**base, logit_bias={str(forced): 100})
    assert [t.token for t in answer.choices[0].logprobs.content] == [" banana"] * 4


def _token_id(cluster, text: str) -> int:
    req = urllib.request.Request(cluster["router"] + "/tokenize", data=json.dumps(
        {"model": MODEL, "prompt": text, "add_special_tokens": False}).encode(),
        headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=10) as r:
        tokens = json.load(r)["tokens"]
    assert len(tokens) == 1, (text, tokens)
    return tokens[0]


def test_the_first_tokens_logprob_in_pd_equals_colocated(cluster):
    kwargs = dict(model=MODEL, messages=[{"role": "user", "content": "Name a color."}],
                  temperature=0, max_tokens=3, logprobs=True, top_logprobs=3)
    remote = client(cluster["router"]).chat.completions.create(**kwargs)
    local = client(cluster["decode"][0]).chat.completions.create(**kwargs)
    r, loc = remote.choices[0].logprobs.content, local.choices[0].logprobs.content
    assert [t.token for t in r] == [t.token for t in loc]
    for a, b in zip(r, loc):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]


def test_a_constrained_stream_survives_its_decode_pods_death(cluster):
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}}
    killed: list[str] = []
    text = ""
    stream = client(cluster["router"]).chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format=fmt, temperature=0, max_tokens=300, stream=True)
    for n, chunk in enumerate(stream):
        for ch in chunk.choices:
            text += ch.delta.content or ""
        if n == 6 and not killed:
            for url in cluster["decode"]:
                load = json.loads(http_get(url + "/load", 2)[1] or b"{}")
                if load.get("running"):
                    _kill_worker_on(url)
                    killed.append(url)
                    break
    assert killed, "no decode pod was running the stream"
    jsonschema.validate(json.loads(text), PERSON)
    # `baton up` restarts the killed worker
    wait_for(lambda: http_get(killed[0] + "/ready", 2)[0] == 200, 120, "the restart")


def _kill_worker_on(url: str) -> None:
    """SIGKILL the `baton serve` child of `baton up` listening at `url`."""
    port = url.rsplit(":", 1)[1]
    out = subprocess.run(["pgrep", "-f", f"baton.cli serve --host 127.0.0.1 --port {port} "],
                         capture_output=True, text=True).stdout.split()
    assert out, f"no worker process on port {port}"
    os.kill(int(out[0]), signal.SIGKILL)
    time.sleep(0.1)


def test_priority_reorders_a_saturated_queue(tmp_path):
    """One sequence at a time: of the requests waiting behind a running one, the one sent
    last with the best (lowest) priority runs first."""
    port = free_port_run(1)
    url = f"http://127.0.0.1:{port}"
    worker = Proc(["serve", "--port", str(port), "--scheduling-policy", "priority",
                   "--max-num-seqs", "1", *FLAGS], tmp_path / "worker.log").start()
    try:
        worker.wait_ready(url)
        order: list[str] = []

        async def one(session, name: str, priority: int, delay: float,
                      tokens: int = 8) -> None:
            await asyncio.sleep(delay)
            body = {"model": MODEL, "prompt": "Count: 1, 2, 3,", "max_tokens": tokens,
                    "ignore_eos": True, "min_tokens": tokens, "priority": priority}
            async with session.post(url + "/v1/completions", json=body) as r:
                assert r.status == 200, await r.text()
                await r.read()
            order.append(name)

        async def go():
            async with aiohttp.ClientSession() as s:
                await asyncio.gather(one(s, "running", 0, 0.0, tokens=300),
                                     *[one(s, f"low-{i}", 10, 0.3) for i in range(3)],
                                     one(s, "urgent", -5, 0.6))

        asyncio.run(go())
        assert order[0] == "running" and order[1] == "urgent", order
        code, raw = http_post_json(url + "/v1/completions",
                                   {"model": MODEL, "prompt": "x", "priority": 1})
        assert code == 200, raw
    finally:
        worker.stop()


def http_post_json(url: str, body: dict) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()
