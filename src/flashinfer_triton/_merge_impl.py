"""Host side of the merge kernels (``kernels/merge.py``): attention-state merging on device tensors.

States are ``(v, s)``: ``v [..., D]`` float16/bfloat16/float32 (last dim contiguous), ``s`` float32
base-2 log-sum-exp of the same leading shape. An empty state (``s = -inf``) leaves the other unchanged,
two empty states give ``v = 0, s = -inf`` (never NaN). Outputs keep the dtype of the input ``v``.
The public layer (``_merge_api``, their only caller) validates arguments: these functions assume shapes agree,
every lse is float32 and every ``v`` has a unit-stride last dimension.

Functions (semantics of ``flashinfer_triton.reference``):

* ``merge_state(v_a, s_a, v_b, s_b) -> (v, s)``
* ``merge_state_in_place(v, s, v_other, s_other, mask=None) -> None``; ``mask`` is bool over ``v``'s
  first dimension (rows where it is False stay untouched).
* ``merge_states(v [N, K, H, D], s [N, K, H]) -> (v [N, H, D], s [N, H])``

Only tensors on a device that runs Triton (CUDA, or the CPU under ``TRITON_INTERPRET=1``) come here: the public
layer (``_merge_api``) takes the PyTorch path for the others, through ``_backend.kernels_for``.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from ._config import MergeConfig, merge_config
from ._config import cdiv as _cdiv
from ._config import next_pow2 as _np2
from ._launch import FastKernel
from ._launch import bind as _bind
from .kernels.merge import _merge_fixed_kernel as _merge_fixed_jit
from .kernels.merge import _merge_pair_kernel as _merge_pair_jit
from .kernels.merge import _merge_states_kernel as _merge_states_jit

_merge_fixed_kernel = FastKernel(_merge_fixed_jit)
_merge_pair_kernel = FastKernel(_merge_pair_jit)
_merge_states_kernel = FastKernel(_merge_states_jit)

# The launches pass every argument positionally (keyword arguments cost Triton's launch path host time per call,
# and the short path takes positional launches only), so they depend on these parameter orders.
_FIXED_PARAMS = ["v_ptr", "s_ptr", "out_v_ptr", "out_s_ptr", "num_rows", "num_heads", "num_hblocks", "stride_vr",
                 "stride_vk", "stride_vh", "stride_sr", "stride_sk", "stride_sh", "stride_or", "stride_oh",
                 "stride_osr", "stride_osh", "NUM_K", "HEAD_DIM", "BLOCK_H", "BLOCK_D", "STREAM", "EVEN"]  # fmt: skip
_PAIR_PARAMS = ["va_ptr", "sa_ptr", "vb_ptr", "sb_ptr", "out_v_ptr", "out_s_ptr", "mask_ptr", "num_rows",
                "rows_per_mask", "stride_va", "stride_vb", "stride_vo", "HEAD_DIM", "BLOCK_R", "BLOCK_D",
                "HAS_MASK"]  # fmt: skip
_STATES_PARAMS = ["v_ptr", "s_ptr", "out_v_ptr", "out_s_ptr", "num_states", "num_heads", "stride_vr", "stride_vk",
                  "stride_vh", "stride_sr", "stride_sk", "stride_sh", "stride_or", "stride_oh", "stride_osr",
                  "stride_osh", "HEAD_DIM", "BLOCK_K", "BLOCK_H", "BLOCK_D", "STREAM"]  # fmt: skip
if (
    _merge_fixed_kernel.arg_names != _FIXED_PARAMS
    or _merge_pair_kernel.arg_names != _PAIR_PARAMS
    or _merge_states_kernel.arg_names != _STATES_PARAMS
):
    raise RuntimeError("the merge kernels' parameters changed: update the positional launches in _merge_impl")


__all__ = ["merge_state", "merge_state_in_place", "merge_states"]


@lru_cache(maxsize=256)
def _states_config_cached(few: bool, num_heads: int, head_dim: int, num_states: int):
    block_d = _np2(head_dim)
    if few:
        block_k = max(1, min(64, _np2(num_states), 8192 // block_d))
        # One warp per 2048 values: the reductions over the states stay within a warp (shuffles, no
        # shared-memory barrier) for the common small tiles, and more programs fit on an SM.
        tile = block_k * block_d
        return block_k, 1, block_d, 1 if tile <= 2048 else 2 if tile <= 4096 else 4
    block_h = max(1, min(_np2(num_heads), 4096 // block_d))
    return 1, block_h, block_d, 4


def _states_config(num_rows: int, num_heads: int, head_dim: int, num_states: int, cfg: MergeConfig):
    """(BLOCK_K, BLOCK_H, BLOCK_D, num_warps) for ``_merge_states_kernel``.

    Few (row, head) pairs (a small batch): one head per program and up to 64 states loaded at once, so
    neither the heads nor the states are walked serially. Many pairs
    (``merge_states`` over long sequences): 4096-value tiles of heads, one state per step (measured
    0.86-0.94 of copy bandwidth on H100 with this shape).
    """
    return _states_config_cached(num_rows * num_heads <= cfg.few_pairs, num_heads, head_dim, num_states)


@lru_cache(maxsize=256)
def _fixed_config(num_heads: int, head_dim: int, num_states: int, elem_bytes: int, tile_values: int, per_thread: int):
    """(BLOCK_H, BLOCK_D, num_warps) of ``_merge_fixed_kernel``: ``tile_values`` values per program over
    all states, ``per_thread`` values of one state per thread (8 fp16 = one 16-byte load)."""
    block_d = _np2(head_dim)
    block_h = max(1, min(_np2(num_heads), tile_values // (_np2(num_states) * block_d)))
    num_warps = max(1, min(8, (block_h * block_d) // (32 * per_thread)))
    return block_h, block_d, num_warps


def _launch_fixed(v, s, out_v, out_s, cfg: MergeConfig) -> tuple:
    """Launch the fixed-count kernel; (what the launch returned, its arguments, its grid)."""
    n, k, h, d = v.shape
    block_h, block_d, num_warps = _fixed_config(
        h, d, k, v.element_size(), cfg.fixed_tile_values, cfg.fixed_values_per_thread
    )
    hblocks = _cdiv(h, block_h)
    vs, ss, os_ = v.stride(), s.stride(), out_v.stride()
    args = (
        v,
        s,
        out_v,
        out_s,
        n,
        h,
        hblocks,
        vs[0],
        vs[1],
        vs[2],
        ss[0],
        ss[1],
        ss[2],
        os_[0],
        os_[1],
        out_s.stride(0),
        out_s.stride(1),
        k,  # NUM_K
        d,  # HEAD_DIM
        block_h,  # BLOCK_H
        block_d,  # BLOCK_D
        cfg.stream_hints,  # STREAM
        h % block_h == 0 and d == block_d,  # EVEN
    )
    grid = (n * hblocks,)
    return _merge_fixed_kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps), args, grid


def _launch_states(v, s, out_v, out_s, cfg: MergeConfig) -> tuple:
    """Launch the online kernel (any state count); (what the launch returned, its arguments, its grid)."""
    n, k, h, d = v.shape
    block_k, block_h, block_d, num_warps = _states_config(n, h, d, k, cfg)
    vs, ss, os_ = v.stride(), s.stride(), out_v.stride()
    args = (
        v,
        s,
        out_v,
        out_s,
        k,
        h,
        vs[0],
        vs[1],
        vs[2],
        ss[0],
        ss[1],
        ss[2],
        os_[0],
        os_[1],
        out_s.stride(0),
        out_s.stride(1),
        d,  # HEAD_DIM
        block_k,  # BLOCK_K
        block_h,  # BLOCK_H
        block_d,  # BLOCK_D
        cfg.stream_hints,  # STREAM
    )
    grid = (n, _cdiv(h, block_h))
    return _merge_states_kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps), args, grid


def merge_states(
    v: torch.Tensor, s: torch.Tensor, *, config: MergeConfig | None = None, bind: list | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [N, K, H, D]``, ``s [N, K, H]`` -> ``v [N, H, D]`` (dtype of v), ``s [N, H]`` float32. ``bind``: a
    list that receives the launch bound to everything but the four pointers (v, s, out v, out s), when a kernel
    was launched and the short path applies: it depends only on the shapes, strides, dtypes and device of v and
    s (and the configuration)."""
    n, k, h, d = v.shape
    out_v = torch.empty((n, h, d), dtype=v.dtype, device=v.device)
    out_s = torch.empty((n, h), dtype=torch.float32, device=v.device)
    if k == 1:
        # One state is returned as it is (the reference's rule, also for an empty state's v).
        out_v.copy_(v[:, 0])
        out_s.copy_(s[:, 0])
        return out_v, out_s
    if n == 0 or h == 0:
        return out_v, out_s
    cfg = config or merge_config()
    if 2 <= k <= cfg.fixed_max_k:
        kernel = _merge_fixed_kernel
        launched = _launch_fixed(v, s, out_v, out_s, cfg)
    else:
        kernel = _merge_states_kernel
        launched = _launch_states(v, s, out_v, out_s, cfg)
    if bind is not None:
        bound = _bind(kernel, launched[0], launched[1], launched[2], 4)
        if bound is not None:
            bind.append(bound)
    return out_v, out_s


