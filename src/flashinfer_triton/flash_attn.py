"""FlashAttention 2.x's Python interface on this library's kernels.

``flash_attn_func``, ``flash_attn_varlen_func`` and ``flash_attn_with_kvcache`` take flash-attn's arguments in
its order, with its shapes and return conventions, so code (and transformers' hub-kernel route, which looks
for these names on a module) can switch by changing an import::

    from flashinfer_triton.flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

Conventions kept from flash-attn: ``causal`` aligned to the bottom right of the score matrix,
``window_size=(left, right)`` with -1 for unbounded, ``softcap`` (0: none), ``softmax_scale`` (default
``head_dim ** -0.5``), and the log-sum-exp in **natural log** with shape ``[batch, nheads, seqlen_q]``
(``[nheads, total_q]`` for varlen). ALiBi biases a key ``-slope * |i + seqlen_k - seqlen_q - j|``.

What is not there is rejected with an error naming the argument: ``dropout_p > 0`` (inference only), a
bounded right window larger than 0, ALiBi without causal masking or with slopes other than the standard
``2 ** (-8 (h + 1) / nheads)``, rotary embedding inside ``flash_attn_with_kvcache`` and ``cache_leftpad``.
``deterministic`` and ``num_splits`` are performance hints (results are deterministic). ``return_attn_probs``
returns ``(out, softmax_lse, None)``: the probabilities are never materialized.

Each call plans one of the library's wrappers; plans are kept in a small cache keyed by the shapes, the
options and the index tensors, so the layers of one model step plan once. Host index tensors are keyed on their
values. Device index tensors (``cu_seqlens_*``, ``block_table``, ``cache_seqlens``, ``cache_batch_idx``) are keyed
on their identity and version counter, which every PyTorch write bumps: a tensor whose contents change by other
means (a custom kernel, a CUDA-graph replay) must be passed as a new tensor, or ``flash_attn.clear_plans()`` called.
"""

from __future__ import annotations

import math
import weakref
from collections import OrderedDict

import torch

from . import _checks as C
from .decode import BatchDecodeWithPagedKVCacheWrapper, block_table_to_csr
from .prefill import BatchPrefillWithPagedKVCacheWrapper, BatchPrefillWithRaggedKVCacheWrapper
from .reference import alibi_slopes as _standard_slopes

__all__ = ["flash_attn_func", "flash_attn_varlen_func", "flash_attn_with_kvcache"]

_LN2 = math.log(2.0)
_WORKSPACE_BYTES = {"cuda": 128 << 20}
_PLAN_CACHE_SIZE = 16


# ---------------------------------------------------------------------------------------------- options
def _mask_options(causal: bool, window_size) -> tuple[bool, int]:
    """flash-attn's ``(causal, window_size)`` as this library's ``(causal, window_left)``."""
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise C.type_error("window_size", "a pair of ints (left, right)", repr(window_size)) from None
    if left < -1 or right < -1:
        raise C.value_error("window_size", "entries >= -1 (-1: unbounded)", repr(tuple(window_size)))
    if causal or right == 0:
        return True, left
    if right > 0:
        raise C.value_error(
            "window_size",
            "a right window of -1 (unbounded) or 0 (causal); a bounded right window > 0 is not supported",
            repr(tuple(window_size)),
        )  # fmt: skip
    return False, left


def _check_alibi(alibi_slopes, num_heads: int, causal: bool):
    """ALiBi as FlashInfer computes it: the standard slopes, causal masking (then the signed and absolute
    distances agree). Returns the slopes [num_heads] float32 (on the host) or None."""
    if alibi_slopes is None:
        return None
    C.check_tensor("alibi_slopes", alibi_slopes, dtypes=(torch.float32,))
    if alibi_slopes.shape[-1] != num_heads or alibi_slopes.dim() not in (1, 2):
        raise C.value_error("alibi_slopes", f"shape [nheads] or [batch, nheads] with nheads = {num_heads}",
                            C.shape_str(alibi_slopes.shape))  # fmt: skip
    if not causal:
        raise C.value_error("alibi_slopes", "causal=True (or window_size[1] == 0) with ALiBi", "a non-causal call")
    std = _standard_slopes(num_heads)
    got = alibi_slopes.detach().float().cpu().reshape(-1, num_heads)
    if not torch.allclose(got, std.expand_as(got), rtol=1e-5, atol=1e-7):
        raise C.value_error("alibi_slopes", "the standard slopes 2 ** (-8 * (h + 1) / nheads)", "other slopes")
    return std


