"""Tokenizer and chat template from transformers, and incremental detokenisation with stop
strings."""

from __future__ import annotations

from pathlib import Path

# Files one of which a checkpoint's tokenizer is read from (fast JSON, SentencePiece, BPE).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "tokenizer_config.json")


def load_tokenizer(model_dir: Path, skip: bool = False):
    """The checkpoint's tokenizer; None with `skip` (`skip_tokenizer_init`). A directory
    holding none of TOKENIZER_FILES raises FileNotFoundError suggesting the flag."""
    if skip:
        return None
    if not any((model_dir / name).exists() for name in TOKENIZER_FILES):
        raise FileNotFoundError(
            f"{model_dir} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}): save "
            "one beside the weights, or start with skip_tokenizer_init=True "
            "(--skip-tokenizer-init) to serve token-id prompts only")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir))


NO_TOKENIZER_STOP = ("stop strings are matched in the output text, and this engine has no "
                     "tokenizer (skip_tokenizer_init): use stop_token_ids")


def eos_token_id(tokenizer, config_eos_ids: tuple[int, ...]) -> int | None:
    """The tokenizer's end-of-sequence id; without a tokenizer, config.json's first."""
    if tokenizer is not None:
        return tokenizer.eos_token_id
    return config_eos_ids[0] if config_eos_ids else None


def require_tokenizer(tokenizer, what: str):
    """`tokenizer`, or a ValueError saying `what` needs the tokenizer this engine was
    started without (`skip_tokenizer_init`)."""
    if tokenizer is None:
        raise ValueError(f"{what} needs a tokenizer, and this engine was started with "
                         "skip_tokenizer_init=True (--skip-tokenizer-init): send prompts "
                         "as token ids")
    return tokenizer


def apply_chat_template(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                        tools: list[dict] | None = None, **kwargs) -> list[int]:
    """The conversation's token ids. `messages` as OpenAI's, with each call's `arguments`
    a dict and the `name` / `tool_calls` / `tool_call_id` fields a template reads;
    `tools` OpenAI-shaped function tools (None: the template renders none)."""
    text = render_conversation(tokenizer, messages, add_generation_prompt, tools, **kwargs)
    return encode_rendered(tokenizer, text)


def render_conversation(tokenizer, messages: list[dict], add_generation_prompt: bool = True,
                         tools: list[dict] | None = None, **kwargs) -> str:
    """The conversation as the prompt's text (what `apply_chat_template` tokenises)."""
    if not tokenizer.chat_template:
        raise ValueError("this model's tokenizer has no chat template; use completions")
    return tokenizer.apply_chat_template(messages, tools=tools,
                                         add_generation_prompt=add_generation_prompt,
                                         tokenize=False, **kwargs)


def encode_rendered(tokenizer, text: str) -> list[int]:
    """A rendered chat prompt's ids: the template wrote its special tokens itself, so none
    is added (as transformers' `apply_chat_template(tokenize=True)`)."""
    return list(tokenizer.encode(text, add_special_tokens=False))


# Prompt tokens decoded before a request's output: the context its first token's text (a
# leading space, a byte-level piece) needs.
CONTEXT_TOKENS = 6


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    Decodes a small window (a few prompt tokens of context, then the unread tail) so that
    byte-level BPE pieces and leading spaces come out right, holding back text that ends in
    an incomplete UTF-8 character. Stop strings are searched in the new text (plus the tail
    of the old text, since a stop string may straddle two tokens); the text is cut exactly
    before the stop string (or after it with include_stop_str_in_output).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        # a fast tokenizer's own streaming decoder (one call per token, in Rust, with a few
        # prompt tokens as context); else two decodes of a window per token (below)
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        if backend is not None:
            from tokenizers.decoders import DecodeStream

            self._backend = backend
            if backend.decode(context, skip_special_tokens=skip_special_tokens).endswith(
                    "\ufffd"):
                # a prompt ending in an incomplete character (or U+FFFD itself): DecodeStream
                # would take the whole context as text not yet read, and give it back as
                # the first token's
                context = []
            self._stream = DecodeStream(ids=list(context),
                                        skip_special_tokens=skip_special_tokens)
        self.ids = context
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self.text = ""
        self._emitted = 0  # chars of self.text already returned as deltas

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token. Returns (new text to show, matched stop string or None).
        After a match the text is final."""
        self.ids.append(token_id)
        if self._stream is not None:
            try:
                piece = self._stream.step(self._backend, token_id)
            except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                # "Invalid prefix": a byte-fallback decoder turned bytes it had decoded
                # into U+FFFD once an invalid byte followed; windows from here on
                self._stream = None
                self.prefix_offset = max(self.read_offset - 5, 0)
            else:
                if piece:  # every token so far read: the windows' start if it falls back
                    self.text += piece
                    if len(self.ids) > 64:
                        self.ids = self.ids[-5:]
                    self.read_offset = len(self.ids)
                matched = self._find_stop()
                return self._take_delta(withhold=not matched), matched
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self.text += full[len(prefix):]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)
        matched = self._find_stop()
        return self._take_delta(withhold=not matched), matched

    def flush(self) -> str:
        """Whatever text is still held back (at the end of the request)."""
        return self._take_delta(withhold=False)

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special,
                                     clean_up_tokenization_spaces=False)

    def _find_stop(self) -> str | None:
        if not self.stop:
            return None
        start = max(self._emitted - self.max_stop_len + 1, 0)
        best = None
        for s in self.stop:
            idx = self.text.find(s, start)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        self.text = self.text[: idx + len(s) if self.include_stop else idx]
        return s

    def _take_delta(self, withhold: bool) -> str:
        # While stop strings are live, hold back a tail that could be the start of one, so
        # a streamed client never sees text that is later cut.
        end = len(self.text)
        if withhold and self.max_stop_len:
            end = max(self._emitted, end - self.max_stop_len + 1)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta
