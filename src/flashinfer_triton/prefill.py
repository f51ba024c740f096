"""Prefill and append attention: ragged queries over paged or ragged KV (FlashInfer's ``flashinfer.prefill``)."""

from __future__ import annotations

import functools

import numpy as np
import torch

from . import _checks as C
from . import _custom_ops, _surface
from ._layout import paged_kv_views, ragged_kv_view
from ._wrapper import (
    _SINGLE_FAST,
    _SMALL_TABLE,
    PublicWrapperSurface,
    _AttentionWrapper,
    _host_i64,
    read_table,
    run_single,
    same_lengths,
    single_fast_key,
)

_T = torch.Tensor

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]


# FlashInfer 0.2's parameters after (q, k, v), in its order (0.7 put scale_q, scale_k, scale_v, o_dtype first).
_SINGLE_PREFILL_V02 = (
    "custom_mask",
    "packed_custom_mask",
    "causal",
    "kv_layout",
    "pos_encoding_mode",
    "allow_fp16_qk_reduction",
    "sm_scale",
    "window_left",
    "logits_soft_cap",
    "rope_scale",
    "rope_theta",
    "return_lse",
    "backend",
)


@C.bind_generations(3, _SINGLE_PREFILL_V02, method=False)
def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale_q: torch.Tensor | float | None = None,
    scale_k: torch.Tensor | float | None = None,
    scale_v: torch.Tensor | float | None = None,
    o_dtype=None,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    backend: str = "auto",
    return_lse: bool = False,
    kv_cache_sf=None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    *,
    allow_fp16_qk_reduction: bool = False,
    lse_base: str = "log2",
    **kwargs,
):
    """Prefill attention of one request.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[qo_len, num_qo_heads, head_dim]``, dtype float16 or bfloat16.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND); dtype of
        q or float8 (``k_scale`` multiplies ``sm_scale``, ``v_scale`` the output).
    scale_q, scale_k, scale_v : fp8 dequantization scales, per head (``[num_qo_heads]``, ``[num_kv_heads]``,
        ``[num_kv_heads]`` float tensors) or one number each; they multiply q, k and v.
    o_dtype : output dtype (default: that of q).
    custom_mask : bool ``[qo_len, kv_len]`` (True = attend); replaces ``causal``.
    packed_custom_mask : the same mask flattened and packed with ``packbits(..., bitorder="little")``.
    causal : aligned to the bottom right: key ``j`` is visible to query ``i`` iff ``j <= i + kv_len - qo_len``.
    window_left : keys more than ``window_left`` before the diagonal are masked; -1 for none.
    return_lse : also return the log-sum-exp, ``[qo_len, num_qo_heads]`` float32, **base 2** (``lse_base="ln"``:
        natural log).

    The positional order is FlashInfer 0.7's; FlashInfer 0.2's (``custom_mask`` 4th) is recognised by the
    argument types. ``use_fp16_qk_reduction`` / ``allow_fp16_qk_reduction`` and ``backend`` are accepted
    performance hints that never change results.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> q = torch.randn(7, 8, 64, dtype=torch.float16)
    >>> k = torch.randn(20, 2, 64, dtype=torch.float16); v = torch.randn_like(k)
    >>> fi.single_prefill_with_kv_cache(q, k, v, causal=True).shape
    torch.Size([7, 8, 64])
    """
    fast_key = fast_shapes = None
    if (
        type(q) is _T
        and type(k) is _T
        and type(v) is _T
        and not kwargs
        and custom_mask is None
        and packed_custom_mask is None
        and kv_cache_sf is None
    ):
        options = (scale_q, scale_k, scale_v, o_dtype, causal, kv_layout, pos_encoding_mode, use_fp16_qk_reduction,
                   sm_scale, window_left, logits_soft_cap, rope_scale, rope_theta, backend, return_lse, k_scale,
                   v_scale, allow_fp16_qk_reduction, lse_base)  # fmt: skip
        fast_key = single_fast_key(2, options, q, k, v)
        fast = _SINGLE_FAST.get(fast_key)
        # a call of a form that passed every check below and whose launch is bound (the plan is the form's)
        if fast is not None and not torch.compiler.is_compiling() and (got := fast(q, k, v)) is not None:
            return got
        # (kept with the form when its launch binds: the public outputs' shapes, where the public tensors start)
        fast_shapes = (q.shape, q.shape[:2], (q.data_ptr(), k.data_ptr(), v.data_ptr()))
    C.reject_unknown("single_prefill_with_kv_cache", kwargs)
    if kv_cache_sf is not None:
        raise NotImplementedError("kv_cache_sf: NVFP4 KV caches are not supported by flashinfer_triton")
    C.check_kv_layout(kv_layout)
    C.check_tensor("q", q, dim=3)
    k4 = ragged_kv_view(k, kv_layout, "k")
    v4 = ragged_kv_view(v, kv_layout, "v")
    if custom_mask is not None:
        C.check_tensor("custom_mask", custom_mask)
        expected = (q.shape[0], k4.shape[0])
        if tuple(custom_mask.shape) != expected and custom_mask.numel() != expected[0] * expected[1]:
            raise C.value_error(
                "custom_mask", f"shape [qo_len, kv_len] = {C.shape_str(expected)}", C.shape_str(custom_mask.shape)
            )
    q, head_v_scale, q_mult, k_mult, v_mult = _per_head_scales(q, k4.shape[2], scale_q, scale_k, scale_v)
    res = run_single(
        q,
        k4,
        v4,
        is_decode=False,
        custom_mask=custom_mask,
        packed_custom_mask=packed_custom_mask if custom_mask is None else None,
        causal=causal,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=q_mult,
        k_scale=_mul_scales("k_scale", k_scale, k_mult),
        v_scale=_mul_scales("v_scale", v_scale, v_mult),
        return_lse=return_lse,
        o_dtype=o_dtype,
        lse_base=lse_base,
        fast_key=fast_key if head_v_scale is None else None,
        fast_shapes=fast_shapes,
    )
    if head_v_scale is not None:
        o = res[0] if return_lse else res
        o.copy_((o.float() * head_v_scale[None, :, None]).to(o.dtype))
    return res


