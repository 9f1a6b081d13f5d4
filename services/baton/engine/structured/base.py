"""The grammar backend contract: what the engine asks of a grammar engine.

    make_request   backend.compile(kind, spec) -> CompiledGrammar   (any thread; cached by
                   `StructuredOutputs`; a spec it cannot compile raises GrammarCompileError)
                   compiled.matcher() -> GrammarMatcher              (one per request)
    each step      backend.fill_bitmask(matchers, bitmask)          (engine thread, one call
                   for every constrained row of the batch)
    after sampling matcher.accept(token) -> bool                     (engine thread)
                   matcher.is_terminated                             (the output is complete)
    speculation    matcher.valid_prefix(guesses) -> int              (engine thread: guesses
                   matcher.fork(guesses) -> GrammarMatcher            checked, then masked at
                                                                      each of their positions)

A bitmask row holds one bit per vocabulary id: bit `t % 32` of int32 word `t // 32` is set
when token `t` may come next. EOS is allowed exactly where the grammar may end.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the contract names torch tensors; implementations import torch
    import torch


class GrammarCompileError(ValueError):
    """A structured-output spec the grammar engine cannot compile (bad JSON, an unsupported
    schema keyword, a bad regex); the message names the problem. The request's fault."""


class GrammarMatcher(ABC):
    """One request's position in its grammar. Used on the engine thread only."""

    backend: GrammarBackend  # the backend that fills this matcher's bitmask rows

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advance over one token. False when the grammar rejects it: the matcher is then
        dead (`error` says why) and its request must end."""

    @abstractmethod
    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of `tokens`, in order, the grammar accepts from here; nothing moves."""

    @abstractmethod
    def fork(self, tokens: Sequence[int]) -> GrammarMatcher:
        """A copy advanced over `tokens` (a prefix `valid_prefix` accepts whole); this
        matcher does not move. Raises ValueError when the grammar rejects one of them."""

    @property
    @abstractmethod
    def is_terminated(self) -> bool:
        """The output is complete: no token but EOS may follow (also after EOS itself)."""

    @property
    @abstractmethod
    def error(self) -> str:
        """Why the matcher is dead; empty while it is not."""


class CompiledGrammar(ABC):
    """A compiled spec, shared by every request that asks for the same one; immutable."""

    @abstractmethod
    def matcher(self) -> GrammarMatcher:
        """A fresh matcher at the grammar's start (thread-safe)."""


class GrammarBackend(ABC):
    """A grammar engine over one tokenizer and vocabulary (`vocab_size` bits per row)."""

    vocab_size: int

    @abstractmethod
    def compile(self, kind: str, spec: str) -> CompiledGrammar:
        """`kind` is one of `StructuredOutput`'s kinds (`json_object` ignores `spec`).
        Raises GrammarCompileError. Thread-safe: called from the caller of make_request."""

    @abstractmethod
    def fill_bitmask(self, matchers: Sequence[GrammarMatcher], bitmask: torch.Tensor) -> None:
        """Write matcher i's allowed next tokens into row i of `bitmask` (int32, CPU,
        contiguous, (len(matchers), ceil(vocab_size / 32))). Engine thread; the matchers
        are this backend's."""
