"""Paged KV-cache maintenance (FlashInfer's ``flashinfer.page``): appending tokens, lengths, positions."""

from __future__ import annotations

import torch

from . import _checks as C
from . import _custom_ops
from ._backend import kernels_for
from ._errors import error_flag
from ._launch import hooks_set
from ._layout import paged_kv_views

__all__ = ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"]


_I32 = torch.int32
_APPEND_DTYPES = frozenset(C.Q_DTYPES + C.FP8_DTYPES)


def _page_impl(device):
    """The Triton page kernels for ``device``, or None for the PyTorch path (``_backend.kernels_for``)."""
    return kernels_for("page", device)


def _cache_views(paged_kv_cache, kv_layout):
    """``(k, v)`` 4-D NHD-ordered views of a cache whose form passed ``paged_kv_views``' checks (views only)."""
    if type(paged_kv_cache) is torch.Tensor:
        k, v = paged_kv_cache.unbind(1)  # (one call for both views: a view of a CUDA tensor costs host time)
    else:
        k, v = paged_kv_cache
        if k.dim() == 3:  # [slots, H, D] in either layout: page size 1
            return k.unsqueeze(1), v.unsqueeze(1)
    if kv_layout == "HND":
        return k.transpose(1, 2), v.transpose(1, 2)
    return k, v


# Forms of argument sets that passed append's checks (an engine appends with the same forms every step):
# a call of a known form skips the checks, which depend on nothing else; the CPU's value checks always run.
# On the GPU a known form also keeps its launch bound (``_launch.bind``: everything but the eight tensors'
# addresses, which the form fixes together with the kernel's specialization), with where K and V start in
# the cache: (launch, K offset, V offset, the cache is a (k, v) pair, device, pages, page size, the device is the
# CPU).
class _Forms(dict):
    """The checked forms (key -> bound launch, or None where it is not bound), with the last one looked up kept
    beside them (``last``: (key, value)): a call of the previous call's form, what an engine's layers make,
    compares its key with that one instead of hashing it (0.3-0.4 of the lookup's 0.7 us on the development
    CPU). Every change of the dict forgets it."""

    __slots__ = ("last",)

    def __init__(self):
        super().__init__()
        self.last = None

    def __setitem__(self, key, value):
        self.last = None
        super().__setitem__(key, value)

    def __delitem__(self, key):
        self.last = None
        super().__delitem__(key)

    def clear(self):
        self.last = None
        super().clear()

    def pop(self, *args):
        self.last = None
        return super().pop(*args)

    def popitem(self):
        self.last = None
        return super().popitem()

    def setdefault(self, *args):
        self.last = None
        return super().setdefault(*args)

    def update(self, *args, **kwargs):
        self.last = None
        super().update(*args, **kwargs)


_CHECKED_FORMS = _Forms()
_CHECKED_FORMS_MAX = 64
_UNCHECKED = object()  # (what a lookup of a form never checked returns)


def _forms_key(kv_layout, cache, key, value, bi, pos, idx, indptr, last) -> tuple | None:
    """What append's checks and launch read of its tensor arguments, as one flat tuple (one expression, no loop:
    with its lookup, half of a known form's host time), or None when one of them is not a tensor or the layout is
    not a string: the layout, the cache's tensor count (a tensor or a ``(k, v)`` pair), the shape, strides, dtype
    and device of the cache and of the appended rows (the launch takes their strides), the shape, dtype, device and
    contiguity of the four index tensors (read at unit stride), the shape and dtype of ``kv_last_page_len`` (all
    its checks read)."""
    T = torch.Tensor
    if (
        type(kv_layout) is not str  # (the checks name any other: a key holding it could compare ambiguously)
        or type(key) is not T
        or type(value) is not T
        or type(bi) is not T
        or type(pos) is not T
        or type(idx) is not T
        or type(indptr) is not T
        or type(last) is not T
    ):
        return None
    if type(cache) is T:
        head = (kv_layout, 1, cache.shape, cache.stride(), cache.dtype, cache.device)
    elif type(cache) is tuple and len(cache) == 2 and type(cache[0]) is T and type(cache[1]) is T:
        k, v = cache
        head = (kv_layout, 2, k.shape, k.stride(), k.dtype, k.device, v.shape, v.stride(), v.dtype, v.device)
    else:
        return None
    return head + (
        key.shape, key.stride(), key.dtype, key.device, value.shape, value.stride(), value.dtype, value.device,
        bi.shape, bi.dtype, bi.device, bi.is_contiguous(), pos.shape, pos.dtype, pos.device, pos.is_contiguous(),
        idx.shape, idx.dtype, idx.device, idx.is_contiguous(), indptr.shape, indptr.dtype, indptr.device,
        indptr.is_contiguous(), last.shape, last.dtype,
    )  # fmt: skip


