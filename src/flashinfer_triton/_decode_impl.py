"""Triton batch decode (one query per request): the ``_backend`` contract's ``supports / plan / run``.

``plan()`` (host) turns the lengths into a work list: each request's visible keys (the sliding window
trims the front) are cut into chunks when the batch alone cannot fill the GPU (flash-decoding). Work
item ``w`` = (request, key start, key end, split flag), stored as four int32 rows of a device array,
followed by the per-request work ``indptr`` that the merge reads and the live work count.
``run()`` (device only) launches ``kernels/decode.py`` on a grid ``(work items, KV heads)``; split
requests write partial states into the float workspace (row ``w``) and the last chunk of a request to
finish merges them into ``out`` / ``lse`` in the same launch (an arrival counter per request and KV head).
Unsplit requests are written directly.

CUDA-graph mode (``ws.cuda_graph``): the work array lives at fixed offsets of ``ws.int_buffer``, the
grid is ``(max_batch_size + max extra chunks, KV heads)`` whatever the lengths, programs past the live
work count exit at once, and the fused merge reads each request's state count from the work list. A graph
captured after one ``plan()`` therefore replays correctly after another ``plan()`` with other lengths and page
counts.

Split-size rule (``_config.DecodeConfig``): with ``B * Hkv`` programs already covering ``split_min_waves`` x
SMs no split; otherwise the chunk is the total visible key count over ``split_target_waves`` x SMs programs (at
least ``min_chunk`` keys, rounded up to the key tile). ``fixed_split_size`` (in pages, as
FlashInfer's, tokens when not paged) forces the chunk; ``disable_split_kv`` turns splitting off.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from typing import ClassVar

import numpy as np
import torch
import triton.language as tl

from . import _backend, _config, _sm90
from ._backend import AttentionBatch, AttentionOptions, Workspace
from ._config import DecodeConfig
from ._config import cdiv as _cdiv
from ._config import next_pow2 as _np2
from ._config import num_sms as _num_sms
from ._launch import FastKernel, hooks_set, stand_in_pointer
from ._launch import bind as _bind
from .kernels.decode import _decode_kernel as _decode_jit
from .kernels.decode_work import _decode_work_kernel as _work_jit

_decode_kernel = FastKernel(_decode_jit)
_work_kernel = FastKernel(_work_jit)
_SUM, _MAX = np.add.reduce, np.maximum.reduce  # (ufunc reductions: no Python wrapper per call)
RUN_BINDS = True  # run() takes ``bind`` (the wrapper keeps the bound launch for calls of the same form)

# The decode launches pass every argument positionally (Triton binds keyword arguments by name at a cost of
# ~3 us of host time per launch), so they depend on this parameter order of _decode_kernel.
_DECODE_PARAMS = [
    "q_ptr",
    "k_ptr",
    "v_ptr",
    "o_ptr",
    "lse_ptr",
    "part_o_ptr",
    "part_lse_ptr",
    "kv_indptr_ptr",
    "kv_indices_ptr",
    "kv_lens_ptr",
    "alibi_ptr",
    "rope_freq_ptr",
    "work_ptr",
    "num_work_ptr",
    "stride_qb",
    "stride_qh",
    "stride_kp",
    "stride_ks",
    "stride_kh",
    "stride_vp",
    "stride_vs",
    "stride_vh",
    "stride_ob",
    "stride_oh",
    "stride_lb",
    "stride_lh",
    "work_cap",
    "qk_scale",
    "soft_cap",
    "v_scale",
    "NUM_QO_HEADS",
    "GROUP",
    "BLOCK_M",
    "HEAD_DIM",
    "BLOCK_D",
    "BLOCK_N",
    "PAGE_SIZE",
    "PAGED",
    "USE_DOT",
    "SOFT_CAP",
    "POS_MODE",
    "HAS_LSE",
    "CHECK_NUM_WORK",
    "COMPUTE_DTYPE",
    "INTERPRET",
    "k_scale_ptr",
    "v_scale_ptr",
    "counter_ptr",
    "SCALE_PTRS",
    "FUSED_MERGE",
    "MERGE_BLOCK_K",
    "GROUP_P2",
    "WHOLE_TILES",
]
if tuple(_decode_kernel.arg_names) != tuple(_DECODE_PARAMS):
    raise RuntimeError("_decode_kernel's parameters changed: update the positional launches in _decode_impl")


_GLUON_KERNEL: list = []
_GLUON_GEOMS: dict = {}  # (cache shape, strides, dtypes, alignment, page size, head dim) -> descriptor geometry or None
_GLUON_DESC_CLS: list = []

_POS_MODES = {"NONE": 0, "ROPE_LLAMA": 1, "ALIBI": 2}
_Q_DTYPES = (torch.float16, torch.bfloat16)
_FP8 = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_TL_DTYPE = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16}


def supports(opts: AttentionOptions) -> bool:
    """True for the decode variants these kernels cover."""
    return (
        opts.is_decode
        and not opts.has_custom_mask
        and opts.q_dtype in _Q_DTYPES
        and (opts.kv_dtype == opts.q_dtype or opts.kv_dtype in _FP8)
        and opts.o_dtype in (torch.float16, torch.bfloat16, torch.float32)
        and opts.head_dim % 16 == 0
        and 16 <= opts.head_dim <= 512
        # Over 256, a GQA group over 64 would need 256 KB of shared memory for the output tile alone: the prefill
        # kernel (which takes decode batches) runs those.
        and (opts.head_dim <= 256 or opts.num_qo_heads <= 64 * opts.num_kv_heads)
        and opts.num_kv_heads > 0
        and opts.num_qo_heads % opts.num_kv_heads == 0
        and opts.pos_encoding_mode in _POS_MODES
        and opts.page_size >= 1
    )


def choose_config(opts: AttentionOptions) -> DecodeConfig:
    """Tile shapes as a function of the shapes (no autotuning: the interpreter cannot); the planner's rules and
    the Gluon kernel's settings at their defaults."""
    group = opts.group_size
    block_d = _np2(opts.head_dim)
    # tl.dot (group padded to 16 rows) also for group 1: its K/V loads are software-pipelined (cp.async),
    # the broadcast-reduce path's are not (checked in the compiled PTX).
    # Head dims over 256 (a 512-wide tile): 16-key tiles keep three stages of K and V at 96 KB of shared memory
    # (32-key tiles would take 192 KB, beside the query tile).
    block_n = 64 if block_d <= 128 else (32 if block_d <= 256 else 16)
    block_m = max(16, _np2(group))
    num_warps = 4 if block_d <= 128 else 8
    return DecodeConfig(block_n, block_m, block_d, True, num_warps, 3, gluon=_config.GLUON_DECODE)


