"""Tokenizer and chat template from transformers, and incremental detokenisation with stop
strings."""

from __future__ import annotations

from pathlib import Path
from typing import cast

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


def piece_table(tokenizer) -> list[str | None] | None:
    """Each token's text where it is exact on its own, else None; None for a tokenizer
    without such texts. A byte-level BPE (GPT-2's decoder: Llama 3, Qwen, SmolLM, GPT-OSS)
    decodes a run of tokens by concatenating their bytes, so after a whole character a token
    whose bytes are whole characters adds exactly its own text (`decode([id])`); added and
    special tokens, and tokens holding part of a character, are left to the tokenizer's
    streaming decoder. Built once per tokenizer (one batched decode of the vocabulary, in
    Rust) and kept on it."""
    if tokenizer is None:
        return None
    if hasattr(tokenizer, "_baton_piece_table"):
        return cast("list[str | None] | None", tokenizer._baton_piece_table)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    table = None
    if backend is not None:
        from tokenizers.decoders import ByteLevel

        if isinstance(backend.decoder, ByteLevel):
            size = backend.get_vocab_size(with_added_tokens=True)
            added = backend.get_added_tokens_decoder()
            texts = backend.decode_batch([[i] for i in range(size)],
                                         skip_special_tokens=False)
            table = [None if not text or "\ufffd" in text or i in added else text
                     for i, text in enumerate(texts)]
    try:
        tokenizer._baton_piece_table = table
    except AttributeError:  # a tokenizer that takes no attributes: built again next time
        pass
    return table


class IncrementalDetokenizer:
    """Turns one request's output tokens into text as they arrive.

    A fast tokenizer's own streaming decoder (`DecodeStream`, with a few prompt tokens as
    context so that leading spaces come out right) reads each token, holding back text
    that ends in an incomplete UTF-8 character; a token of a byte-level tokenizer whose
    text is exact on its own (`piece_table`) skips it while the stream is at a character's
    end. Other tokenizers decode a small window twice per token. Stop strings are searched
    in the new text plus the tail of the text already sent (a stop string may straddle two
    tokens); the text is cut exactly before the stop string (or after it with
    include_stop_str_in_output). The text is kept as the deltas sent and the text not sent
    yet, never one growing string (a long output would copy it per token).
    """

    def __init__(self, tokenizer, prompt_ids: list[int], stop: list[str],
                 include_stop: bool, skip_special_tokens: bool) -> None:
        self.tokenizer = tokenizer
        self.skip_special = skip_special_tokens
        context = list(prompt_ids[-CONTEXT_TOKENS:])
        backend = getattr(tokenizer, "backend_tokenizer", None)
        self._stream = None
        self._pieces: list[str | None] = []
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
            self._pieces = piece_table(tokenizer) or []
        self._whole = True  # the text read so far ends at a character's end
        self.ids = context
        self.prefix_offset = max(len(self.ids) - 5, 0)
        self.read_offset = len(self.ids)
        self.stop = stop
        self.include_stop = include_stop
        self.max_stop_len = max((len(s) for s in stop), default=0)
        self._sent: list[str] = []  # the deltas returned
        self._unsent = ""  # text read and not returned yet
        self._sent_tail = ""  # the last max_stop_len - 1 characters returned

    @property
    def text(self) -> str:
        """The output's text so far (after a stop string matched, final)."""
        return "".join(self._sent) + self._unsent

    def add(self, token_id: int) -> tuple[str, str | None]:
        """Append one token. Returns (new text to show, matched stop string or None).
        After a match the text is final."""
        self.ids.append(token_id)
        if self._stream is not None:
            pieces = self._pieces
            piece = pieces[token_id] if self._whole and token_id < len(pieces) else None
            if piece is None:
                try:
                    piece = self._stream.step(self._backend, token_id)
                except Exception:  # noqa: BLE001 - tokenizers raises a bare Exception
                    # "Invalid prefix": a byte-fallback decoder turned bytes it had decoded
                    # into U+FFFD once an invalid byte followed; windows from here on
                    self._stream = None
                    self.prefix_offset = max(self.read_offset - 5, 0)
                    return self._add_windowed()
                self._whole = bool(piece)
            if piece:  # every token so far read: the windows' start if it falls back
                self._unsent += piece
                if len(self.ids) > 64:
                    self.ids = self.ids[-5:]
                self.read_offset = len(self.ids)
            matched = self._find_stop()
            return self._take_delta(withhold=not matched), matched
        return self._add_windowed()

    def _add_windowed(self) -> tuple[str, str | None]:
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if len(full) > len(prefix) and not full.endswith("\ufffd"):
            self._unsent += full[len(prefix):]
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
        """The earliest stop string in the text not sent (or straddling its start); the
        text cut there."""
        if not self.stop:
            return None
        hay = self._sent_tail + self._unsent
        best = None
        for s in self.stop:
            idx = hay.find(s)
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        if best is None:
            return None
        idx, s = best
        cut = idx + len(s) if self.include_stop else idx
        self._unsent = hay[len(self._sent_tail):cut]
        return s

    def _take_delta(self, withhold: bool) -> str:
        # While stop strings are live, hold back a tail that could be the start of one, so
        # a streamed client never sees text that is later cut.
        unsent = self._unsent
        keep = self.max_stop_len - 1 if withhold and self.max_stop_len else 0
        if len(unsent) <= keep:
            return ""
        delta, self._unsent = (unsent[:len(unsent) - keep], unsent[len(unsent) - keep:]) \
            if keep else (unsent, "")
        self._sent.append(delta)
        if self.max_stop_len > 1:
            self._sent_tail = (self._sent_tail + delta)[1 - self.max_stop_len:]
        return delta
