"""Decode attention: one query token per request over its KV cache (FlashInfer's ``flashinfer.decode``)."""

from __future__ import annotations

import numpy as np
import torch

from . import _checks as C
from . import _config, _custom_ops, _decode_impl
from ._backend import AttentionBatch, Workspace
from ._layout import paged_kv_views, ragged_kv_view
from ._wrapper import (
    DeferredPageRange,
    PendingPageRange,
    PublicWrapperSurface,
    _align4,
    _AttentionWrapper,
    _host_i64,
    read_page_table,
    run_single,
)

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
            _reject_unknown("BatchDecodeWithPagedKVCacheWrapper.plan", kwargs)
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
        fast_seq_lens = seq_lens
        if block_tables is not None:
            indptr, indices, last_page_len = block_table_to_csr(block_tables, seq_lens, page_size, indptr, indices)
            fast_seq_lens = None  # the table's lengths are seq_lens by construction
        if q_len_per_req > 1 or causal:
            self._public_plan = dict(
                indptr=indptr, indices=indices, last_page_len=last_page_len, num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=page_size, pos_encoding_mode=pos_encoding_mode,
                window_left=window_left, logits_soft_cap=logits_soft_cap, q_data_type=q_data_type,
                kv_data_type=kv_data_type, o_data_type=o_data_type, sm_scale=sm_scale, rope_scale=rope_scale,
                rope_theta=rope_theta, non_blocking=non_blocking, seq_lens=seq_lens, fixed_split_size=fixed_split_size,
                disable_split_kv=disable_split_kv, q_len_per_req=q_len_per_req, is_causal=causal,
            )  # fmt: skip
            self._plan_multi_token(**self._public_plan)
            self._q_len_per_req = q_len_per_req
            return
        self._public_plan = None
        self._q_len_per_req = 1
        if w._fast is not None:
            # an engine's per-step plan(): the options of the previous one (_FAST_FIELDS order)
            key = (
                num_qo_heads, num_kv_heads, head_dim, page_size, pos_encoding_mode, window_left, logits_soft_cap,
                q_data_type, kv_data_type, sm_scale, rope_scale, rope_theta, fixed_split_size, disable_split_kv,
                o_data_type, self._use_tensor_cores,
            )  # fmt: skip
            if w._replan_fast(key, indptr, indices, last_page_len, fast_seq_lens):
                a = self.__dict__.get("_plan_args")
                if a is not None:  # forward() re-plans from these
                    a["indptr"], a["indices"], a["last_page_len"] = indptr, indices, last_page_len
                    a["seq_lens"], a["non_blocking"] = seq_lens, non_blocking
                return
        self._plan_args = dict(
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
            seq_lens=seq_lens,
            fixed_split_size=fixed_split_size,
            disable_split_kv=disable_split_kv,
            o_data_type=o_data_type,
        )
        w._plan_general(use_tensor_cores=self._use_tensor_cores, **self._plan_args)

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
        denominator. ``enable_pdl`` is a performance hint. Never synchronizes with the host."""
        fast = self._w._planned
        if (
            fast is not None
            and self._public_plan is None
            and (fast := fast.get("fast_run")) is not None
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
        if args:
            raise TypeError("run(): pass q_scale, k_scale, v_scale, out, lse, return_lse by keyword")
        if torch.compiler.is_compiling() and sinks is None and lse_base == "log2" and lse_layout == "NH":
            # the custom op: Dynamo does not trace the launch path
            return _custom_ops.run_wrapper(
                self, q, (paged_kv_cache,), out=out, lse=lse, return_lse=return_lse,
                q_scale=q_scale, k_scale=k_scale, v_scale=v_scale, window_left=window_left,
            )  # fmt: skip
        _reject_run_extras(
            skip_softmax_threshold_scale_factor=skip_softmax_threshold_scale_factor, kv_cache_sf=kv_cache_sf
        )
        planned = self._q_len_per_req or 1
        if q_len_per_req is not None and q_len_per_req != planned:
            raise C.value_error("q_len_per_req", f"the planned value {planned} (set it in plan())", q_len_per_req)
        core = self._multi if self._public_plan is not None else self._w
        p = core._require_plan()
        if isinstance(q, torch.Tensor) and q.dim() == 3 and q.shape[0] != p["total_q"]:
            bs = p["batch"].batch_size
            raise ValueError(
                f"q: expected batch_size * q_len_per_req = {bs} * {planned} = {p['total_q']} rows as planned, got "
                f"{q.shape[0]} (q_len_per_req is set in plan())"
            )
        if window_left is not None and window_left != p["opts"].window_left:
            raise ValueError(
                f"window_left: expected the planned value {p['opts'].window_left} (set window_left in plan()), "
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


def _reject_run_extras(**given) -> None:
    """run() parameters of FlashInfer 0.7 for kernels this library does not have: an error when set."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{name}: not supported by flashinfer_triton (got a value; pass None)")


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
    previous = self.__dict__.get("_public_plan") or self.__dict__.get("_plan_args") or {}
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


