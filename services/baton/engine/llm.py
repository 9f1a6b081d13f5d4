"""`LLM`: offline batch generation with vLLM's shape.

    from baton import LLM, SamplingParams
    llm = LLM()                      # the bundled SmolLM2-135M-Instruct, bfloat16, on CPU
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import replace
from typing import cast

from baton.common.sampling_params import SamplingParams, child_params
from baton.engine.config import EngineConfig
from baton.engine.core import EngineCore
from baton.engine.lora.registry import AdapterRegistry
from baton.engine.lora.requests import lora_registry
from baton.engine.outputs import CompletionOutput, EngineOutput, RequestOutput
from baton.engine.tokenizer import apply_chat_template, require_tokenizer

PromptType = str | list[int] | dict


class LLM:
    def __init__(self, model: str | None = None, **engine_args) -> None:
        self.config = EngineConfig.from_args(model=model, **engine_args)
        self.engine = EngineCore(self.config)
        self._counter = 0

    def get_tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: str | Sequence[str | None] | None = None
                 ) -> list[RequestOutput]:
        """Generate for every prompt (a string, a list of token ids, or a dict with
        `prompt` / `prompt_token_ids`); outputs come back in prompt order. All prompts are
        validated before any is queued, so a bad one raises ValueError and runs nothing.
        `lora_request`: the LoRA adapter (its name) every prompt runs with, or one per
        prompt (None: the base model)."""
        single = isinstance(prompts, (str, dict)) or (prompts and isinstance(prompts[0], int))
        # one prompt (a string, a dict, or token ids) is a batch of one
        batch = cast("Sequence[PromptType]", [prompts] if single else prompts)
        params = _broadcast(sampling_params or SamplingParams(), len(batch))
        prio = list(priority) if priority is not None else [0] * len(batch)
        if len(prio) != len(batch):
            raise ValueError(f"priority has {len(prio)} entries for {len(batch)} prompts")
        loras: list[str | None] = (
            [lora_request] * len(batch) if lora_request is None or isinstance(lora_request, str)
            else list(lora_request))
        if len(loras) != len(batch):
            raise ValueError(f"lora_request has {len(loras)} entries for {len(batch)} prompts")
        adapters = [None if name is None else self.lora_registry.get(name) for name in loras]
        return self._run([self._tokenize(p) for p in batch], params, prio, use_tqdm, adapters)

    @property
    def lora_registry(self) -> AdapterRegistry:
        """The adapters this engine serves (`add` / `remove` load and unload them);
        ValueError when it was not started with enable_lora / lora_modules."""
        return lora_registry(self.engine.runner.lora)

    def chat(self, messages: list[dict] | list[list[dict]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation or a list of them."""
        # cast: a dict first item means one conversation, which mypy cannot narrow a list by
        convs = cast("list[list[dict]]",
                     [messages] if messages and isinstance(messages[0], dict) else messages)
        tok = require_tokenizer(self.engine.tokenizer, "chat (its template)")
        prompts = [{"prompt_token_ids": apply_chat_template(tok, c, add_generation_prompt)}
                   for c in convs]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _tokenize(self, prompt: PromptType) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            tok = require_tokenizer(self.engine.tokenizer, "a text prompt")
            return prompt, tok.encode(prompt)
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return prompt.get("prompt"), list(prompt["prompt_token_ids"])
            return self._tokenize(prompt["prompt"])
        return None, list(prompt)

    def _run(self, prompts, params, prio, use_tqdm, adapters) -> list[RequestOutput]:
        engine = self.engine
        results: list[RequestOutput] = []
        pending = []
        for (text, ids), p, pr, lora in zip(prompts, params, prio, adapters):
            out = RequestOutput(str(self._counter), text, ids,
                                [CompletionOutput(i) for i in range(p.n)])
            self._counter += 1
            results.append(out)
            for i, child in enumerate(child_params(p)):
                if i:  # one sample's prompt logprobs serve them all; the rest hit the cache
                    child = replace(child, prompt_logprobs=None)
                pending.append(engine.make_request(f"{out.request_id}-{i}", ids, child, pr,
                                                   lora=lora))
        for req in pending:
            engine.add(req)
        by_id = {f"{r.request_id}-{i}": (r, c) for r in results for i, c in enumerate(r.outputs)}
        bar = _progress(len(pending), use_tqdm)
        try:
            while engine.has_unfinished_requests():
                time.sleep(engine.idle_for())  # a dynamic batch's window (0: none)
                for o in engine.step():
                    self._apply(by_id, o, bar)
        except BaseException:
            engine.abort_requests([r.request_id for r in pending])
            raise
        finally:
            if bar is not None:
                bar.close()
        return results

    @staticmethod
    def _apply(by_id: dict, o: EngineOutput, bar) -> None:
        result, completion = by_id[o.request_id]
        completion.add([o])
        if o.prompt_logprobs is not None:
            result.prompt_logprobs = o.prompt_logprobs
        if o.finished:
            result.num_cached_tokens = max(result.num_cached_tokens, o.num_cached_tokens)
            if bar is not None:
                bar.update(1)


def _broadcast(params, n: int) -> list[SamplingParams]:
    if isinstance(params, SamplingParams):
        return [params] * n
    params = list(params)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params


def _progress(total: int, enabled: bool):
    if not enabled:
        return None
    from tqdm import tqdm

    return tqdm(total=total, desc="generating", unit="req")
