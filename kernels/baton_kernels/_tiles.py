"""The inner step both attention kernels share: read a tile of K/V through the block table,
and fold it into an online softmax (log2 units, fp32 state)."""

from __future__ import annotations

import triton
import triton.language as tl

from baton_kernels._common import interpreting

LOG2E = 1.4426950408889634
NO_WINDOW = 1 << 30  # a window no sequence reaches: full causal attention


def softcap_args(scale: float, softcap: float | None) -> tuple[float, float]:
    """(cap_in, cap_out) for `online_softmax_step` from the full q.k scale (natural units,
    k_scale included) and the soft-cap (None: off, the pair unused)."""
    if softcap is None:
        return 0.0, 0.0
    return float(scale) / float(softcap), float(softcap) * LOG2E


@triton.jit
def load_kv_tile(k_cache_ptr, v_cache_ptr, bt_row, pos, n_mask, offs_d, d_mask, kvh,
                 block_size, stride_cb, stride_cs, stride_ch):
    """K transposed ``[D, N]`` and V ``[N, D]`` of positions ``pos`` (masked ones read 0)."""
    phys = tl.load(bt_row + pos // block_size, mask=n_mask, other=0).to(tl.int64)
    tok_off = phys * stride_cb + (pos % block_size) * stride_cs + kvh * stride_ch
    kt = tl.load(k_cache_ptr + tok_off[None, :] + offs_d[:, None],
                 mask=n_mask[None, :] & d_mask[:, None], other=0.0)          # [D, N]
    v = tl.load(v_cache_ptr + tok_off[:, None] + offs_d[None, :],
                mask=n_mask[:, None] & d_mask[None, :], other=0.0)           # [N, D]
    return kt, v


@triton.jit
def online_softmax_step(q, kt, v, visible, m_i, l_i, acc, qk_scale, cap_in, cap_out,
                        DOT_FP32: tl.constexpr, SOFTCAP: tl.constexpr):
    """Fold one K/V tile into (max, sum, acc) for the rows of ``q``; ``visible`` [rows, N]
    masks keys a row may not see (a row may see none of a tile). Returns the new (m_i, l_i,
    acc). An FP8 tile is widened to q's type (exact); its scales are the caller's (k_scale
    in qk_scale, v_scale on the output). With SOFTCAP, scores become
    ``cap * tanh(score / cap)`` (Gemma 2): ``cap_in = qk_scale / (log2(e) cap)``,
    ``cap_out = cap log2(e)``."""
    if DOT_FP32:
        s = tl.dot(q, kt.to(tl.float32), input_precision="ieee")
    else:
        s = tl.dot(q, kt.to(q.dtype))
    if SOFTCAP:
        t = s * cap_in
        s = cap_out * (1.0 - 2.0 / (tl.exp(2.0 * t) + 1.0))                  # tanh, log2 units
    else:
        s = s * qk_scale                                                     # log2 units
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # rows that saw no key yet
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    if DOT_FP32:
        pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(q.dtype), v.to(q.dtype))
    return m_new, l_i, acc * alpha[:, None] + pv


if interpreting():
    def loop_bound(x):
        """A loop bound computed in the kernel, as a Python int for the interpreter's
        ``range``. The interpreter holds a scalar as a 1-element 1-d numpy array, and triton
        3.6's ``tensor.__index__`` converts it with ``int(data)``, which NumPy >= 2.4 refuses
        ("only 0-dimensional arrays can be converted to Python scalars"); 3.7 squeezes first."""
        return x.handle.data.item() if isinstance(x, tl.tensor) else x
else:
    @triton.jit
    def loop_bound(x):
        """Compiled: the bound itself (inlined, so the loop compiles exactly as without it)."""
        return x