# The options of the fast re-plan's key, in order (the public plan() builds the same tuple positionally).
_FAST_FIELDS = (
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
    "fixed_split_size",
    "disable_split_kv",
    "o_data_type",
    "use_tensor_cores",
)
_FAST_OPTIONS = frozenset(_FAST_FIELDS) - {"page_size"}
_PLAIN_TYPES = frozenset((int, float, str, bool, type(None), torch.dtype))


class _FastState:
    """What the fast re-plan follows: the previous plan()'s options (values and their types), page size and
    workspaces, and what it reuses (tile config, views of the device buffers its copies go to)."""

    __slots__ = ("key", "types", "page_size", "fws", "iws", "float_bytes", "cfg", "qo", "graph", "part_views")

    def __init__(self, key, types, page_size, fws, iws, cfg):
        self.key, self.types, self.page_size, self.fws, self.iws, self.cfg = key, types, page_size, fws, iws, cfg
        self.float_bytes = fws.numel() * fws.element_size()
        self.qo = None  # (batch size, host int64 arange tensor, its numpy view) for eager plans
        self.graph = None  # CUDA-graph mode: see _DecodeCore._graph_fast_views
        self.part_views = {}  # eager plans: (work_cap, Hq, D) -> partial-state views of fws


def _fast_key(page_size, options) -> tuple:
    return tuple(page_size if f == "page_size" else options[f] for f in _FAST_FIELDS)


