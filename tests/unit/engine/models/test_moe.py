"""Mixtral and Qwen3-MoE: the expert computation against a per-token reference under
adversarial routings, loading under tensor parallelism, and parity with transformers on tiny
random checkpoints (per-expert hub names and transformers' stacked names)."""

from __future__ import annotations

import json
import time

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import save_file

from baton import SamplingParams
from baton.engine.distributed import TPGroup
from baton.engine.models import fused_moe
from baton.engine.models.fused_moe import fused_experts, grouped_matmul, looped_matmul, route
from baton.engine.models.moe import SparseMoE
from tests.unit.engine.models.parity import (
    check_parity,
    check_preemption,
    hf_first_logprobs,
    prompts_for,
    save_tiny,
)

H, I, E = 64, 48, 8


def reference_moe(x, gate_up, down, weights, ids):
    """One token, one expert at a time: sum_k w * down(SiLU(gate) * up)."""
    out = torch.zeros(x.shape, dtype=torch.float32)
    n = gate_up.shape[1] // 2
    for t in range(x.shape[0]):
        for w, e in zip(weights[t].tolist(), ids[t].tolist()):
            gate_up_t = gate_up[e].float() @ x[t].float()  # (2I,)
            act = F.silu(gate_up_t[:n]) * gate_up_t[n:]  # (I,)
            out[t] += w * (down[e].float() @ act)  # (h,)
    return out


def random_experts(dtype=torch.float32, seed=0, num_experts=E):
    gen = torch.Generator().manual_seed(seed)
    gate_up = torch.randn(num_experts, 2 * I, H, generator=gen) / H ** 0.5
    down = torch.randn(num_experts, H, I, generator=gen) / I ** 0.5
    return gate_up.to(dtype), down.to(dtype)


