from tests.kernels.cpu.fixtures import (  # noqa: F401  (fixtures, by name)
    gemv_f32,
    kernel_cache,
    native_decode,
    native_linear,
    native_ops,
    native_prefill,
)
