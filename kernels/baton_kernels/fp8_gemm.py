"""FP8 weights (float8_e4m3fn ``[N, K]``): ``y = x @ w.T`` on CUDA, the path by device.

Scales (`quant_reference`): ``w_scale`` float32 ``[1]`` (per tensor), ``[N]`` (per channel) or
``[ceil(N / bn), ceil(K / bk)]`` with ``block = (bn, bk)``; ``input_scale`` float32 ``[1]``
(static activation scale) or None (dynamic: per token, per token-group of bk for block-wise).

- sm_89 and later, per tensor / per channel: x quantized to FP8 (`quantize_fp8_activations`,
  one Triton launch), then ``torch._scaled_mm``: tensor-wise scales when both are single,
  else row-wise (``[M, 1]`` by ``[1, N]``), whose output is bf16 (the row-wise kernels'
  only output type on some CUDA versions): fp16 activations get it cast back.
- sm_89 and later, block-wise: x quantized per token-group of bk, then a Triton W8A8 GEMM:
  FP8 tensor-core dots, each K tile's float32 result times its token-group and weight-block
  scales (DeepSeek-V3's scheme).
- before sm_89 (no FP8 dots or conversions), and shapes ``_scaled_mm`` refuses (K or N not a
  multiple of 16): W8A16, the weight widened in registers into a dot in x's dtype. The e4m3
  byte's sign, exponent and mantissa moved into an fp16's (``(b & 0x80) << 8 | (b & 0x7F) <<
  7``) is the same value times 2^-8, subnormals too; the 2^8 goes into the scale, exactly.
  Activations stay unquantized (more accurate than the W8A8 paths; a static input_scale is
  not needed).

Both Triton GEMMs share `_gemm`'s buckets, split-K and epilogue (one kernel, `ACT_FP8`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from baton_kernels._common import (
    check_last_dim_contiguous,
    check_same_device,
    check_tensor,
    interpreting,
    next_pow2,
)
from baton_kernels._gemm import (
    finish,
    split_k,
    split_output,
    split_range,
    store_tile,
    tile_coordinates,
    tile_dot,
    tiles_for,
)
from baton_kernels._tiles import loop_bound
from baton_kernels._variants import jit
from baton_kernels.cache_ops import _to_fp8_bytes
from baton_kernels.quant_reference import AMAX_FLOOR, FP8_MAX

ACT_DTYPES = (torch.float16, torch.bfloat16)
FP8_DOTS = (8, 9)  # the first compute capability with FP8 tensor cores
QUANT_BLOCK = 1024  # activation-quant chunk (a per-token row is read in these)
_FP8_MAX = tl.constexpr(FP8_MAX)
_AMAX_FLOOR = tl.constexpr(AMAX_FLOOR)


@jit(dynamic=("M",))
def quant_fp8_kernel(x_ptr, q_ptr, s_ptr, static_ptr, M, K, group, stride_xm, stride_qm,
                     stride_sm, STATIC: tl.constexpr, BLOCK: tl.constexpr):
    """Columns [g group, (g + 1) group) of row m (program (m, g)) to e4m3 bytes, by the
    static scale or by their own amax / 448 (stored at s[m, g])."""
    m = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * group
    end = tl.minimum(start + group, K)
    if STATIC:
        scale = tl.load(static_ptr)
    else:
        amax = tl.zeros([BLOCK], dtype=tl.float32)
        for k0 in range(loop_bound(start), loop_bound(end), BLOCK):
            offs = k0 + tl.arange(0, BLOCK)
            x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < end, other=0.0)
            amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
        scale = tl.math.div_rn(tl.maximum(tl.max(amax, 0), _AMAX_FLOOR), _FP8_MAX)
        tl.store(s_ptr + m * stride_sm + tl.program_id(1), scale)
    for k0 in range(loop_bound(start), loop_bound(end), BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_ptr + m * stride_xm + offs, mask=offs < end, other=0.0)
        q = _to_fp8_bytes(x, scale, _FP8_MAX, 3, -6)  # IEEE division, as torch divides
        tl.store(q_ptr + m * stride_qm + offs, q, mask=offs < end)


def quantize_fp8_activations(x: torch.Tensor, input_scale: torch.Tensor | None = None,
                             group: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x ``[M, K]`` (bf16 / fp16 / fp32) -> (float8_e4m3fn ``[M, K]``, float32 scales
    ``[M, G]``) as `quant_reference.quantize_fp8_activations_ref`: per token (group None),
    per token-group of `group` columns, or by the static input_scale ``[1]`` (then the
    scales returned are input_scale, ``[1]``)."""
    check_tensor("x", x, 2)
    check_last_dim_contiguous("x", x)
    m, k = x.shape
    width = group or k
    groups = triton.cdiv(k, width) if k else 0
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    if input_scale is not None:
        check_tensor("input_scale", input_scale, 1, (torch.float32,))
        if input_scale.numel() != 1:
            raise ValueError(f"input_scale must be [1], got {tuple(input_scale.shape)}")
        scales = input_scale
    else:
        scales = torch.empty(m, groups, dtype=torch.float32, device=x.device)
    check_same_device(x.device, scales=scales)
    if m and k:
        quant_fp8_kernel[(m, groups)](
            x, q.view(torch.uint8), scales, scales, m, k, width, x.stride(0), q.stride(0),
            scales.stride(0) if input_scale is None else 0, STATIC=input_scale is not None,
            BLOCK=min(next_pow2(width), QUANT_BLOCK))
    return q, scales


