"""logit_bias: added to the raw logits of the biased rows only (one scatter for the batch),
before penalties, truncation and temperature; +100 forces a token, -100 bans it; ids are
checked against the vocabulary when the request is made."""

from __future__ import annotations

import pytest
import torch

from baton import SamplingParams
from baton.engine.request import Request
from baton.engine.sampler import Sampler

V = 64


def make_req(rid="r", **params) -> Request:
    p = SamplingParams(**params)
    return Request(rid, [1, 2, 3], p, max_tokens=p.max_tokens or 16)


def logits(rows=1, seed=0) -> torch.Tensor:
    return torch.randn(rows, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_bias_moves_the_greedy_choice_of_its_row_only():
    lg = logits(3)
    best = lg.argmax(-1).tolist()
    reqs = [make_req("a", temperature=0, logit_bias={5: 100.0}),
            make_req("b", temperature=0),
            make_req("c", temperature=0, logit_bias={best[2]: -100.0})]
    toks, _ = Sampler()(lg, reqs)
    assert toks[0] == 5 and toks[1] == best[1]
    assert toks[2] == int(lg[2].topk(2).indices[1])
    assert torch.equal(lg, logits(3))  # the caller's logits are untouched


def test_bias_comes_before_top_k_and_logprobs_stay_raw():
    lg = logits()
    worst = int(lg[0].argmin())
    req = make_req(temperature=1.5, top_k=1, logprobs=1, logit_bias={worst: 100.0})
    for _ in range(20):
        toks, lps = Sampler()(lg, [req])
        assert toks == [worst]
    raw = torch.log_softmax(lg, -1)
    assert abs(lps[0].logprob - float(raw[0, worst])) < 1e-5


def test_an_id_outside_the_vocabulary_fails_that_row_alone():
    bad = make_req("bad", temperature=0)
    bad.sampling_params.logit_bias = {V + 3: 1.0}  # past make_request's check
    good = make_req("good", temperature=0, logit_bias={7: 100.0})
    failed: dict[str, str] = {}
    toks, _ = Sampler()(logits(2), [bad, good], failed)
    assert list(failed) == ["bad"] and "logit_bias" in failed["bad"]
    assert toks[1] == 7


@pytest.fixture(scope="module")
def core():
    from baton.engine.config import EngineConfig
    from baton.engine.core import EngineCore

    return EngineCore(EngineConfig.from_args(dtype="float32", num_kv_blocks=128, max_num_seqs=8))


def generate(core, rid: str, params: SamplingParams) -> list[int]:
    core.add(core.make_request(rid, core.tokenizer.encode("The capital of France is"), params))
    tokens = []
    while core.has_unfinished_requests():
        tokens += [t for o in core.step() if o.request_id == rid for t in o.new_token_ids]
    return tokens


@pytest.mark.slow
def test_plus_100_forces_a_token_and_minus_100_bans_the_greedy_one(core):
    forced = core.tokenizer.encode(" banana")[0]
    assert generate(core, "f", SamplingParams(temperature=0, max_tokens=4,
                                              logit_bias={forced: 100.0})) == [forced] * 4
    greedy = generate(core, "g", SamplingParams(temperature=0, max_tokens=4))
    banned = generate(core, "b", SamplingParams(temperature=0, max_tokens=4,
                                                logit_bias={greedy[0]: -100.0}))
    assert banned[0] != greedy[0] and greedy[0] not in banned


@pytest.mark.slow
def test_ids_outside_the_vocabulary_are_refused_when_the_request_is_made(core):
    from baton.engine.errors import InvalidRequestError

    vocab = core.model_config.vocab_size
    with pytest.raises(InvalidRequestError) as err:
        core.make_request("x", [1, 2], SamplingParams(logit_bias={vocab: 1.0}))
    assert err.value.param == "logit_bias" and str(vocab) in str(err.value)
