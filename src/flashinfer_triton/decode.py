"""Decode attention: one query token per request over its KV cache (FlashInfer's ``flashinfer.decode``)."""

from __future__ import annotations

import numpy as np
import torch

from . import _checks as C
from . import _config, _custom_ops, _decode_impl, _errors, _surface
from ._backend import AttentionBatch, Workspace
from ._layout import paged_kv_views, ragged_kv_view
from ._wrapper import (
    _SINGLE_FAST,
    PendingPageRange,
    Plan,
    PublicWrapperSurface,
    _align4,
    _AttentionWrapper,
    _host_i64,
    read_page_table,
    read_table,
    run_single,
    same_lengths,
    single_fast_key,
)

_T = torch.Tensor

__all__ = [
    "single_decode_with_kv_cache",
    "BatchDecodeWithPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "fast_decode_plan",
]


def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    use_tensor_cores: bool = False,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
    *,
    lse_base: str = "log2",
):
    """Decode attention of one request.

    Parameters
    ----------
    q : torch.Tensor
        shape ``[num_qo_heads, head_dim]``, dtype float16 or bfloat16.
    k, v : torch.Tensor
        ``[kv_len, num_kv_heads, head_dim]`` (NHD) or ``[num_kv_heads, kv_len, head_dim]`` (HND); dtype of
        q or float8 (e4m3/e5m2, widened in the kernel; ``k_scale``/``q_scale`` multiply ``sm_scale`` and
        ``v_scale`` multiplies the output).
    pos_encoding_mode : "NONE", "ROPE_LLAMA" (applied in the kernel; the query sits at position
        ``kv_len - 1``) or "ALIBI".
    window_left : keep only the last ``window_left + 1`` keys; -1 for all.
    logits_soft_cap : ``c > 0`` maps each score ``s`` to ``c * tanh(s / c)``.
    return_lse : also return the log-sum-exp of the scores, **base 2** (``lse_base="ln"``: natural log), shape
        ``[num_qo_heads]``.

    Returns
    -------
    o : ``[num_qo_heads, head_dim]``, dtype of q (and ``lse`` float32 when ``return_lse``).
    ``use_tensor_cores`` is a performance hint only.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> q = torch.randn(32, 128, dtype=torch.float16)
    >>> k = torch.randn(100, 8, 128, dtype=torch.float16); v = torch.randn_like(k)
    >>> fi.single_decode_with_kv_cache(q, k, v).shape
    torch.Size([32, 128])
    """
    fast_key = fast_shapes = None
    if type(q) is _T and type(k) is _T and type(v) is _T:
        options = (kv_layout, pos_encoding_mode, use_tensor_cores, q_scale, k_scale, v_scale, window_left,
                   logits_soft_cap, sm_scale, rope_scale, rope_theta, return_lse, lse_base)  # fmt: skip
        fast_key = single_fast_key(1, options, q, k, v)
        fast = _SINGLE_FAST.get(fast_key)
        # a call of a form that passed every check below and whose launch is bound (the plan is the form's)
        if fast is not None and not torch.compiler.is_compiling() and (got := fast(q, k, v)) is not None:
            return got
        # (kept with the form when its launch binds: the public outputs' shapes, where the public tensors start)
        fast_shapes = (q.shape, q.shape[:1], (q.data_ptr(), k.data_ptr(), v.data_ptr()))
    C.check_kv_layout(kv_layout)
    C.check_tensor("q", q, dim=2)
    out = run_single(
        q.unsqueeze(0),
        ragged_kv_view(k, kv_layout, "k"),
        ragged_kv_view(v, kv_layout, "v"),
        is_decode=True,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
        return_lse=return_lse,
        lse_base=lse_base,
        fast_key=fast_key,
        fast_shapes=fast_shapes,
    )
    if return_lse:
        return out[0][0], out[1][0]
    return out[0]


# FlashInfer 0.2's plan() parameters after page_size, in its order (0.7 put o_data_type 13th).
_DECODE_PLAN_V02 = (
    "pos_encoding_mode",
    "window_left",
    "logits_soft_cap",
    "q_data_type",
    "kv_data_type",
    "data_type",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "non_blocking",
)


# The order of BatchDecodeWithPagedKVCacheWrapper._plan_values.
_PLAN_FIELDS = (
    "indptr",
    "indices",
    "last_page_len",
    "num_qo_heads",
    "num_kv_heads",
    "head_dim",
    "page_size",
    "pos_encoding_mode",
    "window_left",
    "logits_soft_cap",
    "q_data_type",
    "kv_data_type",
    "sm_scale",
    "rope_scale",
    "rope_theta",
    "non_blocking",
    "seq_lens",
    "fixed_split_size",
    "disable_split_kv",
    "o_data_type",
)


