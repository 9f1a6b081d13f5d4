"""Owns the model weights, the paged KV cache and the sampler on one device."""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

import torch

from baton.engine.attention import ForwardContext, make_attention_backend
from baton.engine.attention.kv_quant import apply_kv_scales, kv_cache_dtype
from baton.engine.config import EngineConfig
from baton.engine.distributed import TPGroup
from baton.engine.models.layers import local_heads
from baton.engine.models.loader import default_cache_dir, load_model
from baton.engine.runner.batch import FlatBatch, build_batch
from baton.engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from baton.engine.runner.host_malloc import release_free_heap, tune_malloc_for_cpu_inference
from baton.engine.runner.tp import building_in, start_tensor_parallel
from baton.engine.runner.tp_wire import logits_calls
from baton.engine.sampler import Sampler, TokenLogprobs, prompt_logprobs
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.structured.masks import fill_grammar_masks

log = logging.getLogger(__name__)


class StepResult(NamedTuple):
    """One step's output: `sampled` and `logprobs` by request id; `failed` maps the
    requests whose own sampling settings raised (sampled nothing) to the error;
    `prompt_logprobs` the next prompt tokens' logprobs of requests asking for them (None
    for tokens a prefix-cache hit skipped), to append to `Request.prompt_logprobs`."""

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprobs]
    failed: dict[str, str]
    prompt_logprobs: dict[str, list[TokenLogprobs | None]] = {}


