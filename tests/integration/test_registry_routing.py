"""The router finds its workers in a real Redis (valkey-server) and routes by the KV blocks
they report: router + 1 prefill + 2 decode pods, all registered, no static list. Exact
prefix routing, the disaggregation decision on exact counts, session affinity, a decode
pod killed, and Redis restarted empty under traffic; two routers sharing the Redis continue
one /v1/responses conversation."""

from __future__ import annotations

import json
import signal
import time
import urllib.request

import pytest

from tests.conftest import make_text
from tests.integration.conftest import (
    MODEL,
    WORKER_FLAGS,
    Proc,
    assert_idle,
    free_port_run,
    http_get,
    metric_value,
    post_json,
    wait_for,
)
from tests.redis_server import RedisServer, server_binary

pytestmark = pytest.mark.slow
FLAGS = [*WORKER_FLAGS, "--num-threads", "1"]


@pytest.fixture(scope="module")
def reg_cluster(tmp_path_factory):
    logs = tmp_path_factory.mktemp("registry")
    redis = RedisServer(server_binary(), logs / "redis.log").start()
    port = free_port_run(4)
    urls = [f"http://127.0.0.1:{port + i}" for i in range(4)]
    roles = {urls[1]: "prefill", urls[2]: "decode", urls[3]: "decode"}
    procs = {url: Proc(["serve", "--port", url.rsplit(":", 1)[1], "--role", role,
                        "--registry", redis.url, *FLAGS], logs / f"{role}-{url[-5:]}.log")
             for url, role in roles.items()}
    procs[urls[0]] = Proc(["router", "--port", str(port), "--registry", redis.url,
                           "--disagg-min-prefill-tokens", "64"], logs / "router.log")
    for p in procs.values():
        p.start()
    for url, p in procs.items():
        p.wait_ready(url, timeout=300)
    wait_for(lambda: len(view(urls[0])["workers"]) == 3, 10, "3 registered workers")
    yield {"router": urls[0], "prefill": urls[1], "decode": urls[2:], "redis": redis,
           "procs": procs}
    for p in procs.values():
        p.stop() if p.proc.poll() is None else None
    redis.stop()


def view(router: str) -> dict:
    import json

    status, body = http_get(router + "/workers")
    assert status == 200
    return json.loads(body)


def registered(redis_server) -> set[str]:
    """The URLs of the worker records in the registry's Redis."""
    import json

    import redis

    client = redis.Redis.from_url(redis_server.url, socket_timeout=2)
    try:
        keys = list(client.scan_iter("baton:worker:*"))
        return {json.loads(raw)["url"] for raw in client.mget(keys) if raw} if keys else set()
    finally:
        client.close()


def cached_blocks(router: str) -> dict[str, int]:
    return {w["url"]: w["cached_blocks"] for w in view(router)["workers"]}


def complete(router: str, prompt: str, **extra) -> dict:
    status, _, body = post_json(router + "/v1/completions", {
        "model": MODEL, "prompt": prompt, "max_tokens": 4, "temperature": 0, **extra})
    assert status == 200, body
    return body


def hits(url: str) -> float:
    return metric_value(url, "baton:prefix_cache_hit_tokens_total")


def finished(url: str) -> float:
    _, page = http_get(url + "/metrics")
    return sum(float(line.rsplit(" ", 1)[1]) for line in page.decode().splitlines()
               if line.startswith("baton:requests_total{"))


def test_workers_register_with_role_and_model(reg_cluster):
    v = view(reg_cluster["router"])
    assert v["source"] == "registry"
    roles = sorted((w["role"], w["model"], w["healthy"]) for w in v["workers"])
    assert roles == [("decode", MODEL, True)] * 2 + [("prefill", MODEL, True)]


