"""`StructuredOutputs`: the engine's one handle on structured outputs. It compiles a
request's `StructuredOutput` (cached by (kind, spec)) into the request's own matcher and
rebuilds a matcher over the tokens a request was generating before it came here."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable

from baton.common.sampling_params import StructuredOutput
from baton.engine.request import Request
from baton.engine.structured.base import (
    CompiledGrammar,
    GrammarBackend,
    GrammarCompileError,
    GrammarMatcher,
)

# Distinct specs kept compiled; a service sees a few schemas over and over.
DEFAULT_CACHE_SIZE = 256
# A spec whose compilation takes longer is refused (and not cached): what one request may
# cost a compiling thread. The input bounds (common.structured_limits) keep real ones far
# below it.
COMPILE_TIMEOUT_S = 10.0


class StructuredOutputs:
    """Built once per engine; the backend (the tokenizer's vocabulary turned into the
    grammar engine's form, ~0.6 s) is made on first use, or by `warm_up`.

    `compile`, `matcher_for` and `warm_up` may be called from any thread (the caller of
    `make_request`, or the worker's compiling threads); matchers are then used on the
    engine thread only. A compilation holds no lock: the lock guards the cache and the
    backend's construction only, so one slow spec never waits another."""

    def __init__(self, make_backend: Callable[[], GrammarBackend] | None,
                 cache_size: int = DEFAULT_CACHE_SIZE,
                 compile_timeout_s: float = COMPILE_TIMEOUT_S) -> None:
        """`make_backend` None: no grammar engine (an engine without a tokenizer), every
        structured request is refused."""
        self._make_backend = make_backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str], CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self.compile_timeout_s = compile_timeout_s
        self._lock = threading.Lock()

    @classmethod
    def for_tokenizer(cls, tokenizer, vocab_size: int, eos_token_id: int | None
                      ) -> StructuredOutputs:
        """The grammar engine over `tokenizer` (None: skip_tokenizer_init, none)."""
        if tokenizer is None:
            return cls(None)

        def make_backend() -> GrammarBackend:
            from baton.engine.structured.llguidance_backend import LLGuidanceBackend

            return LLGuidanceBackend(tokenizer, vocab_size, eos_token_id)

        return cls(make_backend)

    def warm_up(self) -> None:
        """Build the backend now rather than on the first structured request."""
        if self._make_backend is None:
            return
        with self._lock:
            self._backend_locked()

    def _backend_locked(self) -> GrammarBackend:
        if self._make_backend is None:
            raise GrammarCompileError("structured outputs need the tokenizer's vocabulary, "
                                      "and this engine has no tokenizer (skip_tokenizer_init)")
        if self._backend is None:
            self._backend = self._make_backend()
        return self._backend

    def matcher_for(self, structured: StructuredOutput | None) -> GrammarMatcher | None:
        """A fresh matcher for this constraint (None for none). Raises GrammarCompileError
        (the request's fault), its message naming the kind and the problem. Compiles at
        most once per distinct (kind, spec) while it stays cached."""
        if structured is None:
            return None
        return self.compile(structured).matcher()

    def compile(self, structured: StructuredOutput) -> CompiledGrammar:
        """The compiled constraint, from the cache or compiled now on the calling thread
        (outside the lock). Raises GrammarCompileError naming the kind and the problem,
        also when compiling took longer than `compile_timeout_s`."""
        key = (structured.kind, structured.spec)
        with self._lock:
            backend = self._backend_locked()
            compiled = self._cache.get(key)
            if compiled is not None:
                self._cache.move_to_end(key)
                return compiled
        t0 = time.monotonic()
        try:
            compiled = backend.compile(*key)
        except GrammarCompileError as err:
            raise GrammarCompileError(f"the structured output ({structured.kind}) cannot be "
                                      f"compiled: {err}") from None
        took = time.monotonic() - t0
        if took > self.compile_timeout_s:
            raise GrammarCompileError(self.timeout_message(structured.kind, took))
        with self._lock:
            self._cache[key] = compiled
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def timeout_message(self, kind: str, took: float | None = None) -> str:
        spent = f"took {took:.1f} s" if took is not None else "did not finish"
        return (f"the structured output ({kind}) is too costly to compile: compiling it "
                f"{spent}, and the limit is {self.compile_timeout_s:g} s; send a smaller "
                "schema or grammar")

    @property
    def num_cached(self) -> int:
        return len(self._cache)


def generated_so_far(req: Request) -> list[int]:
    """The tokens of this generation made before the request reached this engine: the
    last `num_presampled` of prompt + outputs (a resumed stream's earlier outputs are the
    prompt's tail; a pulled request's first token is already an output)."""
    n = req.num_presampled
    return req.token_ids(req.num_tokens - n, req.num_tokens) if n else []


def rebuild(req: Request) -> str | None:
    """Advance a new request's matcher over `generated_so_far`. Returns why the grammar
    rejected one of them (the request must end with an error), or None."""
    matcher = req.grammar
    if matcher is None:
        return None
    for i, token in enumerate(generated_so_far(req)):
        if req.grammar_after is not None:  # still thinking: the grammar has not started
            req.see_grammar_start(token)
            continue
        if not matcher.accept(token):
            return (f"structured output: earlier output token {i} (id {token}) is not "
                    f"allowed by the grammar: {matcher.error or 'rejected'}")
    return None


def grammar_complete(req: Request) -> bool:
    """The request's structured output is complete: it stops here ("stop")."""
    grammar = req.active_grammar
    return grammar is not None and grammar.is_terminated
