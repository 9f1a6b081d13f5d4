"""Compile every kernel for real GPU targets (no GPU needed). Run as a script, WITHOUT
TRITON_INTERPRET: ``python tests/kernels/compile_check.py 90 80``. Prints one line per compile
and exits non-zero on the first failure."""

from __future__ import annotations

import os
import sys

if os.environ.get("TRITON_INTERPRET"):
    sys.exit("compile_check must run without TRITON_INTERPRET")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource, compile  # noqa: E402

from baton_kernels.cache_ops import reshape_and_cache_kernel  # noqa: E402
from baton_kernels.decode_attention import (  # noqa: E402
    MAX_SPLITS,
    paged_decode_reduce_kernel,
    paged_decode_split_kernel,
)
from baton_kernels.fp8_gemm import fp8_gemm_kernel, quant_fp8_kernel  # noqa: E402
from baton_kernels.prefill_attention import BLOCK_B, paged_prefill_kernel  # noqa: E402
from baton_kernels.quant_gemm import int_weight_gemm_kernel  # noqa: E402


def signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every argument of ``fn``: constexprs marked 'constexpr', the rest from ``types`` or i32."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in fn.arg_names}


def compile_kernel(kernel, types: dict[str, str], constexprs: dict, target, num_warps=4):
    """Compile a `baton_kernels._variants.Kernel` (its Triton function) for ``target``."""
    src = ASTSource(kernel.fn, signature(kernel.fn, types, constexprs), constexprs)
    return compile(src, target=target, options={"num_warps": num_warps})


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


# FP8 cache dtype -> (mantissa bits, smallest normal exponent)
FP8 = {"fp8e4nv": (3, -6), "fp8e5": (2, -14)}


def cases(dtype: str, head_dim: int, group: int, block_size: int, softcap: bool = False,
          cache: str | None = None):
    """(kernel, signature, constexprs) for every kernel at one dtype/head-dim combination;
    `softcap`: the soft-capped attention variants; `cache` an FP8 cache type (None: the
    cache holds `dtype`). The split count is a runtime argument: one decode kernel and one
    reduce serve them all."""
    ptr = f"*{dtype}"
    cptr = f"*{cache}" if cache else ptr
    block_d = max(16, pow2(head_dim))
    dot_fp32 = dtype == "fp32"
    kvh = 2
    mantissa, min_exp = FP8.get(cache, (0, 0))
    yield reshape_and_cache_kernel, {
        "k_ptr": ptr, "v_ptr": ptr, "k_cache_ptr": "*u8" if cache else ptr,
        "v_cache_ptr": "*u8" if cache else ptr, "slot_ptr": "*i64", "k_scale": "fp32",
        "v_scale": "fp32", "fp8_max": "fp32",
    }, dict(NUM_KV_HEADS=kvh, HEAD_DIM=head_dim, BLOCK_T=max(1, 4096 // pow2(kvh * head_dim)),
            BLOCK_HD=pow2(kvh * head_dim), FP8=cache is not None,
            MANTISSA=mantissa, MIN_EXP=min_exp)
    yield paged_decode_split_kernel, {
        "q_ptr": ptr, "k_cache_ptr": cptr, "v_cache_ptr": cptr, "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "out_ptr": ptr, "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "qk_scale": "fp32", "v_scale": "fp32",
    }, dict(NUM_HEADS=kvh * group, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_G=max(16, pow2(group)), BLOCK_D=block_d, BLOCK_N=max(64, block_size),
            DOT_FP32=dot_fp32, SOFTCAP=softcap)
    yield paged_decode_reduce_kernel, {
        "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": ptr,
    }, dict(HEAD_DIM=head_dim, ROWS=1, BLOCK_S=MAX_SPLITS, BLOCK_D=block_d)
    block_m = max(64, pow2(group))
    yield paged_prefill_kernel, {
        "q_ptr": ptr, "k_cache_ptr": cptr, "v_cache_ptr": cptr, "block_tables_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": ptr,
        "qk_scale": "fp32", "v_scale": "fp32",
    }, dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_m // group, BLOCK_M=block_m,
            BLOCK_B=BLOCK_B, BLOCK_D=block_d, BLOCK_N=max(64, block_size), DOT_FP32=dot_fp32,
            SOFTCAP=softcap)


