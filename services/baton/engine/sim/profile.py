"""A simulated device's profile: the device and the model it serves, as plain data (a YAML
file per device x model in `profiles/`, or any path), checked field by field."""

from __future__ import annotations

from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

PROFILES = Path(__file__).parent / "profiles"


@dataclass(frozen=True)
class SimDeviceSpec:
    """What bounds a step: effective memory bandwidth and compute (what serving kernels
    reach, not the datasheet's), a fixed cost per step (kernel launches; with CUDA graphs one
    replay), and the memory the KV pool sizes from."""

    name: str
    memory_gib: float
    memory_bandwidth_gbs: float
    peak_tflops: float
    launch_us: float
    gpu_memory_utilization: float = 0.9


@dataclass(frozen=True)
class SimModelShape:
    """A decoder-only transformer's shapes (Llama-style: gated MLP, grouped KV heads)."""

    name: str
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    weight_bytes: float = 2.0  # per parameter: 2 bf16, 1 fp8, ~0.56 int4 with scales
    kv_bytes: float = 2.0  # per KV element
    max_model_len: int = 8192

    @property
    def layer_params(self) -> int:
        """Weights of the transformer blocks: q, o; k, v; gate, up, down."""
        h, kv = self.hidden_size, self.num_kv_heads * self.head_dim
        attn = 2 * h * self.num_heads * self.head_dim + 2 * h * kv
        return self.num_layers * (attn + 3 * h * self.intermediate_size)

    @property
    def head_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def weight_bytes_total(self) -> float:
        """What a step reads of the weights: the blocks and the lm_head (the embedding
        rows a step looks up are negligible)."""
        return (self.layer_params + self.head_params) * self.weight_bytes

    @property
    def kv_bytes_per_token(self) -> float:
        return self.num_layers * 2 * self.num_kv_heads * self.head_dim * self.kv_bytes


@dataclass(frozen=True)
class SimProfile:
    name: str
    device: SimDeviceSpec
    model: SimModelShape

    def __post_init__(self) -> None:
        d, m = self.device, self.model
        positive = {"device.memory_gib": d.memory_gib,
                    "device.memory_bandwidth_gbs": d.memory_bandwidth_gbs,
                    "device.peak_tflops": d.peak_tflops,
                    **{f"model.{f.name}": getattr(m, f.name) for f in fields(m)
                       if f.name != "name"}}
        for name, value in positive.items():
            if not value > 0:
                raise ValueError(f"sim profile {self.name!r}: {name}={value!r} must be > 0")
        if d.launch_us < 0 or not 0 < d.gpu_memory_utilization <= 1:
            raise ValueError(f"sim profile {self.name!r}: device.launch_us must be >= 0 and "
                             "device.gpu_memory_utilization in (0, 1]")
        if self.kv_pool_bytes <= 0:
            raise ValueError(f"sim profile {self.name!r}: the model's weights "
                             f"({m.weight_bytes_total / 2**30:.1f} GiB) leave no KV memory "
                             f"on {d.memory_gib:g} GiB")

    @property
    def kv_pool_bytes(self) -> float:
        """The device memory the KV pool gets: the usable fraction less the weights."""
        d = self.device
        return d.memory_gib * 2**30 * d.gpu_memory_utilization - self.model.weight_bytes_total

    @classmethod
    def from_dict(cls, raw: dict[str, Any], where: str) -> SimProfile:
        try:
            return cls(str(raw["name"]), _build(SimDeviceSpec, raw["device"], where),
                       _build(SimModelShape, raw["model"], where))
        except KeyError as err:
            raise ValueError(f"sim profile {where}: missing {err.args[0]!r}") from None


def _build(kind, raw: Any, where: str):
    if not isinstance(raw, dict):
        raise ValueError(f"sim profile {where}: {kind.__name__} must be a mapping")
    known = {f.name: f.type for f in fields(kind)}
    unknown = sorted(set(raw) - set(known))
    if unknown:
        raise ValueError(f"sim profile {where}: unknown field {unknown[0]!r} (known: "
                         f"{', '.join(known)})")
    try:
        return kind(**{k: (str(v) if known[k] == "str" else int(v) if known[k] == "int"
                           else float(v)) for k, v in raw.items()})
    except TypeError as err:  # a required field missing
        raise ValueError(f"sim profile {where}: {err}") from None


def available() -> list[str]:
    return sorted(p.stem for p in PROFILES.glob("*.yaml"))


def load_profile(name_or_path: str) -> SimProfile:
    """A bundled profile by name (`h100-llama3-8b`) or a YAML file's path. ValueError names
    the bundled ones when neither exists."""
    import yaml

    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES / f"{name_or_path}.yaml"
    if not path.is_file():
        raise ValueError(f"sim profile {name_or_path!r} is neither a file nor one of "
                         f"{', '.join(available())}")
    raw = yaml.safe_load(path.read_text())
    if not isinstance(raw, dict):
        raise ValueError(f"sim profile {path}: not a YAML mapping")
    return SimProfile.from_dict(raw, str(path))