def _mul_scales(name, a, b):
    if b is None:
        return a
    return C.resolve_scale(name, a) * b


def _per_head_scales(q, num_kv_heads, scale_q, scale_k, scale_v):
    """FlashInfer 0.7's ``scale_q/scale_k/scale_v``: one number each (folded into the scalar scales) or per-head
    tensors. Per-head q and k scales multiply the query rows of each head (k's through its group), per-head v
    scales each head's output. Returns (q, per-q-head output scale or None, q mult, k mult, v mult)."""
    num_qo_heads = q.shape[1]
    group = num_qo_heads // max(num_kv_heads, 1)
    row = None  # [Hq] float32 multiplier of q
    mults = []
    out_scale = None
    for name, sc, heads in (
        ("scale_q", scale_q, num_qo_heads),
        ("scale_k", scale_k, num_kv_heads),
        ("scale_v", scale_v, num_kv_heads),
    ):
        if sc is None:
            mults.append(None)
            continue
        if isinstance(sc, torch.Tensor) and sc.numel() > 1:
            C.check_tensor(name, sc, dim=1, device=q.device)
            if not sc.is_floating_point() or sc.shape[0] != heads:
                raise C.value_error(name, f"a float tensor of shape [{heads}] or one number", C.shape_str(sc.shape))
            per_q = sc.float() if heads == num_qo_heads else sc.float().repeat_interleave(group)
            if name == "scale_v":
                out_scale = per_q
            else:
                row = per_q if row is None else row * per_q
            mults.append(None)
        else:
            mults.append(C.resolve_scale(name, sc))
    if row is not None:
        q = (q.float() * row[None, :, None]).to(q.dtype)
    return (q, out_scale, *mults)


single_prefill_with_kv_cache_return_lse = functools.partial(single_prefill_with_kv_cache, return_lse=True)
single_prefill_with_kv_cache_return_lse.__doc__ = (
    "``single_prefill_with_kv_cache(..., return_lse=True)``: returns ``(o, lse)``."
)


class _PrefillCore(_AttentionWrapper):
    _is_decode = False


