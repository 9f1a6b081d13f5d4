"""The sampler's device part never waits on the host: it runs whole on `meta` logits (no
values: any read-back, boolean-mask indexing or data-dependent shape raises there), draws
only with generators of the logits' device, and takes its numbers in one host → device
copy; vectorised constraints keep each row's own semantics."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from baton.common.sampling_params import SamplingParams
from baton.engine.request import Request
from baton.engine.sampler import Sampler
from baton.engine.structured.masks import GrammarMasks

V = 64


def make_req(rid="r", eos=None, outputs=(), prompt=(1, 2, 3), **params) -> Request:
    p = SamplingParams(**params)
    req = Request(rid, list(prompt), p, max_tokens=p.max_tokens or 16, eos_token_id=eos)
    req.output_token_ids = list(outputs)
    return req


def mixed_batch() -> list[Request]:
    """Every kind of row the sampler handles, in one batch."""
    return [
        make_req("greedy", temperature=0),
        make_req("temp", temperature=0.7),
        make_req("top_k", temperature=1.0, top_k=5),
        make_req("top_p", temperature=1.0, top_p=0.8),
        make_req("min_p", temperature=1.0, min_p=0.1),
        make_req("penalties", outputs=[4, 4, 9], temperature=0, frequency_penalty=0.5,
                 presence_penalty=0.3, repetition_penalty=1.3),
        make_req("bias", temperature=0.9, logit_bias={3: 5.0, 8: -100.0}),
        make_req("bans", eos=2, temperature=0, min_tokens=4, stop_token_ids=[6]),
        make_req("seeded", temperature=1.0, seed=11, logprobs=3),
        make_req("greedy_lp", temperature=0, logprobs=0),
        make_req("grammar", temperature=1.0, seed=5),
    ]


class Recorder(TorchFunctionMode):
    """Records the generators passed to `exponential_` and counts host -> device copies
    into `device` (a tensor made from host data there, or copied there from the CPU)."""

    def __init__(self, device: torch.device) -> None:
        super().__init__()
        self.device = device
        self.generators: list[torch.Generator | None] = []
        self.copies = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = getattr(func, "__name__", "")
        if name == "exponential_":
            self.generators.append(kwargs.get("generator"))
        on_device = isinstance(out, torch.Tensor) and out.device == self.device
        if on_device and (name in ("tensor", "as_tensor")
                          or name in ("to", "cuda") and args[0].device.type == "cpu"
                          or name == "copy_" and args[1].device.type == "cpu"):
            self.copies += 1
        return out


def test_the_device_part_runs_on_meta_logits_with_one_copy_in():
    meta = torch.device("meta")
    reqs = mixed_batch()
    logits = torch.empty(len(reqs), V, device=meta)
    failed: dict[str, str] = {}
    with Recorder(meta) as rec:
        sample = Sampler().sample_on_device(logits, reqs, failed)
    assert failed == {}
    assert sample.tokens.device == meta and sample.tokens.shape == (len(reqs),)
    assert sample.logprob_rows == [8, 9] and sample.logprob_ks == [3, 0]
    assert sample.logprobs.device == meta and sample.logprobs.shape == (2, 2 + 2 * 3)
    assert rec.copies == 1  # every row's numbers in one host -> device copy
    assert rec.generators  # it drew
    # No generator of another device (meta has none: torch refuses CPU ones there).
    assert all(g is None or g.device == meta for g in rec.generators)


def test_grammar_masks_apply_on_the_device_too():
    meta = torch.device("meta")
    reqs = mixed_batch()
    masks = GrammarMasks([10], torch.full((1, V // 32), -1, dtype=torch.int32))
    sample = Sampler().sample_on_device(torch.empty(len(reqs), V, device=meta), reqs, {},
                                        masks)
    assert sample.tokens.device == meta


def test_generators_are_made_on_the_logits_device():
    reqs = mixed_batch()
    logits = torch.randn(len(reqs), V, generator=torch.Generator().manual_seed(0))
    with Recorder(logits.device) as rec:
        Sampler()(logits, reqs, {})
    assert rec.generators and all(g.device == logits.device for g in rec.generators)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_every_row_kind_samples_and_a_resumed_seed_continues():
    cuda = torch.device("cuda", torch.cuda.current_device())
    reqs = mixed_batch()
    logits = torch.randn(len(reqs), V, device=cuda)
    with Recorder(cuda) as rec:
        failed: dict[str, str] = {}
        tokens, lps = Sampler()(logits, reqs, failed)
    assert failed == {} and len(tokens) == len(reqs)
    assert all(g.device == cuda for g in rec.generators)
    row = logits[1:2] * 0.1  # flat: the draws decide
    s = Sampler()
    stream = [s(row, [make_req("a", temperature=1.0, seed=4)])[0][0] for _ in range(4)]
    resumed = make_req("b", temperature=1.0, seed=4)
    resumed.num_presampled = 2  # replayed on the GPU: the same numbers
    s2 = Sampler()
    assert [s2(row, [resumed])[0][0] for _ in range(2)] == stream[2:]


def test_a_seeded_stream_resumes_where_it_left_off():
    row = torch.randn(1, V, generator=torch.Generator().manual_seed(1)) * 0.1  # flat
    s = Sampler()
    req = make_req("a", temperature=1.0, seed=9)
    stream = [s(row, [req])[0][0] for _ in range(6)]
    resumed = make_req("b", temperature=1.0, seed=9)
    resumed.num_presampled = 3  # the draws another engine made
    s2 = Sampler(seed=5)
    assert [s2(row, [resumed])[0][0] for _ in range(3)] == stream[3:]


def test_penalties_of_rows_of_different_lengths_do_not_leak():
    """One padded (P, L) tensor for every penalised row: a row's choice is its own."""
    lg = torch.zeros(3, V)
    lg[:, 4], lg[:, 7], lg[:, 9] = 1.0, 0.9, 0.8
    reqs = [make_req("a", temperature=0, outputs=[4, 4, 4, 4, 7], frequency_penalty=0.2),
            make_req("b", temperature=0, outputs=[9], repetition_penalty=2.0),
            make_req("c", temperature=0, outputs=[V + 5, 4], presence_penalty=0.5)]
    together, _ = Sampler()(lg, reqs)
    alone = [Sampler()(lg[i:i + 1], [r])[0][0] for i, r in enumerate(reqs)]
    assert together == alone == [9, 4, 7]  # an id past the vocabulary is ignored


