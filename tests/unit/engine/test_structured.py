"""Structured outputs: every output of a constrained request satisfies its constraint (greedy
and sampled, on the real bundled model), unconstrained neighbours are untouched, bad specs
are the request's 400, a matcher is rebuilt over tokens generated elsewhere, and a grammar
failure ends its request alone. The mask plumbing itself is checked without the model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from baton import SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton.engine.request import Request
from baton.engine.sampler import Sampler
from baton.engine.structured.base import GrammarBackend, GrammarMatcher
from baton.engine.structured.manager import generated_so_far
from baton.engine.structured.masks import (
    advance_grammars,
    apply_grammar_masks,
    fill_grammar_masks,
    keep_bits,
)

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 24},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "role": {"enum": ["admin", "user", "guest"]},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24},
                           "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
            "required": ["city", "zip"], "additionalProperties": False},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 12},
                 "minItems": 1, "maxItems": 3},
    },
    "required": ["name", "age", "role", "address", "tags"],
    "additionalProperties": False,
}
JSON_SCHEMA = StructuredOutput("json_schema", json.dumps(SCHEMA))
PROMPTS = ["Describe a new user of our website as JSON.",
           "Write a JSON record for a customer who lives in Paris.",
           "Give me a made-up person in JSON."]


# -- the engine (real bundled model, float32) ----------------------------------------------
@pytest.fixture(scope="module")
def core():
    from baton.engine.config import EngineConfig
    from baton.engine.core import EngineCore

    return EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=512, max_num_seqs=16))


def chat(core, text: str) -> list[int]:
    from baton.engine.tokenizer import apply_chat_template

    return apply_chat_template(core.tokenizer, [{"role": "user", "content": text}])


def run(core, requests: dict[str, tuple[list[int], SamplingParams]], presampled=None
        ) -> dict[str, list]:
    """Add every request, step until idle; each request's outputs."""
    outs: dict[str, list] = {}
    for rid, (ids, params) in requests.items():
        req = core.make_request(rid, ids, params, presampled=(presampled or {}).get(rid, 0))
        for o in core.add(req):
            outs.setdefault(o.request_id, []).append(o)
    for _ in range(2000):
        if not core.has_unfinished_requests():
            break
        for o in core.step():
            outs.setdefault(o.request_id, []).append(o)
    assert not core.has_unfinished_requests()
    assert core.kv.num_used_blocks == 0
    return outs


def text_of(outs) -> str:
    return "".join(o.new_text for o in outs)


def tokens_of(outs) -> list[int]:
    return [t for o in outs for t in o.new_token_ids]


def constrained(structured, max_tokens=200, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, structured=structured, **kw)


@pytest.mark.slow
def test_greedy_json_schema_outputs_validate(core):
    outs = run(core, {f"g{i}": (chat(core, p), constrained(JSON_SCHEMA, temperature=0))
                      for i, p in enumerate(PROMPTS)})
    for rid, o in outs.items():
        assert o[-1].finish_reason == "stop", (rid, text_of(o))
        jsonschema.validate(json.loads(text_of(o)), SCHEMA)


@pytest.mark.slow
def test_sampled_json_schema_outputs_validate_for_many_seeds(core):
    ids = chat(core, PROMPTS[0])
    outs = run(core, {f"s{seed}": (ids, constrained(JSON_SCHEMA, temperature=1.0, seed=seed))
                      for seed in range(16)})
    texts = set()
    for rid, o in outs.items():
        assert o[-1].finish_reason == "stop", (rid, text_of(o))
        jsonschema.validate(json.loads(text_of(o)), SCHEMA)
        texts.add(text_of(o))
    assert len(texts) > 8  # sampling still samples


