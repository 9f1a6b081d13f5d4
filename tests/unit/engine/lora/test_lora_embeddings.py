"""LoRA adapters of the token embedding and the LM head (PEFT's `lora_embedding_A/B` and a
LoRA linear over `lm_head`) served against transformers + peft (float32, tiny random Llama,
its head tied to its embedding or not): greedy tokens, the first sampled token's logprobs
and prompt logprobs, mixed in one batch with the base model and a decoder-linears adapter."""

from __future__ import annotations

import pytest
import torch

from baton import LLM, SamplingParams
from tests.unit.engine.lora.tiny_lora import ALL_LINEARS, save_adapter
from tests.unit.engine.models.parity import hf_first_logprobs, hf_greedy, prompts_for
from tests.unit.engine.tiny_checkpoint import save_tiny_llama

MAX_TOKENS = 8


@pytest.fixture(scope="module", params=[False, True], ids=["untied", "tied"])
def models(request, tmp_path_factory):
    from transformers import LlamaForCausalLM

    root = tmp_path_factory.mktemp("lora_embed")
    save_tiny_llama(root / "base", tie_word_embeddings=request.param)
    base = LlamaForCausalLM.from_pretrained(root / "base", dtype=torch.float32).eval()
    adapters = {
        "edges": save_adapter(base, root / "edges", seed=4, r=8,
                              targets=["embed_tokens", "lm_head", "q_proj"]),
        "embed": save_adapter(base, root / "embed", seed=5, r=4, targets=["embed_tokens"],
                              alpha=32),
        "all": save_adapter(base, root / "all", seed=6, r=8,
                            targets=[*ALL_LINEARS, "lm_head"]),
    }
    return root, base, {name: (root / name, m) for name, m in adapters.items()}


@torch.inference_mode()
def hf_prompt_logprobs(hf, ids: list[int]) -> torch.Tensor:
    """(len(ids) - 1,) logprob of each prompt token after the first, given what precedes it."""
    logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    return torch.log_softmax(logits, dim=-1).gather(1, torch.tensor(ids[1:]).unsqueeze(1))[:, 0]


def test_embedding_and_head_adapters_match_peft(models):
    root, base, adapters = models
    llm = LLM(str(root / "base"), skip_tokenizer_init=True, dtype="float32", block_size=16,
              max_num_batched_tokens=32, max_loras=3,
              lora_modules=[f"{n}={p}" for n, (p, _) in adapters.items()])
    prompts = prompts_for(1000, lengths=(5, 40, 23), seed=3)
    names = [None, "edges", "embed", "all"]
    hf = {n: base if n is None else adapters[n][1] for n in names}
    refs = {n: hf_greedy(hf[n], prompts, MAX_TOKENS) for n in names}
    assert len({tuple(map(tuple, r)) for r in refs.values()}) == 4, "adapters change nothing"
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5,
                            prompt_logprobs=0)
    batch = [p for p in prompts for _ in names]
    loras = [n for _ in prompts for n in names]
    outs = llm.generate(batch, params, use_tqdm=False, lora_request=loras)
    for i, (out, name, ids) in enumerate(zip(outs, loras, batch)):
        assert out.outputs[0].token_ids == refs[name][i // len(names)], (name, i)
        first = hf_first_logprobs(hf[name], ids)
        for token, got in out.outputs[0].logprobs[0].top:
            assert abs(got - first[token].item()) <= 1e-4, (name, token)
        want = hf_prompt_logprobs(hf[name], ids)
        got = [entry.logprob for entry in out.prompt_logprobs[1:]]
        assert torch.allclose(torch.tensor(got), want, atol=1e-4), name
    llm.engine.check_integrity()