def _scale(softmax_scale, head_dim: int) -> float:
    if softmax_scale is None:
        return head_dim**-0.5
    if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
        raise C.type_error("softmax_scale", "a float or None", type(softmax_scale).__name__)
    return float(softmax_scale)


def _softcap(softcap) -> float | None:
    if softcap is None or softcap == 0:
        return None
    if softcap < 0:
        raise C.value_error("softcap", "a value >= 0 (0: no cap)", softcap)
    return float(softcap)


def _no_dropout(dropout_p) -> None:
    if dropout_p:
        raise C.value_error("dropout_p", "0.0 (this library implements inference attention only)", dropout_p)


# ---------------------------------------------------------------------------------------------- plan cache
class _PlanCache:
    """The wrappers planned for recent calls, keyed by plain values plus index tensors (identity and version)."""

    def __init__(self, size: int):
        self._size = size
        self._entries: OrderedDict = OrderedDict()
        self._workspaces: dict = {}

    def workspace(self, device: torch.device) -> torch.Tensor:
        key = (device.type, device.index)
        ws = self._workspaces.get(key)
        if ws is None:
            ws = torch.empty(_WORKSPACE_BYTES.get(device.type, 1 << 20), dtype=torch.uint8, device=device)
            self._workspaces[key] = ws
        return ws

    @staticmethod
    def _tensor_key(t):
        if t is None:
            return None
        if t.device.type == "cpu":  # host index tensors: keyed on their values (a memcpy), whatever wrote them
            return ("values", t.dtype, tuple(t.shape), t.contiguous().numpy().tobytes())
        try:
            # device index tensors: identity and version counter (every PyTorch write bumps it; reading the
            # values would cost a device sync per call). A write that bypasses PyTorch (a custom kernel, a CUDA
            # graph replay) must come with a new tensor: see the module's docstring.
            return (id(t), t._version)
        except RuntimeError:  # inference tensors have no version counter: key on the values (a host read)
            return (id(t), tuple(t.tolist()))

    def get(self, key: tuple, tensors: tuple, build):
        full = (key, tuple(self._tensor_key(t) for t in tensors))
        entry = self._entries.get(full)
        if entry is not None and all(r is None or r() is t for r, t in zip(entry[0], tensors)):
            self._entries.move_to_end(full)
            return entry[1]
        wrapper = build()
        # device tensors are keyed by identity: the entry holds a weak reference to check it is the same object
        refs = tuple(None if t is None or t.device.type == "cpu" else weakref.ref(t) for t in tensors)
        self._entries[full] = (refs, wrapper)
        while len(self._entries) > self._size:
            self._entries.popitem(last=False)
        return wrapper

    def clear(self) -> None:
        self._entries.clear()


_PLANS = _PlanCache(_PLAN_CACHE_SIZE)


def clear_plans() -> None:
    """Forget every cached plan (after index tensors changed by means that bypass PyTorch)."""
    _PLANS.clear()


def _lse_natural(lse_base2: torch.Tensor) -> torch.Tensor:
    return lse_base2 * _LN2


def _alibi_lse_shift(lse_nat, slopes, q_lens, k_lens, row_request):
    """Our ALiBi bias is ``slope * (j - i)``; flash-attn's is ``slope * (j - i - (seqlen_k - seqlen_q))``: the
    same softmax, and a log-sum-exp lower by ``slope * (seqlen_k - seqlen_q)`` per request."""
    shift = (k_lens - q_lens).to(torch.float32).to(lse_nat.device)[row_request]  # [total_q]
    return lse_nat - shift[:, None] * slopes.to(lse_nat.device)[None, :]