class _DecodeCore(_AttentionWrapper):
    _is_decode = True
    _paged = True

    _fast = None  # _FastState of the last plan() the fast re-plan may follow

    def plan(self, *, indptr, indices, last_page_len, page_size, seq_lens=None, non_blocking=True, **options):
        if (
            self._fast is not None
            and options.keys() == _FAST_OPTIONS
            and self._replan_fast(_fast_key(page_size, options), indptr, indices, last_page_len, seq_lens)
        ):
            return
        self._plan_general(
            indptr=indptr,
            indices=indices,
            last_page_len=last_page_len,
            page_size=page_size,
            seq_lens=seq_lens,
            non_blocking=non_blocking,
            **options,
        )

    def _plan_general(self, *, indptr, indices, last_page_len, page_size, seq_lens=None, non_blocking=True, **options):
        self._fast = None
        if self._use_cuda_graph:
            bs = self._fixed_batch_size
            C.check_index_tensor("indptr", indptr)
            if indptr.shape[0] != bs + 1:
                raise C.value_error(
                    "indptr",
                    f"shape [batch_size + 1] = [{bs + 1}] (batch size fixed by the CUDA-graph buffers)",
                    C.shape_str(indptr.shape),
                )
        indptr_h, kv_lens, max_index, last_h = read_page_table(
            indptr,
            indices,
            last_page_len,
            page_size,
            scratch=self._range_scratch(),
            read_indices=_config.HOST_PATH.device_index_read,
        )
        batch_size = kv_lens.numel()
        if seq_lens is not None:
            C.check_tensor("seq_lens", seq_lens, dim=1)
            if seq_lens.shape[0] != batch_size or not torch.equal(_host_i64(seq_lens), kv_lens):
                raise C.value_error("seq_lens", "the KV lengths the page table gives", "different lengths")
        graph_buffers = None
        if self._use_cuda_graph:
            graph_buffers = {
                "qo_indptr": self._qo_indptr_buf,
                "kv_indptr": self._paged_kv_indptr_buf,
                "kv_indices": self._paged_kv_indices_buf,
                "last_page_len": self._paged_kv_last_page_len_buf,
            }
            nnz = int(indptr_h[-1])
            if nnz > self._paged_kv_indices_buf.shape[0]:
                raise C.value_error(
                    "indices", f"at most {self._paged_kv_indices_buf.shape[0]} pages (paged_kv_indices_buffer)", nnz
                )
        self._plan_common(
            qo_indptr_host=torch.arange(batch_size + 1, dtype=torch.int64),
            kv_indptr_host=indptr_h,
            kv_indices=indices,
            kv_lens_host=kv_lens,
            last_page_len_host=last_h,
            graph_buffers=graph_buffers,
            max_page_index=max_index,
            page_size=page_size,
            non_blocking=non_blocking,
            **options,
        )
        self._fast = self._fast_state(page_size, options)

    # ------------------------------------------------------------------ CUDA-graph staging in the int workspace
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
        after them (``_workspace``), so a re-plan rewrites both with one host-to-device copy."""
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

    # ------------------------------------------------------------------ fast re-plan
    def _fast_state(self, page_size, options):
        """The state a later plan() with the same options follows, or None where it may not."""
        p = self._planned
        if p["impl"] is not _decode_impl or options.keys() != _FAST_OPTIONS:
            return None
        plan_obj = p["plan"]
        key = _fast_key(page_size, options)
        types = tuple(map(type, key))
        if not all(t in _PLAIN_TYPES for t in types):  # options that do not compare plainly: no fast path
            return None
        fws, iws = self._float_workspace_buffer, self._int_workspace_buffer
        fast = _FastState(key, types, page_size, fws, iws, plan_obj.config)
        if self._use_cuda_graph:
            if not plan_obj.graph or plan_obj.batch_size != self._fixed_batch_size:
                return None
            fast.graph = self._graph_fast_views(plan_obj)
            if fast.graph is None:
                return None
        elif plan_obj.graph:
            return None
        return fast

    def _graph_fast_views(self, plan_obj):
        """(region, host offsets, caller buffer views) for the one-copy CUDA-graph re-plan: ``region`` is the
        int32 device range from the kv_indptr slot of the stage to the end of the work list."""
        cap = self._fixed_batch_size
        slots, size = self._graph_slots(cap)
        iws = self._int_workspace_buffer
        if iws.data_ptr() + 4 * size != plan_obj.work.data_ptr():  # the work list is not where the region expects
            return None
        ip_buf, lp_buf = self._paged_kv_indptr_buf, self._paged_kv_last_page_len_buf
        key = (iws, ip_buf, lp_buf, iws.data_ptr(), ip_buf.data_ptr(), lp_buf.data_ptr(), plan_obj.work.numel())
        cached = self.__dict__.get("_fast_views_cache")  # the same views as at the previous general plan()
        if cached is not None and all(a is b for a, b in zip(cached[0][:3], key[:3])) and cached[0][3:] == key[3:]:
            return cached[1]
        off = {name: o for name, o, _ in slots}
        start = off["kv_indptr"]
        region = iws.view(torch.uint8)[4 * start : 4 * size + plan_obj.work.numel() * 4].view(torch.int32)
        views = (
            region,
            off["kv_indptr"] - start,
            off["kv_lens"] - start,
            off["last_page_len"] - start,
            size - start,
            region[: cap + 1],
            region[off["last_page_len"] - start : off["last_page_len"] - start + cap],
            ip_buf[: cap + 1],
            lp_buf[:cap],
        )
        self._fast_views_cache = (key, views)
        return views

    def _replan_fast(self, key, indptr, indices, last_page_len, seq_lens=None) -> bool:
        """plan() with the options of the previous plan(): an engine's per-step call.

        Same result as the general path with fewer host operations: the page table is validated and the
        lengths computed in numpy, every array (work list included) goes to the device in one host-to-device
        copy (CUDA-graph mode: into the same slots, then the caller's buffers are refilled). Returns False
        (the general path then runs, and raises the errors) for anything unusual: other options or
        workspaces, tensors not on the CPU / the device, an invalid table."""
        f = self._fast
        if (
            key != f.key
            or tuple(map(type, key)) != f.types
            or f.fws is not self._float_workspace_buffer
            or f.iws is not self._int_workspace_buffer
        ):
            return False
        T, i32 = torch.Tensor, torch.int32
        if not (
            type(indptr) is T
            and type(last_page_len) is T
            and type(indices) is T
            and indptr.dtype is i32
            and last_page_len.dtype is i32
            and indices.dtype is i32
            and indptr.dim() == 1
            and indices.dim() == 1
            and last_page_len.dim() == 1
        ):
            return False
        n = indptr.shape[0] - 1
        graph = f.graph
        if n < 1 or last_page_len.shape[0] != n or (graph is not None and n != self._fixed_batch_size):
            return False
        dev = self.device
        idx_on_dev = not indices.is_cpu
        if idx_on_dev and indices.device != dev:
            return False
        read_range = False  # True: min/max reduced into the read; "host": the indices themselves read back
        n_ix = indices.shape[0]
        if indptr.is_cpu and last_page_len.is_cpu:
            ip = indptr.numpy().astype(np.int64)
            lp = last_page_len.numpy().astype(np.int64)
        elif not indptr.is_cpu and indptr.device == dev and last_page_len.device == dev:
            # ONE device-to-host read (one cat kernel, one copy, the sync): the lengths, and the page indices
            # themselves when short (range checked here: an int, so run() never waits), else their min/max
            # reduced into the read when they are exactly the table's (the common case)
            parts = [indptr, last_page_len]
            if idx_on_dev and 0 < n_ix <= _config.HOST_PATH.device_index_read:
                parts.append(indices)
                read_range = "host"
            elif idx_on_dev and n_ix > 0 and (graph is None or _config.HOST_PATH.graph_page_range != "lazy"):
                scratch = self._range_scratch()
                mm = scratch.buffers(dev)[0]
                torch.aminmax(indices, out=scratch.minmax_out(dev))
                parts.append(mm)
                read_range = True
            got = self._range_scratch().read(torch.cat(parts))
            both = got[: 2 * n + 1].astype(np.int64) if read_range == "host" else got.astype(np.int64)
            ip, lp = both[: n + 1], both[n + 1 : 2 * n + 1]
        else:
            return False
        if ip[0] != 0:
            return False
        npages = ip[1:] - ip[:-1]
        nnz = int(ip[-1])
        fewest = npages.min()
        if nnz > n_ix or fewest < 0:
            return False
        if graph is not None and nnz > self._paged_kv_indices_buf.shape[0]:
            return False
        ps = f.page_size
        if fewest > 0:  # every request has pages (the usual case): 1 <= last_page_len <= page_size
            if (lp - 1).view(np.uint64).max() >= ps:  # lp < 1 or lp > ps (one reduction: lp - 1 < 0 reads huge)
                return False
            kv_lens = npages * ps + (lp - ps)
        else:  # empty requests: 0 <= last_page_len <= page_size there, 0 keys
            has = npages > 0
            if ((lp < has) | (lp > ps)).any():
                return False
            kv_lens = ((npages - 1) * ps + lp) * has
        if seq_lens is not None and not (  # engines' seq_lens: host int tensors equal to the table's lengths
            type(seq_lens) is T
            and seq_lens.is_cpu
            and seq_lens.dtype in (i32, torch.int64)
            and seq_lens.shape == (n,)
            and np.array_equal(seq_lens.numpy(), kv_lens)
        ):
            return False
        idx = None
        if nnz == 0:
            max_index = -1
        elif not idx_on_dev:
            idx = indices.numpy()[:nnz]
            hi = int(idx.view(np.uint32).max())  # a negative index reads as >= 2**31
            if hi >= 1 << 31:
                return False
            max_index = hi
        elif read_range == "host":
            hi = int(got[2 * n + 1 : 2 * n + 1 + nnz].view(np.uint32).max())  # a negative index reads >= 2**31
            if hi >= 1 << 31:
                return False
            max_index = hi
        elif read_range and nnz == n_ix:
            lo, max_index = int(both[-2]), int(both[-1])
            if lo < 0:
                return False
        else:
            # CUDA-graph mode, "lazy": no reduction while the previous plan's range went unread (no eager
            # run() since: the graph is being replayed); an eager run() reduces a deferred range itself.
            prev = self._planned["max_page_index"]
            lazy = graph is not None and _config.HOST_PATH.graph_page_range == "lazy"
            table = indices if nnz == n_ix else indices[:nnz]  # (a slice costs ~4 us of host time on CUDA)
            if lazy and isinstance(prev, PendingPageRange) and prev.unread():
                max_index = DeferredPageRange(table, "paged_kv_indices", self._range_scratch())
            else:
                max_index = PendingPageRange.of_device(table, "paged_kv_indices", self._range_scratch())
        if graph is not None:
            self._write_graph(graph, n, ip, lp, kv_lens, indices, nnz, indptr, last_page_len)
            p = self._planned
            batch = p["batch"]
            batch.kv_lens_host = torch.from_numpy(kv_lens)
            batch.kv_indptr_host = torch.from_numpy(ip)
            p["max_page_index"] = max_index
            p["fast_run"] = None  # the page range is new: the next run() checks it
        else:
            self._write_eager(f, n, ip, kv_lens, indices, idx, nnz, max_index)
        return True

    def _write_graph(self, views, n, ip, lp, kv_lens, indices, nnz, indptr, last_page_len) -> None:
        region, o_ip, o_kl, o_lp, o_work, stage_ip, stage_lp, buf_ip, buf_lp = views
        p = self._planned
        host = np.zeros(region.shape[0], dtype=np.int32)
        host[o_ip : o_ip + n + 1] = ip
        host[o_kl : o_kl + n] = kv_lens
        host[o_lp : o_lp + n] = lp
        _decode_impl.replan_graph(p["plan"], p["opts"], kv_lens, self.device, out=host[o_work:])
        region.copy_(torch.from_numpy(host), non_blocking=True)
        # the caller's buffers refilled from the stage: both in one foreach kernel (one CUDA call instead of two
        # memcpys); engines that pass the buffers themselves need no copy
        fill_ip = indptr.data_ptr() != buf_ip.data_ptr()
        fill_lp = last_page_len.data_ptr() != buf_lp.data_ptr()
        if fill_ip and fill_lp:
            torch._foreach_copy_((buf_ip, buf_lp), (stage_ip, stage_lp), non_blocking=True)
        elif fill_ip:
            buf_ip.copy_(stage_ip, non_blocking=True)
        elif fill_lp:
            buf_lp.copy_(stage_lp, non_blocking=True)
        idx_buf = self._paged_kv_indices_buf
        if nnz and indices.data_ptr() != idx_buf.data_ptr():
            idx_buf[:nnz].copy_(indices[:nnz], non_blocking=True)

    def _write_eager(self, f, n, ip, kv_lens, indices, idx, nnz, max_index) -> None:
        """One packed host array [work list | qo_indptr | kv_indptr | kv_lens | page indices (when on the
        host)], every part on a 16-byte boundary, copied to the device at once; the plan holds views of it."""
        p = self._planned
        opts = p["opts"]
        impl = _decode_impl
        dev = self.device
        cfg = f.cfg if f.cfg is not None else impl.choose_config(opts)
        starts, lens_eff, chunk, work_cap, n_counters, align = impl.eager_layout(opts, kv_lens, f.float_bytes, dev, cfg)
        n_work = impl._work_size(work_cap, n, n_counters)
        qo = f.qo
        if qo is None or qo[0] != n:
            qo_h = torch.arange(n + 1, dtype=torch.int64)
            qo = f.qo = (n, qo_h, qo_h.numpy())
        o_qo = _align4(n_work)
        o_ip = o_qo + _align4(n + 1)
        o_kl = o_ip + _align4(n + 1)
        o_ix = o_kl + _align4(n)
        stage_idx = indices.is_cpu
        host = np.empty(o_ix + (nnz if stage_idx else 0), dtype=np.int32)
        work_h = host[:n_work]
        work_h.fill(0)
        _, num_work, max_chunks_live = impl._work_host(
            n, work_cap, n, n_counters, starts, kv_lens, lens_eff, chunk, align, out=work_h
        )
        host[o_qo : o_qo + n + 1] = qo[2]
        host[o_ip : o_ip + n + 1] = ip
        host[o_kl : o_kl + n] = kv_lens
        if stage_idx and nnz:
            host[o_ix:] = idx
        flat = torch.from_numpy(host)
        if dev.type != "cpu":
            flat = flat.to(dev, non_blocking=True)
        # every view in one call (cheaper than one slice each; the work list's own four parts too); the odd
        # pieces are the alignment gaps
        wparts = [4 * work_cap, n + 1, 1, n_counters]
        sizes = wparts + [o_qo - n_work, n + 1, o_ip - o_qo - n - 1, n + 1, o_kl - o_ip - n - 1, n, o_ix - o_kl - n]
        if stage_idx:
            sizes.append(nnz)
        w0, w1, w2, w3, _, qo_d, _, ip_d, _, kl_d, _, *ix_d = flat.split_with_sizes(sizes)
        old = p["batch"]
        batch = AttentionBatch(
            batch_size=n,
            qo_indptr=qo_d,
            kv_indptr=ip_d,
            kv_indices=ix_d[0] if stage_idx else (indices if nnz == indices.shape[0] else indices[:nnz]),
            kv_lens=kl_d,
            qo_indptr_host=qo[1],
            kv_lens_host=torch.from_numpy(kv_lens),
            kv_indptr_host=torch.from_numpy(ip),
            alibi_slopes=old.alibi_slopes,
        )
        plan_obj = impl.plan_from_work(
            opts,
            cfg,
            flat[:n_work],  # the whole work array (its four parts are w0..w3)
            bsz=n,
            work_cap=work_cap,
            batch_cap=n,
            n_counters=n_counters,
            num_work=num_work,
            max_chunks_live=max_chunks_live,
            chunk=chunk,
            graph=False,
            float_buffer=f.fws,
            rope_freq=p["plan"].rope_freq,
            device=dev,
            work_parts=(w0, w1, w2, w3),
            part_views=f.part_views,
        )
        self._planned = {
            "opts": opts,
            "batch": batch,
            "impl": impl,
            "plan": plan_obj,
            "total_q": n,
            "max_page_index": max_index,
        }


def _reject_unknown(where: str, kwargs: dict) -> None:
    """Keyword arguments no signature here names: ``enable_pdl`` (a launch hint, no effect on results) is
    accepted; anything else is a mistake worth naming, never silently dropped."""
    unknown = sorted(set(kwargs) - {"enable_pdl"})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s): {', '.join(unknown)}")