COMBOS = [  # dtype, head_dim, group, block_size, softcap
    ("fp16", 128, 4, 16, False),
    ("bf16", 80, 3, 32, True),
    ("fp32", 96, 1, 16, False),
    ("bf16", 64, 8, 16, False),
]
# FP8 caches: the conversions need sm_89 or later
FP8_COMBOS = [("bf16", 128, 4, 16, False, "fp8e4nv"), ("fp16", 64, 3, 16, True, "fp8e5")]


DECODE_TILES = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128)  # _gemm's buckets: decode, prefill
PREFILL_TILES = dict(BLOCK_M=128, BLOCK_N=128, BLOCK_K=64)


def quant_cases(arch: int):
    """(kernel, signature, constexprs, num_warps) of the quantized-weight GEMMs: W4A16 /
    W8A16 and FP8 W8A16 everywhere; the FP8 activation quant and W8A8 dots from sm_89."""
    for act, bits, zeros, act_order, tiles, warps in (
            ("bf16", 4, True, False, DECODE_TILES, 4),   # groups per tile, split-K
            ("fp16", 4, False, True, PREFILL_TILES, 8),  # act-order: groups per row
            ("bf16", 8, False, False, dict(BLOCK_M=64, BLOCK_N=128, BLOCK_K=64), 4)):
        yield int_weight_gemm_kernel, {
            "x_ptr": f"*{act}", "w_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8",
            "g_ptr": "*i32", "y_ptr": "*fp32" if tiles is DECODE_TILES else f"*{act}",
        }, dict(BITS=bits, HAS_ZEROS=zeros, ACT_ORDER=act_order, ROW_GROUPS=act_order,
                SPLIT=tiles is DECODE_TILES, DOT_FP32=False, **tiles), warps
    w8a8 = (True,) if arch >= 89 else ()
    for act_fp8 in (False, *w8a8):
        for act, scale_bn, tiles, warps in (("bf16", 1, DECODE_TILES, 4),
                                            ("fp16", 128, PREFILL_TILES, 8)):
            yield fp8_gemm_kernel, {
                "x_ptr": "*u8" if act_fp8 else f"*{act}", "xs_ptr": "*fp32", "w_ptr": "*u8",
                "ws_ptr": "*fp32", "y_ptr": "*fp32" if tiles is DECODE_TILES else f"*{act}",
            }, dict(ACT_FP8=act_fp8, SCALE_BN=scale_bn, SCALE_BK=128,
                    SPLIT=tiles is DECODE_TILES, DOT_FP32=False, **tiles), warps
    for static, block in ((False, 128), (True, 1024)) if w8a8 else ():
        yield quant_fp8_kernel, {
            "x_ptr": "*bf16", "q_ptr": "*u8", "s_ptr": "*fp32", "static_ptr": "*fp32",
        }, dict(STATIC=static, BLOCK=block), 4


def main(archs: list[int]) -> None:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for combo in COMBOS + (FP8_COMBOS if arch >= 89 else []):
            for kernel, types, constexprs in cases(*combo):
                compiled = compile_kernel(kernel, types, constexprs, target)
                assert compiled.asm.get("cubin"), f"no cubin for {kernel.name}"
                print(f"ok sm_{arch} {kernel.name} {combo}", flush=True)
        for kernel, types, constexprs, warps in quant_cases(arch):
            compiled = compile_kernel(kernel, types, constexprs, target, warps)
            assert compiled.asm.get("cubin"), f"no cubin for {kernel.name}"
            print(f"ok sm_{arch} {kernel.name} {constexprs}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90, 80])