class BatchDecodeWithPagedKVCacheWrapper(PublicWrapperSurface):
    """Batch decode over a paged KV cache: ``plan()`` once per batch, ``run()`` once per layer.

    Parameters
    ----------
    float_workspace_buffer : torch.Tensor
        uint8 scratch memory on the compute device (engines pass 128 MB); split-KV partial states live in it.
    kv_layout : "NHD" (``[..., page_size, num_kv_heads, head_dim]``) or
        "HND" (``[..., num_kv_heads, page_size, head_dim]``).
    use_cuda_graph : bool
        The batch size is then fixed by ``paged_kv_last_page_len_buffer`` and ``plan()`` copies the page
        table into the three buffers, so a graph captured around ``run()`` replays after any later ``plan()``.
    use_tensor_cores : bool
        A performance hint; never changes results.
    backend : accepted for compatibility ("auto", "fa2", "fa3", ...); every backend maps to this library's kernels.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> ws = torch.empty(1 << 20, dtype=torch.uint8)
    >>> w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    >>> cache = torch.randn(6, 2, 16, 2, 64, dtype=torch.float16)   # 6 pages of 16 tokens
    >>> indptr = torch.tensor([0, 2, 6], dtype=torch.int32); indices = torch.arange(6, dtype=torch.int32)
    >>> last = torch.tensor([5, 16], dtype=torch.int32)
    >>> w.plan(indptr, indices, last, 8, 2, 64, 16)
    >>> w.run(torch.randn(2, 8, 64, dtype=torch.float16), cache).shape
    torch.Size([2, 8, 64])
    """

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
        backend: str = "auto",
        jit_args=None,
    ):
        if jit_args is not None:
            raise NotImplementedError("jit_args: custom JIT attention variants are not supported by flashinfer_triton")
        self._w = _DecodeCore(float_workspace_buffer, kv_layout, use_cuda_graph, backend)
        self._use_tensor_cores = bool(use_tensor_cores)
        w = self._w
        if use_cuda_graph:
            for name, buf in (
                ("paged_kv_indptr_buffer", paged_kv_indptr_buffer),
                ("paged_kv_indices_buffer", paged_kv_indices_buffer),
                ("paged_kv_last_page_len_buffer", paged_kv_last_page_len_buffer),
            ):
                if buf is None:
                    raise ValueError(f"{name}: required when use_cuda_graph=True, got None")
                C.check_index_tensor(name, buf)
                C.check_tensor(name, buf, device=w.device)
            bs = paged_kv_last_page_len_buffer.shape[0]
            if paged_kv_indptr_buffer.shape[0] != bs + 1:
                raise C.value_error(
                    "paged_kv_indptr_buffer",
                    f"shape [len(paged_kv_last_page_len_buffer) + 1] = [{bs + 1}]",
                    C.shape_str(paged_kv_indptr_buffer.shape),
                )
            w._fixed_batch_size = bs
            w._qo_indptr_buf = torch.arange(bs + 1, dtype=torch.int32, device=w.device)
        w._paged_kv_indptr_buf = paged_kv_indptr_buffer
        w._paged_kv_indices_buf = paged_kv_indices_buffer
        w._paged_kv_last_page_len_buf = paged_kv_last_page_len_buffer

    @property
    def use_tensor_cores(self) -> bool:
        return self._use_tensor_cores

    @C.bind_generations(7, _DECODE_PLAN_V02)
    def plan(
        self,
        indptr: torch.Tensor | None,
        indices: torch.Tensor | None,
        last_page_len: torch.Tensor | None,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        page_size: int,
        pos_encoding_mode: str = "NONE",
        window_left: int = -1,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale: float | None = None,
        rope_scale: float | None = None,
        rope_theta: float | None = None,
        non_blocking: bool = True,
        block_tables=None,
        seq_lens=None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
        q_len_per_req: int = 1,
        *,
        window_right: int = 0,
        is_causal: bool | None = None,
        **kwargs,
    ) -> None:
        """Plan batch decode for a page table (CSR: ``indptr [B+1]``, ``indices``, ``last_page_len [B]``,
        int32 or int64, on the CPU or the device), or for a 2-D ``block_tables [B, max_blocks]`` (int32) with
        ``seq_lens [B]``, as FlashAttention-style engines pass (then ``indptr`` and ``indices`` are None).
        Request i holds ``(indptr[i+1]-indptr[i]-1)*page_size + last_page_len[i]`` tokens (0 without pages).
        Options set here hold for every ``run()`` until the next ``plan()``.

        The positional order is FlashInfer 0.7's (``o_data_type`` 13th); FlashInfer 0.2's order (``data_type``
        13th, ``sm_scale`` 14th, ...) is recognised by the types of the values (docs/conformance.md).
        ``data_type`` is the old name of ``kv_data_type``; ``seq_lens``, ``block_tables``, ``fixed_split_size``
        and ``disable_split_kv`` are engine arguments (``seq_lens`` must agree with the page table when given).

        ``q_len_per_req > 1`` plans multi-token decode (speculative decoding): ``run()`` then takes
        ``q [batch_size * q_len_per_req, Hq, D]``, request ``b`` owning rows ``b*q_len_per_req ..``, causal
        within the request (bottom-right aligned: its last row sees every key); every request needs at least
        ``q_len_per_req`` keys. ``is_causal`` (default: ``q_len_per_req > 1``) and ``window_right`` (0, or -1
        for no right bound, i.e. not causal) set that mask."""
        if kwargs:
            C.reject_unknown("BatchDecodeWithPagedKVCacheWrapper.plan", kwargs)
        if kv_data_type is None and data_type is not None:
            kv_data_type = data_type
        w = self._w
        if isinstance(q_len_per_req, bool) or not isinstance(q_len_per_req, int) or q_len_per_req < 1:
            raise C.value_error("q_len_per_req", "an int >= 1", repr(q_len_per_req))
        causal = _decode_causal(q_len_per_req, window_right, is_causal)
        if w._use_cuda_graph and self._q_len_per_req not in (None, q_len_per_req):
            raise C.value_error(
                "q_len_per_req",
                f"{self._q_len_per_req}, the value of this CUDA-graph wrapper's first plan() (part of the captured "
                "shape: use one wrapper per value)",
                q_len_per_req,
            )
        indptr = C.as_int32_index("indptr", indptr)
        indices = C.as_int32_index("indices", indices)
        last_page_len = C.as_int32_index("last_page_len", last_page_len)
        table_seq_lens = seq_lens
        if block_tables is not None:
            indptr, indices, last_page_len = block_table_to_csr(block_tables, seq_lens, page_size, indptr, indices)
            table_seq_lens = None  # the table's lengths are seq_lens by construction
        if q_len_per_req > 1 or causal:
            public_plan = dict(
                indptr=indptr, indices=indices, last_page_len=last_page_len, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, pos_encoding_mode=pos_encoding_mode,
                window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                kv_data_type=kv_data_type, o_data_type=o_data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                rope_theta=rope_theta, non_blocking=non_blocking, seq_lens=seq_lens, fixed_split_size=fixed_split_size,
                disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req, is_causal=causal,
            )  # fmt: skip
            self._plan_multi_token(**public_plan)
            # set once the plan succeeded: a plan() that raises leaves the previous plan whole
            self._public_plan = public_plan
            self._q_len_per_req = q_len_per_req
            return
        w.plan(
            indptr=indptr,
            indices=indices,
            last_page_len=last_page_len,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            q_data_type=q_data_type,
            kv_data_type=kv_data_type,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
            non_blocking=non_blocking,
            seq_lens=table_seq_lens,
            fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
            o_data_type=o_data_type,
            use_tensor_cores=self._use_tensor_cores,
        )
        # kept for forward(), which re-plans from them with its options (block tables: their CSR form, whose
        # lengths are seq_lens by construction); _plan_args makes the dict when asked. Set once the plan
        # succeeded, as the others below: a plan() that raises leaves the previous plan whole.
        self._plan_values = (
            indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode,
            window_left, logits_soft_cap, q_data_type, kv_data_type, sm_scale, rope_scale, rope_theta, non_blocking,
            table_seq_lens, fixed_split_size, disable_split_kv, o_data_type,
        )  # fmt: skip
        self._public_plan = None  # set once the plan succeeded (see above)
        self._q_len_per_req = 1

    @property
    def _plan_args(self) -> dict:
        """The arguments of the last single-token plan() by name (forward() and the cascade re-plan from them)."""
        return dict(zip(_PLAN_FIELDS, self._plan_values))

    _q_len_per_req = None  # rows per request of the last plan() (None before any)
    _public_plan = None  # a multi-token plan()'s arguments (forward() re-plans from them)
    _multi = None  # the prefill core that runs multi-token plans

    def _plan_multi_token(
        self, *, indptr, indices, last_page_len, page_size, q_len_per_req, is_causal, seq_lens, **options
    ) -> None:
        """Multi-token decode: a paged prefill over ``q_len_per_req`` rows a request, on its own core (which
        shares this wrapper's workspaces and, in CUDA-graph mode, its page-table buffers)."""
        from .prefill import _PrefillCore

        w = self._w
        core = self._multi
        if core is None:
            core = self._multi = type("_MultiTokenCore", (_PrefillCore,), {"_paged": True})(
                w._float_workspace_buffer, w._kv_layout, w._use_cuda_graph, w._backend
            )
        core._float_workspace_buffer = w._float_workspace_buffer
        core._int_workspace_buffer = w._int_workspace_buffer
        graph_buffers = None
        if w._use_cuda_graph:
            bs = w._fixed_batch_size
            C.check_index_tensor("indptr", indptr, length=bs + 1, what="[batch_size + 1] (CUDA-graph buffers)")
            core._fixed_batch_size = bs
            core._max_total_q = bs * q_len_per_req
            graph_buffers = {
                "qo_indptr": w._qo_indptr_buf,
                "kv_indptr": w._paged_kv_indptr_buf,
                "kv_indices": w._paged_kv_indices_buf,
                "last_page_len": w._paged_kv_last_page_len_buf,
            }
        indptr_h, kv_lens, max_index, last_h = read_page_table(
            indptr, indices, last_page_len, page_size, scratch=core._range_scratch()
        )
        batch_size = kv_lens.numel()
        if seq_lens is not None:
            C.check_tensor("seq_lens", seq_lens, dim=1)
            if seq_lens.shape[0] != batch_size or not torch.equal(_host_i64(seq_lens), kv_lens):
                raise C.value_error("seq_lens", "the KV lengths the page table gives", "different lengths")
        if batch_size and int(kv_lens.min()) < q_len_per_req:
            raise C.value_error(
                "last_page_len",
                f"every request to hold at least q_len_per_req = {q_len_per_req} keys (the verified tokens are "
                "appended to the cache before run())",
                f"a request with {int(kv_lens.min())}",
            )
        if graph_buffers is not None and int(indptr_h[-1]) > w._paged_kv_indices_buf.shape[0]:
            cap = w._paged_kv_indices_buf.shape[0]
            raise C.value_error("indices", f"at most {cap} pages (paged_kv_indices_buffer)", int(indptr_h[-1]))
        core._plan_common(
            qo_indptr_host=torch.arange(batch_size + 1, dtype=torch.int64) * q_len_per_req,
            kv_indptr_host=indptr_h,
            kv_indices=indices,
            kv_lens_host=kv_lens,
            last_page_len_host=last_h,
            graph_buffers=graph_buffers,
            max_page_index=max_index,
            page_size=page_size,
            causal=is_causal,
            use_tensor_cores=self._use_tensor_cores,
            **options,
        )

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
        enable_pdl=None,
        window_left: int | None = None,
        sinks: torch.Tensor | None = None,
        q_len_per_req: int | None = None,
        skip_softmax_threshold_scale_factor: float | None = None,
        kv_cache_sf=None,
        lse_base: str = "log2",
        lse_layout: str = "NH",
    ):
        """Decode ``q [batch_size * q_len_per_req, num_qo_heads, head_dim]`` against ``paged_kv_cache`` (5-D
        tensor, or ``(k, v)`` tuple of 4-D tensors, or of 3-D ``[slots, H, D]`` tensors meaning page size 1).
        Returns ``o`` (and ``lse [rows, num_qo_heads]``, float32, base 2 unless ``lse_base="ln"``, with
        ``return_lse``). ``sinks [num_qo_heads]``: a per-head sink logit added to every row's softmax
        denominator. ``enable_pdl`` is a performance hint. Never synchronizes with the host, but for the first call
        after a plan whose page indices are on the device: it waits for the 8-byte copy of their range that plan()
        queued, if that has not landed yet."""
        fast = self._w._planned
        if (
            fast is not None
            and self._public_plan is None
            and (fast := fast.fast_run) is not None
            and not args
            and lse is None
            and sinks is None
            and window_left is None
            and q_len_per_req is None
            and skip_softmax_threshold_scale_factor is None
            and kv_cache_sf is None
            and lse_base == "log2"
            and lse_layout == "NH"
            and not torch.compiler.is_compiling()
        ):
            # a call of the form the plan's first run() bound (RunBinding): its checks held for this form
            got = fast(q, paged_kv_cache, out, return_lse, (q_scale, k_scale, v_scale))
            if got is not None:
                return got
        if args:  # FlashInfer 0.2's run(q, paged_kv_cache, q_scale, k_scale, v_scale, return_lse)
            q_scale, k_scale, v_scale, return_lse = C.run_positionals_v02(
                "run", args, ("q_scale", "k_scale", "v_scale", "return_lse"), (q_scale, k_scale, v_scale, return_lse)
            )
        # refused parameters are refused on every path, the compiled one included
        C.reject_run_extras(
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor, kv_cache_sf=kv_cache_sf
        )
        planned = self._q_len_per_req or 1
        if q_len_per_req is not None and q_len_per_req != planned:
            raise C.value_error("q_len_per_req", f"the planned value {planned} (set it in plan())", q_len_per_req)
        if torch.compiler.is_compiling() and sinks is None and lse_base == "log2" and lse_layout == "NH":
            # the custom op: Dynamo does not trace the launch path
            return _custom_ops.run_wrapper(
                self, q, (paged_kv_cache,), out=out, lse=lse, return_lse=return_lse,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
            )  # fmt: skip
        core = self._multi if self._public_plan is not None else self._w
        p = core._require_plan()
        if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != p.total_q:
            bs = p.batch.batch_size
            raise ValueError(
                f"q: expected batch_size * q_len_per_req = {bs} * {planned} = {p.total_q} rows as planned, got "
                f"{q.shape[0]} (q_len_per_req is set in plan())"
            )
        if window_left is not None and window_left != p.opts.window_left:
            raise ValueError(
                f"window_left: expected the planned value {p.opts.window_left} (set window_left in plan()), "
                f"got {window_left}"
            )
        k4, v4 = paged_kv_views(paged_kv_cache, self._w._kv_layout)
        return core._run_common(
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
            kv_src=None if self._public_plan is not None else paged_kv_cache,
        )

    def forward(
        self,
        q,
        paged_kv_cache,
        pos_encoding_mode: str = "NONE",
        q_scale=None,
        k_scale=None,
        v_scale=None,
        window_left: int = -1,
        logits_soft_cap=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        return_lse: bool = False,
    ):
        """Deprecated: ``run()`` with options given per call (they re-plan when they differ from plan())."""
        overrides = dict(
            pos_encoding_mode=pos_encoding_mode,
            window_left=window_left,
            logits_soft_cap=logits_soft_cap,
            sm_scale=sm_scale,
            rope_scale=rope_scale,
            rope_theta=rope_theta,
        )
        if self._public_plan is not None:
            self._multi._require_plan("forward")
            if any(self._public_plan[key] != value for key, value in overrides.items()):
                self._public_plan.update(overrides)
                self._plan_multi_token(**self._public_plan)
        else:
            self._w._require_plan("forward")
            if any(self._plan_args[key] != value for key, value in overrides.items()):
                self._w.plan(use_tensor_cores=self._use_tensor_cores, **{**self._plan_args, **overrides})
        return self.run(q, paged_kv_cache, q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, return_lse=return_lse)

    # FlashInfer 0.7.2's members for its own backends and workspaces (``_surface``).
    def _active_core(self):
        return self._multi if self._public_plan is not None else self._w

    @property
    def resolved_backend(self) -> str:
        """What the last plan() resolved ``backend="auto"`` to: ``"triton"`` or ``"torch"``; an explicit backend
        reports itself; ``"auto"`` before the first plan."""
        return _surface.resolved_backend(self._w._backend, self._active_core().current_plan)

    def workspace_size(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
        data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        block_tables=None,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv=False,
        q_len_per_req=1,
    ) -> tuple[int, int]:
        """``(float_workspace_bytes, int_workspace_bytes)`` that ``plan()`` with these arguments uses of this
        wrapper's workspaces, measured on a probe wrapper (this one's plan and buffers are untouched)."""
        args = dict(locals())
        del args["self"]
        w = self._w
        s = _surface.scratch_like
        probe = BatchDecodeWithPagedKVCacheWrapper(
            w._float_workspace_buffer, w._kv_layout, w._use_cuda_graph, self._use_tensor_cores,
            s(w._paged_kv_indptr_buf), s(w._paged_kv_indices_buf), s(w._paged_kv_last_page_len_buf), w._backend,
        )  # fmt: skip
        return _surface.workspace_size(self, probe, args)

    def prewarm_paged_kv_stride_variant(self, variant: str = "independent") -> None:
        """FlashInfer loads a JIT variant for K and V of different strides here; the kernels of this package take
        both strides as arguments, so after FlashInfer's checks there is nothing to load."""
        planned = self._active_core().current_plan is not None
        _surface.prewarm_paged_kv_stride_variant(type(self).__name__, planned, variant)


