"""LoRA adapters served against transformers + peft (float32, tiny random Llama): greedy
tokens and first-token logprobs of each adapter and of the base model, batched together in
one step, through chunked prefill and prefix caching; an adapter's prompt never hits another
adapter's or the base's cached blocks."""

from __future__ import annotations

import pytest

from baton import LLM, SamplingParams
from tests.unit.engine.lora.tiny_lora import save_adapter, tiny_base
from tests.unit.engine.models.parity import hf_first_logprobs, hf_greedy, prompts_for

MAX_TOKENS = 8


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """The base (its HF model) and three adapters of different ranks, targets and
    scalings: name -> (path, PEFT model)."""
    root = tmp_path_factory.mktemp("lora")
    base = tiny_base(root / "base")
    adapters = {
        "all": save_adapter(base, root / "all", seed=1, r=8),
        "attn": save_adapter(base, root / "attn", seed=2, r=4,
                             targets=["q_proj", "v_proj"], alpha=32),
        "rs": save_adapter(base, root / "rs", seed=3, r=16, targets=["k_proj", "o_proj",
                                                                      "gate_proj", "down_proj"],
                           use_rslora=True, alpha=4),
    }
    return root, base, {name: (root / name, m) for name, m in adapters.items()}


def make_llm(root, adapters, **kwargs) -> LLM:
    args = dict(skip_tokenizer_init=True, dtype="float32", block_size=16,
                max_num_batched_tokens=32, max_loras=3,
                lora_modules=[f"{n}={p}" for n, (p, _) in adapters.items()]) | kwargs
    return LLM(str(root / "base"), **args)


def test_mixed_batch_matches_peft(models):
    root, base, adapters = models
    prompts = prompts_for(1000, lengths=(3, 37, 90, 50))
    llm = make_llm(root, adapters)
    names = [None, "all", "attn", "rs"]
    refs = {n: hf_greedy(base if n is None else adapters[n][1], prompts, MAX_TOKENS)
            for n in names}
    assert len({tuple(map(tuple, r)) for r in refs.values()}) == 4, "adapters change nothing"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
    # every prompt under every adapter and the base, all in one batch, twice (the second
    # round hits the prefix cache)
    batch = [p for p in prompts for _ in names]
    loras = [n for _ in prompts for n in names]
    for round_ in range(2):
        outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
        for i, (out, name) in enumerate(zip(outs, loras)):
            assert out.outputs[0].token_ids == refs[name][i // len(names)], (round_, name, i)
    for out, name, ids in zip(outs, loras, batch):
        ref = hf_first_logprobs(base if name is None else adapters[name][1], ids)
        for token, got in out.outputs[0].logprobs[0].top:
            assert abs(got - ref[token].item()) <= 1e-4, (name, token)
    llm.engine.check_integrity()


def test_prefixes_never_cross_adapters(models):
    root, base, adapters = models
    llm = make_llm(root, adapters)
    prompt = prompts_for(1000, lengths=(80,), seed=5)[0]
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    # (adapter, cached prompt tokens expected): the base's blocks serve neither adapter,
    # each one's own blocks serve it the second time
    for name, hits in ((None, False), ("all", False), ("attn", False), (None, True),
                       ("all", True), ("attn", True)):
        out = llm.generate([prompt], params, use_tqdm=False, lora_request=name)[0]
        ref = hf_greedy(base if name is None else adapters[name][1], [prompt], 4)[0]
        assert out.outputs[0].token_ids == ref, name
        assert (out.num_cached_tokens > 0) == hits, (name, out.num_cached_tokens)
    llm.engine.check_integrity()


def test_preempted_adapter_requests_recompute_with_their_adapter(models):
    root, base, adapters = models
    prompts = prompts_for(1000, lengths=(60, 45, 70, 52), seed=11)
    names = ["all", None, "attn", "rs"]
    refs = [hf_greedy(base if n is None else adapters[n][1], [p], 24)[0]
            for p, n in zip(prompts, names)]
    # 8 blocks of 16 hold the longest prompt and its output, not all four at once
    llm = make_llm(root, adapters, num_kv_blocks=8, enable_prefix_caching=False,
                   max_num_batched_tokens=64)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
                        use_tqdm=False, lora_request=names)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.scheduler.num_preemptions > 0