@jit(dynamic=("M", "tiles_per_split", "stride_ys"))
def fp8_gemm_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, y_ptr,
    M, N, K, tiles_per_split,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_wsk, stride_ym, stride_ys,
    ACT_FP8: tl.constexpr, SCALE_BN: tl.constexpr, SCALE_BK: tl.constexpr,
    SPLIT: tl.constexpr, DOT_FP32: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    """One ``[BLOCK_M, BLOCK_N]`` tile of y over this split's K tiles; a K tile lies in one
    weight-scale block (BLOCK_K divides SCALE_BK). ACT_FP8: x is e4m3 with scales xs[m, kb];
    else x is bf16 / fp16 and w arrives as its bytes (widened as the module says)."""
    offs_m, offs_n = tile_coordinates(M, N, BLOCK_M, BLOCK_N)
    m_mask, n_mask = offs_m < M, offs_n < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    first, last = split_range(K, tiles_per_split, BLOCK_K)
    for t in range(first, last):
        offs_k = t * BLOCK_K + tl.arange(0, BLOCK_K)
        k_mask = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :],
                    mask=m_mask[:, None] & k_mask[None, :], other=0)       # (BM, BK)
        w = tl.load(w_ptr + offs_n[None, :] * stride_wn + offs_k[:, None],
                    mask=k_mask[:, None] & n_mask[None, :], other=0)       # (BK, BN)
        kb = (t * BLOCK_K) // SCALE_BK
        ws = tl.load(ws_ptr + (offs_n // SCALE_BN) * stride_wsn + kb * stride_wsk,
                     mask=n_mask, other=0.0)                               # (BN,)
        part = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        if ACT_FP8:  # both arrive as bytes (the interpreter cannot fill masked FP8 loads)
            x = x.to(tl.float8e4nv, bitcast=True)
            w = w.to(tl.float8e4nv, bitcast=True)
            xs = tl.load(xs_ptr + offs_m * stride_xsm + kb * stride_xsk, mask=m_mask,
                         other=0.0)                                        # (BM,)
            acc += tile_dot(x, w, part, DOT_FP32) * xs[:, None] * ws[None, :]
        else:
            b = w.to(tl.uint16)
            half = (((b & 0x80) << 8) | ((b & 0x7F) << 7)).to(tl.float16, bitcast=True)
            if not DOT_FP32:
                half = half.to(x.dtype)  # exact: 4 significant bits
            acc += tile_dot(x, half, part, DOT_FP32) * (ws * 256.0)[None, :]
    store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_ys, SPLIT)


def _scale_layout(w_scale: torch.Tensor, block: tuple[int, int] | None, n: int, k: int
                  ) -> tuple[int, int, int, int]:
    """(SCALE_BN, SCALE_BK, stride over n blocks, stride over k blocks) of w_scale, SCALE_BK
    0 when one scale spans K; ValueError for a shape that fits no scheme."""
    if w_scale.dtype != torch.float32:
        raise ValueError(f"w_scale must be float32, got {w_scale.dtype}")
    if block is not None:
        bn, bk = block
        if bn < 1 or bk < 16 or bk & (bk - 1):
            raise ValueError(f"block {block}: bn >= 1 and bk a power of two >= 16")
        want = (triton.cdiv(n, bn), triton.cdiv(k, bk))
        if tuple(w_scale.shape) != want:
            raise ValueError(f"block-wise w_scale must be {list(want)} for N={n}, K={k}, "
                             f"block={block}; got {tuple(w_scale.shape)}")
        return bn, bk, w_scale.stride(0), w_scale.stride(1)
    if w_scale.numel() == 1:
        return 1, 0, 0, 0
    if w_scale.numel() == n and w_scale.dim() <= 2 and w_scale.shape[0] == n:
        return 1, 0, w_scale.stride(0), 0
    raise ValueError(f"w_scale must be [1] (per tensor) or [N={n}] (per channel) without a "
                     f"block, got {tuple(w_scale.shape)}")


