"""Attention states, their merge, and cascade (shared-prefix) attention (FlashInfer's ``flashinfer.cascade``).

An attention state is ``(v, s)``: the softmax-weighted values over a set of keys and the base-2
log-sum-exp of the scores. States over disjoint key sets merge exactly:
``s = log2(2**s_a + 2**s_b)``, ``v = (2**s_a * v_a + 2**s_b * v_b) / 2**s``; the operation is
associative and commutative, and an empty state (``s = -inf``) is its identity.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from . import _checks as C
from . import _config, _custom_ops, _surface, _work_row
from ._backend import AttentionBatch
from ._config import num_sms as _num_sms
from ._layout import paged_kv_views, ragged_kv_view
from ._merge_api import merge_state, merge_state_in_place, merge_states
from ._wrapper import PendingPageRange, PlanInfo, RunBinding, check_lse_base, check_page_range, finish_lse
from ._wrapper import plan_info as _plan_info
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


@dataclasses.dataclass(frozen=True)
class CascadePlanInfo:
    """What ``MultiLevelCascadeAttentionWrapper.plan_info()`` reports of the current plan.

    ``fused``: the :class:`PlanInfo` of the fused plan, every level in one attention launch plus one merge launch
    (``details["grid0"]``: its work items; ``arrays["part_o"]``: its partial states, ``P`` rows per query row);
    None when each level runs its own launches (CUDA-graph mode, a causal mask or window in effect, a level off
    the Triton prefill path). The fused plan's ``batch_size`` counts the requests of its combined batch:
    each level's requests plus one empty request after each level (``sum(B_l + 1)``, the length of
    ``arrays["kv_lens"]``). ``levels``: each level's own :class:`PlanInfo`."""

    fused: PlanInfo | None
    levels: tuple[PlanInfo, ...]


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
        self._use_cuda_graph = bool(use_cuda_graph)
        self._fused = None
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
    def is_cuda_graph_enabled(self) -> bool:
        return self._use_cuda_graph

    def plan_info(self) -> CascadePlanInfo | None:
        """What the current plan chose (:class:`CascadePlanInfo`); None before plan()."""
        if not self._planned:
            return None
        return CascadePlanInfo(_plan_info(self._fused), tuple(w.plan_info() for w in self._wrappers))

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
        *,
        allow_fp16_qk_reduction: bool | None = None,
    ) -> None:
        """Plan every level: lists of ``num_levels`` tensors (``qo_indptr``, page-table ``indptr``,
        ``indices`` and ``last_page_len``). Every level's ``qo_indptr[-1]`` must be the same number of rows.
        ``use_fp16_qk_reduction`` (``allow_fp16_qk_reduction``, its FlashInfer 0.2 name) is a precision hint:
        scores accumulate in float32 either way."""
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
        # Every level's qo_indptr is checked before any level is planned, so a bad one leaves the wrapper as it was.
        total = None
        for level in range(self._num_levels):
            name = f"qo_indptr_arr[{level}]"
            qo = C.as_int32_index(name, qo_indptr_arr[level])
            C.check_index_tensor(name, qo)
            if qo.shape[0] < 2:
                raise C.value_error(name, "shape [batch_size + 1] with batch_size >= 1", C.shape_str(qo.shape))
            rows = int(qo[-1])
            if total is not None and rows != total:
                raise C.value_error(name, f"qo_indptr[-1] = {total} like level 0", rows)
            total = rows
        self._planned = False
        self._fused = None
        for level, w in enumerate(self._wrappers):
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
        if not self._use_cuda_graph and _config.CASCADE.fused:
            self._fused = _FusedCascade.build([w._w for w in self._wrappers])
        self._planned = True

    begin_forward = plan

    def run(self, q: torch.Tensor, paged_kv_cache, return_lse: bool = False, *, lse_base: str = "log2"):
        """``q [rows, num_qo_heads, head_dim]`` over all levels; returns ``o`` (and ``lse``, base 2, or natural
        log with ``lse_base="ln"``).

        Never synchronizes with the host, but for the first call after a plan whose page indices are on the
        device (it waits for their range's 8-byte copy if that has not landed). With the fused plan (see
        ``_FusedCascade``) this is two kernel launches and one output allocation; otherwise each level runs on its
        own and is merged in place."""
        if check_lse_base(lse_base):
            if not return_lse:
                return self.run(q, paged_kv_cache)
            o, lse = self.run(q, paged_kv_cache, True)
            return o, finish_lse(lse, True)
        if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
            return _custom_ops.run_wrapper(self, q, (paged_kv_cache,), return_lse=return_lse)
        fused = self._fused
        if fused is None:
            if not self._planned:
                raise RuntimeError("MultiLevelCascadeAttentionWrapper.run() called before plan(): call plan() first")
            return self._run_levels(q, paged_kv_cache, return_lse)
        bound = fused.fast_run
        if bound is not None:  # a call of the form the plan's first run bound (RunBinding: no checks needed)
            got = bound(q, paged_kv_cache, None, return_lse, _NO_SCALES)
            if got is not None:
                return got
        k4, v4 = paged_kv_views(paged_kv_cache, self._kv_layout)
        fused.check(q, k4)
        out = torch.empty(fused.q_shape, dtype=fused.opts.o_dtype, device=fused.device)
        lse = torch.empty(fused.q_shape[:2], dtype=torch.float32, device=fused.device) if return_lse else None
        if fused.bind_tried or (q.is_cuda and torch.cuda.is_current_stream_capturing()):
            fused.impl.run(fused.plan, fused.opts, fused.batch, q, k4, v4, out, lse)
        else:  # the plan's first run: its launches bound for later calls of this form (one binding per plan)
            got = []
            fused.impl.run(fused.plan, fused.opts, fused.batch, q, k4, v4, out, lse, bind=got)
            fused.bind_tried = True
            fused.fast_run = RunBinding.of(got, q, paged_kv_cache, k4, v4, out, lse, False, _NO_SCALES)
        return (out, lse) if return_lse else out

    def _run_levels(self, q, paged_kv_cache, return_lse):
        """One launch per level (plus its split merge), each merged into the first level's state."""
        k4, v4 = paged_kv_views(paged_kv_cache, self._kv_layout)
        out, lse = self._wrappers[0]._w._run_common(q, k4, v4, return_lse=True)
        for w in self._wrappers[1:]:
            o_level, lse_level = w._w._run_common(q, k4, v4, return_lse=True)
            merge_state_in_place(out, lse, o_level, lse_level)
        return (out, lse) if return_lse else out

    forward = run

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """FlashInfer prewarms every level's JIT variant for K and V of different strides; the kernels of this
        package take both strides as arguments, so after FlashInfer's checks there is nothing to load."""
        _surface.prewarm_paged_kv_stride_variant(type(self).__name__, bool(self._planned), variant)


