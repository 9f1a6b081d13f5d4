"""A quantized linear on the GPU: the weight kept as the checkpoint quantized it, multiplied
by `baton_kernels`' GEMMs — int4 / int8 codes with group scales and zeros (W4A16 / W8A16,
act-order included: `quant_gemm.int_weight_gemm`), FP8 e4m3 with per-tensor, per-channel or
block scales (`fp8_gemm.fp8_weight_gemm`: `torch._scaled_mm` or Triton W8A8 on sm_89+,
W8A16 before). One of our fused linears (q / k / v, gate / up) takes its parts' rows
concatenated: they must share a format, group layout and act-order; per-tensor FP8 parts
become per-channel scales.

Not yet run on a GPU (no device was lent when it was written): the kernels are checked in
Triton's interpreter and compiled for sm_80 / sm_90; `tests/gpu` checks them on a device.
"""

from __future__ import annotations

import torch
from torch import nn

from baton.engine.quant.formats import FP8Weight, IntWeight, QuantWeight


def merge_rows(parts: list[QuantWeight]) -> QuantWeight | None:
    """One weight whose rows are `parts`' in order, or None when they cannot share one
    kernel call (different formats, bits, groups, act-order or block rows)."""
    first = parts[0]
    if len(parts) == 1:
        return first
    if all(isinstance(p, IntWeight) for p in parts):
        ints = [p for p in parts if isinstance(p, IntWeight)]
        same = {(p.bits, p.group_size, p.scales.shape[1]) for p in ints}
        g_idx = [p.g_idx for p in ints]
        first_g = g_idx[0]
        if len(same) > 1 or any((g is None) != (first_g is None) or
                                (g is not None and first_g is not None
                                 and not torch.equal(g, first_g)) for g in g_idx):
            return None
        zeros = (None if all(p.zeros is None for p in ints)
                 else torch.cat([p.zero_points() for p in ints]))
        return IntWeight(torch.cat([p.codes for p in ints]), torch.cat([p.scales for p in ints]),
                         zeros, ints[0].bits, ints[0].group_size, first_g)
    if all(isinstance(p, FP8Weight) for p in parts):
        return _merge_fp8([p for p in parts if isinstance(p, FP8Weight)])
    return None


def _merge_fp8(parts: list[FP8Weight]) -> FP8Weight | None:
    if len({p.block for p in parts}) > 1 or len({p.input_scale is None for p in parts}) > 1:
        return None
    block = parts[0].block
    if block is not None:
        if any(p.shape[0] % block[0] for p in parts[:-1]):
            return None  # a part's last block row would mix two parts
        scales = torch.cat([p.scales for p in parts])
    else:  # one scale per row
        scales = torch.cat([p.scales.expand(p.shape[0], 1) for p in parts])
    static = [p.input_scale for p in parts if p.input_scale is not None]
    input_scale = torch.stack(static).max().reshape(1) if static else None
    return FP8Weight(torch.cat([p.values for p in parts]), scales, block, input_scale)


class GPUQuantLinear(nn.Module):
    """y = x @ W.T (+ bias) for x of any leading shape on the GPU, W quantized (its tensors
    made on the device, not buffers: the module never moves)."""

    packed: torch.Tensor  # int: codes packed along K (`quant_pack`), scales, zeros, g_idx
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    values: torch.Tensor  # fp8: e4m3 weight, its scales, a static activation scale
    w_scale: torch.Tensor
    input_scale: torch.Tensor | None

    def __init__(self, weight: QuantWeight, bias: torch.Tensor | None, device: torch.device,
                 dtype: torch.dtype, capability: tuple[int, int] | None = None) -> None:
        """`capability`: the compute capability whose FP8 path to take (None: the
        device's; tests give one to run a path in Triton's interpreter on CPU)."""
        super().__init__()
        self.capability, self.act_dtype = capability, dtype
        self.out_features, self.in_features = weight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(device, dtype),
                                                           requires_grad=False)
        if isinstance(weight, IntWeight):
            from baton_kernels.quant_pack import group_major, pack_int_weight

            self.kind, self.bits, self.group_size = "int", weight.bits, weight.group_size
            self.packed = pack_int_weight(weight.codes, weight.bits).to(device)
            self.scales = group_major(weight.scales.to(device, dtype))
            self.zeros = (None if weight.zeros is None else group_major(
                weight.zeros.clamp(0, 255).to(torch.uint8).to(device)))
            self.g_idx = (None if weight.g_idx is None
                          else weight.g_idx.to(device, torch.int32))
        else:
            self.kind, self.block = "fp8", weight.block
            self.values = weight.values.to(device)
            scales = weight.scales if weight.block is not None else weight.scales.reshape(-1)
            self.w_scale = scales.float().to(device).contiguous()
            self.input_scale = (None if weight.input_scale is None
                                else weight.input_scale.float().to(device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)  # (M, K)
        if self.kind == "int":
            from baton_kernels.quant_gemm import int_weight_gemm

            y = int_weight_gemm(rows, self.packed, self.scales, self.zeros, self.g_idx,
                                self.group_size, self.bits, self.out_features, self.in_features)
        else:
            from baton_kernels.fp8_gemm import fp8_gemm_for, fp8_weight_gemm

            if self.capability is None:
                y = fp8_weight_gemm(rows, self.values, self.w_scale, self.block,
                                    self.input_scale)
            else:
                y = fp8_gemm_for(self.capability, rows, self.values, self.w_scale, self.block,
                                 self.input_scale)
        if self.bias is not None:
            y = y + self.bias
        return y.view(*x.shape[:-1], self.out_features)

    def warm_up(self) -> None:
        """Compile every kernel variant a batch can launch (before CUDA graphs capture)."""
        from baton_kernels._gemm import BUCKET_ROWS

        param = self.packed if self.kind == "int" else self.values
        for m in BUCKET_ROWS:
            self(torch.zeros(m, self.in_features, device=param.device, dtype=self.act_dtype))

    def extra_repr(self) -> str:
        kind = f"int{self.bits} group {self.group_size}" if self.kind == "int" else (
            f"fp8 block {self.block}" if self.block else "fp8")
        return f"in_features={self.in_features}, out_features={self.out_features}, {kind}"
