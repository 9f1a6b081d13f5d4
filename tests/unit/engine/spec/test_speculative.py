"""Speculative decoding (`engine.spec`, n-gram prompt lookup) on the bundled model: with and
without it, greedy tokens, their logprobs, texts and finish reasons are identical — in one
batch with chat prompts, through stop ids, stop strings and max_tokens inside an accepted
run, preemption by recompute, prefix-cache hits and structured outputs (guesses checked
against the grammar) — and guesses are accepted; seeded sampled requests speculate and stay reproducible, and
rejection sampling keeps every position's distribution the target's (a chi-squared test
against plain sampling). Both engines run deterministic bf16, so the logprobs
of a token verified in a chunk equal the ones a decode step gives, bit for bit."""

from __future__ import annotations

import json

import pytest

from baton import LLM, SamplingParams
from baton.common.sampling_params import StructuredOutput
from baton_loadtest.grounded import grounded_workload

SPEC = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": 16}


def _engine(kernel_cache, spec: dict | None, blocks: int = 1024) -> LLM:
    args = dict(dtype="bfloat16", deterministic=True, num_kv_blocks=blocks,
                max_num_batched_tokens=512, cache_dir=str(kernel_cache))
    if spec is not None:
        args["speculative_config"] = json.dumps(spec)
    return LLM(**args)


@pytest.fixture(scope="module")
def plain(kernel_cache):
    return _engine(kernel_cache, None)


@pytest.fixture(scope="module")
def spec(kernel_cache):
    return _engine(kernel_cache, SPEC)


@pytest.fixture(scope="module")
def prompts(plain):
    tok = plain.get_tokenizer()
    grounded = [{"prompt_token_ids": tok.encode(tok.apply_chat_template(
        r.messages, add_generation_prompt=True, tokenize=False), add_special_tokens=False)}
        for r in grounded_workload(4, seed=3, passage_chars=(300, 700))]
    return grounded + ["The quick brown fox", "def fibonacci(n):"]


def _greedy(**kw) -> SamplingParams:
    return SamplingParams(**{"temperature": 0, "max_tokens": 80, "logprobs": 2, **kw})


def _same(a, b) -> None:
    for x, y in zip(a, b, strict=True):
        ox, oy = x.outputs[0], y.outputs[0]
        assert oy.token_ids == ox.token_ids
        assert oy.text == ox.text
        assert (oy.finish_reason, oy.stop_reason) == (ox.finish_reason, ox.stop_reason)
        if ox.logprobs is not None:
            assert [lp.logprob for lp in oy.logprobs] == [lp.logprob for lp in ox.logprobs]
            assert [lp.top for lp in oy.logprobs] == [lp.top for lp in ox.logprobs]


def test_greedy_output_is_unchanged_and_guesses_are_accepted(plain, spec, prompts):
    before = spec.engine.speculator.counters.accepted_tokens
    _same(plain.generate(prompts, _greedy(), use_tqdm=False),
          spec.generate(prompts, _greedy(), use_tqdm=False))
    counters = spec.engine.speculator.counters
    assert counters.accepted_tokens - before > 20
    stats = spec.engine.metrics_snapshot().spec
    assert stats is not None and stats.method == "ngram" and 0 < stats.acceptance_rate <= 1
    spec.engine.kv.check_integrity()


def test_stops_inside_an_accepted_run_end_it_where_plain_decoding_does(plain, spec, prompts):
    ref = plain.generate(prompts[:4], _greedy(), use_tqdm=False)
    for r in ref:
        ids, text = r.outputs[0].token_ids, r.outputs[0].text
        cases = [_greedy(stop_token_ids=[ids[30]]), _greedy(stop=[text[60:66]]),
                 _greedy(max_tokens=37), _greedy(stop=[text[40:44]], max_tokens=45,
                                                 include_stop_str_in_output=True)]
        prompt = {"prompt_token_ids": r.prompt_token_ids}
        for params in cases:
            _same(plain.generate(prompt, params, use_tqdm=False),
                  spec.generate(prompt, params, use_tqdm=False))


