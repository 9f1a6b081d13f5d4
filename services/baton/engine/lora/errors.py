"""What the LoRA package raises: an adapter that cannot be served (bad files, a rank above
`--max-lora-rank`, modules Baton does not adapt), and a request or unload naming an adapter
this engine does not know."""

from __future__ import annotations


class LoRAError(ValueError):
    """An adapter that cannot be loaded as given; the message names the adapter, its path
    and what to change. The worker answers 400."""


class UnknownLoRAError(KeyError):
    """A name that is neither the base model nor a loaded adapter. The worker answers 404
    (vLLM's answer to a request for a model it does not serve)."""

    def __init__(self, name: str, known: list[str]) -> None:
        super().__init__(name)
        self.name = name
        self.message = (f"the LoRA adapter {name!r} does not exist; loaded adapters: "
                        f"{', '.join(known) or 'none'}")

    def __str__(self) -> str:
        return self.message
