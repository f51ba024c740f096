"""A shorter host path for launching our Triton kernels.

``JITFunction.run`` spends most of a launch's host time before the launch itself: a generated binder that
classifies every argument (``native_specialize_impl`` per runtime argument), a dict of all parameters, the
string form of the options for the cache key, the check of used globals. On the GPU machine's host that is
40-80 us per launch of our ~65-parameter kernels. :class:`FastKernel` keeps, per kernel, a map from a key
that separates the arguments at least as finely as Triton's own specialization does to the compiled kernel
Triton chose for them, and launches that compiled kernel directly on a hit:

* constexpr parameters: their values (compared by ``==``: ``True`` and ``1`` meet, where Triton would compile
  twice; the library passes every constexpr with one type, bools for flags and ints for sizes);
* tensors: dtype and ``data_ptr() % 16`` (Triton: dtype and whether the address is 16-byte aligned);
* ints: the value itself when it is 1 (Triton makes 1 a constant), else whether it is a multiple of 16 and
  its range class (i32 / i64 / u64);
* floats and bools: their type (Triton does not specialize them); None: None;
* tensor descriptors: dtype, block shape and padding (Triton's ``tensordesc<dtype[block]>``);
* the launch options (``num_warps``, ``num_stages``, ...) and the current device.

Tensor descriptors: Triton's launcher encodes each one (``cuTensorMapEncodeTiled``, 10-15 us of host time each on
the GPU machine) at every launch. On a hit, a compiled kernel with descriptor parameters is launched below
Triton's descriptor wrapper with the encoded arguments cached per (address, dtype, shape, strides, block,
padding, the kernel's descriptor metadata): equal inputs give the same descriptor bytes, so reuse is exact.
Anything unexpected in that wrapper (another Triton version) keeps Triton's launcher.

Versions: the short path reads Triton's launch objects (the compiled kernel's ``run``, ``function``,
``packed_metadata``, the descriptor wrapper's closure), which are not a public API. It is used only on the Triton
releases it is tested with (``TESTED_TRITON``: CI and the GPU suite run 3.6); on any other release every launch
takes Triton's own path, which is correct on all of them, only slower on the host.

Any other argument type, launch hooks set (profilers), or the interpreter take Triton's own path. A miss goes
through ``JITFunction.run`` (which compiles if needed and launches) and remembers the compiled kernel it
returns. A host-path configuration (``_config.HOST_PATH``) with ``fast_launch=False``, or
``FLASHINFER_TRITON_FAST_LAUNCH=0`` in the environment, restores Triton's path everywhere.
"""

from __future__ import annotations

import torch

from . import _config
from ._errors import lasting_zeros

# Triton releases (major, minor) whose launch internals the short path is tested against.
TESTED_TRITON = ((3, 6),)


def version_tested(version: str) -> bool:
    """Whether ``version`` (Triton's ``__version__``) is a release the short path is tested with."""
    try:
        major, minor = (int(x) for x in version.split(".")[:2])
    except ValueError:
        return False
    return (major, minor) in TESTED_TRITON


def _triton_version() -> str:
    try:
        import triton
    except Exception:  # pragma: no cover - no Triton: nothing is launched through here
        return "0.0"
    return triton.__version__


TRITON_TESTED = version_tested(_triton_version())
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


_A16, _A = (True, 0), (False, 0)  # i32 ints: multiple of 16 or not (tuples: never equal to the class of 1)


def _runtime_key(values) -> tuple | None:
    """The classes of the runtime (non-constexpr) arguments, in order (None: a type we do not classify)."""
    T = torch.Tensor
    key = []
    ap = key.append
    for x in values:
        t = type(x)
        if t is T:
            ap((x.dtype, x.data_ptr() % 16))
        elif t is int:
            if x == 1:
                ap(1)
            elif -2147483648 <= x < 2147483648:
                ap(_A if x % 16 else _A16)
            else:
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


def spec_key(args, const_pos) -> tuple | None:
    """The specialization key of one positional argument list (None: an argument type we do not classify):
    the constexpr values, then the runtime arguments' classes."""
    rt = _runtime_key([x for i, x in enumerate(args) if i not in const_pos])
    if rt is None:
        return None
    return (tuple(x for i, x in enumerate(args) if i in const_pos), rt)


