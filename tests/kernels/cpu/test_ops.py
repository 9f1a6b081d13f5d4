"""The fused CPU ops (add + RMSNorm, SiLU * up, rotary) against their torch references, in
float32 and bfloat16, at decode (1-7 rows) and prefill (1000 rows) sizes. (The model run
through them: tests/unit/engine/test_cpu_platform.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from baton.engine.models.config import ModelConfig
from baton.engine.models.layers import RMSNorm
from baton.engine.models.rope import RotaryEmbedding
from baton_cpu import reference

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


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,h", [(1, 576), (7, 203), (1000, 576), (1000, 203)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_add_rms_norm_matches_torch(ops, dtype, rows, h, with_residual):
    g = torch.Generator().manual_seed(rows + h)
    x = (torch.randn(rows, h, generator=g) * 3).to(dtype)
    residual = (torch.randn(rows, h, generator=g) * 3).to(dtype) if with_residual else None
    weight = torch.randn(h, generator=g).to(dtype)
    normed, res = ops.add_rms_norm(x, residual, weight, 1e-5)
    ref_normed, ref_res = reference.add_rms_norm(x, residual, weight, 1e-5)
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
    assert_matches(ops.silu_mul(gate_up), reference.silu_mul(gate_up))


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
    tables = rotary.tables(dtype)
    q, k = ops.rotary(qkv, positions, *tables, H, KVH, D)
    ref_q, ref_k = reference.rotary(qkv, positions, *tables, H, KVH, D)
    assert q.is_contiguous() and k.is_contiguous()
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    if dtype == torch.bfloat16:  # every rounding step is torch's: bit for bit
        assert torch.equal(q, ref_q) and torch.equal(k, ref_k)


def test_rotary_reads_strided_rows_and_checks_positions(ops):
    rotary = RotaryEmbedding(rope_config(64), 128)
    wide = torch.randn(5, 4 * 64 + 32)
    qkv = wide[:, 16:16 + 4 * 64]  # rows with a stride wider than the qkv width
    positions = torch.tensor([0, 3, 127, 64, 1])
    tables = rotary.tables(torch.float32)
    q, k = ops.rotary(qkv, positions, *tables, 2, 1, 64)
    ref_q, ref_k = reference.rotary(qkv, positions, *tables, 2, 1, 64)
    assert_matches(q, ref_q)
    assert_matches(k, ref_k)
    with pytest.raises(RuntimeError, match="position"):
        ops.rotary(qkv, torch.tensor([0, 1, 128, 2, 3]), *tables, 2, 1, 64)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_references_are_the_models_torch_code(dtype):
    """What the kernels are held to is what the model computes without them, bit for bit."""
    g = torch.Generator().manual_seed(3)
    x, residual = (torch.randn(7, 64, generator=g).to(dtype) for _ in range(2))
    norm = RMSNorm(64, 1e-5).to(dtype)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5, generator=g)
    for got, ref in zip(norm(x, residual), reference.add_rms_norm(x, residual, norm.weight,
                                                                  1e-5)):
        assert torch.equal(got, ref)
    rotary = RotaryEmbedding(rope_config(64), 128)
    qkv, positions = torch.randn(7, 4 * 64, generator=g).to(dtype), torch.arange(3, 10)
    got = rotary.for_step(positions, dtype)(qkv, 2, 1, 64)
    ref = reference.rotary(qkv, positions, *rotary.tables(dtype), 2, 1, 64)
    assert all(torch.equal(a, b) for a, b in zip(got, ref))
