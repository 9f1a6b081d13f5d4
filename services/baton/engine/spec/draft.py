"""Draft-model speculation: a smaller model of the same tokenizer, loaded beside the target
with its own weights, kernels and paged KV (`ModelRunner` + `KVCacheManager`, no prefix
cache), guesses k tokens by k greedy steps of its own over the requests that guess.

Each target request has a shadow request in the draft: its tokens are the target's plus the
draft's latest guesses, and its KV is valid for the leading tokens that still equal the
target's. Before each proposal the shadow takes the target's tokens; the draft recomputes
from the first position that changed (a rejected guess, the target's own token), so after
a fully accepted run it only feeds the target's bonus token. A greedy draft's guess is a
point mass, so the target's verification — argmax or rejection sampling — stays exact."""

from __future__ import annotations

from pathlib import Path

from baton.common.sampling_params import SamplingParams
from baton.engine.kv_cache import KVCacheManager
from baton.engine.request import Request
from baton.engine.scheduler.output import ScheduledRequest, SchedulerOutput

GREEDY = SamplingParams(temperature=0.0, max_tokens=1 << 30)


class DraftModel:
    def __init__(self, runner, vocab_size: int) -> None:
        """`runner`: the draft's `ModelRunner`; `vocab_size`: the target's (the draft must
        share its tokenizer: ValueError otherwise)."""
        if runner.model_config.vocab_size != vocab_size:
            raise ValueError(f"speculative_config.draft_model has a vocabulary of "
                             f"{runner.model_config.vocab_size} tokens, the target "
                             f"{vocab_size}: a draft must share the target's tokenizer")
        self.runner = runner
        self.kv = KVCacheManager(runner.num_blocks, runner.block_size, enable_caching=False)
        self._shadows: dict[str, Request] = {}

    def propose(self, reqs: list[Request], room: dict[str, int]) -> dict[str, list[int]]:
        """Up to room[request id] guesses for each of `reqs` (fewer where the draft's KV
        pool is full)."""
        guesses: dict[str, list[int]] = {r.request_id: [] for r in reqs}
        active = [self._sync(r) for r in reqs if room[r.request_id] > 0]
        while active:
            scheduled = []
            for shadow in active:
                num_new = shadow.num_tokens - shadow.num_computed_tokens
                if self.kv.allocate_slots(shadow, num_new) is not None:
                    scheduled.append(ScheduledRequest(shadow, num_new))
            if not scheduled:
                break
            result = self.runner.execute(SchedulerOutput(scheduled), self.kv.get_block_ids)
            for s in scheduled:
                shadow = s.request
                shadow.num_computed_tokens += s.num_new_tokens
                token = result.sampled[shadow.request_id][0]
                shadow.output_token_ids.append(token)
                guesses[shadow.request_id].append(token)
            active = [s.request for s in scheduled
                      if len(guesses[s.request.request_id]) < room[s.request.request_id]]
        return guesses

    def finish(self, request_id: str) -> None:
        shadow = self._shadows.pop(request_id, None)
        if shadow is not None:
            self.kv.free(shadow)

    def _sync(self, req: Request) -> Request:
        """The shadow of `req`, holding the target's tokens, its KV valid up to the first
        position that changed (and never the last token: its logits give the first guess)."""
        tokens = req.all_token_ids
        shadow = self._shadows.get(req.request_id)
        if shadow is None:
            shadow = self._shadows[req.request_id] = Request(
                req.request_id, list(tokens), GREEDY, max_tokens=1 << 30)
            return shadow
        before = shadow.all_token_ids
        same = next((i for i, (a, b) in enumerate(zip(before, tokens)) if a != b),
                    min(len(before), len(tokens)))
        shadow.prompt_token_ids, shadow.output_token_ids = list(tokens), []
        shadow.num_computed_tokens = min(shadow.num_computed_tokens, same, len(tokens) - 1)
        return shadow


def load_draft(config, target_vocab: int, max_model_len: int) -> DraftModel:
    """The draft of `config` (an EngineConfig whose speculative_config names draft_model),
    on the target's device and dtype, one rank, a KV pool of `draft_num_kv_blocks`."""
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.runner.model_runner import ModelRunner

    spec = config.scheduler.speculative
    checkpoint = config.checkpoint
    draft_config = config.with_args(
        model=spec.draft_model, revision=None, quantization="none", speculative_config=None,
        tensor_parallel_size=1, kv_transport=None, num_kv_blocks=spec.draft_num_kv_blocks,
        kv_cache_memory_bytes=None, gpu_memory_utilization=None)
    model_dir = resolve_model_dir(spec.draft_model, checkpoint.cache_dir, None)
    runner = ModelRunner(draft_config, Path(model_dir), max_model_len)
    return DraftModel(runner, target_vocab)
