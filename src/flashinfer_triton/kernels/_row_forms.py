"""Launches of the row kernels (norm, activation, RoPE) bound per call form, and their listing in ``host_caches()``.

The three row-op families launch a few-microsecond kernel per call, so each keeps, per call form, the launch
``_launch.bind`` returns for its compiled kernel: a later call of the same form passes only its tensors' addresses
and its row count. The public functions key these forms by everything their checks read but the number of rows
(an engine's prefill changes it at every step), so a call of a known form skips its checks as well
(:func:`launch_bound`).
"""

import torch

from .. import _config
from .._launch import FastKernel, bind, hooks_set


class _RowForms:
    """The call forms of every named :class:`BoundForms` (norm, activation, rope), as ``host_caches()`` lists them
    (``"row_forms"``) and ``clear_host_caches()`` forgets them."""

    def __init__(self):
        self.kernels: dict = {}

    def items(self) -> list:
        """``((kernel name, form key), bound launch or False)`` of every form kept."""
        return [((name, key), b) for name, f in list(self.kernels.items()) for key, b in list(f.forms.items())]

    def clear(self) -> None:
        for f in list(self.kernels.values()):
            f.forms.clear()


ROW_FORMS = _RowForms()


class BoundForms:
    """The launches of one kernel per call form, bound to everything but the leading tensors (``_launch.bind``).

    A call form is the key the caller gives: every argument after the leading tensors (sizes, strides, scalars,
    constexprs), the grid but its first axis (the rows, which no argument holds: each launch passes its own), the
    leading tensors' dtypes and the launch options, so the bound launch is the compiled kernel Triton chose for that
    form. Its later calls pass only the tensors' addresses and the rows: a few microseconds of host time, where
    ``FastKernel.run`` classifies every argument again. Addresses off a 16-byte boundary (the kernel was specialised
    on aligned ones), launch hooks (profilers), another current device and the short path switched off
    (``HostPathConfig.fast_launch``) take ``FastKernel.run``."""

    MAX = 256  # forms kept per kernel

    def __init__(self, fast: FastKernel, n_lead: int, name: str | None = None):
        """``name``: the kernel's name in ``host_caches()["row_forms"]`` (None: not listed)."""
        self.fast, self.n_lead = fast, n_lead
        self.forms: dict = {}
        if name is not None:
            ROW_FORMS.kernels[name] = self

    def launch(self, key, args: tuple, grid: tuple, **opts) -> None:
        # isinstance: a model's weight is an nn.Parameter (a Tensor subclass), and so are tensors a tracer wraps
        # (a leading int, the activation's row count, is passed as it is and never taken for an address)
        ptrs, aligned = [], True
        for x in args[: self.n_lead]:
            if isinstance(x, torch.Tensor):
                x = x.data_ptr()
                if x & 15:
                    aligned = False
            ptrs.append(x)
        # The short path switched off (``HostPathConfig.fast_launch``) or a launch hook set takes Triton's launcher
        # for every form, bound or not, and binds none (a form first seen then is bound by a later call without).
        fast = _config.HOST_PATH.fast_launch and not hooks_set()
        bound = self.forms.get(key)
        if bound and aligned and fast and bound.over(grid[0], *ptrs):
            return
        kernel = self.fast.run(*args, grid=grid, warmup=False, **opts)
        if bound is None and aligned and fast:
            if len(self.forms) >= self.MAX:
                self.forms.clear()
            # False: the form cannot be bound (it always takes FastKernel.run); absent: not tried yet.
            self.forms[key] = bind(self.fast, kernel, args, grid, self.n_lead) or False


def launch_bound(bound, g0: int, *ptrs: int, tail: tuple = ()) -> bool:
    """Launch ``bound`` (a form's bound launch: ``BoundForms.forms[key]``) over ``g0`` programs on the grid's first
    axis with these leading tensors' addresses, then the leading ints of ``tail`` (the activation's row count); False,
    having launched nothing, for no programs or where the short path does not apply now (an address off a 16-byte
    boundary, the short path switched off, a launch hook set, another current device): the caller then takes its
    general path."""
    any_bits = 0
    for p in ptrs:
        any_bits |= p
    if not g0 or any_bits & 15 or not _config.HOST_PATH.fast_launch or hooks_set():
        return False
    return bound.over(g0, *ptrs, *tail)
