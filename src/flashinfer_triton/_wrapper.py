"""What every plan/run wrapper shares: workspaces, CUDA-graph buffers, the page table on the device,
the checks of ``run()``, and the hand-off to the implementation chosen in ``_backend``.

``plan()`` does all host work once per batch (reads the lengths, validates them, fills the device
index tensors, lets the implementation cut the work); ``run()`` only checks shapes and launches, so it
never synchronizes with the host and can be captured in a CUDA graph.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import types
from collections.abc import Mapping

import torch

try:  # numpy makes plan()'s host math several times faster; torch alone works too
    import numpy as np
except ImportError:  # pragma: no cover - numpy is nearly always installed beside torch
    np = None

from . import _checks as C
from . import _errors
from ._backend import AttentionBatch, AttentionOptions, Workspace, select_impl, use_triton
from ._launch import hooks_set
from .reference import alibi_slopes

INT_WORKSPACE_BYTES = 8 * 1024 * 1024

# Reductions called as ufuncs: ``a.min()`` goes through numpy's Python wrapper, which costs about as much
# host time as the reduction itself on a batch's small arrays.
if np is not None:
    _MIN, _MAX = np.minimum.reduce, np.maximum.reduce


def _host_i64(x: torch.Tensor) -> torch.Tensor:
    return x.detach().to("cpu", torch.int64)


def same_lengths(x: torch.Tensor, lens) -> bool:
    """True when the 1-D tensor ``x`` holds the lengths ``lens`` (an int numpy array, or a list of ints), as
    ``seq_lens`` must. An integer tensor on the host is compared through its own numpy view, or as a list when
    ``lens`` is one (a small table's, :class:`PageTable`): converting it to int64 first cost about a quarter of
    a small CUDA-graph decode plan()."""
    n = len(lens)
    if x.shape[0] != n:
        return False
    if x.is_cpu and (x.dtype is torch.int32 or x.dtype is torch.int64):
        if type(lens) is list:
            return x.tolist() == lens
        if x.dtype is torch.int32 and lens.dtype == np.int32:  # (a compact table's: equal bytes, no reduction)
            return x.numpy().tobytes() == lens.tobytes()
        return n == 0 or not _MAX(x.numpy() != lens)
    if type(lens) is list:
        lens = np.array(lens, dtype=np.int64)
    return bool(np.array_equal(_host_i64(x).numpy(), lens))


def _pack_custom_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens, name_prefix=""):
    """(packed little-endian segments, byte indptr) from a flat bool mask or an already packed one."""
    from .quantization import segment_packbits

    sizes = qo_lens * kv_lens
    total = int(sizes.sum())
    if custom_mask is not None:
        C.check_tensor(name_prefix + "custom_mask", custom_mask)
        flat = custom_mask.reshape(-1)
        if flat.numel() != total:
            raise C.value_error(
                name_prefix + "custom_mask", f"sum(qo_len * kv_len) = {total} elements", f"{flat.numel()}"
            )
        seg_indptr = torch.zeros(len(sizes) + 1, dtype=torch.int64)
        seg_indptr[1:] = torch.cumsum(sizes, 0)
        packed, mask_indptr = segment_packbits(
            flat.to(torch.bool), seg_indptr.to(flat.device).to(torch.int32), "little"
        )
        return packed, _host_i64(mask_indptr)
    C.check_tensor(name_prefix + "packed_custom_mask", packed_custom_mask, dim=1, dtypes=(torch.uint8,))
    mask_indptr = torch.zeros(len(sizes) + 1, dtype=torch.int64)
    mask_indptr[1:] = torch.cumsum((sizes + 7) // 8, 0)
    if packed_custom_mask.numel() < int(mask_indptr[-1]):
        raise C.value_error(
            name_prefix + "packed_custom_mask",
            f"at least sum(ceil(qo_len * kv_len / 8)) = {int(mask_indptr[-1])} bytes",
            f"{packed_custom_mask.numel()}",
        )
    return packed_custom_mask.contiguous(), mask_indptr  # (the kernels read it at unit stride)


class Plan:
    """What ``plan()`` leaves for ``run()``: the checked options, the batch on the device, the implementation,
    its plan object, the query rows and the page range. Fixed once built, except through three methods: a
    CUDA-graph re-plan that rewrote this plan's arrays at their fixed addresses (``replanned_in_place``), the
    first run() that leaves the bound launch of its call's form (``attach_binding``), and the plan() that made
    it taking over the binding of the plan it replaces where the launch is the same (``inherit_binding``).
    Slots: reading a field costs what a dict lookup did."""

    __slots__ = ("opts", "batch", "impl", "plan", "total_q", "max_page_index", "fast_run", "bind_tried", "plan_id")

    def __init__(self, opts, batch, impl, plan, total_q: int, max_page_index):
        self.opts: AttentionOptions = opts
        self.batch: AttentionBatch = batch
        self.impl = impl
        self.plan = plan  # the implementation's plan object (tiles, work list, partial buffers)
        self.total_q = total_q
        # int, or a range still on the device (PendingPageRange / DeferredPageRange), read at the first need
        self.max_page_index = max_page_index
        self.fast_run: RunBinding | None = None  # the launch bound at the first run(), when it could bind
        self.bind_tried = False  # one binding per plan: the form of its first run (other forms keep the general path)
        self.plan_id = next(_PLAN_IDS)

    def attach_binding(self, binding: RunBinding | None) -> None:
        """Keeps what the first binding run() left (None: that call's form could not bind)."""
        if self.bind_tried:
            raise RuntimeError("a plan keeps the binding of its first run() only")
        self.fast_run, self.bind_tried = binding, True

    def inherit_binding(self, prev: Plan | None) -> None:
        """Takes over the binding of ``prev``, the plan this one replaces, when it binds this plan's launches too:
        the same checked options, implementation and query rows, a page range (paged) or key rows (ragged) that
        the bound cache form holds, and a launch state equal to the previous plan's (:func:`_same_state`: every
        field of the plan object and every device array of the batch, tensors by address, dtype, shape and
        strides). An engine's eager re-plan of the same batch layout then runs its first layer bound, with the
        descriptors its caches already have (``_launch.DescSlot``), instead of checking and binding again."""
        b = prev.fast_run if prev is not None else None
        if type(b) is RangeCheckedBinding:
            b = b.binding
        if b is None or self.bind_tried or prev.opts is not self.opts or prev.impl is not self.impl:
            return
        if prev.total_q != self.total_q:
            return
        pending = False
        if self.opts.paged:
            m = self.max_page_index
            if type(m) is not int:
                # page indices on the device: their range is on its way to the host, read at the first run()
                if not isinstance(m, PendingPageRange):
                    return
                pending = True
            elif m >= b.kv_rows:
                return
        else:
            kv = self.batch.kv_indptr_host
            if kv is None or int(kv[-1]) > b.kv_rows:
                return
        if _same_state(prev.plan, self.plan) and _same_state(prev.batch, self.batch):
            self.fast_run, self.bind_tried = (RangeCheckedBinding(b, self) if pending else b), True

    def replanned_in_place(self, total_q: int, max_page_index) -> None:
        """A CUDA-graph re-plan rewrote the staged arrays and the work list at this plan's addresses: the new
        batch's rows and page range; the binding of the previous batch's first run() is dropped."""
        self.total_q, self.max_page_index = total_q, max_page_index
        self.fast_run, self.bind_tried = None, False


class RangeCheckedBinding:
    """The binding a plan takes over while its page range is still on its way from the device (page indices on
    the device: :class:`PendingPageRange`). Its first call reads the range, as the checking path's first run()
    would, and launches bound when every index addresses the bound cache form's pages (a call of another form
    is refused by the binding itself); the plan then holds the binding. An engine's eager prefill step over
    device page indices thus runs its first layer bound instead of checking and binding again. A range out of
    bounds (or unreadable inside a CUDA-graph capture) returns None: the checking path raises its error."""

    __slots__ = ("binding", "plan", "kv_rows")

    def __init__(self, binding: RunBinding, plan: Plan):
        self.binding, self.plan, self.kv_rows = binding, plan, binding.kv_rows

    def __call__(self, q, kv, out, return_lse: bool, scales):
        got = self.plan.max_page_index.value()
        if got is None or got[0] < 0 or got[1] >= self.kv_rows:
            return None
        self.plan.fast_run = self.binding
        return self.binding(q, kv, out, return_lse, scales)


_PLAN_IDS = itertools.count(1)
_STATE_FIELDS: dict = {}  # dataclass type -> the fields _same_state compares
_SCALARS = (int, float, bool, str, type(None), torch.dtype, torch.device)


def _same_state(a, b) -> bool:
    """Whether two plan objects (or two batches) give run() the same launch arguments: every dataclass field
    equal, tensors by address, dtype, shape, strides and device (a kernel sees nothing else of them), frozen
    dataclasses (configurations) and plain values by value. A batch's host copies (``*_host``) and ``extra`` are
    the host's, not run()'s, and so are the fields a plan class names in ``BINDING_IGNORES``. Anything else (a numpy
    array, an unknown object) must be the same object."""
    if a is b:  # (a plan object taken over whole by the new plan)
        return True
    t = type(a)
    if t is not type(b):
        return False
    names = _STATE_FIELDS.get(t)
    if names is None:
        if not dataclasses.is_dataclass(a):
            return a is b
        skip = getattr(t, "BINDING_IGNORES", ())
        names = tuple(
            f.name
            for f in dataclasses.fields(a)
            if not f.name.endswith("_host") and f.name != "extra" and f.name not in skip
        )
        _STATE_FIELDS[t] = names
    for name in names:
        x, y = getattr(a, name), getattr(b, name)
        if x is y:
            continue
        tx = type(x)
        if tx is not type(y):
            return False
        if tx is _T:
            if (x.data_ptr() != y.data_ptr() or x.dtype != y.dtype or x.device != y.device or x.shape != y.shape
                    or x.stride() != y.stride()):  # fmt: skip
                return False
        elif tx in _SCALARS or (dataclasses.is_dataclass(x) and tx.__dataclass_params__.frozen):
            if x != y:
                return False
        else:
            return False
    return True


@dataclasses.dataclass(frozen=True)
class PlanInfo:
    """What a wrapper's current plan chose (``wrapper.plan_info()``), for tests, benchmarks and logs.

    ``backend``: ``"gluon"`` (the Hopper Gluon kernel, which run() takes when its tensors fit the kernel's
    descriptors, else the Triton kernel of the same plan), ``"triton"`` or ``"torch"`` (the PyTorch path);
    ``config``: the tile configuration (``DecodeConfig`` / ``PrefillConfig``; None on the PyTorch path);
    ``split``: some KV range is cut into pieces whose partial states are merged (in the launch, or by a merge
    launch after it); ``grid``: the attention launch's grid (work items, KV heads); ``cuda_graph``: a plan of
    fixed layout that a captured graph replays after later plans; ``bound``: the first run() of this plan left
    a bound launch, which later calls of the same tensor form take; ``bind_tried``: the plan's one binding is
    settled (its first run() bound or declined, or the binding came from the previous plan): later forms keep
    the general path.

    ``plan_id``: new at each plan() that builds a plan, kept by a CUDA-graph re-plan that rewrites the same
    plan in place (same addresses, same captured graph); ``options``: the checked options (the same object
    while re-plans keep them); ``batch_size``, ``total_q`` (query rows run() takes); ``max_page_index``: the
    largest page index of the table (an int, or a range still on the device, read when run() first needs it);
    ``arrays``: host copies of the batch's and the plan's tensors by name (``qo_indptr``, ``kv_indptr``,
    ``kv_indices``, ``kv_lens``, the ``*_host`` arrays; ``work``, ``counters``, ``part_o``, ... of the
    plan), and ``addresses`` / ``storages`` their device addresses and their storages' base addresses;
    ``details``: the plan's other plain fields (``num_work``, ``work_cap``, ``chunk``, ...); ``batch_extra``: the
    names the batch still holds in its ``extra`` slot; ``float_workspace_bytes``: bytes of the float workspace
    the plan uses. Reading the arrays back waits for the device: not for a hot path."""

    backend: str
    config: object | None
    split: bool
    grid: tuple | None
    cuda_graph: bool
    bound: bool
    plan_id: int = 0
    options: AttentionOptions | None = None
    batch_size: int = 0
    total_q: int = 0
    max_page_index: object = None
    arrays: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    addresses: Mapping[str, int] = dataclasses.field(default_factory=dict)
    storages: Mapping[str, int] = dataclasses.field(default_factory=dict)
    details: Mapping[str, object] = dataclasses.field(default_factory=dict)
    batch_extra: tuple = ()
    float_workspace_bytes: int = 0
    bind_tried: bool = False


_BATCH_ARRAYS = ("qo_indptr", "kv_indptr", "kv_indices", "kv_lens", "qo_indptr_host", "kv_lens_host",
                 "kv_indptr_host", "mask_packed", "mask_indptr", "alibi_slopes")  # fmt: skip


def plan_info(planned: Plan | None, float_buffer: torch.Tensor | None = None) -> PlanInfo | None:
    """The :class:`PlanInfo` of a core wrapper's plan (None before any plan)."""
    if planned is None:
        return None
    from ._surface import buffer_use

    p, opts, b = planned.plan, planned.opts, planned.batch
    tensors = {name: getattr(b, name) for name in _BATCH_ARRAYS}
    details = {}
    if dataclasses.is_dataclass(p):
        for f in dataclasses.fields(p):
            x = getattr(p, f.name)
            if isinstance(x, torch.Tensor):
                tensors[f.name] = x
            elif x is None or type(x) in (int, float, bool, str):
                details[f.name] = x
    tensors = {k: t for k, t in tensors.items() if t is not None}
    common = dict(
        plan_id=planned.plan_id,
        options=opts,
        batch_size=b.batch_size,
        total_q=planned.total_q,
        max_page_index=planned.max_page_index,
        arrays=types.MappingProxyType({k: t.detach().to("cpu", copy=True) for k, t in tensors.items()}),
        addresses=types.MappingProxyType({k: t.data_ptr() for k, t in tensors.items()}),
        storages=types.MappingProxyType({k: t.untyped_storage().data_ptr() for k, t in tensors.items()}),
        details=types.MappingProxyType(details),
        batch_extra=tuple(sorted(b.extra)),
        float_workspace_bytes=buffer_use(planned, float_buffer) if float_buffer is not None else 0,
        bind_tried=planned.bind_tried,
    )
    bound = planned.fast_run is not None
    items = getattr(p, "work_cap", None)  # decode
    if items is None:
        items = getattr(p, "grid0", None)  # prefill
    if items is None:
        return PlanInfo("torch", None, False, None, False, bound, **common)
    if hasattr(p, "needs_merge"):  # decode: the plan's own choice
        split, gluon = bool(p.needs_merge), bool(p.gluon)
    else:  # prefill: the tile configuration's
        split, gluon = p.part_o is not None, bool(p.config.gluon)
    backend = "gluon" if gluon else "triton"
    return PlanInfo(backend, p.config, split, (int(items), opts.num_kv_heads), bool(p.graph), bound, **common)


class PublicWrapperSurface:
    """What the public wrappers show engines beyond plan/run: workspaces, aliases. ``self._w`` is the core."""

    def plan_info(self) -> PlanInfo | None:
        """What the current plan chose: kernel, tiles, split, grid (:class:`PlanInfo`); None before plan()."""
        return self._w.plan_info()

    _w: _AttentionWrapper

    # Engines read and assign these attributes directly (one int workspace shared between wrappers).
    @property
    def _int_workspace_buffer(self) -> torch.Tensor:
        return self._w._int_workspace_buffer

    @_int_workspace_buffer.setter
    def _int_workspace_buffer(self, value: torch.Tensor) -> None:
        C.check_tensor("_int_workspace_buffer", value, device=self._w.device)
        self._w._int_workspace_buffer = value

    @property
    def _float_workspace_buffer(self) -> torch.Tensor:
        return self._w._float_workspace_buffer

    # Engines assign it too (mini-sglang sets "fa2" before CUDA-graph capture): every name maps to this
    # library's kernels, so the value is kept for them to read back and changes nothing else.
    @property
    def _backend(self) -> str:
        return self._w._backend

    @_backend.setter
    def _backend(self, value: str) -> None:
        if not isinstance(value, str):
            raise C.type_error("_backend", "a string ('auto', 'fa2', 'fa3', ...)", type(value).__name__)
        self._w._backend = value

    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._w._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Swap the workspaces (e.g. to share them between wrappers); takes effect at the next plan()."""
        self._w.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""

    def run_return_lse(self, *args, **kwargs):
        """``run(..., return_lse=True)``."""
        kwargs["return_lse"] = True
        return self.run(*args, **kwargs)

    def forward_return_lse(self, *args, **kwargs):
        """Deprecated ``forward(..., return_lse=True)``."""
        kwargs["return_lse"] = True
        return self.forward(*args, **kwargs)

    @property
    def device(self) -> torch.device:
        """The workspace's device (FlashInfer's public ``device`` attribute)."""
        return self._w.device


class _AttentionWrapper:
    """Base of the decode and prefill wrappers (not public)."""

    _is_decode = False
    _paged = True

    def __init__(self, float_workspace_buffer, kv_layout="NHD", use_cuda_graph=False, backend="auto"):
        C.check_tensor("float_workspace_buffer", float_workspace_buffer)
        C.check_kv_layout(kv_layout)
        if not isinstance(backend, str):
            raise C.type_error("backend", "a string ('auto', 'fa2', 'fa3', 'triton', ...)", type(backend).__name__)
        self._float_workspace_buffer = float_workspace_buffer
        self.device = float_workspace_buffer.device
        self._kv_layout = kv_layout
        self._use_cuda_graph = bool(use_cuda_graph)
        self._backend = backend
        self._int_workspace_buffer = _int_workspace(self.device, shared=isinstance(self, _SingleRequest))
        self._planned: Plan | None = None  # after plan()
        self._fixed_batch_size = None
        self._kv_lens_buf = None
        self._qo_indptr_buf = None

    # ------------------------------------------------------------------ lifecycle helpers
    @property
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Swap the workspaces (e.g. to share them between wrappers); takes effect at the next plan()."""
        C.check_tensor("float_workspace_buffer", float_workspace_buffer, device=self.device)
        self._float_workspace_buffer = float_workspace_buffer
        if int_workspace_buffer is not None:
            C.check_tensor("int_workspace_buffer", int_workspace_buffer, device=self.device)
            self._int_workspace_buffer = int_workspace_buffer

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""

    def _range_scratch(self) -> RangeScratch:
        scratch = self.__dict__.get("_range_scratch_obj")
        if scratch is None:
            scratch = self._range_scratch_obj = RangeScratch()
        return scratch

    def _require_plan(self, what: str = "run") -> Plan:
        if self._planned is None:
            raise RuntimeError(f"{type(self).__name__}.{what}() called before plan(): call plan() first")
        return self._planned

    # What other modules read of the plan (attributes, no lookups by name).
    @property
    def current_plan(self) -> Plan | None:
        """The current :class:`Plan` (None before plan())."""
        return self._planned

    @property
    def planned_out_dtype(self) -> torch.dtype | None:
        """The output dtype the current plan writes (None before plan())."""
        p = self._planned
        return None if p is None else p.opts.o_dtype

    def plan_info(self) -> PlanInfo | None:
        """See :class:`PlanInfo` (None before plan())."""
        return plan_info(self._planned, self._float_workspace_buffer)

    def kernel_planner(self):
        """A call that runs the implementation's own plan() again for the current batch and options (without
        the public checks): what benchmarks time as the planning cost of the kernels alone."""
        p = self._require_plan("kernel_planner")
        # (without the wrapper's kept arrays: these plans must not rewrite the arrays of the plan in force)
        return lambda: p.impl.plan(p.opts, p.batch, dataclasses.replace(self._workspace(), reuse=None))

    def _workspace(self) -> Workspace:
        return Workspace(
            float_buffer=self._float_workspace_buffer,
            int_buffer=self._int_workspace_buffer,
            cuda_graph=self._use_cuda_graph,
            max_batch_size=self._fixed_batch_size,
            max_total_q=getattr(self, "_max_total_q", None),
            reuse=self.__dict__.setdefault("_plan_reuse", {}),
        )

    def _stage(self, host_arrays: dict) -> dict:
        """int32 device copies of several host arrays in ONE host-to-device copy (views of one buffer).

        The arrays are packed into one fresh int32 host array and copied with ``non_blocking=True``: from
        pageable memory CUDA stages the bytes before the call returns and does not wait for the device, which
        measured faster on the GPU machine's host (~11 us) than a pinned buffer guarded by an event (~48 us).
        """
        names = list(host_arrays)
        if np is None:
            parts = [host_arrays[n].reshape(-1).to(torch.int32) for n in names]
            sizes = [x.numel() for x in parts]
            flat = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int32)
            if self.device.type != "cpu":
                flat = flat.to(self.device, non_blocking=True)
            return dict(zip(names, torch.split(flat, sizes)))
        packed, sizes = _pack(host_arrays)
        flat = torch.from_numpy(packed)
        if self.device.type != "cpu":
            flat = flat.to(self.device, non_blocking=True)
        # every view in one call (a slice of a CUDA tensor costs ~4 us of host time); odd pieces are the gaps
        return dict(zip(names, flat.split_with_sizes(sizes)[::2]))

    def _device_batch_arrays(
        self,
        *,
        qo_indptr_host,
        kv_indptr_host,
        kv_indices,
        kv_lens_host,
        last_page_len_host,
        mask_indptr_host,
        graph_buffers,
        defer: bool = False,
    ):
        """The batch's index tensors on the device: fresh ones, or (CUDA-graph mode) the caller's persistent
        buffers refilled in place, padded past the batch with empty requests so a larger captured grid is safe.
        ``defer`` (eager mode): a :class:`BatchStage` instead, whose arrays ride in the plan's own copy."""
        # (numpy views of the host tensors first: indexing a torch tensor costs a microsecond or more per call)
        as_host = _as_numpy if np is not None else (lambda x: x.reshape(-1))
        qo_h, kv_h = as_host(qo_indptr_host), as_host(kv_indptr_host)
        batch_size = len(kv_lens_host)
        nnz = int(kv_h[-1]) if kv_indices is not None else 0
        cap = self._fixed_batch_size if self._use_cuda_graph else batch_size

        def pad(x, n, fill):
            if len(x) >= n:
                return x
            out = np.full(n, fill, dtype=np.int64) if np is not None else torch.full((n,), fill, dtype=torch.int64)
            out[: len(x)] = x
            return out

        host = {
            "qo_indptr": pad(qo_h, cap + 1, int(qo_h[-1])),
            "kv_indptr": pad(kv_h, cap + 1, int(kv_h[-1])),
            "kv_lens": pad(as_host(kv_lens_host), cap, 0),
        }
        indices_on_host = kv_indices is not None and kv_indices.device != self.device
        if indices_on_host:
            host["kv_indices"] = as_host(kv_indices)[:nnz]
        if mask_indptr_host is not None:
            mask_h = as_host(mask_indptr_host)
            host["mask_indptr"] = pad(mask_h, cap + 1, int(mask_h[-1]))
        if self._use_cuda_graph and last_page_len_host is not None:
            host["last_page_len"] = pad(as_host(last_page_len_host), cap, 0)
        if not self._use_cuda_graph:
            if defer and np is not None:
                return BatchStage(
                    self.device, host, None if indices_on_host or kv_indices is None else (kv_indices, nnz)
                )
            staged = self._stage(host)
            if not indices_on_host and kv_indices is not None:
                staged["kv_indices"] = kv_indices if kv_indices.shape[0] == nnz else kv_indices[:nnz]
            return staged
        return self._graph_batch_arrays(host, cap, kv_indices, nnz, graph_buffers or {})

    # Slots of the fixed-address staging buffer used in CUDA-graph mode (entries: cap + the second value).
    _GRAPH_SLOTS = (("qo_indptr", 1), ("kv_indptr", 1), ("kv_lens", 0), ("mask_indptr", 1), ("last_page_len", 0))

    @classmethod
    def _graph_slots(cls, cap: int):
        """(name, offset, entries) of each staging slot, every slot starting on a 16-byte boundary, and the
        staging buffer's int32 size."""
        slots, off = [], 0
        for name, extra in cls._GRAPH_SLOTS:
            slots.append((name, off, cap + extra))
            off += _align4(cap + extra)
        return slots, off

    def _graph_stage_buffer(self, size: int) -> torch.Tensor:
        """The fixed-address int32 device buffer of ``size`` entries the CUDA-graph staging copy goes to."""
        stage = getattr(self, "_graph_stage", None)
        if stage is None or stage.numel() != size:
            stage = self._graph_stage = torch.zeros(size, dtype=torch.int32, device=self.device)
        return stage

    def _graph_batch_arrays(self, host: dict, cap: int, kv_indices, nnz: int, buffers: dict) -> dict:
        """CUDA-graph mode: the batch's small arrays go to a fixed-address device buffer owned by the wrapper
        in ONE host-to-device copy (the kernels read them there, so a captured graph stays valid); the
        caller's buffers are refilled as FlashInfer does (``indptr`` / ``last_page_len`` / ``qo_indptr`` /
        ``mask_indptr`` copied in, page indices copied unless they already are that buffer)."""
        slots, size = self._graph_slots(cap)
        own_qo = self._qo_indptr_buf
        for name, _, n in slots:  # every check before the first write
            if name not in host:
                continue
            if len(host[name]) > n:
                raise C.value_error(name, f"at most {n} entries (the CUDA-graph batch capacity)", len(host[name]))
            buf = buffers.get(name)
            if buf is not None and buf is not own_qo and name != "kv_lens" and n > buf.numel():
                raise C.value_error(f"{name} buffer", f"room for {n} entries (CUDA-graph capacity)", buf.numel())
        idx_buf = buffers.get("kv_indices") if kv_indices is not None else None
        if idx_buf is not None and nnz > idx_buf.numel():
            raise C.value_error("kv_indices buffer", f"room for {nnz} entries (CUDA-graph capacity)", idx_buf.numel())
        stage = self._graph_stage_buffer(size)
        # the slot views of this stage, kept while it is the same tensor (a view of a CUDA tensor costs ~4 us
        # of host time on the GPU machine)
        cached = self.__dict__.get("_stage_slot_views")
        if cached is None or cached[0] is not stage or cached[1] != cap:
            cached = self._stage_slot_views = (stage, cap, {name: stage[off : off + n] for name, off, n in slots})
        slot_views = cached[2]
        views = {}
        packed = np.zeros(size, dtype=np.int32) if np is not None else torch.zeros(size, dtype=torch.int32)
        for name, off, _n in slots:
            if name in host:
                values = host[name]
                packed[off : off + len(values)] = values if np is not None else values.to(torch.int32)
                views[name] = slot_views[name]
        src = torch.from_numpy(packed) if np is not None else packed
        stage.copy_(src, non_blocking=True)
        dst, srcs = [], []
        for name, view in views.items():
            buf = buffers.get(name)
            if buf is None or buf is own_qo or name == "kv_lens":
                continue
            dst.append(buf if buf.numel() == view.numel() and buf.dim() == 1 else buf[: view.numel()])
            srcs.append(view)
        if len(dst) > 1:  # the caller's buffers refilled by one foreach kernel instead of one memcpy each
            torch._foreach_copy_(dst, srcs, non_blocking=True)
        elif dst:
            dst[0].copy_(srcs[0], non_blocking=True)
        if kv_indices is not None:
            if idx_buf is None:
                views["kv_indices"] = (
                    kv_indices[:nnz].to(self.device, non_blocking=True)
                    if kv_indices.device != self.device
                    else kv_indices[:nnz]
                )
            else:
                if nnz and kv_indices.data_ptr() != idx_buf.data_ptr():
                    idx_buf[:nnz].copy_(kv_indices[:nnz], non_blocking=True)
                views["kv_indices"] = idx_buf
        return views

    # ------------------------------------------------------------------ plan
    def _resolve_options(
        self,
        has_mask: bool,
        *,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        causal=False,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type=None,
        kv_data_type=None,
        o_data_type=None,
        use_tensor_cores=False,
        disable_split_kv=False,
        fixed_split_size=None,
    ):
        """``(AttentionOptions, ALiBi slopes or None, implementation)`` of plan()'s options: checked once per
        argument set. Engines plan with the same options every step: the checked options (the same object),
        the slopes and the implementation are reused when the arguments equal the previous plan()'s."""
        values = (
            num_qo_heads, num_kv_heads, head_dim, page_size, causal, has_mask, pos_encoding_mode, window_left,
            logits_soft_cap, sm_scale, rope_scale, rope_theta, q_data_type, kv_data_type, o_data_type,
            use_tensor_cores, disable_split_kv, fixed_split_size,
        )  # fmt: skip
        memo_key = (values, tuple(map(type, values)))  # the types too: 4.0 == 4, but only the int passes the checks
        memo = getattr(self, "_opts_memo", None)
        try:
            reuse = memo is not None and memo[0] == memo_key
        except Exception:  # an argument that does not compare plainly (e.g. a tensor): no reuse
            reuse, memo_key = False, None
        if reuse:
            return memo[1], memo[2], memo[3]
        C.check_heads(num_qo_heads, num_kv_heads)
        C.check_head_dim(head_dim)
        C.check_pos_encoding_mode(pos_encoding_mode)
        window_left = C.check_window_left(window_left)
        soft_cap = C.check_soft_cap(logits_soft_cap)
        scale = C.resolve_sm_scale(sm_scale, head_dim)
        rs, rt = C.resolve_rope(rope_scale, rope_theta)
        q_dtype = C.check_q_dtype("q_data_type", C.parse_dtype("q_data_type", q_data_type, torch.float16))
        kv_dtype = C.check_kv_dtype("kv_data_type", C.parse_dtype("kv_data_type", kv_data_type, q_dtype), q_dtype)
        o_dtype = C.check_q_dtype("o_data_type", C.parse_dtype("o_data_type", o_data_type, q_dtype))
        if fixed_split_size is not None and (not isinstance(fixed_split_size, int) or fixed_split_size < -1):
            raise C.value_error("fixed_split_size", "None, -1 or a positive int", repr(fixed_split_size))
        if fixed_split_size is not None and fixed_split_size <= 0:
            fixed_split_size = None
        slopes = None
        if pos_encoding_mode == "ALIBI":
            slopes = alibi_slopes(num_qo_heads).to(self.device)
        opts = AttentionOptions(
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            paged=self._paged,
            causal=bool(causal) and not has_mask,
            window_left=window_left,
            logits_soft_cap=soft_cap,
            sm_scale=scale,
            pos_encoding_mode=pos_encoding_mode,
            rope_scale=rs,
            rope_theta=rt,
            has_custom_mask=has_mask,
            is_decode=self._is_decode,
            q_dtype=q_dtype,
            kv_dtype=kv_dtype,
            o_dtype=o_dtype,
            use_tensor_cores=bool(use_tensor_cores),
            disable_split_kv=bool(disable_split_kv),
            fixed_split_size=fixed_split_size,
        )
        impl = select_impl(opts, self.device)
        self._opts_memo = (memo_key, opts, slopes, impl) if memo_key is not None else None
        return opts, slopes, impl

    def _plan_common(
        self,
        *,
        qo_indptr_host: torch.Tensor,
        kv_indptr_host: torch.Tensor,
        kv_indices,
        kv_lens_host: torch.Tensor,
        max_page_index: int,
        last_page_len_host=None,
        graph_buffers=None,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size: int,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type=None,
        kv_data_type=None,
        o_data_type=None,
        non_blocking=True,
        use_tensor_cores=False,
        disable_split_kv=False,
        fixed_split_size=None,
    ):
        _errors.raise_pending()  # a device-side index error of an earlier kernel surfaces here
        has_mask = custom_mask is not None or packed_custom_mask is not None
        opts, slopes, impl = self._resolve_options(
            has_mask,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            o_data_type=o_data_type,
            use_tensor_cores=use_tensor_cores,
            disable_split_kv=disable_split_kv,
            fixed_split_size=fixed_split_size,
        )
        # The host arrays come as int64 numpy arrays (the page-table readers' own) or CPU tensors: numpy views
        # for the host math and the staging, tensors (views of the same memory) for the batch.
        if np is not None:
            qo_np, kv_ip_np, kv_lens_np = _as_numpy(qo_indptr_host), _as_numpy(kv_indptr_host), _as_numpy(kv_lens_host)
            qo_indptr_host, kv_indptr_host, kv_lens_host = (
                _as_tensor(qo_np),
                _as_tensor(kv_ip_np),
                _as_tensor(kv_lens_np),
            )
            if last_page_len_host is not None:
                last_page_len_host = _as_numpy(last_page_len_host)
        else:
            qo_np, kv_ip_np, kv_lens_np = qo_indptr_host, kv_indptr_host, kv_lens_host
        batch_size = kv_lens_host.numel()
        qo_lens = qo_indptr_host[1:] - qo_indptr_host[:-1] if has_mask else None

        mask_packed = mask_indptr_host = None
        if has_mask:
            packed, mask_indptr_host = _pack_custom_mask(custom_mask, packed_custom_mask, qo_lens, kv_lens_host)
            mask_buf = (graph_buffers or {}).get("mask")
            if mask_buf is not None:
                if packed.numel() > mask_buf.numel():
                    raise C.value_error("custom_mask_buf", f"room for {packed.numel()} bytes", f"{mask_buf.numel()}")
                mask_packed = mask_buf[: packed.numel()]
                mask_packed.copy_(packed, non_blocking=True)
            else:
                mask_packed = packed.to(self.device, non_blocking=True)
        # An implementation that takes the batch's arrays into its own host-to-device copy (STAGES_BATCH) gets
        # them staged, not copied: plan() then makes one copy in all. (A custom mask's plan reads the batch on
        # the device before its own copy.)
        stage = dev = None
        if (
            not has_mask
            and not self._use_cuda_graph
            and np is not None
            and getattr(impl, "STAGES_BATCH", False)
            and len(qo_np) == batch_size + 1
            and len(kv_ip_np) == batch_size + 1
        ):
            # An eager plan (what engines make each step): the batch's arrays staged as they are (no padding: the
            # capacity is the batch), the host page indices among them, device ones left where they are.
            host = {"qo_indptr": qo_np, "kv_indptr": kv_ip_np, "kv_lens": kv_lens_np}
            idx = None
            if kv_indices is not None:
                nnz = int(kv_ip_np[-1])
                if kv_indices.device != self.device:
                    host["kv_indices"] = _as_numpy(kv_indices)[:nnz]
                else:
                    idx = (kv_indices, nnz)
            stage = BatchStage(self.device, host, idx)
        elif not has_mask and getattr(impl, "STAGES_BATCH", False):
            stage = self._device_batch_arrays(
                qo_indptr_host=qo_np,
                kv_indptr_host=kv_ip_np,
                kv_indices=kv_indices,
                kv_lens_host=kv_lens_np,
                last_page_len_host=last_page_len_host,
                mask_indptr_host=None,
                graph_buffers=graph_buffers,
                defer=True,
            )
            if type(stage) is not BatchStage:  # (CUDA-graph mode: the caller's buffers, refilled, once)
                dev, stage = stage, None
        if stage is None and dev is None:
            dev = self._device_batch_arrays(
                qo_indptr_host=qo_np,
                kv_indptr_host=kv_ip_np,
                kv_indices=kv_indices,
                kv_lens_host=kv_lens_np,
                last_page_len_host=last_page_len_host,
                mask_indptr_host=mask_indptr_host,
                graph_buffers=graph_buffers,
            )

        def head(x, n):  # (no slice when it is already that long: a CUDA-tensor view costs ~4 us of host time)
            return x if x is None or x.shape[0] == n else x[:n]

        if stage is not None:  # (the device arrays are set by the plan's copy: BatchStage.finish)
            batch = AttentionBatch(
                batch_size, None, None, None, None, qo_indptr_host, kv_lens_host, kv_indptr_host, None, None, slopes
            )
        else:
            batch = AttentionBatch(
                batch_size=batch_size,
                qo_indptr=head(dev["qo_indptr"], batch_size + 1),
                kv_indptr=head(dev["kv_indptr"], batch_size + 1),
                kv_indices=dev.get("kv_indices"),
                kv_lens=head(dev["kv_lens"], batch_size),
                qo_indptr_host=qo_indptr_host,
                kv_lens_host=kv_lens_host,
                kv_indptr_host=kv_indptr_host,
                mask_packed=mask_packed,
                mask_indptr=head(dev["mask_indptr"], batch_size + 1) if has_mask else None,
                alibi_slopes=slopes,
            )
        if mask_indptr_host is not None:
            batch.extra["mask_indptr_host"] = mask_indptr_host
        if stage is not None:
            stage.batch = batch
            batch.extra["stage"] = stage
        plan_obj = impl.plan(opts, batch, self._workspace())
        if stage is not None and not stage.done:  # (a plan that made no copy of its own)
            batch.extra.pop("stage", None)
            stage.finish_alone()
        total_q = int(qo_np[-1])
        planned = Plan(opts, batch, impl, plan_obj, total_q, max_page_index)
        planned.inherit_binding(self._planned)
        self._planned = planned

    # ------------------------------------------------------------------ run
    def _run_common(
        self,
        q,
        k4,
        v4,
        *,
        q_scale=None,
        k_scale=None,
        v_scale=None,
        out=None,
        lse=None,
        return_lse=False,
        sinks=None,
        lse_base="log2",
        lse_layout="NH",
        kv_src=None,
    ):
        """Checks every argument against the plan and launches. ``kv_src``: the cache as the caller passed it
        (a 5-D tensor or a ``(k, v)`` tuple); given, a run whose launch can be bound leaves a
        :class:`RunBinding` in the plan, which later calls with tensors of the same form take directly."""
        lse_ln = check_lse_base(lse_base)
        lse_given = lse is not None
        C.check_choice("lse_layout", lse_layout, ("NH", "HN"))
        p = self._require_plan()
        opts: AttentionOptions = p.opts
        total_q = p.total_q
        C.check_tensor("q", q, device=self.device)
        expected_q = (total_q, opts.num_qo_heads, opts.head_dim)
        if tuple(q.shape) != expected_q:
            what = (
                "[batch_size, num_qo_heads, head_dim]" if self._is_decode else "[qo_indptr[-1], num_qo_heads, head_dim]"
            )
            C.check_shape("q", q, expected_q, what)
        if q.dtype != opts.q_dtype:
            raise C.type_error("q", f"dtype {opts.q_dtype} as planned (q_data_type)", f"{q.dtype}")
        C.check_last_dim_contiguous("q", q)
        if k4.device != self.device:
            raise C.value_error("paged_kv_cache" if self._paged else "k", f"tensors on {self.device}", f"{k4.device}")
        kv_name = "paged_kv_cache" if self._paged else "k"
        if k4.dtype != opts.kv_dtype:
            raise C.type_error(kv_name, f"dtype {opts.kv_dtype} as planned (kv_data_type)", f"{k4.dtype}")
        if k4.shape[2] != opts.num_kv_heads or k4.shape[3] != opts.head_dim:
            raise C.value_error(
                kv_name,
                f"num_kv_heads = {opts.num_kv_heads} and head_dim = {opts.head_dim} as planned",
                f"num_kv_heads = {k4.shape[2]}, head_dim = {k4.shape[3]}",
            )
        if self._paged:
            if k4.shape[1] != opts.page_size:
                raise C.value_error(kv_name, f"page_size = {opts.page_size} as planned", f"{k4.shape[1]}")
            check_page_range(p.max_page_index, k4.shape[0])
        elif k4.shape[0] < int(p.batch.kv_indptr_host[-1]):
            raise C.value_error(
                "k", f"at least kv_indptr[-1] = {int(p.batch.kv_indptr_host[-1])} rows", f"{k4.shape[0]}"
            )
        qk_mult = C.resolve_scale("q_scale", q_scale) * C.resolve_scale("k_scale", k_scale)
        vs = C.resolve_scale("v_scale", v_scale)
        if out is None:
            out = torch.empty(q.shape, dtype=opts.o_dtype, device=q.device)
        else:
            C.check_tensor("out", out, device=self.device)
            C.check_shape("out", out, q.shape)
            if out.dtype != opts.o_dtype:
                raise C.type_error("out", f"dtype {opts.o_dtype}", f"{out.dtype}")
            C.check_last_dim_contiguous("out", out)
        if sinks is not None:
            C.check_tensor("sinks", sinks, dim=1, device=self.device)
            if not sinks.is_floating_point() or sinks.shape[0] != opts.num_qo_heads:
                raise C.value_error(
                    "sinks", f"a float tensor of shape [num_qo_heads] = [{opts.num_qo_heads}]", C.shape_str(sinks.shape)
                )
        lse_out = None  # the caller's [heads, rows] buffer (lse_layout "HN"), filled from the kernel's [rows, heads]
        if lse is not None:
            C.check_tensor("lse", lse, device=self.device, dtypes=(torch.float32,))
            if lse_layout == "HN" and return_lse:
                C.check_shape("lse", lse, (q.shape[1], q.shape[0]), "[num_qo_heads, rows] (lse_layout='HN')")
                lse_out, lse = lse, None
            else:
                C.check_shape("lse", lse, q.shape[:2])
        if (return_lse or sinks is not None) and lse is None:
            lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
        if (
            kv_src is None
            or p.bind_tried  # one binding per plan: the form of its first run (other forms keep this path)
            or lse_given
            or (type(kv_src) is not _T and type(kv_src) is not tuple)
            or not getattr(p.impl, "RUN_BINDS", False)
            or sinks is not None
            or lse_out is not None
            or lse_ln
            or not _plain_scales(q_scale, k_scale, v_scale)
            # (inside a CUDA-graph capture the page range goes unchecked: a binding would skip it later too)
            or (q.is_cuda and torch.cuda.is_current_stream_capturing())
        ):
            p.impl.run(p.plan, opts, p.batch, q, k4, v4, out, lse, qk_scale_mult=qk_mult, v_scale=vs)
        else:
            bound = []
            p.impl.run(p.plan, opts, p.batch, q, k4, v4, out, lse, qk_scale_mult=qk_mult, v_scale=vs, bind=bound)
            p.attach_binding(RunBinding.of(bound, q, kv_src, k4, v4, out, lse, lse_given, (q_scale, k_scale, v_scale)))
        if sinks is not None:
            apply_sinks(out, lse, sinks)
        if not return_lse:
            return out
        return out, finish_lse(lse, lse_ln, lse_layout, lse_out)


