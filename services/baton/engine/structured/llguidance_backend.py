"""The grammar engine: llguidance (`llguidance==1.9.1`).

Chosen over xgrammar 0.2.8 on our 2-core CPU with SmolLM2-135M-Instruct's tokenizer (49,152
ids); `structured_bench.py --compare` re-measures the masks:

- mask per step, batch 1: llguidance 0.12-0.19 ms, xgrammar 0.01 ms.
- mask per step, batch 64, every row walking its own random path: on the bench's schema
  (free strings, open objects) llguidance 3.1-3.9 ms, xgrammar 9-14 ms; on a closed schema
  (bounded strings, no extra keys) 0.9 ms against 0.8 ms.
- compiling a schema: llguidance 1-5 ms (masks are computed lazily, per step), xgrammar
  1-66 ms (it precomputes them): no stall when a new schema arrives.
- tokenizer set-up, once per engine: llguidance 0.6 s, xgrammar 0.25 s.
- coverage, checked with valid and invalid documents: both enforce nested objects, arrays,
  enums, required, anyOf, oneOf, `$ref`/`$defs`, recursion, patterns, formats, min/max,
  exclusive bounds, multipleOf, min/maxLength, min/maxItems, min/maxProperties,
  prefixItems, const. xgrammar gets allOf and patternProperties wrong (it rejects valid
  documents) and silently ignores uniqueItems, if/then and not (its outputs then fail the
  schema); llguidance enforces the first two and refuses the rest with an error naming
  the keyword, which is our 400.
- install: llguidance is a 7.8 MB wheel with no dependencies; xgrammar is 14 MB with
  apache-tvm-ffi and pulls triton (286 MB) on Linux x86_64, plus transformers and pydantic
  unpinned. Neither brings another torch.

Either mask is small against a decode step (tens to hundreds of ms on CPU). What decided it:
llguidance never silently emits an output its schema rejects, compiles without stalls and
weighs nothing.

JSON is generated in `json.dumps`' default layout (", " and ": ", no other whitespace): a
small model given free whitespace may emit newlines forever. A schema's own `x-guidance`
options override this.

Bounded at compile, never mid-generation (issue 38): the parser's limits are set explicitly
(`LIMITS`), and `compile` computes the grammar's first mask on its template, so the lexer a
regex builds lazily is built then, on the compiling thread, and a grammar the engine refuses
at its first token (too many lexer states, too much fuel, a row too wide) is a compile error,
the request's 400. Every matcher is a copy of that template and starts with its lexer built.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Sequence
from typing import cast

import numpy as np
import torch

from baton.engine.structured.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
)

JSON_OPTIONS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
ANY_JSON_OBJECT = '{"type": "object"}'
# llguidance's parser limits, made explicit: what one request's grammar may cost a step.
# Fuel is llguidance's unit of work (~14k per ms when masking). A row wider than its default
# (2,000) is allowed, since step_max_items bounds a step's parser work anyway: a choice of
# 9,000 literals or 2,000 optional properties (~4 items each, common.structured_limits)
# would otherwise compile and then fail at its first token.
LIMITS = {
    "max_items_in_row": 10_000,  # Earley items in one row: a choice's width (~0.5 ms)
    "initial_lexer_fuel": 1_000_000,  # building the regexes' ASTs, at compile (~20 ms)
    "step_lexer_fuel": 200_000,  # one mask's lexer work (~15 ms)
    "step_max_items": 50_000,  # one mask's parser items (~2.5 ms)
    "max_lexer_states": 250_000,  # lexer DFA states, 1-2 kB each
    "max_grammar_size": 500_000,  # symbols in the grammar's productions
}
# Compile-time probe: this many random walks of this many tokens (a mask each, ~1-15 ms)
PROBE_WALKS, PROBE_STEPS = 4, 8


def _import_llguidance():
    try:
        import llguidance
    except ImportError as err:  # a dependency of baton: a broken install
        raise ImportError("structured outputs need llguidance: pip install "
                          "llguidance==1.9.1") from err
    return llguidance


class LLGuidanceMatcher(GrammarMatcher):
    __slots__ = ("backend", "inner")

    def __init__(self, backend: LLGuidanceBackend, inner) -> None:
        self.backend = backend
        self.inner = inner  # llguidance.LLMatcher

    def accept(self, token_id: int) -> bool:
        return self.inner.consume_token(token_id)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        return self.inner.validate_tokens(list(tokens))

    def fork(self, tokens: Sequence[int]) -> LLGuidanceMatcher:
        inner = self.inner.deep_copy()
        if not inner.consume_tokens(list(tokens)):
            raise ValueError(f"the grammar rejects {list(tokens)}: {inner.get_error()}")
        return LLGuidanceMatcher(cast(LLGuidanceBackend, self.backend), inner)

    @property
    def is_terminated(self) -> bool:
        return self.inner.is_stopped()

    @property
    def error(self) -> str:
        return self.inner.get_error()


class LLGuidanceGrammar(CompiledGrammar):
    """A validated grammar as a matcher at its start; requests get deep copies (cheaper
    than parsing the grammar again)."""

    def __init__(self, backend: LLGuidanceBackend, template) -> None:
        self._backend = backend
        self._template = template

    def matcher(self) -> LLGuidanceMatcher:
        return LLGuidanceMatcher(self._backend, self._template.deep_copy())


class LLGuidanceBackend(GrammarBackend):
    def __init__(self, tokenizer, vocab_size: int, eos_token_id: int | None,
                 num_threads: int | None = None) -> None:
        llg = _import_llguidance()
        from llguidance.hf import from_tokenizer

        self._llg = llg
        self.vocab_size = vocab_size
        # The tokenizer's own EOS: what a grammar allows where it may end (~0.6 s, once).
        self._tokenizer = from_tokenizer(tokenizer, n_vocab=vocab_size, eos_token=eos_token_id)
        self._executor = llg.LLExecutor(num_threads or min(os.cpu_count() or 1, 8))
        self._limits = llg.LLParserLimits(**LIMITS, verbose_errors=False)

    def compile(self, kind: str, spec: str) -> LLGuidanceGrammar:
        """The template matcher, its first mask computed (llguidance drops the GIL for
        both): whatever the engine refuses at the first token is refused here."""
        grammar = self._grammar_text(kind, spec)
        template = self._llg.LLMatcher(self._tokenizer, grammar, log_level=0,
                                       limits=self._limits)
        if not template.is_error():
            template.compute_bitmask()  # builds the lexer now, not on the engine thread
        error = template.get_error() if template.is_error() else self._probe(template)
        if error:
            raise GrammarCompileError(_first_line(error))
        return LLGuidanceGrammar(self, template)

    def _probe(self, template) -> str:
        """Walk a few short random paths through copies of the template (a mask, an
        allowed token, ...): a limit the grammar hits within its first tokens is found here,
        at compile, rather than by a request mid-generation. Returns the error, or ""."""
        rng = random.Random(0)
        for _ in range(PROBE_WALKS):
            matcher = template.deep_copy()
            for _ in range(PROBE_STEPS):
                allowed = _allowed_ids(matcher.compute_bitmask(), self.vocab_size)
                if matcher.is_error() or not allowed or matcher.is_stopped():
                    break
                matcher.consume_token(rng.choice(allowed))
            if matcher.is_error():
                return matcher.get_error()
        return ""

    def _grammar_text(self, kind: str, spec: str) -> str:
        """The spec as llguidance's grammar text; raises GrammarCompileError."""
        matcher_cls = self._llg.LLMatcher
        try:
            if kind == "json_object":
                return matcher_cls.grammar_from_json_schema(ANY_JSON_OBJECT,
                                                            defaults=JSON_OPTIONS)
            if kind == "json_schema":
                _check_schema_text(spec)
                return matcher_cls.grammar_from_json_schema(spec, defaults=JSON_OPTIONS)
            if kind == "regex":
                return matcher_cls.grammar_from_regex(spec)
            if kind == "grammar":  # Lark, or GBNF (llama.cpp's EBNF) converted to Lark
                return self._llg.grammar_from("grammar", spec)
        except (ValueError, TypeError) as err:
            raise GrammarCompileError(str(err)) from None
        raise GrammarCompileError(f"unknown structured output kind {kind!r}")

    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        rows, words = bitmask.shape
        if rows < len(matchers) or words * 32 < self.vocab_size or bitmask.dtype != torch.int32:
            raise ValueError(f"bitmask {tuple(bitmask.shape)} {bitmask.dtype} cannot hold "
                             f"{len(matchers)} rows of {self.vocab_size} ids")
        if not bitmask.is_contiguous() or bitmask.device.type != "cpu":
            raise ValueError("the bitmask must be a contiguous CPU tensor")
        # One call for the batch: llguidance's threads compute the rows without the GIL.
        # cast: this backend is given its own matchers only (masks.fill_grammar_masks)
        self._executor.unsafe_compute_mask_ptr(
            [(cast(LLGuidanceMatcher, m).inner, i) for i, m in enumerate(matchers)],
            bitmask.data_ptr(), words * 4, rows)


def _allowed_ids(mask: bytes, vocab_size: int) -> list[int]:
    """The token ids a bitmask row (bit t % 32 of word t // 32, little-endian) allows."""
    bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")
    return [int(t) for t in np.flatnonzero(bits[:vocab_size])]


def _first_line(error: str) -> str:
    """llguidance's message without the parser state it may append."""
    return error.split("\n<state>", 1)[0].strip() or "invalid grammar"


def _check_schema_text(spec: str) -> None:
    """A schema must be a JSON object; llguidance's message for other text is obscure."""
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as err:
        raise GrammarCompileError(f"the JSON schema is not valid JSON: {err}") from None
    if not isinstance(schema, dict):
        raise GrammarCompileError(f"a JSON schema must be an object, not "
                                  f"{type(schema).__name__}")