_DESC_CACHE: dict = {}
_DESC_CACHE_MAX = 512


def _raw_launcher(kernel):
    """(launch function below the descriptor wrapper, descriptor parameter indices ascending, their metadata,
    metadata keys, cooperative, pdl) for a compiled kernel with descriptor parameters; None when it has none or
    the wrapper is not the Triton 3.6 one we know."""
    try:
        lw = kernel.run  # the CudaLauncher (handles loaded by the launch that cached this kernel)
        inner = lw.launch
        if inner.__closure__ is None or getattr(lw, "global_scratch_size", 1) or getattr(lw, "profile_scratch_size", 1):
            return None
        cells = dict(zip(inner.__code__.co_freevars, (c.cell_contents for c in inner.__closure__), strict=True))
        raw, idx, metas = cells["launcher"], cells["tensordesc_indices"], cells["tensordesc_meta"]
        if not idx or any(m is None for m in metas):
            return None
        pos = sorted(idx)
        keys = [
            (m["swizzle"], m["elem_size"], m["elem_type"], tuple(m["block_size"]), bool(m["fp4_padded"])) for m in metas
        ]
        return raw, pos, list(metas), keys, lw.launch_cooperative_grid, lw.launch_pdl
    except (AttributeError, KeyError, TypeError, ValueError):
        return None


def _desc_args(desc, meta, meta_key):
    """The launcher arguments of one tensor descriptor (encoded once per distinct input)."""
    base = desc.base
    key = (base.data_ptr(), base.dtype, tuple(desc.shape), tuple(desc.strides), tuple(desc.block_shape),
           desc.padding, meta_key)  # fmt: skip
    got = _DESC_CACHE.get(key)
    if got is None:
        from triton.backends.nvidia.driver import make_tensordesc_arg

        got = tuple(make_tensordesc_arg(desc, meta))
        if len(_DESC_CACHE) >= _DESC_CACHE_MAX:
            _DESC_CACHE.clear()
        _DESC_CACHE[key] = got
    return got


def _getter(positions):
    """A function returning ``tuple(args[i] for i in positions)`` (operator.itemgetter, always a tuple)."""
    import operator

    if not positions:
        return lambda args: ()
    if len(positions) == 1:
        i = positions[0]
        return lambda args: (args[i],)
    return operator.itemgetter(*positions)


class FastKernel:
    """Stands in for a ``@triton.jit`` kernel that the library launches as ``kernel.run(*args, grid=...,
    warmup=False, **options)`` with every parameter positional (constexprs included)."""

    def __init__(self, fn):
        self.fn = fn
        self.arg_names = fn.arg_names
        params = getattr(fn, "params", None)  # (the interpreter's functions have none: never the fast path)
        self._const_pos = frozenset(i for i, p in enumerate(params or ()) if p.is_constexpr)
        self._n = len(params) if params is not None else -1
        rt_pos = [i for i in range(max(self._n, 0)) if i not in self._const_pos]
        self._get_const = _getter(sorted(self._const_pos))
        self._get_rt = _getter(rt_pos)
        self._cache: dict = {}
        self._raw: dict = {}  # id(compiled kernel) -> _raw_launcher(...) (None: Triton's launcher)

    def __getattr__(self, name):  # everything else (params, cache, ...) from the kernel itself
        return getattr(self.fn, name)

    def run(self, *args, grid, warmup=False, **options):
        fn = self.fn
        if not (TRITON_TESTED and _config.HOST_PATH.fast_launch) or warmup or len(args) != self._n or callable(grid):
            return fn.run(*args, grid=grid, warmup=warmup, **options)
        from triton import knobs
        from triton.runtime import driver

        rt = knobs.runtime
        if _hooked(rt.launch_enter_hook) or _hooked(rt.launch_exit_hook):
            return fn.run(*args, grid=grid, warmup=False, **options)
        rt = _runtime_key(self._get_rt(args))
        if rt is None:
            return fn.run(*args, grid=grid, warmup=False, **options)
        spec = (self._get_const(args), rt)
        try:
            active = driver.active
            device = active.get_current_device()
        except RuntimeError:  # no GPU driver (CPU-only tests that stand in for the kernel's run)
            return fn.run(*args, grid=grid, warmup=False, **options)
        key = (device, tuple(options.items()), spec)
        try:
            kernel = self._cache.get(key)
        except TypeError:  # an unhashable option or constexpr value: Triton's path
            return fn.run(*args, grid=grid, warmup=False, **options)
        if kernel is None:
            kernel = fn.run(*args, grid=grid, warmup=False, **options)
            if kernel is not None and not hasattr(kernel, "result"):
                self._cache[key] = kernel
            return kernel
        stream = active.get_current_stream(device)
        g1 = grid[1] if len(grid) > 1 else 1
        g2 = grid[2] if len(grid) > 2 else 1
        raw = self._raw.get(id(kernel), False)
        if raw is False:
            raw = self._raw[id(kernel)] = _raw_launcher(kernel)
        if raw is None:
            kernel.run(grid[0], g1, g2, stream, kernel.function, kernel.packed_metadata, None, None, None, *args)
            return kernel
        launch, pos, metas, keys, coop, pdl = raw
        flat = []
        prev = 0
        for j, i in enumerate(pos):  # the descriptor positions, ascending: the rest as slices
            flat += args[prev:i]
            flat += _desc_args(args[i], metas[j], keys[j])
            prev = i + 1
        flat += args[prev:]
        launch(grid[0], g1, g2, stream, kernel.function, coop, pdl, None, None, kernel.packed_metadata, None, None,
               None, *flat)  # fmt: skip
        return kernel


