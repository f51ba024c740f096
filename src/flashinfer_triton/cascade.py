"""Attention states, their merge, and cascade (shared-prefix) attention (FlashInfer's ``flashinfer.cascade``).

An attention state is ``(v, s)``: the softmax-weighted values over a set of keys and the base-2
log-sum-exp of the scores. States over disjoint key sets merge exactly:
``s = log2(2**s_a + 2**s_b)``, ``v = (2**s_a * v_a + 2**s_b * v_b) / 2**s``; the operation is
associative and commutative, and an empty state (``s = -inf``) is its identity.
"""

from __future__ import annotations

import torch

from . import _checks as C
from ._layout import ragged_kv_view
from ._merge_api import merge_state, merge_state_in_place, merge_states
from .decode import BatchDecodeWithPagedKVCacheWrapper
from .prefill import BatchPrefillWithPagedKVCacheWrapper, single_prefill_with_kv_cache

__all__ = [
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "MultiLevelCascadeAttentionWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
]


class MultiLevelCascadeAttentionWrapper:
    """Cascade attention over ``num_levels`` page tables that all index one paged KV cache.

    Level ``l`` has its own ``qo_indptr``: its request ``r`` serves query rows
    ``qo_indptr[r]:qo_indptr[r+1]``. A shared prefix is a level with one request covering every query
    row (``qo_indptr = [0, total]``): its keys are then read once per tile for all those queries, which
    are packed as the rows of the tile. The levels' states are merged; ``causal`` applies to the last
    level only.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> w = fi.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 20, dtype=torch.uint8))
    >>> cache = torch.randn(8, 2, 16, 2, 64, dtype=torch.float16)
    >>> i32 = lambda *x: torch.tensor(x, dtype=torch.int32)
    >>> w.plan([i32(0, 4), i32(0, 2, 4)], [i32(0, 4), i32(0, 2, 4)], [i32(0, 1, 2, 3), i32(4, 5, 6, 7)],
    ...        [i32(16), i32(3, 16)], 8, 2, 64, 16)
    >>> w.run(torch.randn(4, 8, 64, dtype=torch.float16), cache).shape
    torch.Size([4, 8, 64])
    """

    def __init__(
        self,
        num_levels: int,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        qo_indptr_buf_arr=None,
        paged_kv_indptr_buf_arr=None,
        paged_kv_indices_buf_arr=None,
        paged_kv_last_page_len_buf_arr=None,
        backend: str = "auto",
    ):
        C.check_positive_int("num_levels", num_levels)
        C.check_kv_layout(kv_layout)
        arrays = {
            "qo_indptr_buf_arr": qo_indptr_buf_arr,
            "paged_kv_indptr_buf_arr": paged_kv_indptr_buf_arr,
            "paged_kv_indices_buf_arr": paged_kv_indices_buf_arr,
            "paged_kv_last_page_len_buf_arr": paged_kv_last_page_len_buf_arr,
        }
        if use_cuda_graph:
            for name, arr in arrays.items():
                if arr is None or len(arr) != num_levels:
                    got = "None" if arr is None else f"{len(arr)} buffers"
                    raise C.value_error(name, f"a list of num_levels = {num_levels} buffers (use_cuda_graph=True)", got)
        self._num_levels = num_levels
        self._kv_layout = kv_layout
        self._wrappers = [
            BatchPrefillWithPagedKVCacheWrapper(
                float_workspace_buffer,
                kv_layout,
                use_cuda_graph=use_cuda_graph,
                qo_indptr_buf=qo_indptr_buf_arr[i] if use_cuda_graph else None,
                paged_kv_indptr_buf=paged_kv_indptr_buf_arr[i] if use_cuda_graph else None,
                paged_kv_indices_buf=paged_kv_indices_buf_arr[i] if use_cuda_graph else None,
                paged_kv_last_page_len_buf=paged_kv_last_page_len_buf_arr[i] if use_cuda_graph else None,
                backend=backend,
            )
            for i in range(num_levels)
        ]
        # Each level keeps its own int workspace: every level is planned before any runs, and in CUDA-graph
        # mode a level's work list lives in its int workspace, so one shared buffer would be overwritten.
        self._planned = False

    @property
    def _int_workspace_buffer(self) -> torch.Tensor:
        """Level 0's int workspace (each level has its own)."""
        return self._wrappers[0]._int_workspace_buffer

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffers=None) -> None:
        for i, w in enumerate(self._wrappers):
            int_ws = None
            if int_workspace_buffers is not None:
                int_ws = (
                    int_workspace_buffers[i]
                    if isinstance(int_workspace_buffers, (list, tuple))
                    else int_workspace_buffers
                )
            w.reset_workspace_buffer(float_workspace_buffer, int_ws)

    def plan(
        self,
        qo_indptr_arr,
        paged_kv_indptr_arr,
        paged_kv_indices_arr,
        paged_kv_last_page_len,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
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
    ) -> None:
        """Plan every level: lists of ``num_levels`` tensors (``qo_indptr``, page-table ``indptr``,
        ``indices`` and ``last_page_len``). Every level's ``qo_indptr[-1]`` must be the same number of rows."""
        lists = {
            "qo_indptr_arr": qo_indptr_arr,
            "paged_kv_indptr_arr": paged_kv_indptr_arr,
            "paged_kv_indices_arr": paged_kv_indices_arr,
            "paged_kv_last_page_len": paged_kv_last_page_len,
        }
        for name, arr in lists.items():
            if not isinstance(arr, (list, tuple)) or len(arr) != self._num_levels:
                got = f"{len(arr)} entries" if isinstance(arr, (list, tuple)) else type(arr).__name__
                raise C.value_error(name, f"a list of num_levels = {self._num_levels} tensors", got)
        total = None
        for level, w in enumerate(self._wrappers):
            C.check_index_tensor(f"qo_indptr_arr[{level}]", qo_indptr_arr[level])
            rows = int(qo_indptr_arr[level][-1])
            if total is not None and rows != total:
                raise C.value_error(f"qo_indptr_arr[{level}]", f"qo_indptr[-1] = {total} like level 0", rows)
            total = rows
            w.plan(
                qo_indptr_arr[level],
                paged_kv_indptr_arr[level],
                paged_kv_indices_arr[level],
                paged_kv_last_page_len[level],
                num_qo_heads,
                num_kv_heads,
                head_dim,
                page_size,
                causal=causal and level == self._num_levels - 1,
                pos_encoding_mode=pos_encoding_mode,
                sm_scale=sm_scale,
                window_left=window_left,
                logits_soft_cap=logits_soft_cap,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
            )
        self._planned = True

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, return_lse: bool = False):
        """``q [rows, num_qo_heads, head_dim]`` over all levels; returns ``o`` (and base-2 ``lse``)."""
        if not self._planned:
            raise RuntimeError("MultiLevelCascadeAttentionWrapper.run() called before plan(): call plan() first")
        out, lse = self._wrappers[0].run(q, paged_kv_cache, return_lse=True)
        for w in self._wrappers[1:]:
            o_level, lse_level = w.run(q, paged_kv_cache, return_lse=True)
            merge_state_in_place(out, lse, o_level, lse_level)
        return (out, lse) if return_lse else out

    forward = run

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""


