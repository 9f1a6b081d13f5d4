"""Owns the model weights, the paged KV cache and the sampler on one device."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch

from baton.engine.attention import ForwardContext, make_attention_backend
from baton.engine.attention.kv_quant import apply_kv_scales, kv_cache_dtype
from baton.engine.config import EngineConfig
from baton.engine.distributed import TPGroup
from baton.engine.logprobs import TokenLogprobs, prompt_logprob_table, read_prompt_logprobs
from baton.engine.lora.manager import LoRAManager
from baton.engine.lora.targets import LoRATarget, lora_targets
from baton.engine.models.base import CausalLM
from baton.engine.models.layers import local_heads
from baton.engine.models.loader import default_cache_dir, load_model
from baton.engine.platforms import make_platform
from baton.engine.runner.ahead import (
    LaunchedRow,
    StepInFlight,
    fill_pending,
    pending_tokens,
    sampled_index,
)
from baton.engine.runner.batch import BlockRow, FlatBatch, build_batch
from baton.engine.runner.cuda_graphs import DecodeGraphs, capture_sizes
from baton.engine.runner.memory import CudaMemory, KVMemoryPlan, KVMemoryProfiler, largest_batch
from baton.engine.runner.step_result import FinishedStep, StepResult
from baton.engine.runner.tp import building_in, start_tensor_parallel
from baton.engine.runner.tp_wire import logits_calls
from baton.engine.sample_readback import stage
from baton.engine.sampler import Sampler
from baton.engine.scheduler.output import SchedulerOutput
from baton.engine.spec.rejection import RejectionSampler
from baton.engine.spec.verify import sampler_rows
from baton.engine.staging import HostStaging
from baton.engine.structured.masks import fill_grammar_masks

log = logging.getLogger(__name__)


# Prompt positions whose logits are computed at once for prompt logprobs: (rows, vocab)
# float32 logits, ~200 KB a row at a 49k vocabulary.
PROMPT_LOGPROB_ROWS = 256


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    """The device `EngineConfig.device` names: `auto` is CUDA when torch can use a GPU, else
    the CPU with a warning saying why; `cuda` without a usable GPU raises ValueError at
    once, naming the versions found (never a silent fall back to the CPU)."""
    if name == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda")
        log.warning("--device auto: serving on the CPU, no usable GPU (%s); pass --device "
                    "cuda to fail instead", cuda_report())
        return torch.device("cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"EngineConfig.device='cuda' but torch finds no usable GPU: "
                         f"{cuda_report()}. Install a torch built for this driver's CUDA "
                         "version (or a newer driver), or pass --device cpu")
    return torch.device(name)


def cuda_report() -> str:
    """What torch knows of CUDA here: its version and CUDA build, is_available(), the
    device count and, when the driver answers, the CUDA version it supports."""
    parts = [f"torch {torch.__version__}, torch.version.cuda={torch.version.cuda}",
             f"torch.cuda.is_available()={torch.cuda.is_available()}",
             f"torch.cuda.device_count()={torch.cuda.device_count()}"]
    driver = _driver_cuda_version()
    parts.append(f"driver CUDA version {driver}" if driver else "no CUDA driver found")
    return ", ".join(parts)


def _driver_cuda_version() -> str | None:
    """The CUDA version the installed driver supports (cuDriverGetVersion), or None."""
    import ctypes

    for lib in ("libcuda.so.1", "libcuda.so", "nvcuda.dll"):
        try:
            cuda = ctypes.CDLL(lib)
        except OSError:
            continue
        version = ctypes.c_int(0)
        if cuda.cuDriverGetVersion(ctypes.byref(version)) == 0 and version.value:
            return f"{version.value // 1000}.{version.value % 1000 // 10}"
    return None


class ModelRunner:
    def __init__(self, config: EngineConfig, model_dir: Path, max_model_len: int,
                 tp: TPGroup | None = None) -> None:
        """`tp`: a tensor-parallel follower's group (`tp_worker.py`); None on rank 0, which
        spawns the followers itself when `config.parallel.tensor_parallel_size` > 1 (`runner/tp.py`)."""
        self.config = config
        self.device = resolve_device(config.compute.device)
        # CUDA without a fixed pool size: the pool is what the device's fraction leaves
        fraction = config.cache.pool_fraction(self.device.type)
        profiler = (KVMemoryProfiler(CudaMemory(self.device), fraction)
                    if fraction is not None else None)
        if config.cache.gpu_memory_utilization is not None and profiler is None:
            log.warning("--gpu-memory-utilization is ignored: the KV pool is %s",
                        "--num-kv-blocks" if config.cache.num_kv_blocks is not None else
                        "--kv-cache-gib" if config.cache.kv_cache_memory_bytes is not None else
                        f"--kv-cache-gib's default off CUDA (device {self.device})")
        self.tp_leader, self.tp = start_tensor_parallel(config, model_dir, max_model_len,
                                                        self.device, tp)
        self.dtype = DTYPES[config.checkpoint.dtype]
        self.kv_dtype = kv_cache_dtype(config.cache.kv_cache_dtype, self.dtype)  # FP8 or the model's
        cache_dir = Path(config.checkpoint.cache_dir) if config.checkpoint.cache_dir else default_cache_dir()
        self.platform = make_platform(self.device, cache_dir,
                                      cuda_graphs=not config.compute.enforce_eager,
                                      deterministic=config.compute.deterministic)
        lora_targets = self._load_model(model_dir, max_model_len, cache_dir)
        self.kv_scales = apply_kv_scales(self.model, self.kv_dtype)  # (k, v) by layer
        self.block_size = config.cache.block_size
        cfg = self.model_config
        self.backend = make_attention_backend(
            config.compute.attention_backend, self.device, self.dtype,
            (local_heads(cfg.num_heads, self.tp), self.num_kv_heads, cfg.head_dim), cache_dir,
            config.compute.deterministic)
        self.kv_memory: KVMemoryPlan | None = None  # the profile's numbers, when one ran
        self.num_blocks = self._num_blocks(profiler, max_model_len)
        # One tensor for all layers (a transport can register it as a single region):
        # (layers, K/V, blocks, block_size, KVH, D), KVH this rank's kv heads. Zeroed:
        # masked padding must be finite.
        self.kv_cache = torch.zeros(cfg.num_layers, 2, self.num_blocks, self.block_size,
                                    self.num_kv_heads, cfg.head_dim, dtype=self.kv_dtype,
                                    device=self.device)
        self.kv_caches = [(self.kv_cache[i, 0], self.kv_cache[i, 1]) for i in range(cfg.num_layers)]
        self.sampler = Sampler(config.compute.seed)
        self.rejection = RejectionSampler(config.compute.seed)  # sampled requests' guesses
        self.staging = HostStaging(self.device)  # the batch metadata's one copy a step
        self.busy_seconds = 0.0  # time in the model steps (forward, logits, sampling)
        # launched ahead on CUDA (tests set it on CPU); `auto` schedules ahead where measured
        self.launches_async = self.device.type == "cuda"
        self.async_by_default = self.launches_async and self.tp.size == 1
        self._ahead: StepInFlight | None = None  # the last step launched ahead
        self.max_model_len = max_model_len
        self.platform.warm_up(self)
        self.lora = None if lora_targets is None else LoRAManager(
            self.model, lora_targets, config.lora, self.dtype, self.device, cache_dir)
        if self.lora is not None:
            self.lora.attach_fast_path(self.platform.fast_decode, cfg.num_layers)
        log.info("model %s (%s), %d KV blocks of %d tokens (%s), attention=%s, %s",
                 cfg.architecture, config.checkpoint.dtype, self.num_blocks, self.block_size,
                 str(self.kv_dtype).removeprefix("torch."),
                 self.backend.name, self.platform.describe())
        if self.tp_leader is not None:
            self.tp_leader.wait_ready(self.num_blocks)

    def _load_model(self, model_dir: Path, max_model_len: int, cache_dir: Path
                    ) -> dict[str, LoRATarget] | None:
        """Load this rank's weights, keep a GGUF's or a quantized checkpoint's linears
        quantized (`--quantization auto`) and prepare the model for the platform; returns,
        when LoRA is on, the adaptable linears' layout, read before the platform swaps
        them (`engine.lora`)."""
        from baton.engine.platforms.cpu_quant import keep_quantized
        from baton.engine.quant.serve import swap_quantized_linears

        config = self.config
        auto = config.checkpoint.quantization == "auto"

        def swap(model: CausalLM) -> set[str]:  # quantized linears, before (or after) the load
            return swap_quantized_linears(model, model_dir, self.device, self.dtype, self.tp,
                                          cache_dir)

        # LoRA reads the linears' layout from the loaded model: swap after it then
        early = auto and not config.lora.enabled
        with building_in(self.tp):  # this rank's slice of every weight
            self.model, self.model_config = load_model(
                model_dir, self.dtype, self.device, max_model_len,
                config.checkpoint.load_format, swap if early else None)
        targets = lora_targets(self.model) if config.lora.enabled else None
        if auto:
            keep_quantized(self.model, config.checkpoint.model, self.device, self.dtype,
                           self.tp.size, cache_dir)
            if not early:
                swap(self.model)
        self.platform.prepare(self.model)  # e.g. packed weights and fused kernels on CPU
        return targets

    def make_decode_graphs(self, use_graphs: bool) -> DecodeGraphs:
        """Static-buffer decode replays for batch sizes up to max_num_seqs (not captured
        yet); `use_graphs=False` runs them eagerly, which tests use on CPU."""
        return DecodeGraphs(self.model, self.backend, self.kv_caches,
                            capture_sizes(self.config.scheduler.max_num_seqs),
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

    def _num_blocks(self, profiler: KVMemoryProfiler | None, max_model_len: int) -> int:
        """The KV pool's blocks: `num_kv_blocks`, else what `kv_cache_bytes` holds, else
        (CUDA) what the device's fraction leaves after a profiled forward (`memory.py`);
        tensor-parallel ranks take the smallest of theirs."""
        if self.config.cache.num_kv_blocks is not None:
            return self.config.cache.num_kv_blocks
        if profiler is None:
            n = self.config.cache.budget_bytes // self.bytes_per_block
            if n < 1:
                raise ValueError(f"EngineConfig.kv_cache_memory_bytes="
                                 f"{self.config.cache.budget_bytes} holds no KV block "
                                 f"({self.bytes_per_block} bytes each)")
            return int(n)
        self.kv_memory = profiler.plan(self.bytes_per_block,
                                       lambda: self._profile_forward(max_model_len))
        log.info("KV pool from the device's memory: %s", self.kv_memory.describe())
        blocks = torch.tensor([self.kv_memory.num_blocks], device=self.device)
        return int(self.tp.all_gather(blocks, dim=0).min())

    @torch.inference_mode()
    def _profile_forward(self, max_model_len: int) -> None:
        """One forward of the largest batch the scheduler can make, over a one-block cache
        (nothing written), then logits and the sampler's sort for as many rows as a step
        computes logits for: its peak is the activation memory the KV pool must leave."""
        cfg, config = self.model_config, self.config
        cache = torch.zeros(cfg.num_layers, 2, 1, self.block_size, self.num_kv_heads,
                            cfg.head_dim, dtype=self.kv_dtype, device=self.device)
        ids, positions, layout = largest_batch(
            config.scheduler.max_num_batched_tokens, config.scheduler.max_num_seqs, max_model_len,
            self.block_size, self.device)
        ctx = ForwardContext(self.backend, self.backend.build_metadata(layout),
                             [(cache[i, 0], cache[i, 1]) for i in range(cfg.num_layers)])
        hidden = self.model(ids, positions, ctx)  # (T, h)
        rows = min(hidden.shape[0], max(config.scheduler.max_num_seqs, PROMPT_LOGPROB_ROWS))
        logits = self.model.compute_logits(hidden[-rows:]).float()  # (N, V)
        torch.sort(torch.softmax(logits, dim=-1), dim=-1, descending=True)  # top-p's sort
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # Async scheduling (`engine.step_pipeline`): on CUDA a step is launched ahead of the host
    # (`runner/ahead.py`); elsewhere `launch` runs it whole, its pending ids written in first.
    idle_seconds = None  # not tracked: the device waits on the host whenever it is not stepping

    def launch(self, out: SchedulerOutput, block_ids_of: Callable[[str], BlockRow],
               since: float | None = None) -> FinishedStep | StepInFlight:
        """The engine's async-scheduling seam: the step launched; `result()` reads it."""
        if not self.launches_async:
            return FinishedStep(self.execute(out, block_ids_of))
        prev, self._ahead = self._ahead, None
        batch = build_batch(out.rows, block_ids_of, self.block_size, self.device,
                            self.staging, pending=prev.token_index if prev is not None else {})
        t0 = time.perf_counter()
        followers = nullcontext() if self.tp_leader is None else self.tp_leader.launching(
            batch, logits_calls(batch, PROMPT_LOGPROB_ROWS))  # watched until it is read
        with torch.inference_mode(), followers:
            fill_pending(batch, prev, self.tp)
            step = self._launch_step(batch, ahead=True, prev=prev)
        step.on_read = self.tp_leader.landed if self.tp_leader is not None else None
        if step.timed is None:  # no CUDA events: the launch ran the step (CPU)
            self.busy_seconds += time.perf_counter() - t0
        else:  # read when the step is: its events' time
            step.on_timed = self._add_busy
        self._ahead = step
        return step

    @torch.inference_mode()
    def execute(self, out: SchedulerOutput, block_ids_of: Callable[[str], BlockRow]
                ) -> StepResult:
        """Run one step: the sampled token and logprobs of each request that reached the
        end of its known tokens, and the requests whose own sampling settings failed.

        On a GPU the host waits for the device at most twice a step: reading the prompt
        logprobs, if any, and the sampled tokens (with their logprobs); the batch's
        metadata went over in one non-blocking copy."""
        batch = build_batch(out.rows, block_ids_of, self.block_size, self.device,
                            self.staging)
        t0 = time.perf_counter()
        try:
            if self.tp_leader is None:
                return self._launch_step(batch).result()
            # the followers run the same forward and logits calls, within the step timeout
            with self.tp_leader.stepping(batch, logits_calls(batch, PROMPT_LOGPROB_ROWS)):
                return self._launch_step(batch).result()
        finally:  # the model step, as the device's time (common.step_timing)
            self.busy_seconds += time.perf_counter() - t0

    def _launch_step(self, batch: FlatBatch, ahead: bool = False,
                     prev: StepInFlight | None = None) -> StepInFlight:
        """The step's forward, logits and the sampler's device part; `ahead`: its tokens'
        copy to the host queued (CUDA: non-blocking, timed by events), not waited for,
        and pending tokens (inputs, penalties) read from `prev`'s on the device."""
        entries = batch.sampling_entries
        # one row per sampling row (a request with k guesses has k + 1), each with the
        # guesses scored before it; the sampler draws all but the rows verified by
        # rejection sampling (`engine.spec`)
        every = [s.request for s in entries for _ in range(s.num_sampled)]
        guessed = ([s.spec_token_ids[:i] for s in entries for i in range(s.num_sampled)]
                   if any(s.spec_token_ids for s in entries) else None)
        rows = sampler_rows(entries)
        reqs = [every[i] for i in rows]
        timed = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) \
            if ahead and self.device.type == "cuda" else None
        if timed is not None:
            timed[0].record()
        hidden = self._forward(batch)  # (T, h)
        masks = fill_grammar_masks(every, guessed)  # host work while a GPU runs the forward
        prompt_lps = self._prompt_logprobs(batch, hidden)
        if not entries:
            return StepInFlight([], None, None, {}, None, prompt_lps, None, timed=timed)
        assert batch.logits_rows is not None  # build_batch sets it
        logits = self._logits(hidden, batch.logits_rows, batch.logits_indices)  # (N, V)
        failed: dict[str, str] = {}
        staged = None
        if reqs:
            whole = len(rows) == len(every)
            sample = self.sampler.sample_on_device(
                logits if whole else logits[rows], reqs, failed,
                masks if whole or masks is None else masks.select(rows),
                pending_tokens(prev))
            staged = stage(sample, non_blocking=ahead)
        if timed is not None:
            timed[1].record()
        if not ahead:  # read at once: its rows and tokens serve no later step
            return StepInFlight(entries, logits, staged, failed, masks, prompt_lps,
                                self.rejection)
        return StepInFlight([LaunchedRow(s) for s in entries], logits, staged, failed, masks,
                            prompt_lps, self.rejection, sampled_index(reqs), timed)

    def _add_busy(self, seconds: float) -> None:
        self.busy_seconds += seconds

    def _forward(self, batch: FlatBatch) -> torch.Tensor:
        """The last hidden states of every row of the batch, (T, h). A step with LoRA
        adapter rows runs the model's modules (`LoRALinear`), or the fast decode path only
        where that applies the adapters too."""
        if self.lora is None or not self.lora.begin_step(batch):
            return self.platform.forward(self, batch)  # (T, h)
        try:
            return self.platform.forward(self, batch, fast=self.lora.fast_path_ready)
        finally:
            self.lora.end_step()

    def _logits(self, hidden: torch.Tensor, rows: torch.Tensor | slice,
                host_rows: list[int] | slice) -> torch.Tensor:
        """(N, V) logits of hidden[rows] (`host_rows`: the same rows, on the host), the
        head adding the LoRA deltas of the step's adapter rows."""
        picked = hidden.index_select(0, rows) if isinstance(rows, torch.Tensor) else hidden[rows]
        if self.lora is None:
            return self.model.compute_logits(picked)
        with self.lora.logits_rows(host_rows):
            return self.model.compute_logits(picked)

    def _prompt_logprobs(self, batch: FlatBatch, hidden: torch.Tensor
                         ) -> dict[str, list[TokenLogprobs | None]]:
        """The prompt logprobs this step's prompt chunks give, by request id; their logits
        computed PROMPT_LOGPROB_ROWS rows at a time, their tables read back in one copy."""
        spans = batch.prompt_logprob_spans
        if not spans:
            return {}
        assert batch.prompt_targets is not None  # build_batch sets it
        tables, at = [], 0
        for span in spans:
            k = span.request.sampling_params.prompt_logprobs
            assert k is not None  # spans are made only for requests asking for them
            for first in range(0, span.count, PROMPT_LOGPROB_ROWS):
                n = min(PROMPT_LOGPROB_ROWS, span.count - first)
                rows = slice(span.row + first, span.row + first + n)
                logits = self._logits(hidden, rows, rows)  # (n, V)
                targets = batch.prompt_targets[at + first:at + first + n]  # (n,)
                tables.append(prompt_logprob_table(logits, targets, k).reshape(-1))
            at += span.count
        values = torch.cat(tables).tolist()  # the one device -> host copy
        out: dict[str, list[TokenLogprobs | None]] = {}
        at = 0
        for span in spans:
            req = span.request
            k = req.sampling_params.prompt_logprobs
            assert k is not None  # as above
            size = span.count * (2 + 2 * k)
            target_ids = req.prompt_token_ids[span.first_target:span.first_target + span.count]
            lps: list[TokenLogprobs | None] = [None] * span.gap
            lps += read_prompt_logprobs(values[at:at + size], target_ids, k)
            out[req.request_id] = lps
            at += size
        return out

    def close(self) -> None:
        """Stop the tensor-parallel followers, if any."""
        if self.tp_leader is not None:
            self.tp_leader.close()
