"""CUDA: every attention kernel variant compiled at start, decode steps replayed from CUDA
graphs (`runner/cuda_graphs.py`) captured per batch size."""

from __future__ import annotations

from typing import TYPE_CHECKING

from baton.engine.models.layers import local_heads
from baton.engine.platforms.base import Platform

if TYPE_CHECKING:
    from baton.engine.runner.model_runner import ModelRunner


class CudaPlatform(Platform):
    name = "cuda"

    def __init__(self, cuda_graphs: bool) -> None:
        self.cuda_graphs = cuda_graphs  # False: `--enforce-eager`

    def warm_up(self, runner: ModelRunner) -> None:
        from baton.engine.quant.gpu_linear import GPUQuantLinear

        for module in runner.model.modules():  # quantized GEMMs' variants, before capture
            if isinstance(module, GPUQuantLinear):
                module.warm_up()
        warmup = getattr(runner.backend, "warmup", None)
        if warmup is not None:
            # Every kernel variant compiled now (eager mixed and prefill steps too), so no
            # request waits on a JIT; the capture below only records launches.
            warmup(*runner.kv_caches[0], runner.model.attention_specs(),
                   local_heads(runner.model_config.num_heads, runner.tp))
        if (self.cuda_graphs and runner.tp.size == 1
                and getattr(runner.backend, "supports_cuda_graphs", False)):
            graphs = runner.make_decode_graphs(use_graphs=True)
            graphs.capture()
            self.fast_decode = graphs

    def describe(self) -> str:
        sizes = getattr(self.fast_decode, "sizes", None)
        return f"platform cuda, cuda graphs {sizes or 'off'}"
