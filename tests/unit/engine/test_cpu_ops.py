"""The fused native CPU ops (add + RMSNorm, SiLU * up, rotary) against the torch code they
replace, in float32 and bfloat16, at decode (1-7 rows) and prefill (1000 rows) sizes, and the
model run through them against the model run through torch."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from baton.engine.models.config import ModelConfig
from baton.engine.models.llama import RMSNorm
from baton.engine.models.loader import load_model
from baton.engine.models.rope import RotaryEmbedding, apply_rotary

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(scope="module")
def ops(native_ops):
    return native_ops


def ordered(t: torch.Tensor) -> torch.Tensor:
    """bfloat16 bit patterns as integers that grow with the value: a difference is in ulps."""
    bits = t.view(torch.int16).int()
    return torch.where(bits < 0, -(bits & 0x7FFF), bits)


def assert_matches(got: torch.Tensor, ref: torch.Tensor) -> None:
    """float32: within a few ulps (summation order, exp polynomial). bfloat16: never more than
    one ulp apart and equal almost everywhere, so a missed or extra rounding step (which moves
    a large share of the elements) fails."""
    assert got.dtype == ref.dtype and got.shape == ref.shape
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, ref, rtol=2e-6, atol=1e-6)
        return
    ulps = (ordered(got) - ordered(ref)).abs()
    # torch's own bf16 kernels reduce in AVX-512 or AVX2 lanes: on AVX2 its summation order
    # moves the norm's scale by a float ulp now and then, which two bf16 roundings can turn
    # into 2 ulps on an element (the share test below still catches a missed rounding step).
    assert ulps.max().item() <= (1 if torch.backends.cpu.get_cpu_capability().startswith(
        "AVX512") else 2)
    assert (ulps > 0).float().mean().item() <= 1e-3


def norm_reference(x, residual, weight, eps):
    norm = RMSNorm(weight.shape[0], eps)
    norm.weight = torch.nn.Parameter(weight, requires_grad=False)
    return norm(x, residual)  # the torch path: no native ops installed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 576), (7, 203), (1000, 576), (1000, 203)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(ops, dtype, rows, h, with_residual):
    g = torch.Generator().manual_seed(rows + h)
    x = (torch.randn(rows, h, generator=g) * 3).to(dtype)
    residual = (torch.randn(rows, h, generator=g) * 3).to(dtype) if with_residual else None
    weight = torch.randn(h, generator=g).to(dtype)
    normed, res = ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_res = norm_reference(x, residual, weight, 1e-5)
    assert torch.equal(res, ref_res)  # the add rounds exactly as torch's
    assert_matches(normed, ref_normed)


def test_add_rms_norm_rejects_a_weight_of_the_wrong_size(ops):
    with pytest.raises(ValueError, match="weight"):
        ops.add_rms_norm(torch.randn(2, 64), None, torch.ones(32), 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 1536), (7, 203), (1000, 1536)])
def test_silu_mul_matches_torch(ops, dtype, rows, inter):
    g = torch.Generator().manual_seed(rows + inter)
    gate_up = (torch.randn(rows, 2 * inter, generator=g) * 4).to(dtype)
    gate, up = gate_up.chunk(2, dim=-1)
    assert_matches(ops.silu_mul(gate_up), F.silu(gate) * up)


def test_silu_mul_saturates_like_torch(ops):
    gate = torch.tensor([[-1e4, -200.0, -90.0, -20.0, 0.0, 20.0, 90.0, 200.0, 1e4]])
    gate_up = torch.cat([gate, torch.ones_like(gate)], dim=1)
    out = ops.silu_mul(gate_up)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out, F.silu(gate), rtol=1e-6, atol=1e-6)


def rope_config(head_dim: int) -> ModelConfig:
    return ModelConfig(architecture="LlamaForCausalLM", vocab_size=64, hidden_size=64,
                       intermediate_size=128, num_layers=1, num_heads=1, num_kv_heads=1,
                       head_dim=head_dim, rms_norm_eps=1e-5, rope_theta=10000.0,
                       rope_scaling=None, max_position_embeddings=4096,
                       tie_word_embeddings=False, attention_bias=False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 2, 128), (2, 2, 128)])
@pytest.mark.parametrize("rows", [1, 7, 1000])
def test_rotary_matches_apply_rotary(ops, dtype, heads, kv_heads, head_dim, rows):
    H, KVH, D = heads, kv_heads, head_dim
    rotary = RotaryEmbedding(rope_config(D), 4096)
    g = torch.Generator().manual_seed(rows + D)
    qkv = torch.randn(rows, (H + 2 * KVH) * D, generator=g).to(dtype)
    positions = torch.randint(0, 4096, (rows,), generator=g)
    q, k = rotary.for_step(positions, dtype, ops)(qkv, H, KVH, D)
    cos, sin = rotary.lookup(positions, dtype)
    ref = apply_rotary(qkv[:, :(H + KVH) * D].view(rows, H + KVH, D), cos, sin)
    assert q.is_contiguous() and k.is_contiguous()
    assert_matches(q, ref[:, :H])
    assert_matches(k, ref[:, H:])
    if dtype == torch.bfloat16:  # every rounding step is torch's: bit for bit
        assert torch.equal(q, ref[:, :H]) and torch.equal(k, ref[:, H:])


def test_rotary_reads_strided_rows_and_checks_positions(ops):
    rotary = RotaryEmbedding(rope_config(64), 128)
    wide = torch.randn(5, 4 * 64 + 32)
    qkv = wide[:, 16:16 + 4 * 64]  # rows with a stride wider than the qkv width
    positions = torch.tensor([0, 3, 127, 64, 1])
    q, k = rotary.for_step(positions, torch.float32, ops)(qkv, 2, 1, 64)
    ref_q, ref_k = rotary.for_step(positions, torch.float32)(qkv, 2, 1, 64)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    with pytest.raises(RuntimeError, match="position"):
        rotary.for_step(torch.tensor([0, 1, 128, 2, 3]), torch.float32, ops)(qkv, 2, 1, 64)


class CausalAttention:
    """Stands in for ForwardContext: one sequence prefilled from scratch, no KV cache."""

    def attention(self, layer_idx, q, k, v, spec=None):
        G = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(G, dim=1), v.repeat_interleave(G, dim=1)
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                             v.transpose(0, 1), is_causal=True)
        return out.transpose(0, 1)  # (T, H, D)


def tiny_model(tmp_path, dtype):
    cfg = dict(architectures=["LlamaForCausalLM"], vocab_size=512, hidden_size=200,
               intermediate_size=344, num_hidden_layers=3, num_attention_heads=5,
               num_key_value_heads=1, head_dim=64, max_position_embeddings=256)
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    model, _ = load_model(tmp_path, dtype, torch.device("cpu"), 256, "dummy", tmp_path)
    torch.manual_seed(0)
    with torch.no_grad():  # dummy norm weights are all 1: make them exercise the multiply
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
    return model


@pytest.mark.parametrize("dtype", DTYPES)
def test_model_with_native_ops_matches_torch_path(tmp_path, dtype):
    model = tiny_model(tmp_path, dtype)
    ops = model.native
    if ops is None:
        pytest.skip("no C compiler: the loader kept the torch path")
    assert all(m.native is ops for m in (model.norm, model.layers[0].mlp))
    ids = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1))
    positions = torch.arange(40)
    with torch.inference_mode():
        native = model(ids, positions, CausalAttention())
        model.use_native_ops(None)
        reference = model(ids, positions, CausalAttention())
    assert model.layers[2].input_norm.native is None
    # Differences of an ulp now and then, carried through 3 layers.
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(native.float(), reference.float(), rtol=tol, atol=tol)