def test_router_tokenizes_like_the_worker(reg_cluster, model_dir):
    import json

    from transformers import AutoTokenizer

    from baton.common.protocol import ChatCompletionRequest, CompletionRequest
    from baton.router.tokens import RouterTokenizer

    _, raw = http_get(reg_cluster["decode"][0] + "/internal/tokenizer")
    tok = RouterTokenizer(json.loads(raw))
    ref = AutoTokenizer.from_pretrained(str(model_dir))
    chats = [[{"role": "user", "content": "Hello there!"}],
             [{"role": "system", "content": "Be terse."},
              {"role": "user", "content": make_text(2)},
              {"role": "assistant", "content": "Noted."},
              {"role": "user", "content": "Ünïcödé — and emoji 🚀?"}]]
    for messages in chats:
        req = ChatCompletionRequest.model_validate({"model": MODEL, "messages": messages})
        want = ref.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                       return_dict=False)
        assert tok.prompt_ids("chat", req) == list(want)
    for text in ["The quick brown fox", make_text(3, 1), "  leading spaces\tand tabs\n"]:
        req = CompletionRequest.model_validate({"model": MODEL, "prompt": text})
        assert tok.prompt_ids("completions", req) == ref.encode(text)


def test_exact_prefix_routing_and_decision(reg_cluster):
    router, decode = reg_cluster["router"], reg_cluster["decode"]
    prefix = make_text(12)  # ~550 tokens
    complete(router, prefix + "\n\nQuestion: what is this about?")
    wait_for(lambda: MODEL in view(router)["exact_prefix_models"], 30, "the tokenizer")
    wait_for(lambda: max(cached_blocks(router)[u] for u in decode) >= 30, 10,
             "the decode pod's blocks to reach the router")
    holder = max(decode, key=lambda u: cached_blocks(router)[u])
    other = decode[1 - decode.index(holder)]
    pods = [reg_cluster["prefill"], *decode]
    before = {u: (hits(u), finished(u)) for u in pods}
    local = metric_value(router, 'baton:disagg_decisions_total{decision="local"}', 0)
    lent = metric_value(router, 'baton:peer_fetches_total{result="lent"}', 0)
    for q in ["Summarise it.", "Why does it matter?", "Name one fact.", "Translate it."]:
        complete(router, prefix + "\n\n" + q)
    # Each ran on the holder, or on the other pod: pulling the prefix from a pod holding it
    # (peer fetch: the router weighs the pull against the holder's load, and the lender
    # runs a one-block prefill), or, once it pulled it, from its own cache. Either way no
    # request prefilled the shared prefix again.
    moved = metric_value(router, 'baton:peer_fetches_total{result="lent"}', 0) - lent
    assert finished(other) - before[other][1] >= moved
    assert sum(finished(u) - before[u][1] for u in pods) == 4 + moved  # + the lends
    assert sum(hits(u) - before[u][0] for u in pods) >= 4 * 500
    # Only the short uncached tail was left: prefilled on the decode pod, not sent away.
    assert metric_value(router, 'baton:disagg_decisions_total{decision="local"}') == local + 4


def test_session_affinity(reg_cluster):
    router, decode = reg_cluster["router"], reg_cluster["decode"]
    for user in ["alice", "bob", "carol"]:
        before = {u: finished(u) for u in decode}
        for i in range(3):
            complete(router, f"Hi {i}", user=user)  # shorter than one block: no prefix
        moved = sorted(finished(u) - before[u] for u in decode)
        assert moved == [0, 3], f"{user}'s requests were spread: {moved}"


