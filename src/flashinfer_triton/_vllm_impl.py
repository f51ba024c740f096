"""Host side of vLLM's paged attention on ``kernels/vllm_decode.py`` (arguments already checked by ``vllm.py``).

Tuning lives in one frozen ``_config.VllmDecodeConfig``, chosen by :func:`default_config` from the shapes and dtypes;
callers (tests, benchmarks) may pass their own to :func:`run`.

Grid: ``(num_seqs * parts, num_kv_heads)``. v2: ``parts = ceil(max_seq_len / 512)``, every partition program writes
vLLM's partition state and the last one of each (sequence, KV head) reduces them into ``out`` in the same launch
(arrival counters from a per-device workspace, left at zero by every launch, so CUDA graphs replay it). v1: one
program per (sequence, KV head), except when ``num_seqs * Hkv`` programs leave the GPU mostly idle and the
sequences are long: then each sequence is cut into chunks (``_v1_chunk``), whose float32 partial states go to the
same workspace and are merged by the last chunk to finish (only ``out`` is written, as vLLM's v1).

What the shapes and dtypes fix (the config, the launch's constexprs) is computed once per such signature, and the
workspace views once per size: a decode step's host time is mostly the launch itself.
"""

from __future__ import annotations

import math

import torch
import triton.language as tl

from . import _backend
from ._config import VllmDecodeConfig
from ._config import cdiv as _cdiv
from ._config import next_pow2 as _np2
from ._config import num_sms as _num_sms
from ._errors import error_flag
from ._launch import FastKernel, stand_in_pointer
from .kernels.vllm_decode import _vllm_decode_kernel as _vllm_decode_jit

_kernel = FastKernel(_vllm_decode_jit)

# The launch passes every argument positionally (Triton binds keyword arguments by name at a cost of ~3 us of host
# time per launch), so it depends on this parameter order.
_PARAMS = (  # noqa: SIM905 (one string: readable beside the kernel signature)
    "q_ptr k_ptr v_ptr o_ptr tmp_ptr part_lse_ptr es_ptr ml_ptr bt_ptr seq_lens_ptr alibi_ptr k_scale_ptr v_scale_ptr "
    "counter_ptr err_ptr stride_qb stride_qh stride_kp stride_kh stride_vp stride_vh stride_ob stride_oh stride_bt "
    "stride_tb stride_th stride_tp stride_eb stride_eh num_blocks max_blocks num_parts v1_chunk qk_scale v_scale "
    "NUM_QO_HEADS GROUP GROUP_P2 BLOCK_M HEAD_DIM BLOCK_D BLOCK_N PAGE_SIZE KX PART_SIZE SPLIT ALIBI SCALE_PTRS "
    "MERGE_BLOCK_K COMPUTE_DTYPE DOT_PRECISION INTERPRET"
).split()
if tuple(_kernel.arg_names) != tuple(_PARAMS):
    raise RuntimeError("_vllm_decode_kernel's parameters changed: update the positional launch in _vllm_impl")

PARTITION_SIZE = 512
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def default_config(head_dim: int, q_dtype: torch.dtype) -> VllmDecodeConfig:
    """The measured choice (H100, graph replays, the same data as our CSR decode): 64-key tiles and 4 warps up to
    D = 128 (32 and 8 above), 3 stages; a 128-register cap up to D = 128 keeps v2 at 4 programs per SM (144 registers
    uncapped; v1 compiles to 128 anyway). float32 queries (vLLM's tests): 32-key tiles (16 above D = 128), 2 stages
    (float32 K/V tiles are twice as large in shared memory), no cap."""
    block_d = _np2(head_dim)
    if q_dtype == torch.float32:
        return VllmDecodeConfig(block_n=32 if block_d <= 128 else 16, num_warps=4 if block_d <= 128 else 8,
                                num_stages=2, maxnreg=None)  # fmt: skip
    return VllmDecodeConfig(
        block_n=64 if block_d <= 128 else 32,
        num_warps=4 if block_d <= 128 else 8,
        num_stages=3,
        maxnreg=128 if head_dim <= 128 else None,
    )