_T = torch.Tensor
_PLAIN_SCALE = (type(None), float, int)


def _plain_scales(*scales) -> bool:
    return all(type(x) in _PLAIN_SCALE for x in scales)


def _tkey(x: torch.Tensor) -> tuple:
    return (x.shape, x.stride(), x.dtype, x.device)


class RunBinding:
    """What a plan keeps from its first run() to launch later calls directly (one per plan, of the first run's
    form; a plan whose first run could not bind keeps None there): the key of the call's tensors
    (shape, strides, dtype, device of q, the cache and out, compared as tuples), the scales, and the kernel
    launch bound to everything else (``_launch.BoundLaunch``; the leading arguments, q, k, v, out and lse
    pointers, are the call's).

    A call whose tensors match the key needs none of the general path's checks: they depend only on what
    the key holds and on the plan, and passed for this key at the run that built the binding (the page range
    included: the cache's page count is in its shape). Anything else returns None and the caller takes the
    general path. A plan rewritten in place drops its binding; a new plan of the same launch takes it over
    (``Plan.inherit_binding``, which checks its page range against ``kv_rows``)."""

    __slots__ = ("launch", "qkey", "ckey", "pair", "k_off", "v_off", "okey", "alloc_out", "o_dtype", "lse_shape",
                 "no_lse_ptr", "scales", "scale_types", "out_thrice", "then", "kv_rows", "out_like",
                 "lse_like")  # fmt: skip

    @classmethod
    def of(cls, bound, q, kv_src, k4, v4, out, lse, lse_given, scales):
        """``bound``: what the implementation's run(bind=...) left, ``[(BoundLaunch, leading arguments)]``, in
        launch order; the first launch's leading arguments are (q, k, v, out, lse or a stand-in) or (q, k, v,
        out, lse or out, out, out), a later launch's (a split plan's merge) some of those five tensors."""
        if not bound or lse_given or type(q) is not _T or type(out) is not _T:
            return None
        launch, lead = bound[0]
        if len(lead) < 5 or not all(a is b for a, b in zip(lead[:4], (q, k4, v4, out))):
            return None
        b = cls()
        b.launch = launch
        then = []
        for later, args in bound[1:]:
            picks = []
            for x in args:
                j = next((i for i in range(5) if lead[i] is x), None)
                if j is None:
                    return None
                picks.append(j)
            then.append((later, tuple(picks)))
        b.then = tuple(then)
        if len(lead) == 7 and lead[5] is out and lead[6] is out:
            b.out_thrice = True
        elif len(lead) == 5:
            b.out_thrice = False
        else:
            return None
        b.qkey, b.okey, b.o_dtype = _tkey(q), _tkey(out), out.dtype
        b.alloc_out = out.shape == q.shape and out.is_contiguous()
        # outputs allocated by a later call: empty_like of templates of their form (_output_like), on q's device
        b.out_like = _output_like(q.shape, out.dtype, q.device) if b.alloc_out else None
        b.lse_like = None if lse is None else _output_like(lse.shape, torch.float32, q.device)
        if type(kv_src) is _T:
            b.pair, b.ckey = False, _tkey(kv_src)
            base = kv_src.data_ptr()
            b.k_off, b.v_off = k4.data_ptr() - base, v4.data_ptr() - base
        elif type(kv_src) is tuple and len(kv_src) == 2 and type(kv_src[0]) is _T and type(kv_src[1]) is _T:
            b.pair, b.ckey = True, _tkey(kv_src[0]) + _tkey(kv_src[1])
            b.k_off = b.v_off = 0
        else:
            return None
        b.lse_shape = None if lse is None else lse.shape
        b.kv_rows = k4.shape[0]  # pages (paged) or key rows (ragged) of the bound cache form: Plan.inherit_binding
        # without lse the kernel gets a stand-in pointer: a fixed tensor's (bound here) or out's (0 here)
        b.no_lse_ptr = 0 if lse is not None or lead[4] is out else lead[4].data_ptr()
        b.scales, b.scale_types = scales, tuple(map(type, scales))
        return b

    def __call__(self, q, kv, out, return_lse: bool, scales):
        """out (or ``(out, lse)``) after launching, or None where the call does not match the key."""
        if type(q) is not _T or _tkey(q) != self.qkey or (self.lse_shape is not None) != return_lse:
            return None
        # types first: comparing a tensor scale by value would raise (or sync) before the general path names it
        if tuple(map(type, scales)) != self.scale_types or scales != self.scales:
            return None
        if type(kv) is _T:
            if self.pair or _tkey(kv) != self.ckey:
                return None
            base = kv.data_ptr()
            kp, vp = base + self.k_off, base + self.v_off
        elif self.pair and type(kv) is tuple and len(kv) == 2:
            k, v = kv
            if type(k) is not _T or type(v) is not _T or _tkey(k) + _tkey(v) != self.ckey:
                return None
            kp, vp = k.data_ptr(), v.data_ptr()
        else:
            return None
        if out is None:
            if self.out_like is None:
                return None
            out = _empty_like(self.out_like, memory_format=_CONTIGUOUS)  # (q's form: the key's, so the template's)
        elif type(out) is not _T or _tkey(out) != self.okey:
            return None
        lse = None
        if self.lse_like is not None:
            lse = _empty_like(self.lse_like, memory_format=_CONTIGUOUS)
            lp = lse.data_ptr()
        qp, op = q.data_ptr(), out.data_ptr()
        if lse is None:
            lp = self.no_lse_ptr or op
        if (qp | kp | vp | op | lp) & 15 or hooks_set():
            return None
        if not (self.launch(qp, kp, vp, op, lp, op, op) if self.out_thrice else self.launch(qp, kp, vp, op, lp)):
            return None
        if self.then:
            ptrs = (qp, kp, vp, op, lp)
            for later, picks in self.then:
                later(*[ptrs[j] for j in picks])  # (same device: the first launch checked it)
        return out if lse is None else (out, lse)