@pytest.mark.slow
def test_json_object_and_regex_and_grammar(core):
    regex = r"(yes|no), because [a-z ]{1,40}\."
    reqs = {
        "obj": (chat(core, "Reply in JSON."),
                constrained(StructuredOutput("json_object"), temperature=1.0, seed=1)),
        "obj-greedy": (chat(core, "List two fruits."),
                       constrained(StructuredOutput("json_object"), temperature=0)),
        "re": (chat(core, "Is the sky blue?"),
               constrained(StructuredOutput("regex", regex), temperature=0.8, seed=2)),
        "lark": (chat(core, "Is water wet?"),
                 constrained(StructuredOutput("grammar", 'start: "yes" | "no" | "maybe"'),
                             temperature=0)),
        "gbnf": (chat(core, "Pick a colour."),
                 constrained(StructuredOutput("grammar", 'root ::= "red" | "green"'),
                             temperature=1.0, seed=3)),
    }
    outs = run(core, reqs)
    assert isinstance(json.loads(text_of(outs["obj"])), dict)
    assert isinstance(json.loads(text_of(outs["obj-greedy"])), dict)
    assert re.fullmatch(regex, text_of(outs["re"])), text_of(outs["re"])
    assert text_of(outs["lark"]) in ("yes", "no", "maybe")
    assert text_of(outs["gbnf"]) in ("red", "green")
    assert all(o[-1].finish_reason == "stop" for o in outs.values())


@pytest.mark.slow
def test_a_complete_grammar_stops_even_with_ignore_eos(core):
    outs = run(core, {"r": (chat(core, "Yes or no?"), constrained(
        StructuredOutput("regex", "(yes|no)"), temperature=0, ignore_eos=True, max_tokens=16))})
    assert text_of(outs["r"]) in ("yes", "no")
    assert outs["r"][-1].finish_reason == "stop"


@pytest.mark.slow
def test_unconstrained_rows_are_untouched_by_constrained_neighbours(core):
    ids = chat(core, "Tell me about the moon.")
    free = SamplingParams(temperature=0, max_tokens=24)
    alone = tokens_of(run(core, {"free": (ids, free)})["free"])
    batch = {"free": (ids, free)}
    batch |= {f"c{i}": (chat(core, p), constrained(JSON_SCHEMA, temperature=0))
              for i, p in enumerate(PROMPTS)}
    batch["b"] = (ids, SamplingParams(temperature=0, max_tokens=24, logit_bias={13: 5.0}))
    together = run(core, batch)
    assert tokens_of(together["free"]) == alone


