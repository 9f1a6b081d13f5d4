from tests.kernels.cpu.fixtures import (  # noqa: F401  (fixtures, by name)
    kernel_cache,
    native_decode,
    native_prefill,
)