LN2 = 0.6931471805599453
LOG2E = 1.4426950408889634


def check_lse_base(lse_base) -> bool:
    """True for a natural-log LSE (``"ln"``, ``"e"``), False for base 2 (``"log2"``, ``2``, FlashInfer's default)."""
    if lse_base in ("log2", "2", 2):
        return False
    if lse_base in ("ln", "e"):
        return True
    raise C.value_error("lse_base", "'log2' (base 2, the default) or 'ln' (natural log)", repr(lse_base))


def apply_sinks(out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> None:
    """Add each head's sink logit ``sinks[h]`` (natural-log units, like the scaled scores) to the softmax
    denominator of every row, in place: ``o *= 2**lse / (2**lse + e**sink)``, and ``lse`` (base 2) then counts
    the sink too, as FlashInfer's sink variant does. No host sync."""
    sink2 = sinks.to(torch.float32) * LOG2E  # [Hq]
    total = torch.logaddexp2(lse, sink2[None, :])
    factor = torch.exp2(lse - total)
    factor = torch.where(torch.isfinite(total), factor, torch.zeros_like(factor))
    out.copy_((out.float() * factor[..., None]).to(out.dtype))
    lse.copy_(total)


def finish_lse(lse: torch.Tensor, lse_ln: bool, lse_layout: str = "NH", lse_out=None) -> torch.Tensor:
    """The kernels' base-2 ``[rows, heads]`` LSE in the base and layout the caller asked for."""
    if lse_layout == "NH":
        return lse.mul_(LN2) if lse_ln else lse
    src = lse.t()
    if lse_out is None:
        lse_out = torch.empty(src.shape, dtype=lse.dtype, device=lse.device)
    if lse_ln:
        torch.mul(src, LN2, out=lse_out)
    else:
        lse_out.copy_(src)
    return lse_out


def _pack(host_arrays: dict, out=None):
    """(one int32 numpy array holding the arrays, ``split_with_sizes`` sizes that cut it back: each array, then
    the gap after it). Each array starts on a 16-byte boundary: the kernels' pointer arguments then keep one
    alignment (Triton compiles a variant per pointer alignment) whatever the batch size. ``out``: the int32 array
    to pack into (of the packed size), else a new one."""
    arrs = [_as_numpy(x) for x in host_arrays.values()]
    sizes = []
    for a in arrs:
        sizes += (a.size, _align4(a.size) - a.size)
    packed = np.empty(sum(sizes), dtype=np.int32) if out is None else out
    o = 0
    for a, n in zip(arrs, sizes[1::2]):
        packed[o : o + a.size] = a
        o += a.size + n
    return packed, sizes


class BatchStage:
    """A batch's index arrays staged on the host for the plan's own host-to-device copy (one copy per plan()).

    The implementation's plan() pops it from ``batch.extra["stage"]``, packs the arrays (:meth:`pack_into`: int32,
    ``size`` entries, a multiple of 4: what follows stays 16-byte aligned) in front of its own arrays, copies
    once, cuts the device copy with ``sizes`` + its own sizes in one ``split_with_sizes`` and hands the first
    ``len(sizes)`` pieces to :meth:`finish`, which sets the batch's device tensors."""

    __slots__ = ("device", "names", "arrays", "size", "sizes", "indices", "batch", "done")

    def __init__(self, device: torch.device, host_arrays: dict, indices):
        self.device = device
        self.names = list(host_arrays)  # (qo_indptr, kv_indptr, kv_lens first: finish() takes them by position)
        self.arrays = host_arrays  # the host arrays by name (int64 numpy), which the plan's host math may read
        sizes = []
        for x in host_arrays.values():
            n = len(x)
            sizes += (n, ((n + 3) & ~3) - n)  # (_align4 inline)
        self.sizes = sizes
        self.size = sum(sizes)
        self.indices = indices  # (device page indices, nnz): not copied
        self.batch = None
        self.done = False

    def pack_into(self, out):
        """The arrays packed into int32 numpy array ``out`` (``size`` entries), returned (at the offsets ``sizes``
        gives, which the constructor worked out: no second pass over the arrays)."""
        o = 0
        for a, n, gap in zip(self.arrays.values(), self.sizes[0::2], self.sizes[1::2]):
            out[o : o + n] = a
            o += n + gap
        return out

    def finish(self, parts) -> None:
        names = self.names
        b = self.batch
        n = b.batch_size
        # (the pieces alternate array, gap; qo_indptr, kv_indptr and kv_lens lead, in _device_batch_arrays' order)
        b.qo_indptr, b.kv_indptr, b.kv_lens = parts[0], parts[2], parts[4]
        if b.qo_indptr.shape[0] != n + 1:
            b.qo_indptr, b.kv_indptr, b.kv_lens = b.qo_indptr[: n + 1], b.kv_indptr[: n + 1], b.kv_lens[:n]
        if "kv_indices" in names:
            b.kv_indices = parts[2 * names.index("kv_indices")]
        elif self.indices is not None:
            idx, nnz = self.indices
            b.kv_indices = idx if idx.shape[0] == nnz else idx[:nnz]
        self.done = True

    def finish_alone(self) -> None:
        """The copy of the staged arrays by themselves (a plan that made none)."""
        flat = torch.from_numpy(self.pack_into(np.empty(self.size, dtype=np.int32)))
        if self.device.type != "cpu":
            flat = flat.to(self.device, non_blocking=True)
        self.finish(flat.split_with_sizes(self.sizes))


def _align4(n: int) -> int:
    """``n`` int32 entries rounded up to a 16-byte multiple."""
    return (n + 3) & ~3


def _as_numpy(x):
    """A 1-D numpy view (or copy) of a host tensor or array."""
    t = type(x)
    if t is np.ndarray and x.ndim == 1:
        return x
    if t is torch.Tensor and x.dim() == 1 and not x.requires_grad:
        return x.numpy()
    if isinstance(x, torch.Tensor):
        return x.detach().reshape(-1).numpy()
    return np.asarray(x).reshape(-1)


def _as_tensor(x):
    """A CPU tensor sharing the memory of numpy array ``x`` (a tensor passes through)."""
    return torch.from_numpy(x) if type(x) is np.ndarray else x


def _host_array(x: torch.Tensor):
    """An int64 host copy: a numpy array when numpy is there, else a CPU tensor (same operators)."""
    x = x.detach().cpu()
    return x.to(torch.int64) if np is None else x.numpy().astype(np.int64)


class RangeScratch:
    """Buffers a wrapper reuses for :class:`PendingPageRange` at every plan(): a device ``[2]``, a pinned
    host ``[2]`` and an event (allocating them per plan() cost ~40 us of host time on the H100 machine).
    A new plan() of the same wrapper overwrites them; the plan it replaces is gone by then."""

    __slots__ = ("_bufs", "_outs", "_read", "_ranges")

    def __init__(self):
        self._bufs = self._outs = self._read = None
        self._ranges = None  # the page-range kernel's state (:class:`DeviceRange`), made at the first use

    def read(self, x: torch.Tensor):
        """A numpy view of device tensor ``x`` read back (one device-to-host copy that waits for it) into a
        pinned host buffer reused by the next read (CPU tensors: their own numpy view). Use the result before
        the next read of this scratch."""
        if x.device.type != "cuda":
            return x.cpu().numpy()
        n = x.numel()
        buf = self._read
        if buf is None or buf.dtype != x.dtype or buf.numel() < n:
            buf = self._read = torch.empty(max(n, 1024), dtype=x.dtype, pin_memory=True)
        dst = buf[:n]
        dst.copy_(x)  # blocking: returns once the bytes are on the host
        return dst.numpy()

    def buffers(self, device: torch.device):
        if self._bufs is None or self._bufs[0].device != device:
            dev = torch.empty(2, dtype=torch.int32, device=device)
            self._bufs = (dev, torch.empty(2, dtype=torch.int32, pin_memory=True), torch.cuda.Event())
            self._outs = (dev[0], dev[1])  # aminmax's out= views, made once (a view costs ~4 us on CUDA)
        return self._bufs

    def minmax_out(self, device: torch.device):
        """``(min, max)`` 0-d views of the device buffer, for ``torch.aminmax(..., out=)``."""
        self.buffers(device)
        return self._outs

    def device_range(self, device: torch.device) -> DeviceRange | None:
        """The one-launch page-range reduction of this wrapper on ``device`` (None where it does not apply: the
        short launch path off or a launch hook set, which then see torch's reduction, copy and event). A CUDA
        device without an index is the current one: ``cuda`` and ``cuda:<current>`` share one state, and with it
        the sequence numbers and the bound launch (torch.device compares them unequal)."""
        if device.index is None and device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        r = self._ranges
        if r is None or r.device != device:
            if not DeviceRange.usable(device):
                return None
            r = self._ranges = DeviceRange(device)
        return r


class DeviceRange:
    """The page range of device page indices reduced by one launch (``kernels/page_range.py``) straight into a
    pinned host buffer, tagged with a sequence number per plan: no torch reduction, device-to-host copy, stream
    query or event per plan() (each a torch or CUDA runtime call of ~5-15 us of host time on the H100 machine,
    against ~10 for a bound launch). A wrapper keeps one (``RangeScratch.device_range``): a plan's range is valid
    until the wrapper's next plan() queues another, as with the scratch buffers it replaces. The launch is bound
    at the first plan (every argument but the indices, their count and the sequence number is fixed)."""

    __slots__ = ("device", "acc", "out", "words", "seq", "bound")

    BLOCK, ITERS = 1024, 8  # entries per program: BLOCK * ITERS

    def __init__(self, device: torch.device):
        self.device = device
        acc = _errors.lasting_zeros(4, torch.int32, device)
        # the accumulator's identity (each launch's last program resets it), in one blocking copy at the first plan
        acc.copy_(torch.tensor([2**31 - 1, -(2**31), 0, 0], dtype=torch.int32))
        self.acc = acc
        self.out = torch.zeros(2, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.words = self.out.numpy()  # (the host's view: numpy reads the memory the device writes)
        self.seq = 0
        self.bound = None  # the bound launch after the first launch (False: it could not bind)

    @staticmethod
    def usable(device: torch.device) -> bool:
        from . import _config

        if device.type != "cuda":  # (the interpreter's tests; nothing else reduces host tensors on a "device")
            return _INTERPRET_RANGES
        return _config.HOST_PATH.fast_launch and not hooks_set()

    def launch(self, indices: torch.Tensor) -> tuple:
        """Queue the reduction of ``indices`` (int32, non-empty, unit stride) on the current stream: the part a
        :class:`PendingPageRange` holds, ``(self, seq)``."""
        from ._launch import bind

        self.seq = seq = (self.seq + 1) & 0x7FFFFFFF
        n = indices.shape[0]
        g0 = -(-n // (self.BLOCK * self.ITERS))
        ptr = indices.data_ptr()
        b = self.bound
        if b and not ptr & 15 and b.over(g0, ptr, n, seq):
            return (self, seq)
        args = [indices, n, seq, self.acc, self.out, self.BLOCK, self.ITERS]
        dev = self.device
        if dev.type == "cuda" and torch.cuda.current_device() != dev.index:
            with torch.cuda.device(dev):
                kernel = _RANGE_KERNEL.run(*args, grid=(g0,), warmup=False)
        else:
            kernel = _RANGE_KERNEL.run(*args, grid=(g0,), warmup=False)
        if b is None and not ptr & 15 and dev.type == "cuda":
            self.bound = bind(_RANGE_KERNEL, kernel, args, (g0,), 3) or False
        return (self, seq)

    def read(self, seq: int):
        """``(lo, hi)`` of the launch tagged ``seq``, waiting for it when it has not landed yet; None when a later
        launch has overwritten it (a plan read after its wrapper planned again)."""
        w = self.words
        for attempt in range(3):
            a, b = int(w[0]), int(w[1])
            if a >> 32 == seq and b >> 32 == seq:
                return _low_int32(a), _low_int32(b)
            if attempt == 0 and self.device.type == "cuda":
                torch.cuda.current_stream(self.device).synchronize()
            elif attempt == 1 and self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # (another stream made the plan)
        return None


def _low_int32(word: int) -> int:
    return ((word & 0xFFFFFFFF) ^ 0x80000000) - 0x80000000


_INTERPRET_RANGES = False  # tests: the kernel on CPU tensors under TRITON_INTERPRET=1


def _range_kernel():
    from ._launch import FastKernel
    from .kernels.page_range import _page_range_kernel

    return FastKernel(_page_range_kernel)


class _LazyKernel:
    """The FastKernel of the page-range kernel, made at its first launch (importing Triton kernels at import
    time costs every process that never plans over device indices)."""

    __slots__ = ("k",)

    def __init__(self):
        self.k = None

    def __getattr__(self, name):
        if self.k is None:
            object.__setattr__(self, "k", _range_kernel())
        return getattr(self.k, name)


_RANGE_KERNEL = _LazyKernel()


class PendingPageRange:
    """The smallest and largest page index of device-resident page tables, read back without a host sync.

    ``of_device`` queues a min/max reduction and an asynchronous copy into pinned memory at plan(), so
    plan() never waits for the device; :meth:`value` reads it at the first run(). Several ranges combine
    (cascade levels).
    """

    __slots__ = ("_parts", "_value", "name")

    def __init__(self, parts: list, name: str = "paged_kv_indices"):
        self._parts = parts  # ints (max of host-checked indices, min known >= 0) or (pinned [2], event)
        self._value = None
        self.name = name

    @classmethod
    def of_device(cls, indices: torch.Tensor, name: str, scratch: RangeScratch | None = None) -> PendingPageRange:
        if scratch is not None and indices.dtype is torch.int32 and indices.is_contiguous():
            r = scratch.device_range(indices.device)
            if r is not None:  # one launch into pinned memory, no event (DeviceRange)
                return cls([r.launch(indices)], name)
        scratch = scratch if scratch is not None else RangeScratch()
        dev, host, event = scratch.buffers(indices.device)
        torch.aminmax(indices, out=scratch.minmax_out(indices.device))  # one kernel into a reused [2] buffer
        host.copy_(dev, non_blocking=True)
        event.record(torch.cuda.current_stream(indices.device))
        return cls([(host, event)], name)

    @staticmethod
    def combine(values: list):
        """The range over several tables: an int when all are ints, else a PendingPageRange."""
        if all(type(v) is int for v in values):
            return max(values)
        parts = []
        for v in values:
            parts.extend(v.parts() if isinstance(v, PendingPageRange) else [v])
        first = next(v for v in values if isinstance(v, PendingPageRange))
        return PendingPageRange(parts, first.name)

    def parts(self) -> list:
        return self._parts

    def unread(self) -> bool:
        """True while no eager run() has read the range (a CUDA-graph replay never does)."""
        return self._value is None

    def value(self):
        """``(min, max)``; the first call after plan() waits for the 8-byte copy plan() queued if it has not
        landed yet (it normally has: the host work between plan() and the first run() covers it). While a
        CUDA graph is being captured nothing may wait: None (unchecked)."""
        if self._value is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            lo, hi = 0, -1
            for part in self._parts:
                if type(part) is int:
                    hi = max(hi, part)
                    continue
                host, event = part
                if type(host) is DeviceRange:  # (a tagged launch: its words say whether it has landed)
                    got = host.read(event)
                    if got is None:
                        raise RuntimeError(
                            f"{self.name}: this plan's page range was overwritten by a later plan() of its wrapper"
                        )
                    lo, hi = min(lo, got[0]), max(hi, got[1])
                    continue
                if not event.query():
                    event.synchronize()
                lo, hi = min(lo, int(host[0])), max(hi, int(host[1]))
            self._value = (lo, hi)
        return self._value


class DeferredPageRange(PendingPageRange):
    """Device page indices whose range is reduced only when an eager run() asks for it.

    The CUDA-graph decode re-plan leaves it so while the wrapper's graph is being replayed (nothing reads
    the range then), which saves a min/max kernel, a copy and an event per plan(). The eager run() that
    reads it queues the reduction then and waits for its result: that run() (the first after such a plan)
    waits for the device; the plans after it reduce at plan() again (see ``_config.HostPathConfig``).
    """

    __slots__ = ("_indices", "_scratch")

    def __init__(self, indices: torch.Tensor, name: str, scratch: RangeScratch | None = None):
        super().__init__(None, name)
        self._indices, self._scratch = indices, scratch

    def parts(self) -> list:
        if self._parts is None:
            self._parts = PendingPageRange.of_device(self._indices, self.name, self._scratch)._parts
        return self._parts

    def value(self):
        if self._value is None:
            if torch.cuda.is_current_stream_capturing():
                return None
            self.parts()
        return super().value()


def check_page_range(max_index, num_pages: int, name: str = "paged_kv_indices") -> None:
    """run()'s check that every page index addresses the cache (``max_index`` int or PendingPageRange)."""
    if type(max_index) is int:
        hi, lo = max_index, 0
    else:
        got = max_index.value()
        if got is None:  # inside a CUDA-graph capture: nothing may wait there
            return
        (lo, hi), name = got, max_index.name
    if lo < 0:
        raise C.value_error(name, "non-negative page indices", f"a page index of {lo}")
    if hi >= num_pages:
        raise C.value_error(name, f"page indices < the cache's {num_pages} pages", f"a page index of {hi}")


class PageTable:
    """A CSR page table read to the host and validated (:func:`read_table`): int64 numpy ``indptr [n + 1]``,
    ``last [n]`` and ``kv_lens [n]``, ``nnz`` pages, ``max_index`` (an int, or a pending / deferred range of
    device page indices) and ``indices_host`` (the first ``nnz`` page indices as an int32 numpy view when they
    are on the host, else None).

    Read with ``lists=True``, a small host table is kept as Python ints only: ``lists`` holds ``(indptr, last,
    kv_lens)`` as lists and the three arrays are None until :meth:`with_arrays` (``lists`` is None otherwise).
    The CUDA-graph decode re-plan reads the lists: making the arrays cost more than the rest of its reading of
    a batch of 8. A larger host table read with ``lists=True`` has ``indptr`` and ``last`` as int32 views of the
    caller's tensors (``kv_lens`` int32 or int64): :meth:`with_arrays` makes the three int64 arrays of their own.
    ``kv_lens_seq``: the key counts in the form :func:`same_lengths` compares a host ``seq_lens`` with fastest, else
    None: a list when a small table was read on Python ints (either way), the int32 array when a larger table was
    read with whole-array operations at page size 1 (compared as bytes: a fifth of the time of an int32-against-
    int64 comparison and reduction)."""

    __slots__ = ("n", "indptr", "last", "kv_lens", "nnz", "max_index", "indices_host", "lists", "kv_lens_seq")

    def with_arrays(self) -> PageTable:
        """This table with its numpy arrays (made from the lists when it has only those)."""
        if self.indptr is None:
            self.indptr, self.last, self.kv_lens = (np.array(x, dtype=np.int64) for x in self.lists)
        elif self.indptr.dtype != np.int64:
            self.indptr, self.last, self.kv_lens = (x.astype(np.int64) for x in (self.indptr, self.last, self.kv_lens))
        return self


def read_table(
    indptr,
    indices,
    last_page_len,
    page_size,
    *,
    batch_size=None,
    names=None,
    scratch=None,
    read_indices=0,
    reduce_range=False,
    defer=False,
    lists=False,
) -> PageTable:
    """Validate a CSR page table and read it to the host, in numpy: the one check of every plan() that takes a
    page table (a first plan and every re-plan), raising the error that names the argument.

    ``names`` renames the arguments in messages (``paged_kv_indptr`` vs ``indptr``); ``scratch`` (the
    wrapper's :class:`RangeScratch`) holds the buffers that device page indices are reduced and read into.
    When ``indptr`` and ``last_page_len`` are on the device they are read back in one copy (the only sync), and
    with them the page indices when they are on the device too: the indices themselves when at most
    ``read_indices`` entries, else (``reduce_range``) their min/max reduced on the device, which is the range
    when the tensor is exactly the table. Otherwise device page indices get a :class:`PendingPageRange` (read at
    the first run() without waiting at plan()), or with ``defer`` a :class:`DeferredPageRange`.

    ``lists``: the caller (the CUDA-graph decode re-plan) takes a small host table as Python lists
    (``PageTable.lists``) and a larger one as int32 views of the caller's tensors. A larger host table whose
    requests all have pages is checked with a few whole-array operations (:func:`_compact_host_table`), with
    ``lists`` or at page size 1 (without ``lists``, its int64 arrays are made of the views)."""
    n_indptr, n_indices, n_last = names or ("indptr", "indices", "last_page_len")
    C.check_positive_int("page_size", page_size)
    C.check_index_tensor(n_indptr, indptr)
    C.check_index_tensor(n_indices, indices)
    bs = indptr.shape[0] - 1 if batch_size is None else batch_size
    if indptr.shape[0] != bs + 1:
        raise C.value_error(n_indptr, f"shape [batch_size + 1] = [{bs + 1}]", C.shape_str(indptr.shape))
    C.check_index_tensor(n_last, last_page_len, length=bs, what="[batch_size]")
    n_ix = indices.shape[0]
    read = None  # "indices" / "range": what the device read holds after the lengths
    if np is not None and not indptr.is_cpu and last_page_len.device == indptr.device:
        parts = [indptr, last_page_len]
        on_dev = indices.device == indptr.device
        if on_dev and 0 < n_ix <= read_indices:
            parts.append(indices)  # in the same read: no min/max kernel, copy and event for the range
            read = "indices"
        elif on_dev and n_ix > 0 and reduce_range and scratch is not None and indices.is_cuda:
            torch.aminmax(indices, out=scratch.minmax_out(indices.device))
            parts.append(scratch.buffers(indices.device)[0])
            read = "range"
        cat = torch.cat(parts)  # one device-to-host copy instead of two or three
        got = scratch.read(cat) if scratch is not None else cat.cpu().numpy()
        both = got[: 2 * bs + 1].astype(np.int64)
        indptr_np, last_np = both[: bs + 1], both[bs + 1 :]
    elif np is not None and indptr.is_cpu and last_page_len.is_cpu:
        t = None
        if bs <= _SMALL_TABLE:
            t = _small_host_table(indptr, indices, last_page_len, page_size, bs, n_ix, lists)
        elif lists or page_size == 1:
            # (without ``lists``, at page size 1, the int64 arrays of its int32 views: fewer operations than the
            # checks below, and an int32 seq_lens is compared with its key counts as bytes)
            t = _compact_host_table(indptr, indices, last_page_len, page_size, bs, n_ix)
            if t is not None and not lists:
                t.with_arrays()
        if t is not None:
            if t.max_index is None:  # page indices on the device (an engine's CUDA-graph decode step)
                t.max_index = _device_max_index(indices, t.nnz, n_ix, n_indices, scratch, defer)
            return t
        indptr_np = indptr.numpy().astype(np.int64)
        last_np = last_page_len.numpy().astype(np.int64)
    else:
        indptr_np = _host_array(indptr)
        last_np = _host_array(last_page_len)
    if indptr_np[0] != 0:
        raise C.value_error(n_indptr, "indptr[0] == 0", f"indptr[0] == {int(indptr_np[0])}")
    num_pages = indptr_np[1:] - indptr_np[:-1]
    fewest = _MIN(num_pages) if bs and np is not None else (num_pages.min() if bs else 0)
    if fewest < 0:
        raise C.value_error(n_indptr, "a non-decreasing sequence", "a decreasing step")
    nnz = int(indptr_np[-1])
    if n_ix < nnz:
        raise C.value_error(n_indices, f"at least {n_indptr}[-1] = {nnz} entries", f"{n_ix}")
    if fewest > 0:  # every request has pages (the usual case): 1 <= last <= page_size, one reduction
        if np is not None and bs and _MAX((last_np - 1).view(np.uint64)) >= page_size:  # (last < 1 reads huge)
            _bad_last(last_np, num_pages > 0, page_size, n_last)
        # (page size 1 with every last page checked full: each request's keys are its pages)
        kv_lens = num_pages if page_size == 1 and np is not None else num_pages * page_size + (last_np - page_size)
    else:  # empty requests: 0 <= last <= page_size there, 0 keys
        has_pages = num_pages > 0
        _bad_last(last_np, has_pages, page_size, n_last)
        kv_lens = ((num_pages - 1) * page_size + last_np) * has_pages
    if np is None:
        _bad_last(last_np, num_pages > 0, page_size, n_last)
    t = PageTable()
    t.kv_lens, t.kv_lens_seq = kv_lens, None
    t.n, t.indptr, t.last, t.nnz, t.indices_host, t.lists = bs, indptr_np, last_np, nnz, None, None
    max_index = -1
    if nnz > 0:
        if read == "indices":
            max_index = _max_index(got[2 * bs + 1 : 2 * bs + 1 + nnz], n_indices)
        elif read == "range" and nnz == n_ix:
            lo, max_index = int(got[-2]), int(got[-1])
            if lo < 0:
                raise C.value_error(n_indices, "non-negative page indices", "a negative index")
        elif np is not None and indices.is_cpu:
            idx = indices.numpy()[:nnz]  # (an int tensor: never part of autograd)
            max_index = _max_index(idx, n_indices)
            t.indices_host = idx
        else:
            max_index = _device_max_index(indices, nnz, n_ix, n_indices, scratch, defer)
    t.max_index = max_index
    return t


def _device_max_index(indices, nnz: int, n_ix: int, name: str, scratch, defer: bool):
    """``read_table``'s page range of the first ``nnz`` (> 0) page indices when they are not on the host."""
    if indices.is_cuda:
        # Device-resident page indices are not read back here (that would wait for the device): their
        # extremes travel to pinned memory asynchronously and run() checks them once they have landed.
        table = indices if n_ix == nnz else indices[:nnz]  # (a slice of a CUDA tensor costs ~4 us of host)
        if defer:
            return DeferredPageRange(table, "paged_kv_indices", scratch)
        return PendingPageRange.of_device(table, "paged_kv_indices", scratch)
    return _max_index(_host_array(indices[:nnz]), name)


# Host tables of at most this many requests are validated on Python ints: a tensor's tolist() and a short loop
# cost a fraction of the dozen numpy operations on tiny arrays that the general path takes. (Other small host
# paths of the wrappers keep this bound too.)
_SMALL_TABLE = 16
_ONES: dict = {}  # bs -> the bytes of an int32 array of bs ones (every last page full at page size 1)


def _small_host_table(
    indptr, indices, last_page_len, page_size: int, bs: int, n_ix: int, lists: bool = False
) -> PageTable | None:
    """:func:`read_table` of a small table whose ``indptr`` and ``last_page_len`` are on the host, or None when
    anything in it is wrong (the general path then raises its error, so the messages are the same). The arrays
    are the general path's, value for value (with ``lists``: the lists alone, see :class:`PageTable`);
    ``max_index`` is None when there are page indices and they are not on the host (the caller reads their range
    as the general path does)."""
    ipl = indptr.tolist()
    lpl = last_page_len.tolist()
    if ipl[0] != 0:
        return None
    # Whole-list operations (a comprehension and builtins) where every request has pages and 1 <= last <=
    # page_size, the usual case: at 32 requests a third of the host time of a loop with the checks per entry.
    pages = [b - a for a, b in itertools.pairwise(ipl)]
    if bs and (min(pages) < 1 or min(lpl) < 1 or max(lpl) > page_size):
        kvl = _small_lengths(pages, lpl, page_size)  # (empty requests, or an error to report)
        if kvl is None:
            return None
    elif page_size == 1:
        kvl = pages  # (every last page holds its one token)
    else:
        kvl = [p * page_size + (last - page_size) for p, last in zip(pages, lpl)]
    nnz = ipl[-1]
    if n_ix < nnz:
        return None
    t = PageTable()
    t.n, t.nnz, t.kv_lens_seq = bs, nnz, kvl
    if lists:
        t.lists, t.indptr, t.last, t.kv_lens = (ipl, lpl, kvl), None, None, None
    else:
        t.lists = None
        t.indptr = np.array(ipl, dtype=np.int64)
        t.last = np.array(lpl, dtype=np.int64)
        t.kv_lens = np.array(kvl, dtype=np.int64)
    return _with_host_range(t, indices, nnz)


def _compact_host_table(indptr, indices, last_page_len, page_size: int, bs: int, n_ix: int) -> PageTable | None:
    """:func:`read_table` of a host table of more than ``_SMALL_TABLE`` requests that all have pages, with a few
    whole-array operations whatever the batch size (a list comprehension and the lists' conversions cost ~0.3 us a
    request on the development CPU); None for anything else (empty requests, or an error to report: the general
    path then raises it). ``indptr`` and ``last`` are int32 views of the caller's tensors (read within the plan),
    ``kv_lens`` int32 at page size 1, else int64; the values are the general path's (``read_table`` without
    ``lists`` makes the table's int64 arrays of them)."""
    ip = indptr.numpy()
    # strictly increasing from 0 (every request has pages): the int32 differences cannot wrap around then
    if ip.item(0) != 0 or not _MIN(ip[1:] > ip[:-1]):
        return None
    pages = ip[1:] - ip[:-1]
    last = last_page_len.numpy()
    if page_size == 1:
        # every last page holds its one token: the whole array compared as bytes (a reduction costs ~1 us here)
        ones = _ONES.get(bs)
        if ones is None:
            ones = _ONES[bs] = np.ones(bs, dtype=np.int32).tobytes()
        if last.tobytes() != ones:
            return None
        kv_lens = pages  # (int32: ``same_lengths`` compares an int32 seq_lens with it as bytes)
    else:
        if _MAX((last - 1).view(np.uint32)) >= page_size:  # (last < 1 reads huge)
            return None
        kv_lens = pages.astype(np.int64) * page_size + (last - page_size)
    nnz = ip.item(-1)
    if n_ix < nnz:
        return None
    t = PageTable()
    t.n, t.nnz, t.lists, t.kv_lens_seq = bs, nnz, None, kv_lens if page_size == 1 else None
    t.indptr, t.last, t.kv_lens = ip, last, kv_lens
    return _with_host_range(t, indices, nnz)


def _with_host_range(t: PageTable, indices, nnz: int) -> PageTable | None:
    """``t`` with its page range when the page indices are on the host (None for a negative index: the general
    path names it), or ``max_index`` None for the caller to read the range of indices on the device."""
    t.indices_host = None
    max_index = -1
    if nnz > 0:
        if not indices.is_cpu:
            t.max_index = None  # (read_table reads the range of indices on the device)
            return t
        idx = indices.numpy()[:nnz]
        if idx.dtype != np.int32:
            return None
        max_index = int(_MAX(idx.view(np.uint32)))  # one reduction: a negative index reads as >= 2**31
        if max_index >= 1 << 31:
            return None
        t.indices_host = idx
    t.max_index = max_index
    return t


def _small_lengths(pages: list, lpl: list, page_size: int) -> list | None:
    """The key counts of a small table with empty requests (0 <= last <= page_size there, 0 keys), entry by
    entry; None for a decreasing indptr or a last page length out of range."""
    kvl = [0] * len(pages)
    for i, (p, last) in enumerate(zip(pages, lpl)):
        if p > 0:
            if not 1 <= last <= page_size:
                return None
            kvl[i] = p * page_size + (last - page_size)
        elif p < 0 or not 0 <= last <= page_size:
            return None
    return kvl


def _bad_last(last, has_pages, page_size: int, name: str) -> None:
    """The error for a ``last_page_len`` entry out of range, naming the first (none: nothing raised)."""
    # at least 1 for requests with pages, at least 0 for empty ones (the bool compares as 1 / 0)
    bad = (last < has_pages) | (last > page_size)
    if bad.any():
        b = int((bad * 1).argmax())
        raise C.value_error(
            name, f"1 <= {name}[i] <= page_size ({page_size}) for requests with pages", f"{int(last[b])} at i = {b}"
        )


def _max_index(idx, name: str) -> int:
    """The largest of non-empty page indices ``idx`` (a named error for a negative one)."""
    if np is not None and isinstance(idx, np.ndarray) and idx.dtype == np.int32:
        hi = int(_MAX(idx.view(np.uint32)))  # one reduction: a negative index reads as >= 2**31
        if hi < 1 << 31:
            return hi
    elif int(idx.min()) >= 0:
        return int(idx.max())
    raise C.value_error(name, "non-negative page indices", "a negative index")


def read_page_table(
    indptr, indices, last_page_len, page_size, *, batch_size=None, names=None, scratch=None, read_indices=0
):
    """:func:`read_table` with host tensors: ``(indptr, kv_lens, max_page_index, last_page_len)``, int64."""
    t = read_table(
        indptr,
        indices,
        last_page_len,
        page_size,
        batch_size=batch_size,
        names=names,
        scratch=scratch,
        read_indices=read_indices,
    )
    if np is None:
        return t.indptr, t.kv_lens, t.max_index, t.last
    return torch.from_numpy(t.indptr), torch.from_numpy(t.kv_lens), t.max_index, torch.from_numpy(t.last)


def run_single(
    q3: torch.Tensor,
    k4: torch.Tensor,
    v4: torch.Tensor,
    *,
    is_decode: bool,
    custom_mask=None,
    packed_custom_mask=None,
    causal=False,
    pos_encoding_mode="NONE",
    window_left=-1,
    logits_soft_cap=None,
    sm_scale=None,
    rope_scale=None,
    rope_theta=None,
    q_scale=None,
    k_scale=None,
    v_scale=None,
    return_lse=False,
    o_dtype=None,
    lse_base="log2",
    fast_key=None,
    fast_shapes=None,
):
    """One request (``q3 [qo_len, Hq, D]``, K/V ``[kv_len, 1, Hkv, D]`` views) through the backend.

    ``fast_key``: the caller's key of this call's form (:data:`_SINGLE_FAST`), with ``fast_shapes`` the shapes of
    its public out and lse and the addresses of its public q, k and v: when the plan's launch bound for this form
    (and the views here start where the public tensors do), later calls of the key launch it directly."""
    device = q3.device
    check_lse_base(lse_base)
    C.check_q_dtype("q", q3.dtype)
    C.check_last_dim_contiguous("q", q3)
    if k4.device != device or v4.device != device:
        raise C.value_error("k", f"tensors on {device} (the device of q)", f"{k4.device} / {v4.device}")
    if k4.shape != v4.shape:
        raise C.value_error("v", f"the shape of k {C.shape_str(k4.squeeze(1).shape)}", C.shape_str(v4.squeeze(1).shape))
    if k4.dtype != v4.dtype:
        raise C.type_error("v", f"the dtype of k ({k4.dtype})", str(v4.dtype))
    C.check_kv_dtype("k", k4.dtype, q3.dtype)
    qo_len, num_qo_heads, head_dim = q3.shape
    kv_len, _, num_kv_heads, kv_head_dim = k4.shape
    if kv_head_dim != head_dim:
        raise C.value_error("k", f"head_dim {head_dim} (that of q)", kv_head_dim)
    if num_qo_heads % num_kv_heads != 0:
        raise C.value_error("q", f"num_qo_heads a multiple of num_kv_heads ({num_kv_heads})", num_qo_heads)

    # The plan of a single request depends only on its lengths and options (not on the data), so calls
    # with the same ones reuse it (a custom mask is data: those calls always plan). Plans own their device
    # arrays (no shared int workspace outside CUDA-graph mode), so a kept plan stays valid.
    key = None
    if custom_mask is None and packed_custom_mask is None:
        opts = (causal, pos_encoding_mode, window_left, logits_soft_cap, sm_scale, rope_scale, rope_theta, o_dtype)
        key = (is_decode, device, qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, q3.dtype, k4.dtype)
        key += tuple((type(a), a) for a in opts)
        try:
            hash(key)
        except TypeError:  # an option that is not a plain value (e.g. a tensor): plan every time
            key = None
    w = _SINGLE_PLANS.get(key) if key is not None else None
    if w is not None:
        _SINGLE_PLANS.move_to_end(key)
        bound = w._planned.fast_run
        if bound is not None and lse_base == "log2":  # a call of the form the plan's first run bound
            got = bound(q3, (k4, v4), None, return_lse, (q_scale, k_scale, v_scale))
            if got is not None:
                if fast_key is not None:
                    _remember_single(fast_key, fast_shapes, w, q3, k4, v4, (q_scale, k_scale, v_scale), return_lse)
                return got
        got = w._run_common(
            q3, k4, v4, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, lse_base=lse_base,
            kv_src=(k4, v4),
        )  # fmt: skip
        if fast_key is not None and lse_base == "log2":
            _remember_single(fast_key, fast_shapes, w, q3, k4, v4, (q_scale, k_scale, v_scale), return_lse)
        return got
    w = _SingleRequest(device, is_decode)
    qo_h = torch.tensor([0, qo_len], dtype=torch.int64)
    kv_h = torch.tensor([0, kv_len], dtype=torch.int64)
    w._plan_common(
        qo_indptr_host=qo_h,
        kv_indptr_host=kv_h,
        kv_indices=None,
        kv_lens_host=kv_h[1:].clone(),
        max_page_index=-1,
        num_qo_heads=num_qo_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        page_size=1,
        custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask,
        causal=causal,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_data_type=q3.dtype,
        kv_data_type=k4.dtype,
        o_data_type=o_dtype,
        non_blocking=False,
    )
    if key is not None and (device.type != "cuda" or not torch.cuda.is_current_stream_capturing()):
        _SINGLE_PLANS[key] = w
        while len(_SINGLE_PLANS) > _SINGLE_PLANS_MAX:
            _SINGLE_PLANS.popitem(last=False)
    got = w._run_common(
        q3, k4, v4, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse, lse_base=lse_base,
        kv_src=(k4, v4) if key is not None else None,
    )  # fmt: skip
    if fast_key is not None and key is not None and lse_base == "log2":
        _remember_single(fast_key, fast_shapes, w, q3, k4, v4, (q_scale, k_scale, v_scale), return_lse)
    return got


_SINGLE_PLANS: collections.OrderedDict = collections.OrderedDict()  # most recently used last
_SINGLE_PLANS_MAX = 32

# The single-request functions' calls by form: key (the public function's own: its options with their types and
# the shape, strides, dtype and device of q, k and v) -> SingleBinding. Every check of such a call depends only on
# what the key holds, and passed for it; the plan depends only on the lengths and options, which the key fixes.
_SINGLE_FAST: dict = {}
_SINGLE_FAST_MAX = 64
_PLAIN_OPTION = (str, int, float, bool, type(None), torch.dtype)


class SingleBinding:
    """A single-request call's launches bound for one call form (``_SINGLE_FAST``): the public q, k and v go
    straight to the plan's bound launch (the views ``run_single`` takes of them share their addresses), with the
    outputs allocated in their public shapes. Keeps its plan (device arrays the launch reads) alive."""

    __slots__ = ("launch", "then", "out_shape", "o_dtype", "lse_shape", "no_lse_ptr", "out_thrice", "plan", "out_like",
                 "lse_like")  # fmt: skip

    def __call__(self, q, k, v):
        """out (or ``(out, lse)``) after launching, or None where the bound launch does not apply now (launch
        hooks, an address off a 16-byte boundary, another current device): the caller takes the general path."""
        out = _empty_like(self.out_like, memory_format=_CONTIGUOUS)
        qp, kp, vp, op = q.data_ptr(), k.data_ptr(), v.data_ptr(), out.data_ptr()
        lse = None
        if self.lse_like is not None:
            lse = _empty_like(self.lse_like, memory_format=_CONTIGUOUS)
            lp = lse.data_ptr()
        else:
            lp = self.no_lse_ptr or op
        if (qp | kp | vp | op | lp) & 15 or hooks_set():
            return None
        if not (self.launch(qp, kp, vp, op, lp, op, op) if self.out_thrice else self.launch(qp, kp, vp, op, lp)):
            return None
        if self.then:
            ptrs = (qp, kp, vp, op, lp)
            for later, picks in self.then:
                later(*[ptrs[j] for j in picks])
        return out if lse is None else (out, lse)


def _remember_single(fast_key, shapes, w, q3, k4, v4, scales, return_lse: bool) -> None:
    """Keeps the launch the plan ``w`` bound as ``fast_key``'s, where it is this call's form: q3, the K/V pair and
    the scales as bound, outputs allocated by the binding (no caller buffers), the lse as asked, plain options."""
    b = w._planned.fast_run
    if b is None or not b.pair or not b.alloc_out or (b.lse_shape is not None) != return_lse:
        return
    if b.qkey != _tkey(q3) or b.ckey != _tkey(k4) + _tkey(v4):
        return
    if shapes[2] != (q3.data_ptr(), k4.data_ptr(), v4.data_ptr()):  # (the launch takes the public tensors' addresses)
        return
    if tuple(map(type, scales)) != b.scale_types or scales != b.scales:
        return
    if not all(t in _PLAIN_OPTION for t in fast_key[1]):
        return
    sb = SingleBinding()
    sb.launch, sb.then, sb.out_thrice, sb.no_lse_ptr, sb.o_dtype = (
        b.launch,
        b.then,
        b.out_thrice,
        b.no_lse_ptr,
        b.o_dtype,
    )
    sb.out_shape, sb.lse_shape = shapes[0], shapes[1] if return_lse else None
    sb.plan = w
    keep_single_form(fast_key, sb)


_empty_like = torch.empty_like
_CONTIGUOUS = torch.contiguous_format


def _output_like(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` on ``device`` that owns no memory of its own: one element of a 16-byte
    tensor kept per device for the process (:func:`_errors.lasting_zeros`), expanded. ``torch.empty_like`` of it
    with the contiguous format allocates a contiguous output of that form at two thirds of the host time of
    ``torch.empty(shape, dtype=, device=)``, which parses its three arguments at every call (H100 machine's host:
    3.7 against 5.7 us). The bound calls' outputs (:class:`SingleBinding`, :class:`RunBinding`)."""
    base = _TEMPLATE_BASES.get(device)
    if base is None:
        base = _TEMPLATE_BASES[device] = _errors.lasting_zeros(16, torch.uint8, device)
    return base[: dtype.itemsize].view(dtype).expand(shape)


_TEMPLATE_BASES: dict = {}  # device -> the 16 bytes the output templates view (_output_like)


def keep_single_form(fast_key: tuple, sb: SingleBinding) -> None:
    """Keep ``sb`` as the bound launch of the single-request call form ``fast_key`` (:func:`single_fast_key`):
    later calls of the form go straight to it. ``host_caches()["single_forms"]`` lists the forms kept. The
    outputs' templates (``out_like``, ``lse_like``) are made here from ``sb``'s shapes and dtype, on the device of
    the key's q."""
    device = fast_key[6]
    sb.out_like = _output_like(sb.out_shape, sb.o_dtype, device)
    sb.lse_like = None if sb.lse_shape is None else _output_like(sb.lse_shape, torch.float32, device)
    if len(_SINGLE_FAST) >= _SINGLE_FAST_MAX:
        _SINGLE_FAST.clear()
    _SINGLE_FAST[fast_key] = sb


def single_fast_key(tag: int, options: tuple, q, k, v):
    """The key of a single-request call (``_SINGLE_FAST``): the options' types before their values (a lookup
    compares the types first, so a value of another type, a tensor scale say, is never compared by value), then
    the forms of q, k and v (q's device at index 6: :func:`keep_single_form`)."""
    return (tag, tuple(map(type, options)), options, q.shape, q.stride(), q.dtype, q.device, k.shape, k.stride(),
            k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device)  # fmt: skip


class _SingleRequest(_AttentionWrapper):
    """A one-request batch over ragged (contiguous) K/V, planned and run once per call."""

    _paged = False

    def __init__(self, device, is_decode: bool):
        super().__init__(_single_workspace(device), "NHD", use_cuda_graph=False)
        self._is_decode = is_decode


_WORKSPACES: dict = {}


def _single_workspace(device) -> torch.Tensor:
    """A lazily allocated float workspace per device for the single-request functions (split-KV partials)."""
    key = ("float", str(device))
    if key not in _WORKSPACES:
        size = 128 * 1024 * 1024 if device.type == "cuda" else (16 * 1024 * 1024 if use_triton(device) else 0)
        _WORKSPACES[key] = torch.empty(size, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]


def _int_workspace(device, shared: bool) -> torch.Tensor:
    """A wrapper's int workspace; the single-request functions share one per device."""
    if not shared:
        return torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    key = ("int", str(device))
    if key not in _WORKSPACES:
        _WORKSPACES[key] = torch.empty(INT_WORKSPACE_BYTES, dtype=torch.uint8, device=device)
    return _WORKSPACES[key]