def _decode_causal(q_len_per_req: int, window_right, is_causal) -> bool:
    """The mask within a multi-token request: causal unless ``is_causal=False`` or ``window_right=-1``."""
    if isinstance(window_right, bool) or window_right not in (0, -1):
        raise NotImplementedError(
            f"window_right={window_right!r}: only 0 (the causal diagonal) and -1 (no right bound) are implemented"
        )
    if is_causal is not None and not isinstance(is_causal, bool):
        raise C.type_error("is_causal", "a bool or None", type(is_causal).__name__)
    if window_right == -1 and is_causal:
        raise ValueError("is_causal=True contradicts window_right=-1 (no right bound): pass one of them")
    if is_causal is None:
        is_causal = q_len_per_req > 1 and window_right == 0
    return bool(is_causal) and q_len_per_req > 1


def fast_decode_plan(
    self,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    num_qo_heads: int,
    num_kv_heads: int,
    head_dim: int,
    page_size: int,
    pos_encoding_mode: str = "NONE",
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    q_data_type=None,
    kv_data_type=None,
    data_type=None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    non_blocking: bool = True,
    fixed_split_size: int | None = None,
    disable_split_kv: bool = False,
    q_len_per_req: int = 1,
    global_override_indptr_cpu: torch.Tensor | None = None,
) -> None:
    """FlashInfer's ``flashinfer.decode.fast_decode_plan``: ``plan()`` in the form serving engines install as
    ``wrapper.begin_forward = functools.partial(fast_decode_plan, wrapper)`` (SGLang), with its parameter
    order (no ``o_data_type``: the previous plan's is kept).

    ``global_override_indptr_cpu`` is a host copy of ``indptr`` to plan from (it saves reading the device
    tensor back); it must describe the same table. ``data_type`` sets ``q_data_type`` and ``kv_data_type``
    where they are not given. This library's ``plan()`` already takes the short path for a per-step re-plan
    with unchanged options, so the result is exactly ``plan()``'s.
    """
    if not isinstance(self, BatchDecodeWithPagedKVCacheWrapper):
        raise C.type_error("self", "a BatchDecodeWithPagedKVCacheWrapper", type(self).__name__)
    if data_type is not None:
        q_data_type = data_type if q_data_type is None else q_data_type
        kv_data_type = data_type if kv_data_type is None else kv_data_type
    if q_data_type is None:
        q_data_type = "float16"
    if global_override_indptr_cpu is not None:
        C.check_tensor("global_override_indptr_cpu", global_override_indptr_cpu, dim=1)
        if indptr is not None and tuple(indptr.shape) != tuple(global_override_indptr_cpu.shape):
            raise C.value_error(
                "global_override_indptr_cpu",
                f"the shape of indptr {C.shape_str(indptr.shape)}",
                C.shape_str(global_override_indptr_cpu.shape),
            )
        indptr = global_override_indptr_cpu
    previous = self.__dict__.get("_public_plan") or ("_plan_values" in self.__dict__ and self._plan_args) or {}
    type(self).plan(
        self,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode=pos_encoding_mode,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        q_data_type=q_data_type,
        kv_data_type=kv_data_type,
        o_data_type=previous.get("o_data_type"),
        sm_scale=sm_scale,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        non_blocking=non_blocking,
        fixed_split_size=fixed_split_size,
        disable_split_kv=disable_split_kv,
        q_len_per_req=q_len_per_req,
    )


