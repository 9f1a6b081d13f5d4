"""A GPU run can never pass without a GPU: on a machine without CUDA every test of tests/gpu,
and any `gpu`-marked test elsewhere, is skipped with the reason, none passes."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

from tests.unit.deploy.kube import ROOT

no_cuda_only = pytest.mark.skipif(torch.cuda.is_available(),
                                  reason="this machine has CUDA: the GPU tests really run")


@pytest.mark.gpu
def test_a_gpu_marked_test_needs_cuda():
    # Passes on a GPU; on CPU the root conftest skips it before it runs.
    assert torch.cuda.is_available()


@no_cuda_only
def test_gpu_tests_only_skip_without_cuda():
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "tests/gpu",
         f"{__file__}::test_a_gpu_marked_test_needs_cuda"],
        cwd=ROOT, capture_output=True, text=True, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-3000:]
    summary = out.strip().splitlines()[-1]
    assert re.search(r"\d+ skipped", summary), summary
    assert "passed" not in summary and "failed" not in summary and "error" not in summary
    assert int(re.search(r"(\d+) skipped", summary)[1]) >= 10  # tests/gpu was collected
    assert "no CUDA device" in out
