"""An engine's context window (`max_model_len`): prompt + output tokens of one sequence.

Two limits bound it: the model's own (`max_position_embeddings`, extended by its rope
scaling: `model_context_limit`, checked before the weights load) and the KV pool's (one
sequence can use at most every block): `fit_kv_pool`, once the pool is sized.
A length the user asked for that does not fit is a ValueError naming both numbers; the
model's default is lowered to what fits, with a warning (vLLM raises there; a pool sized
for a long context is often not what a small deployment wants).
"""

from __future__ import annotations

import logging
from pathlib import Path

from baton.engine.config import EngineConfig
from baton.engine.errors import ContextLengthError

log = logging.getLogger(__name__)


def check_context(prompt_tokens: int, max_tokens: int | None, max_model_len: int) -> None:
    """Raise ContextLengthError when a prompt of `prompt_tokens` leaves no room for one output
    token, or for `max_tokens` of them when given (the error's `param` is then
    `max_tokens`). The one check of a request's length: the engine's and the worker's."""
    if prompt_tokens >= max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens, but the prompt "
            f"has {prompt_tokens} tokens (and at least one output token is needed)")
    if max_tokens is not None and prompt_tokens + max_tokens > max_model_len:
        raise ContextLengthError(
            f"this model's maximum context length is {max_model_len} tokens; {prompt_tokens} "
            f"prompt tokens + max_tokens {max_tokens} exceed it", param="max_tokens")


def fit_kv_pool(max_model_len: int, config: EngineConfig, num_blocks: int) -> int:
    """`max_model_len` capped by a pool of `num_blocks` blocks of `config.cache.block_size`
    tokens: when `config.checkpoint.max_model_len` asked for it, a ValueError if it does not fit; when
    it is the model's default, lowered to what fits, with a warning."""
    block_size, requested = config.cache.block_size, config.checkpoint.max_model_len is not None
    capacity = num_blocks * block_size
    if max_model_len <= capacity:
        return max_model_len
    if requested:
        raise ValueError(
            f"EngineConfig.max_model_len={max_model_len} does not fit the KV pool: one "
            f"sequence of that length needs {-(-max_model_len // block_size)} blocks of "
            f"{block_size} tokens, the pool holds {num_blocks} ({capacity} tokens). Lower "
            f"max_model_len to at most {capacity}, or give the pool more memory "
            "(--gpu-memory-utilization on CUDA, --kv-cache-gib, or --num-kv-blocks)")
    log.warning("the model's context length %d does not fit the KV pool (%d blocks of %d "
                "tokens = %d tokens): max_model_len lowered to %d; give the pool more "
                "memory (--gpu-memory-utilization on CUDA, --kv-cache-gib or "
                "--num-kv-blocks) to serve the full length",
                max_model_len, num_blocks, block_size, capacity, capacity)
    return capacity


def model_context_limit(config: EngineConfig, model_dir: Path) -> int:
    """The context window the model allows (its rope scaling extends it: yarn, dynamic),
    or the `max_model_len` asked for when that fits in it (else a ValueError)."""
    from baton.engine.models.config import ModelConfig
    from baton.engine.models.rope import context_limit

    limit = context_limit(ModelConfig.from_dir(model_dir))
    asked = config.checkpoint.max_model_len
    if asked is None:
        return limit
    if asked > limit:
        raise ValueError(f"EngineConfig.max_model_len={asked} exceeds "
                         f"the model's context length {limit} (max_position_embeddings, "
                         f"extended by its rope scaling)")
    return asked
