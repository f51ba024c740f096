"""vLLM's PagedAttention and cache API (``vllm._custom_ops``) on this library's kernels.

``paged_attention_v1`` / ``paged_attention_v2`` / ``reshape_and_cache`` / ``reshape_and_cache_flash`` /
``copy_blocks`` / ``swap_blocks`` / ``convert_fp8`` take vLLM's arguments and layouts and write their results in
place, as vLLM's CUDA ops do:

* ``query [num_seqs, num_heads, head_size]`` (one decode query per sequence; float16, bfloat16 or float32; any
  head size that is a multiple of 8 from 16 to 256, e.g. vLLM's 32, 64, 80, 96, 112, 120, 128, 192, 256), ``out``
  the same shape;
* ``key_cache [num_blocks, num_kv_heads, head_size / x, block_size, x]`` with ``x = 16 bytes / element``
  (4 for float32, 8 for fp16/bf16, 16 for fp8), ``value_cache [num_blocks, num_kv_heads, head_size, block_size]``
  (the inner dimensions contiguous; dimensions of size 1 may have any stride);
* ``block_tables int32 [num_seqs, max_blocks_per_seq]`` (token ``j`` of sequence ``b`` is in block
  ``block_tables[b, j // block_size]``, offset ``j % block_size``), ``seq_lens int32 [num_seqs]``;
* score ``s_j = scale * (q . k_j)`` (+ ``alibi_slopes[h] * (j - seq_len + 1)``), ``out = softmax(s) V``;
* v2 splits each sequence into 512-key partitions: ``max_logits[b, h, p] = max_j s_j``,
  ``exp_sums[b, h, p] = sum_j exp(s_j - max_logits)``, ``tmp_out[b, h, p] = partition output / exp_sums``
  (float32 sums, ``tmp_out`` in its own dtype), over the partitions ``p < ceil(seq_len / 512)``; the
  others (up to ``max_num_partitions = ceil(max_seq_len / 512)``) get ``-inf`` / ``0`` / ``0``.
* fp8 caches (``kv_cache_dtype`` ``"fp8"`` / ``"fp8_e4m3"`` -> float8_e4m3fn, ``"fp8_e5m2"``), stored as
  ``uint8`` (vLLM's allocation) or float8 tensors: the cache holds ``x / scale`` (``reshape_and_cache``),
  attention reads ``stored * scale``. ``k_scale`` / ``v_scale`` are numbers or one-element float32 tensors
  (read on the device, no host sync).

* ``reshape_and_cache_flash``: caches ``[num_blocks, block_size, num_kv_heads, head_size]`` (any strides with a
  contiguous last dimension, e.g. a permuted HND allocation); ``copy_blocks``: ``cache[dst] = cache[src]`` for every
  pair of ``block_mapping [n, 2]`` in every layer's caches; ``swap_blocks``: ``dst[d] = src[s]`` between devices
  (``block_mapping`` on the CPU, as vLLM requires); ``convert_fp8``: to / from fp8 bytes with a scale.

Bad indices (a block-table entry past the cache, a ``seq_lens`` entry past the block table or, for v2, past
``max_seq_len``, a slot or block number past the cache): CPU tensors are checked before anything is written
(ValueError naming the argument); on GPUs, where that check would cost a sync, the kernels check every index against
the cache's extent, skip the offending work (never reading or writing out of bounds), and record a device-side
error that ``flashinfer_triton.check_errors()`` raises (it reads the record: a sync), or a wrapper's ``plan()`` once
an asynchronous read of the record, which an earlier ``plan()`` enqueued, has landed (``_errors.py``; never a sync).

CUDA tensors (and CPU tensors under ``TRITON_INTERPRET=1``) run ``kernels/vllm_decode.py`` and
``kernels/vllm_cache.py``; other CPU tensors a PyTorch path.
"""

from __future__ import annotations

import math

import torch

from ._backend import use_triton
from ._checks import (
    check_last_dim_contiguous,
    check_shape,
    check_tensor,
    shape_str,
    type_error,
    value_error,
)
from ._errors import error_flag

PARTITION_SIZE = 512
BLOCK_SIZES = (8, 16, 32)
MAX_HEAD_SIZE = 256
_Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_FP8 = {
    "fp8": torch.float8_e4m3fn,
    "fp8_e4m3": torch.float8_e4m3fn,
    "fp8_e5m2": torch.float8_e5m2,
}
_FP8_MAX = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

__all__ = [
    "PARTITION_SIZE",
    "convert_fp8",
    "copy_blocks",
    "paged_attention_v1",
    "paged_attention_v2",
    "reshape_and_cache",
    "reshape_and_cache_flash",
    "swap_blocks",
]


