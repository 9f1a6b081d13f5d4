"""`--enable-lora`, `--lora-modules`, `--max-loras`, `--max-lora-rank`, `--max-cpu-loras`:
the adapters an engine starts with and how many it holds where (vLLM's names and defaults)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import cast

# An adapter's name is the `model` a request names it by (and a metrics label).
_NAME = re.compile(r"^[A-Za-z0-9][\w.:/@+-]{0,127}$")


@dataclass(frozen=True)
class LoRAConfig:
    """`modules`: (name, path) of the adapters loaded at start (the path a directory, a
    hub cache repo or `hf://ORG/NAME`, as `--model` takes); `enabled` also with none (run-time
    loads only). `max_loras`: adapters resident in the batch's buffers at once (a step holds
    at most this many distinct adapters); `max_cpu_loras`: host copies kept (None: as many as
    `max_loras`); `max_lora_rank`: adapters of higher rank are refused."""

    enable: bool = False
    modules: tuple[tuple[str, str], ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None

    def __post_init__(self) -> None:
        object.__setattr__(self, "modules", parse_modules(self.modules))
        if not 1 <= self.max_loras <= 256:
            raise ValueError(f"EngineConfig.max_loras={self.max_loras!r} must be in [1, 256]")
        if not 1 <= self.max_lora_rank <= 512:
            raise ValueError(f"EngineConfig.max_lora_rank={self.max_lora_rank!r} must be in "
                             "[1, 512]")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(f"EngineConfig.max_cpu_loras={self.max_cpu_loras!r} must be None "
                             f"or >= max_loras ({self.max_loras})")

    def check_with(self, tensor_parallel_size: int, deterministic: bool,
                   speculative_method: str | None) -> None:
        """ValueError naming the setting LoRA is not served with yet, when enabled."""
        conflict = ("tensor_parallel_size > 1" if tensor_parallel_size > 1 else
                    "deterministic=True" if deterministic else
                    "speculative_config method 'draft_model'"
                    if speculative_method == "draft_model" else None)
        if self.enabled and conflict is not None:
            raise ValueError(f"EngineConfig.enable_lora / lora_modules: LoRA adapters are not "
                             f"served with {conflict} yet")

    @property
    def enabled(self) -> bool:
        return self.enable or bool(self.modules)

    @property
    def host_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


def check_name(name: str) -> str:
    """`name` if it can name an adapter (letters, digits, `_.:/@+-`, up to 128), else
    ValueError."""
    if not isinstance(name, str) or not _NAME.match(name):
        raise ValueError(f"LoRA adapter name {name!r} must start with a letter or digit and "
                         "hold only letters, digits and _.:/@+- (at most 128)")
    return name


def parse_modules(modules: object) -> tuple[tuple[str, str], ...]:
    """`--lora-modules` as given — `name=path` strings, (name, path) pairs or a mapping —
    as (name, path) pairs; ValueError for a malformed entry or a name given twice."""
    items: Iterable[object] = (
        modules.items() if isinstance(modules, Mapping) else [modules]
        if isinstance(modules, str) else cast("Iterable[object]", modules or ()))
    pairs: list[tuple[str, str]] = []
    for item in items:
        if isinstance(item, str):
            name, sep, path = item.partition("=")
            if not sep or not path:
                raise ValueError(f"EngineConfig.lora_modules entry {item!r} must be name=path")
        elif isinstance(item, tuple | list) and len(item) == 2:
            name, path = str(item[0]), str(item[1])
        else:
            raise ValueError(f"EngineConfig.lora_modules entry {item!r} must be name=path")
        pairs.append((check_name(name), path))
    names = [n for n, _ in pairs]
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ValueError(f"EngineConfig.lora_modules names {twice[0]!r} twice")
    return tuple(pairs)