def get_seq_lens(kv_indptr: torch.Tensor, kv_last_page_len: torch.Tensor, page_size: int) -> torch.Tensor:
    """KV length of each request from its page table: ``(num_pages - 1) * page_size + last_page_len``,
    0 for a request without pages. Returns int32 ``[batch_size]`` on the device of the inputs.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> fi.get_seq_lens(torch.tensor([0, 2, 2, 5], dtype=torch.int32), torch.tensor([3, 0, 16], dtype=torch.int32), 16)
    tensor([19,  0, 48], dtype=torch.int32)
    """
    kv_indptr = C.as_int32_index("kv_indptr", kv_indptr)
    kv_last_page_len = C.as_int32_index("kv_last_page_len", kv_last_page_len)
    C.check_index_tensor("kv_indptr", kv_indptr)
    bs = kv_indptr.shape[0] - 1
    C.check_index_tensor("kv_last_page_len", kv_last_page_len, length=bs, what="[batch_size]")
    C.check_positive_int("page_size", page_size)
    if kv_last_page_len.device != kv_indptr.device:
        raise C.value_error("kv_last_page_len", f"a tensor on {kv_indptr.device}", f"one on {kv_last_page_len.device}")
    impl = _page_impl(kv_indptr.device)
    if impl is not None:
        return impl.get_seq_lens(kv_indptr, kv_last_page_len, page_size)
    num_pages = kv_indptr[1:] - kv_indptr[:-1]
    lens = (num_pages - 1).clamp(min=0) * page_size + kv_last_page_len
    return torch.where(num_pages > 0, lens, torch.zeros_like(lens)).to(torch.int32)


def get_batch_indices_positions(
    append_indptr: torch.Tensor,
    seq_lens: torch.Tensor,
    nnz: int,
    batch_indices: torch.Tensor | None = None,
    positions: torch.Tensor | None = None,
):
    """For each of the ``nnz`` appended tokens, its request and its position in that request's KV.

    Request ``b`` appends ``append_indptr[b+1] - append_indptr[b]`` tokens that end its ``seq_lens[b]``
    tokens (lengths after the append). Returns ``(batch_indices, positions)``, int32 ``[nnz]`` each, on the
    device of ``append_indptr``, with no host synchronization (``nnz`` is given by the caller).
    ``seq_lens`` may be on that device or on the CPU (as engines keep it; pinned memory makes the one
    host-to-device copy asynchronous). ``batch_indices`` and ``positions``, when given (int32 ``[nnz]`` on
    that device), receive the results and are returned. Index inputs may be int32 or int64.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    >>> fi.get_batch_indices_positions(i32(0, 2, 5), i32(4, 3), 5)
    (tensor([0, 0, 1, 1, 1], dtype=torch.int32), tensor([2, 3, 0, 1, 2], dtype=torch.int32))
    """
    append_indptr = C.as_int32_index("append_indptr", append_indptr)
    seq_lens = C.as_int32_index("seq_lens", seq_lens)
    C.check_index_tensor("append_indptr", append_indptr)
    bs = append_indptr.shape[0] - 1
    C.check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32,))
    if isinstance(nnz, bool) or not isinstance(nnz, int) or nnz < 0:
        raise C.value_error("nnz", "a non-negative int", repr(nnz))
    for name, buf in (("batch_indices", batch_indices), ("positions", positions)):
        if buf is not None:
            C.check_index_tensor(name, buf, length=nnz, what="[nnz]")
            C.check_tensor(name, buf, device=append_indptr.device)
    res = _batch_indices_positions(append_indptr, seq_lens, nnz, bs)
    if batch_indices is None and positions is None:
        return res
    out = []
    for buf, got in zip((batch_indices, positions), res):
        if buf is None:
            out.append(got)
        else:
            buf.copy_(got)
            out.append(buf)
    return tuple(out)


