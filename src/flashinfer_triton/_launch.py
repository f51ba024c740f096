"""A shorter host path for launching our Triton kernels.

``JITFunction.run`` spends most of a launch's host time before the launch itself: a generated binder that
classifies every argument (``native_specialize_impl`` per runtime argument), a dict of all parameters, the
string form of the options for the cache key, the check of used globals. On the GPU machine's host that is
40-80 us per launch of our ~65-parameter kernels. :class:`FastKernel` keeps, per kernel, a map from a key
that separates the arguments at least as finely as Triton's own specialization does to the compiled kernel
Triton chose for them, and launches that compiled kernel directly on a hit:

* constexpr parameters: their values;
* tensors: dtype and ``data_ptr() % 16`` (Triton: dtype and whether the address is 16-byte aligned);
* ints: the value itself when it is 1 (Triton makes 1 a constant), else whether it is a multiple of 16 and
  its range class (i32 / i64 / u64);
* floats and bools: their type (Triton does not specialize them); None: None;
* tensor descriptors: dtype, block shape and padding (Triton's ``tensordesc<dtype[block]>``);
* the launch options (``num_warps``, ``num_stages``, ...) and the current device.

Any other argument type, launch hooks set (profilers), or the interpreter take Triton's own path. A miss goes
through ``JITFunction.run`` (which compiles if needed and launches) and remembers the compiled kernel it
returns. ``ENABLED = False`` (or ``FLASHINFER_TRITON_FAST_LAUNCH=0`` in the environment) restores Triton's path
everywhere.
"""

from __future__ import annotations

import os

import torch

ENABLED = os.environ.get("FLASHINFER_TRITON_FAST_LAUNCH", "1") not in ("", "0")
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
_I32 = (-(1 << 31), 1 << 31)
_I64 = (-(1 << 63), 1 << 63)


def _int_class(x: int):
    if x == 1:
        return 1
    if _I32[0] <= x < _I32[1]:
        return (x % 16 == 0, 0)
    return (x % 16 == 0, 1 if _I64[0] <= x < _I64[1] else 2)


def _hooked(hook) -> bool:
    """A launch hook is set: a callable, or Triton's hook chain (3.6) with something in it."""
    if hook is None:
        return False
    calls = getattr(hook, "calls", None)
    return calls is None or len(calls) > 0


def spec_key(args, const_pos) -> tuple | None:
    """The specialization key of one positional argument list (None: an argument type we do not classify)."""
    T = torch.Tensor
    key = []
    ap = key.append
    for i, x in enumerate(args):
        if i in const_pos:
            ap(x)
            continue
        t = type(x)
        if t is T:
            ap((x.dtype, x.data_ptr() % 16))
        elif t is int:
            ap(_int_class(x))
        elif t is float:
            ap(float)
        elif t is bool:
            ap(bool)
        elif x is None:
            ap(None)
        elif t.__name__ == "TensorDescriptor":
            ap((x.base.dtype, tuple(x.block_shape), getattr(x, "padding", None)))
        else:
            return None
    return tuple(key)


class FastKernel:
    """Stands in for a ``@triton.jit`` kernel that the library launches as ``kernel.run(*args, grid=...,
    warmup=False, **options)`` with every parameter positional (constexprs included)."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = fn.arg_names
        params = getattr(fn, "params", None)  # (the interpreter's functions have none: never the fast path)
        self._const_pos = frozenset(i for i, p in enumerate(params or ()) if p.is_constexpr)
        self._n = len(params) if params is not None else -1
        self._cache: dict = {}

    def __getattr__(self, name):  # everything else (params, cache, ...) from the kernel itself
        return getattr(self.fn, name)

    def run(self, *args, grid, warmup=False, **options):
        fn = self.fn
        if not ENABLED or _INTERPRET or warmup or len(args) != self._n:
            return fn.run(*args, grid=grid, warmup=warmup, **options)
        from triton import knobs
        from triton.runtime import driver

        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            return fn.run(*args, grid=grid, warmup=False, **options)
        spec = spec_key(args, self._const_pos)
        if spec is None:
            return fn.run(*args, grid=grid, warmup=False, **options)
        try:
            active = driver.active
            device = active.get_current_device()
        except RuntimeError:  # no GPU driver (CPU-only tests that stand in for the kernel's run)
            return fn.run(*args, grid=grid, warmup=False, **options)
        key = (device, tuple(options.items()), spec)
        kernel = self._cache.get(key)
        if kernel is None:
            kernel = fn.run(*args, grid=grid, warmup=False, **options)
            if kernel is not None and not hasattr(kernel, "result"):
                self._cache[key] = kernel
            return kernel
        stream = active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
        return kernel
