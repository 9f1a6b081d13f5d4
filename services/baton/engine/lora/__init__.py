"""Multi-LoRA serving (`--enable-lora`, `--lora-modules`): PEFT adapters over one base model,
requests of different adapters and of the base batched in one forward pass. Importing the
package loads no torch (the config and the errors); its modules with tensors do."""

from baton.engine.lora.config import LoRAConfig
from baton.engine.lora.errors import LoRAError, UnknownLoRAError

__all__ = ["LoRAConfig", "LoRAError", "UnknownLoRAError"]
