"""Prefill and append attention: ragged queries over paged or ragged KV (FlashInfer's ``flashinfer.prefill``)."""

from __future__ import annotations

import functools

import torch

from . import _checks as C
from ._layout import paged_kv_views, ragged_kv_view
from ._wrapper import PublicWrapperSurface, _AttentionWrapper, _host_i64, read_page_table, run_single
from .decode import _reject_unknown

__all__ = [
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
]


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    allow_fp16_qk_reduction: bool = False,
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
    backend: str = "auto",
    k_scale: float | None = None,
    v_scale: float | None = None,
    o_dtype=None,
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
    custom_mask : bool ``[qo_len, kv_len]`` (True = attend); replaces ``causal``.
    packed_custom_mask : the same mask flattened and packed with ``packbits(..., bitorder="little")``.
    causal : aligned to the bottom right: key ``j`` is visible to query ``i`` iff ``j <= i + kv_len - qo_len``.
    window_left : keys more than ``window_left`` before the diagonal are masked; -1 for none.
    return_lse : also return the log-sum-exp, **base 2**, ``[qo_len, num_qo_heads]`` float32.

    ``allow_fp16_qk_reduction`` and ``backend`` are accepted performance hints that never change results.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> q = torch.randn(7, 8, 64, dtype=torch.float16)
    >>> k = torch.randn(20, 2, 64, dtype=torch.float16); v = torch.randn_like(k)
    >>> fi.single_prefill_with_kv_cache(q, k, v, causal=True).shape
    torch.Size([7, 8, 64])
    """
    _reject_unknown("single_prefill_with_kv_cache", kwargs)
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
    return run_single(
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
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
        o_dtype=o_dtype,
    )


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

    def _qo_indptr(self, qo_indptr, batch_size):
        C.check_index_tensor("qo_indptr", qo_indptr, length=batch_size + 1, what="[batch_size + 1]")
        qo_h = _host_i64(qo_indptr)
        C.check_indptr_host("qo_indptr", qo_h)
        w = self._w
        if w._use_cuda_graph and batch_size > w._fixed_batch_size:
            cap = w._fixed_batch_size
            raise C.value_error("qo_indptr", f"at most {cap} requests (CUDA-graph buffers)", batch_size)
        if w._use_cuda_graph:
            total = int(qo_h[-1])
            if w._max_total_q is None:
                w._max_total_q = max(2 * total, w._fixed_batch_size, 1)
            if total > w._max_total_q:
                raise C.value_error(
                    "qo_indptr",
                    f"at most {w._max_total_q} query rows in total (CUDA-graph capacity: the wrapper's "
                    "max_total_q, else twice the first plan's rows)",
                    f"{total} rows",
                )
        return qo_h

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
        qk_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        max_total_q: int | None = None,
        **kwargs,
    ):
        _reject_unknown(
            "BatchPrefillWithPagedKVCacheWrapper", {k: v for k, v in kwargs.items() if k != "mask_indptr_buf"}
        )
        if qk_indptr_buf is None:
            qk_indptr_buf = kwargs.get("mask_indptr_buf")
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
                qk_indptr_buf=qk_indptr_buf,
            ),
            max_total_q=max_total_q,
        )

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
        head_dim: int | None = None,
        seq_lens=None,
        seq_lens_q=None,
        block_tables=None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        allow_fp16_qk_reduction: bool = False,
        **kwargs,
    ) -> None:
        """Plan a batch: ``qo_indptr [B+1]`` splits the query rows, the CSR page table
        (``paged_kv_indptr [B+1]``, ``paged_kv_indices``, ``paged_kv_last_page_len [B]``, int32, CPU or
        device) gives each request's keys. ``custom_mask`` is the flat bool concatenation of every
        request's ``[qo_len, kv_len]`` mask (or ``packed_custom_mask``, packed per request with
        ``segment_packbits(bitorder="little")``); it replaces ``causal``. ``head_dim`` is the old name of
        ``head_dim_qk``."""
        _reject_unknown("BatchPrefillWithPagedKVCacheWrapper.plan", kwargs)
        head_dim_qk = _resolve_head_dim(head_dim_qk, head_dim, head_dim_vo)
        if page_size is None:
            raise TypeError("plan() missing required argument: 'page_size'")
        options = _plan_options(locals(), head_dim_qk)
        self._plan_args = dict(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            page_size=page_size,
            **options,
        )
        w = self._w
        indptr_h, kv_lens, max_index, last_h = read_page_table(
            paged_kv_indptr,
            paged_kv_indices,
            paged_kv_last_page_len,
            page_size,
            names=("paged_kv_indptr", "paged_kv_indices", "paged_kv_last_page_len"),
            scratch=w._range_scratch(),
        )
        batch_size = kv_lens.numel()
        _check_seq_lens(seq_lens, kv_lens)
        qo_h = self._qo_indptr(qo_indptr, batch_size)
        nnz = int(indptr_h[-1])
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

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *args,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl=None,
        window_left: int | None = None,
    ):
        """Attend ``q [qo_indptr[-1], num_qo_heads, head_dim]`` over ``paged_kv_cache``; returns ``o``
        (and ``lse [qo_indptr[-1], num_qo_heads]``, float32, base 2). Never synchronizes with the host."""
        if args:
            raise TypeError("run(): pass k_scale, v_scale, out, lse, return_lse by keyword")
        p = self._w._require_plan()
        _check_run_window(window_left, p)
        k4, v4 = paged_kv_views(paged_kv_cache, self._w._kv_layout)
        return self._w._run_common(q, k4, v4, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=return_lse)

    def forward(
        self,
        q,
        paged_kv_cache,
        causal: bool = True,
        pos_encoding_mode: str = "NONE",
        allow_fp16_qk_reduction: bool = False,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
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
        qk_indptr_buf: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
        max_total_q: int | None = None,
        **kwargs,
    ):
        _reject_unknown(
            "BatchPrefillWithRaggedKVCacheWrapper", {k: v for k, v in kwargs.items() if k != "mask_indptr_buf"}
        )
        if qk_indptr_buf is None:
            qk_indptr_buf = kwargs.get("mask_indptr_buf")
        super().__init__(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph,
            backend,
            dict(
                qo_indptr_buf=qo_indptr_buf,
                kv_indptr_buf=kv_indptr_buf,
                custom_mask_buf=custom_mask_buf,
                qk_indptr_buf=qk_indptr_buf,
            ),
            max_total_q=max_total_q,
        )

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
        head_dim: int | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        allow_fp16_qk_reduction: bool = False,
        seq_lens=None,
        seq_lens_q=None,
        **kwargs,
    ) -> None:
        """Plan a batch: ``qo_indptr [B+1]`` and ``kv_indptr [B+1]`` (int32, CPU or device) split the
        query rows and the key rows. Masks and options as in the paged wrapper."""
        _reject_unknown("BatchPrefillWithRaggedKVCacheWrapper.plan", kwargs)
        head_dim_qk = _resolve_head_dim(head_dim_qk, head_dim, head_dim_vo)
        options = _plan_options(locals(), head_dim_qk)
        self._plan_args = dict(qo_indptr=qo_indptr, kv_indptr=kv_indptr, **options)
        w = self._w
        C.check_index_tensor("kv_indptr", kv_indptr)
        batch_size = kv_indptr.shape[0] - 1
        kv_h = _host_i64(kv_indptr)
        C.check_indptr_host("kv_indptr", kv_h)
        kv_lens = kv_h[1:] - kv_h[:-1]
        _check_seq_lens(seq_lens, kv_lens)
        qo_h = self._qo_indptr(qo_indptr, batch_size)
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

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        *args,
        k_scale: float | None = None,
        v_scale: float | None = None,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        enable_pdl=None,
        window_left: int | None = None,
    ):
        """Attend ``q [qo_indptr[-1], Hq, D]`` over ``k, v [kv_indptr[-1], Hkv, D]``; returns ``o``
        (and base-2 ``lse``). Never synchronizes with the host."""
        if args:
            raise TypeError("run(): pass k_scale, v_scale, out, lse, return_lse by keyword")
        p = self._w._require_plan()
        _check_run_window(window_left, p)
        k4 = ragged_kv_view(k, self._w._kv_layout, "k")
        v4 = ragged_kv_view(v, self._w._kv_layout, "v")
        if k4.shape != v4.shape:
            raise C.value_error("v", f"the shape of k {C.shape_str(k.shape)}", C.shape_str(v.shape))
        if v4.dtype != k4.dtype:
            raise C.type_error("v", f"the dtype of k ({k4.dtype})", str(v4.dtype))
        return self._w._run_common(q, k4, v4, k_scale=k_scale, v_scale=v_scale, out=out, lse=lse, return_lse=return_lse)

    def forward(
        self,
        q,
        k,
        v,
        causal: bool = True,
        pos_encoding_mode: str = "NONE",
        allow_fp16_qk_reduction: bool = False,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
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
    if seq_lens.shape[0] != kv_lens.numel() or not torch.equal(_host_i64(seq_lens), kv_lens):
        raise C.value_error("seq_lens", "the KV lengths the page table gives", "different lengths")


def _check_run_window(window_left, planned):
    if window_left is not None and window_left != planned["opts"].window_left:
        raise ValueError(
            f"window_left: expected the planned value {planned['opts'].window_left} (set it in plan()), "
            f"got {window_left}"
        )
