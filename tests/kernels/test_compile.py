"""Every kernel compiles to a cubin for sm_90 and sm_80 (catches GPU-only compile errors on a
CPU machine). Compiling needs TRITON_INTERPRET unset, which conftest sets for this process, so
compile_check.py runs in subprocesses (one per architecture, in parallel)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")

SCRIPT = Path(__file__).with_name("compile_check.py")


def test_kernels_compile_for_sm90_and_sm80():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    procs = {arch: subprocess.Popen([sys.executable, str(SCRIPT), str(arch)], env=env,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
             for arch in (90, 80)}
    for arch, proc in procs.items():
        output, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, f"sm_{arch} compile failed:\n{output[-4000:]}"
        compiled = [line for line in output.splitlines() if line.startswith(f"ok sm_{arch} ")]
        # 4 kernels x 4 combinations per architecture, and 2 more on sm_90 for FP8 caches;
        # the quantized GEMMs: 3 integer, 2 FP8 W8A16, and on sm_90 2 W8A8 + 2 activation quant
        assert len(compiled) == 16 + 5 + (8 + 4 if arch == 90 else 0), output[-4000:]
