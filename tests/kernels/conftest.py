"""Kernel tests run on CUDA when present, else in triton's CPU interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here at import time.
"""

from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

ON_GPU = torch.cuda.is_available()


@pytest.fixture
def device() -> torch.device:
    return torch.device("cuda" if ON_GPU else "cpu")
