"""One quantized linear as its format stores it, read into one of two canonical forms.

`IntWeight`: w[n, k] = scales[n, g(k)] * (codes[n, k] - zeros[n, g(k)]), g(k) = g_idx[k]
(GPTQ act-order) or k // group_size; codes unsigned in [0, 2^bits).
`FP8Weight`: w[n, k] = values[n, k] * scales[.] with one scale per tensor, per output
channel, or per (bn, bk) block.

Each reader takes a `get(suffix)` that returns the linear's tensor `<prefix>.<suffix>` (None
when absent). Packing, per format (out = N rows, in = K columns of the float weight):
- compressed-tensors `pack-quantized`: `weight_packed` int32 (N, ceil(K / 32) * bits),
  values offset by 2^(bits-1), 32 / bits per word along K, low bits first (its dense
  packing, for the 4 and 8 bits served: no value straddles two words); `weight_zero_point`
  (asymmetric) packed the same way along N; `weight_shape` the float shape; `weight_g_idx`
  for act-order.
- compressed-tensors `int-quantized` / `naive-quantized`: `weight` int8 (N, K), signed.
- compressed-tensors `float-quantized`, transformers `fp8`: `weight` float8_e4m3fn (N, K);
  `weight_scale` (compressed-tensors) or `weight_scale_inv` (fp8, a multiplier too).
- GPTQ: `qweight` int32 (K * bits / 32, N), 32 / bits codes per word along K, low bits
  first; `qzeros` int32 (G, N * bits / 32) along N; `scales` (G, N); `g_idx` (K,). v1
  files (`checkpoint_format: gptq`) store each zero minus one.
- AWQ (GEMM): `qweight` int32 (K, N / 8) along N in AWQ's order (word nibble j holds
  column 8 i + [0, 2, 4, 6, 1, 3, 5, 7][j]); `qzeros` (G, N / 8) likewise; `scales` (G, N).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from baton.engine.quant.spec import QuantSpec, UnsupportedQuantization, WeightScheme

Getter = Callable[[str], torch.Tensor | None]
AWQ_COLUMN_OF_NIBBLE = (0, 2, 4, 6, 1, 3, 5, 7)


@dataclass(frozen=True)
class IntWeight:
    codes: torch.Tensor  # (N, K) uint8
    scales: torch.Tensor  # (N, G) float32
    zeros: torch.Tensor | None  # (N, G) int16; None: symmetric, 2^(bits-1)
    bits: int
    group_size: int  # K for one scale per channel
    g_idx: torch.Tensor | None = None  # (K,) int64: act-order groups

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.codes.shape)  # type: ignore[return-value]

    def groups(self) -> torch.Tensor:
        """(K,) the group of each input column."""
        if self.g_idx is not None:
            return self.g_idx
        return torch.arange(self.codes.shape[1]) // self.group_size

    def zero_points(self) -> torch.Tensor:
        """(N, G) int16 zeros, the symmetric ones made explicit."""
        if self.zeros is not None:
            return self.zeros
        return torch.full(self.scales.shape, 1 << (self.bits - 1), dtype=torch.int16)

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        g = self.groups()
        offset = self.codes.to(torch.int16) - self.zero_points()[:, g]  # (N, K)
        return offset.float() * self.scales[:, g]


@dataclass(frozen=True)
class FP8Weight:
    values: torch.Tensor  # (N, K) float8_e4m3fn
    scales: torch.Tensor  # (1, 1), (N, 1) or (ceil(N / bn), ceil(K / bk)) float32
    block: tuple[int, int] | None = None
    input_scale: torch.Tensor | None = None  # static activation scale (1,), else dynamic

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.values.shape)  # type: ignore[return-value]

    def dequantize(self) -> torch.Tensor:
        """(N, K) float32."""
        n, k = self.shape
        scales = self.scales
        if self.block is not None:
            bn, bk = self.block
            scales = scales.repeat_interleave(bn, 0)[:n].repeat_interleave(bk, 1)[:, :k]
        return self.values.float() * scales


QuantWeight = IntWeight | FP8Weight


def read_weight(spec: QuantSpec, prefix: str, get: Getter) -> QuantWeight:
    """The canonical weight of the linear `prefix`. Raises UnsupportedQuantization or
    ValueError (naming the tensor) for tensors that do not fit the spec."""
    scheme = spec.scheme_for(prefix).weights
    if spec.method == "gptq":
        return _gptq(scheme, get, spec.zeros_offset)
    if spec.method == "awq":
        return _awq(scheme, get)
    if scheme.kind == "float":
        return _fp8(scheme, get)
    if get("weight_packed") is not None:  # as a group's own format may say, not the config's
        return _ct_packed(scheme, get)
    return _ct_int8(scheme, get)


def quantized_suffixes(spec: QuantSpec) -> tuple[str, ...]:
    """The tensor suffixes that mark a linear as stored quantized (beside the `weight` of
    float and int8 formats, recognised by its dtype)."""
    return {"gptq": ("qweight",), "awq": ("qweight",)}.get(
        spec.method, ("weight_packed",))


def _need(get: Getter, name: str) -> torch.Tensor:
    tensor = get(name)
    if tensor is None:
        raise ValueError(f"the quantized checkpoint lacks the linear's {name!r}")
    return tensor


def _per_row(t: torch.Tensor, n: int) -> torch.Tensor:
    """(N, G): a per-tensor value (scale or zero) repeated per row."""
    if t.numel() == 1:
        return t.reshape(1, 1).expand(n, 1).contiguous()
    return t.reshape(n, -1)


def _scales_2d(scales: torch.Tensor, n: int) -> torch.Tensor:
    """Scales as (N, G) float32."""
    return _per_row(scales.float(), n)


def _group_size(scheme: WeightScheme, k: int, groups: int) -> int:
    if scheme.strategy in ("tensor", "channel") or groups == 1:
        return k
    size = scheme.group_size or -(-k // groups)
    if -(-k // size) != groups:
        raise ValueError(f"{groups} scale groups do not fit {k} inputs in groups of {size}")
    return size


def _ct_packed(scheme: WeightScheme, get: Getter) -> IntWeight:
    n, k = (int(v) for v in _need(get, "weight_shape").tolist())
    offset = 1 << (scheme.bits - 1)
    codes = unpack_words(_need(get, "weight_packed"), scheme.bits, dim=1)[:, :k]  # (N, K)
    scales = _scales_2d(_need(get, "weight_scale"), n)
    zeros = None
    if not scheme.symmetric:
        zp = _need(get, "weight_zero_point")
        if zp.dtype == torch.int32:  # packed along N, offset like the codes
            zeros = unpack_words(zp, scheme.bits, dim=0)[:n].to(torch.int16)
        else:  # stored signed (per tensor: one)
            zeros = zp.to(torch.int16) + offset
        zeros = _per_row(zeros, n)
    return IntWeight(codes.contiguous(), scales, zeros, scheme.bits,
                     _group_size(scheme, k, scales.shape[1]), _g_idx(get("weight_g_idx"), k))


def _ct_int8(scheme: WeightScheme, get: Getter) -> IntWeight:
    weight = _need(get, "weight")
    if weight.dtype != torch.int8:
        raise ValueError(f"an int-quantized weight stored as {weight.dtype}, not int8")
    n, k = weight.shape
    scales = _scales_2d(_need(get, "weight_scale"), n)
    zp = get("weight_zero_point")
    zeros = (None if scheme.symmetric or zp is None
             else _per_row(zp.to(torch.int16) + 128, n))
    return IntWeight((weight.to(torch.int16) + 128).to(torch.uint8), scales, zeros, 8,
                     _group_size(scheme, k, scales.shape[1]), _g_idx(get("weight_g_idx"), k))


def _fp8(scheme: WeightScheme, get: Getter) -> FP8Weight:
    weight = _need(get, "weight")
    if weight.dtype != torch.float8_e4m3fn:
        raise UnsupportedQuantization(f"fp8 weights stored as {weight.dtype} are not served "
                                      "(float8_e4m3fn is)")
    scales = get("weight_scale")
    scales = _need(get, "weight_scale_inv") if scales is None else scales
    n, k = weight.shape
    block = scheme.block if scheme.strategy == "block" else None
    if block is not None:
        expected = (-(-n // block[0]), -(-k // block[1]))
        scales = scales.float().reshape(expected)
    else:
        scales = _scales_2d(scales, n)
        if scales.shape[1] != 1:
            raise ValueError(f"fp8 scales of shape {tuple(scales.shape)} for a {n} x {k} "
                             f"weight by {scheme.strategy}")
    static = get("input_scale")
    return FP8Weight(weight, scales, block, None if static is None else static.float().reshape(1))


def _g_idx(g_idx: torch.Tensor | None, k: int) -> torch.Tensor | None:
    if g_idx is None:
        return None
    if g_idx.numel() != k:
        raise ValueError(f"g_idx of {g_idx.numel()} entries for {k} inputs")
    return g_idx.to(torch.int64)


def unpack_words(words: torch.Tensor, bits: int, dim: int) -> torch.Tensor:
    """int32 words -> their 32 / bits codes each, low bits first, laid out along `dim`
    (0: a word holds consecutive rows; 1: consecutive columns). Returns uint8."""
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)  # (per,)
    codes = (words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)  # (R, C, per)
    if dim == 0:
        return codes.permute(0, 2, 1).reshape(words.shape[0] * per, -1).to(torch.uint8)
    return codes.reshape(words.shape[0], -1).to(torch.uint8)


def _gptq(scheme: WeightScheme, get: Getter, zeros_offset: int) -> IntWeight:
    bits = scheme.bits
    codes = unpack_words(_need(get, "qweight"), bits, dim=0).T.contiguous()  # (N, K)
    n, k = codes.shape
    scales = _need(get, "scales").float().T.contiguous()  # (N, G)
    zeros = (unpack_words(_need(get, "qzeros"), bits, dim=1)[:, :n].to(torch.int16)
             + zeros_offset).T.contiguous()  # (N, G)
    g_idx = _g_idx(get("g_idx"), k)
    size = _group_size(scheme, k, scales.shape[1])
    if g_idx is not None and torch.equal(g_idx, torch.arange(k) // size):
        g_idx = None  # the trivial order: groups are runs of columns
    symmetric = scheme.symmetric and bool((zeros == 1 << (bits - 1)).all())
    return IntWeight(codes, scales, None if symmetric else zeros, bits, size, g_idx)


def _awq(scheme: WeightScheme, get: Getter) -> IntWeight:
    order = torch.tensor(AWQ_COLUMN_OF_NIBBLE)
    inverse = torch.argsort(order)  # column m of a word is nibble inverse[m]

    def columns(words: torch.Tensor) -> torch.Tensor:  # (R, C) -> (R, 8 C) in column order
        nibbles = unpack_words(words, 4, dim=1).reshape(words.shape[0], -1, 8)
        return nibbles[:, :, inverse].reshape(words.shape[0], -1)

    codes = columns(_need(get, "qweight")).T.contiguous()  # (N, K)
    n, k = codes.shape
    scales = _need(get, "scales").float().T.contiguous()  # (N, G)
    qzeros = get("qzeros")
    zeros = None if qzeros is None else columns(qzeros).to(torch.int16).T.contiguous()
    return IntWeight(codes, scales, zeros, 4, _group_size(scheme, k, scales.shape[1]))
