"""Prompts as the engine's token ids, in the router, without the model or torch.

For exact prefix-cache routing the router hashes a prompt's KV blocks the way the engine
does (`common.hashing`), which needs the engine's token ids. A worker hands out its
tokenizer's JSON and chat template (`GET /internal/tokenizer`, ~1.5 MB, once per model);
the router tokenizes with the `tokenizers` library and renders chat templates with Jinja
the way transformers does (sandboxed, `trim_blocks`, `lstrip_blocks`, `raise_exception`,
`tojson`; the messages and tools as the worker passes them), then encodes without adding
special tokens, as transformers does. Tests check
the ids equal the worker's for chat and completion prompts.

`TokenizerCache` fetches in the background when a model's first request arrives; until it
has one, the router uses its approximate index (`router.prefix`).
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from datetime import datetime
from typing import Any, NoReturn

import aiohttp

from baton.common.hashing import ROOT_HASH, hash_token_blocks
from baton.common.internal import OpenAIBody
from baton.common.prompt_bound import max_prompt_chars
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.common.registry import hash_hex

log = logging.getLogger("baton.router")


def _tojson(x: object, ensure_ascii: bool = False, indent: int | str | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    """transformers' `tojson` filter (tool schemas go through it)."""
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _raise(message: str) -> NoReturn:
    raise ValueError(message)


class RouterTokenizer:
    def __init__(self, payload: dict[str, Any]) -> None:  # /internal/tokenizer's JSON
        import tokenizers
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        self.model = payload["model"]
        self.block_size = int(payload["block_size"])
        self._tok = tokenizers.Tokenizer.from_str(payload["tokenizer_json"])
        # a text longer than this fits no context: the worker refuses it, the router does
        # not tokenise it (None: no bound, or a worker that does not say its context)
        limit = payload.get("max_model_len")
        self._max_chars = (max_prompt_chars(payload["tokenizer_json"], limit)
                           if isinstance(limit, int) and limit > 0 else None)
        self._special = dict(payload.get("special_tokens") or {})
        self._template = None
        if payload.get("chat_template"):
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[loopcontrols])
            env.filters["tojson"] = _tojson
            env.globals["raise_exception"] = _raise
            env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
            self._template = env.from_string(payload["chat_template"])

    def prompt_ids(self, api: str, req: OpenAIBody) -> list[int] | None:
        """The engine's prompt ids for a single-prompt request, or None when the router
        cannot know them (several prompts, no template, a template error)."""
        if api == "chat":
            if self._template is None:
                return None
            assert isinstance(req, ChatCompletionRequest)  # the body of its api
            try:
                text = self._template.render(
                    messages=req.template_messages(), tools=req.template_tools(),
                    add_generation_prompt=req.add_generation_prompt,
                    **{**self._special, **(req.chat_template_kwargs or {})})
            except Exception:  # noqa: BLE001 - the worker answers the error itself
                return None
            if self._too_long(text):
                return None
            return self._tok.encode(text, add_special_tokens=False).ids
        assert isinstance(req, CompletionRequest)  # the body of its api
        prompts = req.prompts()
        if len(prompts) != 1:
            return None
        p = prompts[0]
        if isinstance(p, str):
            return None if self._too_long(p) else self._tok.encode(p).ids
        return list(p)

    def _too_long(self, text: str) -> bool:
        return self._max_chars is not None and len(text) > self._max_chars

    def block_hashes(self, ids: list[int], root: int = ROOT_HASH) -> list[str]:
        """The engine's hashes of the prompt's full blocks, as the registry spells them;
        `root`: a LoRA adapter's (`LoadReport.lora_roots`), the base model's by default."""
        return [hash_hex(h) for h in hash_token_blocks(ids, self.block_size, root)]


class TokenizerCache:
    """One `RouterTokenizer` per model, fetched once from a worker that serves it."""

    def __init__(self, session: aiohttp.ClientSession, timeout_s: float = 30.0,
                 retry_after_s: float = 10.0) -> None:
        self.session = session
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._have: dict[str, RouterTokenizer] = {}
        self._fetching: dict[str, asyncio.Task[None]] = {}
        self._failed_at: dict[str, float] = {}

    def get(self, model: str, worker_urls: list[str]) -> RouterTokenizer | None:
        """The model's tokenizer if fetched; else starts a fetch (at most one at a time,
        and not again within `retry_after_s` of a failed one) and returns None."""
        tok = self._have.get(model)
        if tok is None and model not in self._fetching and worker_urls and \
                time.monotonic() - self._failed_at.get(model, -1e9) >= self.retry_after_s:
            self._fetching[model] = asyncio.create_task(self._fetch(model, worker_urls))
        return tok

    def models(self) -> list[str]:
        return sorted(self._have)

    async def _fetch(self, model: str, urls: list[str]) -> None:
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        try:
            for url in urls:
                try:
                    async with self.session.get(url + "/internal/tokenizer",
                                                timeout=timeout) as resp:
                        if resp.status != 200:
                            continue
                        payload = await resp.json()
                    tok = await asyncio.to_thread(RouterTokenizer, payload)
                except (aiohttp.ClientError, TimeoutError, ValueError, KeyError) as err:
                    log.warning("tokenizer of %s from %s: %r", model, url, err)
                    continue
                self._have[model] = tok
                log.info("exact prefix routing for %s (tokenizer from %s)", model, url)
                return
            self._failed_at[model] = time.monotonic()
        finally:
            self._fetching.pop(model, None)  # a failure is retried on a later request

    async def close(self) -> None:
        for task in list(self._fetching.values()):
            task.cancel()
        await asyncio.gather(*self._fetching.values(), return_exceptions=True)