def _direct_launcher(kernel):
    """(the compiled launcher function, cooperative, pdl) of a compiled kernel without descriptor parameters and
    without scratch memory, called below Triton's launcher object (which only adds two scratch allocations of
    size 0 in that case); None where its launcher is not the Triton 3.6 one we know."""
    try:
        lw = kernel.run
        inner = lw.launch
        if type(inner).__name__ != "builtin_function_or_method":  # (a descriptor wrapper: a Python closure)
            return None
        if lw.global_scratch_size or lw.profile_scratch_size:
            return None
        return inner, lw.launch_cooperative_grid, lw.launch_pdl
    except AttributeError:
        return None


def _device_getter(active):
    """The current-device query of a bound launch: torch's own (no lazy-init check) where Triton's driver uses
    ``torch.cuda.current_device`` (CUDA is initialized by then: the kernel was launched once)."""
    if active.get_current_device is torch.cuda.current_device:
        return torch._C._cuda_getDevice
    return active.get_current_device


class BoundLaunch:
    """One compiled kernel with every argument but the leading few bound: what a plan keeps so that ``run()``
    launches with the tensors of the call only.

    Pointers are bound as ints (the launcher takes an int as the address itself: no ``data_ptr()`` call and no
    pointer-attribute query per argument). Built by :func:`bind` from a launch that went through
    :class:`FastKernel` (the compiled kernel and the argument list Triton specialized on), so the bound launch
    is that same kernel; the caller keeps the leading arguments in the classes they had there (the plan's
    run key: shapes, strides, dtypes, 16-byte alignment). Where the compiled launcher is known
    (:func:`_direct_launcher`) the launch calls it directly, with the launch flags bound as well."""

    __slots__ = ("launch", "grid", "function", "meta", "pre", "tail", "stream_of", "device_of", "device", "flags")

    def __call__(self, *lead) -> bool:
        """Launch with these leading arguments on the current stream; False (nothing launched) when the current
        device is not the one the kernel was bound on (the caller then takes the general path)."""
        device = self.device_of()
        if device != self.device:
            return False
        g0, g1, g2 = self.grid
        if self.flags is None:
            self.launch(g0, g1, g2, self.stream_of(device), self.function, self.meta, None, None, None,
                        *self.pre, *lead, *self.tail)  # fmt: skip
        else:
            coop, pdl = self.flags
            self.launch(g0, g1, g2, self.stream_of(device), self.function, coop, pdl, None, None, self.meta, None,
                        None, None, *self.pre, *lead, *self.tail)  # fmt: skip
        return True

    def over(self, g0: int, *lead) -> bool:
        """As calling it, with ``g0`` programs on the grid's first axis instead of the bound count: the row kernels
        (norm, activation, rope) keep one bound launch per call form, whatever the number of rows it is called on
        (a row count is no argument of theirs, so the compiled kernel is the same). Their kernels have no descriptor
        parameters: :class:`DescBoundLaunch` keeps its bound grid."""
        device = self.device_of()
        if device != self.device:
            return False
        _, g1, g2 = self.grid
        if self.flags is None:
            self.launch(g0, g1, g2, self.stream_of(device), self.function, self.meta, None, None, None,
                        *self.pre, *lead, *self.tail)  # fmt: skip
        else:
            coop, pdl = self.flags
            self.launch(g0, g1, g2, self.stream_of(device), self.function, coop, pdl, None, None, self.meta, None,
                        None, None, *self.pre, *lead, *self.tail)  # fmt: skip
        return True