def _v1_chunk(num_seqs: int, num_kv_heads: int, max_seq_len: int, block_n: int, sms: int,
              cfg: VllmDecodeConfig | None = None) -> int:  # fmt: skip
    """Keys per chunk for v1's split, or 0 for none (``cfg``'s split rule; default: ``VllmDecodeConfig()``)."""
    cfg = cfg or VllmDecodeConfig()
    if num_seqs * num_kv_heads >= cfg.split_min_waves * sms:
        return 0
    chunk = max(cfg.min_chunk, math.ceil(num_seqs * max_seq_len * num_kv_heads / (cfg.split_target_waves * sms)))
    chunk = _cdiv(chunk, block_n) * block_n
    return chunk if chunk < max_seq_len else 0


_WS: dict = {}
_WS_OLD: list = []  # replaced workspaces stay alive: a captured CUDA graph may still point at them
_VIEWS: dict = {}  # (device, rows, heads, D, counters) -> (workspace, its views)
_STATIC: dict = {}  # run()'s settings fixed by shapes, dtypes and the config (see _static)


def split_workspace(device: torch.device) -> tuple | None:
    """The workspace the split launches on ``device`` use now (float32 partial states, int32 counters), None before
    the first: it only grows, and a grown one replaces it for later calls."""
    return _WS.get(device)


def _workspace(device, rows: int, num_heads: int, head_dim: int, n_counters: int):
    """(partial o float32 [rows, H, D], partial lse float32 [rows, H], counters int32 [n_counters], zero) from a
    per-device cache that only grows; the counters are left at zero by every launch."""
    need_f = rows * num_heads * (head_dim + 1)
    ws = _WS.get(device)
    if ws is None or ws[0].numel() < need_f or ws[1].numel() < n_counters:
        if ws is not None:
            _WS_OLD.append(ws)
        # each part grows to the next power of two, and only when it is too small: a batch that ramps up step
        # by step keeps a few buffers alive (at most twice the largest), not one per step
        fbuf = ws[0] if ws is not None and ws[0].numel() >= need_f else None
        counters = ws[1] if ws is not None and ws[1].numel() >= n_counters else None
        ws = _WS[device] = (
            fbuf if fbuf is not None else torch.empty(_np2(need_f), dtype=torch.float32, device=device),
            counters if counters is not None else torch.zeros(_np2(n_counters), dtype=torch.int32, device=device),
        )
    key = (device, rows, num_heads, head_dim, n_counters)
    hit = _VIEWS.get(key)
    if hit is not None and hit[0] is ws:
        return hit[1]
    fbuf, counters = ws
    part_o = fbuf[: rows * num_heads * head_dim].view(rows, num_heads, head_dim)
    part_lse = fbuf[rows * num_heads * head_dim : need_f].view(rows, num_heads)
    if len(_VIEWS) >= 256:
        _VIEWS.clear()
    _VIEWS[key] = (ws, (part_o, part_lse, counters[:n_counters]))
    return _VIEWS[key][1]


def _static(cfg: VllmDecodeConfig, num_heads, num_kv_heads, head_dim, block_size, kx, q_dtype, alibi, scale_ptrs,
            partitioned):  # fmt: skip
    """(BLOCK_N, the constexprs NUM_QO_HEADS .. KX, PART_SIZE, the constexprs ALIBI .. INTERPRET less
    MERGE_BLOCK_K)."""
    group = num_heads // num_kv_heads
    block_d = max(16, _np2(head_dim))
    # Full tiles load whole blocks: BLOCK_N a multiple of the block size (both powers of two).
    block_n = max(_np2(cfg.block_n), block_size)
    head = (num_heads, group, _np2(group), max(16, _np2(group)), head_dim, block_d, block_n, block_size, kx)
    fp32 = q_dtype == torch.float32 or _backend._INTERPRET
    tail = (
        tl.float32 if _backend._INTERPRET else _TL_DTYPE[q_dtype],  # COMPUTE_DTYPE
        "ieee" if fp32 else "tf32",  # DOT_PRECISION (16-bit operands: unused)
        _backend._INTERPRET,
    )
    return block_n, head, PARTITION_SIZE if partitioned else 0, (alibi, scale_ptrs), tail


