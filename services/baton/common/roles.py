"""What a worker does in a deployment: the one definition of the role names."""

from __future__ import annotations

import enum


class Role(enum.StrEnum):
    """`both`: a colocated worker (prefills and decodes its own requests); `prefill`: computes
    prompts' KV and holds it for a decode pod; `decode`: pulls that KV (or prefills locally)
    and generates. A `StrEnum`, so it compares equal to its name on the wire."""

    BOTH = "both"
    PREFILL = "prefill"
    DECODE = "decode"


ROLE_NAMES: tuple[str, ...] = tuple(r.value for r in Role)
