"""A quantized safetensors checkpoint: which linears it stores quantized, each one's
canonical weight (read lazily, tensor by tensor), and the float stream the loader copies
into the model (`--quantization none`'s weights, and what `auto` starts from).

The quantized linears are found from the tensors themselves, not from the config's ignore
lists: a prefix is quantized when it has the format's packed tensor (`qweight`,
`weight_packed`) or its `weight` is int8 / float8. Its other tensors (scales, zeros,
g_idx, shapes, static activation scales) are read only through `weight(prefix)`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Set
from contextlib import ExitStack
from pathlib import Path

import torch

from baton.engine.quant.formats import QuantWeight, quantized_suffixes, read_weight
from baton.engine.quant.spec import QuantSpec, read_spec

# tensors that belong to a quantized linear besides its weight (never loaded as parameters)
QUANT_SUFFIXES = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale",
                  "weight_scale_inv", "weight_zero_point", "weight_shape", "weight_g_idx",
                  "input_scale", "input_zero_point", "weight_global_scale")
QUANTIZED_WEIGHT_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)


def read_checkpoint_spec(model_dir: Path) -> QuantSpec | None:
    """The spec of `model_dir`'s config.json (None: not quantized)."""
    return read_spec(json.loads((model_dir / "config.json").read_text()))


class QuantCheckpoint:
    """The tensors of `files` (safetensors), indexed by name, opened memory-mapped."""

    def __init__(self, files: list[Path], spec: QuantSpec) -> None:
        from safetensors import safe_open

        self.spec = spec
        self._stack = ExitStack()
        self._where = {}
        for path in files:
            handle = self._stack.enter_context(safe_open(str(path), framework="pt",
                                                         device="cpu"))
            for name in handle.keys():
                self._where[name] = handle
        self.prefixes = self._quantized_prefixes()

    def close(self) -> None:
        self._stack.close()

    def __enter__(self) -> QuantCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def tensor(self, name: str) -> torch.Tensor | None:
        handle = self._where.get(name)
        return None if handle is None else handle.get_tensor(name)

    def _dtype(self, name: str) -> str:
        return self._where[name].get_slice(name).get_dtype()

    def _quantized_prefixes(self) -> list[str]:
        marks = quantized_suffixes(self.spec)
        found = []
        for name in self._where:
            prefix, _, suffix = name.rpartition(".")
            if suffix in marks or (suffix == "weight" and self._dtype(name) in ("I8", "F8_E4M3",
                                                                                  "F8_E5M2")):
                found.append(prefix)
        return sorted(found)

    def rows(self, prefix: str) -> int:
        """The output features (N) of the quantized linear `prefix`, read from its tensors'
        shapes (the packed ones': `weight_shape`) without unpacking its codes: GPTQ / AWQ
        `scales` (G, N), compressed-tensors `weight_packed`'s `weight_shape` (N, K), else
        the int8 / fp8 `weight` (N, K)."""
        if self.spec.method in ("gptq", "awq"):
            return self._shape(f"{prefix}.scales")[1]
        if f"{prefix}.weight_packed" in self._where:
            shape = self.tensor(f"{prefix}.weight_shape")
            if shape is None:
                raise ValueError("the quantized checkpoint lacks the linear's 'weight_shape'")
            return int(shape[0])
        return self._shape(f"{prefix}.weight")[0]

    def _shape(self, name: str) -> list[int]:
        if name not in self._where:
            raise ValueError(f"the quantized checkpoint lacks the linear's "
                             f"{name.rpartition('.')[2]!r}")
        return self._where[name].get_slice(name).get_shape()

    def weight(self, prefix: str) -> QuantWeight:
        """The canonical weight of the quantized linear `prefix`."""
        return read_weight(self.spec, prefix, lambda s: self.tensor(f"{prefix}.{s}"))

    def float_tensors(self, held: Set[str] = frozenset()) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) as an unquantized checkpoint would hold them: each quantized
        linear's `weight` de-quantized (float32), its other tensors left out; nothing of
        the `held` prefixes' weights (modules already hold them quantized)."""
        quantized = set(self.prefixes)
        for name in self._where:
            prefix, _, suffix = name.rpartition(".")
            if prefix in quantized:
                if suffix in (*QUANT_SUFFIXES, "weight"):
                    continue
            yield name, self._where[name].get_tensor(name)
        for prefix in self.prefixes:
            if prefix not in held:
                yield f"{prefix}.weight", self.weight(prefix).dequantize()
