"""What a request must satisfy before an engine takes it, beyond what `SamplingParams`
checks alone: its prompt and token ids against this model's vocabulary and context, its KV
handoff against this engine's transport. Each raises `InvalidRequestError` (a 4xx)."""

from __future__ import annotations

from typing import Protocol

from baton.common.sampling_params import SamplingParams
from baton.engine import tokenizer as tok
from baton.engine.context_window import check_context
from baton.engine.errors import InvalidRequestError
from baton.engine.kv_connector.handoff import (
    KVHandoff,
    PullKV,
    check_peer_prefix,
    peer_prefix,
)


class PoolShape(Protocol):
    """What the checks read of a KV pool (`KVCacheManager`, or a front's `KVShape`)."""

    @property
    def num_blocks(self) -> int: ...

    @property
    def block_size(self) -> int: ...

    def blocks_for(self, num_tokens: int) -> int: ...


def check_prompt(prompt_token_ids: list[int], vocab: int, max_model_len: int,
                 kv: PoolShape) -> None:
    n = len(prompt_token_ids)
    if n == 0:
        raise InvalidRequestError("the prompt is empty")
    bad = [t for t in prompt_token_ids if not (isinstance(t, int) and 0 <= t < vocab)]
    if bad:
        raise InvalidRequestError(f"prompt token ids {bad[:5]} are outside [0, {vocab})")
    check_context(n, None, max_model_len)
    if kv.blocks_for(n + 1) > kv.num_blocks:
        raise InvalidRequestError(
            f"the prompt needs {kv.blocks_for(n + 1)} KV blocks but the pool has "
            f"{kv.num_blocks}; raise num_kv_blocks or shorten the prompt")


def check_params(params: SamplingParams, vocab: int, has_tokenizer: bool) -> None:
    """Token ids against this vocabulary; stop strings need a tokenizer."""
    if params.stop and not has_tokenizer:  # matched in the text, which it has not
        raise InvalidRequestError(tok.NO_TOKENIZER_STOP, param="stop")
    for name, ids in (("stop_token_ids", params.stop_token_ids),
                      ("logit_bias", params.logit_bias or ())):
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise InvalidRequestError(f"{name} token ids {bad[:5]} are outside this "
                                      f"model's vocabulary [0, {vocab})", param=name)


def check_handoff(handoff: KVHandoff, num_prompt: int, params: SamplingParams,
                  has_connector: bool, kv: PoolShape, vocab: int) -> None:
    if not has_connector:
        raise InvalidRequestError("this engine has no KV transport (kv_transport=None)")
    peer = peer_prefix(handoff)
    if isinstance(handoff, PullKV) or peer is not None:
        if params.prompt_logprobs is not None:  # only the engine computing it sees the prompt
            raise InvalidRequestError("prompt_logprobs come from the engine that computes "
                                      "the prompt, not one pulling its KV",
                                      param="prompt_logprobs")
        try:
            if isinstance(handoff, PullKV):
                handoff.check(num_prompt, kv.blocks_for(num_prompt), vocab)
            elif peer is not None:
                check_peer_prefix(peer, num_prompt, kv.block_size)
        except ValueError as err:
            raise InvalidRequestError(str(err)) from None
