"""Host side of the merge kernels (``kernels/merge.py``): attention-state merging on device tensors.

States are ``(v, s)``: ``v [..., D]`` float16/bfloat16/float32 (last dim contiguous), ``s`` float32
base-2 log-sum-exp of the same leading shape. An empty state (``s = -inf``) leaves the other unchanged,
two empty states give ``v = 0, s = -inf`` (never NaN). Outputs keep the dtype of the input ``v``.
The public layer validates arguments; these functions assume shapes agree.

Functions (semantics of ``flashinfer_triton.reference``):

* ``merge_state(v_a, s_a, v_b, s_b) -> (v, s)``
* ``merge_state_in_place(v, s, v_other, s_other, mask=None) -> None``; ``mask`` is bool over ``v``'s
  first dimension (rows where it is False stay untouched).
* ``merge_states(v [N, K, H, D], s [N, K, H]) -> (v [N, H, D], s [N, H])``
* ``merge_partial_states(part_v, part_s, indptr, out_v, out_s=None, *, min_states=1) -> None``:
  the split-KV reduction with a variable number of partial states per row, for the decode and prefill
  paths. ``part_v [S, H, D]`` (any float dtype, last dim contiguous), ``part_s [S, H]`` float32,
  ``indptr [R + 1]`` int32 on the device: row ``r``'s states are ``part_*[indptr[r]:indptr[r+1]]``.
  Writes ``out_v [R, H, D]`` (its own dtype, any strides with a contiguous last dim) and, when given,
  ``out_s [R, H]`` float32. Rows with fewer than ``min_states`` states are not written at all (the
  decode path uses ``min_states=2``: unsplit requests are written by the attention kernel itself);
  a row with zero states and ``min_states <= 0`` gets ``v = 0, s = -inf``. ``max_states`` (optional,
  host-known) is a tile-size hint only: up to 64 states of a row are loaded at once, more take more
  steps; any count is handled. No host synchronization,
  grid ``(R, ceil(H / BLOCK_H))`` fixed by the shapes, so it can be captured in a CUDA graph.

On devices that do not run Triton (CPU without ``TRITON_INTERPRET=1``) the same functions fall back to
the reference in PyTorch.
"""

from __future__ import annotations

from functools import lru_cache

import torch

from . import reference
from ._backend import use_triton
from ._launch import FastKernel
from .kernels.merge import _merge_fixed_kernel as _merge_fixed_jit
from .kernels.merge import _merge_pair_kernel as _merge_pair_jit
from .kernels.merge import _merge_states_kernel

_merge_fixed_kernel = FastKernel(_merge_fixed_jit)
_merge_pair_kernel = FastKernel(_merge_pair_jit)

# _launch_fixed / _launch_pair pass every argument positionally (keyword arguments cost Triton's launch path
# host time per call), so they depend on these parameter orders.
_FIXED_PARAMS = ["v_ptr", "s_ptr", "out_v_ptr", "out_s_ptr", "num_rows", "num_heads", "num_hblocks", "stride_vr",
                 "stride_vk", "stride_vh", "stride_sr", "stride_sk", "stride_sh", "stride_or", "stride_oh",
                 "stride_osr", "stride_osh", "NUM_K", "HEAD_DIM", "BLOCK_H", "BLOCK_D", "STREAM", "WIDE",
                 "ROW_FAST", "PERSIST", "STAGES", "EVEN"]  # fmt: skip
_PAIR_PARAMS = ["va_ptr", "sa_ptr", "vb_ptr", "sb_ptr", "out_v_ptr", "out_s_ptr", "mask_ptr", "num_rows",
                "rows_per_mask", "stride_va", "stride_vb", "stride_vo", "HEAD_DIM", "BLOCK_R", "BLOCK_D", "HAS_MASK",
                "STREAM", "HINT_B", "WIDE", "RCP", "EVEN"]  # fmt: skip
if _merge_fixed_kernel.arg_names != _FIXED_PARAMS or _merge_pair_kernel.arg_names != _PAIR_PARAMS:
    raise RuntimeError("the merge kernels' parameters changed: update the positional launches in _merge_impl")


def _cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (``triton.cdiv`` costs microseconds per host call)."""
    return -(-a // b)


def _np2(n: int) -> int:
    """The next power of two >= n (n >= 1), as ``triton.next_power_of_2`` but cheap on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


__all__ = ["merge_state", "merge_state_in_place", "merge_states", "merge_partial_states"]

