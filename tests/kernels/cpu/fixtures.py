"""The `baton_cpu` kernels, built once per test session into one cache dir (the prefill
kernel alone takes ~10 s to build), or the test skipped where no C compiler exists. Imported
by the conftests of the tests that use them (here and tests/unit/engine)."""

from __future__ import annotations

import pytest

from baton_cpu import attention, linear, ops


@pytest.fixture(scope="session")
def kernel_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("kernels")


def _built(kernel, what: str):
    if kernel is None:
        pytest.skip(f"no C compiler: {what} cannot be built here")
    return kernel


@pytest.fixture(scope="session")
def native_decode(kernel_cache):
    return _built(attention.load_decode(kernel_cache), "the native decode kernel")


@pytest.fixture(scope="session")
def native_prefill(kernel_cache):
    return _built(attention.load_prefill(kernel_cache), "the native prefill kernel")


@pytest.fixture(scope="session")
def native_ops(kernel_cache):
    return _built(ops.load(kernel_cache), "the native CPU ops")


@pytest.fixture(scope="session")
def native_linear(kernel_cache):
    return _built(linear.load_linear_kernels(kernel_cache), "the native linear kernels")


@pytest.fixture(scope="session")
def gemv_f32(kernel_cache):
    return _built(linear.load_gemv_f32(kernel_cache),
                  "the fp32 GEMV (or this CPU has no AVX2 + FMA)")
