"""Validating and building one `Request` from what a caller asks: the engine facts that
takes (vocabulary, context window, KV pool shape, EOS, structured outputs, KV transport,
LoRA) and nothing of the engine's state, so it runs on any thread, and in a process that
holds no model: the HTTP front of an engine core running in its own process
(`engine.core_process`) validates with the core's facts before anything crosses."""

from __future__ import annotations

from dataclasses import dataclass

from baton.common.sampling_params import SamplingParams
from baton.engine.errors import InvalidRequestError
from baton.engine.kv_connector.handoff import KVHandoff, PullKV
from baton.engine.lora.requests import LoRAAdapter, check_lora_request
from baton.engine.request import Request
from baton.engine.request_checks import check_handoff, check_params, check_prompt
from baton.engine.structured.base import CompiledGrammar, GrammarCompileError
from baton.engine.structured.manager import StructuredOutputs


@dataclass(frozen=True)
class KVShape:
    """What a request's checks read of the KV pool: its size in blocks of `block_size`
    tokens (`KVCacheManager`'s `blocks_for` / `num_blocks`)."""

    block_size: int
    num_blocks: int

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


@dataclass(frozen=True)
class EngineFacts:
    """What an engine core tells a front that validates requests for it (plain data, sent
    once when the core is up)."""

    model_dir: str
    vocab_size: int
    max_model_len: int
    eos_token_id: int | None
    kv: KVShape
    has_connector: bool


class RequestFactory:
    """`make_request` over an engine's facts. `structured`: the engine's grammar compiler
    (a request's grammar is compiled here unless it comes compiled); `lora`: its LoRA
    manager, None when it serves no adapters."""

    def __init__(self, facts: EngineFacts, tokenizer, structured: StructuredOutputs,
                 lora=None) -> None:
        self.facts = facts
        self.tokenizer = tokenizer
        self.structured = structured
        self.lora = lora

    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0, detokenize: bool = True,
                     arrival_time: float | None = None, *, kv: KVHandoff | None = None,
                     presampled: int = 0, grammar: CompiledGrammar | None = None,
                     lora: LoRAAdapter | None = None, with_grammar: bool = True) -> Request:
        """See `EngineCore.make_request`. `with_grammar=False`: validate and build without
        a grammar matcher (a front's copy, whose grammar the core builds)."""
        f = self.facts
        n, vocab = len(prompt_token_ids), f.vocab_size
        check_prompt(prompt_token_ids, vocab, f.max_model_len, f.kv)
        check_params(params, vocab, self.tokenizer is not None)
        room = f.max_model_len - n
        req = Request(request_id, list(prompt_token_ids), params,
                      max_tokens=min(params.max_tokens or room, room),
                      eos_token_id=f.eos_token_id, priority=priority, detokenize=detokenize)
        if arrival_time is not None:
            req.arrival_time = arrival_time
        if with_grammar:
            try:
                req.grammar = (grammar.matcher() if grammar is not None
                               else self.structured.matcher_for(params.structured))
            except GrammarCompileError as err:
                raise InvalidRequestError(str(err), param="response_format") from None
        if presampled < 0:
            raise InvalidRequestError(f"presampled={presampled} must be >= 0")
        req.num_presampled = presampled
        req.lora = check_lora_request(lora, kv, self.lora)
        if kv is not None:
            check_handoff(kv, n, params, f.has_connector, f.kv, vocab)
            req.kv_handoff = kv
        if isinstance(kv, PullKV):
            req.output_token_ids.append(kv.params.first_token)
            req.num_presampled += 1
        return req