# ---------------------------------------------------------------------------------------------- varlen
def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    """Attention over packed sequences: ``q [total_q, nheads, headdim]``, ``k, v [total_k, nheads_k, headdim]``
    with ``cu_seqlens_q / cu_seqlens_k [batch + 1]`` (int32) marking each sequence's rows; or, with
    ``block_table [batch, max_blocks]`` (int32), ``k, v`` are paged caches ``[num_blocks, page_size, nheads_k,
    headdim]`` and sequence ``b``'s keys are its first ``cu_seqlens_k[b+1] - cu_seqlens_k[b]`` tokens.

    Returns ``out [total_q, nheads, headdim]``, or ``(out, softmax_lse [nheads, total_q] (natural log), None)``
    with ``return_attn_probs``. ``max_seqlen_q`` / ``max_seqlen_k`` are accepted as flash-attn takes them
    (the plan reads the exact lengths)."""
    _no_dropout(dropout_p)
    C.check_tensor("q", q, dim=3)
    C.check_tensor("k", k, dim=4 if block_table is not None else 3, device=q.device)
    C.check_tensor("v", v, device=q.device)
    if v.shape != k.shape:
        raise C.value_error("v", f"the shape of k {C.shape_str(k.shape)}", C.shape_str(v.shape))
    C.check_index_tensor("cu_seqlens_q", cu_seqlens_q)
    C.check_index_tensor("cu_seqlens_k", cu_seqlens_k, length=cu_seqlens_q.shape[0], what="[batch_size + 1]")
    nheads, head_dim = q.shape[1], q.shape[2]
    nheads_k = k.shape[-2]
    if k.shape[-1] != head_dim:
        raise C.value_error("k", f"head dim {head_dim} (that of q)", k.shape[-1])
    if nheads % nheads_k:
        raise C.value_error("k", f"a number of heads dividing nheads = {nheads}", nheads_k)
    is_causal, window_left = _mask_options(causal, window_size)
    slopes = _check_alibi(alibi_slopes, nheads, is_causal)
    sm_scale = _scale(softmax_scale, head_dim)
    cap = _softcap(softcap)
    pos = "ALIBI" if slopes is not None else "NONE"
    opts = (nheads, nheads_k, head_dim, q.dtype, k.dtype, is_causal, window_left, cap, sm_scale, pos, q.device)
    common = dict(
        causal=is_causal, window_left=window_left, logits_soft_cap=cap, sm_scale=sm_scale, pos_encoding_mode=pos,
        q_data_type=q.dtype, kv_data_type=k.dtype,
    )  # fmt: skip
    if block_table is None:

        def build():
            w = BatchPrefillWithRaggedKVCacheWrapper(_PLANS.workspace(q.device))
            w.plan(cu_seqlens_q, cu_seqlens_k, nheads, nheads_k, head_dim, **common)
            return w

        w = _PLANS.get(("ragged", *opts), (cu_seqlens_q, cu_seqlens_k), build)
        res = w.run(q, k, v, return_lse=return_attn_probs or slopes is not None)
    else:
        C.check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,))
        page_size = k.shape[1]

        def build():
            seq_lens = (cu_seqlens_k[1:] - cu_seqlens_k[:-1]).to(torch.int32).cpu()
            indptr, indices, last = block_table_to_csr(block_table, seq_lens, page_size)
            w = BatchPrefillWithPagedKVCacheWrapper(_PLANS.workspace(q.device))
            w.plan(cu_seqlens_q, indptr, indices.to(q.device), last, nheads, nheads_k, head_dim, page_size, **common)
            return w

        w = _PLANS.get(("paged", page_size, *opts), (cu_seqlens_q, cu_seqlens_k, block_table), build)
        res = w.run(q, (k, v), return_lse=return_attn_probs or slopes is not None)
    if isinstance(res, tuple):
        out, lse = res
    else:
        out, lse = res, None
    if not return_attn_probs:
        return out
    lse = _lse_natural(lse)
    if slopes is not None:
        cq = cu_seqlens_q.to(torch.int64)
        ck = cu_seqlens_k.to(torch.int64)
        q_lens, k_lens = cq[1:] - cq[:-1], ck[1:] - ck[:-1]
        rows = torch.repeat_interleave(torch.arange(q_lens.shape[0], device=cq.device), q_lens, output_size=q.shape[0])
        lse = _alibi_lse_shift(lse, slopes, q_lens, k_lens, rows)
    return out, lse.transpose(0, 1).contiguous(), None