# Streaming cache hints on the value loads (evict_first) and stores (.cs) of the merge kernels. H100, kernel
# time: merge_states N512-K8 22.8 -> 19.8 us, N4096-K8 115.6 -> 114.1,
# N16384-K2 43.9 -> 42.7, N4096-K2 40.8 -> 41.2 (noise); the pair kernel got slower at N32768 (275.8 ->
# 287.4 us), so it keeps plain loads.
STREAM_HINTS = True
PAIR_STREAM_HINTS = False
# The fixed-K merge_states kernel's hints: True (value loads and stores), False, "load" or "store" only.
FIXED_STREAM_HINTS = True
_STREAM_CODES = {False: 0, True: 1, "load": 2, "store": 3}
# Up to this many (row, head) pairs the states of a row are merged in parallel (see _states_config).
FEW_PAIRS = 8192

# Variants swept on the H100 against FlashInfer 0.7.2 in one process (warm = graph replay, cold = L2 flushed).
# Defaults from it: the fixed-K kernel with 64-bit offsets ("fixed-wide": FI/ours warm 1.00-1.09 and cold
# 1.01-1.49 on every merge_states row but N512-K8 warm, 0.64: inputs resident in L2) and the pair kernel's
# reciprocal (in place: warm 0.98-1.01, cold 1.00-1.08).
# merge_states kernel: "3d" = _merge_states_kernel (3-D [BLOCK_K, BLOCK_H, D] tiles, online over states;
# the many-rows tile [1, 32, 128] has 121 registers and three shared-memory layout conversions per state,
# sm_90 offline compile); "fixed" = _merge_fixed_kernel for 2 <= K <= FIXED_MAX_K (2-D [BLOCK_H, D]
# tiles, every state's load issued before the first use, 31-82 registers, no shared memory).
STATES_KERNEL = "fixed"
FIXED_MAX_K = 16
# Fixed kernel knobs: values per thread per state (8 fp16 = one 16-byte load), values per program over
# all states, 32-bit offsets when they fit, tile order, persistent grid (programs per SM, 0 = off) and
# the pipelining depth of the persistent loop.
FIXED_VALUES_PER_THREAD = 8
FIXED_TILE_VALUES = 4096
FIXED_NARROW = False
FIXED_ROW_FAST = False
FIXED_PERSIST = 0
FIXED_STAGES = 1
# No masks when the head blocks and D tile fit the shape exactly (fewer instructions).
FIXED_EVEN = True
# FIXED_L2_RESIDENT (off by default): inputs that fit in L2 take one program per row's heads
# (FIXED_RESIDENT_TILE values over all states, as FlashInfer's grid) and streaming hints on the stores only, so
# the value loads keep their L2 lines. H100, same process as FlashInfer 0.7.2: with the inputs
# L2-resident (CUDA-graph loop) 512 x 8 x 32 x 128 takes 7.4-8.2 us vs FlashInfer's 7.5-8.1 (the default
# tiles and hints: 13.4), 64 x 16 3.3-3.4 vs 4.9-5.1; but with L2 flushed before each call (the benchmark's
# eager column) the 512 x 8 case is bimodal, 21.1 / 38.5 / 42.6 us in three runs against the default's
# steady 18.7-19.2 and FlashInfer's 21.0-21.6 (plain value loads after a flush; evict_first loads do not show
# it). At 4096 rows (268 MB) the one-row tiles were 2% slower than the default ones, hence the size rule.
FIXED_L2_RESIDENT = False
FIXED_RESIDENT_TILE = 32768
FIXED_RESIDENT_HINTS = "store"
FIXED_RESIDENT_FRACTION = 0.8  # of the L2's bytes: v and s together at most this
# Pair kernel: evict_first on the other state's loads only (in place: v_other is read once); 32-bit
# offsets when they fit.
PAIR_HINT_B = False
PAIR_NARROW = False
# Pair kernel: a reciprocal per row times each value instead of a division per value.
PAIR_RCP = True
# Pair kernel: no masks when there is no row mask and the tiles fit the shape exactly.
PAIR_EVEN = False
_INT32_MAX = 2**31 - 1


