"""Where a request's end is decided from its sampled token, before the scheduler applies it.

The scheduler checks what it knows (EOS, stop token ids, max_tokens, the context window:
`Scheduler.stop_status`); the engine adds what needs the token's text or the grammar: a stop
string, a structured output now complete, or the request's own sampling or detokenising
failing. Both reach the scheduler in one call (`update_from_output(..., ends)`), so a request
ends once, with its final status, before the KV connector sees it: a prefill whose last token
fails gets no lease."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from baton.engine.request import Request, RequestStatus
from baton.engine.scheduler.output import EngineEnd, ScheduledRequest
from baton.engine.structured.manager import grammar_complete

Detokenize = Callable[[Request, int], tuple[str, str | None]]  # (text, stop string matched)


def token_ends(scheduled: Sequence[ScheduledRequest], sampled: dict[str, list[int]],
               failed: dict[str, str], detokenize: Detokenize
               ) -> tuple[dict[str, str], dict[str, EngineEnd]]:
    """The text of each request's sampled tokens (request id -> text), and the ends the
    engine decides: request id -> `EngineEnd` (`at`: the token it ends at, when a request
    gained several). `failed`: rows whose sampling settings failed (their error)."""
    texts: dict[str, str] = {}
    ends: dict[str, EngineEnd] = {}
    for s in scheduled:
        req, rid = s.request, s.request.request_id
        if rid in failed:  # with a token or without one
            ends[rid] = EngineEnd(RequestStatus.FINISHED_ERROR, failed[rid])
            continue
        parts = []
        tokens = sampled.get(rid, [])
        for i, token in enumerate(tokens):
            try:
                text, matched = detokenize(req, token)
            except Exception as err:  # noqa: BLE001 - its stop strings or its detokenising
                ends[rid] = EngineEnd(RequestStatus.FINISHED_ERROR,
                                      f"{type(err).__name__}: {err}", at=i)
                break
            parts.append(text)
            if (end := text_end(req, matched, last=i == len(tokens) - 1)) is not None:
                ends[rid] = EngineEnd(end.status, end.reason, at=i)
                break
        if rid in sampled:
            texts[rid] = "".join(parts)
    return texts, ends


def text_end(req: Request, matched: str | None, last: bool = True) -> EngineEnd | None:
    """A token whose text matched a stop string, or that completed the request's structured
    output, ends it ("stop"; `matched` is its stop reason). The grammar has taken the
    step's whole run (`advance_grammars`, which cuts a run where its output completes):
    only the run's `last` token can have completed it."""
    if matched is not None or (last and grammar_complete(req)):
        return EngineEnd(RequestStatus.FINISHED_STOPPED, matched)
    return None