def test_prefix_hits_and_preemption_keep_it_exact(kernel_cache, plain, prompts):
    small = _engine(kernel_cache, SPEC, blocks=36)  # 576 tokens for ~1,000 asked
    ref = plain.generate(prompts, _greedy(max_tokens=120), use_tqdm=False)
    got = small.generate(prompts, _greedy(max_tokens=120), use_tqdm=False)
    assert small.engine.scheduler.num_preemptions > 0
    _same(ref, got)
    again = small.generate(prompts[0], _greedy(max_tokens=120), use_tqdm=False)
    assert again[0].num_cached_tokens > 0  # guesses never entered the cache; hits did
    _same(ref[:1], again)
    small.engine.kv.check_integrity()


def test_seeded_sampled_requests_speculate_reproducibly(spec, prompts):
    seeded = [SamplingParams(temperature=0.8, seed=7, max_tokens=40)] * 2
    before = spec.engine.speculator.counters.verified_requests
    first = spec.generate(prompts[:2], seeded, use_tqdm=False)
    assert spec.engine.speculator.counters.verified_requests > before  # they guessed
    _same(first, spec.generate(prompts[:2], seeded, use_tqdm=False))


def test_n_choices_each_speculate(plain, spec, prompts):
    """n > 1: every choice is a request of its own that guesses; greedy choices equal plain
    decoding's, seeded sampled ones are reproducible."""
    greedy = _greedy(n=3, max_tokens=40)
    ref = plain.generate(prompts[0], greedy, use_tqdm=False)[0].outputs
    before = spec.engine.speculator.counters.verified_requests
    got = spec.generate(prompts[0], greedy, use_tqdm=False)[0].outputs
    assert spec.engine.speculator.counters.verified_requests - before >= 3
    assert [o.token_ids for o in got] == [o.token_ids for o in ref] and len(got) == 3
    sampled = SamplingParams(n=3, temperature=0.8, seed=11, max_tokens=30)
    once, again = (spec.generate(prompts[1], sampled, use_tqdm=False)[0].outputs
                   for _ in range(2))
    assert [o.token_ids for o in once] == [o.token_ids for o in again]


RECORD = {"type": "object", "additionalProperties": False,
          "required": ["name", "city", "zip"],
          "properties": {"name": {"type": "string"}, "city": {"type": "string"},
                         "zip": {"type": "string", "pattern": "^[0-9]{5}$"}}}


def _copy_prompt(plain) -> dict:
    tok = plain.get_tokenizer()
    ask = ('Copy this customer record exactly, as JSON: {"name": "Ada Lovelace", '
           '"city": "London", "zip": "10001"}. Then copy it again.')
    text = tok.apply_chat_template([{"role": "user", "content": ask}],
                                   add_generation_prompt=True, tokenize=False)
    return {"prompt_token_ids": tok.encode(text, add_special_tokens=False)}


def test_structured_requests_guess_under_their_grammar(plain, spec, prompts):
    """Guesses of a constrained request are cut where its grammar rejects them and each
    verification row is masked as the grammar stands after the guesses before it: the
    output is the plain one, token for token (the grammar completing inside an accepted
    run ends it there, "stop"), and the requests did guess."""
    structured = [StructuredOutput("json_schema", json.dumps(RECORD)),
                  StructuredOutput("json_object"),
                  StructuredOutput("regex", r"[A-Z][a-z]+ [A-Z][a-z]+, [A-Za-z ]{1,40}\.")]
    counters = spec.engine.speculator.counters
    for so in structured:
        for prompt in (_copy_prompt(plain), prompts[0]):
            before = counters.verified_requests
            ref = plain.generate(prompt, _greedy(structured=so, max_tokens=60), use_tqdm=False)
            got = spec.generate(prompt, _greedy(structured=so, max_tokens=60), use_tqdm=False)
            _same(ref, got)
            if prompt is not prompts[0]:
                assert counters.verified_requests > before, so  # it guessed
    done = spec.generate(_copy_prompt(plain), _greedy(
        structured=structured[0], max_tokens=60), use_tqdm=False)[0].outputs[0]
    assert done.finish_reason == "stop" and json.loads(done.text)["zip"] == "10001"