@lru_cache(maxsize=256)
def _states_config_cached(few: bool, num_heads: int, head_dim: int, max_states: int | None):
    block_d = _np2(head_dim)
    if few:
        hint = max(1, max_states if max_states is not None else 16)
        block_k = max(1, min(64, _np2(hint), 8192 // block_d))
        # One warp per 2048 values: the reductions over the states stay within a warp (shuffles, no
        # shared-memory barrier) for the common small tiles, and more programs fit on an SM.
        tile = block_k * block_d
        return block_k, 1, block_d, 1 if tile <= 2048 else 2 if tile <= 4096 else 4
    block_h = max(1, min(_np2(num_heads), 4096 // block_d))
    return 1, block_h, block_d, 4


def _states_config(num_rows: int, num_heads: int, head_dim: int, max_states: int | None):
    """(BLOCK_K, BLOCK_H, BLOCK_D, num_warps) for ``_merge_states_kernel``.

    Few (row, head) pairs, as in the split-KV reduction of a small batch: one head per program and up to
    64 states loaded at once, so neither the heads nor the states are walked serially. Many pairs
    (``merge_states`` over long sequences): 4096-value tiles of heads, one state per step (measured
    0.86-0.94 of copy bandwidth on H100 with this shape).
    """
    return _states_config_cached(num_rows * num_heads <= FEW_PAIRS, num_heads, head_dim, max_states)


def _max_offset(x: torch.Tensor) -> int:
    """The largest element offset ``x`` addresses (its storage extent in elements)."""
    return sum((n - 1) * abs(st) for n, st in zip(x.shape, x.stride()) if n > 0)


@lru_cache(maxsize=16)
def _num_sms(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count if torch.cuda.is_available() else 4


@lru_cache(maxsize=256)
def _fixed_config(num_heads: int, head_dim: int, num_states: int, elem_bytes: int, tile_values: int, per_thread: int):
    """(BLOCK_H, BLOCK_D, num_warps) of ``_merge_fixed_kernel``: ``tile_values`` values per program over
    all states, ``per_thread`` values of one state per thread (8 fp16 = one 16-byte load)."""
    block_d = _np2(head_dim)
    block_h = max(1, min(_np2(num_heads), tile_values // (_np2(num_states) * block_d)))
    num_warps = max(1, min(8, (block_h * block_d) // (32 * per_thread)))
    return block_h, block_d, num_warps


@lru_cache(maxsize=16)
def _l2_bytes(index: int) -> int:
    """The L2's size in bytes (50 MB as on an H100 when there is no CUDA device: the interpreter's tests)."""
    if torch.cuda.is_available():
        return int(getattr(torch.cuda.get_device_properties(index), "L2_cache_size", 0))
    return 50 << 20


def _launch_fixed(v, s, out_v, out_s) -> None:
    n, k, h, d = v.shape
    tile, hints = FIXED_TILE_VALUES, FIXED_STREAM_HINTS
    if FIXED_L2_RESIDENT:
        index = v.device.index if v.device.type == "cuda" and v.device.index is not None else 0
        if v.numel() * v.element_size() + s.numel() * 4 <= FIXED_RESIDENT_FRACTION * _l2_bytes(index):
            tile, hints = FIXED_RESIDENT_TILE, FIXED_RESIDENT_HINTS
    block_h, block_d, num_warps = _fixed_config(h, d, k, v.element_size(), tile, FIXED_VALUES_PER_THREAD)
    hblocks = _cdiv(h, block_h)
    tiles = n * hblocks
    # 32-bit offsets when every address formed fits, the masked tail of the last head block included.
    pad = block_h * max(v.stride(2), s.stride(2), out_v.stride(1), out_s.stride(1)) + block_d
    if v.is_contiguous() and s.is_contiguous():  # the common case: v is the largest of the four
        extent = v.numel()
    else:
        extent = max(_max_offset(v), _max_offset(s), _max_offset(out_v), _max_offset(out_s))
    narrow = FIXED_NARROW and extent + pad < _INT32_MAX
    programs = tiles
    if FIXED_PERSIST:
        index = v.device.index if v.device.type == "cuda" and v.device.index is not None else 0
        programs = min(tiles, FIXED_PERSIST * _num_sms(index))
    vs, ss, os_ = v.stride(), s.stride(), out_v.stride()
    _merge_fixed_kernel.run(
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
        _STREAM_CODES[hints],  # STREAM
        not narrow,  # WIDE
        FIXED_ROW_FAST,  # ROW_FAST
        programs < tiles,  # PERSIST
        FIXED_STAGES,  # STAGES
        FIXED_EVEN and h % block_h == 0 and d == block_d,  # EVEN
        grid=(programs,),
        warmup=False,
        num_warps=num_warps,
    )


def _launch_states(
    v, s, indptr, out_v, out_s, num_rows, num_states, strides_v, strides_s, varlen, min_states, max_states
):
    if num_rows == 0:
        return
    num_heads, head_dim = out_v.shape[-2], out_v.shape[-1]
    block_k, block_h, block_d, num_warps = _states_config(num_rows, num_heads, head_dim, max_states)
    grid = (num_rows, _cdiv(num_heads, block_h))
    ost = out_v.stride()
    _merge_states_kernel[grid](
        v,
        s,
        indptr if indptr is not None else s,
        out_v,
        out_s if out_s is not None else s,
        num_states,
        num_heads,
        *strides_v,
        *strides_s,
        ost[0],
        ost[1],
        out_s.stride(0) if out_s is not None else 0,
        out_s.stride(1) if out_s is not None else 0,
        HEAD_DIM=head_dim,
        BLOCK_K=block_k,
        BLOCK_H=block_h,
        BLOCK_D=block_d,
        VARLEN=varlen,
        MIN_STATES=min_states,
        HAS_S_OUT=out_s is not None,
        STREAM=STREAM_HINTS,
        num_warps=num_warps,
    )


def merge_partial_states(
    part_v, part_s, indptr, out_v, out_s=None, *, min_states: int = 1, max_states: int | None = None
) -> None:
    """Reduce ragged groups of partial states into rows (see the module docstring)."""
    num_rows = indptr.shape[0] - 1
    if not use_triton(part_v.device):
        ptr = indptr.tolist()
        for r in range(num_rows):
            lo, hi = ptr[r], ptr[r + 1]
            if hi - lo < min_states:
                continue
            v_m, s_m = reference.merge_states(part_v[lo:hi].unsqueeze(0), part_s[lo:hi].unsqueeze(0))
            out_v[r].copy_(v_m[0].to(out_v.dtype))
            if out_s is not None:
                out_s[r].copy_(s_m[0])
        return
    pv, ps = part_v.stride(), part_s.stride()
    _launch_states(
        part_v,
        part_s,
        indptr,
        out_v,
        out_s,
        num_rows,
        0,
        (0, pv[0], pv[1]),
        (0, ps[0], ps[1]),
        True,
        min_states,
        max_states,
    )


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``v [N, K, H, D]``, ``s [N, K, H]`` -> ``v [N, H, D]`` (dtype of v), ``s [N, H]`` float32."""
    n, k, h, d = v.shape
    out_v = torch.empty((n, h, d), dtype=v.dtype, device=v.device)
    out_s = torch.empty((n, h), dtype=torch.float32, device=v.device)
    if not use_triton(v.device):
        if k == 0:
            out_v.zero_()
            out_s.fill_(float("-inf"))
            return out_v, out_s
        v_m, s_m = reference.merge_states(v, s)
        out_v.copy_(v_m)
        out_s.copy_(s_m)
        return out_v, out_s
    if k == 1:
        # One state is returned as it is (the reference's rule, also for an empty state's v).
        out_v.copy_(v[:, 0])
        out_s.copy_(s[:, 0])
        return out_v, out_s
    if v.stride(-1) != 1:
        v = v.contiguous()
    if s.dtype != torch.float32:
        s = s.float()
    if n == 0 or h == 0:
        return out_v, out_s
    if STATES_KERNEL == "fixed" and 2 <= k <= FIXED_MAX_K:
        _launch_fixed(v, s, out_v, out_s)
        return out_v, out_s
    vs, ss = v.stride(), s.stride()
    _launch_states(v, s, None, out_v, out_s, n, k, vs[:3], ss, False, 0, k)
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
    """float32 contiguous lse (``x`` itself in the common case)."""
    if x.dtype == torch.float32 and x.is_contiguous():
        return x
    return x.reshape(-1).float().contiguous()


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
    wide = True
    if PAIR_NARROW:
        # Every row offset times its stride, padded by one tile (the masked tail still forms addresses).
        rows = _cdiv(num_rows, block_r) * block_r
        wide = rows * max(stride_va, stride_vb, stride_vo, block_d) + block_d >= _INT32_MAX
    _merge_pair_kernel.run(
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
        PAIR_STREAM_HINTS,  # STREAM
        PAIR_HINT_B,  # HINT_B
        wide,  # WIDE
        PAIR_RCP,  # RCP
        PAIR_EVEN and mask is None and num_rows % block_r == 0 and d == block_d,  # EVEN
        grid=(_cdiv(num_rows, block_r),),
        warmup=False,
        num_warps=num_warps,
    )


def merge_state(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two states; returns ``(v, s)`` with ``v`` in ``v_a``'s dtype and ``s`` float32."""
    d = v_a.shape[-1]
    out_v = torch.empty(v_a.shape, dtype=v_a.dtype, device=v_a.device)
    out_s = torch.empty(s_a.shape, dtype=torch.float32, device=s_a.device)
    if not use_triton(v_a.device):
        v_m, s_m = reference.merge_state(v_a, s_a, v_b, s_b)
        out_v.copy_(v_m)
        out_s.copy_(s_m)
        return out_v, out_s
    va, sva = _rows(v_a, d)
    vb, svb = _rows(v_b, d)
    _launch_pair(va, sva, _lse(s_a), vb, svb, _lse(s_b), out_v, d, out_s, out_s.numel(), d, None, 1)
    return out_v, out_s


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` where ``mask`` (bool over dim 0) is True."""
    if not use_triton(v.device):
        reference.merge_state_in_place(v, s, v_other, s_other, mask)
        return
    d = v.shape[-1]
    # Work straight in v and s when they are contiguous (the common case: no view, no copy); else in
    # copies written back afterwards.
    v_direct = v.is_contiguous()
    v_rows = v if v_direct else v.reshape(-1, d).clone()
    s_direct = s.dtype == torch.float32 and s.is_contiguous()
    s_rows = s if s_direct else s.reshape(-1).float().clone()
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