def routing(kind: str, T: int, k: int, gen: torch.Generator):
    if kind == "one-expert":  # every pair on the last expert; the others empty
        ids = torch.full((T, k), E - 1)
    elif kind == "same-expert-twice":  # a token's k slots on one expert
        ids = torch.randint(0, E, (T, 1), generator=gen).expand(T, k)
    else:  # random distinct experts per token, some experts left empty
        ids = torch.stack([torch.randperm(E // 2, generator=gen)[:k] * 2 for _ in range(T)])
    weights = torch.rand(T, k, generator=gen)
    return weights, ids


@pytest.fixture(params=["grouped_mm", "looped"])
def matmul_path(request, monkeypatch):
    if request.param == "looped":
        monkeypatch.setattr(fused_moe, "grouped_mm_works", lambda *key: False)
    elif not fused_moe.grouped_mm_works(torch.float32, "cpu", H, 2 * I):
        pytest.skip("torch._grouped_mm does not run on this CPU build")
    return request.param


@pytest.mark.parametrize("kind", ["one-expert", "same-expert-twice", "random"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 2), (37, 2), (64, 3)])
def test_experts_match_per_token_reference(kind, T, k, matmul_path):
    gen = torch.Generator().manual_seed(T * 10 + k)
    x = torch.randn(T, H, generator=gen)
    gate_up, down = random_experts()
    weights, ids = routing(kind, T, k, gen)
    got = fused_experts(x, gate_up, down, weights, ids)
    want = reference_moe(x, gate_up, down, weights, ids)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_identical_tokens_get_identical_outputs(matmul_path):
    x = torch.randn(1, H).expand(20, H).contiguous()  # (20, h), one row repeated
    gate_up, down = random_experts()
    weights, ids = route(torch.randn(1, E).expand(20, E), 2, renormalize=True)
    got = fused_experts(x, gate_up, down, weights, ids)
    assert torch.equal(got, got[:1].expand_as(got))
    torch.testing.assert_close(got, reference_moe(x, gate_up, down, weights, ids))


def test_empty_step_gives_empty_output():
    gate_up, down = random_experts()
    out = fused_experts(torch.empty(0, H), gate_up, down, torch.empty(0, 2),
                        torch.empty(0, 2, dtype=torch.long))
    assert out.shape == (0, H)


def test_grouped_and_looped_matmul_agree_with_empty_groups():
    gen = torch.Generator().manual_seed(3)
    counts = torch.tensor([0, 5, 0, 0, 9, 1, 0, 0])
    rows = torch.randn(int(counts.sum()), H, generator=gen)
    weight = torch.randn(E, 2 * I, H, generator=gen)
    want = torch.cat([rows[0:5] @ weight[1].T, rows[5:14] @ weight[4].T, rows[14:] @ weight[5].T])
    torch.testing.assert_close(looped_matmul(rows, weight, counts), want)
    torch.testing.assert_close(grouped_matmul(rows, weight, counts), want)


def test_route_renormalizes_only_when_asked():
    logits = torch.randn(10, E)
    probs = torch.softmax(logits, dim=-1)
    raw, ids = route(logits, 2, renormalize=False)
    assert torch.equal(ids, probs.topk(2).indices)
    torch.testing.assert_close(raw, probs.topk(2).values)
    normed, same = route(logits, 2, renormalize=True)
    assert torch.equal(same, ids)
    torch.testing.assert_close(normed.sum(-1), torch.ones(10))
    torch.testing.assert_close(normed, raw / raw.sum(-1, keepdim=True))


def per_expert_tensors(gate_up, down):
    """(name, tensor) per expert as Mixtral's hub checkpoints store them."""
    for e in range(gate_up.shape[0]):
        yield f"experts.{e}.w1", (e, "gate"), gate_up[e, :I]
        yield f"experts.{e}.w3", (e, "up"), gate_up[e, I:]
        yield f"experts.{e}.w2", (e, "down"), down[e]


def load_block(block: SparseMoE, router, gate_up, down) -> SparseMoE:
    block.gate.weight.data.copy_(router)
    with torch.no_grad():
        for _, shard, tensor in per_expert_tensors(gate_up, down):
            param = block.down if shard[1] == "down" else block.gate_up
            param.weight_loader(param, tensor, shard)
    return block


@pytest.mark.parametrize("renormalize", [True, False])
def test_block_matches_reference_and_tensor_parallel_halves_sum_to_it(renormalize):
    gate_up, down = random_experts(seed=5)
    router = torch.randn(E, H)
    x = torch.randn(33, H)
    whole = load_block(SparseMoE(H, I, E, 2, renormalize), router, gate_up, down)
    weights, ids = route(x @ router.T, 2, renormalize)
    torch.testing.assert_close(whole(x), reference_moe(x, gate_up, down, weights, ids))
    halves = [load_block(SparseMoE(H, I, E, 2, renormalize, tp=TPGroup(rank, 2)),
                         router, gate_up, down) for rank in range(2)]
    assert halves[0].gate_up.shape == (E, I, H) and halves[1].down.shape == (E, H, I // 2)
    torch.testing.assert_close(halves[0](x) + halves[1](x), whole(x))


def test_block_in_bf16_stays_close_to_float32():
    gate_up, down = random_experts(seed=6)
    router = torch.randn(E, H)
    x = torch.randn(50, H)
    exact = load_block(SparseMoE(H, I, E, 2, True), router, gate_up, down)(x)
    half = load_block(SparseMoE(H, I, E, 2, True), router, gate_up, down).to(torch.bfloat16)
    got = half(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), exact, rtol=0.05, atol=0.05)


@pytest.mark.parametrize("arch,extra", [
    ("MixtralForCausalLM", dict(num_local_experts=4, num_experts_per_tok=5)),
    ("Qwen3MoeForCausalLM", dict(num_experts=4, num_experts_per_tok=0,
                                 moe_intermediate_size=32)),
])
def test_config_with_more_experts_per_token_than_experts_is_refused(arch, extra):
    from baton.engine.models.config import ModelConfig
    from baton.engine.models.registry import model_class

    cfg = ModelConfig.from_dict(dict(architectures=[arch], vocab_size=100, hidden_size=H,
                                     intermediate_size=I, num_hidden_layers=1,
                                     num_attention_heads=4, **extra))
    with torch.device("meta"), pytest.raises(ValueError, match="num_experts_per_tok"):
        model_class(arch)(cfg, 64)


# -- parity with transformers ----------------------------------------------------------------

COMMON = dict(vocab_size=1001, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=512, bos_token_id=1,
              eos_token_id=2, tie_word_embeddings=False)

CASES = {
    "mixtral-8x-top2": (transformers.MixtralConfig, transformers.MixtralForCausalLM,
                        dict(intermediate_size=48, num_local_experts=8, num_experts_per_tok=2)),
    "qwen3moe-norm-topk-dense0": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                                  dict(intermediate_size=80, moe_intermediate_size=32,
                                       num_experts=8, num_experts_per_tok=2, head_dim=32,
                                       norm_topk_prob=True, mlp_only_layers=[0])),
    "qwen3moe-raw-topk-dense1": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                                 dict(intermediate_size=80, moe_intermediate_size=32,
                                      num_experts=4, num_experts_per_tok=3, head_dim=16,
                                      norm_topk_prob=False, mlp_only_layers=[1])),
    "qwen3moe-sparse-step2": (transformers.Qwen3MoeConfig, transformers.Qwen3MoeForCausalLM,
                              dict(intermediate_size=80, moe_intermediate_size=32,
                                   num_experts=8, num_experts_per_tok=2, decoder_sparse_step=2,
                                   norm_topk_prob=True)),
}