def run(
    q: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    out: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    *,
    num_kv_heads: int,
    scale: float,
    alibi_slopes: torch.Tensor | None,
    k_scale,
    v_scale,
    partitioned: bool,
    max_seq_len: int,
    max_num_partitions: int = 1,
    exp_sums: torch.Tensor | None = None,
    max_logits: torch.Tensor | None = None,
    tmp_out: torch.Tensor | None = None,
    strides: tuple | None = None,
    config: VllmDecodeConfig | None = None,
) -> None:
    """vLLM's paged attention on checked arguments: ``key_cache [blocks, Hkv, D/X, block_size, X]``, ``value_cache
    [blocks, Hkv, D, block_size]`` (fp8 caches already viewed as float8); ``k_scale`` / ``v_scale`` floats or
    one-element device tensors (read on the device); ``strides``: (key block, key head, value block, value head)
    strides to use instead of the caches' own (the caller's choice for dimensions of size 1)."""
    num_seqs, num_heads, head_dim = q.shape
    if num_seqs == 0:
        return
    device = q.device
    scale_ptrs = isinstance(k_scale, torch.Tensor) or isinstance(v_scale, torch.Tensor)
    alibi = alibi_slopes is not None
    kx = int(key_cache.shape[-1])
    block_size = int(value_cache.shape[-1])
    skey = (num_heads, num_kv_heads, head_dim, block_size, kx, q.dtype, alibi, scale_ptrs, partitioned, config)
    st = _STATIC.get(skey)
    if st is None:
        if len(_STATIC) >= 256:
            _STATIC.clear()
        cfg = config if config is not None else default_config(head_dim, q.dtype)
        st = _STATIC[skey] = (cfg, *_static(cfg, num_heads, num_kv_heads, head_dim, block_size, kx, q.dtype, alibi,
                                           scale_ptrs, partitioned))  # fmt: skip
    cfg, block_n, head, part_size, flags, tail = st
    dummy = stand_in_pointer(device)
    k_scale_t = v_scale_t = dummy
    ks = vs = 1.0
    if scale_ptrs:
        k_scale_t = k_scale.reshape(1) if isinstance(k_scale, torch.Tensor) else torch.full(
            (1,), float(k_scale), dtype=torch.float32, device=device)  # fmt: skip
        v_scale_t = v_scale.reshape(1) if isinstance(v_scale, torch.Tensor) else torch.full(
            (1,), float(v_scale), dtype=torch.float32, device=device)  # fmt: skip
    else:
        ks, vs = float(k_scale), float(v_scale)
    n_counters = num_seqs * num_kv_heads
    part_lse = dummy
    v1_chunk = 0
    if partitioned:
        parts = max_num_partitions
        tmp = tmp_out
        _, _, counters = _workspace(device, 0, num_heads, head_dim, n_counters)
        ts, es = tmp_out.stride(), exp_sums.stride()
    else:
        parts = 1
        tmp = dummy
        counters = dummy
        ts = es = (0, 0, 0)
        if cfg.split_v1 and max_seq_len:
            v1_chunk = _v1_chunk(num_seqs, num_kv_heads, int(max_seq_len), block_n, _num_sms(device), cfg)
            if v1_chunk:
                parts = _cdiv(int(max_seq_len), v1_chunk)
                tmp, part_lse, counters = _workspace(device, num_seqs * parts, num_heads, head_dim, n_counters)
    group_p2 = head[2]
    merge_k = max(1, min(_np2(parts), cfg.merge_max_k, cfg.merge_tile // (group_p2 * head[5])))
    qs, os_ = q.stride(), out.stride()
    if strides is None:
        strides = (key_cache.stride(0), key_cache.stride(1), value_cache.stride(0), value_cache.stride(1))
    args = [
        q, key_cache, value_cache, out, tmp, part_lse,
        exp_sums if partitioned else dummy, max_logits if partitioned else dummy,
        block_tables, seq_lens, alibi_slopes if alibi else dummy, k_scale_t, v_scale_t, counters, error_flag(device),
        qs[0], qs[1], *strides, os_[0], os_[1], block_tables.stride(0), ts[0], ts[1], ts[2], es[0], es[1],
        int(key_cache.shape[0]), int(block_tables.shape[1]), parts, v1_chunk, float(scale) * ks, vs,
        *head, part_size, v1_chunk > 0, *flags, merge_k, *tail,
    ]  # fmt: skip
    grid = (num_seqs * parts, num_kv_heads)
    if cfg.maxnreg:
        _kernel.run(*args, grid=grid, warmup=False, maxnreg=cfg.maxnreg, num_warps=cfg.num_warps,
                    num_stages=cfg.num_stages)  # fmt: skip
    else:
        _kernel.run(*args, grid=grid, warmup=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
