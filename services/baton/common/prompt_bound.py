"""A prompt too long for the context window, known from its length before it is tokenised
(no torch): a 20 MB prompt is refused at once instead of growing the process by gigabytes
for seconds only to be refused afterwards (issue 38).

The rule is sound, not a guess. Every token of a prompt stands for a piece of the text the
tokenizer's normalizer gives it, at most `L` characters long, `L` being the longest string
in its vocabulary as the vocabulary spells it (a byte-level vocabulary spells a byte as a
character, so a byte-level token covers at most `L` bytes, hence at most `L` characters;
a byte-fallback token `<0x41>` spells 1 byte in 6 characters, which only loosens the
bound). So a prompt of `c` characters after normalization has at least `c / L` tokens, and
one of more than `max_model_len * L` characters cannot fit. Normalizers that only add or
keep characters (none, `Prepend`, `Replace` by something as long, NFD / NFKD, `Lowercase`)
leave `c` at least the prompt's length; NFC / NFKC compose at most 4 code points into one
(the longest canonical decomposition), so the prompt's length is divided by 4 first. A
tokenizer whose normalizer or pre-tokenizer may drop text (whitespace splitting, `Strip`,
a `Precompiled` map, a regex `Replace`) has no bound: its prompts are only tokenised.
"""

from __future__ import annotations

import json

COMPOSING_SLACK = 4  # NFC / NFKC: at most this many code points become one
_KEEPING_NORMALIZERS = frozenset({"Prepend", "Lowercase", "NFD", "NFKD"})
_COMPOSING_NORMALIZERS = frozenset({"NFC", "NFKC"})
_KEEPING_PRE_TOKENIZERS = frozenset({"ByteLevel", "Metaspace", "Split", "Digits",
                                     "Punctuation", "UnicodeScripts"})


def max_prompt_chars(tokenizer_json: str, max_model_len: int) -> int | None:
    """The most characters a prompt of at most `max_model_len` tokens can have under the
    tokenizer `tokenizer_json` (a `tokenizers` JSON); None when its tokenizer may drop text
    (no sound bound)."""
    spec = json.loads(tokenizer_json)
    slack = _normalizer_slack(spec.get("normalizer"))
    if slack is None or not _keeps_text(spec.get("pre_tokenizer")):
        return None
    longest = _longest_token(spec)
    return max_model_len * longest * slack if longest else None


def _normalizer_slack(node: object) -> int | None:
    """How many characters of the prompt may become one (None: any number, or dropped)."""
    if node is None:
        return 1
    if not isinstance(node, dict):
        return None
    kind = node.get("type")
    if kind == "Sequence":
        slack = 1
        for part in node.get("normalizers") or ():
            one = _normalizer_slack(part)
            if one is None:
                return None
            slack *= one
        return slack
    if kind == "Replace":
        pattern, content = node.get("pattern"), node.get("content")
        string = pattern.get("String") if isinstance(pattern, dict) else None
        if isinstance(string, str) and isinstance(content, str):
            return 1 if len(content) >= len(string) else None
        return None  # a regex may match any length
    if kind in _KEEPING_NORMALIZERS:
        return 1
    return COMPOSING_SLACK if kind in _COMPOSING_NORMALIZERS else None


def _keeps_text(node: object) -> bool:
    """The pre-tokenizer splits without removing anything."""
    if node is None:
        return True
    if not isinstance(node, dict):
        return False
    kind = node.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in node.get("pretokenizers") or ())
    return kind in _KEEPING_PRE_TOKENIZERS and node.get("behavior") != "Removed"


def _longest_token(spec: dict[str, object]) -> int:
    """The longest vocabulary string, added tokens included (0: no vocabulary)."""
    model = spec.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict):
        pieces: list[object] = list(vocab)
    elif isinstance(vocab, list):  # Unigram: [piece, score] pairs
        pieces = [p[0] for p in vocab if isinstance(p, list) and p]
    else:
        return 0
    added = spec.get("added_tokens")
    for token in added if isinstance(added, list) else ():
        if isinstance(token, dict):
            pieces.append(token.get("content"))
    return max((len(p) for p in pieces if isinstance(p, str)), default=0)
