"""Triton implementation of the general attention path (prefill, append, ragged, paged, cascade levels).

The seam is ``_backend``'s: ``supports(opts)``, ``plan(opts, batch, ws)`` on the host, ``run(...)`` on
the device with no host synchronization. Any ``qo_len`` per request is accepted, so this is also the
fallback for decode variants the decode kernel does not cover.

``plan()`` cuts every request's queries into tiles of ``TILE_T = BLOCK_M // group`` tokens (the query
heads of one KV head are packed into a tile's rows), clips each tile's KV range to the keys its rows can
see (causal diagonal, sliding window), splits long ranges when the tiles alone cannot fill the GPU, and
orders the work longest first. The work list goes to the device once; ``run()`` launches one program per
(work item, KV head), then, if a range was split, one merge program per split query row.

CUDA-graph mode (``ws.cuda_graph``): the grid is fixed by the capacity (``ws.max_total_q``,
``ws.max_batch_size``), the work list lives in ``ws.int_buffer`` and its live length is read on the
device (programs past it exit), and KV ranges are never split, so a graph captured after one ``plan()``
replays correctly after another.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import ClassVar

import numpy as np
import torch

from . import _backend, _config, _sm90, _work_row
from ._backend import AttentionBatch, AttentionOptions, Workspace
from ._config import GluonPrefillConfig, PrefillConfig
from ._config import capability as _capability
from ._config import cdiv as _cdiv
from ._config import next_pow2 as _next_pow2
from ._config import num_sms as _num_sms
from ._launch import bind as _bind

LOG2E = 1.4426950408889634
# The work list's row (``_work_row``): the item's fields, then its request's first query row, queries, keys and
# first K/V row (or page-table entry).
_WORK_FIELDS, _REQ_AT = _work_row.WORK_FIELDS, _work_row.REQ_AT
_MERGE_FIELDS = 3  # output row, first partial row, number of partials
_UNSPLIT_TAIL = np.array([-1, 1, 0, 0], dtype=np.int32)  # an unsplit item's fields 4-7: no partial row, 1 split

_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_KV_DTYPES = _Q_DTYPES + tuple(
    d for d in (getattr(torch, "float8_e4m3fn", None), getattr(torch, "float8_e5m2", None)) if d is not None
)


@dataclass
class PrefillPlan:
    """What ``run()`` needs: device work arrays, launch grid, partial buffers."""

    config: PrefillConfig
    tile_t: int
    grid0: int
    # int32 [grid0, _WORK_FIELDS]: every row up to the grid exists (CUDA-graph plans: zeros past num_work), so a
    # program loads its row without waiting for num_work
    work: torch.Tensor
    num_work: torch.Tensor  # int32 [1]
    num_work_host: int
    merge: torch.Tensor | None  # int32 [num_merge, 3]
    num_merge: torch.Tensor | None
    num_merge_host: int
    part_o: torch.Tensor | None  # [rows, Hq, D] in PARTIAL_DTYPE(o_dtype): the output dtype, or float32
    part_lse: torch.Tensor | None  # float32 [rows, Hq]
    kv_rows: int | None = None  # ragged, eager: kv_indptr[-1], the rows a tensor descriptor may read
    blocks: torch.Tensor | None = None  # custom mask: int32 runs of KV tiles with set bits (2 ints per run)
    num_blocks_host: int = 0  # KV tiles the runs cover (visited by all work items together)
    # Matrix work of the launch (2 x 2 x rows x keys x D over the work items and KV heads; a custom mask's
    # skipped tiles not counted): decides whether tensor descriptors pay for their host time (see run()).
    work_flops: float = float("inf")
    # CUDA-graph plan: a launch captured now replays after later plans, so nothing of this batch's extent may be
    # baked into launch arguments (tensor descriptors cover the caller's whole K/V buffers, see run()).
    graph: bool = False
    # Persistent Gluon launch (``_persist_lists``): programs, the offsets of each program's units in the unit list
    # (int32 [programs + 1]) and the unit list (int32: KV head << 23 | work item), views of the work list's array
    # (rewritten in place by a re-plan of the same layout, as the work list is); 0 / None: one program per (work
    # item, KV head).
    persist_nprog: int = 0
    persist_cta: torch.Tensor | None = None
    persist_units: torch.Tensor | None = None
    # Fields a bound launch does not depend on (``_wrapper._same_state``): run() reads work_flops only to choose
    # tensor descriptors for K/V, and a launch with those is never bound.
    BINDING_IGNORES: ClassVar[tuple] = ("work_flops",)


def supports(opts: AttentionOptions) -> bool:
    """Every variant of the spec: head dims multiple of 16 up to 512, any group up to 128, fp8 KV."""
    if opts.head_dim % 16 != 0 or not 16 <= opts.head_dim <= 512:
        return False
    if opts.num_kv_heads <= 0 or opts.num_qo_heads % opts.num_kv_heads != 0 or opts.group_size > 128:
        return False
    if opts.pos_encoding_mode not in ("NONE", "ROPE_LLAMA", "ALIBI"):
        return False
    return opts.q_dtype in _Q_DTYPES and opts.kv_dtype in _KV_DTYPES and opts.o_dtype in _Q_DTYPES


_TILE_CONFIGS: dict = {}


def _tile_config(block_m: int, block_n: int, num_warps: int, num_stages: int, gpu: bool = True) -> PrefillConfig:
    """The ``PrefillConfig`` of a tile shape with the other fields at their defaults, made once per shape and shared
    by every plan (it is frozen): building a frozen dataclass costs microseconds of host time per plan().
    ``gpu=False`` (the interpreter's tiles): no minimum work for a KV split (there is no launch cost to weigh, and
    tests see splits at small sizes)."""
    key = (block_m, block_n, num_warps, num_stages, gpu)
    got = _TILE_CONFIGS.get(key)
    if got is None:
        got = PrefillConfig(block_m, block_n, num_warps, num_stages)
        if not gpu:
            got = replace(got, split_min_tile_flops=0.0, split_min_tile_bytes=0.0)
        _TILE_CONFIGS[key] = got
    return got


# (opts, device, (max_rows, total_rows, SMs), config) of the last choose_config question
_CONFIG_LAST: list = [(None, None, None, None)]


def choose_config(
    opts: AttentionOptions, max_rows: int, device: torch.device, total_rows: int | None = None
) -> PrefillConfig:
    """Tile shape from the variant and the largest query tile (rows = tokens x group) of the batch.

    A heuristic table, not an autotuner (the interpreter cannot autotune). The H100 entries come from
    the sweep in ``benchmarks/bench_prefill.py --sweep`` (see docs/prefill.md). The last answer is kept for its
    (immutable) options, device, row counts and SM count: an engine's successive plans mostly ask the same.
    """
    sms = _num_sms(device) if device.type == "cuda" else 0
    last = _CONFIG_LAST[0]  # (one tuple, replaced whole: threads never see a mixed entry)
    if last[0] is opts and last[2] == (max_rows, total_rows, sms) and (last[1] is device or last[1] == device):
        return last[3]
    cfg = _choose_config(opts, max_rows, device, total_rows)
    _CONFIG_LAST[0] = (opts, device, (max_rows, total_rows, sms), cfg)
    return cfg


def _choose_config(
    opts: AttentionOptions, max_rows: int, device: torch.device, total_rows: int | None
) -> PrefillConfig:
    group = opts.group_size
    d = opts.head_dim
    if device.type != "cuda":
        # Interpreter: small tiles so tests cover several tiles and the masked/unmasked split cheaply.
        bm = max(16, min(32, _next_pow2(max(max_rows, group))))
        return _tile_config(max(bm, _next_pow2(group)), 16, 4, 1, gpu=False)
    masked_diag = opts.causal or opts.window_left >= 0
    sms = _num_sms(device)
    if opts.pos_encoding_mode == "ROPE_LLAMA" and d <= 256:
        # RoPE of every K tile in registers: a 128-row tile spills. (Above 256 the 512-wide tiles below: 64x64
        # would need 384 KB of shared memory there, the rotated copy of each K tile included.)
        cfg = _tile_config(64, 64, 8, 2)
    elif d <= 64:
        # H100, 4096 32/32 causal: 64x64 w4 s3 0.209 ms vs 128x64 w8 s3 0.229 ms.
        cfg = _tile_config(64, 64, 4, 3) if masked_diag else _tile_config(128, 64, 8, 3)
    elif d <= 128:
        if opts.paged:
            cfg = _tile_config(128, 64, 8, 3)
        elif opts.has_custom_mask:
            # H100, block-diagonal 512 mask, 4096 32/8: 128x64 w8 s3 0.265 ms vs 64x64 w4 s3 0.361 ms.
            cfg = _tile_config(128, 64, 8, 3)
        elif masked_diag:
            # Causal: 64-row tiles waste less on the diagonal and balance the triangle better (H100 sweep),
            # except when a 128-row tile spans few tokens (GQA group >= 4) and there are enough of them:
            # 8192 32/8: 128x128 w8 s3 1.160 ms vs 64x64 1.225; 16384 32/8: 4.490 vs 4.897; but append
            # 512 over 8192 (128 tiles of 128 rows): 0.171 vs 0.150.
            big = group >= 4 and -(-max_rows // 128) * opts.num_kv_heads >= 4 * sms
            cfg = _tile_config(128, 128, 8, 3) if big else _tile_config(64, 64, 4, 3)
        elif -(-max(max_rows, total_rows or 0) // 128) * opts.num_kv_heads < sms:
            # Too few 128-row tiles to fill the GPU (the KV range gets split). With the one-pass split merge
            # (H100, graph replays, same process): 64 queries x 16384 keys 32/8 (256 rows) 128x128 w8 s3 50.1 /
            # 50.2 us vs 64x64 w4 s3 51.3 / 51.4; 128 queries 82.8 / 83.5 vs 83.5 / 83.5; fewer rows than two
            # full 128-row tiles keep 64x64 (16 queries, 64 rows: a forced 128x128 took 69.8 vs 65.4 us).
            big = max(max_rows, total_rows or 0) >= 256
            cfg = _tile_config(128, 128, 8, 3) if big else _tile_config(64, 64, 4, 3)
        else:
            cfg = _tile_config(128, 128, 8, 3)
    elif d <= 256:
        cfg = _tile_config(64, 32, 4, 3)
    else:
        # Head dims 272-512 (a 512-wide tile): the fp32 accumulator of a 64-row tile alone would take 256 registers
        # per thread at 4 warps; 32 rows over 8 warps hold it in 64, and two stages of 32-key K and V tiles
        # (128 KB at 16 bits) leave room for the query tile in the 227 KB of shared memory.
        cfg = _tile_config(32, 32, 8, 2)
    # Decode-like batches (few rows per request): a smaller tile wastes less of the MMA.
    bm = max(16, min(cfg.block_m, _next_pow2(max(max_rows, 1))))
    bm = max(bm, _next_pow2(group))
    if bm != cfg.block_m:
        if d > 256 and bm > 32:
            # A GQA group over 32 at a 512-wide tile: the query tile grows, so the K/V ring shrinks to stay in
            # shared memory (64 rows: 64 KB + 2 x 2 x 16 keys; 128 rows: 128 KB + 1 x 2 x 16 keys).
            cfg = _tile_config(bm, 16, 8, 2 if bm <= 64 else 1)
        else:
            cfg = _tile_config(bm, min(cfg.block_n, 64), 4 if bm <= 64 else cfg.num_warps, cfg.num_stages)
    return cfg


_CANDIDATE_LAST: list = [(None, None, None, False)]  # (opts, device, gcfg, answer) of the last question


def split_pays(cfg: PrefillConfig, opts: AttentionOptions, rows: int, keys: int) -> bool:
    """Whether an eager plan whose longest query tile (``rows`` rows: tokens x group) sees ``keys`` keys may split
    its KV: the unsplit grid runs about as long as that tile (one wave), and below both of the config's minimums
    (its matrix work, its K/V bytes) that is shorter than the host time of the merge launch a split adds
    (``PrefillConfig.split_min_tile_flops``)."""
    d = opts.head_dim
    return (
        4 * rows * keys * d >= cfg.split_min_tile_flops
        or 2 * keys * d * opts.kv_dtype.itemsize >= cfg.split_min_tile_bytes
    )


def _gluon_candidate(opts: AttentionOptions, device: torch.device, gcfg: GluonPrefillConfig) -> bool:
    """Variants the Gluon kernel covers, on an sm_90 GPU with Gluon importable: ragged (or single) K/V or pages of
    8 to 64 keys, fp16 / bf16 throughout, the configuration's head dims (of 64, 128, 256) and groups (of 1-16; at
    D64 from ``d64_min_group``), causal or no mask, a sliding window or none, a logits soft cap or none, no other
    score transform. The last answer is kept for its
    (immutable) options, device and configuration objects: an engine's plans ask with the same ones."""
    last = _CANDIDATE_LAST[0]  # (one tuple, replaced whole: threads never see a mixed entry)
    if last[0] is opts and last[2] is gcfg and (last[1] is device or last[1] == device):  # (a batch's device: new)
        return last[3]
    ok = _gluon_variant(opts, device, gcfg)
    _CANDIDATE_LAST[0] = (opts, device, gcfg, ok)
    return ok


