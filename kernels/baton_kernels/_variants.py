"""Launch variants: what one kernel launch compiles to, kept finite and recordable.

Triton compiles one binary per *variant* of a kernel: its constexpr values, the dtypes of its
arguments, and (unless told not to) whether each integer argument equals 1 or is a multiple
of 16 and whether each pointer is 16-byte aligned. A value that changes from step to step in
any of those ways compiles a new variant mid-serving, stalling every stream. So every kernel
here is declared with `jit(dynamic=..., unaligned=...)`: integers that vary per step (counts,
lengths, a table's width) are not specialised, nor is the alignment of per-step index
tensors (slices of one metadata buffer); constexprs depend only on the model's shapes and
dtypes. Every launch goes through `Kernel[grid](...)`, which adds the launch's variant key to
the set of an enclosing `recording_variants()` block, so a test can check that warm-up
launched every variant that serving launches later.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
import triton

# The set that launches record into while a `recording_variants()` block runs, else None.
_RECORDING: ContextVar[set | None] = ContextVar("baton_kernels_recording", default=None)

VariantKey = tuple  # (kernel name, argument specialisations, constexprs, num_warps)


@contextmanager
def recording_variants() -> Iterator[set[VariantKey]]:
    """Collect the variant key of every kernel launch made inside the block (this thread /
    context only) into the yielded set."""
    seen: set[VariantKey] = set()
    token = _RECORDING.set(seen)
    try:
        yield seen
    finally:
        _RECORDING.reset(token)


@dataclass(frozen=True)
class Kernel:
    """A Triton kernel with the names of its per-step integers (`dynamic`) and per-step
    index pointers (`unaligned`); ``kernel[grid](*args, **constexprs)`` launches it."""

    fn: Any  # triton's JITFunction (or InterpretedFunction under TRITON_INTERPRET)
    name: str
    runtime_args: tuple[str, ...]  # non-constexpr parameters, in order
    dynamic: frozenset[str]
    unaligned: frozenset[str]

    def __getitem__(self, grid):
        def launch(*args, num_warps: int = 4, **constexprs):
            seen = _RECORDING.get()
            if seen is not None:
                seen.add(self.variant_key(args, constexprs, num_warps))
            return self.fn[grid](*args, num_warps=num_warps, **constexprs)
        return launch

    def variant_key(self, args: tuple, constexprs: dict, num_warps: int) -> VariantKey:
        """What Triton's cache key depends on, by Triton's rules (3.x): tensor dtypes and
        16-byte alignment, integer width, == 1 and % 16 == 0 of specialised integers."""
        if len(args) != len(self.runtime_args):
            raise TypeError(f"{self.name} takes {len(self.runtime_args)} runtime arguments, "
                            f"got {len(args)}")
        spec = tuple(_arg_spec(name, value, name in self.dynamic, name in self.unaligned)
                     for name, value in zip(self.runtime_args, args))
        return (self.name, spec, tuple(sorted((k, repr(v)) for k, v in constexprs.items())),
                num_warps)


def _arg_spec(name: str, value, dynamic: bool, unaligned: bool) -> tuple:
    if isinstance(value, torch.Tensor):
        aligned = not unaligned and value.data_ptr() % 16 == 0
        return (name, str(value.dtype), "aligned" if aligned else "")
    if isinstance(value, bool):
        return (name, "u1")
    if isinstance(value, int):
        width = "i32" if -2**31 <= value < 2**31 else "i64"
        if dynamic:
            return (name, width)
        return (name, width, "one" if value == 1 else "div16" if value % 16 == 0 else "")
    if isinstance(value, float):
        return (name, "fp32")
    raise TypeError(f"argument {name} of type {type(value).__name__} has no variant rule")


def jit(*, dynamic: tuple[str, ...] = (), unaligned: tuple[str, ...] = ()):
    """``triton.jit`` with `dynamic` integers and `unaligned` pointers not specialised."""
    def wrap(fn) -> Kernel:
        params = inspect.signature(fn).parameters
        runtime = tuple(n for n, p in params.items() if "constexpr" not in str(p.annotation))
        unknown = (set(dynamic) | set(unaligned)) - set(runtime)
        if unknown:
            raise ValueError(f"{fn.__name__} has no runtime parameters {sorted(unknown)}")
        compiled = triton.jit(fn, do_not_specialize=list(dynamic),
                              do_not_specialize_on_alignment=list(unaligned))
        return Kernel(compiled, fn.__name__, runtime, frozenset(dynamic), frozenset(unaligned))
    return wrap