def build(case: str, path, model_dir, stacked: bool = False):
    """The case's tiny HF model saved under `path`; with `stacked`, its weights rewritten
    in transformers' in-memory names (`mlp.experts.gate_up_proj`, ...)."""
    config_cls, model_cls, extra = CASES[case]

    def init(model):  # q/k norm weights away from 1 so a missing norm shows
        for layer in model.model.layers:
            for norm in ("q_norm", "k_norm"):
                if hasattr(layer.self_attn, norm):
                    getattr(layer.self_attn, norm).weight.uniform_(0.5, 1.5)

    hf = save_tiny(config_cls(**COMMON, **extra), model_cls, path, model_dir, init=init)
    if stacked:
        for file in path.glob("*.safetensors"):
            file.unlink()
        state = {k: v.contiguous() for k, v in hf.state_dict().items()}
        save_file(state, str(path / "model.safetensors"), metadata={"format": "pt"})
        (path / "model.safetensors.index.json").unlink(missing_ok=True)
    return hf


def first_logprob_gap(llm, hf, prompts) -> float:
    """Largest |Baton - transformers| over the top-5 logprobs of each prompt's first token."""
    params = SamplingParams(temperature=0, max_tokens=1, logprobs=5)
    gap = 0.0
    for ids, out in zip(prompts, llm.generate(prompts, params, use_tqdm=False)):
        ref = hf_first_logprobs(hf, ids)
        gap = max(gap, max(abs(got - ref[t].item()) for t, got in out.outputs[0].logprobs[0].top))
    return gap


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_transformers(case, tmp_path, model_dir):
    hf = build(case, tmp_path, model_dir)
    names = json.dumps(sorted(_saved_names(tmp_path)))
    assert ".experts.0." in names  # save_pretrained writes the hub's per-expert names
    llm = check_parity(tmp_path, hf)
    prompts = prompts_for(COMMON["vocab_size"])
    print(f"\n{case}: max first-token logprob diff {first_logprob_gap(llm, hf, prompts):.2e}")


@pytest.mark.parametrize("case", ["mixtral-8x-top2", "qwen3moe-norm-topk-dense0"])
def test_loads_transformers_stacked_expert_names(case, tmp_path, model_dir):
    hf = build(case, tmp_path, model_dir, stacked=True)
    assert any(n.endswith("mlp.experts.gate_up_proj") for n in _saved_names(tmp_path))
    check_parity(tmp_path, hf)