def _gluon_variant(opts: AttentionOptions, device: torch.device, gcfg: GluonPrefillConfig) -> bool:
    if not gcfg.enabled or _backend._INTERPRET or device.type != "cuda":
        return False
    if opts.has_custom_mask or opts.pos_encoding_mode != "NONE":
        return False
    if opts.paged and opts.page_size not in gcfg.page_sizes:
        return False
    if opts.q_dtype not in (torch.float16, torch.bfloat16) or opts.kv_dtype != opts.q_dtype:
        return False
    g = opts.group_size
    if opts.head_dim not in gcfg.head_dims or g not in gcfg.groups or g > 16:
        return False
    if opts.head_dim <= 64 and g < gcfg.d64_min_group:
        return False
    return _sm90.gluon_device_ok(device)


def _pdl_ok(device: torch.device) -> bool:
    """Programmatic dependent launch: compiled kernels on sm_90 or newer (never the interpreter)."""
    return not _backend._INTERPRET and _capability(device)[0] >= 9


def partial_dtype(o_dtype: torch.dtype) -> torch.dtype:
    """Split-KV partial values (normalized: |o| <= max |v|) are stored in the output dtype when it is fp16 / bf16
    (as FlashInfer's tmp_v), halving the bytes written by the attention launch and read by the merge; lse stays
    float32 and the merge accumulates in float32."""
    if o_dtype in (torch.float16, torch.bfloat16):
        return o_dtype
    return torch.float32


_PPSM_LAST: list = [(None, None, 0)]  # (config, opts, answer) of the last _programs_per_sm


def _programs_per_sm(cfg: PrefillConfig, opts: AttentionOptions) -> int:
    """How many programs of this config one SM holds at once (1-4), from shared memory (Q tile plus
    ``num_stages`` K and V tiles) and registers (assumed 255 per thread, the worst case). The last answer is kept
    for its (immutable) config and options objects."""
    last = _PPSM_LAST[0]
    if last[0] is cfg and last[1] is opts:
        return last[2]
    got = _PPSM_LAST[0] = (cfg, opts, _programs_per_sm_of(cfg, opts))
    return got[2]


def _programs_per_sm_of(cfg: PrefillConfig, opts: AttentionOptions) -> int:
    q_bytes = opts.q_dtype.itemsize
    kv_bytes = opts.kv_dtype.itemsize
    smem = cfg.block_m * opts.head_dim * q_bytes + cfg.num_stages * 2 * cfg.block_n * opts.head_dim * kv_bytes
    by_smem = (228 * 1024) // max(smem, 1)
    by_regs = 65536 // (cfg.num_warps * 32 * 255)
    return max(1, min(4, by_smem, by_regs))


_GRAPH_CAPACITY: dict = {}


# Reductions called as ufuncs: ``a.max()`` / ``a.sum()`` go through numpy's Python wrappers, which cost about as much
# host time as the reduction on a batch's small arrays.
_MAX, _MIN, _SUM = np.maximum.reduce, np.minimum.reduce, np.add.reduce


def _i64(x: torch.Tensor) -> np.ndarray:
    """An int64 numpy view (a copy when of another dtype) of a host index tensor."""
    return x.numpy() if x.dtype == torch.int64 else x.to(torch.int64).numpy()


def _request_fields(qo_indptr: np.ndarray, kv_lens: np.ndarray, kv_indptr: np.ndarray) -> np.ndarray:
    """int64 [batch, 4]: each request's fields of a work row (``_work_row``, from ``_REQ_AT``): first query row,
    queries, keys, kv_indptr entry; a work list's rows gather theirs with one index by request."""
    t = np.empty((len(kv_lens), 4), dtype=np.int64)
    t[:, 0] = qo_indptr[:-1]
    np.subtract(qo_indptr[1:], qo_indptr[:-1], out=t[:, 1])
    t[:, 2] = kv_lens
    t[:, 3] = kv_indptr[:-1]
    return t


_UNSPLIT_HEADS: dict = {}  # batch size -> int32 [batch, _WORK_FIELDS]: the request and _UNSPLIT_TAIL, zeros elsewhere


def _unsplit_rows(qo_indptr: np.ndarray, kv_lens: np.ndarray, kv_indptr: np.ndarray) -> np.ndarray:
    """int32 [batch, _WORK_FIELDS]: each request's unsplit work row but its tile's columns (first token, ks, ke:
    zero here): the request, ``_UNSPLIT_TAIL`` and the request's fields (``_request_fields``). The first two are a
    copy of the batch size's kept head (made once per batch size, never written)."""
    n = len(kv_lens)
    head = _UNSPLIT_HEADS.get(n)
    if head is None:
        head = np.zeros((n, _WORK_FIELDS), dtype=np.int32)
        head[:, 0] = np.arange(n, dtype=np.int32)
        head[:, 4:_REQ_AT] = _UNSPLIT_TAIL
        if len(_UNSPLIT_HEADS) < 256:
            _UNSPLIT_HEADS[n] = head
    t = head.copy()
    t[:, _REQ_AT] = qo_indptr[:-1]
    np.subtract(qo_indptr[1:], qo_indptr[:-1], out=t[:, _REQ_AT + 1], casting="unsafe")
    t[:, _REQ_AT + 2] = kv_lens
    t[:, _REQ_AT + 3] = kv_indptr[:-1]
    return t