class _Address:
    """Stands in for a descriptor's base tensor where only its address is read."""

    __slots__ = ("ptr",)

    def __init__(self, ptr: int):
        self.ptr = ptr

    def data_ptr(self) -> int:
        return self.ptr


class _DescAt:
    """A tensor descriptor of a fixed geometry over the tensor at a given address (what Triton's encoder reads)."""

    __slots__ = ("base", "shape", "strides", "padding")


# Encoded descriptor arguments by geometry (shape, strides, padding, the kernel's descriptor metadata), each a
# dict address -> arguments: shared by every DescSlot of that geometry, so that the binding a re-plan makes
# finds the caches of the previous plan's layers encoded already.
_ENCODED: dict = {}
_ENCODED_MAX = 64  # geometries kept


class DescSlot:
    """One descriptor parameter of a bound launch: its geometry (shape, strides, block, padding) and the kernel's
    descriptor metadata are fixed by the plan and the call's form, only the address changes. The encoded
    launcher arguments are kept per address (an engine passes each layer's cache, and mostly the same few q / out
    buffers, every step), in a dict shared by the slots of one geometry (``_ENCODED``): equal addresses and
    geometry give the same bytes, so reuse is exact."""

    __slots__ = ("shape", "strides", "padding", "meta", "encoded")

    MAX = 256  # addresses kept per geometry (a 64-layer model's K and V caches, with room for q buffers)

    def __init__(self, desc, meta, meta_key=None):
        self.shape, self.strides, self.padding = list(desc.shape), list(desc.strides), desc.padding
        self.meta = meta
        key = None if meta_key is None else (tuple(self.shape), tuple(self.strides), self.padding, meta_key)
        got = _ENCODED.get(key) if key is not None else None
        if got is None:
            got = {}
            if key is not None:
                if len(_ENCODED) >= _ENCODED_MAX:
                    _ENCODED.clear()
                _ENCODED[key] = got
        self.encoded: dict = got

    def args(self, ptr: int) -> tuple:
        got = self.encoded.get(ptr)
        if got is None:
            from triton.backends.nvidia.driver import make_tensordesc_arg

            d = _DescAt()
            d.base, d.shape, d.strides, d.padding = _Address(ptr), self.shape, self.strides, self.padding
            got = tuple(make_tensordesc_arg(d, self.meta))
            if len(self.encoded) >= self.MAX:
                self.encoded.clear()
            self.encoded[ptr] = got
        return got


class DescBoundLaunch(BoundLaunch):
    """A :class:`BoundLaunch` of a compiled kernel with tensor-descriptor parameters (the Gluon kernels): the
    leading arguments are addresses, those at descriptor positions turned into the encoded descriptor of the
    bound geometry (:class:`DescSlot`); descriptors are launched below Triton's descriptor wrapper, as
    :class:`FastKernel` does on a hit."""

    __slots__ = ("slots", "coop", "pdl")

    over = None  # (launched on its bound grid only: no row kernel has descriptor parameters)

    def __call__(self, *lead) -> bool:
        device = self.device_of()
        if device != self.device:
            return False
        flat = []
        for x, slot in zip(lead, self.slots):
            if slot is None:
                flat.append(x)
            else:
                flat += slot.args(x)
        g0, g1, g2 = self.grid
        self.launch(g0, g1, g2, self.stream_of(device), self.function, self.coop, self.pdl, None, None, self.meta,
                    None, None, None, *self.pre, *flat, *self.tail)  # fmt: skip
        return True