@pytest.mark.slow
@pytest.mark.parametrize("spec,needle", [
    (StructuredOutput("json_schema", '{"type": "objec"}'), "objec"),
    (StructuredOutput("json_schema", '{"type": "array", "uniqueItems": true}'), "uniqueItems"),
    (StructuredOutput("json_schema", "{not json"), "JSON"),
    (StructuredOutput("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
    (StructuredOutput("regex", "(unclosed"), "regex"),
    (StructuredOutput("grammar", "start: undefined_rule"), "undefined_rule"),
])
def test_a_spec_that_does_not_compile_is_the_requests_error(core, spec, needle):
    from baton.engine.errors import InvalidRequestError

    with pytest.raises(InvalidRequestError) as err:
        core.make_request("bad", [1, 2, 3], SamplingParams(structured=spec))
    assert err.value.param == "response_format"
    assert needle.lower() in str(err.value).lower()
    assert spec.kind in str(err.value)


@pytest.mark.slow
def test_compiled_specs_are_cached(core):
    before = core.structured.num_cached
    for i in range(3):
        core.make_request(f"c{i}", [1, 2], SamplingParams(structured=JSON_SCHEMA))
    assert core.structured.num_cached <= before + 1


@pytest.mark.slow
def test_a_resumed_request_continues_to_a_valid_document(core):
    ids = chat(core, PROMPTS[1])
    full = tokens_of(run(core, {"full": (ids, constrained(JSON_SCHEMA, temperature=0))})["full"])
    for k in (1, len(full) // 2, len(full) - 2):
        outs = run(core, {"resumed": (ids + full[:k], constrained(JSON_SCHEMA, temperature=0))},
                   presampled={"resumed": k})["resumed"]
        assert outs[-1].finish_reason == "stop"
        rest = tokens_of(outs)
        document = core.tokenizer.decode(full[:k] + rest)
        jsonschema.validate(json.loads(document), SCHEMA)


@pytest.mark.slow
def test_a_resumed_request_whose_earlier_tokens_break_the_grammar_ends_in_error(core):
    ids = chat(core, PROMPTS[1])
    bad = core.tokenizer.encode("hello")
    outs = run(core, {"bad": (ids + bad, constrained(JSON_SCHEMA, temperature=0))},
               presampled={"bad": len(bad)})["bad"]
    assert len(outs) == 1 and outs[0].finish_reason == "error"
    assert "structured output" in str(outs[0].stop_reason)
    assert outs[0].new_token_ids == []


@pytest.mark.slow
def test_a_grammar_failure_ends_that_request_alone(core):
    ids = chat(core, PROMPTS[0])
    from baton.engine.structured.llguidance_backend import LLGuidanceMatcher

    class Rejecting(LLGuidanceMatcher):  # masks as the grammar says, rejects what it gets
        def accept(self, token_id):
            return False

        @property
        def error(self):
            return "rejected on purpose"

    poison = core.make_request("poison", ids, constrained(JSON_SCHEMA, temperature=0))
    poison.grammar = Rejecting(poison.grammar.backend, poison.grammar.inner)
    assert core.add(poison) == []
    outs = run(core, {"good": (ids, constrained(JSON_SCHEMA, temperature=0)),
                      "free": (ids, SamplingParams(temperature=0, max_tokens=8))})
    assert outs["poison"][-1].finish_reason == "error"
    assert "rejected on purpose" in outs["poison"][-1].stop_reason
    assert outs["good"][-1].finish_reason == "stop"
    assert outs["free"][-1].finish_reason == "length"


@pytest.mark.slow
def test_a_pulled_request_continues_the_prefills_structured_output(core):
    """Prefill engine (HoldKV) samples the first token under the grammar; the decode engine
    (PullKV) rebuilds its matcher over that token and finishes a valid document; a first
    token the grammar rejects ends the pulled request in error before it pulls."""
    import time
    from dataclasses import replace

    from baton.engine.config import EngineConfig
    from baton.engine.core import EngineCore
    from baton.engine.kv_connector import HoldKV, PullKV

    def engine(role):
        return EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=128, kv_transport="local",
                                       engine_id=f"structured-{role}-{time.monotonic_ns()}"))

    p, d = engine("prefill"), engine("decode")
    try:
        ids = chat(p, PROMPTS[2])
        params = constrained(JSON_SCHEMA, temperature=0)
        p.add(p.make_request("pd", ids, replace(params, max_tokens=1), kv=HoldKV()))
        kv = next(o for o in drain(p, until="pd") if o.finished).kv_transfer_params
        assert kv is not None and core.tokenizer.decode([kv.first_token]).startswith("{")
        bad = kv.model_copy(update={"first_token": core.tokenizer.encode("hello")[0]})
        outs = d.add(d.make_request("bad", ids, params, kv=PullKV(bad)))
        assert [o.finish_reason for o in outs] == ["error"]
        outs = d.add(d.make_request("pd", ids, params, kv=PullKV(kv))) + drain(d)
        assert outs[-1].finish_reason == "stop"
        jsonschema.validate(json.loads(core.tokenizer.decode(tokens_of(outs))), SCHEMA)
    finally:
        p.close()
        d.close()


def drain(core, until: str | None = None, timeout: float = 120.0) -> list:
    """Step until idle (with KV pulls polled), or until request `until` has finished."""
    import time

    outs, deadline = [], time.monotonic() + timeout
    while (core.has_unfinished_requests() or core.needs_polling) and time.monotonic() < deadline:
        outs += core.step()
        if until is not None and any(o.request_id == until and o.finished for o in outs):
            break
    return outs


# -- the plumbing, without the model -------------------------------------------------------
class AllowBackend(GrammarBackend):
    """Allows exactly the ids in `allowed` for every matcher."""

    def __init__(self, vocab_size: int, allowed=()) -> None:
        self.vocab_size = vocab_size
        self.allowed = list(allowed)
        self.calls = 0

    def compile(self, kind, spec):
        raise NotImplementedError

    def fill_bitmask(self, matchers, bitmask):
        self.calls += 1
        words = [0] * bitmask.shape[1]
        for t in self.allowed:
            words[t // 32] |= 1 << (t % 32)
        signed = [w - (1 << 32) if w >= 1 << 31 else w for w in words]  # int32 bit patterns
        bitmask[:len(matchers)] = torch.tensor(signed, dtype=torch.int32)


class RecordingMatcher(GrammarMatcher):
    def __init__(self, backend, accept=True) -> None:
        self.backend = backend
        self._accept = accept
        self.tokens: list[int] = []

    def accept(self, token_id):
        self.tokens.append(token_id)
        return self._accept

    def valid_prefix(self, tokens):
        return len(tokens) if self._accept else 0

    def fork(self, tokens):
        copy = type(self)(self.backend, self._accept)
        copy.tokens = self.tokens + list(tokens)
        return copy

    @property
    def is_terminated(self):
        return False

    @property
    def error(self):
        return "" if self._accept else "rejected on purpose"


def make_req(rid: str, grammar=None, **params) -> Request:
    req = Request(rid, [1, 2, 3], SamplingParams(**params), max_tokens=8)
    req.grammar = grammar
    return req


def test_masks_are_filled_in_one_call_for_the_constrained_rows_only():
    backend = AllowBackend(100, [5, 33, 99])
    reqs = [make_req("a"), make_req("b", RecordingMatcher(backend)), make_req("c"),
            make_req("d", RecordingMatcher(backend))]
    masks = fill_grammar_masks(reqs)
    assert masks.rows == [1, 3] and backend.calls == 1
    assert masks.bitmask.shape == (2, 4) and masks.bitmask.dtype == torch.int32
    assert fill_grammar_masks([make_req("x")]) is None


def test_applying_masks_touches_only_constrained_rows_and_bans_padded_ids():
    backend = AllowBackend(70, [0, 31, 32, 69])
    logits = torch.randn(3, 72)  # the lm_head padded past the tokenizer's 70 ids
    masks = fill_grammar_masks([make_req("a"), make_req("b", RecordingMatcher(backend)),
                                make_req("c")])
    masked = logits.clone()
    apply_grammar_masks(masked, masks)
    assert torch.equal(masked[[0, 2]], logits[[0, 2]])
    finite = masked[1].isfinite().nonzero().squeeze(1).tolist()
    assert finite == [0, 31, 32, 69]
    assert torch.equal(masked[1, finite], logits[1, finite])


def test_keep_bits_follow_the_bit_layout():
    packed = torch.randint(-2**31, 2**31 - 1, (3, 5), dtype=torch.int32,
                           generator=torch.Generator().manual_seed(0))
    keep = keep_bits(packed, 150)
    assert keep.shape == (3, 150) and set(keep.unique().tolist()) <= {0, -1}
    word = int(packed[1, 2]) & 0xFFFFFFFF
    assert (keep[1, 64:96] == -1).tolist() == [bool(word >> b & 1) for b in range(32)]
    assert keep_bits(packed, 170)[:, 160:].eq(0).all()  # past the mask: banned


def test_the_sampler_picks_only_allowed_ids_and_advances_the_matchers():
    backend = AllowBackend(64, [7, 40])
    m_greedy, m_sampled = RecordingMatcher(backend), RecordingMatcher(backend)
    reqs = [make_req("free", temperature=0), make_req("g", m_greedy, temperature=0),
            make_req("s", m_sampled, temperature=1.0, seed=3)]
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    for _ in range(20):
        tokens, _ = Sampler()(logits, reqs, {}, fill_grammar_masks(reqs))
        assert tokens[0] == int(logits[0].argmax())
        assert tokens[1] in (7, 40) and tokens[2] in (7, 40)
        advance_grammars(reqs, {r.request_id: [t] for r, t in zip(reqs, tokens)}, {})
    assert torch.equal(logits, before)  # the caller's logits are not modified
    assert len(m_greedy.tokens) == len(m_sampled.tokens) == 20


def test_a_rejected_token_fails_that_request_alone():
    backend = AllowBackend(16, range(16))
    reqs = [make_req("ok", RecordingMatcher(backend)),
            make_req("bad", RecordingMatcher(backend, accept=False))]
    failed: dict[str, str] = {}
    advance_grammars(reqs, {"ok": [3], "bad": [4]}, failed)
    assert list(failed) == ["bad"] and "rejected on purpose" in failed["bad"]
    with pytest.raises(RuntimeError, match="bad"):
        advance_grammars(reqs, {"ok": [3], "bad": [4]}, None)


def test_generated_so_far_covers_resumed_and_pulled_tokens():
    req = make_req("r")
    req.prompt_token_ids = [1, 2, 3, 10, 11]  # a resumed stream: 10, 11 were sent before
    req.num_presampled = 2
    assert generated_so_far(req) == [10, 11]
    req.output_token_ids = [12]  # and pulled: the prefill pod sampled 12
    req.num_presampled = 3
    assert generated_so_far(req) == [10, 11, 12]
    req.num_presampled = 0
    assert generated_so_far(req) == []
