"""Which device the engine runs on: `--device cuda` without a usable GPU fails at once,
naming what torch and the driver report (no silent CPU fall back); `--device auto` choosing
the CPU says why. This machine has no GPU, which is the case under test."""

from __future__ import annotations

import logging
import subprocess
import sys

import pytest
import torch

from baton import LLM
from baton.engine.runner.model_runner import resolve_device
from tests.unit.engine.tiny_checkpoint import save_tiny_llama

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without "
                                "a usable GPU")


def what_torch_reports() -> list[str]:
    return [f"torch {torch.__version__}", f"torch.version.cuda={torch.version.cuda}",
            "torch.cuda.is_available()=False", "torch.cuda.device_count()=0"]


def test_cuda_without_a_gpu_names_the_versions_found():
    with pytest.raises(ValueError) as err:
        resolve_device("cuda")
    for part in (*what_torch_reports(), "--device cpu"):
        assert part in str(err.value), part


def test_an_engine_asked_for_cuda_fails_before_loading_weights(tmp_path):
    model = save_tiny_llama(tmp_path / "m")
    with pytest.raises(ValueError, match=r"EngineConfig.device='cuda' but torch finds no"):
        LLM(model=str(model), device="cuda", skip_tokenizer_init=True, num_kv_blocks=8)


def test_auto_on_the_cpu_warns_why(caplog):
    with caplog.at_level(logging.WARNING, logger="baton.engine.runner.model_runner"):
        assert resolve_device("auto") == torch.device("cpu")
    (record,) = [r for r in caplog.records if "--device auto" in r.getMessage()]
    assert record.levelno == logging.WARNING
    for part in what_torch_reports():
        assert part in record.getMessage(), part


def test_baton_serve_with_cuda_exits_non_zero_with_the_reason(tmp_path):
    model = save_tiny_llama(tmp_path / "m")
    out = subprocess.run(
        [sys.executable, "-m", "baton.cli", "serve", "--model", str(model), "--device", "cuda",
         "--skip-tokenizer-init", "--num-kv-blocks", "8", "--port", "0"],
        capture_output=True, text=True, timeout=120)
    assert out.returncode != 0
    assert "EngineConfig.device='cuda' but torch finds no usable GPU" in out.stderr
    assert "torch.cuda.is_available()=False" in out.stderr
