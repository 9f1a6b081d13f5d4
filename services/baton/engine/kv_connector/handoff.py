"""What one request asks of the KV connector: hold my KV for a puller, or pull this KV."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.internal import KVTransferParams


@dataclass(frozen=True)
class HoldKV:
    """Prefill role: when the request ends, keep its prompt's blocks under a lease and hand
    out `KVTransferParams` (on the request's final output) for a decode pod to pull them."""


@dataclass(frozen=True)
class PullKV:
    """Decode role: the prompt's KV is held by a prefill engine (`params`); pull it instead
    of computing it. `params.first_token` (sampled by the prefill) is the first output."""

    params: KVTransferParams

    def check(self, num_prompt_tokens: int, num_prompt_blocks: int, vocab_size: int) -> None:
        """Raise ValueError unless the held KV covers exactly this prompt (tokens and
        blocks of this engine's size) and the first token is in the vocabulary."""
        p = self.params
        if p.num_tokens != num_prompt_tokens or len(p.block_ids) != num_prompt_blocks:
            raise ValueError(f"kv_transfer_params cover {p.num_tokens} tokens in "
                             f"{len(p.block_ids)} blocks, the prompt has {num_prompt_tokens} "
                             f"tokens ({num_prompt_blocks} blocks)")
        if p.first_token >= vocab_size:
            raise ValueError(f"first_token {p.first_token} is outside [0, {vocab_size})")


KVHandoff = HoldKV | PullKV
