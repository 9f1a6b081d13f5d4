"""C kernels for the CPU, each built with the system compiler on first use (`build.py`) and
called through ctypes: the model's linears (`linear.py`: bf16 GEMM over VNNI-packed weights,
fp32 small-batch GEMV), its small fused ops (`ops.py`: add + RMSNorm, SiLU * up, rotary),
paged decode and prefill attention (`attention.py`), and a whole Llama decode step in one call
(`decode_step.py`). Sources and headers in `csrc/`; pure-torch references in `reference.py`.

Imports torch; imports nothing from `baton`. Every `load*` returns None where a kernel cannot
be built here (no compiler, a failed build): callers keep their torch path.
"""