class _PrefillWrapperBase(PublicWrapperSurface):
    """Shared surface of the two batch prefill wrappers."""

    _paged = True

    def __init__(self, float_workspace_buffer, kv_layout, use_cuda_graph, backend, buffers: dict, max_total_q=None):
        core_cls = type("_Core", (_PrefillCore,), {"_paged": self._paged})
        self._w = core_cls(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        w = self._w
        self._buffers = buffers
        if max_total_q is not None and (isinstance(max_total_q, bool) or not isinstance(max_total_q, int)):
            raise C.type_error("max_total_q", "an int or None", type(max_total_q).__name__)
        if max_total_q is not None and max_total_q < 1:
            raise C.value_error("max_total_q", "a positive number of query rows", max_total_q)
        # CUDA-graph query-row capacity (the launch grid is sized from it): the constructor's max_total_q,
        # else fixed by the first plan() (FlashInfer's rule), with 2x headroom.
        w._max_total_q = max_total_q if use_cuda_graph else None
        if use_cuda_graph:
            for name, buf in buffers.items():
                if buf is None and name in self._required_buffers:
                    raise ValueError(f"{name}: required when use_cuda_graph=True, got None")
                if buf is not None:
                    if name == "custom_mask_buf":
                        C.check_tensor(name, buf, dim=1, dtypes=(torch.uint8,), device=w.device)
                    else:
                        C.check_index_tensor(name, buf)
                        C.check_tensor(name, buf, device=w.device)
            w._fixed_batch_size = buffers["qo_indptr_buf"].shape[0] - 1
        self._plan_args = None

    def _qo_indptr(self, qo_indptr, batch_size, checked=None):
        """``checked``: the int64 host array of an indptr tensor ``qo_indptr`` is (the page table's, read and checked
        by ``read_table``: starts at 0, never decreases, ``batch_size + 1`` entries), taken as it is."""
        if checked is not None:
            qo_np = checked
        else:
            C.check_index_tensor("qo_indptr", qo_indptr, length=batch_size + 1, what="[batch_size + 1]")
            qo_np = _small_indptr(qo_indptr) if batch_size <= _SMALL_TABLE and qo_indptr.is_cpu else None
        if qo_np is None:
            # host math in numpy: a few operations of a microsecond where torch's cost several each
            qo_np = qo_indptr.numpy().astype(np.int64) if qo_indptr.is_cpu else _host_i64(qo_indptr).numpy()
            if qo_np[0] != 0:
                raise C.value_error("qo_indptr", "indptr[0] == 0", f"indptr[0] == {int(qo_np[0])}")
            if batch_size and np.minimum.reduce(qo_np[1:] - qo_np[:-1]) < 0:
                raise C.value_error("qo_indptr", "a non-decreasing sequence", "a decreasing step")
        w = self._w
        if w._use_cuda_graph and batch_size > w._fixed_batch_size:
            cap = w._fixed_batch_size
            raise C.value_error("qo_indptr", f"at most {cap} requests (CUDA-graph buffers)", batch_size)
        if w._use_cuda_graph:
            total = int(qo_np[-1])
            if w._max_total_q is None:
                w._max_total_q = max(2 * total, w._fixed_batch_size, 1)
            if total > w._max_total_q:
                raise C.value_error(
                    "qo_indptr",
                    f"at most {w._max_total_q} query rows in total (CUDA-graph capacity: the wrapper's "
                    "max_total_q, else twice the first plan's rows)",
                    f"{total} rows",
                )
        return qo_np

    def _graph_buffers(self) -> dict | None:
        """The caller's CUDA-graph buffers under the names plan() fills, or None outside graph mode."""
        if not self._w._use_cuda_graph:
            return None
        names = {
            "qo_indptr_buf": "qo_indptr",
            "paged_kv_indptr_buf": "kv_indptr",
            "kv_indptr_buf": "kv_indptr",
            "paged_kv_indices_buf": "kv_indices",
            "paged_kv_last_page_len_buf": "last_page_len",
            "custom_mask_buf": "mask",
            "qk_indptr_buf": "mask_indptr",
        }
        return {names[k]: v for k, v in self._buffers.items() if v is not None}

    def _replan_with(self, **overrides):
        if any(self._plan_args.get(key) != value for key, value in overrides.items()):
            self.plan(**{**self._plan_args, **overrides})


# FlashInfer 0.2's plan() parameters after head_dim (ragged) / page_size (paged), in its order (0.7 put
# head_dim_vo first and o_data_type after kv_data_type).
_RAGGED_PLAN_V02 = (
    "custom_mask",
    "packed_custom_mask",
    "causal",
    "pos_encoding_mode",
    "allow_fp16_qk_reduction",
    "window_left",
    "logits_soft_cap",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "q_data_type",
    "kv_data_type",
)


_PAGED_PLAN_V02 = (
    "custom_mask",
    "packed_custom_mask",
    "causal",
    "pos_encoding_mode",
    "allow_fp16_qk_reduction",
    "sm_scale",
    "window_left",
    "logits_soft_cap",
    "rope_scale",
    "rope_theta",
    "q_data_type",
    "kv_data_type",
    "non_blocking",
)


class BatchPrefillWithPagedKVCacheWrapper(_PrefillWrapperBase):
    """Batch prefill/append: ragged queries over a paged KV cache; ``plan()`` once, ``run()`` per layer.

    ``causal`` is aligned to the bottom right, so new tokens appended after a cached prefix see the whole
    prefix (``qo_len < kv_len``). With ``use_cuda_graph=True`` the buffers fix the batch capacity
    (``len(qo_indptr_buf) - 1``) and ``plan()`` copies each batch into them; the total query rows of any
    later batch may not exceed ``max_total_q`` (keyword of this library; default: twice the first plan's
    total, FlashInfer fixes it at the first plan's total).

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    >>> cache = torch.randn(4, 2, 16, 2, 64, dtype=torch.float16)
    >>> qo_indptr = torch.tensor([0, 3, 8], dtype=torch.int32)
    >>> w.plan(qo_indptr, torch.tensor([0, 1, 4], dtype=torch.int32), torch.arange(4, dtype=torch.int32),
    ...        torch.tensor([9, 2], dtype=torch.int32), 8, 2, 64, 16, causal=True)
    >>> w.run(torch.randn(8, 8, 64, dtype=torch.float16), cache).shape
    torch.Size([8, 8, 64])
    """

    _paged = True
    _required_buffers = ("qo_indptr_buf", "paged_kv_indptr_buf", "paged_kv_indices_buf", "paged_kv_last_page_len_buf")

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        paged_kv_indptr_buf: torch.Tensor | None = None,
        paged_kv_indices_buf: torch.Tensor | None = None,
        paged_kv_last_page_len_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
        *,
        qk_indptr_buf: torch.Tensor | None = None,  # FlashInfer 0.2's name of mask_indptr_buf (same position)
        max_total_q: int | None = None,
        **kwargs,
    ):
        C.reject_unknown("BatchPrefillWithPagedKVCacheWrapper", kwargs)
        _reject_jit(jit_args, jit_kwargs, variant_owns_mask)
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            backend,
            dict(
                qo_indptr_buf=qo_indptr_buf,
                paged_kv_indptr_buf=paged_kv_indptr_buf,
                paged_kv_indices_buf=paged_kv_indices_buf,
                paged_kv_last_page_len_buf=paged_kv_last_page_len_buf,
                custom_mask_buf=custom_mask_buf,
                qk_indptr_buf=_mask_indptr_buf(qk_indptr_buf, mask_indptr_buf),
            ),
            max_total_q=max_total_q,
        )

    @C.bind_generations(8, _PAGED_PLAN_V02)
    def plan(
        self,
        qo_indptr: torch.Tensor,
        paged_kv_indptr: torch.Tensor,
        paged_kv_indices: torch.Tensor,
        paged_kv_last_page_len: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int | None = None,
        page_size: int | None = None,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        sm_scale: float | None = None,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        uniform_q_len: int | None = None,
        *,
        head_dim: int | None = None,
        allow_fp16_qk_reduction: bool = False,
        **kwargs,
    ) -> None:
        """Plan a batch: ``qo_indptr [B+1]`` splits the query rows, the CSR page table
        (``paged_kv_indptr [B+1]``, ``paged_kv_indices``, ``paged_kv_last_page_len [B]``, int32 or int64, CPU
        or device) gives each request's keys (or ``block_tables [B, max_blocks]`` with ``seq_lens``).
        ``custom_mask`` is the flat bool concatenation of every request's ``[qo_len, kv_len]`` mask (or
        ``packed_custom_mask``, packed per request with ``segment_packbits(bitorder="little")``); it replaces
        ``causal``. ``head_dim`` is the old name of ``head_dim_qk``.

        The positional order is FlashInfer 0.7's (``head_dim_vo`` 9th); FlashInfer 0.2's (``custom_mask``
        9th) is recognised by the argument types. ``seq_lens``, ``seq_lens_q``, ``max_token_per_sequence``,
        ``max_sequence_kv`` and ``uniform_q_len`` describe the batch and are checked against it; the
        multi-item scoring arguments (``prefix_len_ptr``, ...) are not supported and raise."""
        if kwargs:  # (every plan(): no set arithmetic when there is nothing to refuse)
            C.reject_unknown("BatchPrefillWithPagedKVCacheWrapper.plan", kwargs)
        _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        head_dim_qk = _resolve_head_dim(head_dim_qk, head_dim, head_dim_vo)
        if page_size is None:
            raise TypeError("plan() missing required argument: 'page_size'")
        qo_indptr = C.as_int32_index("qo_indptr", qo_indptr)
        paged_kv_indptr = C.as_int32_index("paged_kv_indptr", paged_kv_indptr)
        paged_kv_indices = C.as_int32_index("paged_kv_indices", paged_kv_indices)
        paged_kv_last_page_len = C.as_int32_index("paged_kv_last_page_len", paged_kv_last_page_len)
        if block_tables is not None:
            from .decode import block_table_to_csr

            ip, ix, lp = block_table_to_csr(block_tables, seq_lens, page_size)
            if paged_kv_indptr is not None or paged_kv_indices is not None:
                given = (paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len)
                nnz = int(ip[-1])
                if any(x is None for x in given) or not (
                    torch.equal(_host_i64(given[0]), ip.long())
                    and given[1].shape[0] >= nnz
                    and torch.equal(_host_i64(given[1][:nnz]), ix.long())
                    and torch.equal(_host_i64(given[2]), lp.long())
                ):
                    raise C.value_error(
                        "block_tables", "the same pages as the CSR page table given beside it", "different pages"
                    )
            else:
                paged_kv_indptr, paged_kv_indices, paged_kv_last_page_len = ip, ix, lp
        # (the options by name: no locals() dict of every parameter)
        options = dict(
            num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, custom_mask=custom_mask,
            packed_custom_mask=packed_custom_mask if custom_mask is None else None, causal=causal,
            pos_encoding_mode=pos_encoding_mode, window_left=window_left, logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale, rope_scale=rope_scale, rope_theta=rope_theta, q_data_type=q_data_type,
            kv_data_type=kv_data_type, o_data_type=o_data_type, non_blocking=non_blocking,
            fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv, head_dim=head_dim_qk,
        )  # fmt: skip
        w = self._w
        t = read_table(
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            page_size,
            names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
            scratch=w._range_scratch(),
        )
        # (the table's numpy arrays go on as they are: _plan_common makes the batch's tensors of them)
        indptr_h, kv_lens, max_index, last_h = t.indptr, t.kv_lens, t.max_index, t.last
        batch_size = t.n
        _check_seq_lens(seq_lens, kv_lens if t.kv_lens_seq is None else t.kv_lens_seq)
        # (qo_indptr the very tensor of paged_kv_indptr, as an engine without cached prefixes at page size 1 passes
        # it: the table's checked host array serves, with nothing left to check)
        same = qo_indptr is paged_kv_indptr and type(indptr_h) is np.ndarray and indptr_h.dtype == np.int64
        qo_h = self._qo_indptr(qo_indptr, batch_size, indptr_h if same else None)
        _check_batch_bounds(qo_h, kv_lens, seq_lens_q, max_token_per_sequence, max_sequence_kv, uniform_q_len)
        nnz = t.nnz
        graph_buffers = self._graph_buffers()
        if graph_buffers is not None and nnz > graph_buffers["kv_indices"].shape[0]:
            cap = graph_buffers["kv_indices"].shape[0]
            raise C.value_error("paged_kv_indices", f"at most {cap} pages (paged_kv_indices_buf)", nnz)
        w._plan_common(
            qo_indptr_host=qo_h,
            kv_indptr_host=indptr_h,
            kv_indices=paged_kv_indices,
            kv_lens_host=kv_lens,
            last_page_len_host=last_h,
            graph_buffers=graph_buffers,
            max_page_index=max_index,
            page_size=page_size,
            **options,
        )
        # (set once the plan succeeded: a plan() that raises leaves forward() the previous plan's arguments; the
        # options dict itself, completed, rather than a copy: _plan_common took its own mapping of it)
        options.update(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            page_size=page_size,
        )
        self._plan_args = options

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl=None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_sf=None,
        skip_softmax_threshold_scale_factor: float | None = None,
        use_fp16_softmax: bool | None = None,
        uses_spcompress: bool | None = None,
    ):
        """Attend ``q [qo_indptr[-1], num_qo_heads, head_dim]`` over ``paged_kv_cache``; returns ``o`` (and
        ``lse``, float32, ``[qo_indptr[-1], num_qo_heads]``, base 2; ``lse_base="ln"``: natural log;
        ``lse_layout="HN"``: ``[num_qo_heads, qo_indptr[-1]]``). ``sinks [num_qo_heads]``: a per-head sink logit
        added to every row's softmax denominator. Never synchronizes with the host, but for the first call after a
        plan whose page indices are on the device: it waits for the 8-byte copy of their range that plan() queued,
        if that has not landed yet."""
        fast = self._w._planned
        if (
            fast is not None
            and (fast := fast.fast_run) is not None
            and not args
            and lse is None
            and sinks is None
            and window_left is None
            and kv_cache_sf is None
            and skip_softmax_threshold_scale_factor is None
            and use_fp16_softmax is None
            and uses_spcompress is None
            and lse_base == "log2"
            and lse_layout == "NH"
            and not torch.compiler.is_compiling()
        ):
            # a call of the form the plan's first run() bound (RunBinding): its checks held for this form
            got = fast(q, paged_kv_cache, out, return_lse, (q_scale, k_scale, v_scale))
            if got is not None:
                return got
        if args:  # FlashInfer 0.2's run(q, paged_kv_cache, k_scale, v_scale, return_lse)
            k_scale, v_scale, return_lse = C.run_positionals_v02(
                "run", args, ("k_scale", "v_scale", "return_lse"), (k_scale, v_scale, return_lse)
            )
        # refused parameters are refused on every path, the compiled one included
        C.reject_run_extras(
            kv_cache_sf=kv_cache_sf,
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor,
            use_fp16_softmax=use_fp16_softmax,
            uses_spcompress=uses_spcompress,
        )
        if torch.compiler.is_compiling() and sinks is None and lse_base == "log2" and lse_layout == "NH":
            # the custom op: Dynamo does not trace the launch path
            return _custom_ops.run_wrapper(
                self, q, (paged_kv_cache,), out=out, lse=lse, return_lse=return_lse,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
            )  # fmt: skip
        p = self._w._require_plan()
        _check_run_window(window_left, p)
        k4, v4 = paged_kv_views(paged_kv_cache, self._w._kv_layout)
        return self._w._run_common(
            q,
            k4,
            v4,
            q_scale=q_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
            lse=lse,
            return_lse=return_lse,
            sinks=sinks,
            lse_base=lse_base,
            lse_layout=lse_layout,
            kv_src=paged_kv_cache,
        )

    def forward(
        self,
        q,
        paged_kv_cache,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
        *,
        allow_fp16_qk_reduction: bool = False,
    ):
        """Deprecated: ``run()`` with options given per call (re-plans when they differ from plan())."""
        self._w._require_plan("forward")
        self._replan_with(
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        return self.run(q, paged_kv_cache, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    # FlashInfer 0.7.2's members for its own workspaces and JIT variants (``_surface``).
    def workspace_size(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim_qk,
        page_size,
        head_dim_vo=None,
        custom_mask=None,
        packed_custom_mask=None,
        causal=False,
        pos_encoding_mode="NONE",
        use_fp16_qk_reduction=False,
        sm_scale=None,
        window_left=-1,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len=0,
        max_item_len_ptr=None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        max_token_per_sequence=None,
        max_sequence_kv=None,
        fixed_split_size=None,
        disable_split_kv=False,
        uniform_q_len=None,
    ) -> tuple[int, int]:
        """``(float_workspace_bytes, int_workspace_bytes)`` that ``plan()`` with these arguments uses of this
        wrapper's workspaces, measured on a probe wrapper (this one's plan and buffers are untouched)."""
        args = dict(locals())
        del args["self"]
        w = self._w
        buffers = {name: _surface.scratch_like(buf) for name, buf in self._buffers.items()}
        probe = BatchPrefillWithPagedKVCacheWrapper(
            w._float_workspace_buffer, w._kv_layout, w._use_cuda_graph, backend=w._backend,
            max_total_q=w._max_total_q, **buffers,
        )  # fmt: skip
        return _surface.workspace_size(self, probe, args)

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """FlashInfer loads a JIT variant for K and V of different strides here; the kernels of this package take
        both strides as arguments, so after FlashInfer's checks there is nothing to load."""
        _surface.prewarm_paged_kv_stride_variant(type(self).__name__, self._w.current_plan is not None, variant)


class BatchPrefillWithRaggedKVCacheWrapper(_PrefillWrapperBase):
    """Batch prefill over ragged K/V: request i's keys are rows ``kv_indptr[i]:kv_indptr[i+1]`` of
    ``k, v [kv_indptr[-1], num_kv_heads, head_dim]`` (NHD). ``plan()`` once, ``run()`` per layer.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    >>> w.plan(torch.tensor([0, 3, 5], dtype=torch.int32), torch.tensor([0, 4, 9], dtype=torch.int32), 4, 2, 64,
    ...        causal=True)
    >>> k = torch.randn(9, 2, 64, dtype=torch.float16)
    >>> w.run(torch.randn(5, 4, 64, dtype=torch.float16), k, torch.randn_like(k)).shape
    torch.Size([5, 4, 64])
    """

    _paged = False
    _required_buffers = ("qo_indptr_buf", "kv_indptr_buf")

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf: torch.Tensor | None = None,
        kv_indptr_buf: torch.Tensor | None = None,
        custom_mask_buf: torch.Tensor | None = None,
        mask_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        jit_kwargs=None,
        variant_owns_mask: bool = False,
        *,
        qk_indptr_buf: torch.Tensor | None = None,  # FlashInfer 0.2's name of mask_indptr_buf (same position)
        max_total_q: int | None = None,
        **kwargs,
    ):
        C.reject_unknown("BatchPrefillWithRaggedKVCacheWrapper", kwargs)
        _reject_jit(jit_args, jit_kwargs, variant_owns_mask)
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            backend,
            dict(
                qo_indptr_buf=qo_indptr_buf,
                kv_indptr_buf=kv_indptr_buf,
                custom_mask_buf=custom_mask_buf,
                qk_indptr_buf=_mask_indptr_buf(qk_indptr_buf, mask_indptr_buf),
            ),
            max_total_q=max_total_q,
        )

    @C.bind_generations(5, _RAGGED_PLAN_V02)
    def plan(
        self,
        qo_indptr: torch.Tensor,
        kv_indptr: torch.Tensor,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim_qk: int | None = None,
        head_dim_vo: int | None = None,
        custom_mask: torch.Tensor | None = None,
        packed_custom_mask: torch.Tensor | None = None,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        non_blocking: bool = True,
        prefix_len_ptr=None,
        token_pos_in_items_ptr=None,
        token_pos_in_items_len: int = 0,
        max_item_len_ptr=None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        seq_lens=None,
        seq_lens_q=None,
        max_token_per_sequence: int | None = None,
        max_sequence_kv: int | None = None,
        v_indptr=None,
        o_indptr=None,
        uniform_q_len: int | None = None,
        *,
        head_dim: int | None = None,
        allow_fp16_qk_reduction: bool = False,
        **kwargs,
    ) -> None:
        """Plan a batch: ``qo_indptr [B+1]`` and ``kv_indptr [B+1]`` (int32 or int64, CPU or device) split the
        query rows and the key rows. Masks and options as in the paged wrapper. The positional order is
        FlashInfer 0.7's (``head_dim_vo`` 6th); 0.2's (``custom_mask`` 6th) is recognised by the argument types.
        ``v_indptr`` / ``o_indptr`` may only repeat ``kv_indptr`` / ``qo_indptr`` (separate V and output rows
        are not supported)."""
        C.reject_unknown("BatchPrefillWithRaggedKVCacheWrapper.plan", kwargs)
        _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr)
        head_dim_qk = _resolve_head_dim(head_dim_qk, head_dim, head_dim_vo)
        qo_indptr = C.as_int32_index("qo_indptr", qo_indptr)
        kv_indptr = C.as_int32_index("kv_indptr", kv_indptr)
        for name, given, same in (("v_indptr", v_indptr, kv_indptr), ("o_indptr", o_indptr, qo_indptr)):
            if given is not None and not (
                isinstance(given, torch.Tensor)
                and given.shape == same.shape
                and torch.equal(_host_i64(given), _host_i64(same))
            ):
                other = "kv_indptr" if name == "v_indptr" else "qo_indptr"
                raise NotImplementedError(f"{name}: only None or a copy of {other} is supported")
        options = _plan_options(locals(), head_dim_qk)
        w = self._w
        C.check_index_tensor("kv_indptr", kv_indptr)
        batch_size = kv_indptr.shape[0] - 1
        kv_h = _host_i64(kv_indptr)
        C.check_indptr_host("kv_indptr", kv_h)
        kv_lens = kv_h[1:] - kv_h[:-1]
        _check_seq_lens(seq_lens, kv_lens)
        qo_h = self._qo_indptr(qo_indptr, batch_size)
        _check_batch_bounds(qo_h, kv_lens, seq_lens_q, max_token_per_sequence, max_sequence_kv, uniform_q_len)
        w._plan_common(
            qo_indptr_host=qo_h,
            kv_indptr_host=kv_h,
            kv_indices=None,
            kv_lens_host=kv_lens,
            graph_buffers=self._graph_buffers(),
            max_page_index=-1,
            page_size=1,
            **options,
        )
        # (set once the plan succeeded: a plan() that raises leaves forward() the previous plan's arguments)
        self._plan_args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, **options)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
        o_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        lse_base: str = "log2",
        lse_layout: str = "NH",
        enable_pdl=None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        kv_cache_sf=None,
    ):
        """Attend ``q [qo_indptr[-1], Hq, D]`` over ``k, v [kv_indptr[-1], Hkv, D]``; returns ``o`` (and
        ``lse``: base 2 unless ``lse_base="ln"``, ``lse_layout`` "NH" or "HN"). ``o_scale`` multiplies the
        output. Never synchronizes with the host."""
        fast = self._w._planned
        if (
            fast is not None
            and (fast := fast.fast_run) is not None
            and not args
            and lse is None
            and sinks is None
            and window_left is None
            and kv_cache_sf is None
            and o_scale is None
            and lse_base == "log2"
            and lse_layout == "NH"
            and not torch.compiler.is_compiling()
        ):
            # a call of the form the plan's first run() bound (RunBinding): its checks held for this form
            got = fast(q, (k, v), out, return_lse, (q_scale, k_scale, v_scale))
            if got is not None:
                return got
        if args:  # FlashInfer 0.2's run(q, k, v, return_lse)
            (return_lse,) = C.run_positionals_v02("run", args, ("return_lse",), (return_lse,))
        plain = sinks is None and lse_base == "log2" and lse_layout == "NH" and o_scale is None
        C.reject_run_extras(kv_cache_sf=kv_cache_sf)  # refused on every path, the compiled one included
        if torch.compiler.is_compiling() and plain:  # the custom op: Dynamo does not trace the launch path
            return _custom_ops.run_wrapper(
                self, q, (k, v), out=out, lse=lse, return_lse=return_lse,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
            )  # fmt: skip
        p = self._w._require_plan()
        _check_run_window(window_left, p)
        k4 = ragged_kv_view(k, self._w._kv_layout, "k")
        v4 = ragged_kv_view(v, self._w._kv_layout, "v")
        if k4.shape != v4.shape:
            raise C.value_error("v", f"the shape of k {C.shape_str(k.shape)}", C.shape_str(v.shape))
        if v4.dtype != k4.dtype:
            raise C.type_error("v", f"the dtype of k ({k4.dtype})", str(v4.dtype))
        if o_scale is not None:
            v_scale = C.resolve_scale("v_scale", v_scale) * C.resolve_scale("o_scale", o_scale)
        return self._w._run_common(
            q,
            k4,
            v4,
            q_scale=q_scale,
            k_scale=k_scale,
            v_scale=v_scale,
            out=out,
            lse=lse,
            return_lse=return_lse,
            sinks=sinks,
            lse_base=lse_base,
            lse_layout=lse_layout,
            kv_src=(k, v) if o_scale is None else None,
        )

    def forward(
        self,
        q,
        k,
        v,
        causal: bool = False,
        pos_encoding_mode: str = "NONE",
        use_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
        *,
        allow_fp16_qk_reduction: bool = False,
    ):
        """Deprecated: ``run()`` with options given per call (re-plans when they differ from plan())."""
        self._w._require_plan("forward")
        self._replan_with(
            causal=causal,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        return self.run(q, k, v, return_lse=return_lse)


def _small_indptr(indptr: torch.Tensor):
    """The int64 numpy copy of a short host indptr that starts at 0 and never decreases, checked on Python ints
    (``tolist()`` and a short loop cost less than numpy's operations on an array of a few entries); None when
    it breaks either rule, for the general check to name it."""
    values = indptr.tolist()
    prev = values[0]
    if prev != 0:
        return None
    for cur in values:
        if cur < prev:
            return None
        prev = cur
    return np.array(values, dtype=np.int64)


def _mask_indptr_buf(qk_indptr_buf, mask_indptr_buf):
    """0.2's ``qk_indptr_buf`` and 0.7's ``mask_indptr_buf`` are one buffer under two names."""
    if qk_indptr_buf is not None and mask_indptr_buf is not None and qk_indptr_buf is not mask_indptr_buf:
        raise ValueError("mask_indptr_buf: give it or qk_indptr_buf (its FlashInfer 0.2 name), not both")
    return qk_indptr_buf if qk_indptr_buf is not None else mask_indptr_buf


def _reject_jit(jit_args, jit_kwargs, variant_owns_mask) -> None:
    for name, value in (("jit_args", jit_args), ("jit_kwargs", jit_kwargs)):
        if value is not None:
            raise NotImplementedError(f"{name}: custom JIT attention variants are not supported by flashinfer_triton")
    if variant_owns_mask:
        raise NotImplementedError("variant_owns_mask: custom JIT attention variants are not supported")


def _reject_multi_item(prefix_len_ptr, token_pos_in_items_ptr, token_pos_in_items_len, max_item_len_ptr) -> None:
    """FlashInfer's multi-item scoring arguments: not implemented here, so an error when set."""
    if (
        prefix_len_ptr is None
        and token_pos_in_items_ptr is None
        and token_pos_in_items_len in (0, None)
        and max_item_len_ptr is None
    ):
        return  # (every plan(): no dict of the four)
    given = {
        "prefix_len_ptr": prefix_len_ptr is not None,
        "token_pos_in_items_ptr": token_pos_in_items_ptr is not None,
        "token_pos_in_items_len": token_pos_in_items_len not in (0, None),
        "max_item_len_ptr": max_item_len_ptr is not None,
    }
    for name, is_set in given.items():
        if is_set:
            raise NotImplementedError(f"{name}: multi-item scoring is not supported by flashinfer_triton")


def _check_batch_bounds(qo_h, kv_lens, seq_lens_q, max_token_per_sequence, max_sequence_kv, uniform_q_len) -> None:
    """The batch descriptions engines pass beside the index arrays must agree with them."""
    # (int64 numpy arrays, or host tensors taken as numpy views: numpy's operations cost less host time)
    if seq_lens_q is None and max_token_per_sequence is None and max_sequence_kv is None and uniform_q_len is None:
        return  # (the usual plan(): nothing to compare)
    qo = qo_h if type(qo_h) is np.ndarray else qo_h.numpy()
    kv_lens = kv_lens if type(kv_lens) is np.ndarray else kv_lens.numpy()
    qo_lens = qo[1:] - qo[:-1]
    if seq_lens_q is not None:
        C.check_tensor("seq_lens_q", seq_lens_q, dim=1)
        if not same_lengths(seq_lens_q, qo_lens):
            raise C.value_error("seq_lens_q", "the query lengths qo_indptr gives", "different lengths")
    if max_token_per_sequence is None and max_sequence_kv is None and uniform_q_len is None:
        return
    longest_q = int(qo_lens.max()) if len(qo_lens) else 0
    longest_kv = int(kv_lens.max()) if len(kv_lens) else 0
    for name, bound, longest in (
        ("max_token_per_sequence", max_token_per_sequence, longest_q),
        ("max_sequence_kv", max_sequence_kv, longest_kv),
    ):
        if bound is None:
            continue
        if isinstance(bound, bool) or not isinstance(bound, int):
            raise C.type_error(name, "an int or None", type(bound).__name__)
        if bound < longest:
            raise C.value_error(name, f"at least the longest request's {longest}", bound)
    if uniform_q_len is not None:
        if isinstance(uniform_q_len, bool) or not isinstance(uniform_q_len, int):
            raise C.type_error("uniform_q_len", "an int or None", type(uniform_q_len).__name__)
        if len(qo_lens) and not bool((qo_lens == uniform_q_len).all()):
            raise C.value_error("uniform_q_len", "every request's query length", f"{uniform_q_len} (lengths differ)")


_OPTION_NAMES = (
    "num_qo_heads",
    "num_kv_heads",
    "custom_mask",
    "packed_custom_mask",
    "causal",
    "pos_encoding_mode",
    "window_left",
    "logits_soft_cap",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "q_data_type",
    "kv_data_type",
    "o_data_type",
    "non_blocking",
    "fixed_split_size",
    "disable_split_kv",
)


def _plan_options(args: dict, head_dim: int) -> dict:
    """The options both prefill plans pass on unchanged (a custom mask wins over a packed one)."""
    options = {name: args[name] for name in _OPTION_NAMES}
    options["head_dim"] = head_dim
    if options["custom_mask"] is not None:
        options["packed_custom_mask"] = None
    return options


def _resolve_head_dim(head_dim_qk, head_dim, head_dim_vo):
    if head_dim_qk is None:
        head_dim_qk = head_dim
    if head_dim_qk is None:
        raise TypeError("plan() missing required argument: 'head_dim_qk'")
    if head_dim is not None and head_dim != head_dim_qk:
        raise C.value_error("head_dim", f"head_dim_qk ({head_dim_qk}) when both are given", head_dim)
    if head_dim_vo is not None and head_dim_vo != head_dim_qk:
        raise C.value_error(
            "head_dim_vo", f"head_dim_qk ({head_dim_qk}): different V head dims are not supported", head_dim_vo
        )
    return head_dim_qk


def _check_seq_lens(seq_lens, kv_lens):
    if seq_lens is None:
        return
    C.check_tensor("seq_lens", seq_lens, dim=1)
    if type(kv_lens) is not np.ndarray and type(kv_lens) is not list:  # (a small table's list: compared as one)
        kv_lens = kv_lens.numpy()
    if not same_lengths(seq_lens, kv_lens):
        raise C.value_error("seq_lens", "the KV lengths the page table gives", "different lengths")


def _check_run_window(window_left, planned):
    if window_left is not None and window_left != planned.opts.window_left:
        raise ValueError(
            f"window_left: expected the planned value {planned.opts.window_left} (set it in plan()), got {window_left}"
        )
