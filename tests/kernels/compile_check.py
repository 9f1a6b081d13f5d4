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
from baton_kernels.decode_attention import (paged_decode_reduce_kernel,  # noqa: E402
                                            paged_decode_split_kernel)
from baton_kernels.prefill_attention import paged_prefill_kernel  # noqa: E402


def signature(fn, types: dict[str, str], constexprs: dict) -> dict[str, str]:
    """Every argument of ``fn``: constexprs marked 'constexpr', the rest from ``types`` or i32."""
    return {name: "constexpr" if name in constexprs else types.get(name, "i32")
            for name in fn.arg_names}


def pow2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def cases(dtype: str, head_dim: int, group: int, splits: int, block_size: int):
    """(kernel, signature, constexprs) for every kernel at one dtype/head-dim combination."""
    ptr = f"*{dtype}"
    block_d = max(16, pow2(head_dim))
    dot_fp32 = dtype == "fp32"
    kvh = 2
    yield reshape_and_cache_kernel, {
        "k_ptr": ptr, "v_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "slot_ptr": "*i64",
    }, dict(NUM_KV_HEADS=kvh, HEAD_DIM=head_dim, BLOCK_T=max(1, 4096 // pow2(kvh * head_dim)),
            BLOCK_HD=pow2(kvh * head_dim))
    yield paged_decode_split_kernel, {
        "q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "block_tables_ptr": "*i32",
        "seq_lens_ptr": "*i32", "out_ptr": ptr, "part_out_ptr": "*fp32",
        "part_lse_ptr": "*fp32", "qk_scale": "fp32",
    }, dict(NUM_HEADS=kvh * group, GROUP=group, HEAD_DIM=head_dim, NUM_SPLITS=splits,
            BLOCK_G=max(16, pow2(group)), BLOCK_D=block_d, BLOCK_N=max(64, block_size),
            DOT_FP32=dot_fp32)
    if splits > 1:
        yield paged_decode_reduce_kernel, {
            "part_out_ptr": "*fp32", "part_lse_ptr": "*fp32", "out_ptr": ptr,
        }, dict(NUM_HEADS=kvh * group, HEAD_DIM=head_dim, NUM_SPLITS=splits, ROWS=1,
                BLOCK_S=pow2(splits), BLOCK_D=block_d)
    block_m = max(64, pow2(group))
    yield paged_prefill_kernel, {
        "q_ptr": ptr, "k_cache_ptr": ptr, "v_cache_ptr": ptr, "block_tables_ptr": "*i32",
        "query_start_loc_ptr": "*i32", "seq_lens_ptr": "*i32", "out_ptr": ptr,
        "qk_scale": "fp32",
    }, dict(GROUP=group, HEAD_DIM=head_dim, BLOCK_Q=block_m // group, BLOCK_M=block_m,
            BLOCK_B=16, BLOCK_D=block_d, BLOCK_N=max(64, block_size), DOT_FP32=dot_fp32)


COMBOS = [  # dtype, head_dim, group, splits, block_size
    ("fp16", 128, 4, 1, 16),
    ("bf16", 80, 3, 4, 32),
    ("fp32", 96, 1, 2, 16),
    ("bf16", 64, 8, 8, 16),
]


def main(archs: list[int]) -> None:
    for arch in archs:
        target = GPUTarget("cuda", arch, 32)
        for combo in COMBOS:
            for fn, types, constexprs in cases(*combo):
                src = ASTSource(fn, signature(fn, types, constexprs), constexprs)
                kernel = compile(src, target=target, options={"num_warps": 4})
                assert kernel.asm.get("cubin"), f"no cubin for {fn.__name__}"
                print(f"ok sm_{arch} {fn.__name__} {combo}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [90, 80])
