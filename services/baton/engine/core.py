"""EngineCore: the synchronous engine (scheduler + KV manager + model runner + detokenisers).

Single-threaded: `add_request`, `abort_requests` and `step` must be called from one thread
(the LLM's caller, or the async front's engine thread).
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import replace

import torch

from baton.common.sampling_params import SamplingParams
from baton.common.stats import EngineStats
from baton.common.step_timing import StepTiming
from baton.engine import tokenizer as tok
from baton.engine.config import Device, EngineConfig, LiveSettings
from baton.engine.context_window import fit_kv_pool, model_context_limit
from baton.engine.errors import EngineStepError
from baton.engine.kv_cache import KVCacheManager
from baton.engine.kv_connector.factory import make_connector
from baton.engine.kv_connector.handoff import KVHandoff
from baton.engine.logprobs import arrived_logprobs
from baton.engine.lora.requests import LoRAAdapter
from baton.engine.models.loader import resolve_model_dir
from baton.engine.outputs import EngineOutput
from baton.engine.request import Request, RequestStatus
from baton.engine.request_factory import EngineFacts, KVShape, RequestFactory
from baton.engine.runner import ModelRunner
from baton.engine.runner.step_result import StepResult
from baton.engine.scheduler import SchedulerLimits, make_scheduler
from baton.engine.scheduler.output import EngineEnd, ScheduledRequest
from baton.engine.sim.runner import SimRunner
from baton.engine.spec.decider import Speculator
from baton.engine.spec.draft import load_draft
from baton.engine.step_counters import StepCounters
from baton.engine.step_pipeline import Launched, async_scheduling, check_live, fill_inputs, launched
from baton.engine.stops import text_end, token_ends
from baton.engine.structured.base import CompiledGrammar
from baton.engine.structured.manager import StructuredOutputs, rebuild
from baton.engine.structured.masks import advance_grammars

log = logging.getLogger(__name__)


# Consecutive failed steps before a step's error is the engine's, not its requests'.
MAX_FAILED_STEPS = 3


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        torch.set_num_threads(config.compute.num_threads or os.cpu_count() or 1)
        checkpoint = config.checkpoint
        self.model_dir = resolve_model_dir(checkpoint.model, checkpoint.cache_dir,
                                           checkpoint.revision)
        self.tokenizer = tok.load_tokenizer(self.model_dir, checkpoint.skip_tokenizer_init)
        self.runner = (SimRunner(config, self.model_dir) if config.compute.device == Device.SIM
                       else ModelRunner(config, self.model_dir,
                                        model_context_limit(config, self.model_dir)))
        self.max_model_len = max_len = fit_kv_pool(self.runner.max_model_len, config,
                                                   self.runner.num_blocks)
        self.model_config = self.runner.model_config
        window = self.model_config.sliding_window if self.model_config.all_sliding else None
        self.kv = KVCacheManager(self.runner.num_blocks, config.cache.block_size,
                                 config.cache.enable_prefix_caching, sliding_window=window)
        self.connector = make_connector(config, self.runner, self.kv, self.model_dir)
        limits = config.scheduler
        self.scheduler = make_scheduler(SchedulerLimits(
            limits.max_num_batched_tokens, limits.max_num_seqs, max_len, limits.policy,
            config.lora.max_loras if config.lora.enabled else None,
            limits.batch_window_ms / 1000),
            self.kv, self.connector)
        self.eos_token_id = tok.eos_token_id(self.tokenizer, self.model_config.eos_token_ids)
        self.structured = StructuredOutputs.for_tokenizer(
            self.tokenizer, self.model_config.vocab_size, self.eos_token_id)
        self.requests = RequestFactory(EngineFacts(
            str(self.model_dir), self.model_config.vocab_size, max_len, self.eos_token_id,
            KVShape(self.kv.block_size, self.kv.num_blocks), self.connector is not None),
            self.tokenizer, self.structured, self.runner.lora)
        self._detok: dict[str, tok.IncrementalDetokenizer | None] = {}
        tok.piece_table(self.tokenizer)  # built now, not on the first request's step
        self.speculator = Speculator(limits.speculative, max_len, draft=(
            load_draft(config, self.model_config.vocab_size, max_len)
            if limits.speculative.method == "draft_model" else None))
        self.stats = StepCounters()
        self.timing = StepTiming()
        self._failed_steps = 0  # in a row
        self.async_scheduling = async_scheduling(config, self.runner)  # `step_pipeline`
        self._launched: Launched | None = None  # the step in flight (async scheduling)
        self._step_t0, self._timed_busy = 0.0, self.runner.busy_seconds  # step()'s start; timed

    # -- requests --------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt_token_ids: list[int],
                     params: SamplingParams, priority: int = 0, detokenize: bool = True,
                     arrival_time: float | None = None, *, kv: KVHandoff | None = None,
                     presampled: int = 0, grammar: CompiledGrammar | None = None,
                     lora: LoRAAdapter | None = None) -> Request:
        """Validate and build a request without touching engine state (thread-safe);
        `lora`: its adapter (`AdapterRegistry.get`, off this thread), None: the base model.
        `kv`: `HoldKV` (prefill role) or `PullKV` (decode role), see `engine.kv_connector`;
        a pulled request's first output is the token the prefill sampled. `presampled`:
        draws a seeded sampler already made for this request elsewhere (tokens a resumed
        stream had sent), which ours skips to continue its sequence, and a structured
        output's grammar is advanced over (in `add`; a spec that does not compile raises).
        `grammar`: `params.structured` compiled already (`structured.compile`, off this
        thread: the worker's `AsyncEngine.compile_grammar`); else it is compiled here."""
        return self.requests.make_request(
            request_id, prompt_token_ids, params, priority, detokenize, arrival_time, kv=kv,
            presampled=presampled, grammar=grammar, lora=lora)

    def add(self, req: Request) -> list[EngineOutput]:
        """Queue a request; returns the outputs of tokens it arrived with (sampled elsewhere:
        a remote prefill's first token), which may already end it."""
        self.scheduler.add_request(req)
        p = req.sampling_params
        self._detok[req.request_id] = tok.IncrementalDetokenizer(
            self.tokenizer, req.prompt_token_ids, p.stop, p.include_stop_str_in_output,
            p.skip_special_tokens) if req.detokenize and self.tokenizer is not None else None
        error = rebuild(req)
        if error is not None:
            return self._fail([req], {req.request_id: error})
        outputs: list[EngineOutput] = []
        for token in list(req.output_token_ids):
            status = self.scheduler.stop_status(req, token)
            text, matched = self._detok_add(req, token)
            if status is None and (end := text_end(req, matched)) is not None:
                status, req.stop_reason = end.status, end.reason
            lp = arrived_logprobs(req)
            if status is not None:
                self.scheduler.finish_requests([req.request_id], status)
                return outputs + [self._final_output(req, [token], text,
                                                     [lp] if lp is not None else None)]
            outputs.append(self._token_output(req, [token], [lp] if lp is not None else None,
                                              text, False))
        return outputs

    def _detok_add(self, req: Request, token: int):
        detok = self._detok.get(req.request_id)
        return detok.add(token) if detok is not None else ("", None)

    def add_request(self, request_id: str, prompt_token_ids: list[int],
                    params: SamplingParams, priority: int = 0) -> Request:
        req = self.make_request(request_id, prompt_token_ids, params, priority)
        self.add(req)
        return req

    def abort_requests(self, request_ids) -> list[EngineOutput]:
        ended = self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)
        outputs = [self._final_output(req, [], "", None) for req in ended]
        launched = self._launched
        if launched is not None and not self.scheduler.has_unfinished_requests():
            self._launched = None  # its requests are gone: read it, keep none in flight
            outputs += self._read(launched)
        return outputs

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # -- the step --------------------------------------------------------------------------
    def idle_for(self) -> float:
        """Seconds the caller may sleep: the next step would be empty although requests
        wait (`Scheduler.idle_for`)."""
        return self.scheduler.idle_for()

    @property
    def needs_polling(self) -> bool:
        """True while work advances without model steps (KV loads, leases)."""
        return self.scheduler.needs_polling

    def step(self) -> list[EngineOutput]:
        """Schedule, run and update one step. A request whose own sampling or stop logic
        raises ends alone with finish reason "error"; a step that fails as a whole ends the
        requests it ran the same way, and after MAX_FAILED_STEPS such steps in a row raises
        EngineStepError. A step that ran is timed (`timing`)."""
        self._step_t0 = t0 = time.perf_counter()
        idle, steps = self.runner.idle_seconds, self.stats.steps_total
        outputs = self._step()
        if self.stats.steps_total != steps:  # device: its time since the last step timed
            device, idle_now = self.runner.busy_seconds - self._timed_busy, self.runner.idle_seconds
            self._timed_busy += device  # (a call that only read a step adds to the next)
            if self.async_scheduling and idle is not None and idle_now is not None:
                self.timing.record(device + idle_now - idle, device)  # host: what the device waited
            else:
                self.timing.record(time.perf_counter() - t0, device)
        return outputs

    def _step(self) -> list[EngineOutput]:
        if self.async_scheduling:
            return self._step_ahead()
        self.speculator.propose(self.scheduler.running)
        sched = self.scheduler.schedule()
        outputs = [self._final_output(r, [], "", None) for r in self.scheduler.drain_ended()]
        if sched.is_empty:
            return outputs
        self.stats.count(sched)
        try:
            result = self.runner.execute(sched, self.kv.block_row)
        except Exception as err:  # noqa: BLE001 - whose fault it is decides what ends
            return outputs + self._step_failed(sched, err)
        self._failed_steps = 0
        sampled = self.scheduler.cut_at_stops(result.sampled)
        scheduled = sched.scheduled
        advance_grammars([s.request for s in scheduled], sampled, result.failed)
        texts, ends = token_ends(scheduled, sampled, result.failed, self._detok_add)
        finished = self.scheduler.update_from_output(sched, sampled, ends)
        return outputs + self._outputs(scheduled, result, sampled, texts, ends, finished)

    def _step_ahead(self) -> list[EngineOutput]:
        """Async scheduling (`step_pipeline`): schedule and launch the next step, then read
        the one in flight while the next runs."""
        prev, self._launched = self._launched, None  # never a `sync` one: read at launch
        sched = self.scheduler.schedule()
        outputs = [self._final_output(r, [], "", None) for r in self.scheduler.drain_ended()]
        if sched.is_empty:
            return outputs + (self._read(prev) if prev is not None else [])
        self.stats.count(sched)
        if prev is not None and not self.runner.launches_async:
            fill_inputs(prev)
        try:
            # the device's wait counts from its last step's end if one was in flight when
            # this call began (the host owed it the next), else from the call's start
            handle = self.runner.launch(sched, self.kv.block_row,
                                        since=0.0 if prev is not None else self._step_t0)
        except Exception as err:  # noqa: BLE001 - as in a synchronous step
            return (outputs + (self._read(prev) if prev is not None else [])
                    + self._step_failed(sched, err))
        step = launched(sched, handle)
        if prev is not None:
            outputs += self._read(prev)
        if step.sync or not self.scheduler.has_unfinished_requests():  # nothing to overlap:
            return outputs + self._read(step)  # an idle engine keeps no step in flight
        self._launched = step
        return outputs

    def _read(self, launched: Launched) -> list[EngineOutput]:
        """A launched step's results, applied: its pending tokens filled in, the requests
        it ends ended (those ended since it launched are left alone)."""
        sched = launched.sched
        try:
            result = launched.handle.result()
        except Exception as err:  # noqa: BLE001 - as in a synchronous step
            return self._step_failed(sched, err)
        self._failed_steps = 0
        live = [s for s in sched.scheduled if not s.request.is_finished]
        sampled = result.sampled
        advance_grammars([s.request for s in live], sampled, result.failed)
        texts, ends = token_ends(live, sampled, result.failed, self._detok_add)
        finished = self.scheduler.resolve_pending(launched.sampling, sampled, ends)
        return self._outputs(live, result, sampled, texts, ends, finished)

    def _outputs(self, scheduled: list[ScheduledRequest], result: StepResult,
                 sampled: dict[str, list[int]], texts: dict[str, str],
                 ends: dict[str, EngineEnd], finished: list[Request]) -> list[EngineOutput]:
        """The outputs of a step's requests once the scheduler has applied its results."""
        ended = {r.request_id for r in finished}
        self.stats.preemptions_total = self.scheduler.num_preemptions
        outputs = []
        for s in scheduled:
            req = s.request
            rid = req.request_id
            if rid in result.guessed:
                self.speculator.record(req, *result.guessed[rid])
            req.add_prompt_logprobs(result.prompt_logprobs.get(rid))
            if req.status == RequestStatus.FINISHED_ERROR:  # ended this step; no token sent
                outputs.append(self._final_output(req, [], "", None))
                continue
            tokens = sampled.get(rid)
            if not tokens:
                continue
            end = ends.get(rid)
            if end is not None and end.at is not None:
                tokens = tokens[:end.at + 1]
            self.stats.generation_tokens_total += len(tokens)
            lps = result.logprobs.get(rid)
            outputs.append(self._token_output(req, tokens, lps[:len(tokens)] if lps else None,
                                              texts[rid], rid in ended))
        return outputs

    def _step_failed(self, sched, err: Exception) -> list[EngineOutput]:
        """A step raised before sampling: its requests end with the error, unless steps
        keep failing, or under tensor parallelism (ranks left out of step), then the engine
        is at fault: EngineStepError."""
        self._failed_steps += 1
        if self._failed_steps >= MAX_FAILED_STEPS or self.runner.tp.size > 1:
            raise EngineStepError(f"{self._failed_steps} steps in a row failed; the last: "
                                  f"{err!r}") from err
        log.exception("a step of %d requests failed; ending them", len(sched.scheduled))
        reqs = [s.request for s in sched.scheduled if not s.request.is_finished]
        return self._fail(reqs, {r.request_id: f"{type(err).__name__}: {err}" for r in reqs})

    def _fail(self, reqs: list[Request], errors: dict[str, str]) -> list[EngineOutput]:
        """End `reqs` (running, their step failed) with finish reason "error", their error as
        the stop reason."""
        outputs = []
        for req in reqs:
            req.stop_reason = errors[req.request_id]
            self.scheduler.finish_requests([req.request_id], RequestStatus.FINISHED_ERROR)
            outputs.append(self._final_output(req, [], "", None))
        return outputs

    def _token_output(self, req: Request, tokens: list[int], lps, text: str,
                      finished: bool) -> EngineOutput:
        if finished:
            return self._final_output(req, tokens, text, lps)
        out = EngineOutput(req.request_id, tokens, text, lps,
                           prompt_logprobs=req.take_prompt_logprobs())
        if req.num_output_tokens - req.num_pending == len(tokens):  # the first tokens: how
            # they were reached
            out.queue_time, out.kv_transfer_time = self._queued(req), req.kv_transfer_time
        return out

    @staticmethod
    def _queued(req: Request) -> float | None:
        t = req.first_scheduled_time
        return None if t is None else t - req.arrival_time

    def _final_output(self, req: Request, tokens: list[int], text: str, lps) -> EngineOutput:
        if (detok := self._detok.pop(req.request_id, None)) is not None:
            text += detok.flush()
        self.runner.sampler.release(req.request_id)
        self.runner.rejection.release(req.request_id)
        self.speculator.finish(req)
        queued = self._queued(req)
        return EngineOutput(req.request_id, tokens, text, lps,
                            finish_reason=req.status.finish_reason, stop_reason=req.stop_reason,
                            num_prompt_tokens=req.num_prompt_tokens,
                            num_cached_tokens=req.num_cached_tokens, queue_time=queued,
                            kv_transfer_time=req.kv_transfer_time,
                            kv_transfer_params=req.kv_transfer_params,
                            prompt_logprobs=req.take_prompt_logprobs() if tokens else None)

    # -- introspection ---------------------------------------------------------------------
    @property
    def num_running(self) -> int:
        return self.scheduler.num_running

    @property
    def num_waiting(self) -> int:
        return self.scheduler.num_waiting

    def metrics_snapshot(self) -> EngineStats:
        """Counters and gauges for /metrics and the load report; plain reads, safe from
        another thread."""
        return EngineStats(
            running=self.scheduler.num_running, waiting=self.scheduler.num_waiting,
            kv_blocks_used=self.kv.num_used_blocks, kv_blocks_total=self.kv.num_blocks,
            prompt_tokens_total=self.stats.prompt_tokens_total,
            generation_tokens_total=self.stats.generation_tokens_total,
            prefix_cache_hit_tokens_total=self.scheduler.prefix_hit_tokens,
            preemptions_total=self.stats.preemptions_total,
            kv_transfer=self.connector.kv_stats() if self.connector is not None else None,
            spec=self.speculator.stats(), timing=self.timing.snapshot(),
            kv_tier=self.connector.tier_stats() if self.connector is not None else None)

    def take_kv_transfer_durations(self) -> list[float]:
        """Seconds each KV load took since the last call (thread-safe)."""
        return self.connector.take_transfer_durations() if self.connector is not None else []

    # -- live tuning (engine thread) -------------------------------------------------------
    def reconfigure(self, live: LiveSettings) -> None:
        """Apply live-tuned knobs between steps (call on the engine thread). The scheduler's
        limits may not exceed the ones the engine started with (buffers are sized then)."""
        self.config.check_live(live)
        check_live(self.async_scheduling, live)
        self.scheduler.limits = replace(
            self.scheduler.limits, max_num_seqs=live.scheduler.max_num_seqs,
            max_num_batched_tokens=live.scheduler.max_num_batched_tokens)
        self.speculator.reconfigure(live.scheduler.speculative)
        if self.connector is not None:
            self.connector.reconfigure(live.kv)

    def check_integrity(self) -> None:
        self.kv.check_integrity()

    def close(self) -> None:
        if self.connector is not None:
            self.connector.close()
        self.runner.close()
