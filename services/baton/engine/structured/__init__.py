"""Structured outputs: a request's output constrained by a grammar, token by token.

`base.py` the backend contract; `llguidance_backend.py` the grammar engine (and why it was
chosen); `manager.py` `StructuredOutputs` (compile + cache, per-request matchers, rebuilding
a matcher over earlier tokens); `masks.py` one step's bitmasks, applied to the constrained
rows of the sampler's logits. Nothing here is imported by `request.py` but `base.py`.
"""
