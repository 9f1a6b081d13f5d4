"""Multi-LoRA on the device: one batch mixing two adapters (ranks 16 and 8, all linears and
a few) with the base model, their deltas on `baton_kernels.lora`'s Triton kernels: in bf16
the adapters change what the base model says; in float32 each step's top logprobs equal
(1e-3) the same engine's with the deltas in torch matmuls, tokens parting only at a tie."""

from __future__ import annotations

import gc

import pytest
import torch

from baton import LLM, SamplingParams
from benchmarks.lora_adapters import write_random_adapter
from tests.gpu.models import TINY, prompt_ids, save_random_llama

SHARE = {"gpu_memory_utilization": 0.3}
NAMES = ["a", None, "b"]


@pytest.fixture(scope="module")
def lora_base(tmp_path_factory, model_dir):
    root = tmp_path_factory.mktemp("tiny-lora")
    save_random_llama(root / "base", model_dir, TINY, torch.device("cuda"))
    torch.cuda.empty_cache()
    write_random_adapter(root / "base", root / "a", seed=1, r=16, std=0.1)
    write_random_adapter(root / "base", root / "b", seed=2, r=8, std=0.1,
                         targets=("q_proj", "v_proj", "down_proj"))
    return root


def run(root, prompts, dtype: str) -> tuple[str, list[tuple[list[int], list[dict[int, float]]]]]:
    llm = LLM(str(root / "base"), device="cuda", dtype=dtype, **SHARE, max_loras=2,
              lora_modules=[f"a={root / 'a'}", f"b={root / 'b'}"])
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=5)
    batch = [p for p in prompts for _ in NAMES]
    outs = llm.generate(batch, params, use_tqdm=False,
                        lora_request=[n for _ in prompts for n in NAMES])
    llm.engine.check_integrity()
    kernel = type(next(iter(llm.engine.runner.lora.layers.values())).native).__name__
    del llm
    gc.collect()
    torch.cuda.empty_cache()
    return kernel, [(o.outputs[0].token_ids, [dict(lp.top) for lp in o.outputs[0].logprobs])
                    for o in outs]


def test_mixed_adapters_on_the_triton_kernels(lora_base, monkeypatch):
    from baton.engine.lora import manager

    prompts = prompt_ids(4, TINY["vocab_size"], seed=7)
    kernel, served = run(lora_base, prompts, "bfloat16")  # what serving runs: it serves
    assert kernel == "TritonLoRA"
    for i in range(len(prompts)):  # and each adapter's tokens are not the base model's
        rows = served[i * len(NAMES):(i + 1) * len(NAMES)]
        assert rows[0][0] != rows[1][0] and rows[2][0] != rows[1][0], rows
    # float32, against the deltas in torch matmuls: the same to the sums' order
    kernel, triton = run(lora_base, prompts, "float32")
    assert kernel == "TritonLoRA"
    monkeypatch.setattr(manager, "_delta_kernel", lambda *args: None)
    kernel, torch_path = run(lora_base, prompts, "float32")
    assert kernel == "NoneType"
    for (tokens, lps), (ref_tokens, refs) in zip(triton, torch_path):
        for step, (lp, ref) in enumerate(zip(lps, refs)):
            for token in set(lp) & set(ref):
                assert abs(lp[token] - ref[token]) < 1e-3, (step, token, lp, ref)
            if tokens[step] != ref_tokens[step]:  # only at a tie to the sums' order
                best = sorted(ref.values(), reverse=True)
                assert best[0] - best[1] < 1e-3, (step, tokens, ref_tokens, ref)
                break
