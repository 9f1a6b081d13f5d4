"""Baton: disaggregated prefill/decode LLM serving.

`from baton import LLM, SamplingParams` is the offline entry point, shaped like vLLM's.
The engine (and torch) load lazily so that torch-free parts (router, common) can import
`baton.*` without paying for torch.
"""

from typing import TYPE_CHECKING

from baton.common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from baton.engine.llm import LLM
    from baton.engine.outputs import CompletionOutput, RequestOutput

__all__ = ["LLM", "SamplingParams", "RequestOutput", "CompletionOutput"]
__version__ = "0.1.0"


def __getattr__(name: str):
    if name == "LLM":
        from baton.engine.llm import LLM

        return LLM
    if name in ("RequestOutput", "CompletionOutput"):
        from baton.engine import outputs

        return getattr(outputs, name)
    raise AttributeError(f"module 'baton' has no attribute {name!r}")
