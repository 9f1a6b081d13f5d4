"""GPU tests: every test here is `gpu`-marked and runs on CUDA or not at all.

Unlike tests/kernels (which fall back to Triton's interpreter on CPU), nothing here may run
on the CPU: without a CUDA device each test is skipped with the reason, so a "GPU run" on a
CPU-only torch shows skips, never passes. TRITON_INTERPRET is never set here, and a test
refuses to run when the environment sets it (the kernels would run on the host)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
NO_CUDA = "no CUDA device: torch.cuda.is_available() is False (GPU tests need one)"


@pytest.hookimpl(tryfirst=True)  # before `-m gpu` selects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        if HERE in Path(item.path).resolve().parents:
            item.add_marker(pytest.mark.gpu)
            if not torch.cuda.is_available():
                item.add_marker(pytest.mark.skip(reason=NO_CUDA))


@pytest.fixture(autouse=True)
def on_the_device():
    """Fails a GPU test that would run its kernels in Triton's interpreter."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        pytest.fail("TRITON_INTERPRET is set: the GPU tests must run the kernels on the device")
    yield


@pytest.fixture(autouse=True)
def free_the_device():
    """What a test left on the device (its engine, its model) is freed before the next."""
    yield
    import gc

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


@pytest.fixture
def cuda() -> torch.device:
    return torch.device("cuda")
