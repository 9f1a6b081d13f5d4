"""A PEFT LoRA adapter on disk: `adapter_config.json` + `adapter_model.safetensors`, read
and checked (what Baton cannot apply is refused here, by name), its tensors grouped by the
module they adapt. Reads files: call it off the engine thread."""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import torch
from safetensors import safe_open

from baton.engine.lora.errors import LoRAError
from baton.engine.lora.pace import give_way
from baton.engine.models.hub import resolve_hub_model

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
# PEFT's prefix of every tensor name: base_model.model.<the base model's module names>
_PREFIX = "base_model.model."
# PEFT's names for a LoRA's two matrices: a linear's (lora_A.weight (r, in), lora_B.weight
# (out, r)) and an embedding's (lora_embedding_A (r, vocab), lora_embedding_B (hidden, r)).
_KINDS = {"A.weight": "A", "B.weight": "B", "embedding_A": "A", "embedding_B": "B"}
_BASE_LAYER = ".base_layer.weight"


@dataclass(frozen=True)
class ModuleLoRA:
    """One adapted module, named as in the base checkpoint (`model.layers.0.self_attn.q_proj`,
    `model.embed_tokens`, `lm_head`): A (r, in) and B (out, r), float32 (an embedding's A is
    (r, vocab): its delta for token t is B A[:, t]), and the scaling its delta is multiplied
    by."""

    a: torch.Tensor
    b: torch.Tensor
    scaling: float

    @property
    def rank(self) -> int:
        return self.a.shape[0]


@dataclass(frozen=True)
class PeftAdapter:
    path: Path  # the directory read
    modules: dict[str, ModuleLoRA]
    digest: str  # blake2b of the config and weights files: same digest, same adapter
    # the shapes of the frozen base weights PEFT saves beside an embedding's or head's LoRA
    # (`<module>.base_layer.weight`, kept in case the vocabulary was resized): checked
    # against the base model's, never loaded
    base_shapes: dict[str, tuple[int, ...]]

    @property
    def rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def read_peft_adapter(name: str, path: str, max_rank: int) -> PeftAdapter:
    """Read the adapter `name` from `path` (a directory, a hub cache repo, `hf://` or a repo
    id in the hub cache); LoRAError naming what is wrong: missing files, a LoRA variant or
    module Baton does not apply (DoRA, biases, modules_to_save, trainable tokens), a rank
    above `max_rank`."""
    try:
        where = Path(resolve_hub_model(path))
    except (FileNotFoundError, ValueError) as err:
        raise LoRAError(f"LoRA adapter {name!r}: {err}") from None
    files = [where / CONFIG_FILE, where / WEIGHTS_FILE]
    missing = [f.name for f in files if not f.is_file()]
    if missing:
        raise LoRAError(f"LoRA adapter {name!r}: {where} has no {' or '.join(missing)} (a PEFT "
                        "adapter directory holds adapter_config.json and "
                        "adapter_model.safetensors)")
    before = _stamps(files)
    digest = _digest(files)
    config = _parse_config(name, where, files[0].read_bytes())
    tensors, base_shapes = _read_tensors(name, files[1])
    if _stamps(files) != before:
        raise LoRAError(f"LoRA adapter {name!r}: {where} changed while it was read; load it "
                        "again once it is written")
    modules = _modules(name, config, tensors)
    too_big = sorted((m.rank, key) for key, m in modules.items() if m.rank > max_rank)
    if too_big:
        raise LoRAError(f"LoRA adapter {name!r} has rank {too_big[-1][0]} ({too_big[-1][1]}) "
                        f"above --max-lora-rank {max_rank}; start the engine with a larger "
                        "--max-lora-rank")
    return PeftAdapter(where, modules, digest, base_shapes)


def _stamps(files: list[Path]) -> list[tuple[int, int]]:
    """Each file's size and modification time: what changes when it is rewritten."""
    return [(st.st_size, st.st_mtime_ns) for st in (f.stat() for f in files)]