def test_two_routers_sharing_redis_continue_one_conversation(reg_cluster, tmp_path):
    """/v1/responses stored in the registry's Redis: a turn answered by one router (its
    prompt prefilled remotely) is continued, read and deleted through another."""
    a = reg_cluster["router"]
    port = free_port_run(1)
    b = f"http://127.0.0.1:{port}"
    other = Proc(["router", "--port", str(port), "--registry", reg_cluster["redis"].url,
                  "--disagg-min-prefill-tokens", "64"], tmp_path / "router-b.log").start()
    try:
        other.wait_ready(b, timeout=30)
        text = make_text(3, 1) + "\n\nSummarise this in one line."
        greedy = {"model": MODEL, "temperature": 0, "max_output_tokens": 12}
        status, _, first = post_json(a + "/v1/responses", {"input": text, **greedy})
        assert status == 200, first
        status, _, second = post_json(b + "/v1/responses", {
            "input": "Shorter, please.", "previous_response_id": first["id"], **greedy})
        assert status == 200, second
        said = first["output"][0]["content"][0]["text"]
        status, _, chat = post_json(a + "/v1/chat/completions", {
            "model": MODEL, "temperature": 0, "max_tokens": 12, "messages": [
                {"role": "user", "content": text}, {"role": "assistant", "content": said},
                {"role": "user", "content": "Shorter, please."}]})
        assert second["output"][0]["content"][0]["text"] == \
            chat["choices"][0]["message"]["content"]
        status, got = http_get(b + f"/v1/responses/{first['id']}")
        assert status == 200 and json.loads(got)["output"] == first["output"]
        req = urllib.request.Request(b + f"/v1/responses/{first['id']}", method="DELETE")
        with urllib.request.urlopen(req, timeout=10) as resp:
            assert resp.status == 200
        assert http_get(a + f"/v1/responses/{first['id']}")[0] == 404
    finally:
        assert other.stop()


def exact_index(router: str) -> None:
    """Until the router counts prompts exactly (its first request for the model fetches
    the tokenizer)."""
    complete(router, "Hello")
    wait_for(lambda: MODEL in view(router)["exact_prefix_models"], 30, "the tokenizer")


def session_on(pod: str, pods: list[str]) -> str:
    """A session key the router's rendezvous hashing gives `pod` of `pods`."""
    from types import SimpleNamespace

    from baton.router.scheduling.context import RoutingContext
    from baton.router.scheduling.scorers import session

    ups = [SimpleNamespace(url=u) for u in pods]
    return next(key for key in (f"user-{i}" for i in range(1000))
                if session(ups, RoutingContext(session=key))[pods.index(pod)] == 1.0)


def test_a_conversation_that_moves_pulls_its_prefix_from_the_pod_it_left(reg_cluster,
                                                                         reference_llm):
    """Turn 1 on one decode pod, turn 2 (its session now on the other pod) pulls the
    blocks the first pod holds instead of prefilling them: exact text, the tokens counted as
    cached, the first decode pod the lender, no lease or block left behind."""
    from baton import SamplingParams

    router, decode = reg_cluster["router"], reg_cluster["decode"]
    exact_index(router)
    a, b = decode
    pods = [reg_cluster["prefill"], a, b]
    messages = [{"role": "user", "content": "A moving conversation.\n" + make_text(9, 5)
                 + "\n\nWhat is it about?"}]
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 12}
    status, _, first = post_json(router + "/v1/chat/completions",
                                 {**greedy, "messages": messages, "user": session_on(a, decode)})
    assert status == 200, first
    wait_for(lambda: cached_blocks(router)[a] >= 20, 10, "turn 1's blocks at the router")
    held = cached_blocks(router)[a]
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": "Shorter, please."}]
    # Turn 2 asked on A first (a client's retry, say): A now holds more of it than the
    # prefill pod, which prefilled turn 1 only, so A is the one to lend it.
    status, _, _ = post_json(router + "/v1/chat/completions", {
        **greedy, "max_tokens": 1, "messages": messages, "user": session_on(a, decode)})
    assert status == 200
    wait_for(lambda: cached_blocks(router)[a] > held, 10, "turn 2's blocks at the router")
    lent = metric_value(router, 'baton:peer_fetches_total{result="lent"}', 0)
    pulled = metric_value(b, "baton:kv_transfer_bytes_total", 0)
    served = {u: finished(u) for u in pods}
    status, _, second = post_json(router + "/v1/chat/completions",
                                  {**greedy, "messages": messages, "user": session_on(b, decode)})
    assert status == 200, second
    assert metric_value(router, 'baton:peer_fetches_total{result="lent"}') == lent + 1
    assert metric_value(b, "baton:kv_transfer_bytes_total") > pulled
    assert {u: finished(u) - served[u] for u in pods} == {a: 1, b: 1, pods[0]: 0}  # A lent
    assert second["usage"]["prompt_tokens_details"]["cached_tokens"] >= 20 * 16
    want = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0].text
    assert second["choices"][0]["message"]["content"] == want
    assert_idle([reg_cluster["prefill"], *decode])  # the lease ended, its blocks free