# ---------------------------------------------------------------------------------------------- dense batch
def flash_attn_func(
    q,
    k,
    v,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
):
    """``q [batch, seqlen_q, nheads, headdim]``, ``k, v [batch, seqlen_k, nheads_k, headdim]`` ->
    ``out [batch, seqlen_q, nheads, headdim]``, or ``(out, softmax_lse [batch, nheads, seqlen_q], None)`` with
    ``return_attn_probs`` (natural-log LSE)."""
    C.check_tensor("q", q, dim=4)
    C.check_tensor("k", k, dim=4, device=q.device)
    C.check_tensor("v", v, dim=4, device=q.device)
    if k.shape[0] != q.shape[0]:
        raise C.value_error("k", f"batch size {q.shape[0]} (that of q)", k.shape[0])
    b, sq, h, d = q.shape
    sk = k.shape[1]
    cu_q, cu_k = _uniform_indptr(b, sq, sk, q.device)
    res = flash_attn_varlen_func(
        q.reshape(b * sq, h, d), k.reshape(b * sk, *k.shape[2:]), v.reshape(b * sk, *v.shape[2:]), cu_q, cu_k, sq, sk,
        dropout_p, softmax_scale, causal, window_size, softcap, alibi_slopes, deterministic, return_attn_probs,
    )  # fmt: skip
    if not return_attn_probs:
        return res.view(b, sq, h, d)
    out, lse, _ = res
    return out.view(b, sq, h, d), lse.view(h, b, sq).transpose(0, 1).contiguous(), None


_INDPTRS: dict = {}