@dataclass
class DecodePlan:
    batch_size: int
    work: torch.Tensor  # int32 [4 * work_cap + batch_cap + 2] on the device
    work_cap: int  # grid size along axis 0
    batch_cap: int  # merge rows
    # live work items (host copy; None after a CUDA-graph re-plan whose work list the device built: the count is
    # then only in ``num_work_dev``)
    num_work: int | None
    work_indptr: torch.Tensor  # int32 [batch_cap + 1] view into ``work``
    num_work_dev: torch.Tensor  # int32 [1] view into ``work``
    needs_merge: bool
    part_o: torch.Tensor | None  # float32 [work_cap, Hq, D]
    part_lse: torch.Tensor | None  # float32 [work_cap, Hq]
    rope_freq: torch.Tensor | None
    config: DecodeConfig
    chunk: int | None
    graph: bool
    max_chunks: int  # tile hint for the merge (fixed in CUDA-graph mode)
    dummy: torch.Tensor  # float32 [1]: stands in for absent float pointers (never dereferenced)
    counters: torch.Tensor | None = None  # int32 [batch_cap * Hkv], zero between launches (fused merge)
    fused: bool = False  # split requests present: the launch merges them (FUSED_MERGE)
    merge_block_k: int = 1
    group_p2: int = 1
    gluon: bool = False  # the Gluon kernel (Hopper), when run()'s tensors fit it (_gluon_descs)
    # Host-side fields that run() never reads (the kernels read the work list and its live count on the device):
    # a re-plan that changes only these keeps the previous plan's bound launch (``_wrapper._same_state``).
    BINDING_IGNORES: ClassVar[tuple] = ("batch_size", "num_work", "chunk", "max_chunks")


def _chunk_size(opts, cfg: DecodeConfig, lens_eff, num_requests, sms, waves=None) -> int | None:
    """Keys per split chunk, or None for no split (``lens_eff``: an int array or a list of ints; ``waves``:
    programs per SM aimed at, ``cfg.split_target_waves`` when None)."""
    return _split_rule(opts, cfg, lens_eff, num_requests, sms, waves)[0]


def _split_rule(opts, cfg: DecodeConfig, lens_eff, num_requests, sms, waves=None) -> tuple:
    """(:func:`_chunk_size`, the total of ``lens_eff`` when it was summed, else None)."""
    if opts.disable_split_kv:
        return None, None
    if opts.fixed_split_size is not None and opts.fixed_split_size > 0:
        return int(opts.fixed_split_size) * (opts.page_size if opts.paged else 1), None
    if num_requests * opts.num_kv_heads >= cfg.split_min_waves * sms:
        return None, None
    small = type(lens_eff) is list or len(lens_eff) <= _SMALL_SUMS  # (a few dozen requests: sums on Python ints)
    vals = (lens_eff if type(lens_eff) is list else lens_eff.tolist()) if small else None
    total = sum(vals) if small else int(_SUM(lens_eff))
    if total == 0:
        return None, total
    waves = cfg.split_target_waves if waves is None else waves
    chunk = max(cfg.min_chunk, math.ceil(total * opts.num_kv_heads / (waves * sms)))
    chunk = _cdiv(chunk, cfg.block_n) * cfg.block_n
    if chunk >= (max(vals) if small else int(_MAX(lens_eff))):
        return None, total
    return chunk, total


def _work_size(work_cap: int, batch_cap: int, n_counters: int) -> int:
    """int32 entries of the work array (see ``_work_host``)."""
    return 4 * work_cap + batch_cap + 2 + n_counters


# Split work lists of at most this many requests and work slots are built on Python ints (a loop per item: past
# a few hundred items numpy's array operations are the cheaper)
_SMALL_SPLIT, _SMALL_WORK = 16, 256
# The split rule sums the lengths of at most this many requests on Python ints: ``tolist()``, ``sum`` and ``max``
# cost 1.1 us at 32 against 2.1 for two numpy reductions at any size (development CPU; even at 64)
_SMALL_SUMS = 64