def test_preemption_keeps_parity(tmp_path, model_dir):
    hf = build("mixtral-8x-top2", tmp_path, model_dir)
    check_preemption(tmp_path, hf, prompts_for(COMMON["vocab_size"], (40, 60, 70, 50)))


def test_bf16_on_cpu_packs_the_router_and_keeps_experts_stacked(tmp_path, model_dir):
    """bfloat16 on CPU: linears packed (the router too), the stacked experts left as
    Parameters with SiLU * up through the native kernel; close to float32 transformers."""
    from baton import LLM

    hf = build("mixtral-8x-top2", tmp_path, model_dir)
    llm = LLM(str(tmp_path), dtype="bfloat16", block_size=16, max_num_batched_tokens=64)
    moe = llm.engine.runner.model.layers[1].mlp
    assert type(moe.gate).__name__ == "PackedLinear"
    assert isinstance(moe.gate_up, torch.nn.Parameter) and moe.gate_up.dtype == torch.bfloat16
    prompts = prompts_for(COMMON["vocab_size"])
    assert first_logprob_gap(llm, hf, prompts) < 0.1


def _saved_names(path) -> list[str]:
    from safetensors import safe_open

    names = []
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            names += list(f.keys())
    return names


# -- speed ------------------------------------------------------------------------------------

def _best_times(fns: dict, rounds: int = 3) -> dict:
    """Best wall time of each function, the candidates interleaved round by round so a
    neighbour's load on the shared CPU falls on all of them alike."""
    best = dict.fromkeys(fns, float("inf"))
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - start)
    return best


@torch.inference_mode()
def test_grouped_experts_beat_a_per_token_loop(monkeypatch):
    """T=256, 8 experts, top-2, h 512, I 1024, float32, one thread: the grouped path
    (torch._grouped_mm, and one matmul per expert) against one matmul chain per (token,
    expert) pair."""
    gen = torch.Generator().manual_seed(0)
    T, h, n = 256, 512, 1024
    gate_up = torch.randn(E, 2 * n, h, generator=gen) / h ** 0.5
    down = torch.randn(E, h, n, generator=gen) / n ** 0.5
    x = torch.randn(T, h, generator=gen)
    weights, ids = route(torch.randn(T, E, generator=gen), 2, renormalize=True)
    has_grouped_mm = fused_moe.grouped_mm_works(torch.float32, "cpu", h, 2 * n)

    def looped():
        with monkeypatch.context() as patch:
            patch.setattr(fused_moe, "grouped_mm_works", lambda *key: False)
            return fused_experts(x, gate_up, down, weights, ids)

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread: the shared CPU's load stalls a team of threads
    try:
        best = _best_times({"grouped": lambda: fused_experts(x, gate_up, down, weights, ids),
                            "looped": looped,
                            "per-token": lambda: reference_moe(x, gate_up, down, weights, ids)})
    finally:
        torch.set_num_threads(threads)
    torch.testing.assert_close(looped(), fused_experts(x, gate_up, down, weights, ids))
    ms = {name: f"{t * 1e3:.1f} ms" for name, t in best.items()}
    print(f"\nT={T} E={E} top-2 h={h} I={n} (_grouped_mm: {has_grouped_mm}): {ms}; "
          f"per-token / grouped {best['per-token'] / best['grouped']:.1f}x, "
          f"per-token / looped {best['per-token'] / best['looped']:.1f}x")
    assert max(best["grouped"], best["looped"]) < best["per-token"]


def test_num_params_counts_every_expert():
    """The weight-size estimates (benchmarks' weight-streaming floor) count all experts."""
    from baton.engine.models.config import ModelConfig

    config = transformers.MixtralConfig(vocab_size=1001, hidden_size=64, intermediate_size=96,
                                        num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, num_local_experts=8,
                                        tie_word_embeddings=False)
    hf = transformers.MixtralForCausalLM(config)
    ours = ModelConfig.from_dict({**config.to_dict(), "architectures": ["MixtralForCausalLM"]})
    assert ours.num_params == sum(p.numel() for p in hf.parameters())
