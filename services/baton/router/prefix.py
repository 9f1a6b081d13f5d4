"""What each worker probably has in its prefix cache, as the router can know it without
tokenising: the prompts it sent there (llm-d's "approximate" prefix-cache mode).

A prompt is cut into blocks (64 characters of text, or 16 token ids for a token prompt:
about one KV block of 16 tokens either way), each block's hash chained to the previous
one's, so a hash names a whole prefix. Each worker keeps an LRU of the hashes the router
sent it. `match` counts the leading blocks of a prompt a worker has; the routing scorer
`prefix` prefers workers with long matches, and the disaggregation decider subtracts the
match from the prompt before comparing it with `min_prefill_tokens`. A worker's real cache
may have evicted what the router remembers; the cost of a wrong guess is one local prefill
of a prompt that was worth sending away, never a wrong answer.
"""

from __future__ import annotations

from collections import OrderedDict

CHARS_PER_BLOCK = 64
TOKENS_PER_BLOCK = 16


def prompt_of(api: str, req) -> str | list[int] | None:
    """The prompt as the router sees it, or None when a request has several prompts."""
    if api == "chat":
        return "".join(f"<{m.role}>" + (m.content if isinstance(m.content, str)
                                        else "".join(p.text for p in m.content))
                       for m in req.messages)
    prompts = req.prompts()
    return prompts[0] if len(prompts) == 1 else None


def block_hashes(prompt: str | list[int]) -> list[int]:
    step = CHARS_PER_BLOCK if isinstance(prompt, str) else TOKENS_PER_BLOCK
    out, prev = [], 0
    for i in range(0, len(prompt) - step + 1, step):  # whole blocks only
        prev = hash((prev, prompt[i:i + step] if isinstance(prompt, str)
                     else tuple(prompt[i:i + step])))
        out.append(prev)
    return out


def leading_matches(held, hashes: list) -> int:
    """How many of `hashes`, from the first, are in `held` (chained hashes: a miss ends
    the shared prefix)."""
    n = 0
    for h in hashes:
        if h not in held:
            break
        n += 1
    return n


class PrefixIndex:
    def __init__(self, capacity_per_worker: int = 100_000) -> None:
        self.capacity = capacity_per_worker
        self._held: dict[str, OrderedDict[int, None]] = {}

    def match(self, url: str, hashes: list[int]) -> int:
        """Leading blocks of the prompt this worker probably holds."""
        held = self._held.get(url)
        return leading_matches(held, hashes) if held else 0

    def add(self, url: str, hashes: list[int]) -> None:
        held = self._held.setdefault(url, OrderedDict())
        for h in hashes:
            held[h] = None
            held.move_to_end(h)
        while len(held) > self.capacity:
            held.popitem(last=False)

    def forget(self, url: str) -> None:
        """A worker restarted or left: its cache is empty."""
        self._held.pop(url, None)