def _cache_dtype(kv_cache_dtype, model_dtype: torch.dtype) -> torch.dtype:
    if not isinstance(kv_cache_dtype, str):
        raise type_error(
            "kv_cache_dtype", "a str ('auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2')", type(kv_cache_dtype).__name__
        )
    if kv_cache_dtype == "auto":
        return model_dtype
    if kv_cache_dtype in _FP8:
        return _FP8[kv_cache_dtype]
    raise value_error("kv_cache_dtype", "one of 'auto', 'fp8', 'fp8_e4m3', 'fp8_e5m2'", repr(kv_cache_dtype))


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _view_cache(name: str, cache: torch.Tensor, cache_dtype: torch.dtype, kv_cache_dtype: str) -> torch.Tensor:
    """The cache as a tensor of ``cache_dtype`` (fp8 caches may come as uint8, as vLLM allocates them)."""
    if cache.dtype == cache_dtype:
        return cache
    if cache_dtype in _FP8_MAX and cache.dtype == torch.uint8:
        return cache.view(cache_dtype)
    expected = _dtype_name(cache_dtype) + (" or uint8" if cache_dtype in _FP8_MAX else "")
    raise type_error(name, f"dtype {expected} (kv_cache_dtype={kv_cache_dtype!r})", _dtype_name(cache.dtype))