def bind(fast: FastKernel, kernel, args, grid, n_lead: int, first: int = 0) -> BoundLaunch | None:
    """A :class:`BoundLaunch` of ``kernel`` (what ``fast.run(*args, ...)`` returned) with every argument but
    ``args[first:first + n_lead]`` (the call's, passed to the bound launch) bound, or None where the short path
    does not apply (Triton's path, an unknown descriptor launcher, launch hooks, a pointer off a 16-byte boundary
    among the call's arguments: their class is then not the one bind assumes)."""
    if (
        kernel is None
        or not (TRITON_TESTED and _config.HOST_PATH.fast_launch)
        or len(args) != fast._n
        or callable(grid)
    ):
        return None
    raw = fast._raw.get(id(kernel), False)
    if raw is False:
        raw = fast._raw[id(kernel)] = _raw_launcher(kernel)
    if raw is None and any(type(x).__name__ == "TensorDescriptor" for x in args):
        return None  # descriptors, but not the Triton launcher we know: its wrapper encodes them at every launch
    try:
        from triton.runtime import driver

        if hooks_set():
            return None
        active = driver.active
        device = active.get_current_device()
        launch, function, meta = kernel.run, kernel.function, kernel.packed_metadata
    except (AttributeError, RuntimeError):
        return None
    T = torch.Tensor
    stop = first + n_lead
    for x in args[first:stop]:
        if isinstance(x, T) and x.data_ptr() % 16:
            return None
    if raw is None:
        b = BoundLaunch()
    else:
        # Descriptors: only among the leading arguments (a bound one would hold its tensor's address past the
        # plan's life), each a slot of fixed geometry encoded per address.
        launch, pos, metas, meta_keys, coop, pdl = raw
        if pos[0] < first or pos[-1] >= stop:
            return None
        b = DescBoundLaunch()
        b.slots = [None] * n_lead
        for j, i in enumerate(pos):
            x = args[i]
            if type(x.base) is not T or x.base.data_ptr() % 16:
                return None
            b.slots[i - first] = DescSlot(x, metas[j], meta_keys[j])
        b.coop, b.pdl = coop, pdl
    b.flags = None
    if raw is None:
        direct = _direct_launcher(kernel)
        if direct is not None:
            launch, b.flags = direct[0], direct[1:]
    b.launch, b.function, b.meta = launch, function, meta
    b.grid = (grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1)
    b.pre = tuple(x.data_ptr() if isinstance(x, T) else x for x in args[:first])
    b.tail = tuple(x.data_ptr() if isinstance(x, T) else x for x in args[stop:])
    b.stream_of, b.device_of, b.device = active.get_current_stream, _device_getter(active), device
    return b


_STAND_INS: dict = {}


def stand_in_pointer(device: torch.device) -> torch.Tensor:
    """A float32 [1] tensor passed for absent pointer arguments (never dereferenced), one per device, kept for the
    life of the process (``_errors.lasting_zeros``: outside any CUDA-graph memory pool)."""
    t = _STAND_INS.get(device)
    if t is None:
        t = _STAND_INS[device] = lasting_zeros(1, torch.float32, device)
    return t


_RUNTIME_KNOBS: list = []


def hooks_set() -> bool:
    """Whether a launch hook (a profiler) is set now: bound launches then take the general path."""
    if not _RUNTIME_KNOBS:
        from triton import knobs

        _RUNTIME_KNOBS.append((knobs.runtime, getattr(knobs, "HookChain", None)))
    rt, chain = _RUNTIME_KNOBS[0]
    enter, leave = rt.launch_enter_hook, rt.launch_exit_hook
    if type(enter) is chain and type(leave) is chain:  # (Triton's own chains: a fifth of _hooked's host time)
        return bool(enter.calls) or bool(leave.calls)
    return _hooked(enter) or _hooked(leave)
