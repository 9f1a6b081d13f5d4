"""Speculative decoding: a proposer guesses the next few tokens of a decoding request; the
scheduler runs them with its last token as one chunk in the normal continuous batch; the
model runner keeps the longest run of guesses the target model itself would have produced,
plus the target's own next token (`verify.py`). Greedy output is unchanged, token for token.

`config.py` the settings (`--speculative-config`), `ngram.py` prompt lookup (the proposer),
`decider.py` which requests guess this step and what it counts, `verify.py` acceptance."""
