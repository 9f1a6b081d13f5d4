"""Building a request's `RoutingContext`: its prompt's block hashes, the index that says who
holds them, and its prompt's token count.

Exact, when the registry says what the workers hold (`prefix.BlockIndex`) and this model's
tokenizer is here (`router.tokens`): the engine's own token ids and block hashes. Else the
router's estimate: the approximate index of what it sent (`prefix.ApproximatePrefixIndex`)
and ~4 characters a token.
"""

from __future__ import annotations

import asyncio

from baton.common.hashing import ROOT_HASH
from baton.common.internal import OpenAIBody
from baton.common.protocol import ChatCompletionRequest, CompletionRequest
from baton.router.discovery import Discovery
from baton.router.prefix import (
    TOKENS_PER_BLOCK,
    ApproximatePrefixIndex,
    BlockIndex,
    block_hashes,
    prompt_of,
)
from baton.router.scheduling.context import RoutingContext
from baton.router.tokens import TokenizerCache

INLINE_TOKENIZE_BYTES = 4096  # bodies up to ~1,000 tokens are tokenized on the event loop


def splittable(api: str, req: OpenAIBody) -> bool:
    """Whether a prefill pod can compute this request's prompt for a decode pod: one
    sample, and no prompt logprobs (completions' `echo` with `logprobs`: the decode pod
    that pulls the KV never sees the prompt's logits)."""
    if req.n != 1:
        return False
    if api == "completions":
        assert isinstance(req, CompletionRequest)  # the body of its api
        return not (req.echo and req.logprobs is not None)
    return True


def estimate_prompt_tokens(api: str, req: OpenAIBody) -> int | None:
    """A rough token count for the decision (~4 characters a token, plus the chat
    template's few tokens a message), or None when the request cannot be split."""
    prompt = prompt_of(api, req)
    if not splittable(api, req) or prompt is None:
        return None
    if not isinstance(prompt, str):
        return len(prompt)
    estimate = len(prompt) // 4
    if api == "chat":
        assert isinstance(req, ChatCompletionRequest)  # the body of its api
        estimate += 8 * len(req.messages)
    return estimate


class ContextBuilder:
    """Owns the approximate index; reads the exact one (None without the registry)."""

    def __init__(self, discovery: Discovery, exact: BlockIndex | None,
                 tokenizers: TokenizerCache) -> None:
        self.discovery = discovery
        self.exact = exact
        self.tokenizers = tokenizers
        self.approximate = ApproximatePrefixIndex()

    async def build(self, api: str, req: OpenAIBody, body_bytes: int = 0,
                    session: str | None = None) -> RoutingContext:
        """The routing context of a parsed request. Long prompts are tokenized on a thread
        (~3 ms for 2,000 tokens; the tokenizer releases the GIL), short ones inline; a
        model whose tokenizer is not fetched yet starts its fetch and is estimated."""
        if self.exact is not None:
            ctx = await self._exact(api, req, body_bytes, session)
            if ctx is not None:
                return ctx
        prompt = prompt_of(api, req)
        root = self.hash_root(req.model)
        return RoutingContext(model=req.model, prefix_index=self.approximate,
                              prefix_hashes=block_hashes(prompt, root) if prompt else (),
                              block_tokens=TOKENS_PER_BLOCK,
                              prompt_tokens=estimate_prompt_tokens(api, req), session=session)

    def hash_root(self, model: str) -> int:
        """Where `model`'s block hashes chain from: a LoRA adapter's root as a worker serving
        it reports it, else the base model's (ROOT_HASH)."""
        for e in self.discovery.all():
            root = e.lora_roots.get(model)
            if root is not None and e.healthy:
                return int(root, 16)
        return ROOT_HASH

    async def _exact(self, api: str, req: OpenAIBody, body_bytes: int,
                     session: str | None) -> RoutingContext | None:
        tok = self.tokenizers.get(req.model, [e.url for e in self.discovery.all()
                                              if e.healthy and e.serves(req.model)])
        if tok is None:
            return None
        ids = (await asyncio.to_thread(tok.prompt_ids, api, req)
               if body_bytes > INLINE_TOKENIZE_BYTES else tok.prompt_ids(api, req))
        if ids is None:
            return None
        root = self.hash_root(req.model)
        return RoutingContext(model=req.model, prefix_index=self.exact,
                              prefix_hashes=tok.block_hashes(ids, root),
                              block_tokens=tok.block_size,
                              prompt_tokens=len(ids) if splittable(api, req) else None,
                              prompt_token_ids=tuple(ids) if splittable(api, req) else None,
                              session=session)