# Prompt positions whose logits are computed at once for prompt logprobs: (rows, vocab)
# float32 logits, ~200 KB a row at a 49k vocabulary.
PROMPT_LOGPROB_ROWS = 256


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError("EngineConfig.device='cuda' but no CUDA device is available")
    return torch.device(name)


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        """`tp`: a tensor-parallel follower's group (`tp_worker.py`); None on rank 0, which
        spawns the followers itself when `config.tensor_parallel_size` > 1 (`runner/tp.py`)."""
        self.config = config
        self.device = resolve_device(config.device)
        self.tp_leader, self.tp = start_tensor_parallel(config, model_dir, max_model_len,
                                                        self.device, tp)
        if self.device.type == "cpu":
            tune_malloc_for_cpu_inference()
        self.dtype = DTYPES[config.dtype]
        self.kv_dtype = kv_cache_dtype(config.kv_cache_dtype, self.dtype)  # FP8 or the model's
        cache_dir = Path(config.cache_dir) if config.cache_dir else default_cache_dir()
        with building_in(self.tp):  # this rank's slice of every weight
            self.model, self.model_config = load_model(model_dir, self.dtype, self.device,
                                                       max_model_len, config.load_format,
                                                       cache_dir)
        self.kv_scales = apply_kv_scales(self.model, self.kv_dtype)  # (k, v) by layer
        self.block_size = config.block_size
        self.num_blocks = self._num_blocks()
        cfg = self.model_config
        # One tensor for all layers (a transport can register it as a single region):
        # (layers, K/V, blocks, block_size, KVH, D), KVH this rank's kv heads. Zeroed:
        # masked padding must be finite.
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size,
                                    self.num_kv_heads, cfg.head_dim, dtype=self.kv_dtype,
                                    device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1])
                          for i in range(cfg.num_layers)]
        self.backend = make_attention_backend(
            config.attention_backend, self.device, self.dtype,
            (local_heads(cfg.num_heads, self.tp), self.num_kv_heads, cfg.head_dim), cache_dir)
        # On CPU in bfloat16, decode-only steps run as one native call (`native_decode`).
        self.native_decode = None
        if self.device.type == "cpu" and self.dtype == torch.bfloat16:
            from baton.engine.models import native_decode

            self.native_decode = native_decode.load(self.model, self.kv_caches, self.backend,
                                                    cache_dir)
        if self.device.type == "cpu":
            release_free_heap()  # the checkpoint's tensors, freed by packing
        self.sampler = Sampler(config.seed)
        self.max_model_len = max_model_len
        self.graphs: DecodeGraphs | None = None
        if (self.device.type == "cuda" and not config.enforce_eager and self.tp.size == 1
                and getattr(self.backend, "supports_cuda_graphs", False)):
            self.graphs = self.make_decode_graphs(use_graphs=True)
            self.graphs.capture()
        log.info("model %s (%s), %d KV blocks of %d tokens (%s), attention=%s, cuda "
                 "graphs=%s", cfg.architecture, config.dtype, self.num_blocks, self.block_size,
                 str(self.kv_dtype).removeprefix("torch."),
                 self.backend.name, self.graphs.sizes if self.graphs else "off")
        if self.tp_leader is not None:
            self.tp_leader.wait_ready(self.num_blocks)

    def make_decode_graphs(self, use_graphs: bool) -> DecodeGraphs:
        """Static-buffer decode replays for batch sizes up to max_num_seqs (not captured
        yet); `use_graphs=False` runs them eagerly, which tests use on CPU."""
        return DecodeGraphs(self.model, self.backend, self.kv_caches,
                            capture_sizes(self.config.max_num_seqs),
                            -(-self.max_model_len // self.block_size), self.device, use_graphs)

    @property
    def num_kv_heads(self) -> int:
        """The KV heads this rank's cache holds (all of them without tensor parallelism)."""
        return local_heads(self.model_config.num_kv_heads, self.tp)

    @property
    def bytes_per_block(self) -> int:
        cfg = self.model_config
        return (2 * cfg.num_layers * self.block_size * self.num_kv_heads * cfg.head_dim
                * torch.finfo(self.kv_dtype).bits // 8)

    def _num_blocks(self) -> int:
        if self.config.num_kv_blocks is not None:
            return self.config.num_kv_blocks
        n = self.config.kv_cache_memory_bytes // self.bytes_per_block
        if n < 1:
            raise ValueError(f"EngineConfig.kv_cache_memory_bytes="
                             f"{self.config.kv_cache_memory_bytes} holds no KV block "
                             f"({self.bytes_per_block} bytes each)")
        return int(n)

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids_of: Callable[[str], list[int]]
                ) -> StepResult:
        """Run one step: the sampled token and logprobs of each request that reached the
        end of its known tokens, and the requests whose own sampling settings failed."""
        batch = build_batch(out.rows, block_ids_of, self.block_size, self.device)
        if self.tp_leader is not None:  # the followers run the same forward and logits calls
            self.tp_leader.send_step(batch, logits_calls(batch, PROMPT_LOGPROB_ROWS))
        reqs = [s.request for s in batch.sampling_entries]
        hidden = self._forward(batch)  # (T, h)
        # Host work while a GPU runs the forward (launched, not finished): grammar masks.
        masks = fill_grammar_masks(reqs)
        prompt_lps = self._prompt_logprobs(batch, hidden)
        if not reqs:
            return StepResult({}, {}, {}, prompt_lps)
        rows = torch.tensor(batch.logits_indices, device=hidden.device)
        logits = self.model.compute_logits(hidden.index_select(0, rows))  # (N, V)
        failed: dict[str, str] = {}
        tokens, logprobs = self.sampler(logits, reqs, failed, masks)
        sampled = {r.request_id: t for r, t in zip(reqs, tokens) if r.request_id not in failed}
        lps = {r.request_id: lp for r, lp in zip(reqs, logprobs) if lp is not None}
        return StepResult(sampled, lps, failed, prompt_lps)

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        """The last hidden states of every row of the batch, (T, h)."""
        if self.graphs is not None and self.graphs.can_run(batch):
            hidden = self.graphs.run(batch)  # (T, h), T = number of decodes
        elif self.native_decode is not None and self.native_decode.can_run(batch):
            hidden = self.native_decode(batch)  # (T, h)
        else:
            ctx = ForwardContext(self.backend, self.backend.build_metadata(batch.layout),
                                 self.kv_caches)
            hidden = self.model(batch.input_ids, batch.positions, ctx)  # (T, h)
        return hidden

    def _prompt_logprobs(self, batch: FlatBatch, hidden: torch.Tensor
                         ) -> dict[str, list[TokenLogprobs | None]]:
        """The prompt logprobs this step's prompt chunks give, by request id; their logits
        computed PROMPT_LOGPROB_ROWS rows at a time."""
        out: dict[str, list[TokenLogprobs | None]] = {}
        for span in batch.prompt_logprob_spans:
            req = span.request
            lps: list[TokenLogprobs | None] = [None] * span.gap
            for first in range(0, span.count, PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, span.count - first)
                logits = self.model.compute_logits(
                    hidden[span.row + first:span.row + first + n])  # (n, V)
                target = span.first_target + first
                lps += prompt_logprobs(logits, req.prompt_token_ids[target:target + n],
                                       req.sampling_params.prompt_logprobs)
            out[req.request_id] = lps
        return out

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any."""
        if self.tp_leader is not None:
            self.tp_leader.close()