def _work_host(bsz, work_cap, batch_cap, n_counters, starts, lens, lens_eff, chunk, align=0, out=None):
    """The work array on the host: req | start | end | split rows (``work_cap`` each), work_indptr
    [batch_cap + 1], live count, then the fused merge's arrival counters (zero: each launch's last chunk
    resets its own). Returns (array, live work items, most chunks of one request).

    With ``align`` (the key tile; 0 under ``fixed_split_size``: exact chunks) a split request's chunks are evened
    out: same count as chunks of ``chunk`` keys, each ``ceil(len / count)`` rounded up to ``align`` but at most
    ``chunk``.

    ``out``: an int32 host array of ``_work_size(...)`` entries, all zero, written in place (the caller
    packs the work array beside other arrays for one host-to-device copy).

    ``starts``, ``lens`` and ``lens_eff`` are int64 arrays (``starts`` 0 without a window), or all three lists of
    Python ints (``starts`` 0 or a list), which take the loop on Python ints whatever the batch size."""
    cnt0 = 4 * work_cap + batch_cap + 2
    host = np.zeros(cnt0 + n_counters, dtype=np.int32) if out is None else out
    ind0 = 4 * work_cap
    if chunk is None:
        # One work item per request (the common, unsplit case): no per-item gathers.
        num_work, max_chunks_live = bsz, 1
        ar = np.arange(bsz + 1, dtype=np.int32)
        host[0:bsz] = ar[:bsz]
        host[work_cap : work_cap + bsz] = starts
        host[2 * work_cap : 2 * work_cap + bsz] = lens
        host[ind0 : ind0 + bsz + 1] = ar
    elif type(lens) is list or (0 < bsz <= _SMALL_SPLIT and work_cap <= _SMALL_WORK):
        # A few requests (an engine's small decode batch split for the GPU's SMs): the same items on Python
        # ints, a loop of a few dozen steps against some twenty numpy operations on tiny arrays. (Lists: a small
        # table's lengths, see ``replan_graph``.)
        if type(lens) is not list:
            starts = starts if type(starts) is int else starts.tolist()
            lens, lens_eff = lens.tolist(), lens_eff.tolist()
        return _work_small(bsz, work_cap, batch_cap, starts, lens, lens_eff, chunk, align, host)
    else:
        n_chunks = _chunks_of(lens_eff, chunk)
        # (ufuncs and array methods: numpy's function forms add a Python wrapper's host time per call)
        work_indptr = np.zeros(bsz + 1, dtype=np.int64)
        np.add.accumulate(n_chunks, out=work_indptr[1:])
        num_work = int(work_indptr[-1])
        max_chunks_live = int(_MAX(n_chunks, initial=1))
        req = np.arange(bsz, dtype=np.int64).repeat(n_chunks)
        local = np.arange(num_work, dtype=np.int64) - work_indptr[req]
        if align:
            even = -(-lens_eff // n_chunks)
            size_r = np.minimum(-(-even // align) * align, chunk)[req]
        else:
            size_r = chunk
        w_start = local * size_r
        if type(starts) is not int:
            w_start += starts[req]
        host[0:num_work] = req
        host[work_cap : work_cap + num_work] = w_start
        host[2 * work_cap : 2 * work_cap + num_work] = np.minimum(w_start + size_r, lens[req])
        host[3 * work_cap : 3 * work_cap + num_work] = n_chunks[req] > 1
        host[ind0 : ind0 + bsz + 1] = work_indptr
    host[ind0 + bsz + 1 : ind0 + batch_cap + 1] = num_work
    host[ind0 + batch_cap + 1] = num_work
    return host, num_work, max_chunks_live


def _work_small(bsz, work_cap, batch_cap, starts, lens: list, lens_eff: list, chunk: int, align: int, host):
    """``_work_host``'s split work list of a few requests, on Python ints: ``starts`` an int (0, no window) or a
    list, ``lens`` and ``lens_eff`` lists; ``host`` zeroed. The same array as the numpy path's, value for value.

    Each request's items are written per request, not per item: a request of ``c`` chunks of ``size`` keys
    (``chunk`` evened out, see ``_work_host``) covers ``c * size >= lens_eff`` keys while its first ``c - 1``
    chunks end inside it (``(c - 1) * size <= (c - 1) * chunk < lens_eff``), so only its last item ends at the
    request's end; its starts and ends are ranges."""
    # (lists of the live items only: ``host`` is zero past them, and converting a list into a numpy array costs
    # ~40 ns an entry, so a list of every slot cost more than the loop)
    req_l, start_w, end_w, flag_w = [], [], [], []
    ind = [0]
    k, most = 0, 1
    for r in range(bsz):
        eff = lens_eff[r]
        ws = starts if type(starts) is int else starts[r]
        c = (eff + chunk - 1) // chunk
        if c <= 1:  # one item, the whole request (at least one, also for no keys)
            req_l.append(r)
            start_w.append(ws)
            end_w.append(lens[r])
            flag_w.append(0)
            k += 1
        else:
            size = chunk
            if align:  # the chunks evened out: ceil(len / c) rounded up to the key tile, at most ``chunk``
                even = -(-eff // c)
                size = -(-even // align) * align
                if size > chunk:
                    size = chunk
            stop = ws + c * size
            req_l += [r] * c
            start_w += range(ws, stop, size)
            end_w += range(ws + size, stop, size)
            end_w.append(lens[r])
            flag_w += [1] * c
            k += c
            if c > most:
                most = c
        ind.append(k)
    # the four rows' live items, then work_indptr and the live count in one assignment
    host[0:k] = req_l
    host[work_cap : work_cap + k] = start_w
    host[2 * work_cap : 2 * work_cap + k] = end_w
    host[3 * work_cap : 3 * work_cap + k] = flag_w
    ind += [k] * (batch_cap - bsz + 1)
    host[4 * work_cap : 4 * work_cap + batch_cap + 2] = ind
    return host, k, most


def _visible(opts: AttentionOptions, lens):
    """(first visible key, visible key count) of each request: the sliding window trims the front; without one
    the first key is 0 for all (an int: ``_work_host`` takes either). ``lens``: an int array, or a list of ints
    (then lists)."""
    if opts.window_left is not None and opts.window_left >= 0:
        if type(lens) is list:
            starts = [max(n - 1 - opts.window_left, 0) for n in lens]
            return starts, [n - s for n, s in zip(lens, starts)]
        starts = np.maximum(lens - 1 - opts.window_left, 0)
        return starts, lens - starts
    return 0, lens


def _split_waves(opts: AttentionOptions, device: torch.device, cfg: DecodeConfig) -> float:
    """Programs per SM the split rule aims at: the Gluon kernel's for plans it may run."""
    return cfg.gluon.split_waves if _gluon_candidate(opts, device, cfg) else cfg.split_target_waves


def _align(opts: AttentionOptions, cfg: DecodeConfig) -> int:
    """The chunk alignment that evens out a split request's chunks (0: exact chunks, see ``_work_host``)."""
    return 0 if opts.fixed_split_size else cfg.block_n


def _graph_chunk(opts, cfg: DecodeConfig, lens_eff, bsz, sms, extra, waves=None):
    """The split chunk in CUDA-graph mode: the chunks must fit the ``extra`` work slots fixed at capture."""
    block_n = cfg.block_n
    chunk, total = _split_rule(opts, cfg, lens_eff, bsz, sms, waves)
    if chunk is not None and extra == 0:
        return None
    if chunk is not None:
        if total is None:
            total = sum(lens_eff) if type(lens_eff) is list else int(_SUM(lens_eff))
        # (rounded up to the key tile: chunks then start on page boundaries, which the Gluon kernel's page copies need)
        chunk = max(chunk, _cdiv(math.ceil(total / extra), block_n) * block_n)
    return chunk


# (a weak reference to the plan object, options, device, (SMs, split waves, merge counters, chunk alignment)) of the
# last re-plan: one tuple, replaced whole (threads never see a mixed entry). Weak: a plan holds views of its
# wrapper's workspace buffers, which must go with the wrapper, not stay until another plan is re-planned.
_REPLAN_LAST: list = [(type(None), None, None, None)]  # (type(None)() is None: no plan yet)


def _replan_fixed(p: DecodePlan, opts: AttentionOptions, device: torch.device) -> tuple:
    """(SMs, split waves, merge counters, chunk alignment): what a re-plan reads besides the lengths, fixed with
    the plan object, kept for the last one."""
    last = _REPLAN_LAST[0]
    if last[0]() is p and last[1] is opts and last[2] is device:
        return last[3]
    fixed = (
        _num_sms(device),
        _split_waves(opts, device, p.config),
        p.counters.numel() if p.counters is not None else 0,
        _align(opts, p.config),
    )
    _REPLAN_LAST[0] = (weakref.ref(p), opts, device, fixed)
    return fixed


def graph_chunk(p: DecodePlan, opts: AttentionOptions, lens, device: torch.device) -> int | None:
    """The split chunk of a CUDA-graph re-plan of ``p`` for these KV lengths (an int array or a list of ints),
    None for no split: what :func:`replan_graph` plans with, for a caller that builds the work list on the device
    (:class:`DeviceWorkList`)."""
    sms, waves, _, _ = _replan_fixed(p, opts, device)
    lens_eff = _visible(opts, lens)[1]
    return _graph_chunk(opts, p.config, lens_eff, p.batch_size, sms, p.work_cap - p.batch_cap, waves)


def replan_graph(
    p: DecodePlan, opts: AttentionOptions, lens, device: torch.device, out: np.ndarray | None = None
) -> None:
    """CUDA-graph re-plan with the options and batch capacity of ``p`` (the wrapper checked both): only
    the work list changes, rewritten in place at the same address (the fast path of an engine's step).
    ``lens``: the KV lengths, an int64 array or (a small table's) a list of ints, planned on Python ints.

    ``out``: a zeroed int32 host array of ``p.work.numel()`` entries to write the work list into; the
    caller then copies it to ``p.work`` (with its own arrays, in one copy). Without it the copy is made here."""
    starts, lens_eff = _visible(opts, lens)
    sms, waves, n_counters, align = _replan_fixed(p, opts, device)
    chunk = _graph_chunk(opts, p.config, lens_eff, p.batch_size, sms, p.work_cap - p.batch_cap, waves)
    if type(lens) is list and chunk is not None and len(lens) > _SMALL_SPLIT:
        # (the split rule's sums run on the lists at any size; past a few requests numpy builds the work list faster)
        lens, lens_eff = np.array(lens, dtype=np.int64), np.array(lens_eff, dtype=np.int64)
        starts = starts if type(starts) is int else np.array(starts, dtype=np.int64)
    host, num_work, _ = _work_host(
        p.batch_size, p.work_cap, p.batch_cap, n_counters, starts, lens, lens_eff, chunk, align, out
    )
    if out is None:
        p.work.copy_(torch.from_numpy(host), non_blocking=True)
    p.num_work = num_work
    p.chunk = chunk


def builds_work_on_device(device: torch.device) -> bool:
    """Whether a CUDA-graph plan on ``device`` builds its work list on the device (:class:`DeviceWorkList`): on a
    GPU, and on the CPU under the interpreter; on the CPU otherwise (the planner's host-path benchmarks and tests
    on CPU tensors) nothing runs the kernel, so the host writes it (:func:`replan_graph`)."""
    return device.type != "cpu" or _backend._INTERPRET


# page indices copied per program of the work-list launch (its programs past the first)
_COPY_BLOCK = 2048


class DeviceWorkList:
    """The work list of a CUDA-graph plan built on the device (``kernels/decode_work.py``) from the plan's staged KV
    lengths, given the split chunk the host chose (:func:`graph_chunk`): the same array :func:`replan_graph`
    writes, without the host's work per request and per item (~1 us a request on Python ints on the development
    CPU, ~30 numpy operations past a few requests). The same launch refills the caller's ``indptr`` and
    ``last_page_len`` buffers from the stage and copies the page indices into the caller's buffer, where a plan
    made a copy call besides (a view and a foreach copy: ~16 us of host time on the H100 machine).

    Kept with the plan's layout; the launch is bound at the first call (every argument but the page indices, their
    count and the chunk is fixed with the layout), so a re-plan pays one bound launch (a few us of host time).
    Called after the copy that stages the arrays, on the same stream; the work array's four rows, ``work_indptr``
    and live count are written whole (the merge counters after them are not touched)."""

    __slots__ = ("args", "dst", "options", "bound")

    def __init__(self, p: DecodePlan, opts: AttentionOptions, kv_lens, stage_ip, stage_lp, buf_ip, buf_lp, idx_buf):
        window = opts.window_left if opts.window_left is not None and opts.window_left >= 0 else -1
        self.args = [idx_buf, 0, 0, idx_buf, kv_lens, p.work, stage_ip, stage_lp, buf_ip, buf_lp, p.batch_size]
        self.args += [p.work_cap, p.batch_cap, window, _align(opts, p.config)]
        # BLOCK_B: every request, and the slots of indptr and of the live count past them; BLOCK_W; BLOCK_C
        self.args += [_np2(p.batch_cap + 1), 128, _COPY_BLOCK]
        self.dst = idx_buf
        # program 0 holds some ten int64 values of each request in registers: 4 warps take 255 registers a thread at
        # 1024 requests and spill at 2048 (ptxas, sm_90); 128 requests a warp keep it at 128 or fewer, no spills
        self.options = {"num_warps": min(16, max(4, self.args[-3] // 128))}
        self.bound = None  # the bound launch after the first call (False: it could not bind; the general launch)

    def __call__(self, chunk: int | None, indices: torch.Tensor | None, n_copy: int) -> None:
        """Launch for this plan: ``chunk`` (None: no split); ``indices``: page indices on the buffer's device whose
        first ``n_copy`` are copied into it (None: nothing to copy)."""
        c = 0 if chunk is None else chunk
        src = self.dst if indices is None else indices
        grid0 = 1 + (n_copy + _COPY_BLOCK - 1) // _COPY_BLOCK
        # The rules of the library's other bound launches (``_row_forms.BoundForms``): the bound launch keeps the
        # 16-byte alignment of the indices it was bound with, and is neither taken nor made while the short path is
        # off or a launch hook (a profiler) is set, which then see every launch through Triton's launcher
        ptr = src.data_ptr()
        aligned = not ptr & 15
        fast = _config.HOST_PATH.fast_launch and not hooks_set()
        b = self.bound
        # (the address as an int, as the other bound launches pass theirs: Triton's launcher takes it as it is,
        # where a tensor costs a data_ptr() call and a pointer-attribute query)
        if b and aligned and fast and b.over(grid0, ptr, n_copy, c):
            return
        args = self.args
        args[0], args[1], args[2] = src, n_copy, c
        dev = self.dst.device
        if dev.type == "cuda" and torch.cuda.current_device() != dev.index:
            # (another current device: Triton launches on the current device's stream, torch's copies on the
            # tensors' device's, where the staging copy was queued; a plan() made only torch calls before)
            with torch.cuda.device(dev):
                kernel = _work_kernel.run(*args, grid=(grid0,), warmup=False, **self.options)
        else:
            kernel = _work_kernel.run(*args, grid=(grid0,), warmup=False, **self.options)
        if b is None and aligned and fast:
            self.bound = _bind(_work_kernel, kernel, args, (grid0,), 3) or False
        args[0] = self.dst  # (the caller's tensor is not kept)


def eager_layout(opts: AttentionOptions, lens: np.ndarray, float_bytes: int, device: torch.device, cfg: DecodeConfig):
    """Eager mode (no CUDA graph): the split decision for these lengths (int64 host array) and the shape
    of the work array, without building it: ``(starts, lens_eff, chunk, work_cap, n_counters, align)``."""
    bsz = len(lens)
    starts, lens_eff = _visible(opts, lens)
    part_row_bytes = opts.num_qo_heads * (opts.head_dim + 1) * 4
    max_slots = float_bytes // part_row_bytes
    chunk = _chunk_size(opts, cfg, lens_eff, bsz, _num_sms(device), _split_waves(opts, device, cfg))
    if chunk is not None and max_slots < bsz + 1:
        chunk = None
    work_cap = bsz
    if chunk is not None:
        work_cap = sum(_chunk_list(lens_eff, chunk)) if bsz <= _SMALL_SPLIT else int(_SUM(_chunks_of(lens_eff, chunk)))
        if work_cap > max_slots:
            if opts.fixed_split_size:
                raise ValueError(
                    f"fixed_split_size: {work_cap} partial states of {part_row_bytes} bytes do not fit in "
                    f"the float workspace of {float_bytes} bytes"
                )
            # (rounded up to the key tile: chunks start on page boundaries, as the Gluon kernel's page copies need)
            chunk = max(chunk, _cdiv(math.ceil(int(lens_eff.sum()) / (max_slots - bsz)), cfg.block_n) * cfg.block_n)
            work_cap = (
                sum(_chunk_list(lens_eff, chunk)) if bsz <= _SMALL_SPLIT else int(_SUM(_chunks_of(lens_eff, chunk)))
            )
    n_counters = bsz * opts.num_kv_heads
    return starts, lens_eff, chunk, work_cap, n_counters, _align(opts, cfg)


_CHUNKS_LAST: list = [(None, 0, None)]  # (lens_eff array, chunk, its chunk counts) of the last _chunks_of


_CHUNK_LIST_LAST: list = [(None, 0, None)]  # the same for _chunk_list


def _chunk_list(lens_eff: np.ndarray, chunk: int) -> list:
    """:func:`_chunks_of` as a list of Python ints, for a few requests (``tolist()`` and a short loop cost less than
    numpy's operations on an array of a few entries); kept the same way for the same array object and chunk."""
    last = _CHUNK_LIST_LAST[0]
    if last[0] is lens_eff and last[1] == chunk:
        return last[2]
    got = [(c if c > 1 else 1) for c in [(x + chunk - 1) // chunk for x in lens_eff.tolist()]]
    _CHUNK_LIST_LAST[0] = (lens_eff, chunk, got)
    return got


def _chunks_of(lens_eff: np.ndarray, chunk: int) -> np.ndarray:
    """Chunks of each request (at least 1): ``max(ceil(lens_eff / chunk), 1)``. The last answer is kept for the
    same array object and chunk: a plan asks twice (its layout, then its work list)."""
    # (one tuple, replaced whole: threads never see a mixed entry; it holds the array, so no other takes its id)
    last = _CHUNKS_LAST[0]
    if last[0] is lens_eff and last[1] == chunk:
        return last[2]
    got = np.maximum((lens_eff + chunk - 1) // chunk, 1)
    _CHUNKS_LAST[0] = (lens_eff, chunk, got)
    return got


def partial_views(float_buffer: torch.Tensor, work_cap: int, hq: int, d: int):
    """float32 ``[work_cap, Hq, D]`` partial values and ``[work_cap, Hq]`` lse at the start of the float
    workspace."""
    fb = float_buffer.view(torch.uint8)
    part_o = fb[: work_cap * hq * d * 4].view(torch.float32).view(work_cap, hq, d)
    part_lse = fb[work_cap * hq * d * 4 : work_cap * hq * (d + 1) * 4].view(torch.float32).view(work_cap, hq)
    return part_o, part_lse


def plan_from_work(
    opts: AttentionOptions,
    cfg: DecodeConfig,
    work: torch.Tensor,
    *,
    bsz: int,
    work_cap: int,
    batch_cap: int,
    n_counters: int,
    num_work: int,
    max_chunks_live: int,
    chunk: int | None,
    graph: bool,
    float_buffer: torch.Tensor,
    rope_freq: torch.Tensor | None,
    device: torch.device,
    work_parts: tuple | None = None,
    part_views: dict | None = None,
) -> DecodePlan:
    """The plan around a work array already on the device (``_work_size`` int32 entries); ``work_parts``: its
    four parts (work items, work indptr, live count, counters) when the caller split them already;
    ``part_views``: a dict the caller keeps per float workspace, caching the partial-state views by shape."""
    if work_parts is None:
        work_parts = work.split_with_sizes((4 * work_cap, batch_cap + 1, 1, n_counters))
    _, work_indptr, num_work_dev, counters = work_parts
    needs_merge = (graph and work_cap > batch_cap) or max_chunks_live > 1
    max_chunks = 16 if graph else max_chunks_live
    group_p2 = _np2(opts.group_size)
    merge_block_k = max(1, min(_np2(max_chunks), cfg.merge_max_k, cfg.merge_tile // (group_p2 * cfg.block_d)))
    part_o = part_lse = None
    if needs_merge:
        hq, d = opts.num_qo_heads, opts.head_dim
        if part_views is not None:  # the caller's cache of these views (six view operations: ~15 us of host)
            key = (work_cap, hq, d)
            got = part_views.get(key)
            if got is None:
                got = part_views[key] = partial_views(float_buffer, work_cap, hq, d)
            part_o, part_lse = got
        else:
            part_o, part_lse = partial_views(float_buffer, work_cap, hq, d)
    return DecodePlan(
        batch_size=bsz,
        work=work,
        work_cap=work_cap,
        batch_cap=batch_cap,
        num_work=num_work,
        work_indptr=work_indptr,
        num_work_dev=num_work_dev,
        needs_merge=needs_merge,
        part_o=part_o,
        part_lse=part_lse,
        rope_freq=rope_freq,
        config=cfg,
        chunk=chunk,
        graph=graph,
        max_chunks=max_chunks,
        dummy=stand_in_pointer(device),
        counters=counters,
        fused=needs_merge,
        merge_block_k=merge_block_k,
        group_p2=group_p2,
        gluon=_gluon_use(opts, cfg, device, chunk, graph, bsz),
    )


def _gluon_use(opts: AttentionOptions, cfg: DecodeConfig, device: torch.device, chunk, graph: bool, bsz: int) -> bool:
    """Whether a plan runs the Gluon kernel: a variant it covers, a key tile of whole pages (split chunks then start
    on page boundaries), and with ``plans="split"`` a split plan, a batch of ``bsz`` requests left whole with one
    to ``split_min_waves`` programs per SM, a head dim of ``all_plans_head_dims`` or any CUDA-graph plan (the
    kernel captured serves every later re-plan, split or not)."""
    g = cfg.gluon
    if g.plans == "all" or chunk is not None or graph or opts.head_dim in g.all_plans_head_dims:
        return cfg.block_n % opts.page_size == 0 and _gluon_candidate(opts, device, cfg)
    sms = _num_sms(device)
    return (
        sms <= bsz * opts.num_kv_heads < cfg.split_min_waves * sms
        and cfg.block_n % opts.page_size == 0
        and _gluon_candidate(opts, device, cfg)
    )


_CANDIDATE_LAST: list = [(None, None, None, False)]  # (opts, device, cfg, answer) of the last question


def _gluon_candidate(opts: AttentionOptions, device: torch.device, cfg: DecodeConfig) -> bool:
    """Variants the Gluon decode kernel covers, on an sm_90 GPU: pages of 8-64 keys, fp16 / bf16 q = K/V, the
    head dims of its configuration, at most 64 query heads per KV head, no RoPE / ALiBi / soft cap / window, the
    fused merge.

    Every plan asks twice with the same (immutable) options, configuration and device objects: the last answer
    is kept for them."""
    last = _CANDIDATE_LAST[0]  # (one tuple, replaced whole: threads never see a mixed entry)
    if last[0] is opts and last[1] is device and last[2] is cfg:
        return last[3]
    ok = _gluon_variant(opts, device, cfg)
    _CANDIDATE_LAST[0] = (opts, device, cfg, ok)
    return ok


def _gluon_variant(opts: AttentionOptions, device: torch.device, cfg: DecodeConfig) -> bool:
    g = cfg.gluon
    if g.plans == "none" or _backend._INTERPRET or device.type != "cuda":
        return False
    if opts.head_dim not in g.head_dims:
        return False
    if not opts.paged or opts.page_size not in g.page_sizes or opts.page_size > g.tile(opts.head_dim)[0]:
        return False
    if opts.q_dtype not in _Q_DTYPES or opts.kv_dtype != opts.q_dtype:
        return False
    if opts.group_size > 64 or opts.pos_encoding_mode != "NONE" or opts.has_custom_mask:
        return False
    if (opts.logits_soft_cap or 0.0) > 0.0 or opts.window_left >= 0 or not opts.sm_scale > 0.0:
        return False
    return _sm90.gluon_device_ok(device)


def _gluon_descs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, opts: AttentionOptions):
    """(K descriptor, V descriptor, rows per page, head row step, head column step) of run()'s caches as the Gluon
    kernel's 2-D page descriptors (``_sm90.gluon_page_geometry``), or None when they do not fit. The geometry
    and shared layout are worked out once per cache form (shape, strides, dtype: an engine passes the same cache
    every step); the descriptors are made per call (they hold the tensors: a cached one would keep a freed cache
    alive)."""
    key = (k.shape, v.shape, k.stride(), v.stride(), k.dtype, v.dtype, k.data_ptr() % 16, v.data_ptr() % 16,
           opts.page_size, opts.head_dim)  # fmt: skip
    got = _GLUON_GEOMS.get(key, False)
    if got is False:
        got = None
        if k.dtype == v.dtype and k.shape[0] > 0:
            geom = _sm90.gluon_page_geometry(k, v, opts.head_dim)
            if geom is not None:
                from .kernels._sm90_common import kernel_layouts

                d, ps = opts.head_dim, opts.page_size
                lay = kernel_layouts("fp16" if k.dtype == torch.float16 else "bf16", ps, ps, d)[1]
                got = (*geom, lay, [ps, d])
        if len(_GLUON_GEOMS) >= 64:
            _GLUON_GEOMS.clear()
        _GLUON_GEOMS[key] = got
    if got is None:
        return None
    rs, rows, cols, rpp, hr, hc, lay, block = got
    desc = _tensor_descriptor()
    return desc(k, [rows, cols], [rs, 1], block, lay), desc(v, [rows, cols], [rs, 1], block, lay), rpp, hr, hc


def _tensor_descriptor():
    """Gluon's Hopper TensorDescriptor class (imported on first use)."""
    if not _GLUON_DESC_CLS:
        from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

        _GLUON_DESC_CLS.append(TensorDescriptor)
    return _GLUON_DESC_CLS[0]


def _run_gluon(p: DecodePlan, opts, batch, q, k, v, out, lse, qk_scale: float, descs, bind: list | None = None) -> None:
    """The Gluon decode kernel over the plan's work list (split pieces merged in the same launch). ``bind``: as
    :func:`run`'s (the leading arguments given as q, k, v, out, lse: the descriptors' tensors)."""
    if not _GLUON_KERNEL:
        from .kernels.decode_sm90 import _decode_gluon_kernel

        _GLUON_KERNEL.append(FastKernel(_decode_gluon_kernel))
    g = p.config.gluon
    block_n, stages, maxnreg = g.tile(opts.head_dim)
    k_desc, v_desc, rpp, hr, hc = descs
    write_lse = lse is not None
    part_o = p.part_o if p.part_o is not None else out
    args = (
        q,
        k_desc,
        v_desc,
        out,
        lse if write_lse else out,
        part_o,
        p.part_lse if p.part_lse is not None else part_o,
        p.counters if p.counters is not None else p.work,
        p.work,
        p.num_work_dev,
        batch.kv_indptr,
        batch.kv_indices,
        batch.kv_lens,
        rpp,
        hr,
        hc,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        lse.stride(0) if write_lse else 0,
        lse.stride(1) if write_lse else 0,
        p.work_cap,
        qk_scale,
        opts.num_qo_heads,  # NUM_QO_HEADS
        opts.group_size,  # GROUP
        p.group_p2,  # GROUP_P2
        opts.head_dim,  # HEAD_DIM
        block_n,  # BLOCK_N
        stages,  # STAGES
        opts.page_size,  # PAGE_SIZE
        write_lse,  # WRITE_LSE
        p.merge_block_k,  # MERGE_BLOCK_K
        g.loader_regs,  # LOADER_REGS
    )
    grid = (p.work_cap, opts.num_kv_heads)
    kernel = _GLUON_KERNEL[0].run(*args, grid=grid, warmup=False, num_warps=4, maxnreg=maxnreg)
    if bind is not None:
        bound = _bind(_GLUON_KERNEL[0], kernel, args, grid, 5)
        if bound is not None:
            bind.append((bound, (q, k, v, out, args[4])))


def plan(
    opts: AttentionOptions, batch: AttentionBatch, ws: Workspace, *, config: DecodeConfig | None = None
) -> DecodePlan:
    """Host side: work list (with split-KV chunks) copied to the device; see the module docstring. ``config``:
    the tiles and rules to use (default ``choose_config(opts)``)."""
    device = batch.device
    cfg = config or choose_config(opts)
    bsz = batch.batch_size
    lens = batch.kv_lens_host.numpy().reshape(-1)[:bsz].astype(np.int64, copy=False)
    float_bytes = ws.float_buffer.numel() * ws.float_buffer.element_size()

    if ws.cuda_graph:
        p = graph_layout(opts, cfg, ws, device, bsz)
        replan_graph(p, opts, lens, device)
        return p
    starts, lens_eff, chunk, work_cap, n_counters, align = eager_layout(opts, lens, float_bytes, device, cfg)
    host, num_work, max_chunks_live = _work_host(bsz, work_cap, bsz, n_counters, starts, lens, lens_eff, chunk, align)
    # From pageable memory: CUDA stages the bytes before the call returns (so ``host`` may be freed) and
    # does not wait for the device; measured cheaper on the host than a pinned buffer (docs/host-path.md).
    work = torch.from_numpy(host).to(device, non_blocking=True)
    return plan_from_work(
        opts,
        cfg,
        work,
        bsz=bsz,
        work_cap=work_cap,
        batch_cap=bsz,
        n_counters=n_counters,
        num_work=num_work,
        max_chunks_live=max_chunks_live,
        chunk=chunk,
        graph=False,
        float_buffer=ws.float_buffer,
        rope_freq=_rope_freq(opts, device) if opts.pos_encoding_mode == "ROPE_LLAMA" else None,
        device=device,
    )


def graph_layout(
    opts: AttentionOptions, cfg: DecodeConfig, ws: Workspace, device: torch.device, bsz: int
) -> DecodePlan:
    """CUDA-graph mode: the plan's fixed layout, whatever the lengths (work slots for ``max_batch_size`` requests
    and the extra chunks the split may make, the work array at the start of ``ws.int_buffer``, the RoPE
    frequencies after it); its work list is written by :func:`replan_graph` at every plan()."""
    float_bytes = ws.float_buffer.numel() * ws.float_buffer.element_size()
    sms = _num_sms(device)
    max_slots = float_bytes // (opts.num_qo_heads * (opts.head_dim + 1) * 4)
    batch_cap = int(ws.max_batch_size if ws.max_batch_size is not None else bsz)
    if bsz > batch_cap:
        raise ValueError(f"batch_size: expected at most max_batch_size = {batch_cap}, got {bsz}")
    extra = 0 if opts.disable_split_kv else math.ceil(cfg.split_target_waves * sms / opts.num_kv_heads)
    if batch_cap + extra > max_slots:
        extra = max(0, max_slots - batch_cap)
    work_cap = batch_cap + extra
    n_counters = batch_cap * opts.num_kv_heads
    nbytes = 4 * _work_size(work_cap, batch_cap, n_counters)
    freq_bytes = (opts.head_dim // 2) * 4 if opts.pos_encoding_mode == "ROPE_LLAMA" else 0
    int_bytes = ws.int_buffer.numel() * ws.int_buffer.element_size()
    if nbytes + freq_bytes > int_bytes:
        raise ValueError(
            f"int_workspace_buffer: {nbytes + freq_bytes} bytes needed for {work_cap} work items, got {int_bytes}"
        )
    work = ws.int_buffer.view(torch.uint8)[:nbytes].view(torch.int32)
    rope_freq = None
    if freq_bytes:
        rope_freq = ws.int_buffer.view(torch.uint8)[nbytes : nbytes + freq_bytes].view(torch.float32)
        rope_freq.copy_(_rope_freq(opts, device))
    return plan_from_work(
        opts,
        cfg,
        work,
        bsz=bsz,
        work_cap=work_cap,
        batch_cap=batch_cap,
        n_counters=n_counters,
        num_work=0,
        max_chunks_live=1,
        chunk=None,
        graph=True,
        float_buffer=ws.float_buffer,
        rope_freq=rope_freq,
        device=device,
    )


def _rope_freq(opts: AttentionOptions, device) -> torch.Tensor:
    """Frequencies computed exactly as the reference computes them (same float32 expression)."""
    d = opts.head_dim
    t = torch.arange(d // 2, dtype=torch.float32, device=device)
    return (opts.rope_theta ** (-2.0 * t / d) / opts.rope_scale).to(torch.float32)


def run(
    plan_obj: DecodePlan,
    opts: AttentionOptions,
    batch: AttentionBatch,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor | None,
    *,
    qk_scale_mult: float = 1.0,
    v_scale: float = 1.0,
    bind: list | None = None,
) -> None:
    """Device only: ``out [B, Hq, D]`` and ``lse [B, Hq]`` (base 2) when not None. No host sync.

    ``bind``: a list that receives the launch bound to everything but q, k, v, out and lse (``_launch.bind``)
    when this plan's run is one launch of the short path; the caller keeps it for later calls whose tensors
    have the same shapes, strides, dtypes and alignment."""
    p = plan_obj
    cfg = p.config
    if p.work_cap == 0:
        return
    if p.gluon and q.stride(2) == 1:
        qk_scale = float(opts.sm_scale) * float(qk_scale_mult) * 1.4426950408889634
        if qk_scale > 0.0 and v_scale == 1.0 and q.dtype == k.dtype:
            descs = _gluon_descs(q, k, v, opts)
            if descs is not None:
                _run_gluon(p, opts, batch, q, k, v, out, lse, qk_scale, descs, bind)
                return
    pos_mode = _POS_MODES[opts.pos_encoding_mode]
    dummy = p.dummy
    part_o = p.part_o if p.part_o is not None else dummy
    part_lse = p.part_lse if p.part_lse is not None else dummy
    compute = tl.float32 if _backend._INTERPRET else _TL_DTYPE[q.dtype]
    cap = float(opts.logits_soft_cap or 0.0)
    # Whole tiles (with the register cap) only where they compile without spills (offline sm_90): no RoPE,
    # 16-bit KV, head_dim 64 or 128 (timed on the GPU: D128 fp16 / bf16, the decode table). Capped at 128,
    # RoPE spills 128-136 B and fp8 KV 88-96 B; those keep the all-masked kernel, uncapped.
    whole = cfg.whole_tiles and pos_mode != 1 and k.element_size() >= 2 and opts.head_dim in (64, 128)
    # Every argument positional, in the kernel's parameter order (checked at import: _DECODE_PARAMS):
    # keyword arguments cost Triton's launch path ~3 us of host time per call (binding by name).
    args = [
        q,
        k,
        v,
        out,
        lse if lse is not None else dummy,
        part_o,
        part_lse,
        batch.kv_indptr,
        batch.kv_indices if batch.kv_indices is not None else batch.kv_indptr,
        batch.kv_lens,
        batch.alibi_slopes if (pos_mode == 2 and batch.alibi_slopes is not None) else dummy,
        p.rope_freq if p.rope_freq is not None else dummy,
        p.work,
        p.num_work_dev,
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
        lse.stride(0) if lse is not None else 0,
        lse.stride(1) if lse is not None else 0,
        p.work_cap,
        float(opts.sm_scale) * float(qk_scale_mult),
        cap if cap > 0 else 1.0,
        float(v_scale),
        opts.num_qo_heads,  # NUM_QO_HEADS
        opts.group_size,  # GROUP
        cfg.block_m,  # BLOCK_M
        opts.head_dim,  # HEAD_DIM
        cfg.block_d,  # BLOCK_D
        cfg.block_n,  # BLOCK_N
        opts.page_size,  # PAGE_SIZE
        opts.paged,  # PAGED
        cfg.use_dot,  # USE_DOT
        cap > 0,  # SOFT_CAP
        pos_mode,  # POS_MODE
        lse is not None,  # HAS_LSE
        p.graph,  # CHECK_NUM_WORK
        compute,  # COMPUTE_DTYPE
        _backend._INTERPRET,  # INTERPRET
        None,  # k_scale_ptr
        None,  # v_scale_ptr
        p.counters if p.fused else None,  # counter_ptr
        False,  # SCALE_PTRS
        p.fused,  # FUSED_MERGE
        p.merge_block_k,  # MERGE_BLOCK_K
        p.group_p2,  # GROUP_P2
        whole,  # WHOLE_TILES
    ]
    grid = (p.work_cap, opts.num_kv_heads)
    if whole and cfg.maxnreg:
        kernel = _decode_kernel.run(
            *args, grid=grid, warmup=False, maxnreg=cfg.maxnreg, num_warps=cfg.num_warps, num_stages=cfg.num_stages
        )
    else:
        kernel = _decode_kernel.run(*args, grid=grid, warmup=False, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if bind is not None:
        bound = _bind(_decode_kernel, kernel, args, grid, 5)
        if bound is not None:
            bind.append((bound, args[:5]))