def _batch_indices_positions(append_indptr, seq_lens, nnz, bs):
    if seq_lens.device != append_indptr.device:
        # Engines keep seq_lens on the host (often pinned), as FlashInfer allows: one asynchronous copy.
        if seq_lens.device.type != "cpu":
            where = f"{append_indptr.device} or the CPU" if append_indptr.device.type != "cpu" else "cpu"
            raise C.value_error("seq_lens", f"a tensor on {where}", f"one on {seq_lens.device}")
        if seq_lens.shape[0] == bs:
            seq_lens = seq_lens.to(append_indptr.device, non_blocking=True)
    if seq_lens.shape[0] != bs:
        raise C.value_error("seq_lens", f"shape [batch_size] = [{bs}]", C.shape_str(seq_lens.shape))
    impl = _page_impl(append_indptr.device)
    if impl is not None:
        return impl.get_batch_indices_positions(append_indptr, seq_lens, nnz)
    device = append_indptr.device
    token = torch.arange(nnz, device=device, dtype=torch.int64)
    # request of each token: the number of request ends at or before it
    batch = torch.searchsorted(append_indptr[1:].to(torch.int64).contiguous(), token, right=True)
    batch = batch.clamp(max=max(bs - 1, 0))
    counts = (append_indptr[1:] - append_indptr[:-1]).to(torch.int64)
    start = append_indptr[:-1].to(torch.int64)
    if bs == 0:
        return torch.zeros(nnz, dtype=torch.int32, device=device), torch.zeros(nnz, dtype=torch.int32, device=device)
    positions = seq_lens.to(torch.int64)[batch] - counts[batch] + (token - start[batch])
    return batch.to(torch.int32), positions.to(torch.int32)