def block_table_to_csr(block_tables, seq_lens, page_size, indptr=None, indices=None):
    """CSR page table ``(indptr, indices, last_page_len)`` (int32, on the CPU) from a 2-D block table.

    Request ``b`` uses the first ``ceil(seq_lens[b] / page_size)`` entries of ``block_tables[b]``.
    """
    if indptr is not None or indices is not None:
        raise ValueError("block_tables: pass either a CSR page table (indptr, indices) or block_tables, not both")
    C.check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,))
    if seq_lens is None:
        raise ValueError("seq_lens: required with block_tables, got None")
    C.check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32,))
    C.check_positive_int("page_size", page_size)
    bs, max_blocks = block_tables.shape
    if seq_lens.shape[0] != bs:
        raise C.value_error(
            "seq_lens", f"shape [batch_size] = [{bs}] (rows of block_tables)", C.shape_str(seq_lens.shape)
        )
    lens = _host_i64(seq_lens)
    if bool((lens < 0).any()):
        raise C.value_error("seq_lens", "non-negative lengths", "a negative length")
    pages = (lens + page_size - 1) // page_size
    if bool((pages > max_blocks).any()):
        raise C.value_error("seq_lens", f"at most max_blocks * page_size = {max_blocks * page_size} tokens", "more")
    indptr = torch.zeros(bs + 1, dtype=torch.int64)
    indptr[1:] = torch.cumsum(pages, 0)
    table = block_tables.detach().cpu()
    keep = torch.arange(max_blocks)[None, :] < pages[:, None]
    indices = table[keep].to(torch.int32)
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    return indptr.to(torch.int32), indices, last.to(torch.int32)