_NO_SCALES = (None, None, None)  # (q, k, v scales: the cascade takes none)


def _ceil_to(x, m):
    return -(-x // m) * m


# Reductions as ufuncs: the array methods' Python wrappers cost about what the reduction does on small arrays.
_MAX, _SUM = np.maximum.reduce, np.add.reduce


def _i64(x: torch.Tensor) -> np.ndarray:
    """An int64 numpy view (a copy when of another dtype) of a host index tensor."""
    return x.numpy() if x.dtype == torch.int64 else x.to(torch.int64).numpy()


def _head(x: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` entries of ``x`` (``x`` itself when that long: a view costs host time)."""
    return x if x.shape[0] == n else x[:n]


# (the levels' option objects, the fused options or None) of the last _fused_options question
_FUSED_OPTS_LAST: list = [((), None)]


def _fused_options(level_opts: tuple):
    """The options of the fused launch (the levels' with causal off), or None when the levels differ in anything
    but causal. The last answer is kept for the same (immutable) option objects: a re-plan asks with them."""
    last = _FUSED_OPTS_LAST[0]  # (one tuple, replaced whole: threads never see a mixed entry)
    if len(last[0]) == len(level_opts) and all(a is b for a, b in zip(last[0], level_opts)):
        return last[1]
    same = dataclasses.replace(level_opts[0], causal=False)
    got = same if all(dataclasses.replace(o, causal=False) == same for o in level_opts) else None
    _FUSED_OPTS_LAST[0] = (level_opts, got)
    return got


def _choose_splits(ranges, block_n, num_sms, total_q, num_qo_heads, num_kv_heads, head_dim, kv_itemsize, config=None):
    """KV pieces per tile for each level (``ranges[l]``: the KV length of each of level l's query tiles).

    A piece is about ``1 / (split_waves * SMs)`` of the batch's KV work (at least 4 KV tiles), so a long
    shared level is cut and the short per-request levels are not. Each partial slot costs a write and a read
    of ``[total_q, Hq, D]`` float32: pieces grow until that traffic is under ``merge_share`` of the K/V
    bytes the tiles read (more pieces balance better but merge more). ``config``: a
    :class:`~flashinfer_triton._config.CascadeConfig` (default: ``_config.CASCADE``)."""
    cfg = config or _config.CASCADE
    work_tokens = sum(int(_SUM(r)) for r in ranges)
    chunk = max(4 * block_n, _ceil_to(int(-(-work_tokens * num_kv_heads // (cfg.split_waves * num_sms))), block_n))
    kv_bytes = work_tokens * num_kv_heads * head_dim * 2 * kv_itemsize
    slot_bytes = max(1, total_q * num_qo_heads * head_dim * 8)
    max_slots = max(len(ranges), int(cfg.merge_share * kv_bytes // slot_bytes))

    longest = [int(_MAX(r)) if len(r) else None for r in ranges]  # (each level's once, not at every count)

    def count(c):
        return [max(1, -(-m // c)) if m is not None else 1 for m in longest]

    splits = count(chunk)
    while sum(splits) > max_slots and max(splits) > 1:
        chunk = _ceil_to(chunk * 5 // 4 + 1, block_n)
        splits = count(chunk)
    return splits


class _FusedCascade:
    """Every level of a planned cascade in ONE attention launch plus ONE merge launch.

    Built at ``plan()`` from the levels' plans when they all run on the Triton prefill path
    (``_prefill_impl``), outside CUDA-graph mode, with no causal mask in effect (causal only matters on the
    last level when one of its requests has more than one query) and no sliding window.

    * Combined batch: level ``l``'s request ``r`` is request ``R_l + r`` with ``R_l = sum(B_k + 1, k < l)``;
      the index arrays are the levels' arrays concatenated (``kv_indptr`` shifted by the pages of the levels
      before it, ``kv_lens`` with one empty request after each level), so request ``b`` always reads
      ``qo_indptr[b], qo_indptr[b + 1]`` of its own level.
    * Work: each level's query tiles (``TILE_T = BLOCK_M // group`` tokens) cut into exactly ``S_l`` KV
      pieces, ``S_l`` chosen so that the longest piece is about one SM's share of the whole batch (the shared
      level splits, the short per-request levels do not). Every piece writes a partial state; query row ``q``
      owns ``P = sum(S_l)`` consecutive partial rows, level ``l`` the slots ``[off_l, off_l + S_l)``, so the
      row stride inside a tile is ``P``. Pieces past a short range are empty and write ``lse = -inf``: every
      slot is written at every run, and the partials may live in the caller's float workspace.
    * Merge: one program per query row combines its ``P`` partial states into ``out`` (and ``lse``).

    ``run()`` then checks the arguments, allocates ``out`` (and ``lse``) and makes the two launches.
    """

    def __init__(self, impl, opts, plan, batch, q_shape, device, kv_tail, max_page_index, plan_id=0):
        self.impl, self.opts, self.plan, self.batch = impl, opts, plan, batch
        self.q_shape, self.device, self.kv_tail, self.max_page_index = q_shape, device, kv_tail, max_page_index
        self.total_q = q_shape[0]
        self.plan_id = plan_id  # the last level's: new at each plan()
        self.fast_run: RunBinding | None = None  # the launches bound at the first run (see run())
        self.bind_tried = False

    @classmethod
    def build(cls, cores):
        """The fused plan of the planned level cores, or None when a level needs its own launch."""
        planned = [c.current_plan for c in cores]
        impl = planned[0].impl
        if getattr(impl, "__name__", "").rsplit(".", 1)[-1] != "_prefill_impl":
            return None
        if any(p.impl is not impl for p in planned):
            return None
        if getattr(impl, "_WORK_FIELDS", None) != _work_row.WORK_FIELDS or getattr(impl, "_MERGE_FIELDS", None) != 3:
            return None  # the work-list format this builder writes
        opts = _fused_options(tuple(p.opts for p in planned))
        if opts is None:
            return None
        if not opts.paged or opts.has_custom_mask or opts.window_left >= 0:
            return None
        host = [
            (_i64(p.batch.qo_indptr_host), _i64(p.batch.kv_indptr_host), _i64(p.batch.kv_lens_host)) for p in planned
        ]
        qo_lens_l = [qo[1:] - qo[:-1] for qo, _, _ in host]
        last_qo_lens = qo_lens_l[-1]
        if planned[-1].opts.causal and len(last_qo_lens) and int(_MAX(last_qo_lens)) > 1:
            return None
        device = planned[0].batch.device
        group = opts.group_size
        total_q = planned[0].total_q
        max_qo = max((int(_MAX(q)) if len(q) else 0) for q in qo_lens_l)
        cfg = impl.choose_config(opts, _config.CASCADE.tile_rows or max(max_qo, 1) * group, device)
        tile_t = cfg.block_m // group
        bn = cfg.block_n

        # Query tiles of every level: (level, local request, first token, KV length).
        # (ufuncs and array methods: numpy's function forms add a Python wrapper's host time per call)
        tiles = []
        for (_, _, kv_lens), qo_lens in zip(host, qo_lens_l):
            n_tiles = -(-qo_lens // tile_t)
            req = np.arange(len(qo_lens), dtype=np.int64).repeat(n_tiles)
            first = np.add.accumulate(n_tiles) - n_tiles
            t0 = (np.arange(int(_SUM(n_tiles)), dtype=np.int64) - first.repeat(n_tiles)) * tile_t
            tiles.append((req, t0, kv_lens[req]))
        ranges = [r for _, _, r in tiles]
        hd = (opts.num_qo_heads, opts.num_kv_heads, opts.head_dim, opts.kv_dtype.itemsize)
        splits = _choose_splits(ranges, bn, _num_sms(device), total_q, *hd)
        num_slots = sum(splits)
        fused_partials = num_slots > 1

        # Each level's items in one block [field, piece, tile] (pieces in order, each over the level's tiles):
        # every field is written whole, then the items are gathered longest first into rows (``_work_row``).
        nf, at = _work_row.WORK_FIELDS, _work_row.REQ_AT
        items, req_base, slot_base, kv_base = [], 0, 0, 0
        for (qo, kv_indptr, kv_lens), (req, t0, rng), s_l in zip(host, tiles, splits, strict=True):
            piece = _ceil_to(-(-rng // s_l), bn)
            # (fields 6 and 7 stay 0: no arrival counter, the rows are merged by the separate merge launch)
            blk = np.zeros((nf, s_l, len(req)), dtype=np.int64)
            cuts = np.arange(s_l + 1, dtype=np.int64)[:, None] * piece  # piece s covers [cuts[s], cuts[s + 1])
            np.minimum(cuts[:-1], rng, out=blk[2])
            np.minimum(cuts[1:], rng, out=blk[3])
            blk[0] = req + req_base
            blk[1] = t0
            if fused_partials:
                np.add((qo[req] + t0) * num_slots + slot_base, np.arange(s_l, dtype=np.int64)[:, None], out=blk[4])
            else:
                blk[4] = -1  # a lone unsplit level writes out directly
            blk[5] = num_slots
            # the request's scalars, as the concatenated batch below holds them (its kv_indptr offset per level)
            blk[at] = qo[req]
            blk[at + 1] = qo[req + 1] - qo[req]
            blk[at + 2] = kv_lens[req]
            blk[at + 3] = kv_indptr[req] + kv_base
            items.append(blk.reshape(nf, -1))
            req_base += len(qo)
            slot_base += s_l
            kv_base += int(kv_indptr[-1])
        fields = np.concatenate(items, axis=1) if items else np.zeros((nf, 0), dtype=np.int64)
        work = fields.T[(fields[2] - fields[3]).argsort(kind="stable")]
        num_items = len(work)
        num_merge = total_q if fused_partials else 0

        # Every host-known array in one host-to-device copy; the page indices are concatenated on the device.
        # (int32, written in place: qo_indptr | kv_indptr | kv_lens | work count | work list | merge count | merges)
        qo_cat = np.concatenate([qo for qo, _, _ in host])
        kv_lens_cat = np.zeros(sum(len(kv_lens) + 1 for _, _, kv_lens in host), dtype=np.int64)
        n_ip = sum(len(kv_indptr) for _, kv_indptr, _ in host)
        sizes = [len(qo_cat), n_ip, len(kv_lens_cat), 1, num_items * nf, 1, num_merge * 3]
        flat_h = np.empty(sum(sizes), dtype=np.int32)
        o = len(qo_cat)
        flat_h[:o] = qo_cat
        offset, lo = 0, 0
        for _, kv_indptr, kv_lens in host:
            flat_h[o : o + len(kv_indptr)] = kv_indptr + offset
            o += len(kv_indptr)
            offset += int(kv_indptr[-1])
            kv_lens_cat[lo : lo + len(kv_lens)] = kv_lens  # (then one empty request after each level)
            lo += len(kv_lens) + 1
        flat_h[o : o + lo] = kv_lens_cat
        o += lo
        flat_h[o] = num_items
        flat_h[o + 1 : o + 1 + num_items * nf] = work.reshape(-1)
        o += 1 + num_items * nf
        flat_h[o] = num_merge
        merge = flat_h[o + 1 :].reshape(num_merge, 3)
        rows = np.arange(num_merge, dtype=np.int64)
        merge[:, 0] = rows
        merge[:, 1] = rows * num_slots
        merge[:, 2] = num_slots
        dev = torch.from_numpy(flat_h).to(device).split_with_sizes(sizes)
        indices = [_head(p.batch.kv_indices, int(h[1][-1])) for p, h in zip(planned, host, strict=True)]
        indices = [x for x in indices if x is not None and x.numel() > 0]
        kv_indices = torch.cat(indices) if indices else torch.zeros(1, dtype=torch.int32, device=device)

        part_o = part_lse = None
        if num_merge:
            hq, d = opts.num_qo_heads, opts.head_dim
            rows_p = total_q * num_slots
            pdt = impl.partial_dtype(opts.o_dtype)  # the output dtype (fp16 / bf16) or float32
            o_bytes = rows_p * hq * d * pdt.itemsize
            need = o_bytes + rows_p * hq * 4
            fb = cores[0]._float_workspace_buffer
            if fb.device == device and fb.numel() >= need + 256:
                # the views of this workspace and shape, kept by the first level's wrapper: a re-plan mostly
                # repeats the shape, and each view costs microseconds of host time
                pkey = (fb.data_ptr(), fb.numel(), rows_p, hq, d, pdt)
                kept = cores[0].__dict__.get("_fused_part_views")
                if kept is not None and kept[0] is fb and kept[1] == pkey:
                    part_o, part_lse = kept[2]
                else:
                    off = (256 - fb.data_ptr() % 256) % 256
                    region = fb[off : off + need]
                    part_o = region[:o_bytes].view(pdt).view(rows_p, hq, d)
                    part_lse = region[o_bytes:].view(torch.float32).view(rows_p, hq)
                    cores[0]._fused_part_views = (fb, pkey, (part_o, part_lse))
            else:
                part_o = torch.empty(rows_p, hq, d, dtype=pdt, device=device)
                part_lse = torch.empty(rows_p, hq, dtype=torch.float32, device=device)
        plan = impl.PrefillPlan(
            config=cfg,
            tile_t=tile_t,
            grid0=num_items,
            work=dev[4].view(num_items, nf),
            num_work=dev[3],
            num_work_host=num_items,
            merge=dev[6].view(num_merge, 3) if num_merge else None,
            num_merge=dev[5] if num_merge else None,
            num_merge_host=num_merge,
            part_o=part_o,
            part_lse=part_lse,
        )
        batch = AttentionBatch(
            batch_size=len(kv_lens_cat),
            qo_indptr=dev[0],
            kv_indptr=dev[1],
            kv_indices=kv_indices,
            kv_lens=dev[2],
            qo_indptr_host=torch.from_numpy(qo_cat),
            kv_lens_host=torch.from_numpy(kv_lens_cat),
            alibi_slopes=planned[0].batch.alibi_slopes,
        )
        max_page = PendingPageRange.combine([p.max_page_index for p in planned])
        kv_tail = (opts.page_size, opts.num_kv_heads, opts.head_dim)
        q_shape = (total_q, opts.num_qo_heads, opts.head_dim)
        return cls(impl, opts, plan, batch, q_shape, device, kv_tail, max_page, planned[-1].plan_id)

    def check(self, q, k4) -> None:
        """``run()``'s argument checks, one comparison each, raising the error that names the argument."""
        opts = self.opts
        C.check_tensor("q", q, device=self.device)
        if q.shape != self.q_shape:
            C.check_shape("q", q, self.q_shape, "[qo_indptr[-1], num_qo_heads, head_dim]")
        if q.dtype != opts.q_dtype:
            raise C.type_error("q", f"dtype {opts.q_dtype} as planned (q_data_type)", f"{q.dtype}")
        C.check_last_dim_contiguous("q", q)
        if k4.device != self.device:
            raise C.value_error("paged_kv_cache", f"tensors on {self.device}", f"{k4.device}")
        if k4.dtype != opts.kv_dtype:
            raise C.type_error("paged_kv_cache", f"dtype {opts.kv_dtype} as planned (kv_data_type)", f"{k4.dtype}")
        if k4.shape[1:] != self.kv_tail:
            if k4.shape[2] != opts.num_kv_heads or k4.shape[3] != opts.head_dim:
                raise C.value_error(
                    "paged_kv_cache",
                    f"num_kv_heads = {opts.num_kv_heads} and head_dim = {opts.head_dim} as planned",
                    f"num_kv_heads = {k4.shape[2]}, head_dim = {k4.shape[3]}",
                )
            raise C.value_error("paged_kv_cache", f"page_size = {opts.page_size} as planned", f"{k4.shape[1]}")
        check_page_range(self.max_page_index, k4.shape[0])


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

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Swap the workspaces; takes effect at the next begin_forward()."""
        self._batch_decode_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

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
        self._planned_options = None

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
        self._planned_options = (True, None, None, None, None)

    plan = begin_forward

    def reset_workspace_buffer(self, float_workspace_buffer, int_workspace_buffer=None) -> None:
        """Swap the workspaces; takes effect at the next begin_forward()."""
        self._batch_prefill_wrapper.reset_workspace_buffer(float_workspace_buffer, int_workspace_buffer)

    def forward(
        self,
        q: torch.Tensor,
        k_shared: torch.Tensor,
        v_shared: torch.Tensor,
        unique_kv_cache,
        causal: bool = False,
        use_fp16_qk_reduction: bool = False,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        *,
        allow_fp16_qk_reduction: bool = False,
        logits_soft_cap=None,
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
        options = (bool(causal), sm_scale, logits_soft_cap, rope_scale, rope_theta)
        if options != self._planned_options:  # plan again only when forward() changes an option
            self._batch_prefill_wrapper.plan(
                **self._args,
                causal=causal,
                sm_scale=sm_scale,
                logits_soft_cap=logits_soft_cap,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
            )
            self._planned_options = options
        v_unique, s_unique = self._batch_prefill_wrapper.run(q, unique_kv_cache, return_lse=True)
        merge_state_in_place(v_state, s_state, v_unique, s_unique)
        return v_state

    run = forward

    def end_forward(self) -> None:
        """Kept for old callers: nothing to release."""

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """The prefill wrapper's (FlashInfer's delegation): checks, then nothing to load."""
        self._batch_prefill_wrapper.prewarm_paged_kv_stride_variant(variant)
