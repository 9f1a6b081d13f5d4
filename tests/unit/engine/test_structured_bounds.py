"""Grammar work is bounded and found at compile (issue 38): a compile holds no lock another
request needs, one past the time limit is refused (and not cached), `AsyncEngine`'s
compile runs off the event loop, and what the grammar engine would refuse within a
grammar's first tokens (a row too wide) is a compile error, not a failure mid-generation."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest

from baton.common.sampling_params import StructuredOutput
from baton.engine.async_engine import AsyncEngine
from baton.engine.errors import InvalidRequestError
from baton.engine.structured.base import CompiledGrammar, GrammarBackend, GrammarCompileError
from baton.engine.structured.manager import StructuredOutputs


class _Grammar(CompiledGrammar):
    def matcher(self):
        raise NotImplementedError  # these tests never make matchers


class SlowBackend(GrammarBackend):
    """Compiles `"slow"` only once `release` is set, anything else at once."""

    vocab_size = 8

    def __init__(self, delay_s: float = 0.0) -> None:
        self.release = threading.Event()
        self.delay_s = delay_s

    def compile(self, kind, spec):
        if spec == "slow":
            self.release.wait(10)
        time.sleep(self.delay_s)
        return _Grammar()

    def fill_bitmask(self, matchers, bitmask):
        raise NotImplementedError


def test_a_slow_compile_holds_no_lock_another_spec_needs():
    backend = SlowBackend()
    outputs = StructuredOutputs(lambda: backend)
    slow = threading.Thread(target=outputs.compile, args=(StructuredOutput("regex", "slow"),))
    slow.start()
    t0 = time.monotonic()
    outputs.compile(StructuredOutput("regex", "fast"))  # while "slow" is compiling
    assert time.monotonic() - t0 < 1
    backend.release.set()
    slow.join(10)
    assert outputs.num_cached == 2


def test_a_compile_past_the_limit_is_refused_and_not_cached():
    outputs = StructuredOutputs(lambda: SlowBackend(delay_s=0.2), compile_timeout_s=0.05)
    with pytest.raises(GrammarCompileError, match=r"too costly to compile.*limit is 0.05 s"):
        outputs.compile(StructuredOutput("regex", "a"))
    assert outputs.num_cached == 0


def test_async_compile_leaves_the_loop_free_and_times_out_as_a_request_error():
    backend = SlowBackend()
    outputs = StructuredOutputs(lambda: backend, compile_timeout_s=0.3)
    engine = AsyncEngine.__new__(AsyncEngine)  # the facade over a core with grammars only
    engine.core = SimpleNamespace(requests=SimpleNamespace(structured=outputs))
    engine._grammar_pool = ThreadPoolExecutor(2)

    async def main() -> list[float]:
        ticks: list[float] = []

        async def tick() -> None:
            while True:
                ticks.append(time.monotonic())
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        with pytest.raises(InvalidRequestError, match="did not finish"):
            await engine.compile_grammar(StructuredOutput("regex", "slow"))
        assert await engine.compile_grammar(StructuredOutput("regex", "ok")) is not None
        ticker.cancel()
        return ticks

    ticks = asyncio.run(main())
    backend.release.set()
    engine._grammar_pool.shutdown(wait=True)
    assert max(b - a for a, b in zip(ticks, ticks[1:])) < 0.2  # the loop kept running


@pytest.fixture(scope="module")
def backend():
    from baton.engine import tokenizer as tok
    from baton.engine.models.loader import resolve_model_dir
    from baton.engine.structured.llguidance_backend import LLGuidanceBackend

    tokenizer = tok.load_tokenizer(resolve_model_dir(None))
    return LLGuidanceBackend(tokenizer, len(tokenizer), tokenizer.eos_token_id), tokenizer


def wide_schema(n: int) -> str:
    return json.dumps({"type": "object",
                       "properties": {f"p{i}": {"type": "integer"} for i in range(n)}})


def test_a_row_too_wide_after_the_first_token_is_a_compile_error(backend):
    # ~4 items per optional property: 2,600 of them overflow the row at `{"`
    with pytest.raises(GrammarCompileError, match="max is 10000"):
        backend[0].compile("json_schema", wide_schema(2600))


@pytest.mark.parametrize("kind,spec", [
    ("json_schema", wide_schema(600)),  # a row of ~2,400 items: failed at `{"` before
    ("grammar", "start: " + " | ".join(f'"w{i}x"' for i in range(9000))),
])
def test_wide_choices_within_the_limits_compile_and_walk(backend, kind, spec):
    grammar_engine, tokenizer = backend
    matcher = grammar_engine.compile(kind, spec).matcher()
    for token in tokenizer.encode('{"p5' if kind == "json_schema" else "w12"):
        assert matcher.accept(token), matcher.error
