"""The Triton LoRA kernels (`baton_kernels.lora`) against the float32 reference the CPU
kernel is held to (`baton_cpu.reference.lora_add`): rows of several adapters and of none,
fused parts on their own columns, odd sizes. On CUDA when present, else the interpreter."""

from __future__ import annotations

import pytest
import torch

from baton_cpu.reference import lora_add as reference


@pytest.mark.parametrize("parts,rank,k,dtype", [
    ([(0, 64)], 8, 64, torch.float32),
    ([(0, 96), (96, 32), (128, 32)], 16, 80, torch.bfloat16),  # q / k / v
    ([(0, 50), (50, 50)], 3, 37, torch.float32),  # gate / up, sizes off the tiles
])
def test_matches_the_reference(device, parts, rank, k, dtype):
    from baton_kernels.lora import lora_add

    g = torch.Generator().manual_seed(rank)
    slots, m = 3, 9
    out = parts[-1][0] + parts[-1][1]
    a = torch.randn(slots, len(parts) * rank, k, generator=g).to(dtype)
    b = [torch.randn(slots, rank, cols, generator=g).to(dtype) for _, cols in parts]
    x = torch.randn(m, k, generator=g).to(dtype)
    y = torch.randn(m, out, generator=g).to(dtype)
    row_slots = torch.tensor([-1, 0, 2, 1, -1, 2, 2, 0, 1])
    want = reference(x, y, row_slots, a, b, parts)
    got = y.to(device)
    lora_add(x.to(device), got, row_slots.to(device), a.to(device), [t.to(device) for t in b],
             parts)
    got = got.cpu()
    assert torch.equal(got[row_slots < 0], y[row_slots < 0])  # base rows untouched
    step = 2 ** -7 if dtype == torch.bfloat16 else 1e-5  # one rounding, sums reordered
    assert ((got.float() - want.float()).abs() <= want.float().abs().clamp_min(1.0) * step).all()


def test_refuses_shapes_that_do_not_fit(device):
    from baton_kernels.lora import lora_add

    a, b = torch.zeros(1, 4, 8, device=device), [torch.zeros(1, 4, 8, device=device)]
    with pytest.raises(ValueError, match="do not fit"):
        lora_add(torch.zeros(2, 7, device=device), torch.zeros(2, 8, device=device),
                 torch.zeros(2, dtype=torch.int64, device=device), a, b, [(0, 8)])


def test_the_engines_lora_linear_takes_them(device):
    """`LoRALinear` with the Triton kernels (as the engine runs it on CUDA) equals its torch
    path (two matmuls over every slot, rows masked to their own)."""
    from baton.engine.lora.layer import LoRALinear, LoRAStepState
    from baton_kernels.lora import TritonLoRA

    g = torch.Generator().manual_seed(0)
    base = torch.nn.Linear(48, 40, bias=False).to(device)
    parts, rank, slots = [(0, 24), (24, 16)], 4, 3
    a = torch.randn(slots, 2 * rank, 48, generator=g).to(device)
    b = [torch.randn(slots, rank, cols, generator=g).to(device) for _, cols in parts]
    state = LoRAStepState()
    row_slots = torch.tensor([2, -1, 0, 0, 1, -1])
    state.row_slots = row_slots.to(device)
    state.mask = (row_slots[:, None] == torch.arange(slots)).float()[:, :, None].to(device)
    state.slots = frozenset({0, 1, 2})
    x = torch.randn(6, 48, generator=g).to(device)
    torch_path, kernels = (LoRALinear(base, a, b, parts, state, native)
                           for native in (None, TritonLoRA()))
    torch_path.adapted = kernels.adapted = {0, 1, 2}  # every slot adapts this linear
    with torch.no_grad():
        want, got = torch_path(x), kernels(x)
    assert not torch.allclose(want[row_slots >= 0], base(x)[row_slots >= 0])  # deltas added
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got[row_slots < 0], base(x)[row_slots < 0])


def test_warm_up_launches_every_variant_serving_launches(device):
    """`LoRALinear.warm_up` (the engine calls it at start) compiles what a step of adapter
    rows launches later, whatever the step's row count."""
    from baton.engine.lora.layer import LoRALinear, LoRAStepState
    from baton_kernels import recording_variants
    from baton_kernels.lora import TritonLoRA

    parts, rank = [(0, 24), (24, 16)], 4
    layer = LoRALinear(torch.nn.Linear(48, 40, bias=False).to(device),
                       torch.randn(2, 2 * rank, 48, device=device),
                       [torch.randn(2, rank, cols, device=device) for _, cols in parts],
                       parts, LoRAStepState(), TritonLoRA())
    with recording_variants() as warm:
        layer.warm_up()
    layer.adapted = {0, 1}  # both slots hold an adapter of this linear
    for rows in (1, 7, 32):
        layer.state.row_slots = torch.arange(rows, device=device) % 3 - 1
        layer.state.mask = torch.ones(rows, 2, 1, device=device)
        layer.state.slots = frozenset({0, 1})
        with recording_variants() as served, torch.no_grad():
            layer(torch.randn(rows, 48, device=device))
        assert served and served <= warm
