"""Exactness against Hugging Face transformers on tiny random checkpoints made here.

No weights can be downloaded, so each architecture's test builds its model with transformers
itself (`config_cls(**small sizes)`, `from_config` under a fixed seed, `save_pretrained`) and
`check_parity` compares Baton with it in float32:
- the first step's distribution: top-k logprobs of the first generated token;
- greedy tokens for several prompts, through chunked prefill (a small token budget),
  prefix-cache hits (the prompts run twice, and prompts sharing a long prefix) and
  preemption (a KV pool too small for every request at once).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

from baton import LLM, SamplingParams

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


def save_tiny(config, model_cls, path: Path, tokenizer_dir: Path, seed: int = 0,
              weight_scale: float = 4.0, init=None):
    """Build `model_cls(config)` with random weights (scaled up so greedy paths differ),
    save it with the bundled tokenizer's files under `path`; returns the HF model (eval,
    float32). `init(model)` may adjust weights first (biases, norms)."""
    torch.manual_seed(seed)
    model = model_cls(config).eval().float()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(weight_scale)
        if init is not None:
            init(model)
    model.save_pretrained(path)
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_dir / name, path / name)
    return model


def prompts_for(vocab_size: int, lengths=(3, 37, 90, 150), seed: int = 1) -> list[list[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


@torch.inference_mode()
def hf_greedy(hf, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    out = []
    for ids in prompts:
        gen = hf.generate(torch.tensor([ids]), max_new_tokens=max_tokens, do_sample=False,
                          eos_token_id=None, pad_token_id=0, min_new_tokens=max_tokens)
        out.append(gen[0, len(ids):].tolist())
    return out


@torch.inference_mode()
def hf_first_logprobs(hf, ids: list[int]) -> torch.Tensor:
    logits = hf(torch.tensor([ids])).logits[0, -1].float()
    return torch.log_softmax(logits, dim=-1)


def check_parity(path: Path, hf, prompts: list[list[int]] | None = None, max_tokens: int = 10,
                 atol: float = 1e-4, **llm_kwargs) -> LLM:
    """Assert Baton (float32) equals `hf` on `prompts` as the module docstring says;
    returns the LLM (for further checks)."""
    prompts = prompts or prompts_for(hf.config.get_text_config().vocab_size)
    refs = hf_greedy(hf, prompts, max_tokens)
    assert len({t for r in refs for t in r}) > 3, "degenerate model: greedy paths all alike"
    greedy = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, logprobs=5)
    kwargs = dict(dtype="float32", block_size=16, max_num_batched_tokens=32) | llm_kwargs
    llm = LLM(str(path), **kwargs)
    for round_ in range(2):  # the second round hits the prefix cache
        outs = llm.generate(prompts, greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == refs, f"round {round_}"
    for ids, out in zip(prompts, outs):
        ref = hf_first_logprobs(hf, ids)
        first = out.outputs[0].logprobs[0]
        assert len(first.top) == 5
        for token, got in first.top:
            assert abs(got - ref[token].item()) <= atol, (token, got, ref[token].item())
    # Shared prefixes: the later prompts reuse the first one's cached blocks.
    base = prompts[-1]
    shared = [base[:100] + p[:20] for p in prompts[:3]]
    outs = llm.generate(shared, greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_greedy(hf, shared, max_tokens)
    return llm


def check_preemption(path: Path, hf, prompts: list[list[int]], max_tokens: int = 24,
                     **llm_kwargs) -> None:
    """Greedy tokens still equal HF's when the pool is too small for every request at once
    (requests are preempted and recomputed)."""
    refs = hf_greedy(hf, prompts, max_tokens)
    need = max(-(-(len(p) + max_tokens) // 16) for p in prompts)
    kwargs = dict(dtype="float32", block_size=16, max_num_batched_tokens=64,
                  num_kv_blocks=need + 2, enable_prefix_caching=False) | llm_kwargs
    llm = LLM(str(path), **kwargs)
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=max_tokens,
                                                ignore_eos=True), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == refs
    assert llm.engine.scheduler.num_preemptions > 0