def test_a_prefill_pod_pulls_the_prefix_a_decode_pod_holds(reg_cluster, reference_llm):
    """A conversation whose earlier turn a decode pod computed itself moves on with a new
    part long enough for a remote prefill: the prefill pod pulls the prefix from that decode
    pod, computes the rest and hands the whole prompt to the decode pod picked."""
    from baton import SamplingParams

    router, decode, prefill = reg_cluster["router"], reg_cluster["decode"], reg_cluster["prefill"]
    exact_index(router)
    a, b = decode
    greedy = {"model": MODEL, "temperature": 0, "max_tokens": 12}
    messages = [{"role": "user", "content": "Computed on a decode pod.\n" + make_text(12, 1)
                 + "\n\nWhat is it about?"}]
    status, _, first = post_json(a + "/internal/generate",  # computed on A, not prefilled
                                 {"api": "chat", "request": {**greedy, "messages": messages}})
    assert status == 200, first
    time.sleep(2.0)  # A's block events reach the router (its pool is full: the count stays)
    messages += [{"role": "assistant", "content": first["choices"][0]["message"]["content"]},
                 {"role": "user", "content": make_text(2, 13) + "\n\nAnd this part?"}]
    lent = metric_value(router, 'baton:peer_fetches_total{result="lent"}', 0)
    remote = metric_value(router, 'baton:disagg_decisions_total{decision="remote"}', 0)
    pulled = metric_value(prefill, "baton:kv_transfer_bytes_total", 0)
    status, _, second = post_json(router + "/v1/chat/completions",
                                  {**greedy, "messages": messages, "user": session_on(b, decode)})
    assert status == 200, second
    assert metric_value(router, 'baton:peer_fetches_total{result="lent"}') == lent + 1
    assert metric_value(router, 'baton:disagg_decisions_total{decision="remote"}') == remote + 1
    assert metric_value(prefill, "baton:kv_transfer_bytes_total") > pulled  # from A
    want = reference_llm.chat(messages, SamplingParams(temperature=0, max_tokens=12),
                              use_tqdm=False)[0].outputs[0].text
    assert second["choices"][0]["message"]["content"] == want
    assert_idle([prefill, *decode])


def test_a_killed_decode_pod_leaves_routing(reg_cluster):
    router, decode = reg_cluster["router"], reg_cluster["decode"]
    victim = reg_cluster["procs"][decode[1]]
    victim.proc.send_signal(signal.SIGKILL)
    victim.proc.wait(10)
    wait_for(lambda: decode[1] not in cached_blocks(router), 5, "the dead pod to expire")
    for i in range(3):
        complete(router, f"Still serving {i}?")


def test_redis_restart_under_traffic(reg_cluster):
    router, decode, redis = reg_cluster["router"], reg_cluster["decode"], reg_cluster["redis"]
    # The one decode pod left pulls this prompt's KV (min_tokens: it does not end at once).
    complete(router, make_text(6, 2) + "\n\nWhat next?", min_tokens=4)
    wait_for(lambda: cached_blocks(router)[decode[0]] >= 10, 10, "its blocks at the router")
    held = cached_blocks(router)[decode[0]]
    redis.stop()
    for i in range(3):  # routing goes on from the router's last view
        complete(router, make_text(3, i) + "\n\nAnd now?")
    assert decode[0] in cached_blocks(router)
    redis.start()  # empty: workers register again and resend what they hold
    # The router's last view already shows them: first wait for both records in the new
    # Redis, so what the router shows next is what it caught up from there.
    wait_for(lambda: {reg_cluster["prefill"], decode[0]} <= registered(redis), 15,
             "both workers registered again")
    wait_for(lambda: cached_blocks(router).get(decode[0], 0) >= held
             and sorted(w["role"] for w in view(router)["workers"]) == ["decode", "prefill"],
             15, "the decode pod's blocks after the restart")
    complete(router, "After the restart")
    assert_idle([reg_cluster["prefill"], decode[0]])  # no lease or block left behind