def test_a_banned_id_outside_the_vocabulary_fails_that_row_alone():
    lg = torch.randn(2, V, generator=torch.Generator().manual_seed(2))
    bad = make_req("bad", eos=1, temperature=0, min_tokens=3)
    bad.sampling_params.stop_token_ids = [V + 1]  # past make_request's check
    good = make_req("good", eos=int(lg[1].argmax()), temperature=0, min_tokens=3)
    failed: dict[str, str] = {}
    toks, _ = Sampler()(lg, [bad, good], failed)
    assert list(failed) == ["bad"] and "banned" in failed["bad"]
    assert toks[1] == int(lg[1].topk(2).indices[1])  # its own ban held
    with pytest.raises(IndexError, match="bad"):
        Sampler()(lg, [bad, good])


def test_top_k_rows_keep_their_own_k_in_a_mixed_batch():
    lg = torch.randn(3, V, generator=torch.Generator().manual_seed(3)) * 3
    reqs = [make_req("k1", temperature=2.0, top_k=1), make_req("off", temperature=0),
            make_req("k3", temperature=2.0, top_k=3)]
    s = Sampler()
    seen: set[int] = set()
    for _ in range(100):
        toks, _ = s(lg, reqs)
        assert toks[0] == int(lg[0].argmax()) and toks[1] == int(lg[1].argmax())
        seen.add(toks[2])
    assert seen <= set(lg[2].topk(3).indices.tolist()) and len(seen) > 1


def test_a_row_that_saw_no_id_in_the_vocabulary_is_left_alone():
    lg = torch.zeros(1, V)
    lg[0, 0], lg[0, 1] = 1.0, 0.9  # id 0: the padding of a row without ids
    req = make_req("a", prompt=[V + 1], temperature=0, repetition_penalty=4.0,
                   frequency_penalty=1.0)
    assert Sampler()(lg, [req])[0] == [0]
