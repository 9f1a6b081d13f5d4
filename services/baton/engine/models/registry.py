"""Which module implements each Hugging Face architecture.

Add an architecture by writing its module (a `CausalLM` subclass) and naming it here; the
loader imports only the module the checkpoint needs.
"""

from __future__ import annotations

import importlib

# architecture (config.json's `architectures[0]`) -> (module under baton.engine.models, class)
ARCHITECTURES: dict[str, tuple[str, str]] = {
    "LlamaForCausalLM": ("llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("llama", "LlamaForCausalLM"),
    "Qwen3ForCausalLM": ("qwen3", "Qwen3ForCausalLM"),
    "Phi3ForCausalLM": ("phi3", "Phi3ForCausalLM"),
    "Gemma2ForCausalLM": ("gemma", "Gemma2ForCausalLM"),
    "Gemma3ForCausalLM": ("gemma", "Gemma3ForCausalLM"),
    # The multimodal checkpoints (4B/12B/27B): their text model; vision weights skipped.
    "Gemma3ForConditionalGeneration": ("gemma", "Gemma3ForCausalLM"),
    "MixtralForCausalLM": ("moe", "MixtralForCausalLM"),
    "Qwen3MoeForCausalLM": ("moe", "Qwen3MoeForCausalLM"),
}

SUPPORTED_ARCHITECTURES = frozenset(ARCHITECTURES)

# model_type -> architecture, for configs without `architectures`.
MODEL_TYPES: dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "phi3": "Phi3ForCausalLM",
    "gemma2": "Gemma2ForCausalLM",
    "gemma3_text": "Gemma3ForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


def architecture_of(cfg: dict) -> str:
    archs = cfg.get("architectures")
    if archs:
        return archs[0]
    model_type = cfg.get("model_type")
    return MODEL_TYPES.get(model_type or "", f"<model_type {model_type!r}>")


def model_class(architecture: str) -> type:
    if architecture not in ARCHITECTURES:
        raise ValueError(f"model architecture {architecture!r} is not supported; supported: "
                         f"{sorted(SUPPORTED_ARCHITECTURES)}")
    module, name = ARCHITECTURES[architecture]
    return getattr(importlib.import_module(f"baton.engine.models.{module}"), name)