class BatchDecodeWithSharedPrefixPagedKVCacheWrapper:
    """Decode for requests that share a prefix (FlashInfer's legacy two-level API): the shared K/V come as
    plain tensors, each request's own tokens as a paged cache. The shared keys are read once for all
    ``batch_size * num_qo_heads`` query rows, then merged with each request's unique-KV state."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"):
        self._kv_layout = C.check_kv_layout(kv_layout)
        self._batch_decode_wrapper = BatchDecodeWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._planned = False

    def begin_forward(
        self,
        unique_kv_indptr,
        unique_kv_indices,
        unique_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        data_type="float16",
        q_data_type=None,
    ) -> None:
        """Plan the unique (per-request) level."""
        q_dtype = data_type if q_data_type is None else q_data_type
        self._batch_decode_wrapper.plan(
            unique_kv_indptr,
            unique_kv_indices,
            unique_kv_last_page_len,
            num_qo_heads,
            num_kv_heads,
            head_dim,
            page_size,
            q_data_type=q_dtype,
            kv_data_type=data_type,
        )
        self._planned = True

    plan = begin_forward

    def forward(
        self,
        q: torch.Tensor,
        k_shared: torch.Tensor,
        v_shared: torch.Tensor,
        unique_kv_cache,
        allow_fp16_qk_reduction: bool = False,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
    ) -> torch.Tensor:
        """``q [batch_size, Hq, D]``; ``k_shared, v_shared [shared_len, Hkv, D]`` (in ``kv_layout``)."""
        if not self._planned:
            raise RuntimeError("BatchDecodeWithSharedPrefixPagedKVCacheWrapper.forward() called before begin_forward()")
        ragged_kv_view(k_shared, self._kv_layout, "k_shared")
        v_shared_state, s_shared = single_prefill_with_kv_cache(
            q,
            k_shared,
            v_shared,
            causal=False,
            kv_layout=self._kv_layout,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            return_lse=True,
        )
        w = self._batch_decode_wrapper
        if sm_scale is not None and w._plan_args["sm_scale"] != sm_scale:
            w._w.plan(use_tensor_cores=w.use_tensor_cores, **{**w._plan_args, "sm_scale": sm_scale})
        v_unique, s_unique = w.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(v_shared_state, s_shared, v_unique, s_unique)
        return v_shared_state

    run = forward

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""


class BatchPrefillWithSharedPrefixPagedKVCacheWrapper:
    """Prefill for requests that share a prefix (FlashInfer's legacy two-level API): every query row
    attends to the shared K/V (non-causal, read once for all rows) and to its own request's paged KV
    (causal by default); the two states are merged."""

    def __init__(self, float_workspace_buffer: torch.Tensor, kv_layout: str = "NHD"):
        self._kv_layout = C.check_kv_layout(kv_layout)
        self._batch_prefill_wrapper = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._args = None

    def begin_forward(
        self,
        qo_indptr,
        paged_kv_indptr,
        paged_kv_indices,
        paged_kv_last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        q_data_type="float16",
        kv_data_type=None,
    ) -> None:
        """Plan the unique (per-request) level; ``causal`` and scales come with ``forward()``."""
        self._args = dict(
            qo_indptr=qo_indptr,
            paged_kv_indptr=paged_kv_indptr,
            paged_kv_indices=paged_kv_indices,
            paged_kv_last_page_len=paged_kv_last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim_qk=head_dim,
            page_size=page_size,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
        )
        self._batch_prefill_wrapper.plan(**self._args, causal=True)

    plan = begin_forward

    def forward(
        self,
        q: torch.Tensor,
        k_shared: torch.Tensor,
        v_shared: torch.Tensor,
        unique_kv_cache,
        causal: bool = True,
        allow_fp16_qk_reduction: bool = False,
        sm_scale=None,
        logits_soft_cap=None,
        rope_scale=None,
        rope_theta=None,
    ) -> torch.Tensor:
        """``q [qo_indptr[-1], Hq, D]``; shared K/V ``[shared_len, Hkv, D]`` (in ``kv_layout``)."""
        if self._args is None:
            raise RuntimeError(
                "BatchPrefillWithSharedPrefixPagedKVCacheWrapper.forward() called before begin_forward()"
            )
        v_state, s_state = single_prefill_with_kv_cache(
            q,
            k_shared,
            v_shared,
            causal=False,
            kv_layout=self._kv_layout,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            return_lse=True,
        )
        self._batch_prefill_wrapper.plan(
            **self._args,
            causal=causal,
            sm_scale=sm_scale,
            logits_soft_cap=logits_soft_cap,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        v_unique, s_unique = self._batch_prefill_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(v_state, s_state, v_unique, s_unique)
        return v_state

    run = forward

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""
