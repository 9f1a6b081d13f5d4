"""What the quantized-weight GEMMs (`quant_gemm`, `fp8_gemm`) share: the tile sizes of each
row-count bucket, split-K for the few-row (decode) buckets, and the epilogue.

Both kernels compute ``y [M, N] = x [M, K] @ w.T`` one ``BLOCK_M x BLOCK_N`` output tile per
program, de-quantizing a ``BLOCK_K x BLOCK_N`` weight tile in registers per step into a
tensor-core dot with float32 accumulation. Decode (M of a few rows) reads every weight once
and is memory-bound: a row-count bucket of at most 64 rows has too few output tiles to keep
the device's memory busy, so the K range is split among programs (split-K, at most
`MAX_SPLITS`) whose float32 partial sums are added in a fixed order (deterministic, no
atomics). The split count depends on the bucket, the shape and the device, never on M
itself, so one call per bucket (`BUCKET_ROWS`) compiles every variant a model serves.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cache

import torch
import triton
import triton.language as tl

from baton_kernels._tiles import loop_bound

MAX_SPLITS = 16
PROGRAMS_PER_SM = 4  # split-K aims at this many programs per streaming multiprocessor
CPU_PROGRAMS = 4  # the interpreter's stand-in for a device's SM count (tests split too)


@dataclass(frozen=True)
class Tiles:
    """The constexpr tile of one row-count bucket."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    split_k: bool  # few rows: split K among programs when the output tiles are few


# (largest M of the bucket, its tiles); the last bucket takes every larger M (prefill).
BUCKETS = (
    (16, Tiles(16, 64, 128, 4, True)),
    (32, Tiles(32, 64, 128, 4, True)),
    (64, Tiles(64, 64, 64, 4, True)),
    (256, Tiles(64, 128, 64, 4, False)),
    (None, Tiles(128, 128, 64, 8, False)),
)
BUCKET_ROWS = (16, 32, 64, 256, 257)  # one row count per bucket: warm-up calls these


def tiles_for(m: int) -> Tiles:
    for largest, tiles in BUCKETS:
        if largest is None or m <= largest:
            return tiles
    raise AssertionError("the last bucket takes every M")


@cache
def _device_programs(index: int) -> int:
    return PROGRAMS_PER_SM * torch.cuda.get_device_properties(index).multi_processor_count


def target_programs(device: torch.device) -> int:
    """How many programs keep `device` busy (CUDA: per SM; the interpreter: a few)."""
    if device.type != "cuda":
        return CPU_PROGRAMS
    return _device_programs(device.index if device.index is not None
                            else torch.cuda.current_device())


def split_k(tiles: Tiles, m: int, n: int, k_tiles: int, device: torch.device
            ) -> tuple[int, int]:
    """(splits, K tiles per split): 1 split unless the bucket splits and its output tiles
    are too few for the device; never an empty split."""
    out_tiles = triton.cdiv(m, tiles.block_m) * triton.cdiv(n, tiles.block_n)
    splits = 1
    if tiles.split_k:
        splits = max(1, min(MAX_SPLITS, k_tiles, target_programs(device) // out_tiles))
    per_split = triton.cdiv(k_tiles, splits)
    return triton.cdiv(k_tiles, per_split), per_split


def split_output(splits: int, m: int, n: int, dtype: torch.dtype, device: torch.device
                 ) -> torch.Tensor:
    """Where the kernel writes: y ``[M, N]`` in `dtype`, or float32 partial sums
    ``[splits, M, N]``, reduced by `finish`."""
    if splits == 1:
        return torch.empty(m, n, dtype=dtype, device=device)
    return torch.empty(splits, m, n, dtype=torch.float32, device=device)


def finish(out: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """y from `split_output`'s tensor: the partial sums added in split order."""
    return out if out.dim() == 2 else out.sum(dim=0).to(dtype)


@triton.jit
def tile_coordinates(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's output rows and columns (int64 rows: M x K may pass 2^31)."""
    pid = tl.program_id(0)
    tiles_n = tl.cdiv(N, BLOCK_N)
    offs_m = (pid // tiles_n) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = (pid % tiles_n) * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m.to(tl.int64), offs_n


@triton.jit
def split_range(K, tiles_per_split, BLOCK_K: tl.constexpr):
    """The K tiles of this program's split (axis 1 of the grid): [first, last)."""
    first = tl.program_id(1) * tiles_per_split
    last = tl.minimum(first + tiles_per_split, tl.cdiv(K, BLOCK_K))
    return loop_bound(first), loop_bound(last)


@triton.jit
def tile_dot(a, b, acc, DOT_FP32: tl.constexpr):
    """acc + a @ b (float32). DOT_FP32 (the interpreter, whose bf16 dot is wrong): both
    operands widened to float32 (exact) first."""
    if DOT_FP32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def store_tile(y_ptr, acc, offs_m, offs_n, M, N, stride_ym, stride_ys, SPLIT: tl.constexpr):
    """acc into y (its dtype), or float32 into this split's slice of the partial sums."""
    mask = (offs_m < M)[:, None] & (offs_n < N)[None, :]
    if SPLIT:
        at = y_ptr + tl.program_id(1) * stride_ys + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(at, acc, mask=mask)
    else:
        at = y_ptr + offs_m[:, None] * stride_ym + offs_n[None, :]
        tl.store(at, acc.to(y_ptr.dtype.element_ty), mask=mask)