class CUDAGraphBatchDecodeWithPagedKVCacheWrapper(BatchDecodeWithPagedKVCacheWrapper):
    """Batch decode for CUDA graphs: the batch size is ``len(last_page_len_buffer)``, and ``plan()``
    copies each batch's page table into these buffers, whose addresses a captured graph keeps."""

    def __init__(
        self,
        workspace_buffer: torch.Tensor,
        indptr_buffer: torch.Tensor,
        indices_buffer: torch.Tensor,
        last_page_len_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        use_tensor_cores: bool = False,
    ):
        super().__init__(
            workspace_buffer,
            kv_layout,
            use_cuda_graph=True,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=indptr_buffer,
            paged_kv_indices_buffer=indices_buffer,
            paged_kv_last_page_len_buffer=last_page_len_buffer,
        )


class _DecodeCore(_AttentionWrapper):
    """Planning and state of the batch decode wrapper. ``plan()`` is one path for a first plan and every
    re-plan: the options are resolved once per argument set (``_resolve_options``: an engine's per-step plan
    gets the same checked options object back), the page table is read and validated once, in numpy
    (``read_table``), and with the Triton decode implementation the plan's arrays are written by the same code
    every time:

    * eager: one packed host array [work list | qo_indptr | kv_indptr | kv_lens | page indices when they are on
      the host], each part on a 16-byte boundary, one host-to-device copy; the plan holds views of it;
    * CUDA graph: the layout (work slots, staging slots, partial-state views) is fixed at the first plan of an
      option set and workspace (``_decode_impl.graph_layout``); every plan rewrites the staged arrays and the
      work list at the same addresses with one copy, then refills the caller's buffers.

    Other implementations (the PyTorch one off the GPU) plan through ``_plan_common`` from the same table."""

    _is_decode = True
    _paged = True

    def plan(
        self,
        *,
        indptr,
        indices,
        last_page_len,
        num_qo_heads,
        num_kv_heads,
        head_dim,
        page_size,
        pos_encoding_mode="NONE",
        window_left=-1,
        logits_soft_cap=None,
        q_data_type=None,
        kv_data_type=None,
        sm_scale=None,
        rope_scale=None,
        rope_theta=None,
        non_blocking=True,
        seq_lens=None,
        fixed_split_size=None,
        disable_split_kv=False,
        o_data_type=None,
        use_tensor_cores=False,
    ):
        _errors.raise_pending()  # a device-side index error of an earlier kernel surfaces here
        graph = self._use_cuda_graph
        if graph:
            bs = self._fixed_batch_size
            C.check_index_tensor("indptr", indptr)
            if indptr.shape[0] != bs + 1:
                raise C.value_error(
                    "indptr",
                    f"shape [batch_size + 1] = [{bs + 1}] (batch size fixed by the CUDA-graph buffers)",
                    C.shape_str(indptr.shape),
                )
        hp = _config.HOST_PATH
        # CUDA-graph mode, "lazy": no min/max reduction of device page indices while the previous plan's range
        # went unread (no eager run() since: the graph is being replayed); an eager run() reduces it itself
        lazy = graph and hp.graph_page_range == "lazy"
        prev = self._planned
        prev_range = prev.max_page_index if prev is not None else None
        t = read_table(
            indptr,
            indices,
            last_page_len,
            page_size,
            scratch=self._range_scratch(),
            read_indices=hp.device_index_read,
            reduce_range=not lazy,
            defer=lazy and isinstance(prev_range, PendingPageRange) and prev_range.unread(),
            lists=graph,
        )
        if seq_lens is not None:
            C.check_tensor("seq_lens", seq_lens, dim=1)
            if not same_lengths(seq_lens, t.kv_lens if t.lists is None else t.lists[2]):
                raise C.value_error("seq_lens", "the KV lengths the page table gives", "different lengths")
        if graph and t.nnz > self._paged_kv_indices_buf.shape[0]:
            cap = self._paged_kv_indices_buf.shape[0]
            raise C.value_error("indices", f"at most {cap} pages (paged_kv_indices_buffer)", t.nnz)
        opts, slopes, impl = self._resolve_options(
            False,
            num_qo_heads=num_qo_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            page_size=page_size,
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
        if impl is not _decode_impl:
            t.with_arrays()
            self._plan_common(
                qo_indptr_host=torch.arange(t.n + 1, dtype=torch.int64),
                kv_indptr_host=torch.from_numpy(t.indptr),
                kv_indices=indices,
                kv_lens_host=torch.from_numpy(t.kv_lens),
                last_page_len_host=torch.from_numpy(t.last),
                graph_buffers=self._graph_buffers() if graph else None,
                max_page_index=t.max_index,
                num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads,
                head_dim=head_dim,
                page_size=page_size,
                pos_encoding_mode=pos_encoding_mode,
                window_left=window_left,
                logits_soft_cap=logits_soft_cap,
                sm_scale=sm_scale,
                rope_scale=rope_scale,
                rope_theta=rope_theta,
                q_data_type=q_data_type,
                kv_data_type=kv_data_type,
                o_data_type=o_data_type,
                non_blocking=non_blocking,
                use_tensor_cores=use_tensor_cores,
                disable_split_kv=disable_split_kv,
                fixed_split_size=fixed_split_size,
            )
            return
        cfg = self.__dict__.get("_cfg")
        if cfg is None or cfg[0] is not opts:  # the tiles and RoPE table of this option set, made once
            rope = _decode_impl._rope_freq(opts, self.device) if opts.pos_encoding_mode == "ROPE_LLAMA" else None
            cfg = self._cfg = (opts, _decode_impl.choose_config(opts), rope)
        if graph:
            self._write_graph(opts, slopes, cfg[1], t, indptr, indices, last_page_len)
        else:
            self._write_eager(opts, slopes, cfg[1], cfg[2], t, indices)

    def _graph_buffers(self) -> dict:
        return {
            "qo_indptr": self._qo_indptr_buf,
            "kv_indptr": self._paged_kv_indptr_buf,
            "kv_indices": self._paged_kv_indices_buf,
            "last_page_len": self._paged_kv_last_page_len_buf,
        }

    # ------------------------------------------------------------------ eager plans
    def _write_eager(self, opts, slopes, cfg, rope_freq, t, indices) -> None:
        """One packed host array [work list | qo_indptr | kv_indptr | kv_lens | page indices (when on the
        host)], every part on a 16-byte boundary, copied to the device at once; the plan holds views of it."""
        impl = _decode_impl
        dev = self.device
        fws = self._float_workspace_buffer
        n, ip, kv_lens, nnz = t.n, t.indptr, t.kv_lens, t.nnz
        float_bytes = fws.numel() * fws.element_size()
        starts, lens_eff, chunk, work_cap, n_counters, align = impl.eager_layout(opts, kv_lens, float_bytes, dev, cfg)
        n_work = impl._work_size(work_cap, n, n_counters)
        stage_idx = indices.device != dev
        if stage_idx and nnz and t.indices_host is None:
            raise C.value_error("indices", f"a tensor on the host or on {dev}", str(indices.device))
        # The packed array's layout (offsets, the split's sizes) and qo_indptr depend on these four numbers only:
        # an engine's successive plans mostly repeat them, so they are kept for the last ones, with the arrays
        # themselves. A plan of the same layout rewrites the host array and copies it into the same device
        # array, whose views the previous plan made: no allocation and no view per plan (each view of a CUDA
        # tensor costs microseconds of host time). The copy is stream-ordered after the runs of the plan it
        # replaces, as FlashInfer's plan writes its own into the same workspace every time.
        key = (n, work_cap, n_counters, nnz if stage_idx else -1)
        lay = self.__dict__.get("_eager_layout")
        if lay is None or lay[0] != key:
            qo_h = torch.arange(n + 1, dtype=torch.int64)
            o_qo = _align4(n_work)
            o_ip = o_qo + _align4(n + 1)
            o_kl = o_ip + _align4(n + 1)
            o_ix = o_kl + _align4(n)
            # the work list's own four parts, then each array with the alignment gap after it
            sizes = [4 * work_cap, n + 1, 1, n_counters, o_qo - n_work, n + 1, o_ip - o_qo - n - 1, n + 1]
            sizes += [o_kl - o_ip - n - 1, n, o_ix - o_kl - n] + ([nnz] if stage_idx else [])
            host = np.empty(o_ix + (nnz if stage_idx else 0), dtype=np.int32)
            flat = torch.from_numpy(host)
            if dev.type != "cpu":
                flat = torch.empty(host.shape[0], dtype=torch.int32, device=dev)
            # every view in one call (cheaper than one slice each); the pieces after the work list's four
            # alternate between an array and the alignment gap after it
            w0, w1, w2, w3, _, qo_d, _, ip_d, _, kl_d, _, *ix_d = flat.split_with_sizes(sizes)
            arrays = (host, flat, flat[:n_work], (w0, w1, w2, w3), qo_d, ip_d, kl_d, ix_d[0] if stage_idx else None)
            # qo_indptr (0, 1, .., n) depends on the layout alone: written once, kept by every plan of it
            host[o_qo : o_qo + n + 1] = qo_h.numpy()
            lay = self._eager_layout = (key, (o_ip, o_kl), qo_h, arrays)
        _, (o_ip, o_kl), qo_h, arrays = lay
        host, flat, work_d, work_parts, qo_d, ip_d, kl_d, ix_d = arrays
        work_h = host[:n_work]
        work_h.fill(0)
        _, num_work, max_chunks_live = impl._work_host(
            n, work_cap, n, n_counters, starts, kv_lens, lens_eff, chunk, align, out=work_h
        )
        host[o_ip : o_ip + n + 1] = ip
        host[o_kl : o_kl + n] = kv_lens
        if stage_idx and nnz:
            host[-nnz:] = t.indices_host
        if dev.type != "cpu":  # (on the CPU the tensor is the host array itself)
            flat.copy_(torch.from_numpy(host), non_blocking=True)  # the plan's one host-to-device copy
        batch = AttentionBatch(
            batch_size=n,
            qo_indptr=qo_d,
            kv_indptr=ip_d,
            kv_indices=ix_d if stage_idx else (indices if nnz == indices.shape[0] else indices[:nnz]),
            kv_lens=kl_d,
            qo_indptr_host=qo_h,
            kv_lens_host=torch.from_numpy(kv_lens),
            kv_indptr_host=torch.from_numpy(ip),
            alibi_slopes=slopes,
        )
        # The plan object depends on the layout's arrays and these values only: a plan that repeats them (an
        # engine's step over the same batch shape) takes the previous plan's object, which nothing changes.
        pkey = (arrays, opts, cfg, fws, rope_freq, num_work, max_chunks_live, chunk)
        kept = self.__dict__.get("_eager_plan_obj")
        k0 = None if kept is None else kept[0]
        if (
            k0 is not None
            and k0[0] is arrays
            and k0[1] is opts
            and k0[2] is cfg
            and k0[3] is fws
            and k0[4] is rope_freq
            and k0[5:] == pkey[5:]
        ):
            plan_obj = kept[1]
        else:
            views = self.__dict__.get("_part_views")
            if views is None or views[0] is not fws:  # partial-state views of this float workspace, by shape
                views = self._part_views = (fws, {})
            plan_obj = impl.plan_from_work(
                opts,
                cfg,
                work_d,  # the whole work array (work_parts: its four parts)
                bsz=n,
                work_cap=work_cap,
                batch_cap=n,
                n_counters=n_counters,
                num_work=num_work,
                max_chunks_live=max_chunks_live,
                chunk=chunk,
                graph=False,
                float_buffer=fws,
                rope_freq=rope_freq,
                device=dev,
                work_parts=work_parts,
                part_views=views[1],
            )
            self._eager_plan_obj = (pkey, plan_obj)
        planned = Plan(opts, batch, impl, plan_obj, n, t.max_index)
        planned.inherit_binding(self._planned)
        self._planned = planned

    # ------------------------------------------------------------------ CUDA-graph plans
    def _graph_stage_size(self) -> int:
        return self._graph_slots(self._fixed_batch_size)[1]

    def _graph_views(self, iws: torch.Tensor, size: int):
        """(stage [size] int32, the int workspace after it as bytes) of this int workspace, cached while it is the
        same tensor: every view of a CUDA tensor costs ~4 us of host time on the GPU machine."""
        key = (iws, iws.data_ptr(), iws.numel(), size)
        cached = self.__dict__.get("_graph_views_cache")
        if cached is not None and cached[0][0] is iws and cached[0][1:] == key[1:]:
            return cached[1]
        nbytes = iws.numel() * iws.element_size()
        if nbytes < 4 * size:
            raise C.value_error("int_workspace_buffer", f"at least {4 * size} bytes", nbytes)
        b = iws.view(torch.uint8)
        views = (b[: 4 * size].view(torch.int32), b[4 * size :])
        self._graph_views_cache = (key, views)
        return views

    def _graph_stage_buffer(self, size: int) -> torch.Tensor:
        """CUDA-graph mode: the staged arrays live at the start of the int workspace, the work list right
        after them (``_workspace``), so a plan rewrites both with one host-to-device copy."""
        return self._graph_views(self._int_workspace_buffer, size)[0]

    def _workspace(self) -> Workspace:
        if not self._use_cuda_graph:
            return super()._workspace()
        return Workspace(
            float_buffer=self._float_workspace_buffer,
            int_buffer=self._graph_views(self._int_workspace_buffer, self._graph_stage_size())[1],
            cuda_graph=True,
            max_batch_size=self._fixed_batch_size,
        )

    def _graph_layout(self, opts, slopes, cfg):
        """(plan, batch, views) of this option set and workspace: made at its first plan, kept while both are
        the same (a captured graph keeps every address). ``views``: the int32 device region from the start of
        the stage to the end of the work list, its host mirror (with the mirror's work list, the mirror as a tensor
        and the offsets of kv_indptr, kv_lens and last_page_len), the stage's kv_indptr and last_page_len slots and
        the caller's buffers they refill, and the int64 host array whose views are the batch's ``kv_indptr_host``
        and ``kv_lens_host``."""
        fws, iws = self._float_workspace_buffer, self._int_workspace_buffer
        ptrs = (fws.data_ptr(), iws.data_ptr())
        got = self.__dict__.get("_layout")
        if got is not None and got[0] is opts and got[1] is fws and got[2] is iws and got[3] == ptrs:
            return got[4]
        cap = self._fixed_batch_size
        slots, size = self._graph_slots(cap)
        plan_obj = _decode_impl.graph_layout(opts, cfg, self._workspace(), self.device, cap)
        off = {name: o for name, o, _ in slots}
        region = iws.view(torch.uint8)[: 4 * (size + plan_obj.work.numel())].view(torch.int32)
        o_qo, o_ip, o_kl, o_lp = off["qo_indptr"], off["kv_indptr"], off["kv_lens"], off["last_page_len"]
        batch = AttentionBatch(
            batch_size=cap,
            qo_indptr=region[o_qo : o_qo + cap + 1],
            kv_indptr=region[o_ip : o_ip + cap + 1],
            kv_indices=self._paged_kv_indices_buf,
            kv_lens=region[o_kl : o_kl + cap],
            qo_indptr_host=torch.arange(cap + 1, dtype=torch.int64),
            kv_lens_host=None,
            alibi_slopes=slopes,
        )
        # the batch's host copies of kv_indptr and kv_lens: views of one int64 array that every plan rewrites
        # (two tensors made per plan cost about a microsecond)
        host64 = np.zeros(2 * cap + 1, dtype=np.int64)
        h64_t = torch.from_numpy(host64)
        batch.kv_indptr_host, batch.kv_lens_host = h64_t[: cap + 1], h64_t[cap + 1 :]
        # The host mirror of the region, kept with the layout: qo_indptr (0, 1, .., cap) and the alignment gaps are
        # written once; every plan rewrites the batch's arrays whole (the batch size is fixed) and zeroes the work
        # list before writing it. (The copy from pageable memory has read it by the time copy_ returns.) kv_indptr
        # and kv_lens are neighbours: from Python lists they are written in one assignment, the gap between them
        # (``gap``, zeros) with them.
        host = np.zeros(region.shape[0], dtype=np.int32)
        host[o_qo : o_qo + cap + 1] = np.arange(cap + 1, dtype=np.int32)
        gap = [0] * (o_kl - o_ip - cap - 1)
        stage_lp = region[o_lp : o_lp + cap]
        buf_ip, buf_lp = self._paged_kv_indptr_buf[: cap + 1], self._paged_kv_last_page_len_buf[:cap]
        # On a GPU the work list is built on the device from the staged lengths, after the copy, by the launch that
        # refills the caller's buffers: the host then only chooses the split chunk (per-request work on the host was
        # most of a re-plan past a few requests)
        work_list = None
        idx_buf = self._paged_kv_indices_buf
        # (the launch addresses the caller's buffers at unit stride; strided views keep the host path's torch copies)
        unit = buf_ip.is_contiguous() and buf_lp.is_contiguous() and idx_buf.is_contiguous()
        if unit and _decode_impl.builds_work_on_device(self.device):
            work_list = _decode_impl.DeviceWorkList(
                plan_obj, opts, batch.kv_lens, batch.kv_indptr, stage_lp, buf_ip, buf_lp, idx_buf
            )
        mirror = (host, host[size:], torch.from_numpy(host), o_ip, o_kl, o_lp, gap, host64)
        views = (region, mirror, batch.kv_indptr, stage_lp, buf_ip, buf_lp, work_list)
        layout = (plan_obj, batch, views)
        self._layout = (opts, fws, iws, ptrs, layout)
        return layout

    def _write_graph(self, opts, slopes, cfg, t, indptr, indices, last_page_len) -> None:
        """The staged arrays (qo_indptr, kv_indptr, kv_lens, last_page_len) and the work list written at the
        layout's fixed addresses in one host-to-device copy, then the caller's buffers refilled. A small table
        (``t.lists``) is planned from its Python lists, without numpy arrays of it. On a GPU the work list is
        built on the device after the copy, in the launch that refills the caller's buffers
        (``_decode_impl.DeviceWorkList``); the host chooses the split chunk."""
        plan_obj, batch, views = self._graph_layout(opts, slopes, cfg)
        region, mirror, stage_ip, stage_lp, buf_ip, buf_lp, device_list = views
        host, work_h, host_t, o_ip, o_kl, o_lp, gap, host64 = mirror
        n, nnz = t.n, t.nnz  # (n: the fixed batch size)
        if t.lists is not None:
            ipl, lpl, lens = t.lists
            host[o_ip : o_kl + n] = ipl + gap + lens
            host[o_lp : o_lp + n] = lpl
            host64[:] = ipl + lens
        else:
            lens = t.kv_lens
            host[o_ip : o_ip + n + 1] = t.indptr
            host[o_kl : o_kl + n] = lens
            host[o_lp : o_lp + n] = t.last
            host64[: n + 1] = t.indptr
            host64[n + 1 :] = lens
        idx_buf = self._paged_kv_indices_buf
        copy_indices = nnz and indices.data_ptr() != idx_buf.data_ptr()  # (engines that pass the buffer: no copy)
        if device_list is not None:
            # One launch after the copy (the mirror's work list goes as it is, overwritten whole by the kernel): the
            # work list, the caller's indptr / last_page_len buffers from the stage, and the page indices when they
            # are on the buffer's device (else one copy of their own)
            chunk = _decode_impl.graph_chunk(plan_obj, opts, lens, self.device)
            region.copy_(host_t, non_blocking=True)
            fused = copy_indices and indices.device == idx_buf.device
            device_list(chunk, indices if fused else None, nnz if fused else 0)
            if copy_indices and not fused:
                idx_buf[:nnz].copy_(indices[:nnz], non_blocking=True)
            plan_obj.num_work, plan_obj.chunk = None, chunk
        else:
            work_h.fill(0)
            _decode_impl.replan_graph(plan_obj, opts, lens, self.device, out=work_h)
            region.copy_(host_t, non_blocking=True)
            # the caller's buffers refilled, indptr and last_page_len from the stage and the page indices from the
            # caller's table, in one foreach kernel (one CUDA call instead of a memcpy each); engines that pass the
            # buffers themselves need no copy
            dst, src = [], []
            if indptr.data_ptr() != buf_ip.data_ptr():
                dst.append(buf_ip)
                src.append(stage_ip)
            if last_page_len.data_ptr() != buf_lp.data_ptr():
                dst.append(buf_lp)
                src.append(stage_lp)
            if copy_indices:
                dst.append(idx_buf[:nnz])
                src.append(indices if indices.shape[0] == nnz else indices[:nnz])  # (a view costs ~4 us on CUDA)
            if dst:
                torch._foreach_copy_(dst, src, non_blocking=True)
        prev = self._planned
        if prev is not None and prev.plan is plan_obj and prev.batch is batch:
            prev.replanned_in_place(n, t.max_index)  # the same layout: the same plan, rewritten at its addresses
        else:
            self._planned = Plan(opts, batch, _decode_impl, plan_obj, n, t.max_index)
