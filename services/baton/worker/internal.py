"""Internal endpoints of the prefill and decode roles (DESIGN.md §2). Routers call them;
they are not part of the OpenAI surface and the router does not expose them.

    POST /internal/prefill   {"api": "chat"|"completions", "request": <OpenAI body>}
      -> {"prompt_token_ids": [...], "kv_transfer_params": {...}}
    POST /internal/generate  {"api": ..., "request": <OpenAI body>, "prompt_token_ids": [...],
                              "kv_transfer_params": {...} | null, "return_token_ids": bool,
                              "resume": {"prompt_tokens", "completion_tokens",
                                         "text_offset", "created"} | null}
      -> the OpenAI answer (streamed or whole); without kv_transfer_params the decode pod
         prefills locally. `return_token_ids` adds `token_ids` to every streamed choice and
         `prompt_token_ids` to the first event; `resume` continues a stream another decode
         pod started (its prompt is the original prompt + the tokens already sent).

A prefill samples the first token with the request's own sampling settings (greedy stays
greedy, a seed is used) but never stops on it: stop conditions are the decode pod's, which
applies them to the first token too.
"""

from __future__ import annotations

import json
import time
from dataclasses import replace

from fastapi import FastAPI, Request

from baton.common.errors import OpenAIError
from baton.common.protocol import ChatCompletionRequest, CompletionRequest, parse_request
from baton.worker.openai_api import Internal
from baton.worker.serving import engine_error, new_id

MODELS = {"chat": ChatCompletionRequest, "completions": CompletionRequest}


def _parse(body: bytes) -> tuple[str, object, dict]:
    try:
        msg = json.loads(body)
        api = msg["api"]
        model = MODELS[api]
    except (ValueError, KeyError, TypeError):
        raise OpenAIError(400, "an internal request needs {'api': 'chat'|'completions', "
                               "'request': {...}}") from None
    return api, parse_request(model, json.dumps(msg.get("request")).encode()), msg


def _internal(msg: dict, ids: list[int] | None) -> Internal:
    resume = msg.get("resume")
    if resume is None:
        return Internal(return_token_ids=msg.get("return_token_ids") is True)
    try:
        prompt_tokens = int(resume["prompt_tokens"])
        sent = int(resume.get("completion_tokens", 0))
        internal = Internal(True, prompt_tokens, sent, int(resume.get("text_offset", 0)),
                            int(resume["created"]) if resume.get("created") else None)
    except (KeyError, TypeError, ValueError):
        raise OpenAIError(400, "resume needs integer prompt_tokens, completion_tokens, "
                               "text_offset and created") from None
    if ids is None or not 0 < prompt_tokens <= len(ids) or prompt_tokens + sent != len(ids):
        raise OpenAIError(400, "a resumed request gives prompt_token_ids = the original "
                               "prompt + the tokens already sent")
    return internal


def install_internal_routes(app: FastAPI, state) -> None:
    from baton.worker.app import prompts_of, serve_openai

    role = state.settings.role

    if role == "prefill":
        @app.post("/internal/prefill")
        async def internal_prefill(request: Request):
            serving = state.require_serving()
            api, req, _ = _parse(await request.body())
            serving.check_model(req.model)
            prompts = prompts_of(serving, api, req)
            if len(prompts) != 1:
                raise OpenAIError(400, "remote prefill takes one prompt per request")
            params = replace(req.to_sampling_params(), n=1, max_tokens=1, min_tokens=0,
                             stop=[], stop_token_ids=[], ignore_eos=True, logprobs=None)
            rid = request.headers.get("x-request-id") or new_id("prefill")
            jobs = serving.make_jobs(rid, prompts, params, "prompt", {"hold_kv": True})
            serving.admit(jobs)
            t0 = time.monotonic()
            kv_params = None
            try:
                async for d in serving.run(jobs):
                    if d.kv_transfer_params is not None:
                        kv_params = d.kv_transfer_params
            except Exception as err:  # noqa: BLE001 - engine death: a clean 5xx
                raise engine_error(err) from None
            finally:
                serving.abort(jobs)
            if kv_params is None:
                raise OpenAIError(500, "the prefill ended without KV to hand over",
                                  code="prefill_failed")
            return {"prompt_token_ids": prompts[0], "kv_transfer_params": kv_params,
                    "prefill_s": time.monotonic() - t0}

    if role == "decode":
        @app.post("/internal/generate")
        async def internal_generate(request: Request):
            api, req, msg = _parse(await request.body())
            ids = msg.get("prompt_token_ids")
            kv = msg.get("kv_transfer_params")
            prompts = None
            if ids is not None:
                if not (isinstance(ids, list) and all(isinstance(t, int) for t in ids)):
                    raise OpenAIError(400, "prompt_token_ids must be a list of ints")
                prompts = [ids]
            internal = _internal(msg, ids)
            engine_kv = {"kv_transfer_params": kv} if kv else {}
            if internal.resumed:  # a seeded sampler goes on from where the stream broke
                engine_kv["presampled"] = internal.resumed_completion_tokens
            return await serve_openai(request, state, api, req, prompts, engine_kv or None,
                                      internal)