def test_sampled_structured_requests_guess_and_keep_to_the_schema(spec, plain):
    """Rejection sampling over masked rows: every seeded sampled output is a document of
    the schema, and the same seed gives the same document."""
    import jsonschema

    params = [SamplingParams(temperature=0.7, seed=s, max_tokens=80, structured=StructuredOutput(
        "json_schema", json.dumps(RECORD))) for s in range(6)]
    counters = spec.engine.speculator.counters
    before = counters.accepted_tokens
    first = spec.generate([_copy_prompt(plain)] * 6, params, use_tqdm=False)
    assert counters.accepted_tokens > before
    for out in first:
        if out.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(out.outputs[0].text), RECORD)
    _same(first, spec.generate([_copy_prompt(plain)] * 6, params, use_tqdm=False))


def test_live_tuning_turns_it_off_and_on(spec, prompts):
    from dataclasses import replace

    from baton.engine.spec.config import SpeculativeConfig

    engine = spec.engine
    live = engine.config.live_settings
    off = replace(live, scheduler=replace(live.scheduler, speculative=SpeculativeConfig()))
    engine.reconfigure(off)
    before = engine.speculator.counters.proposed_tokens
    spec.generate(prompts[0], _greedy(max_tokens=30), use_tqdm=False)
    assert engine.speculator.counters.proposed_tokens == before
    engine.reconfigure(live)
    spec.generate(prompts[1], _greedy(max_tokens=30), use_tqdm=False)
    assert engine.speculator.counters.proposed_tokens > before


def test_rejection_sampling_keeps_the_distribution(kernel_cache, plain):
    """Per position, the tokens of many sampled continuations with speculation are drawn
    from the same distribution as without it (chi-squared two-sample test, p > 0.001 at
    each position), while guesses are both kept and rejected."""
    from scipy.stats import chi2_contingency

    many = _engine(kernel_cache, {**SPEC, "disable_by_batch_size": 512})
    prompt = "1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2 3 4 5 1 2"  # a pattern lookup can guess
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True)
    draws = 300
    runs = {name: [o.outputs[0].token_ids for o in llm.generate([prompt] * draws, params,
                                                                 use_tqdm=False)]
            for name, llm in (("plain", plain), ("spec", many))}
    c = many.engine.speculator.counters
    assert 0 < c.accepted_tokens < c.proposed_tokens
    for pos in range(1, 6):
        tables = {name: [ids[pos] for ids in runs[name]] for name in runs}
        support = sorted(set(tables["plain"]) | set(tables["spec"]))
        common = [t for t in support
                  if tables["plain"].count(t) + tables["spec"].count(t) >= 10]
        counts = [[sum(1 for t in tables[name] if t == tok) for tok in common]
                  + [sum(1 for t in tables[name] if t not in common)] for name in runs]
        counts = [[a, b] for a, b in zip(*counts) if a + b > 0]
        assert chi2_contingency(counts).pvalue > 1e-3, (pos, counts)


def test_suffix_method_guesses_from_other_requests_outputs(kernel_cache, plain):
    """`suffix`: a request that repeats an earlier one's answer guesses it from the index
    (its prompt has nothing to look up), exactly."""
    llm = _engine(kernel_cache, {**SPEC, "method": "suffix"})
    prompt = "Name three colours of the rainbow."
    ref = plain.generate(prompt, _greedy(max_tokens=40), use_tqdm=False)
    _same(ref, llm.generate(prompt, _greedy(max_tokens=40), use_tqdm=False))
    before = llm.engine.speculator.counters.accepted_tokens
    _same(ref, llm.generate(prompt, _greedy(max_tokens=40), use_tqdm=False))
    assert llm.engine.speculator.counters.accepted_tokens - before >= 20