def _uniform_indptr(batch: int, sq: int, sk: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``cu_seqlens`` of equal-length sequences, made once per shape (the same tensors key the plan cache)."""
    key = (batch, sq, sk, torch.device(device))
    got = _INDPTRS.get(key)
    if got is None:
        ar = torch.arange(batch + 1, dtype=torch.int32)
        got = ((ar * sq).to(device), (ar * sk).to(device))
        if len(_INDPTRS) > 64:
            _INDPTRS.clear()
        _INDPTRS[key] = got
    return got


# ---------------------------------------------------------------------------------------------- KV cache
def flash_attn_with_kvcache(
    q,
    k_cache,
    v_cache,
    k=None,
    v=None,
    rotary_cos=None,
    rotary_sin=None,
    cache_seqlens=None,
    cache_batch_idx=None,
    cache_leftpad=None,
    block_table=None,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    rotary_interleaved=True,
    alibi_slopes=None,
    num_splits=0,
    return_softmax_lse=False,
):
    """Attention of ``q [batch, seqlen_q, nheads, headdim]`` over a KV cache, after appending ``k, v``.

    ``k_cache, v_cache``: ``[batch_cache, seqlen_cache, nheads_k, headdim]``, or with ``block_table [batch,
    max_blocks]`` (int32) paged ``[num_blocks, page_size, nheads_k, headdim]``. ``cache_seqlens`` (int or int32
    ``[batch]``) is each sequence's cached length before the append; ``k, v [batch, seqlen_new, nheads_k,
    headdim]``, when given, are written into the cache in place at positions ``cache_seqlens[b] ...`` and
    attended to. ``cache_batch_idx [batch]`` picks the cache row of each sequence (non-paged caches).

    Returns ``out [batch, seqlen_q, nheads, headdim]``, plus ``softmax_lse [batch, nheads, seqlen_q]`` (natural
    log) with ``return_softmax_lse``."""
    for name, value in (("rotary_cos", rotary_cos), ("rotary_sin", rotary_sin), ("cache_leftpad", cache_leftpad)):
        if value is not None:
            raise C.value_error(name, "None (apply rotary embedding / left padding before the call)", "a tensor")
    C.check_tensor("q", q, dim=4)
    C.check_tensor("k_cache", k_cache, dim=4, device=q.device)
    C.check_tensor("v_cache", v_cache, dim=4, device=q.device)
    if v_cache.shape != k_cache.shape:
        raise C.value_error("v_cache", f"the shape of k_cache {C.shape_str(k_cache.shape)}", C.shape_str(v_cache.shape))
    b, sq, h, d = q.shape
    nheads_k = k_cache.shape[2]
    if k_cache.shape[3] != d:
        raise C.value_error("k_cache", f"head dim {d} (that of q)", k_cache.shape[3])
    if (k is None) != (v is None):
        raise C.value_error("v" if v is None else "k", "given together with " + ("k" if v is None else "v"), "None")
    dev = q.device
    paged = block_table is not None
    if paged:
        C.check_tensor("block_table", block_table, dim=2, dtypes=(torch.int32,), device=dev)
        if block_table.shape[0] != b:
            raise C.value_error("block_table", f"{b} rows (the batch of q)", block_table.shape[0])
        if cache_batch_idx is not None:
            raise C.value_error("cache_batch_idx", "None with block_table (the table names each sequence's pages)",
                                "a tensor")  # fmt: skip
    # cached lengths before the append, on the device
    if cache_seqlens is None:
        if paged or k is not None:
            raise C.value_error("cache_seqlens", "the cached lengths (required with block_table or k, v)", "None")
        seqlens = _full(b, k_cache.shape[1], dev)  # the whole cache row
    elif isinstance(cache_seqlens, int) and not isinstance(cache_seqlens, bool):
        seqlens = _full(b, cache_seqlens, dev)
    else:
        C.check_tensor("cache_seqlens", cache_seqlens, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
        if cache_seqlens.shape[0] != b:
            raise C.value_error("cache_seqlens", f"shape [batch] = [{b}]", C.shape_str(cache_seqlens.shape))
        seqlens = cache_seqlens
    if cache_batch_idx is not None:
        C.check_tensor("cache_batch_idx", cache_batch_idx, dim=1, dtypes=(torch.int32, torch.int64), device=dev)
        if cache_batch_idx.shape[0] != b:
            raise C.value_error("cache_batch_idx", f"shape [batch] = [{b}]", C.shape_str(cache_batch_idx.shape))
    s_new = 0
    if k is not None:
        C.check_tensor("k", k, dim=4, device=dev)
        C.check_tensor("v", v, dim=4, device=dev)
        if k.shape != v.shape or k.shape[0] != b or tuple(k.shape[2:]) != (nheads_k, d):
            raise C.value_error("k", f"shape [batch, seqlen_new, nheads_k, headdim] = [{b}, *, {nheads_k}, {d}] "
                                "(v the same)", f"k {C.shape_str(k.shape)}, v {C.shape_str(v.shape)}")  # fmt: skip
        s_new = k.shape[1]
    if h % nheads_k:
        raise C.value_error("k_cache", f"a number of heads dividing nheads = {h}", nheads_k)
    is_causal, window_left = _mask_options(causal, window_size)
    slopes = _check_alibi(alibi_slopes, h, is_causal)
    sm_scale = _scale(softmax_scale, d)
    cap = _softcap(softcap)
    if k is not None:  # every argument checked: now the cache may be written
        _append(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table)
    pos = "ALIBI" if slopes is not None else "NONE"
    # a non-paged cache is a paged one with one page per row, of page_size = seqlen_cache
    page_size = k_cache.shape[1]
    opts = (h, nheads_k, d, q.dtype, k_cache.dtype, is_causal, window_left, cap, sm_scale, pos, dev, page_size, sq)
    want_lse = return_softmax_lse
    # the plan depends on the lengths after the append: key on (cache_seqlens, s_new) and the table's source
    key_tensors = (seqlens, block_table if paged else cache_batch_idx)
    plain = (s_new, k_cache.shape[0])

    def lens_host():  # keys each sequence attends to (plan time only)
        return (seqlens.to(torch.int64) + s_new).to(torch.int32).cpu()

    def table_host():
        if paged:
            return block_table.cpu()
        rows = cache_batch_idx if cache_batch_idx is not None else _arange(b, dev)
        return rows.to(torch.int32).cpu().view(b, 1)

    if sq == 1:  # one query per sequence: the decode kernels

        def build():
            w = BatchDecodeWithPagedKVCacheWrapper(_PLANS.workspace(dev))
            w.plan(None, None, None, h, nheads_k, d, page_size, pos_encoding_mode=pos, window_left=window_left,
                   logits_soft_cap=cap,
                   sm_scale=sm_scale, q_data_type=q.dtype, kv_data_type=k_cache.dtype,
                   block_tables=table_host(), seq_lens=lens_host())  # fmt: skip
            return w

        w = _PLANS.get(("kvcache-decode", *opts, *plain), key_tensors, build)
        res = w.run(q.view(b, h, d), (k_cache, v_cache), return_lse=want_lse)
    else:

        def build():
            lens = lens_host()
            indptr, indices, last = block_table_to_csr(table_host(), lens, page_size)
            qo = torch.arange(b + 1, dtype=torch.int32) * sq
            w = BatchPrefillWithPagedKVCacheWrapper(_PLANS.workspace(dev))
            w.plan(qo.to(dev), indptr, indices.to(dev), last, h, nheads_k, d, page_size, causal=is_causal,
                   window_left=window_left, logits_soft_cap=cap, sm_scale=sm_scale, pos_encoding_mode=pos,
                   q_data_type=q.dtype, kv_data_type=k_cache.dtype)  # fmt: skip
            return w

        w = _PLANS.get(("kvcache-prefill", *opts, *plain), key_tensors, build)
        res = w.run(q.reshape(b * sq, h, d), (k_cache, v_cache), return_lse=want_lse)
    out, lse = res if want_lse else (res, None)
    out = out.view(b, sq, h, d)
    if not want_lse:
        return out
    lse = _lse_natural(lse)
    if slopes is not None:
        rows = torch.arange(b, device=dev).repeat_interleave(sq)
        lse = _alibi_lse_shift(lse, slopes, torch.full((b,), sq, device=dev), seqlens.to(torch.int64) + s_new, rows)
    return out, lse.view(b, sq, h).transpose(1, 2).contiguous()


_CONSTS: dict = {}


def _const(kind: str, n: int, value: int, device) -> torch.Tensor:
    """Small index tensors made once per shape and value, so that they key the plan cache stably."""
    key = (kind, n, value, torch.device(device))
    got = _CONSTS.get(key)
    if got is None:
        if len(_CONSTS) > 256:
            _CONSTS.clear()
        x = torch.arange(n, dtype=torch.int32) if kind == "arange" else torch.full((n,), value, dtype=torch.int32)
        got = _CONSTS[key] = x.to(device)
    return got


def _arange(n: int, device) -> torch.Tensor:
    return _const("arange", n, 0, device)


def _full(n: int, value: int, device) -> torch.Tensor:
    return _const("full", n, value, device)


def _append(k_cache, v_cache, k, v, seqlens, cache_batch_idx, block_table) -> None:
    """Write ``k, v [batch, seqlen_new, ...]`` at positions ``seqlens[b] + t`` of each sequence, in place, with
    device-side indexing only (no host synchronization)."""
    b, s_new = k.shape[0], k.shape[1]
    dev = k.device
    pos = seqlens.to(torch.int64)[:, None] + torch.arange(s_new, device=dev)[None, :]  # [b, s_new]
    if block_table is not None:
        page_size = k_cache.shape[1]
        rows = block_table.to(torch.int64).gather(1, pos // page_size)
        slots = pos % page_size
    else:
        rows = (cache_batch_idx.to(torch.int64) if cache_batch_idx is not None else torch.arange(b, device=dev))[
            :, None
        ]
        rows = rows.expand(b, s_new)
        slots = pos
    k_cache[rows, slots] = k.to(k_cache.dtype)
    v_cache[rows, slots] = v.to(v_cache.dtype)
