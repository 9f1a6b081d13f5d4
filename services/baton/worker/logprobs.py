"""Logprobs in OpenAI's two shapes, from the sampler's `TokenLogprobs`.

Token texts are each token decoded on its own (what OpenAI's `token` fields hold), cached
per worker: the same few thousand tokens come back in every response. A prompt's logprobs
(completions' `echo` with `logprobs`) come first in the completion's, as vLLM's: the first
prompt token has none (`null` logprob and top logprobs), and text offsets count from the
start of the prompt.
"""

from __future__ import annotations

from baton.engine.sampler import TokenLogprobs

MIN_LOGPROB = -9999.0  # what -inf is shown as (JSON has no infinity)


class TokenTexts:
    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self._text: dict[int, str] = {}

    def text(self, token_id: int) -> str:
        text = self._text.get(token_id)
        if text is None:  # without a tokenizer, vLLM's "token_id:N" form
            text = (self.tokenizer.decode([token_id]) if self.tokenizer is not None
                    else f"token_id:{token_id}")
            self._text[token_id] = text
        return text

    def chat_logprobs(self, lps: list[TokenLogprobs]) -> dict:
        """Chat's `logprobs`: one entry per token, with its top alternatives."""
        def entry(tid: int, lp: float) -> dict:
            s = self.text(tid)
            return {"token": s, "logprob": max(lp, MIN_LOGPROB), "bytes": list(s.encode())}
        return {"content": [entry(lp.token_id, lp.logprob) | {
            "top_logprobs": [entry(t, v) for t, v in lp.top]} for lp in lps], "refusal": None}

    def completion_logprobs(self, lps: list[TokenLogprobs], offset: int) -> dict:
        """Completions' `logprobs`; `offset` is the text offset of the first token."""
        tokens, values, tops, offsets = [], [], [], []
        for lp in lps:
            s = self.text(lp.token_id)
            tokens.append(s)
            values.append(max(lp.logprob, MIN_LOGPROB))
            tops.append({self.text(t): max(v, MIN_LOGPROB) for t, v in lp.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}

    def prompt_logprobs(self, prompt_ids: list[int], lps: list[TokenLogprobs | None]) -> dict:
        """Completions' `logprobs` of a prompt: one entry per prompt token (`lps`: the
        engine's, None where a token has none — the first)."""
        tokens, values, tops, offsets = [], [], [], []
        offset = 0
        lps = list(lps) + [None] * (len(prompt_ids) - len(lps))
        for tid, lp in zip(prompt_ids, lps):
            s = self.text(tid)
            tokens.append(s)
            values.append(None if lp is None else max(lp.logprob, MIN_LOGPROB))
            tops.append(None if lp is None else {
                self.text(t): max(v, MIN_LOGPROB) for t, v in lp.top})
            offsets.append(offset)
            offset += len(s)
        return {"tokens": tokens, "token_logprobs": values, "top_logprobs": tops,
                "text_offset": offsets}


def joined(first: dict, then: dict) -> dict:
    """Two completions' `logprobs` objects as one (the prompt's, then the output's)."""
    return {key: first[key] + then[key] for key in first}