def _check_fp8_args(x, w, input_scale) -> None:
    check_tensor("x", x, 2, ACT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_tensor("w", w, 2, (torch.float8_e4m3fn,))
    if not w.is_contiguous():
        raise ValueError("w must be contiguous [N, K]")
    if x.shape[1] != w.shape[1]:
        raise ValueError(f"x has {x.shape[1]} columns, w is [N, K] = {tuple(w.shape)}")
    if input_scale is not None and (input_scale.dtype != torch.float32
                                    or input_scale.numel() != 1):
        raise ValueError(f"input_scale must be float32 [1], got {input_scale.dtype} "
                         f"{tuple(input_scale.shape)}")


def _triton_fp8_gemm(x: torch.Tensor, xs: torch.Tensor | None, w: torch.Tensor,
                     w_scale: torch.Tensor, layout: tuple[int, int, int, int],
                     out_dtype: torch.dtype) -> torch.Tensor:
    """The Triton GEMM: W8A8 when xs is given (x e4m3, xs ``[M, G]`` or ``[1]``), else
    W8A16 (x bf16 / fp16)."""
    (m, k), n = x.shape, w.shape[0]
    scale_bn, scale_bk, stride_wsn, stride_wsk = layout
    tiles = tiles_for(m)
    block_k = min(tiles.block_k, scale_bk) if scale_bk else tiles.block_k
    splits, per_split = split_k(tiles, m, n, triton.cdiv(k, block_k), x.device)
    out = split_output(splits, m, n, out_dtype, x.device)
    xs_strides = (0, 0) if xs is None or xs.numel() == 1 else (xs.stride(0), xs.stride(1))
    grid = (triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n), splits)
    fp8_gemm_kernel[grid](
        x.view(torch.uint8) if xs is not None else x, xs if xs is not None else w_scale,
        w.view(torch.uint8),
        w_scale, out, m, n, k, per_split, x.stride(0), *xs_strides, w.stride(0),
        stride_wsn, stride_wsk, out.stride(-2), out.stride(0) if splits > 1 else 0,
        ACT_FP8=xs is not None, SCALE_BN=scale_bn, SCALE_BK=scale_bk or block_k,
        SPLIT=splits > 1, DOT_FP32=interpreting(), BLOCK_M=tiles.block_m,
        BLOCK_N=tiles.block_n, BLOCK_K=block_k, num_warps=tiles.num_warps)
    return finish(out, out_dtype)


def _scaled_mm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
               input_scale: torch.Tensor | None) -> torch.Tensor:
    """Per-tensor / per-channel weights through torch._scaled_mm (x quantized first)."""
    m, n = x.shape[0], w.shape[0]
    xq, xs = quantize_fp8_activations(x, input_scale)
    if input_scale is not None and w_scale.numel() == 1:  # tensor-wise
        return torch._scaled_mm(xq, w.t(), scale_a=input_scale.reshape(1),
                                scale_b=w_scale.reshape(1), out_dtype=x.dtype)
    scale_a = xs.reshape(1, 1).expand(m, 1).contiguous() if input_scale is not None else xs
    scale_b = w_scale.reshape(1, -1).expand(1, n).contiguous()             # (1, N)
    y = torch._scaled_mm(xq, w.t(), scale_a=scale_a, scale_b=scale_b,
                         out_dtype=torch.bfloat16)
    return y.to(x.dtype)


def fp8_path(capability: tuple[int, int], n: int, k: int,
             block: tuple[int, int] | None) -> str:
    """Which path serves an FP8 weight on a device of `capability`: "scaled_mm",
    "w8a8_block" or "w8a16" (the module docstring says why)."""
    if tuple(capability) < FP8_DOTS:
        return "w8a16"
    if block is not None:
        return "w8a8_block"
    return "scaled_mm" if k % 16 == 0 and n % 16 == 0 else "w8a16"


def fp8_gemm_for(capability: tuple[int, int], x: torch.Tensor, w: torch.Tensor,
                 w_scale: torch.Tensor, block: tuple[int, int] | None = None,
                 input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`fp8_weight_gemm` as a device of `capability` runs it (tests run every path in the
    interpreter, and ``torch._scaled_mm`` on CPU)."""
    _check_fp8_args(x, w, input_scale)
    n, k = w.shape
    layout = _scale_layout(w_scale, block, n, k)
    check_same_device(x.device, w=w, w_scale=w_scale,
                      **({"input_scale": input_scale} if input_scale is not None else {}))
    if x.shape[0] == 0:
        return x.new_empty(0, n)
    path = fp8_path(capability, n, k, block)
    if path == "scaled_mm":
        return _scaled_mm(x, w, w_scale, input_scale)
    if path == "w8a8_block" and block is not None:
        xq, xs = quantize_fp8_activations(x, input_scale, block[1])
        return _triton_fp8_gemm(xq, xs, w, w_scale, layout, x.dtype)
    return _triton_fp8_gemm(x, None, w, w_scale, layout, x.dtype)


def fp8_weight_gemm(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                    block: tuple[int, int] | None = None,
                    input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``y [M, N] = x [M, K] @ (w * scales).T`` in x's dtype (bf16 / fp16) for a CUDA
    x; the path by the device's compute capability (module docstring). RuntimeError for a
    tensor off CUDA (de-quantize there: `quant_reference.dequantize_fp8_weight`);
    ValueError for arguments that do not fit."""
    if x.device.type != "cuda" or w.device.type != "cuda":
        raise RuntimeError(f"fp8_weight_gemm runs on CUDA only (x on {x.device}, w on "
                           f"{w.device}): the path depends on the GPU's FP8 support; on CPU "
                           "de-quantize the weight (quant_reference.dequantize_fp8_weight)")
    return fp8_gemm_for(torch.cuda.get_device_capability(x.device), x, w, w_scale, block,
                        input_scale)