def _digest(files: list[Path]) -> str:
    """blake2b of the files one after the other, read in chunks (hashing lets go of the GIL,
    and nothing holds a whole file at once)."""
    hasher = hashlib.blake2b(digest_size=16)
    for file in files:
        with open(file, "rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 22), b""):
                hasher.update(chunk)
    return hasher.hexdigest()


def _read_tensors(name: str, file: Path
                  ) -> tuple[dict[str, torch.Tensor], dict[str, tuple[int, ...]]]:
    """The LoRA tensors, one at a time (giving way to the engine between them), and the
    shapes of the frozen base weights PEFT saves beside an embedding's or head's LoRA (never
    read: a vocabulary's worth of floats)."""
    tensors, base_shapes = {}, {}
    try:
        with safe_open(str(file), framework="pt") as stream:
            for i, key in enumerate(stream.keys()):
                if key.endswith(_BASE_LAYER):
                    module = key.removeprefix(_PREFIX).removesuffix(_BASE_LAYER)
                    base_shapes[module] = tuple(stream.get_slice(key).get_shape())
                    continue
                if i % 4 == 0:
                    give_way()
                tensors[key] = stream.get_tensor(key)
    except Exception as err:  # noqa: BLE001 - any parse failure is the file's fault
        raise LoRAError(f"LoRA adapter {name!r}: {file} is not a safetensors file ({err})"
                        ) from None
    return tensors, base_shapes


def _parse_config(name: str, where: Path, raw: bytes) -> dict:
    try:
        config = json.loads(raw)
    except ValueError as err:
        raise LoRAError(f"LoRA adapter {name!r}: {where / CONFIG_FILE} is not JSON ({err})"
                        ) from None
    if not isinstance(config, dict) or config.get("peft_type", "LORA") != "LORA":
        raise LoRAError(f"LoRA adapter {name!r}: {where / CONFIG_FILE} is not a LoRA adapter "
                        f"(peft_type {config.get('peft_type') if isinstance(config, dict) else None!r})")
    refusals = [("use_dora", bool(config.get("use_dora")), "DoRA adapters"),
                ("bias", config.get("bias", "none") != "none", "adapters that train biases"),
                ("modules_to_save", bool(config.get("modules_to_save")),
                 "adapters with fully trained modules (modules_to_save)"),
                ("lora_bias", bool(config.get("lora_bias")), "LoRA biases"),
                ("fan_in_fan_out", bool(config.get("fan_in_fan_out")),
                 "fan_in_fan_out (Conv1D) weights")]
    refusals.append(("trainable_token_indices", bool(config.get("trainable_token_indices")),
                     "adapters that train token embeddings (trainable_token_indices)"))
    for field, bad, what in refusals:
        if bad:
            raise LoRAError(f"LoRA adapter {name!r}: Baton does not serve {what} "
                            f"({CONFIG_FILE}: {field}); LoRA over linears and embeddings only")
    return config


def _modules(name: str, config: dict, tensors: dict[str, torch.Tensor]
             ) -> dict[str, ModuleLoRA]:
    """The (A, B) pair of each adapted module, named without PEFT's prefix."""
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        stem, dot, kind = key.rpartition(".lora_")
        if not dot or kind not in _KINDS:
            raise LoRAError(f"LoRA adapter {name!r}: tensor {key!r} is not a LoRA A or B (DoRA "
                            "magnitudes and biases are not served)")
        pairs.setdefault(stem.removeprefix(_PREFIX), {})[_KINDS[kind]] = tensor.float()
    if not pairs:
        raise LoRAError(f"LoRA adapter {name!r} holds no LoRA weights")
    modules = {}
    for module, ab in pairs.items():
        give_way()
        if set(ab) != {"A", "B"} or ab["A"].shape[0] != ab["B"].shape[1]:
            raise LoRAError(f"LoRA adapter {name!r}: {module} needs lora_A (r, in) and lora_B "
                            f"(out, r), found {({k: tuple(v.shape) for k, v in ab.items()})}")
        rank = ab["A"].shape[0]
        alpha = float(cast("float", _pattern_value(config.get("alpha_pattern") or {}, module,
                                                   config.get("lora_alpha", 8))))
        scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
        modules[module] = ModuleLoRA(ab["A"], ab["B"], scaling)
    return modules


def _pattern_value(patterns: dict[str, object], module: str, default: object) -> object:
    """PEFT's per-module override (`alpha_pattern`): the first key that matches the end of
    the module's name on a dot boundary, as `peft.utils.get_pattern_key` matches."""
    for pattern, value in patterns.items():
        if re.match(rf"(.*\.)?({pattern})$", module):
            return value
    return default