def _tiles(opts: AttentionOptions, qo_lens: np.ndarray, kv_lens: np.ndarray, tile_t: int, block_n: int):
    """Per query tile: request, first token, visible KV range [ks, ke) (ks a multiple of block_n, so KV
    tiles are aligned to the page grid; the window edge is masked in the kernel's head loop), tokens."""
    if len(qo_lens) == 1:
        # One request (an engine's usual eager prefill): its lengths as ints, half the array operations.
        qo, kv = int(qo_lens[0]), int(kv_lens[0])
        n = -(-qo // tile_t)
        req = np.zeros(n, dtype=np.int64)
        t0 = np.arange(0, n * tile_t, tile_t, dtype=np.int64)
    else:
        n_tiles = -(-qo_lens // tile_t)
        # (array methods: numpy's function forms add a Python wrapper's host time per call)
        req = np.arange(len(qo_lens), dtype=np.int64).repeat(n_tiles)
        first = n_tiles.cumsum() - n_tiles
        t0 = (np.arange(int(_SUM(n_tiles)), dtype=np.int64) - first[req]) * tile_t
        qo = qo_lens[req]
        if opts.causal and not opts.has_custom_mask and opts.window_left < 0:
            delta_r = kv_lens - qo_lens
            if len(delta_r) and _MIN(delta_r) >= 0:
                # Every request has at least its queries' keys (an engine's prefill): a tile's range ends at its
                # last token + delta, min(t0 + tile_t, qo) + delta = t0 + n_tok + delta, never negative and never
                # past kv, so the clamps drop out (the same values: one gather of delta instead of two of the
                # lengths, no clamps).
                n_tok = np.minimum(qo - t0, tile_t)
                ke = t0 + n_tok
                ke += delta_r[req]
                return req, t0, np.zeros(len(t0), dtype=np.int64), ke, n_tok
        kv = kv_lens[req]
    delta = kv - qo
    # (np.maximum / np.minimum: np.clip's wrapper costs several times their host time on small arrays)
    if opts.causal and not opts.has_custom_mask:
        if type(kv) is int and delta >= 0:
            # (one request with at least its queries' keys: min(t0 + tile_t, qo) + delta is never negative and
            # never past kv, so the clamp reduces to its last bound)
            ke = np.minimum(t0 + (tile_t + delta), kv)
        else:
            ke = np.minimum(np.maximum(np.minimum(t0 + tile_t, qo) + delta, 0), kv)
    else:
        ke = np.full(len(t0), kv, dtype=np.int64) if type(kv) is int else kv
    if opts.window_left >= 0:
        ks = np.maximum(t0 + delta - opts.window_left, 0) // block_n * block_n
        ks = np.minimum(ks, ke)
    else:
        ks = np.zeros(len(t0), dtype=np.int64)
    return req, t0, ks, ke, np.minimum(qo - t0, tile_t)


# Batches of at most this many requests read their lengths as Python ints; those of at most _SMALL_TILES query tiles
# (no custom mask) build the tiles and an unsplit work list on them too: a loop of a few dozen steps against some
# twenty numpy operations on arrays of a few entries.
_SMALL_BATCH, _SMALL_TILES = 16, 16


def _tiles_small(opts: AttentionOptions, qo_l: list, kv_l: list, tile_t: int, block_n: int):
    """:func:`_tiles` on Python ints for ``qo_l`` (qo_indptr) and ``kv_l`` (KV lengths) as lists: ``(tiles, longest
    range, req, t0, ks, ke, n_tok)`` with lists of the same values, or None past ``_SMALL_TILES`` tiles. No call
    per request or tile (plain arithmetic and comparisons: the host-work bounds count calls)."""
    n, prev = 0, qo_l[0]
    for x in qo_l[1:]:
        n += -(-(x - prev) // tile_t)
        prev = x
    if n > _SMALL_TILES:
        return None
    req, t0s, kss, kes, toks = [0] * n, [0] * n, [0] * n, [0] * n, [0] * n
    causal = opts.causal and not opts.has_custom_mask
    wl = opts.window_left
    i = longest = 0
    for r, kv in enumerate(kv_l):
        qo = qo_l[r + 1] - qo_l[r]
        delta = kv - qo
        t0 = 0
        while t0 < qo:
            end = t0 + tile_t
            if causal:  # min(max(min(t0 + tile_t, qo) + delta, 0), kv)
                ke = (end if end < qo else qo) + delta
                ke = 0 if ke < 0 else (kv if ke > kv else ke)
            else:
                ke = kv
            if wl >= 0:  # min(max(t0 + delta - window_left, 0) // block_n * block_n, ke)
                ks = t0 + delta - wl
                ks = 0 if ks < 0 else ks // block_n * block_n
                if ks > ke:
                    ks = ke
            else:
                ks = 0
            req[i], t0s[i], kss[i], kes[i] = r, t0, ks, ke
            toks[i] = qo - t0 if end > qo else tile_t
            if ke - ks > longest:
                longest = ke - ks
            i += 1
            t0 = end
    return n, longest, req, t0s, kss, kes, toks


def _small_items(tiles, qo_l: list, kv_l: list, kvi_l: list) -> tuple:
    """The unsplit work list of :func:`_tiles_small`'s tiles, longest range first (stable: ties keep tile order),
    flattened (``_WORK_FIELDS`` ints an item), and the sum of range x tokens over the tiles. ``qo_l``, ``kv_l``,
    ``kvi_l``: qo_indptr, the KV lengths and kv_indptr as lists (the rows' request fields)."""
    n, _, req, t0s, kss, kes, toks = tiles
    neg = [kss[i] - kes[i] for i in range(n)]
    flat = [0] * (n * _WORK_FIELDS)
    j = dot = 0
    for i in sorted(range(n), key=neg.__getitem__):
        r = req[i]
        q0 = qo_l[r]
        # (_UNSPLIT_TAIL, then the request's fields)
        flat[j : j + _WORK_FIELDS] = (r, t0s[i], kss[i], kes[i], -1, 1, 0, 0, q0, qo_l[r + 1] - q0, kv_l[r], kvi_l[r])
        dot -= neg[i] * toks[i]
        j += _WORK_FIELDS
    return flat, dot


def plan(
    opts: AttentionOptions,
    batch: AttentionBatch,
    ws: Workspace,
    *,
    config: PrefillConfig | None = None,
    gluon: GluonPrefillConfig | None = None,
):
    """Host side: query tiles, visible KV ranges, KV split, work list on the device. ``config``: the tile and
    rules to use (default: ``choose_config``'s, or the Gluon kernel's plan where ``gluon`` (default
    ``_config.GLUON_PREFILL``) takes it).

    ``batch.extra["stage"]`` (the wrapper's ``BatchStage``, when present): the batch's own index arrays, still on
    the host; they go to the device in this plan's copy, in front of the work list."""
    stage = batch.extra.pop("stage", None)
    device = batch.device if stage is None else stage.device
    group = opts.group_size
    staged = stage.arrays if stage is not None else None
    if batch.kv_indptr_host is None:
        raise ValueError("kv_indptr_host: required by the prefill plan (each work row carries its request's kv_indptr)")
    if (
        staged is not None
        and staged["qo_indptr"].dtype == np.int64
        and staged["kv_lens"].dtype == np.int64
        and staged["kv_indptr"].dtype == np.int64
    ):
        # (the same arrays, without three conversions)
        qo_indptr, kv_lens, kv_indptr = staged["qo_indptr"], staged["kv_lens"], staged["kv_indptr"]
    else:
        qo_indptr, kv_lens = _i64(batch.qo_indptr_host), _i64(batch.kv_lens_host)
        kv_indptr = _i64(batch.kv_indptr_host)
    small = len(kv_lens) <= _SMALL_BATCH and not opts.has_custom_mask
    if small:
        # A few requests: their lengths as Python ints (tolist() and a short loop cost less than numpy's
        # operations on arrays of a few entries); the tiles too when there are few (_tiles_small).
        qo_l, kv_l = qo_indptr.tolist(), kv_lens.tolist()
        longest_q, prev = 0, qo_l[0]
        for x in qo_l[1:]:
            if x - prev > longest_q:
                longest_q = x - prev
            prev = x
        max_rows = longest_q * group if len(kv_l) else group
        total_q = prev
    else:
        qo_lens = qo_indptr[1:] - qo_indptr[:-1]
        max_rows = int(_MAX(qo_lens)) * group if len(qo_lens) else group
        total_q = int(qo_indptr[-1])
    if ws.cuda_graph:
        # The tile shape must not depend on this batch's lengths: a graph captured after one plan()
        # replays the kernel it captured (same BLOCK_M) over the work list of the next plan().
        max_rows = ws.max_total_q * group if ws.max_total_q is not None else 1 << 30
    total_rows = max_rows if ws.cuda_graph else total_q * group
    gcfg = gluon or _config.GLUON_PREFILL
    if config is not None:
        cfg = config
    elif max_rows >= gcfg.min_rows and _gluon_candidate(opts, device, gcfg):
        # (split plans too: the Gluon kernel writes partial rows that the merge launch combines)
        cfg = gcfg.tile_for(opts.head_dim)
    else:
        cfg = choose_config(opts, max_rows, device, total_rows)
    if cfg.block_m < group:
        raise ValueError(f"config: block_m {cfg.block_m} must be at least the group size {group}")
    tile_t = gcfg.tile_tokens(group, opts.head_dim, not opts.paged) if cfg.gluon else cfg.block_m // group

    tiles = _tiles_small(opts, qo_l, kv_l, tile_t, cfg.block_n) if small else None
    if tiles is None:
        if small:
            qo_lens = qo_indptr[1:] - qo_indptr[:-1]
        req, t0, ks, ke, n_tok = _tiles(opts, qo_lens, kv_lens, tile_t, cfg.block_n)
        n_tiles = len(req)
    else:
        n_tiles = tiles[0]
    blocks = None
    n_visited = 0
    if opts.has_custom_mask and n_tiles:
        # Custom mask: visit only the KV tiles with a set bit. From here on [ks, ke) of a tile is its slice
        # of the run list, scaled by block_n (so the split and the longest-first order below apply as is).
        blocks, n_visited, ks, ke = _mask_block_list(
            batch, req, t0, ks, ke, tile_t, cfg.block_n, kv_lens, opts.window_left
        )
    splits = None
    chunk = 0
    # (without a window or a mask every range starts at key 0: the ranges are the ends, read only from here on)
    zero_ks = opts.window_left < 0 and not opts.has_custom_mask
    ranges = None
    if n_tiles and not ws.cuda_graph and not opts.disable_split_kv:
        if tiles is None:
            ranges = ke if zero_ks else ke - ks
        units = n_tiles * opts.num_kv_heads
        sms = _num_sms(device)
        if opts.fixed_split_size:
            chunk = -(-int(opts.fixed_split_size) // cfg.block_n) * cfg.block_n
        elif (
            units < sms
            and (longest := int(_MAX(ranges)) if tiles is None else tiles[1]) >= 8 * cfg.block_n
            and (cfg.split_pieces or split_pays(cfg, opts, tile_t * group, longest))
        ):
            # Whole waves: units x splits <= the programs the GPU holds at once. (Rounding the split count
            # up left 288 pieces of 1856 keys for 264 slots on 64 queries x 16384 keys: a second wave of 24.)
            # At most split_max_pieces: past that the merge costs more than the parallelism brings.
            target = cfg.split_pieces or min((_programs_per_sm(cfg, opts) * sms) // units, cfg.split_max_pieces)
            if target >= 2:
                chunk = -(-longest // target)
                chunk = max(-(-chunk // cfg.block_n) * cfg.block_n, 4 * cfg.block_n)
        if chunk:
            if tiles is not None:  # (a split plan: the numpy path below, from the tiles as arrays)
                req, t0, ks, ke, n_tok = (np.array(x, dtype=np.int64) for x in tiles[2:])
                ranges, tiles = ke - ks, None
            splits = np.maximum(1, -(-ranges // chunk))

    rows_cols = flat_items = None
    if tiles is not None:
        # Few tiles, no split, no mask: the work list as one flat list of Python ints, written in one assignment.
        num_items = n_tiles
        part_rows = None
        flat_items, dot = _small_items(tiles, qo_l, kv_l, kv_indptr.tolist())
        work_flops = float(4 * opts.head_dim * opts.num_kv_heads * group * dot)
    elif not chunk and blocks is None:
        # No split, no mask (most plans): one work item per tile, written straight into the packed host array
        # below in longest-first order (stable: ties keep tile order), a handful of array operations.
        if ranges is None:
            ranges = ke if zero_ks else ke - ks
        num_items = n_tiles
        part_rows = None
        work_flops = float(4 * opts.head_dim * opts.num_kv_heads * group * int(ranges.dot(n_tok)))
        order = (-ranges).argsort(kind="stable")
        rows_cols = (req, t0, ks, ke)
    else:
        if splits is None:
            splits = np.ones(n_tiles, dtype=np.int64)
        # Work items: unsplit tiles write out directly; split tiles write partial rows (token-major).
        split_tile = splits > 1
        part_rows = n_tok * splits * split_tile
        # (ufuncs and array methods: numpy's function forms add a Python wrapper's host time per call)
        # (the running sums give the totals too: their last entries)
        rows_end = np.add.accumulate(part_rows)
        part_base = rows_end - part_rows
        total_part = int(rows_end[-1]) if n_tiles else 0
        items_end = np.add.accumulate(splits)
        num_items = int(items_end[-1]) if n_tiles else 0
        # One row per tile (request, first token, ks, ke, first partial row or -1, splits, 0, first partial row),
        # repeated to the tile's items in one call; an item then adds its index in the tile (0 for an unsplit
        # tile) to its partial row and its chunk offset to its range.
        work = np.zeros((n_tiles, _WORK_FIELDS), dtype=np.int64)  # (field 6: 0)
        work[:, 0] = req
        work[:, 1] = t0
        work[:, 2] = ks
        work[:, 3] = ke
        work[:, 4] = np.where(split_tile, part_base, -1)
        work[:, 5] = splits
        work[:, 7] = part_base
        work[:, _REQ_AT:] = _request_fields(qo_indptr, kv_lens, kv_indptr)[req]
        if num_items != n_tiles:
            work = work.repeat(splits, axis=0)
            item_s = np.arange(num_items, dtype=np.int64) - (items_end - splits).repeat(splits)
            work[:, 4] += item_s
            if chunk:
                item_ks = work[:, 2]
                item_ks += item_s * chunk
                np.minimum(work[:, 3], item_ks + chunk, out=work[:, 3])
        # (a tile of one item keeps its range: ceil(range / chunk) <= 1)
        # The items of a tile cover its range [ks, ke) exactly, so the flops are the tiles' (n_tok <= tile_t).
        work_flops = float(
            4 * opts.head_dim * opts.num_kv_heads * group * int((ranges if chunk else ke - ks).dot(n_tok))
        )
        # Longest ranges first, so the last wave is short (causal tiles differ by up to the whole KV).
        order = (work[:, 2] - work[:, 3]).argsort(kind="stable")
        work = work[order]

    merge = None  # the merge list's columns (output row, first partial row, partials), written into host below
    num_merge_host = 0
    part_o = part_lse = None
    if part_rows is None:
        total_part = 0
    if total_part:
        st = split_tile.nonzero()[0]
        tok_per = n_tok[st]
        tok_end = np.add.accumulate(tok_per)
        num_merge_host = int(tok_end[-1])  # merged output rows (some tile is split: st is not empty)
        m_tile = st.repeat(tok_per)
        m_u = np.arange(num_merge_host, dtype=np.int64) - (tok_end - tok_per).repeat(tok_per)
        out_row = qo_indptr[req[m_tile]] + t0[m_tile] + m_u
        m_splits = splits[m_tile]
        merge = (out_row, part_base[m_tile] + m_u * m_splits, m_splits)
        hq, d = opts.num_qo_heads, opts.head_dim
        pdt = partial_dtype(opts.o_dtype)
        o_bytes = total_part * hq * d * pdt.itemsize
        need = o_bytes + total_part * hq * 4
        fb = ws.float_buffer
        if fb is not None and fb.device == device and fb.numel() >= need + 256:
            # The partial-state views of this workspace and shape, kept per wrapper (``ws.reuse``): an engine's
            # split plans mostly repeat the shape, and the six views cost microseconds of host time each.
            pkey = (fb.data_ptr(), fb.numel(), total_part, hq, d, pdt)
            kept_part = ws.reuse.get("prefill_part") if ws.reuse is not None else None
            if kept_part is not None and kept_part[0] is fb and kept_part[1] == pkey:
                part_o, part_lse = kept_part[2]
            else:
                base = fb.data_ptr() % 256
                off = (256 - base) % 256
                region = fb[off : off + need]
                part_o = region[:o_bytes].view(pdt).view(total_part, hq, d)
                part_lse = region[o_bytes:].view(torch.float32).view(total_part, hq)
                if ws.reuse is not None and not ws.cuda_graph:
                    ws.reuse["prefill_part"] = (fb, pkey, (part_o, part_lse))
        else:
            part_o = torch.empty(total_part, hq, d, dtype=pdt, device=device)
            part_lse = torch.empty(total_part, hq, dtype=torch.float32, device=device)

    # The persistent grid (``GluonPrefillConfig.persist_min_units_per_sm``, ``_persist_lists``): eager, unsplit D128
    # plans of several requests over ragged K/V, from either path above. (A unit is one int32, KV head << 23 | work
    # item: fewer than 256 KV heads and 2^23 items.) Its lists ride in the work list's array and copy (below).
    # One request takes it in the few-wave causal regime (``persist_single_max_units_per_sm``): at least one unit and
    # at most that many per SM, where the one-shot grid's tail (each KV head's longest item dispatched after the
    # previous head's shortest) and its per-CTA set-up cost most; D256 too (its 64-key tiles, 2 stages), where the
    # query rows are TMA copies (groups 1, 2, 4, 8, 16). D256 by rows (groups 3, 5, 6, 7) keeps the one-shot grid:
    # correct on the persistent grid (GPU tests, memcheck) but 0.6-1.9% slower there on an H100 (docs/prefill.md).
    n_units = num_items * opts.num_kv_heads
    nprog = 0
    if (
        cfg.gluon
        and num_items
        and not chunk
        and not opts.has_custom_mask
        and not ws.cuda_graph
        and not opts.paged
        and opts.num_kv_heads < 1 << 8
        and num_items < 1 << 23
        and (
            (
                len(kv_lens) > 1
                and opts.head_dim == 128
                and gcfg.persist_min_units_per_sm >= 0
                and n_units >= gcfg.persist_min_units_per_sm * _num_sms(device)
            )
            or (
                len(kv_lens) == 1
                and opts.causal
                and (opts.head_dim == 128 or (opts.head_dim == 256 and tile_t & (tile_t - 1) == 0))
                and _num_sms(device) <= n_units <= gcfg.persist_single_max_units_per_sm * _num_sms(device)
            )
        )
    ):
        nprog = min(_num_sms(device), n_units)
    else:
        n_units = 0

    n_blocks = 0 if blocks is None else len(blocks)
    if ws.cuda_graph:
        # Work list (then the mask's block list) at fixed offsets of the int workspace: same addresses
        # at every plan, so a captured graph reads the current plan's lists.
        grid0 = _graph_capacity(opts, ws, tile_t, num_items)
        # A masked plan keeps at least one (empty) run slot, so its run list is never a zero-size tensor
        # (whose data pointer is null) and sits at the same address in every plan.
        need_ints = 1 + grid0 * _WORK_FIELDS + max(n_blocks, 2 if opts.has_custom_mask else 0)
        ib = ws.int_buffer
        if ib is None or ib.numel() < need_ints * 4:
            raise ValueError(
                f"int_workspace_buffer: need {need_ints * 4} bytes for the CUDA-graph work list"
                + (f" and the custom mask's {n_blocks // 2} KV-tile runs" if n_blocks else "")
            )
        ints = ib[: need_ints * 4].view(torch.int32)
        # All grid0 rows are written at every plan, those past this plan's items as zeros: the kernels load their
        # program's row before (not after) comparing it with the live count, so the row must exist and be
        # harmless (an empty KV range) for every program of the captured grid.
        host = np.zeros(need_ints, dtype=np.int32)
    else:
        grid0 = num_items
        need_ints = 1 + num_items * _WORK_FIELDS + n_blocks
        # (the merge list rides in the same host-to-device copy, after the work list and the mask's runs; the
        # batch's staged arrays, when given, in front of them: the lists are written in place after those)
        lead = 0 if stage is None else stage.size
        # The wrapper's previous plan of this layout left its arrays (``ws.reuse``): they are rewritten, the
        # device array by this plan's one copy (stream-ordered after the runs of the plan it replaces, as
        # FlashInfer's plan rewrites its own workspace), and its views serve again: no allocation and no view
        # per plan (each view of a CUDA tensor costs microseconds of host time).
        layout = (
            device,
            None if stage is None else tuple(stage.sizes),
            grid0,
            need_ints,
            n_blocks,
            None if merge is None else num_merge_host,
            n_units,
        )
        # The persistent lists (never with a merge list) last, each 16-byte aligned: per-program offsets, units.
        tail = lead + need_ints + (0 if merge is None else 1 + num_merge_host * _MERGE_FIELDS)
        persist_at = (tail + 3) & ~3 if n_units else tail
        units_at = persist_at + ((nprog + 4) & ~3) if n_units else tail
        kept = ws.reuse.get("prefill") if ws.reuse is not None else None
        if kept is not None and kept[0] == layout:
            both = kept[1]
        else:
            kept = None
            both = np.empty(units_at + n_units, dtype=np.int32)
        host = both[lead:]
    # the lists packed in numpy (a slice assignment into a torch tensor costs microseconds of host time each)
    host[0] = num_items
    if flat_items is not None:
        host[1 : 1 + num_items * _WORK_FIELDS] = flat_items
    elif rows_cols is None:
        host[1 : 1 + num_items * _WORK_FIELDS] = work.reshape(-1)
    else:
        items = host[1 : 1 + num_items * _WORK_FIELDS].reshape(num_items, _WORK_FIELDS)
        if len(kv_lens) == 1:  # (one request: its four values broadcast, no gather)
            for j, col in enumerate(rows_cols):  # (a column at a time: cheaper than stacking them first)
                items[:, j] = col[order]
            items[:, 4:_REQ_AT] = _UNSPLIT_TAIL
            items[:, _REQ_AT:] = (qo_indptr[0], qo_indptr[1] - qo_indptr[0], kv_lens[0], kv_indptr[0])
        else:
            # Every row starts as its request's row of a per-request table (request, the unsplit tail, the request's
            # fields), gathered in one call straight into the host array; the tile's own columns follow. (Half the
            # host time of gathering each column and the request fields apart: 14.5 against 27.6 us at 832 tiles.)
            _unsplit_rows(qo_indptr, kv_lens, kv_indptr).take(req[order], axis=0, out=items)
            items[:, 1] = t0[order]
            if opts.window_left >= 0:  # (without a window every tile's range starts at key 0, as _tiles makes it)
                items[:, 2] = ks[order]
            items[:, 3] = ke[order]
    blocks_at = 1 + grid0 * _WORK_FIELDS
    if n_blocks:
        host[blocks_at : blocks_at + n_blocks] = blocks
    if merge is not None:  # (eager plans only: CUDA-graph plans never split)
        host[need_ints] = num_merge_host
        merge_rows = host[need_ints + 1 :].reshape(num_merge_host, _MERGE_FIELDS)
        for j, col in enumerate(merge):  # (a column at a time: no stacked int64 copy, no cast)
            merge_rows[:, j] = col
    if n_units:
        if tiles is not None:  # (the few-tile path: its tiles as arrays, its work list's order)
            req, ks, ke = (np.array(tiles[i], dtype=np.int64) for i in (2, 4, 5))
            order = (ks - ke).argsort(kind="stable")
        cta_host, units_host = both[persist_at : persist_at + nprog + 1], both[units_at:]
        if len(kv_lens) == 1:
            head_bytes = 2 * int(kv_lens[0]) * opts.head_dim * opts.kv_dtype.itemsize
            _persist_single(opts.num_kv_heads, ks, ke, order, cfg.block_n, head_bytes, cta_host, units_host)
        else:
            _persist_lists(opts.num_kv_heads, req, ks, ke, order, kv_lens, cfg.block_n, cta_host, units_host)
    # In CUDA-graph mode a masked plan always hands the kernel the same address for its KV-tile runs, even
    # when this batch has none (an empty slice at the fixed offset): a graph captured on one plan must read
    # the runs of every later plan there.
    graph_mask = ws.cuda_graph and opts.has_custom_mask
    with_blocks = bool(n_blocks or graph_mask)
    # One copy, never a synchronizing one: from pageable memory CUDA stages the bytes before the call returns
    # (so ``host`` may be freed) without waiting for the device to finish the copy.
    if stage is not None:  # the batch's arrays first (a multiple of 4 entries: the work list stays 16-byte aligned)
        stage.pack_into(both[:lead])
    if ws.cuda_graph:
        ints.copy_(torch.from_numpy(host), non_blocking=True)
    elif kept is not None:
        ints, views = kept[2], kept[3]
        if device.type != "cpu":  # (on the CPU the device array is the host array itself)
            ints.copy_(torch.from_numpy(both), non_blocking=True)
    elif device.type != "cpu":
        ints = torch.from_numpy(both).to(device, non_blocking=True)
    else:
        ints = torch.from_numpy(both)
    if ws.cuda_graph or kept is None:
        # every device view in one call (a view of a CUDA tensor costs host time): count | work list | gap |
        # runs | merge count | merge list
        merge_n = 0 if merge is None else num_merge_host * _MERGE_FIELDS
        sizes = [1, grid0 * _WORK_FIELDS, need_ints - blocks_at if with_blocks else 0]
        sizes.append(need_ints - blocks_at - sizes[2])
        if merge is not None:
            sizes += [1, merge_n]
        if n_units:
            sizes += [persist_at - tail, nprog + 1, units_at - persist_at - nprog - 1, n_units]
        lead_parts = ()
        if stage is None:
            parts = ints.split_with_sizes(sizes)
        else:
            parts = ints.split_with_sizes(stage.sizes + sizes)
            lead_parts, parts = parts[: len(stage.sizes)], parts[len(stage.sizes) :]
        views = (
            lead_parts,
            parts[0],
            parts[1].view(grid0, _WORK_FIELDS),
            parts[2] if with_blocks else None,
            parts[4] if merge is not None else None,
            parts[5].view(num_merge_host, _MERGE_FIELDS) if merge is not None else None,
            parts[-3] if n_units else None,
            parts[-1] if n_units else None,
        )
        if not ws.cuda_graph and ws.reuse is not None:
            ws.reuse["prefill"] = (layout, both, ints, views)
    lead_parts, num_work, work_dev, blocks_dev, num_merge, merge_dev, persist_cta, persist_units = views
    if stage is not None:
        stage.finish(lead_parts)
    return PrefillPlan(
        config=cfg,
        tile_t=tile_t,
        grid0=grid0,
        work=work_dev,
        num_work=num_work,
        num_work_host=num_items,
        merge=merge_dev,
        num_merge=num_merge,
        num_merge_host=num_merge_host,
        part_o=part_o,
        part_lse=part_lse,
        kv_rows=None if opts.paged or batch.kv_indptr_host is None or ws.cuda_graph else int(batch.kv_indptr_host[-1]),
        blocks=blocks_dev,
        num_blocks_host=n_visited,
        work_flops=float("inf") if ws.cuda_graph else work_flops,
        graph=bool(ws.cuda_graph),
        persist_nprog=nprog,
        persist_cta=persist_cta,
        persist_units=persist_units,
    )


# The persistent schedule's feedback blocks (_persist_lists): each block takes this fraction of the rounds left (at
# least one round), so the last rounds are dealt one at a time. 3 keeps the programs within 0.1-0.6 % of each other
# on the A/B batches of docs/prefill.md (estimated cost), at 15 blocks for 263 rounds.
_PERSIST_BLOCK_DIV = 3


def _persist_lists(hkv: int, req, ks, ke, order, kv_lens, block_n: int, cta, units) -> None:
    """The persistent Gluon launch's static schedule (``kernels/prefill_sm90_persist.py``), written into the int32
    host arrays ``cta`` (per-program unit offsets: ``len(cta) - 1`` programs) and ``units`` (a unit being ``KV head
    << 23 | work item``), which plan() copies with its work list.

    The sequence of units is FlashInfer's sm90 batch order (``PrefillSM90Plan``): KV head, then requests by KV
    length, longest first, then query tiles last to first, so that the programs at work at any time read the K/V
    of a few requests of one head (L2). It is dealt in rounds of one unit per program (odd rounds mirrored), so the
    programs walk it together and a program's units keep its order. Which program takes which column of a round is
    decided a block of rounds at a time: the block's columns (their units' estimated costs, ``1 +`` KV tiles,
    summed) heaviest first go to the programs least loaded so far (LPT on the blocks, FlashInfer's min-heap a block
    at a time). The blocks shrink towards the end (``_PERSIST_BLOCK_DIV``), so the last, cheapest units even the
    loads out. Array operations over the units and one short loop over the blocks: about 0.3 ms of host time for
    35k units."""
    n = len(order)
    n_units = n * hkv
    nprog = len(cta) - 1
    # The tiles come in request order, first token ascending: the sequence of one head reverses each request's tiles
    # and takes the requests longest first (stable).
    n_t = np.bincount(req, minlength=len(kv_lens))
    by_len = (-kv_lens).argsort(kind="stable")
    cnt = n_t[by_len]
    seq = (np.add.accumulate(n_t) - 1)[by_len].repeat(cnt) - (
        np.arange(n, dtype=np.int64) - (np.add.accumulate(cnt) - cnt).repeat(cnt)
    )
    row = np.empty(n, dtype=np.int32)  # tile -> its row of the work list
    row[order] = np.arange(n, dtype=np.int32)
    rounds = -(-n_units // nprog)
    cost = np.zeros((rounds, nprog), dtype=np.int32)
    cost.reshape(-1)[:n_units].reshape(hkv, n)[:] = ((ke - ks + (2 * block_n - 1)) // block_n)[seq]
    cost[1::2] = cost[1::2, ::-1]
    starts, sizes, r = [], [], 0
    while r < rounds:
        starts.append(r)
        sizes.append(max(1, (rounds - r) // _PERSIST_BLOCK_DIV))
        r += sizes[-1]
    block_cost = np.add.reduceat(cost, starts, axis=0)
    heavy = (-block_cost).argsort(axis=1)
    blk = np.arange(len(starts))[:, None]
    heavy_cost = block_cost[blk, heavy]
    takers = np.empty(heavy.shape, dtype=np.intp)
    load = np.zeros(nprog, dtype=np.int64)
    for b in range(len(starts)):
        takers[b] = load.argsort(kind="stable")
        load[takers[b]] += heavy_cost[b]
    col = np.empty(heavy.shape, dtype=np.int32)  # (block, program) -> its column
    col[blk, takers] = heavy
    col = col.repeat(sizes, axis=0)
    col[1::2] = (nprog - 1) - col[1::2]
    col += np.arange(0, rounds * nprog, nprog, dtype=np.int32)[:, None]  # -> the unit's place in the sequence
    counts = np.full(nprog, rounds, dtype=np.int32)
    flat = col.T.ravel()  # program-major
    if n_units % nprog:  # (the last round is short)
        flat = flat[flat < n_units]
        counts -= col[-1] >= n_units
    code = ((np.arange(hkv, dtype=np.int32) << 23)[:, None] | row[seq]).reshape(-1)
    cta[0] = 0
    np.add.accumulate(counts, out=cta[1:])
    np.take(code, flat, out=units)


# One request's persistent schedule (_persist_single): KV heads in sections whose K and V fit this many bytes of L2
# (estimated loads within 0.6-1.2 % of their mean on the rule's 4096-token rows at D128 and D256; 8 MB sections left
# up to 5.7 %, their ends falling mid-round).
_PERSIST_SECTION_BYTES = 16 << 20


def _persist_single(hkv: int, ks, ke, order, block_n: int, head_bytes: int, cta, units) -> None:
    """The persistent launch's static schedule for one request, written into ``cta`` and ``units`` as
    ``_persist_lists`` writes its own: LPT over the units in rounds. The sequence takes the KV heads in sections of
    ``sec`` heads (the largest power of two dividing ``hkv`` whose K and V, ``head_bytes`` a head, fit
    ``_PERSIST_SECTION_BYTES``: the units at work at any time read a few heads' K/V, as the one-shot grid's
    head-major order does) and, within a section, the work list's order (longest KV range first, which is the work
    list's row order) with the section's heads fastest. It is dealt a round of one unit per program at a time: the
    round's units, heaviest first (estimated cost ``1 +`` KV tiles), to the programs least loaded so far. Every
    section ends on its shortest units, so the last rounds even the loads out; the one-shot grid instead dispatches
    each head's longest items after the previous head's shortest, and the last head's longest item starts last. A
    few rounds (the rule asks for at most a dozen units per SM): about 0.1 ms of host time."""
    n = len(order)
    n_units = n * hkv
    nprog = len(cta) - 1
    sec = 1
    while hkv % (2 * sec) == 0 and 2 * sec * head_bytes <= _PERSIST_SECTION_BYTES:
        sec *= 2
    rows = np.arange(n, dtype=np.int32)
    # work-list rows are longest-first: row r's cost from the tile at order[r]
    cost_row = (1 + (ke - ks + (block_n - 1)) // block_n)[order]
    # the sequence: section-major, then row, then the section's heads
    heads = np.arange(hkv, dtype=np.int32).reshape(hkv // sec, 1, sec)
    seq_head = np.broadcast_to(heads, (hkv // sec, n, sec)).reshape(-1)
    seq_row = np.broadcast_to(rows.reshape(1, n, 1), (hkv // sec, n, sec)).reshape(-1)
    seq_cost = cost_row[seq_row]
    prog = np.empty(n_units, dtype=np.int64)
    load = np.zeros(nprog, dtype=np.int64)
    for r0 in range(0, n_units, nprog):
        c = seq_cost[r0 : r0 + nprog]
        heavy = (-c).argsort(kind="stable")
        takers = load.argsort(kind="stable")[: len(c)]
        prog[r0 + heavy] = takers
        load[takers] += c[heavy]
    # program-major lists, each program's units in round order (the sequence's)
    by_prog = np.argsort(prog, kind="stable")
    counts = np.bincount(prog, minlength=nprog)
    cta[0] = 0
    np.add.accumulate(counts, out=cta[1:])
    units[:] = ((seq_head << 23) | seq_row)[by_prog]


_RUN_TILES = 16  # longest run of KV tiles in one mask-list entry (so a split can still cut the list)


def _mask_block_list(batch: AttentionBatch, req, t0, ks, ke, tile_t: int, block_n: int, kv_lens, window_left: int):
    """Classify every (query tile, KV tile) of a custom mask on the device (one pre-pass launch, then one
    small copy to the host: plan() may synchronize, run() never does) and list, per query tile, the runs of
    consecutive KV tiles of [ks, ke) that hold a set bit.

    Returns (entries int32 [2 * runs]: (first key * 2 + all bits set, end key) per run, number of KV tiles
    visited, new ks, new ke) where [ks, ke) / block_n is the query tile's slice of the runs. A run is "all
    set" only when every tile in it has all its in-range bits set, lies inside the KV length and past the
    sliding-window edge of every row, so the kernel can take its unmasked loop.
    """
    from .kernels.prefill import _mask_tiles_kernel

    device = batch.device
    n_tiles = len(req)
    n_blk = max(1, int(-(-kv_lens.max() // block_n))) if len(kv_lens) else 1
    tiles = torch.from_numpy(np.stack([req, t0], axis=1).astype(np.int32)).to(device)
    cls = torch.empty(n_tiles, n_blk, dtype=torch.int8, device=device)
    _mask_tiles_kernel[(n_tiles * n_blk,)](
        batch.mask_packed,
        batch.mask_indptr,
        batch.qo_indptr,
        batch.kv_lens,
        tiles,
        cls,
        n_blk,
        TILE_T=tile_t,
        TILE_TP=_next_pow2(tile_t),
        BLOCK_N=block_n,
        num_warps=4,
    )
    cls = cls.cpu().numpy()
    col = np.arange(n_blk, dtype=np.int64)[None, :]
    kv = kv_lens[req]
    not_full = (col + 1) * block_n > kv[:, None]  # the request's last, partial KV tile
    if window_left >= 0:
        qo = (np.asarray(batch.qo_indptr_host[1:] - batch.qo_indptr_host[:-1], dtype=np.int64))[req]
        edge = np.minimum(t0 + tile_t, qo) - 1 + (kv - qo) - window_left  # latest window start of the tile
        not_full |= col * block_n < edge[:, None]
    cls = np.where((cls == 2) & not_full, 1, cls)
    sel = (cls != 0) & (col >= (ks // block_n)[:, None]) & (col < (-(-ke // block_n))[:, None])
    rows, cols = np.nonzero(sel)  # row-major: each query tile's KV tiles in increasing order
    n = len(rows)
    if n == 0:
        z = np.zeros(n_tiles, dtype=np.int64)
        return np.zeros(0, dtype=np.int32), 0, z, z
    c = cls[rows, cols]
    brk = np.ones(n, dtype=bool)
    brk[1:] = (rows[1:] != rows[:-1]) | (cols[1:] != cols[:-1] + 1) | (c[1:] != c[:-1])
    run_id = np.cumsum(brk) - 1
    pos = np.arange(n) - np.flatnonzero(brk)[run_id]
    brk |= pos % _RUN_TILES == 0
    starts = np.flatnonzero(brk)
    ends = np.append(starts[1:], n) - 1
    entries = np.stack([cols[starts] * block_n * 2 + (c[starts] == 2), (cols[ends] + 1) * block_n], axis=1)
    count = np.bincount(rows[starts], minlength=n_tiles).astype(np.int64)
    first = np.cumsum(count) - count
    return entries.reshape(-1).astype(np.int32), n, first * block_n, (first + count) * block_n


def _graph_capacity(opts: AttentionOptions, ws: Workspace, tile_t: int, needed: int) -> int:
    """Fixed grid size in CUDA-graph mode: every tile a batch within the capacity can produce."""
    if ws.max_total_q is not None and ws.max_batch_size is not None:
        cap = -(-ws.max_total_q // tile_t) + ws.max_batch_size
    else:
        # Capacity not given: fixed by the first plan on this int workspace (with headroom).
        key = (ws.int_buffer.data_ptr(), tile_t)
        if key not in _GRAPH_CAPACITY:
            _GRAPH_CAPACITY[key] = max(2 * needed, (ws.max_batch_size or 1) * 4)
        cap = _GRAPH_CAPACITY[key]
    if needed > cap:
        raise ValueError(
            f"qo_indptr: the batch needs {needed} query tiles, more than the CUDA-graph capacity {cap} "
            "(max_batch_size / max_total_q)"
        )
    return max(cap, 1)


RUN_BINDS = True  # run() takes ``bind`` (the wrapper keeps the bound launch for calls of the same form)
STAGES_BATCH = True  # plan() takes the batch's index arrays into its own copy (``batch.extra["stage"]``)


def run(
    plan_obj: PrefillPlan,
    opts,
    batch,
    q,
    k,
    v,
    out,
    lse,
    *,
    qk_scale_mult: float = 1.0,
    v_scale: float = 1.0,
    bind: list | None = None,
):
    """Device only: the attention kernel over the planned work, then the merge of split rows.

    ``bind``: a list that receives the launches bound to everything but q, k, v, out and lse (``_launch.bind``):
    the attention launch (the Gluon kernel's, or the Triton kernel's with pointer loads: its TMA variant's
    descriptors follow the K/V seen), then the merge launch of a split plan; the caller keeps them for later
    calls whose tensors have the same form."""
    _prefill_kernel, _merge_partials_kernel = _KERNELS or _load_kernels()

    p = plan_obj
    if p.grid0 == 0:
        return
    cfg = p.config
    scale = float(opts.sm_scale) * float(qk_scale_mult)
    softcap = opts.logits_soft_cap is not None and opts.logits_soft_cap > 0
    alibi = opts.pos_encoding_mode == "ALIBI"
    qk_scale = scale if (softcap or alibi) else scale * LOG2E
    dot_f32 = _backend._INTERPRET or q.dtype == torch.float32
    fold = cfg.fold_scale
    if fold is None:  # (see PrefillConfig.fold_scale)
        fold = not (cfg.block_m >= 128 and cfg.block_n >= 128)
    fold = bool(fold) and not (softcap or alibi) and qk_scale > 0.0
    dummy = batch.qo_indptr
    d = opts.head_dim
    if cfg.gluon and _gluon_args_ok(opts, q, k, v, qk_scale):
        _run_gluon(p, opts, batch, q, k, v, out, lse, qk_scale, bind=bind)
        if p.part_o is not None:
            _launch_merge(_merge_partials_kernel, p, opts, out, lse, False, bind)
        return
    block_d = max(16, _next_pow2(d))
    k_desc = v_desc = None
    want_tma = False
    # The descriptor ends at the batch's last key: rows past it (an engine's unwritten tail, possibly NaN)
    # read as zeros instead of reaching P @ V. A CUDA-graph plan cannot bound it (a replay after a later plan
    # with more keys would read zeros for them): pointer loads there.
    n = k.shape[0] if p.kv_rows is None else min(k.shape[0], p.kv_rows)
    if n > 0 and not p.graph and (want_tma := _want_tma(cfg, opts, k, v, block_d)) and _tma_pays(cfg, p, k, v):
        from triton.tools.tensor_descriptor import TensorDescriptor

        hkv = k.shape[2]
        k_desc = TensorDescriptor(k, [n, hkv, opts.head_dim], [k.stride(0), k.stride(2), 1], [cfg.block_n, 1, block_d])
        v_desc = TensorDescriptor(v, [n, hkv, opts.head_dim], [v.stride(0), v.stride(2), 1], [cfg.block_n, 1, block_d])
    write_lse = lse is not None
    lse_t = lse if write_lse else out
    has_split = p.part_o is not None
    pdl = has_split and cfg.merge_pdl and _pdl_ok(q.device)
    # Per-row slot / page-table offsets once per loop when a key tile holds whole pages (else per-tile addressing).
    page_inv = bool(opts.paged and cfg.block_n % opts.page_size == 0)
    # Every argument positional, in parameter order (checked at import against _PREFILL_PARAMS): keyword
    # arguments cost Triton's launch path host time per call.
    args = (
        q,
        k,
        v,
        out,
        lse_t,
        p.part_o if has_split else out,
        p.part_lse if has_split else out,
        p.work,
        p.num_work,
        batch.kv_indices if opts.paged else dummy,
        batch.mask_packed if opts.has_custom_mask else dummy,
        batch.mask_indptr if opts.has_custom_mask else dummy,
        batch.alibi_slopes if alibi else dummy,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if write_lse else 0,
        lse.stride(1) if write_lse else 0,
        qk_scale,
        float(v_scale),
        float(opts.logits_soft_cap or 0.0) if softcap else 1.0,
        int(opts.window_left),
        1.0 / float(opts.rope_scale),
        math.log2(float(opts.rope_theta)),
        k_desc,
        v_desc,
        p.blocks if p.blocks is not None else dummy,
        opts.num_qo_heads,  # NUM_QO_HEADS
        opts.group_size,  # GROUP
        d,  # HEAD_DIM
        block_d,  # BLOCK_D
        cfg.block_m,  # BLOCK_M
        cfg.block_n,  # BLOCK_N
        p.tile_t,  # TILE_T
        bool(opts.paged),  # PAGED
        int(opts.page_size) if opts.paged else 1,  # PAGE_SIZE
        bool(opts.causal) and not opts.has_custom_mask,  # CAUSAL
        opts.window_left >= 0,  # WINDOW
        bool(opts.has_custom_mask),  # CUSTOM_MASK
        softcap,  # SOFTCAP
        alibi,  # ALIBI
        opts.pos_encoding_mode == "ROPE_LLAMA",  # ROPE
        write_lse,  # WRITE_LSE
        has_split,  # HAS_SPLIT
        dot_f32,  # DOT_F32
        k_desc is not None,  # USE_TMA
        # Bit offsets within a request's mask segment fit in int32 when the mask's whole buffer does (the
        # buffer, not this batch's slice: a CUDA-graph re-plan must not switch the captured kernel).
        bool(opts.has_custom_mask and batch.mask_packed.untyped_storage().nbytes() >= (1 << 28)),  # MASK_I64
        fold,  # FOLD_SCALE
        page_inv,  # PAGE_INV
        page_inv and k.stride(0) == v.stride(0) and k.stride(1) == v.stride(1),  # KV_SHARED
        # 32-bit offsets when K's and V's whole storages are under 2**31 elements (a view never reaches past
        # its storage; one size check per tensor instead of walking shapes and strides: host time per call).
        page_inv
        and k.untyped_storage().nbytes() < _INT32_LIMIT * k.element_size()
        and v.untyped_storage().nbytes() < _INT32_LIMIT * v.element_size(),  # KV_I32
        pdl,  # PDL_TRIGGER
    )
    grid = (p.grid0, opts.num_kv_heads)
    kernel = _prefill_kernel.run(*args, grid=grid, warmup=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if bind is not None and not want_tma:
        # (split: part_o / part_lse are the plan's, bound; the merge launch binds after this one)
        n_lead = 5 if has_split else 7
        bound = _bind(_prefill_kernel, kernel, args, grid, n_lead)
        if bound is not None:
            bind.append((bound, args[:n_lead]))
    if has_split:
        _launch_merge(_merge_partials_kernel, p, opts, out, lse, pdl, bind if bind and not want_tma else None)


def _launch_merge(kernel, p: PrefillPlan, opts, out, lse, pdl: bool, bind: list | None = None):
    """The partial-state merge of the split rows (PDL: a programmatic dependent of the attention launch).
    ``bind``: a list holding the attention launch's binding, which receives this launch bound to everything but
    out and lse (``(out, lse or out)``: the leading arguments of the call's that it takes)."""
    d = opts.head_dim
    block_d = max(16, _next_pow2(d))
    write_lse = lse is not None
    lse_t = lse if write_lse else out
    # 512 values per program ([128, 4] rows, one per thread of 4 warps): many programs for few query rows.
    block_h = min(_next_pow2(opts.num_qo_heads), max(1, 512 // block_d))
    args = (
        p.part_o,
        p.part_lse,
        p.merge,
        p.num_merge,
        out,
        lse_t,
        out.stride(0),
        out.stride(1),
        lse.stride(0) if write_lse else 0,
        lse.stride(1) if write_lse else 0,
        opts.num_qo_heads,  # NUM_QO_HEADS
        d,  # HEAD_DIM
        block_d,  # BLOCK_D
        block_h,  # BLOCK_H
        write_lse,  # WRITE_LSE
        pdl,  # PDL_WAIT
    )
    grid = (p.num_merge_host, _cdiv(opts.num_qo_heads, block_h))
    compiled = kernel.run(
        *args, grid=grid, warmup=False, num_warps=max(1, min(4, block_h * block_d // 128)), launch_pdl=pdl
    )
    if bind:  # (only after the attention launch bound)
        bound = _bind(kernel, compiled, args, grid, 2, first=4)
        if bound is not None:
            bind.append((bound, (out, lse_t)))


def _gluon_args_ok(opts, q, k, v, qk_scale: float) -> bool:
    """run()'s tensors fit the Gluon kernel's descriptors: [tokens, heads * D] views (heads adjacent, head dim
    contiguous), 16-byte aligned rows, K and V of q's dtype; a positive scale (folded into the exponent)."""
    if qk_scale <= 0.0 or k.dtype != q.dtype or v.dtype != q.dtype or k.shape[0] == 0:
        return False
    d = opts.head_dim
    if q.stride(2) != 1 or q.stride(1) != d or q.data_ptr() % 16 or (q.stride(0) * q.element_size()) % 16:
        return False
    if opts.paged:
        return _sm90.gluon_page_geometry(k, v, d) is not None
    for x in (k, v):  # [rows, 1, heads, D]
        if x.stride(3) != 1 or x.stride(2) != d or x.data_ptr() % 16 or (x.stride(0) * x.element_size()) % 16:
            return False
    return True


_GLUON_KERNEL: list = []
_GLUON_PERSIST: list = []
_GLUON_LAYOUTS: dict = {}


def _run_gluon(
    p: PrefillPlan,
    opts,
    batch,
    q,
    k,
    v,
    out,
    lse,
    qk_scale: float,
    gcfg: GluonPrefillConfig | None = None,
    bind: list | None = None,
):
    """The warp-specialized Gluon kernel over the plan's work list (split pieces into the partial rows).
    ``bind``: as :func:`run`'s (the leading arguments given as the descriptors' tensors: q, k, v, out, lse or
    out, then out, out without split pieces)."""
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    gcfg = gcfg or _config.GLUON_PREFILL
    if not _GLUON_KERNEL:
        from ._launch import FastKernel
        from .kernels.prefill_sm90 import _prefill_gluon_kernel

        _GLUON_KERNEL.append(FastKernel(_prefill_gluon_kernel))
    kern = _GLUON_KERNEL[0]
    g, d = opts.group_size, opts.head_dim
    tile_t = p.tile_t
    bn = p.config.block_n
    # (a TMA box has power-of-two sides: a paged tile of 40 or 24 tokens per head is copied in boxes of 8, one of 192
    # in boxes of 64)
    pow2 = tile_t & (tile_t - 1) == 0
    # (runs off the 8-row atom: the consumers load q themselves, the descriptor's box only sets the tile's layout)
    qb = tile_t & -tile_t if tile_t % 8 == 0 else 8
    lkey = (q.dtype, qb, bn, d)
    lay = _GLUON_LAYOUTS.get(lkey)
    if lay is None:
        from .kernels._sm90_common import kernel_layouts

        lay = _GLUON_LAYOUTS[lkey] = kernel_layouts("fp16" if q.dtype == torch.float16 else "bf16", qb, bn, d)
    q_lay, kv_lay = lay
    hq, hkv = opts.num_qo_heads, opts.num_kv_heads
    q_desc = TensorDescriptor(q, [q.shape[0], hq * d], [q.stride(0), 1], [qb, d], q_lay)
    if opts.paged:
        ps = opts.page_size
        rs, rows, cols, rpp, hr, hc = _sm90.gluon_page_geometry(k, v, d)
        pkey = ("page", q.dtype, ps, d)
        p_lay = _GLUON_LAYOUTS.get(pkey)
        if p_lay is None:
            from .kernels._sm90_common import kernel_layouts

            p_lay = _GLUON_LAYOUTS[pkey] = kernel_layouts("fp16" if q.dtype == torch.float16 else "bf16", ps, ps, d)[1]
        k_desc = TensorDescriptor(k, [rows, cols], [rs, 1], [ps, d], p_lay)
        v_desc = TensorDescriptor(v, [rows, cols], [rs, 1], [ps, d], p_lay)
        kv_indices = batch.kv_indices
    else:
        ps, rpp, hr, hc = 1, 0, 0, d
        n = k.shape[0] if p.kv_rows is None else min(k.shape[0], p.kv_rows)
        k_desc = TensorDescriptor(k, [n, hkv * d], [k.stride(0), 1], [bn, d], kv_lay)
        v_desc = TensorDescriptor(v, [n, hkv * d], [v.stride(0), 1], [bn, d], kv_lay)
        kv_indices = p.num_work  # (unused)
    write_lse = lse is not None
    # Three consumers where the plan's tile holds more than 128 rows (D64: 192 // group tokens); group 16 at D64
    # rounds down to 8 tokens, 128 rows, which two consumers cover.
    n_cons = 3 if tile_t * g > 128 else 2
    # Registers of the consumers / the loader warp (the loader's page-number loads need more than 24 at small pages,
    # and so do the query's boxes of 8 tokens): 2 x 128 x consumer + 128 x loader <= 64 K at 12 warps launched at
    # 168; three consumers, 16 warps launched at 128: 3 x 128 x consumer + 128 x loader <= 64 K.
    loader_regs = (32 if ps >= 16 and pow2 else 40) if opts.paged else (24 if pow2 else 32)
    if n_cons == 2:
        cons_regs = gcfg.consumer_regs if not (opts.paged and (ps < 16 or not pow2)) else 232
    else:
        cons_regs = 160 if loader_regs <= 32 else 152
    # Soft cap: the kernel takes tanh(s * sm_scale / cap) and scales it by cap x log2(e) (qk_scale is sm_scale then)
    softcap = opts.logits_soft_cap is not None and opts.logits_soft_cap > 0
    cap_scale = qk_scale / opts.logits_soft_cap if softcap else 1.0
    if softcap:
        qk_scale = float(opts.logits_soft_cap) * LOG2E
    args = (
        q_desc,
        k_desc,
        v_desc,
        out,
        lse if write_lse else out,
        q,  # q_ptr (runs off the 8-row swizzle atom: the consumers load their query rows through it)
        p.part_o if p.part_o is not None else out,
        p.part_lse if p.part_o is not None else out,
        p.work,
        p.num_work,
        kv_indices,
        rpp,
        hr,
        hc,
        out.stride(0),
        out.stride(1),
        lse.stride(0) if write_lse else 0,
        lse.stride(1) if write_lse else 0,
        qk_scale,
        cap_scale,
        opts.num_qo_heads,
        g,  # GROUP
        d,  # HEAD_DIM
        bn,  # BLOCK_N
        tile_t,  # TILE_T
        gcfg.stages(d),  # STAGES
        bool(opts.causal),  # CAUSAL
        softcap,  # SOFTCAP
        write_lse,  # WRITE_LSE
        # V rows past a range's end zeroed: CUDA-graph plans (descriptors over the whole buffers) and pages (a
        # last page's unwritten slots, the clamped pages of a tile past the last page)
        p.graph or bool(opts.paged),  # ZERO_V_TAIL
        p.part_o is not None,  # HAS_SPLIT
        bool(opts.paged),  # PAGED
        ps,  # PAGE_SIZE
        cons_regs,  # CONSUMER_REGS
        loader_regs,  # LOADER_REGS
        max(int(opts.window_left), 0),  # window_left
        opts.window_left >= 0,  # WINDOW
        n_cons,  # CONSUMERS
        q.stride(0),  # stride_qt (q_ptr's row stride)
    )
    grid = (p.grid0, hkv)
    # The output rows go out through shared memory with 16-byte stores (one-shot: the warpgroup's slice of the query
    # tile holds them; persistent: its half of the last tile's K buffer) where the staged rows have the query
    # tile's dtype; an output of another dtype is stored from the registers.
    epi_smem = out.dtype == q.dtype
    if p.persist_nprog:
        # The persistent grid on the plan's static schedule (two consumers: D128, and D256 for one request).
        if not _GLUON_PERSIST:
            from ._launch import FastKernel
            from .kernels.prefill_sm90_persist import _prefill_gluon_persist_kernel

            _GLUON_PERSIST.append(FastKernel(_prefill_gluon_persist_kernel))
        kern = _GLUON_PERSIST[0]
        # (the staged rows go through the last tile's K buffer: 128-key tiles, D128)
        args = args + (p.persist_cta, p.persist_units, epi_smem and bn == 128)
        grid = (p.persist_nprog,)
    else:
        args = args + (epi_smem,)  # EPI_SMEM
    kernel = kern.run(*args, grid=grid, warmup=False, num_warps=4, maxnreg=168 if n_cons == 2 else 128)
    if bind is not None:
        # (split: part_o / part_lse are the plan's, bound; the merge launch binds after this one)
        split = p.part_o is not None
        bound = _bind(kern, kernel, args, grid, 6 if split else 8)
        if bound is not None:
            leading = (q, k, v, out, args[4]) if split else (q, k, v, out, args[4], out, out)
            bind.append((_QTwice(bound), leading))


class _QTwice:
    """A bound launch of the Gluon prefill kernel taking the call's usual leading arguments (q, k, v, out, lse[,
    out, out]; ``_wrapper.RunBinding``): q's address goes to the kernel twice, as its descriptor's base and as
    ``q_ptr`` right after lse."""

    __slots__ = ("bound",)

    def __init__(self, bound):
        self.bound = bound

    def __call__(self, qp, kp, vp, op, lp, *rest) -> bool:
        return self.bound(qp, kp, vp, op, lp, qp, *rest)


_PREFILL_PARAMS = [
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "o_ptr",
    "lse_ptr",
    "part_o_ptr",
    "part_lse_ptr",
    "work_ptr",
    "num_work_ptr",
    "kv_indices_ptr",
    "mask_ptr",
    "mask_indptr_ptr",
    "alibi_ptr",
    "stride_qt",
    "stride_qh",
    "stride_kp",
    "stride_ks",
    "stride_kh",
    "stride_vp",
    "stride_vs",
    "stride_vh",
    "stride_ot",
    "stride_oh",
    "stride_lt",
    "stride_lh",
    "qk_scale",
    "v_scale",
    "soft_cap",
    "window_left",
    "rope_rcp_scale",
    "rope_log2_theta",
    "k_desc",
    "v_desc",
    "blk_ptr",
    "NUM_QO_HEADS",
    "GROUP",
    "HEAD_DIM",
    "BLOCK_D",
    "BLOCK_M",
    "BLOCK_N",
    "TILE_T",
    "PAGED",
    "PAGE_SIZE",
    "CAUSAL",
    "WINDOW",
    "CUSTOM_MASK",
    "SOFTCAP",
    "ALIBI",
    "ROPE",
    "WRITE_LSE",
    "HAS_SPLIT",
    "DOT_F32",
    "USE_TMA",
    "MASK_I64",
    "FOLD_SCALE",
    "PAGE_INV",
    "KV_SHARED",
    "KV_I32",
    "PDL_TRIGGER",
]
_MERGE_PARTIALS_PARAMS = [
    "part_o_ptr",
    "part_lse_ptr",
    "merge_ptr",
    "num_merge_ptr",
    "o_ptr",
    "lse_ptr",
    "stride_ot",
    "stride_oh",
    "stride_lt",
    "stride_lh",
    "NUM_QO_HEADS",
    "HEAD_DIM",
    "BLOCK_D",
    "BLOCK_H",
    "WRITE_LSE",
    "PDL_WAIT",
]
_KERNELS: list = []


def _load_kernels():
    """(_prefill_kernel, _merge_partials_kernel), imported on first use and kept; ``run`` passes their
    arguments positionally, so their parameter order is checked here once."""
    from .kernels.prefill import _merge_partials_kernel, _prefill_kernel

    if _prefill_kernel.arg_names != _PREFILL_PARAMS or _merge_partials_kernel.arg_names != _MERGE_PARTIALS_PARAMS:
        raise RuntimeError("the prefill kernels' parameters changed: update the positional launches in _prefill_impl")
    from ._launch import FastKernel

    _KERNELS[:] = [FastKernel(_prefill_kernel), FastKernel(_merge_partials_kernel)]
    return tuple(_KERNELS)


def _want_tma(cfg: PrefillConfig, opts: AttentionOptions, k: torch.Tensor, v: torch.Tensor, block_d: int) -> bool:
    """Tensor descriptors (TMA) for contiguous-row K/V: not paged, 16-byte aligned, power-of-two head dim of at
    most 256 (a TMA box dimension's limit)."""
    if cfg.use_tma is False or opts.paged or block_d != opts.head_dim or block_d > 256 or k.shape[0] == 0:
        return False
    if k.dtype not in (torch.float16, torch.bfloat16) or v.dtype != k.dtype:
        return False
    for x in (k, v):
        item = x.element_size()
        if x.data_ptr() % 16 or (x.stride(0) * item) % 16 or (x.stride(2) * item) % 16 or x.stride(3) != 1:
            return False
    if cfg.use_tma:
        return True
    return _capability(k.device)[0] >= 9


# K/V seen by an eager launch under PrefillConfig.tma_eager_min_flops (an engine's fresh K/V of new tokens never
# pays the descriptor encoding; a loop over the same buffers gets the faster kernel from its second call).
_TMA_SEEN: dict = {}


def _tma_pays(cfg: PrefillConfig, p: PrefillPlan, k: torch.Tensor, v: torch.Tensor) -> bool:
    if cfg.use_tma is not None or p.work_flops >= cfg.tma_eager_min_flops:
        return True
    if torch.cuda.is_current_stream_capturing():
        return True
    key = (k.data_ptr(), v.data_ptr(), k.shape, k.stride(), v.stride(), k.dtype)
    if key in _TMA_SEEN:
        return True
    if len(_TMA_SEEN) >= 256:
        _TMA_SEEN.clear()
    _TMA_SEEN[key] = True
    return False


_INT32_LIMIT = 2**31 - 1
