"""A GGUF file's linear weights as the file holds them (raw quantized blocks), mapped onto our
Llama-style modules, for `--quantization auto` (`platforms/cpu_quant.py` serves them).

GGUF names a layer's linears `blk.N.attn_q` / `attn_k` / `attn_v` / `attn_output` /
`ffn_gate` / `ffn_up` / `ffn_down`, the head `output` (absent when tied to `token_embd`).
Our modules fuse q, k, v into `attn.qkv_proj` and gate, up into `mlp.gate_up_proj`: their
rows are concatenated, raw (a row of blocks is a row of the matrix). llama.cpp's converter
permutes the rows of q and k of `llama` files (rotary halves interleaved); transformers'
GGUF loader, which built our de-quantized copy, undoes it (`_reverse_permute_weights`), and
so does `unpermute_rows` here, on whole rows of blocks. A fused module's parts may differ in
type (llama.cpp's Q4_K_M stores some layers' attn_v in Q6_K beside Q4_K q and k): it is
then a list of parts, each in its own type.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from baton.engine.models.loader import bundled_gguf_path

# our module (under layers[i], or the model) -> the GGUF tensors whose rows it concatenates
LAYER_LINEARS = {
    "attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}
FLOAT_TYPES = ("F32", "F16", "BF16")  # not quantized: served de-quantized, as before


@dataclass(frozen=True)
class RawPart:
    """Consecutive rows of a linear in one GGUF type: `raw` uint8 (rows, in / block elements
    * block bytes) for a quantized type, or the file's floats for FLOAT_TYPES."""

    type_name: str
    raw: torch.Tensor
    sources: tuple[str, ...]  # the GGUF tensors whose rows these are, in order


@dataclass(frozen=True)
class RawLinear:
    """One of our linears as the file stores it: its rows as parts, consecutive tensors of
    one type merged into one part."""

    module: str  # e.g. layers.3.attn.qkv_proj, lm_head
    parts: tuple[RawPart, ...]
    in_features: int

    @property
    def sources(self) -> tuple[str, ...]:
        return tuple(name for part in self.parts for name in part.sources)

    @property
    def type_names(self) -> tuple[str, ...]:
        return tuple(part.type_name for part in self.parts)

    @property
    def is_float(self) -> bool:
        """Not quantized (left to the loader's de-quantized copy)."""
        return all(name in FLOAT_TYPES for name in self.type_names)


def gguf_source(model: str | None) -> Path | None:
    """The GGUF file a `--model` value loads (None: the bundled one), or None for a
    checkpoint that is not a GGUF file."""
    if model is None:
        return bundled_gguf_path()
    path = Path(model).expanduser()
    return path if path.suffix == ".gguf" and path.is_file() else None


def unpermute_rows(rows: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation (transformers' `_reverse_permute_weights`):
    rows (out, ...) seen as (n_head, out / n_head / 2, 2, ...) -> (n_head, 2, dim, ...)."""
    dim = rows.shape[0] // n_head // 2
    return rows.reshape(n_head, dim, 2, *rows.shape[1:]).swapaxes(2, 1).reshape(rows.shape)


class GGUFLinears:
    """The linear tensors of one GGUF file (memory-mapped by `gguf.GGUFReader`)."""

    def __init__(self, path: Path) -> None:
        from gguf import GGUFReader

        self.path = path
        self.reader = GGUFReader(str(path))
        self.tensors = {t.name: t for t in self.reader.tensors}
        field = self.reader.get_field("general.architecture")
        self.architecture = "" if field is None else str(field.contents())

    def _field(self, key: str) -> int | None:
        field = self.reader.get_field(f"{self.architecture}.{key}")
        return None if field is None else int(field.contents())

    def _rows(self, name: str) -> np.ndarray:
        """A tensor's rows (out, bytes or elements per row), un-permuted for llama q / k."""
        rows = np.asarray(self.tensors[name].data)
        heads, kv_heads = self._field("attention.head_count"), self._field(
            "attention.head_count_kv")
        if self.architecture == "llama" and heads is not None:
            if ".attn_q." in name:
                return unpermute_rows(rows, heads)
            if ".attn_k." in name:
                return unpermute_rows(rows, kv_heads or heads)
        return rows

    def linear(self, module: str, names: tuple[str, ...]) -> RawLinear | None:
        """The rows of `names` concatenated as `module`, or None where the file lacks one,
        they differ in width, or float and quantized parts mix (the module stays
        de-quantized)."""
        if not all(n in self.tensors for n in names):
            return None
        types = [self.tensors[n].tensor_type.name for n in names]
        widths = {int(self.tensors[n].shape[0]) for n in names}  # GGUF shapes are (in, out)
        if len(widths) != 1 or (len(set(types)) > 1 and set(types) & set(FLOAT_TYPES)):
            return None
        parts: list[RawPart] = []
        for name, kind in zip(names, types, strict=True):
            sources: tuple[str, ...] = (name,)
            if parts and parts[-1].type_name == kind:  # one part per run of a type
                sources = (*parts.pop().sources, name)
            rows = np.concatenate([self._rows(n) for n in sources])
            parts.append(RawPart(kind, torch.from_numpy(np.ascontiguousarray(rows)), sources))
        return RawLinear(module, tuple(parts), widths.pop())

    def linears(self, num_layers: int, tied: bool) -> Iterator[RawLinear | None]:
        """Every layer's linears and the head (`token_embd` when `tied`); None for each
        that cannot be taken as stored."""
        for i in range(num_layers):
            for module, parts in LAYER_LINEARS.items():
                yield self.linear(f"layers.{i}.{module}", tuple(f"blk.{i}.{p}.weight"
                                                                for p in parts))
        yield self.linear("lm_head", ("token_embd.weight" if tied else "output.weight",))