def _check_scale(name: str, value, device):
    """A finite number, or a one-element floating tensor on ``device`` (returned as float32 [1])."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise value_error(name, "a number or a one-element tensor", f"shape {shape_str(value.shape)}")
        if not value.dtype.is_floating_point:
            raise type_error(name, "a floating-point tensor", _dtype_name(value.dtype))
        if value.device != device:
            raise value_error(name, f"a tensor on {device} (the device of query)", f"one on {value.device}")
        return value.reshape(1).to(torch.float32)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, "a number or a one-element tensor", type(value).__name__)
    value = float(value)
    if not math.isfinite(value) or value <= 0:
        raise value_error(name, "a positive finite number", repr(value))
    return value


def _check_int(name: str, value, minimum: int = 0) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise value_error(name, f"an int >= {minimum}", repr(value))
    return value


_RUN_VLLM = []


def _run_vllm():
    """``_vllm_impl.run``, imported on first use (Triton is not imported for the PyTorch path) and kept (a
    function-level import costs ~0.5 us per call)."""
    if not _RUN_VLLM:
        from ._vllm_impl import run

        _RUN_VLLM.append(run)
    return _RUN_VLLM[0]


def _common_case_ok(
    out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
    max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
) -> bool:  # fmt: skip
    """True when the arguments are the common case and pass every check of ``_check_attention_args``:
    plain tensors, a 16-bit cache of the query's dtype, no ALiBi, float scales. Cheaper than those checks
    (host time per decode call); anything else (including every invalid argument) returns False and gets the
    full checks, which raise the errors."""
    T = torch.Tensor
    if not (
        type(query) is T and type(out) is T and type(key_cache) is T and type(value_cache) is T
        and type(block_tables) is T and type(seq_lens) is T and alibi_slopes is None and kv_cache_dtype == "auto"
        and type(scale) is float and type(k_scale) is float and type(v_scale) is float
        and type(num_kv_heads) is int and type(block_size) is int and type(max_seq_len) is int
    ):  # fmt: skip
        return False
    qshape = query.shape
    dtype = query.dtype
    device = query.device
    if len(qshape) != 3 or dtype not in _Q_DTYPES or block_size not in BLOCK_SIZES or num_kv_heads < 1:
        return False
    num_seqs, num_heads, head_size = qshape
    if (
        num_heads % num_kv_heads or head_size % 8 or not 16 <= head_size <= MAX_HEAD_SIZE or max_seq_len < 0
        or not (math.isfinite(scale) and 0 < k_scale < math.inf and 0 < v_scale < math.inf)
        or (query.stride(2) != 1 and query.numel() > 0)
        or out.shape != qshape or out.dtype != dtype or out.device != device or (out.stride(2) != 1 and out.numel() > 0)
        or key_cache.dtype != dtype or value_cache.dtype != dtype
        or key_cache.device != device or value_cache.device != device
    ):  # fmt: skip
        return False
    x = 16 // key_cache.element_size()
    kshape = key_cache.shape
    if len(kshape) != 5 or tuple(kshape[1:]) != (num_kv_heads, head_size // x, block_size, x):
        return False
    vshape = value_cache.shape
    if len(vshape) != 4 or tuple(vshape) != (kshape[0], num_kv_heads, head_size, block_size):
        return False
    ks = key_cache.stride()
    vs = value_cache.stride()
    if ks[4] != 1 or ks[3] != x or ks[2] != block_size * x or vs[3] != 1 or vs[2] != block_size:
        return False
    if vs[1] % block_size or vs[0] % block_size:
        return False
    bshape = block_tables.shape
    return (
        len(bshape) == 2 and bshape[0] == num_seqs and block_tables.dtype == torch.int32
        and block_tables.device == device and (block_tables.stride(1) == 1 or block_tables.numel() == 0)
        and seq_lens.shape == (num_seqs,) and seq_lens.dtype == torch.int32 and seq_lens.device == device
        and seq_lens.is_contiguous() and max_seq_len <= bshape[1] * block_size
    )  # fmt: skip


def _check_attention_args(
    out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
    max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
):  # fmt: skip
    """Validate vLLM's paged-attention arguments; returns (key_cache, value_cache, k_scale, v_scale, strides):
    ``strides`` the (key block, key head, value block, value head) strides for the kernel, with those of size-1
    dimensions (any stride is valid there) replaced by the contiguous ones, or None for the caches' own."""
    if _common_case_ok(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
    ):  # fmt: skip
        return key_cache, value_cache, k_scale, v_scale, None
    check_tensor("query", query, dim=3, dtypes=_Q_DTYPES)
    check_last_dim_contiguous("query", query)
    num_seqs, num_heads, head_size = query.shape
    device = query.device
    check_tensor("out", out, dim=3, dtypes=(query.dtype,), device=device)
    check_shape("out", out, tuple(query.shape), "of query")
    check_last_dim_contiguous("out", out)
    num_kv_heads = _check_int("num_kv_heads", num_kv_heads, 1)
    if num_heads % num_kv_heads != 0:
        raise value_error("num_kv_heads", f"a divisor of num_heads ({num_heads})", num_kv_heads)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(float(scale)):
        raise type_error("scale", "a finite number", type(scale).__name__)
    block_size = _check_int("block_size", block_size, 1)
    if block_size not in BLOCK_SIZES:
        raise value_error("block_size", "one of 8, 16, 32", block_size)
    if head_size % 8 != 0 or not 16 <= head_size <= MAX_HEAD_SIZE:
        raise value_error(
            "query", f"head_size a multiple of 8 from 16 to {MAX_HEAD_SIZE}", f"shape {shape_str(query.shape)}"
        )
    max_seq_len = _check_int("max_seq_len", max_seq_len, 0)

    cache_dtype = _cache_dtype(kv_cache_dtype, query.dtype)
    check_tensor("key_cache", key_cache, dim=5, device=device)
    check_tensor("value_cache", value_cache, dim=4, device=device)
    key_cache = _view_cache("key_cache", key_cache, cache_dtype, kv_cache_dtype)
    value_cache = _view_cache("value_cache", value_cache, cache_dtype, kv_cache_dtype)
    x = 16 // key_cache.element_size()
    if head_size % x != 0:
        raise value_error(
            "query", f"head_size a multiple of x = {x} (16 bytes of the cache dtype)", f"shape {shape_str(query.shape)}"
        )  # fmt: skip
    num_blocks = key_cache.shape[0]
    check_shape("key_cache", key_cache, (num_blocks, num_kv_heads, head_size // x, block_size, x),
                "[num_blocks, num_kv_heads, head_size / x, block_size, x]")  # fmt: skip
    check_shape("value_cache", value_cache, (num_blocks, num_kv_heads, head_size, block_size),
                "[num_blocks, num_kv_heads, head_size, block_size]")  # fmt: skip
    ks = key_cache.stride()
    if ks[4] != 1 or ks[3] != x or (ks[2] != block_size * x and head_size // x > 1):
        raise value_error(
            "key_cache", "contiguous [head_size / x, block_size, x] inner dimensions", f"strides {tuple(ks)}"
        )
    vs = value_cache.stride()
    # Dimensions of size 1 are never stepped over: their strides may be anything (the kernel gets contiguous ones).
    vb = vs[0] if num_blocks > 1 else num_kv_heads * head_size * block_size
    vh = vs[1] if num_kv_heads > 1 else head_size * block_size
    if vs[3] != 1 or vs[2] != block_size or vh % block_size or vb % block_size:
        raise value_error("value_cache", "a contiguous [head_size, block_size] inner layout", f"strides {tuple(vs)}")
    strides = (
        ks[0] if num_blocks > 1 else num_kv_heads * head_size * block_size,
        ks[1] if num_kv_heads > 1 else head_size * block_size,
        vb,
        vh,
    )

    check_tensor("block_tables", block_tables, dim=2, dtypes=(torch.int32,), device=device)
    if block_tables.shape[0] != num_seqs:
        raise value_error("block_tables", f"shape [num_seqs = {num_seqs}, max_blocks]", shape_str(block_tables.shape))
    check_last_dim_contiguous("block_tables", block_tables)
    check_tensor("seq_lens", seq_lens, dim=1, dtypes=(torch.int32,), device=device)
    check_shape("seq_lens", seq_lens, (num_seqs,), "[num_seqs]")
    if not seq_lens.is_contiguous():
        raise value_error("seq_lens", "a contiguous tensor", f"strides {tuple(seq_lens.stride())}")
    if max_seq_len > block_tables.shape[1] * block_size:
        raise value_error(
            "max_seq_len", f"at most max_blocks * block_size = {block_tables.shape[1] * block_size}", max_seq_len
        )
    if alibi_slopes is not None:
        check_tensor("alibi_slopes", alibi_slopes, dim=1, dtypes=(torch.float32,), device=device)
        check_shape("alibi_slopes", alibi_slopes, (num_heads,), "[num_heads]")
        if not alibi_slopes.is_contiguous():
            raise value_error("alibi_slopes", "a contiguous tensor", f"strides {tuple(alibi_slopes.stride())}")
    k_scale = _check_scale("k_scale", k_scale, device)
    v_scale = _check_scale("v_scale", v_scale, device)
    return key_cache, value_cache, k_scale, v_scale, strides


def _check_blocksparse(vert_stride) -> None:
    # vLLM's block-sparse attention (vert_stride > 1) is not implemented; its other parameters only matter with it.
    if isinstance(vert_stride, bool) or not isinstance(vert_stride, int) or vert_stride > 1:
        raise value_error("blocksparse_vert_stride", "0 or 1 (block-sparse attention is not implemented)",
                          repr(vert_stride))  # fmt: skip


def _check_tables_host(block_tables, seq_lens, block_size: int, num_blocks: int, max_len: int | None) -> None:
    """CPU tensors: every length within the block table (and ``max_len`` when given), every block-table entry a
    sequence uses within the cache; ValueError naming the argument, before anything is written."""
    lens = seq_lens.long()
    cap = block_tables.shape[1] * block_size
    bad = torch.nonzero((lens < 0) | (lens > cap)).flatten()
    if bad.numel():
        i = int(bad[0])
        raise value_error(
            "seq_lens", f"entries in [0, max_blocks * block_size = {cap}]", f"seq_lens[{i}] = {int(lens[i])}"
        )
    if max_len is not None:
        bad = torch.nonzero(lens > max_len).flatten()
        if bad.numel():
            i = int(bad[0])
            raise value_error("seq_lens", f"entries <= max_seq_len = {max_len}", f"seq_lens[{i}] = {int(lens[i])}")
    used = (
        torch.arange(block_tables.shape[1], device=lens.device)[None, :]
        < ((lens + block_size - 1) // block_size)[:, None]
    )
    bt = block_tables.long()
    bad = torch.nonzero(used & ((bt < 0) | (bt >= num_blocks)))
    if bad.numel():
        b, j = (int(v) for v in bad[0])
        raise value_error(
            "block_tables", f"entries in [0, num_blocks = {num_blocks}) for the blocks seq_lens uses",
            f"block_tables[{b}, {j}] = {int(bt[b, j])}",
        )  # fmt: skip


def paged_attention_v1(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale=1.0,
    v_scale=1.0,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """vLLM's v1 paged attention: one pass over each whole sequence, result written into ``out``. The
    ``blocksparse_*`` parameters (and ``tp_rank``, which only they use) are vLLM's block-sparse attention: only the
    dense case (``blocksparse_vert_stride <= 1``) is implemented, anything else is rejected."""
    _check_blocksparse(blocksparse_vert_stride)
    key_cache, value_cache, k_scale, v_scale, strides = _check_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
    )  # fmt: skip
    if query.device.type == "cpu":
        _check_tables_host(block_tables, seq_lens, block_size, key_cache.shape[0], None)
    if use_triton(query.device):
        run_vllm = _run_vllm()
        run_vllm(query, key_cache, value_cache, out, block_tables, seq_lens, num_kv_heads=num_kv_heads,
                 scale=float(scale), alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
                 partitioned=False, max_seq_len=int(max_seq_len), strides=strides)  # fmt: skip
    else:
        _torch_paged_attention(out, None, None, None, query, key_cache, value_cache, num_kv_heads, float(scale),
                               block_tables, seq_lens, alibi_slopes, k_scale, v_scale, 1)  # fmt: skip


def paged_attention_v2(
    out: torch.Tensor,
    exp_sums: torch.Tensor,
    max_logits: torch.Tensor,
    tmp_out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    num_kv_heads: int,
    scale: float,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    max_seq_len: int,
    alibi_slopes: torch.Tensor | None = None,
    kv_cache_dtype: str = "auto",
    k_scale=1.0,
    v_scale=1.0,
    tp_rank: int = 0,
    blocksparse_local_blocks: int = 0,
    blocksparse_vert_stride: int = 0,
    blocksparse_block_size: int = 64,
    blocksparse_head_sliding_step: int = 0,
) -> None:
    """vLLM's v2 paged attention: 512-key partitions (state in ``exp_sums`` / ``max_logits`` /
    ``tmp_out``), then their reduction into ``out``. ``blocksparse_*`` as in v1."""
    _check_blocksparse(blocksparse_vert_stride)
    key_cache, value_cache, k_scale, v_scale, strides = _check_attention_args(
        out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
        max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale,
    )  # fmt: skip
    num_seqs, num_heads, head_size = query.shape
    parts = max(1, -(-max_seq_len // PARTITION_SIZE))
    device = query.device
    if not _partition_buffers_ok(exp_sums, max_logits, tmp_out, num_seqs, num_heads, head_size, parts, device):
        _check_partition_buffers(exp_sums, max_logits, tmp_out, num_seqs, num_heads, head_size, parts, device)
    if device.type == "cpu":
        _check_tables_host(block_tables, seq_lens, block_size, key_cache.shape[0], parts * PARTITION_SIZE)
    if use_triton(device):
        run_vllm = _run_vllm()
        run_vllm(query, key_cache, value_cache, out, block_tables, seq_lens, num_kv_heads=num_kv_heads,
                 scale=float(scale), alibi_slopes=alibi_slopes, k_scale=k_scale, v_scale=v_scale,
                 partitioned=True, max_seq_len=int(max_seq_len), max_num_partitions=parts, exp_sums=exp_sums,
                 max_logits=max_logits, tmp_out=tmp_out, strides=strides)  # fmt: skip
    else:
        _torch_paged_attention(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                               float(scale), block_tables, seq_lens, alibi_slopes, k_scale, v_scale, parts)  # fmt: skip


_PART_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _partition_buffers_ok(exp_sums, max_logits, tmp_out, num_seqs, num_heads, head_size, parts, device) -> bool:
    """True when v2's partition buffers pass every check of ``_check_partition_buffers`` (cheaper; False for
    anything unusual, which then gets those checks and their errors)."""
    T = torch.Tensor
    if not (type(exp_sums) is T and type(max_logits) is T and type(tmp_out) is T):
        return False
    es, ml, ts = exp_sums.shape, max_logits.shape, tmp_out.shape
    return (
        len(es) == 3 and es[0] == num_seqs and es[1] == num_heads and es[2] >= parts
        and len(ml) == 3 and ml[0] == num_seqs and ml[1] == num_heads and ml[2] >= parts
        and len(ts) == 4 and ts[0] == num_seqs and ts[1] == num_heads and ts[2] >= parts and ts[3] == head_size
        and exp_sums.dtype == torch.float32 and max_logits.dtype == torch.float32 and tmp_out.dtype in _PART_DTYPES
        and exp_sums.device == device and max_logits.device == device and tmp_out.device == device
        and exp_sums.stride() == max_logits.stride()
        and (exp_sums.stride(2) == 1 or exp_sums.numel() == 0)
        and (max_logits.stride(2) == 1 or max_logits.numel() == 0)
        and (tmp_out.stride(3) == 1 or tmp_out.numel() == 0)
    )  # fmt: skip


def _check_partition_buffers(exp_sums, max_logits, tmp_out, num_seqs, num_heads, head_size, parts, device) -> None:
    """Validate v2's ``exp_sums`` / ``max_logits`` / ``tmp_out``; raises naming the argument."""
    for name, t in (("exp_sums", exp_sums), ("max_logits", max_logits)):
        check_tensor(name, t, dim=3, dtypes=(torch.float32,), device=device)
        if tuple(t.shape[:2]) != (num_seqs, num_heads) or t.shape[2] < parts:
            raise value_error(
                name, f"shape [num_seqs, num_heads, >= max_num_partitions] = [{num_seqs}, {num_heads}, >={parts}]",
                shape_str(t.shape),
            )  # fmt: skip
        check_last_dim_contiguous(name, t)
    if exp_sums.stride() != max_logits.stride():
        raise value_error(
            "max_logits", f"the strides of exp_sums {tuple(exp_sums.stride())}", tuple(max_logits.stride())
        )
    check_tensor("tmp_out", tmp_out, dim=4, dtypes=_PART_DTYPES, device=device)
    if tuple(tmp_out.shape[:2]) != (num_seqs, num_heads) or tmp_out.shape[2] < parts or tmp_out.shape[3] != head_size:
        raise value_error(
            "tmp_out",
            f"shape [num_seqs, num_heads, >= max_num_partitions, head_size] = [{num_seqs}, {num_heads}, >={parts}, "
            f"{head_size}]",
            shape_str(tmp_out.shape),
        )
    check_last_dim_contiguous("tmp_out", tmp_out)


def _host_scale(s) -> float:
    return float(s.item()) if isinstance(s, torch.Tensor) else float(s)


def _torch_paged_attention(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads,
                           scale, block_tables, seq_lens, alibi_slopes, k_scale, v_scale, parts):  # fmt: skip
    """PyTorch path (CPU without the interpreter): the same math, per sequence, in float32."""
    num_seqs, num_heads, head_size = query.shape
    block_size = value_cache.shape[-1]
    group = num_heads // num_kv_heads
    ks, vs = _host_scale(k_scale), _host_scale(v_scale)
    lens = seq_lens.tolist()
    for b in range(num_seqs):
        n = int(lens[b])
        q = query[b].float()  # [Hq, D]
        if n == 0:
            out[b].zero_()
            if exp_sums is not None:
                exp_sums[b, :, :parts] = 0.0
                max_logits[b, :, :parts] = float("-inf")
                tmp_out[b, :, :parts] = 0
            continue
        blocks = block_tables[b, : -(-n // block_size)].long()
        k = key_cache[blocks].float().permute(0, 3, 1, 2, 4).reshape(-1, num_kv_heads, head_size)[:n] * ks
        v = value_cache[blocks].float().permute(0, 3, 1, 2).reshape(-1, num_kv_heads, head_size)[:n] * vs
        k = k.repeat_interleave(group, dim=1)
        v = v.repeat_interleave(group, dim=1)
        s = torch.einsum("hd,nhd->hn", q, k) * scale  # [Hq, n]
        if alibi_slopes is not None:
            pos = torch.arange(n, device=q.device, dtype=torch.float32) - (n - 1)
            s = s + alibi_slopes.float()[:, None] * pos[None, :]
        if exp_sums is None:
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, dim=-1), v).to(out.dtype)
            continue
        ms, es, ts = [], [], []
        for p in range(parts):
            sp = s[:, p * PARTITION_SIZE : (p + 1) * PARTITION_SIZE]
            if sp.shape[1] == 0:
                ms.append(torch.full((num_heads,), float("-inf"), device=q.device))
                es.append(torch.zeros(num_heads, device=q.device))
                ts.append(torch.zeros(num_heads, head_size, device=q.device))
                continue
            m = sp.max(dim=1).values
            e = torch.exp(sp - m[:, None])
            ms.append(m)
            es.append(e.sum(dim=1))
            vp = v[p * PARTITION_SIZE : p * PARTITION_SIZE + sp.shape[1]]
            ts.append(torch.einsum("hn,nhd->hd", e, vp) / es[-1][:, None])
        m_all, e_all, t_all = torch.stack(ms, 1), torch.stack(es, 1), torch.stack(ts, 1)
        max_logits[b, :, :parts] = m_all
        exp_sums[b, :, :parts] = e_all
        tmp_out[b, :, :parts] = t_all.to(tmp_out.dtype)
        w = e_all * torch.exp(m_all - m_all.max(dim=1, keepdim=True).values)
        out[b] = (torch.einsum("hp,hpd->hd", w, t_all) / w.sum(dim=1, keepdim=True)).to(out.dtype)


def _check_kv_rows(key, value):
    """``key`` / ``value [num_tokens, num_kv_heads, head_size]`` (last dimension contiguous)."""
    check_tensor("key", key, dim=3, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    check_tensor("value", value, dim=3, dtypes=(key.dtype,), device=key.device)
    check_shape("value", value, tuple(key.shape), "of key")
    check_last_dim_contiguous("key", key)
    check_last_dim_contiguous("value", value)


def _check_slots(slot_mapping, num_tokens: int, num_slots: int, device) -> None:
    check_tensor("slot_mapping", slot_mapping, dim=1, dtypes=(torch.int32, torch.int64), device=device)
    check_shape("slot_mapping", slot_mapping, (num_tokens,), "[num_tokens]")
    if device.type == "cpu" and num_tokens:
        bad = torch.nonzero(slot_mapping >= num_slots).flatten()
        if bad.numel():
            i = int(bad[0])
            raise value_error(
                "slot_mapping", f"entries < num_blocks * block_size = {num_slots} (or < 0: skipped)",
                f"slot_mapping[{i}] = {int(slot_mapping[i])}",
            )  # fmt: skip


def _write_slots(key, value, kc, vc, slot_mapping, kv_cache_dtype, k_scale, v_scale, cache_dtype, strides, kx,
                 block_size, num_blocks):  # fmt: skip
    """Scatter token rows into slots; ``kc`` / ``vc`` strides ``strides = (kb, kh, kx_stride, ks, vb, vh, vd, vs)``
    address element ``d`` of token slot ``(blk, off)`` head ``h`` at ``blk*kb + h*kh + (d // kx)*kx_stride + off*ks +
    d % kx`` (keys) and ``blk*vb + h*vh + d*vd + off*vs`` (values)."""
    device = key.device
    k_scale = _check_scale("k_scale", k_scale, device)
    v_scale = _check_scale("v_scale", v_scale, device)
    fp8_max = _FP8_MAX.get(cache_dtype, 0.0)
    if use_triton(device):
        from .kernels.vllm_cache import launch_reshape_and_cache

        def as_tensor(s):
            return s if isinstance(s, torch.Tensor) else torch.full((1,), s, dtype=torch.float32, device=device)

        launch_reshape_and_cache(key, value, kc, vc, slot_mapping, as_tensor(k_scale), as_tensor(v_scale), fp8_max,
                                 strides, kx, block_size, num_blocks, error_flag(device))  # fmt: skip
        return
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    blk, off = slots // block_size, slots % block_size
    k, v = key[keep].float(), value[keep].float()
    if fp8_max:
        k = (k / _host_scale(k_scale)).clamp(-fp8_max, fp8_max)
        v = (v / _host_scale(v_scale)).clamp(-fp8_max, fp8_max)
    num_kv_heads, head_size = key.shape[1], key.shape[2]
    if kc.dim() == 5:  # vLLM's paged layout
        kc[blk, :, :, off, :] = k.reshape(-1, num_kv_heads, head_size // kx, kx).to(cache_dtype)
        vc[blk, :, :, off] = v.to(cache_dtype)
    else:  # [num_blocks, block_size, num_kv_heads, head_size]
        kc[blk, off] = k.to(cache_dtype)
        vc[blk, off] = v.to(cache_dtype)


def reshape_and_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale=1.0,
    v_scale=1.0,
) -> None:
    """Write ``key / value [num_tokens, num_kv_heads, head_size]`` token ``t`` into slot
    ``slot_mapping[t]`` of vLLM's caches (block ``slot // block_size``, offset ``slot % block_size``);
    slots ``< 0`` are skipped. fp8 caches store ``x / scale`` (saturated to the format's finite range)."""
    _check_kv_rows(key, value)
    device = key.device
    num_tokens, num_kv_heads, head_size = key.shape
    cache_dtype = _cache_dtype(kv_cache_dtype, key.dtype)
    check_tensor("key_cache", key_cache, dim=5, device=device)
    check_tensor("value_cache", value_cache, dim=4, device=device)
    key_cache = _view_cache("key_cache", key_cache, cache_dtype, kv_cache_dtype)
    value_cache = _view_cache("value_cache", value_cache, cache_dtype, kv_cache_dtype)
    x = 16 // key_cache.element_size()
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[3]
    if head_size % x != 0:
        raise value_error("key", f"head_size a multiple of x = {x}", f"shape {shape_str(key.shape)}")
    check_shape("key_cache", key_cache, (num_blocks, num_kv_heads, head_size // x, block_size, x),
                "[num_blocks, num_kv_heads, head_size / x, block_size, x]")  # fmt: skip
    check_shape("value_cache", value_cache, (num_blocks, num_kv_heads, head_size, block_size),
                "[num_blocks, num_kv_heads, head_size, block_size]")  # fmt: skip
    check_last_dim_contiguous("key_cache", key_cache)
    _check_slots(slot_mapping, num_tokens, num_blocks * block_size, device)
    ks, vs = key_cache.stride(), value_cache.stride()
    _write_slots(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, cache_dtype,
                 (ks[0], ks[1], ks[2], ks[3], vs[0], vs[1], vs[2], vs[3]), x, block_size, num_blocks)  # fmt: skip


def reshape_and_cache_flash(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_cache_dtype: str = "auto",
    k_scale=1.0,
    v_scale=1.0,
) -> None:
    """``reshape_and_cache`` for the flash layout: ``key_cache`` / ``value_cache [num_blocks, block_size,
    num_kv_heads, head_size]`` (any strides with a contiguous last dimension: NHD, or an HND allocation viewed as
    NHD). Slots ``< 0`` are skipped; fp8 caches store ``x / scale``."""
    _check_kv_rows(key, value)
    device = key.device
    num_tokens, num_kv_heads, head_size = key.shape
    cache_dtype = _cache_dtype(kv_cache_dtype, key.dtype)
    check_tensor("key_cache", key_cache, dim=4, device=device)
    check_tensor("value_cache", value_cache, dim=4, device=device)
    key_cache = _view_cache("key_cache", key_cache, cache_dtype, kv_cache_dtype)
    value_cache = _view_cache("value_cache", value_cache, cache_dtype, kv_cache_dtype)
    num_blocks, block_size = key_cache.shape[0], key_cache.shape[1]
    shape = (num_blocks, block_size, num_kv_heads, head_size)
    check_shape("key_cache", key_cache, shape, "[num_blocks, block_size, num_kv_heads, head_size]")
    check_shape("value_cache", value_cache, shape, "[num_blocks, block_size, num_kv_heads, head_size]")
    check_last_dim_contiguous("key_cache", key_cache)
    check_last_dim_contiguous("value_cache", value_cache)
    _check_slots(slot_mapping, num_tokens, num_blocks * block_size, device)
    ks, vs = key_cache.stride(), value_cache.stride()
    # As the paged layout with one key chunk of head_size (chunk stride unused) and unit value element stride.
    _write_slots(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale, cache_dtype,
                 (ks[0], ks[2], 0, ks[1], vs[0], vs[2], 1, vs[1]), 0, block_size, num_blocks)  # fmt: skip


def _check_block_mapping(block_mapping, device, num_src: int, num_dst: int) -> None:
    check_tensor("block_mapping", block_mapping, dim=2, dtypes=(torch.int64, torch.int32), device=device)
    if block_mapping.shape[1] != 2:
        raise value_error("block_mapping", "shape [num_pairs, 2]", shape_str(block_mapping.shape))
    if block_mapping.device.type == "cpu" and block_mapping.numel():
        src, dst = block_mapping[:, 0], block_mapping[:, 1]
        for col, bound, what in ((src, num_src, "source"), (dst, num_dst, "destination")):
            bad = torch.nonzero((col < 0) | (col >= bound)).flatten()
            if bad.numel():
                i = int(bad[0])
                raise value_error(
                    "block_mapping", f"{what} blocks in [0, {bound})", f"{what} block {int(col[i])} in pair {i}"
                )


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def copy_blocks(key_caches, value_caches, block_mapping: torch.Tensor) -> None:
    """For every pair ``(src, dst)`` of ``block_mapping [num_pairs, 2]`` (int64, on the caches' device) and every
    layer: ``key_caches[l][dst] = key_caches[l][src]``, the same for ``value_caches`` (vLLM's copy-on-write of
    blocks). Every cache is ``[num_blocks, ...]`` with each block contiguous."""
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        if not isinstance(caches, (list, tuple)) or not all(isinstance(c, torch.Tensor) for c in caches):
            raise type_error(name, "a list of tensors", type(caches).__name__)
    if len(key_caches) != len(value_caches):
        raise value_error("value_caches", f"{len(key_caches)} tensors (as key_caches)", len(value_caches))
    if not key_caches:
        return
    device = key_caches[0].device
    num_blocks = key_caches[0].shape[0]
    for name, caches in (("key_caches", key_caches), ("value_caches", value_caches)):
        for i, c in enumerate(caches):
            check_tensor(f"{name}[{i}]", c, device=device)
            if c.dim() < 1 or c.shape[0] != num_blocks:
                raise value_error(f"{name}[{i}]", f"shape [num_blocks = {num_blocks}, ...]", shape_str(c.shape))
            if not c[0].is_contiguous():
                raise value_error(f"{name}[{i}]", "contiguous blocks", f"strides {tuple(c.stride())}")
    _check_block_mapping(block_mapping, device, num_blocks, num_blocks)
    if block_mapping.shape[0] == 0:
        return
    caches = list(key_caches) + list(value_caches)
    if use_triton(device):
        from .kernels.vllm_cache import launch_copy_blocks

        flag = error_flag(device)
        for c in caches:
            launch_copy_blocks(c.view(_INT_VIEW[c.element_size()]), block_mapping, flag)
        return
    src, dst = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    for c in caches:
        c[dst] = c[src]


def swap_blocks(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    """``dst[d] = src[s]`` for every pair ``(s, d)`` of ``block_mapping [num_pairs, 2]`` (int64 on the CPU, as vLLM
    requires, so the block numbers are checked on the host): GPU to CPU, CPU to GPU or within one GPU."""
    check_tensor("src", src)
    check_tensor("dst", dst)
    if src.dtype != dst.dtype:
        raise type_error("dst", f"dtype {_dtype_name(src.dtype)} (that of src)", _dtype_name(dst.dtype))
    if src.dim() < 1 or tuple(dst.shape[1:]) != tuple(src.shape[1:]):
        raise value_error("dst", f"blocks of shape {shape_str(src.shape[1:])} (those of src)", shape_str(dst.shape))
    if src.device.type == dst.device.type == "cuda" and src.device != dst.device:
        raise value_error("dst", f"a tensor on {src.device} (that of src) or on the CPU", f"one on {dst.device}")
    if not isinstance(block_mapping, torch.Tensor) or block_mapping.device.type != "cpu":
        raise value_error("block_mapping", "a tensor on the CPU", getattr(block_mapping, "device", type(block_mapping)))
    _check_block_mapping(block_mapping, torch.device("cpu"), src.shape[0], dst.shape[0])
    if block_mapping.shape[0] == 0:
        return
    s_idx, d_idx = block_mapping[:, 0].long(), block_mapping[:, 1].long()
    blocks = src.index_select(0, s_idx.to(src.device)).to(dst.device)
    dst.index_copy_(0, d_idx.to(dst.device), blocks)


def convert_fp8(output: torch.Tensor, input: torch.Tensor, scale: float = 1.0, kv_dtype: str = "fp8") -> None:
    """vLLM's fp8 cache conversion: into an fp8 (or uint8) ``output``, ``fp8(input / scale)`` saturated to the
    format's finite range; from an fp8 (or uint8) ``input``, ``input * scale`` in ``output``'s dtype. ``kv_dtype``
    names the fp8 format ('fp8' / 'fp8_e4m3': e4m3, 'fp8_e5m2')."""
    check_tensor("output", output)
    check_tensor("input", input, device=output.device)
    check_shape("input", input, tuple(output.shape), "of output")
    if not isinstance(kv_dtype, str) or kv_dtype not in _FP8:
        raise value_error("kv_dtype", "one of 'fp8', 'fp8_e4m3', 'fp8_e5m2'", repr(kv_dtype))
    fp8 = _FP8[kv_dtype]
    s = float(scale)
    if not math.isfinite(s) or s <= 0:
        raise value_error("scale", "a positive finite number", repr(scale))
    floats = (torch.float16, torch.bfloat16, torch.float32)
    if output.dtype in (torch.uint8, fp8) and input.dtype in floats:
        q = (input.float() / s).clamp(-_FP8_MAX[fp8], _FP8_MAX[fp8]).to(fp8)
        output.copy_(q.view(output.dtype) if output.dtype == torch.uint8 else q)
    elif input.dtype in (torch.uint8, fp8) and output.dtype in floats:
        raw = input.view(fp8) if input.dtype == torch.uint8 else input
        output.copy_((raw.float() * s).to(output.dtype))
    else:
        raise type_error(
            "output",
            f"fp8/uint8 from a float input, or a float output from fp8/uint8 (input {_dtype_name(input.dtype)})",
            _dtype_name(output.dtype),
        )  # fmt: skip
