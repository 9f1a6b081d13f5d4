"""A request's routing context: the engine's token ids and block hashes when the registry
and the model's tokenizer are there, the router's estimate otherwise."""

from __future__ import annotations

import asyncio
import json

from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.router.discovery import StaticDiscovery
from baton.router.prefix import BlockIndex, block_hashes
from baton.router.routing_context import ContextBuilder


class FakeTokenizer:
    block_size = 4

    def prompt_ids(self, api: str, req) -> list[int] | None:
        prompts = req.prompts() if api == "completions" else ["chat"]
        return list(range(10)) if len(prompts) == 1 else None

    def block_hashes(self, ids: list[int], root: int = 0) -> list[str]:
        return [f"{i + root:x}" for i in range(len(ids) // self.block_size)]


class FakeTokenizers:
    def __init__(self, tok: FakeTokenizer | None) -> None:
        self.tok, self.asked = tok, []

    def get(self, model: str, urls: list[str]) -> FakeTokenizer | None:
        self.asked.append(model)
        return self.tok


def chat(text: str, **extra):
    body = {"model": "m", "messages": [{"role": "user", "content": text}]} | extra
    return parse_request(ChatCompletionRequest, json.dumps(body).encode())


def completion(prompt, **extra):
    body = {"model": "m", "prompt": prompt} | extra
    return parse_request(CompletionRequest, json.dumps(body).encode())


def build(builder: ContextBuilder, api: str, req, session: str | None = None):
    return asyncio.run(builder.build(api, req, 0, session))


def test_without_the_registry_the_router_estimates():
    builder = ContextBuilder(StaticDiscovery(["http://a"]), None, FakeTokenizers(None))
    ctx = build(builder, "chat", chat("x" * 400), session="s1")
    assert ctx.prefix_index is builder.approximate and ctx.block_tokens == 16
    prompt = "<user>" + "x" * 400  # as the router sees it
    assert ctx.prompt_tokens == len(prompt) // 4 + 8  # ~4 characters a token, 8 a message
    assert ctx.session == "s1" and ctx.model == "m"
    assert list(ctx.prefix_hashes) == block_hashes(prompt)
    assert build(builder, "chat", chat("x", n=2)).prompt_tokens is None
    assert build(builder, "completions", completion([1, 2, 3])).prompt_tokens == 3
    assert build(builder, "completions", completion(["a", "b"])).prefix_hashes == ()


def test_with_the_registry_and_a_tokenizer_the_context_is_exact():
    exact = BlockIndex()
    tokenizers = FakeTokenizers(FakeTokenizer())
    builder = ContextBuilder(StaticDiscovery(["http://a"]), exact, tokenizers)
    ctx = build(builder, "completions", completion("a b c"))
    assert ctx.prefix_index is exact and ctx.block_tokens == 4 and ctx.prompt_tokens == 10
    assert list(ctx.prefix_hashes) == ["0", "1"]
    assert build(builder, "completions", completion("a", n=2)).prompt_tokens is None
    # Several prompts: no engine ids, so the estimate.
    assert build(builder, "completions", completion(["a", "b"])).prefix_index \
        is builder.approximate
    tokenizers.tok = None  # not fetched yet: estimated meanwhile
    assert build(builder, "chat", chat("hi")).prefix_index is builder.approximate