def append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    paged_kv_cache,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
) -> None:
    """Write appended keys and values into a paged KV cache, in place.

    Token ``t`` (``append_key[t]``, ``[num_kv_heads, head_dim]``) goes to request ``batch_indices[t]`` at
    position ``positions[t]``: page ``kv_indices[kv_indptr[b] + pos // page_size]``, slot
    ``pos % page_size``. Nothing else in the cache is written. The cache is a 5-D tensor or a ``(k, v)``
    tuple (4-D, or 3-D for page size 1) in ``kv_layout``; values are cast to the cache's dtype (fp8 too).
    ``kv_last_page_len`` is accepted for FlashInfer compatibility (the positions already say where).

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> cache = torch.zeros(2, 2, 4, 1, 8)
    >>> i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    >>> key = torch.ones(1, 1, 8)
    >>> fi.append_paged_kv_cache(key, key, i32(0), i32(5), cache, i32(0, 1), i32(0, 2), i32(2))
    >>> int(cache[1, 0, 1].sum())
    8
    """
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.append_paged_kv_cache(
            append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout,
        )  # fmt: skip
    form = _forms_key(kv_layout, paged_kv_cache, append_key, append_value, batch_indices, positions, kv_indices,
                      kv_indptr, kv_last_page_len)  # fmt: skip
    last = _CHECKED_FORMS.last
    if form is not None and last is not None and form == last[0]:
        bound = last[1]
    else:
        try:
            bound = _CHECKED_FORMS.get(form, _UNCHECKED) if form is not None else _UNCHECKED
        except TypeError:  # a kv_layout that does not hash: the checks name it
            form, bound = None, _UNCHECKED
        if bound is not _UNCHECKED:
            _CHECKED_FORMS.last = (form, bound)
    if bound is not _UNCHECKED:  # a known form (None: checked, its launch not bound)
        if bound is not None:
            # Its bound launch with this call's eight addresses (written out here: a call costs host time), unless
            # an address is off a 16-byte boundary (another specialization), a launch hook is set or another
            # device is current (the launch then returns False): the general path below.
            launch, k_off, v_off, pair, device, num_pages, page_size, on_cpu = bound
            if pair:
                kp, vp = paged_kv_cache[0].data_ptr() + k_off, paged_kv_cache[1].data_ptr() + v_off
            else:
                base = paged_kv_cache.data_ptr()
                kp, vp = base + k_off, base + v_off
            p0, p1, p2, p3 = (
                append_key.data_ptr(),
                append_value.data_ptr(),
                batch_indices.data_ptr(),
                positions.data_ptr(),
            )
            p6, p7 = kv_indices.data_ptr(), kv_indptr.data_ptr()
            if not ((p0 | p1 | p2 | p3 | kp | vp | p6 | p7) & 15 or hooks_set()):
                if on_cpu:  # (a stand-in driver: the CPU's value checks always run; device.type costs ~0.2 us)
                    _check_append_ranges(batch_indices, positions, kv_indices, kv_indptr, page_size, num_pages)
                error_flag(device)  # (marks the device's error record for the next plan()'s read, as launches do)
                if launch(p0, p1, p2, p3, kp, vp, p6, p7):
                    return
        k4, v4 = _cache_views(paged_kv_cache, kv_layout)
    else:
        k4, v4 = _check_append(
            append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr,
            kv_last_page_len, kv_layout,
        )  # fmt: skip
        if form is not None:
            if len(_CHECKED_FORMS) >= _CHECKED_FORMS_MAX:
                _CHECKED_FORMS.clear()
            _CHECKED_FORMS[form] = None
    num_pages, page_size = k4.shape[:2]
    device = k4.device
    nnz = append_key.shape[0]
    if device.type == "cpu" and nnz > 0:
        _check_append_ranges(batch_indices, positions, kv_indices, kv_indptr, page_size, num_pages)
    impl = _page_impl(device)
    if impl is not None:
        got = [] if form is not None else None
        impl.append_paged_kv_cache(
            append_key, append_value, batch_indices, positions, k4, v4, kv_indices, kv_indptr, bind=got
        )  # fmt: skip
        if got:
            pair = type(paged_kv_cache) is tuple
            kb, vb = (c.data_ptr() for c in paged_kv_cache) if pair else (paged_kv_cache.data_ptr(),) * 2
            k_off, v_off = k4.data_ptr() - kb, v4.data_ptr() - vb
            _CHECKED_FORMS[form] = (got[0], k_off, v_off, pair, device, num_pages, page_size, device.type == "cpu")
        return
    if nnz == 0:
        return
    b = batch_indices.long()
    pos = positions.long()
    pages = kv_indices.long()[kv_indptr.long()[b] + pos // page_size]
    slots = pos % page_size
    k4[pages, slots] = append_key.to(k4.dtype)
    v4[pages, slots] = append_value.to(v4.dtype)


def _check_append(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout,
):
    """append's checks of everything but values (the forms of the arguments), raising the error that names the
    argument; returns the cache's ``(k, v)`` 4-D views."""
    C.check_kv_layout(kv_layout)
    k4, v4 = paged_kv_views(paged_kv_cache, kv_layout)
    num_pages, page_size, num_kv_heads, head_dim = k4.shape
    device = k4.device
    C.check_tensor("append_key", append_key, dim=3, device=device)
    C.check_tensor("append_value", append_value, dim=3, device=device)
    nnz = append_key.shape[0]
    C.check_shape("append_key", append_key, (nnz, num_kv_heads, head_dim), "[nnz, num_kv_heads, head_dim]")
    C.check_shape("append_value", append_value, (nnz, num_kv_heads, head_dim), "[nnz, num_kv_heads, head_dim]")
    C.check_last_dim_contiguous("append_key", append_key)
    C.check_last_dim_contiguous("append_value", append_value)
    for name, x in (("append_key", append_key), ("append_value", append_value)):
        if x.dtype not in C.Q_DTYPES + C.FP8_DTYPES:
            raise C.type_error(name, "float16, bfloat16, float32 or float8", str(x.dtype))
    C.check_index_tensor("batch_indices", batch_indices, length=nnz, what="[nnz]")
    C.check_index_tensor("positions", positions, length=nnz, what="[nnz]")
    C.check_index_tensor("kv_indices", kv_indices)
    C.check_index_tensor("kv_indptr", kv_indptr)
    C.check_index_tensor("kv_last_page_len", kv_last_page_len, length=kv_indptr.shape[0] - 1, what="[batch_size]")
    for name, x in (
        ("batch_indices", batch_indices),
        ("positions", positions),
        ("kv_indices", kv_indices),
        ("kv_indptr", kv_indptr),
    ):
        if x.device != device:
            raise C.value_error(name, f"a tensor on {device} (the cache's device)", f"one on {x.device}")
        if not x.is_contiguous():  # (the kernel reads it at unit stride, as FlashInfer's does)
            raise C.value_error(name, "a contiguous tensor", f"stride {x.stride(0)}")
    return k4, v4


def _check_append_ranges(batch_indices, positions, kv_indices, kv_indptr, page_size, num_pages):
    """On the host (CPU tensors only: reading device data here would synchronize)."""
    bs = kv_indptr.shape[0] - 1
    b = batch_indices.long()
    if int(b.min()) < 0 or int(b.max()) >= bs:
        raise C.value_error("batch_indices", f"values in [0, {bs})", "a value out of range")
    pos = positions.long()
    pages_of_request = (kv_indptr.long()[1:] - kv_indptr.long()[:-1])[b]
    if int(pos.min()) < 0 or bool((pos // page_size >= pages_of_request).any()):
        raise C.value_error("positions", "positions inside each request's pages", "a position past its last page")
    slot = kv_indptr.long()[b] + pos // page_size
    if int(slot.max()) >= kv_indices.shape[0]:
        raise C.value_error("kv_indices", "an entry for every addressed page", "too few entries")
    pages = kv_indices.long()[slot]
    if int(pages.min()) < 0 or int(pages.max()) >= num_pages:
        raise C.value_error("kv_indices", f"page indices in [0, {num_pages})", "an index out of range")