def _rows(x: torch.Tensor, d: int):
    """(tensor, row stride) seeing ``x`` as ``[rows, D]`` with unit stride on D: ``x`` itself when it is
    contiguous (no view made), else a view or a copy."""
    if x.is_contiguous():
        return x, d
    x2 = x.reshape(-1, d)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    return x2, x2.stride(0)


def _lse(x: torch.Tensor) -> torch.Tensor:
    """The (float32) lse as one contiguous row (``x`` itself in the common case)."""
    return x if x.is_contiguous() else x.reshape(-1).contiguous()


@lru_cache(maxsize=256)
def _pair_config(head_dim: int, num_rows: int) -> tuple[int, int, int]:
    """(rows per program, BLOCK_D, num_warps): 4096-value tiles, fewer rows when that would leave SMs idle
    (at least ~264 programs, two per SM of an H100, for small inputs)."""
    block_d = _np2(head_dim)
    block_r = max(1, 4096 // block_d)
    if num_rows < block_r * 264:
        block_r = max(1, min(block_r, _np2(max(1, num_rows // 264))))
    return block_r, block_d, 4


def _launch_pair(va, stride_va, sa, vb, stride_vb, sb, out_v, stride_vo, out_s, num_rows, d, mask, rows_per_mask):
    if num_rows == 0:
        return
    block_r, block_d, num_warps = _pair_config(d, num_rows)
    args = (
        va,
        sa,
        vb,
        sb,
        out_v,
        out_s,
        mask if mask is not None else sa,
        num_rows,
        rows_per_mask,
        stride_va,
        stride_vb,
        stride_vo,
        d,  # HEAD_DIM
        block_r,  # BLOCK_R
        block_d,  # BLOCK_D
        mask is not None,  # HAS_MASK
    )
    grid = (_cdiv(num_rows, block_r),)
    kernel = _merge_pair_kernel.run(*args, grid=grid, warmup=False, num_warps=num_warps)
    return kernel, args, grid


def merge_state(v_a, s_a, v_b, s_b, bind: list | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states; returns ``(v, s)`` with ``v`` in ``v_a``'s dtype and ``s`` float32. ``bind``: a list
    that receives the launch bound to everything but the seven pointers (v_a, s_a, v_b, s_b, out v, out s,
    s_a again) when the states are used as they are (contiguous, float32 lse)."""
    d = v_a.shape[-1]
    out_v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    out_s = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    va, sva = _rows(v_a, d)
    vb, svb = _rows(v_b, d)
    sa, sb = _lse(s_a), _lse(s_b)
    launched = _launch_pair(va, sva, sa, vb, svb, sb, out_v, d, out_s, out_s.numel(), d, None, 1)
    if bind is not None and launched is not None and va is v_a and vb is v_b and sa is s_a and sb is s_b:
        bound = _bind(_merge_pair_kernel, launched[0], launched[1], launched[2], 7)
        if bound is not None:
            bind.append(bound)
    return out_v, out_s


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` where ``mask`` (bool over dim 0) is True."""
    d = v.shape[-1]
    # Work straight in v and s when they are contiguous (the common case: no view, no copy); else in
    # copies written back afterwards.
    v_direct = v.is_contiguous()
    v_rows = v if v_direct else v.reshape(-1, d).clone()
    s_direct = s.is_contiguous()
    s_rows = s if s_direct else s.reshape(-1).clone()
    mask_u8 = None
    rows_per_mask = 1
    num_rows = s.numel()
    if mask is not None:
        mask_u8 = (mask if mask.is_contiguous() else mask.contiguous()).view(torch.uint8)
        rows_per_mask = max(1, num_rows // max(1, mask_u8.numel()))
    vo, svo = _rows(v_other, d)
    sv = d if v_direct else v_rows.stride(0)
    _launch_pair(v_rows, sv, s_rows, vo, svo, _lse(s_other), v_rows, sv, s_rows, num_rows, d, mask_u8, rows_per_mask)
    if not v_direct:
        v.copy_(v_rows.view(v.shape))
    if not s_direct:
        s.copy_(s_rows.view(s.shape))
