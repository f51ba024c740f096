"""Context parallelism: attention over a KV sequence sharded across the ranks of a ``torch.distributed`` group.

Every rank computes attention over its share of the keys with the single-GPU wrappers and ``return_lse``,
which gives an attention state ``(o, lse)`` per query row and head. States over disjoint key sets merge
exactly (``lse = log2(sum_r 2**lse_r)``, ``o = sum_r 2**(lse_r - lse) * o_r``), so the ranks' partial states
combine into the answer over the whole sequence with a few collectives:

* **Decode / append over a sharded paged cache** (:class:`ContextParallelDecodeWrapper`,
  :class:`ContextParallelAppendWrapper`). Every rank holds the same queries and its share of every request's
  KV pages, either contiguous chunks of pages or pages dealt round-robin (:func:`shard_page_table`).
  Two ways to combine the states, chosen by message size:

  - ``"allgather"``: one ``all_gather_into_tensor`` of ``(o, lse)`` packed as ``[rows, heads, D + 1]``
    float32, then :func:`~flashinfer_triton.merge_states` on every rank. One collective: the choice when the
    message is small and latency dominates.
  - ``"reduce_scatter"``: ``all_gather`` of the LSE only, each rank rescales its output by
    ``2**(lse_r - lse)``, then ``reduce_scatter_tensor`` sums the rescaled outputs and leaves each rank the
    heads it owns (optionally ``all_gather``-ed back). Each rank moves about one copy of the output instead
    of ``world_size`` copies: the choice for large batches.

* **Ring prefill** (:class:`RingPrefillWrapper`): queries and keys are both sharded. Each request's
  sequence is cut into ``2 * world_size`` chunks and rank ``r`` holds chunks ``r`` and
  ``2 * world_size - 1 - r`` (zig-zag, :func:`zigzag_indices`), which gives every rank the same causal work.
  The ranks' KV blocks travel around the ring with ``batch_isend_irecv`` while the block already present is
  attended to, so communication hides behind compute; the states are merged with ``merge_state_in_place``.

Every entry point that returns an LSE takes ``lse_base``: 2 (FlashInfer's convention, the default) or
``"e"`` (vLLM's and FlashAttention's natural log).

Validation: arguments are checked locally before any collective; then ``plan()`` exchanges one small
fingerprint of its options (and whether the local checks passed) with ``all_gather``, so a rank whose
options differ, or whose plan failed, makes every rank raise instead of leaving the others in a collective
that never completes. ``run()`` does no host synchronization and, with the buffers fixed at ``plan()``,
replays inside CUDA graphs.

Positions are global under context parallelism, so the in-kernel RoPE/ALiBi (which use local positions)
and sliding windows are rejected: apply RoPE to q and k before sharding.
"""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass

import torch

from . import _checks as C
from . import _config

__all__ = [
    "PageTableShard",
    "shard_page_table",
    "shard_kv_lens",
    "zigzag_chunk_bounds",
    "zigzag_indices",
    "zigzag_indptr",
    "combine_states",
    "ContextParallelDecodeWrapper",
    "ContextParallelAppendWrapper",
    "RingPrefillWrapper",
]

LN2 = math.log(2.0)
SHARD_LAYOUTS = ("contiguous", "interleaved")
COMBINE_METHODS = ("auto", "allgather", "reduce_scatter")
_FINGERPRINT_SLOTS = 24


@dataclass(frozen=True, slots=True)
class _ShardedPlan:
    """What a sharded-cache wrapper's plan() fixed for its run(): the rows of every call and the output dtype
    (``heads``, ``head_dim``: the decode wrapper's query shape)."""

    rows: int
    out_dtype: torch.dtype
    heads: int | None = None
    head_dim: int | None = None


@dataclass(frozen=True, slots=True)
class _RingPlan:
    """What the ring prefill's plan() fixed for its run()'s checks: dtypes and head shapes."""

    out_dtype: torch.dtype
    heads: int
    kv_heads: int
    head_dim: int
    q_dtype: torch.dtype
    kv_dtype: torch.dtype


# ----------------------------------------------------------------------------- group and options checks
def _dist():
    import torch.distributed as dist

    return dist


def _group_info(group, where: str) -> tuple[int, int]:
    """(world_size, rank) of ``group``; raises before any collective when the group cannot be used."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(f"{where}: torch.distributed is not initialized; call torch.distributed.init_process_group")
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the group")
    size = dist.get_world_size(group)
    if size < 1:
        raise ValueError(f"group: expected a process group with at least one rank, got size {size}")
    return size, rank


def _comm_device(group) -> torch.device:
    """The device collectives on ``group`` take: CUDA for NCCL-only groups, else the CPU."""
    backend = str(_dist().get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend:
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _field_value(value) -> int:
    """An int64 standing for ``value``: ints as they are, anything else by a stable hash of its repr."""
    if isinstance(value, bool) or (isinstance(value, int) and -(1 << 62) < value < (1 << 62)):
        return int(value)
    digest = hashlib.sha256(repr(value).encode()).digest()
    return int.from_bytes(digest[:7], "little")


def _exchange_plan(group, where: str, error: BaseException | None, same: dict, per_rank: dict) -> torch.Tensor:
    """All-gather whether the local plan succeeded, the options that must agree (``same``) and per-rank
    counts (``per_rank``); raise the same way on every rank when something is off. Returns the gathered
    per-rank counts, ``[world_size, len(per_rank)]`` int64 on the CPU."""
    dist = _dist()
    size = dist.get_world_size(group)
    names = list(same)
    if len(names) > _FINGERPRINT_SLOTS:
        raise RuntimeError(f"{where}: {len(names)} options exceed the fingerprint's {_FINGERPRINT_SLOTS} slots")
    # a fixed length whatever happened locally, so the all-gather matches on every rank
    row = [0 if error is not None else 1]
    row += [0 if error is not None else _field_value(same[n]) for n in names]
    row += [0] * (_FINGERPRINT_SLOTS - len(names))
    row += [0 if error is not None else int(per_rank[n]) for n in per_rank]
    local = torch.tensor(row, dtype=torch.int64, device=_comm_device(group))
    gathered = torch.empty(size * len(row), dtype=torch.int64, device=local.device)
    dist.all_gather_into_tensor(gathered, local, group=group)
    gathered = gathered.cpu().view(size, len(row))
    if error is not None:
        raise error
    failed = [r for r in range(size) if int(gathered[r, 0]) != 1]
    if failed:
        raise RuntimeError(f"{where}: plan() failed on rank(s) {failed} of the group; see the error raised there")
    fields = gathered[:, 1 : 1 + _FINGERPRINT_SLOTS]
    differ = [n for i, n in enumerate(names) if bool((fields[:, i] != fields[0, i]).any())]
    if differ:
        raise ValueError(
            f"{where}: options differ across ranks: {', '.join(differ)}; every rank must plan() with the same "
            "options and batch"
        )
    return gathered[:, 1 + _FINGERPRINT_SLOTS :]


def _check_lse_base(lse_base) -> float:
    if isinstance(lse_base, str) and lse_base.lower() == "e":
        return math.e
    if lse_base == 2 or (isinstance(lse_base, str) and lse_base == "2"):
        return 2.0
    if isinstance(lse_base, (int, float)) and not isinstance(lse_base, bool) and abs(lse_base - math.e) < 1e-12:
        return math.e
    raise C.value_error("lse_base", "2 (FlashInfer) or 'e' / math.e (vLLM, FlashAttention)", repr(lse_base))


def _check_global_positions(pos_encoding_mode, window_left) -> None:
    if pos_encoding_mode not in (None, "NONE"):
        raise C.value_error(
            "pos_encoding_mode",
            "'NONE' under context parallelism (in-kernel RoPE/ALiBi would use local positions; apply RoPE "
            "to q and k before sharding)",
            repr(pos_encoding_mode),
        )
    if window_left is not None and window_left != -1:
        raise C.value_error("window_left", "-1 under context parallelism (no sliding window)", window_left)


def _host_int(name: str, x) -> torch.Tensor:
    if isinstance(x, (list, tuple)):
        x = torch.tensor(x, dtype=torch.int64)
    C.check_tensor(name, x, dim=1, dtypes=(torch.int32, torch.int64))
    return x.detach().to("cpu", torch.int64)


# ----------------------------------------------------------------------------- page-table sharding
@dataclass(frozen=True)
class PageTableShard:
    """One rank's share of a CSR page table (all int32 on the CPU unless said otherwise).

    ``indptr [B + 1]``, ``indices``, ``last_page_len [B]``: the local page table, ready for the wrappers;
    ``indices`` are the global page ids, or ``0 .. n - 1`` when sharded with ``compact=True`` (then
    ``global_indices`` lists the global page each local page copies, so ``local_cache = cache[global_indices]``).
    ``logical_pages`` (int64): each local page's position in its request (page ``p`` holds tokens
    ``p * page_size ..``). ``kv_lens`` (int64 ``[B]``): local tokens per request; ``seq_lens`` (int64 ``[B]``):
    the whole requests' lengths.
    """

    indptr: torch.Tensor
    indices: torch.Tensor
    last_page_len: torch.Tensor
    logical_pages: torch.Tensor
    global_indices: torch.Tensor
    kv_lens: torch.Tensor
    seq_lens: torch.Tensor
    page_size: int
    world_size: int
    rank: int
    layout: str


def _page_owner(logical: torch.Tensor, num_pages: torch.Tensor, world_size: int, layout: str) -> torch.Tensor:
    """Rank owning each page, from its position in its request and the request's page count."""
    if layout == "interleaved":
        return logical % world_size
    # contiguous: the first num_pages % world_size ranks get one page more than the others
    base = num_pages // world_size
    extra = num_pages % world_size
    cut = extra * (base + 1)  # pages before this index belong to the ranks with an extra page
    return torch.where(
        logical < cut,
        logical // (base + 1).clamp(min=1),
        extra + (logical - cut) // base.clamp(min=1),
    )


def shard_page_table(
    indptr, indices, last_page_len, page_size: int, world_size: int, rank: int, layout: str = "contiguous", *,
    compact: bool = False,
) -> PageTableShard:  # fmt: skip
    """Rank ``rank``'s share of a CSR page table split over ``world_size`` ranks.

    Parameters
    ----------
    indptr, indices, last_page_len : the whole page table (int32, CPU or device), as the decode wrapper takes.
    layout : ``"contiguous"``: request ``b``'s ``n`` pages are cut into ``world_size`` runs of consecutive
        pages (``ceil`` or ``floor`` of ``n / world_size`` pages each, longer runs first);
        ``"interleaved"``: page ``p`` goes to rank ``p % world_size``.
    compact : renumber the local pages ``0 .. n - 1`` (see :class:`PageTableShard`).

    A rank may hold no page of a request (its share is empty; the wrappers give such rows ``lse = -inf``).

    Examples
    --------
    >>> import torch
    >>> from flashinfer_triton.distributed import shard_page_table
    >>> s = shard_page_table(torch.tensor([0, 5], dtype=torch.int32), torch.arange(5, dtype=torch.int32),
    ...                      torch.tensor([3], dtype=torch.int32), 16, 2, 1, "interleaved")
    >>> s.indices.tolist(), s.kv_lens.tolist()
    ([1, 3], [32])
    """
    C.check_positive_int("world_size", world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise C.value_error("rank", f"an int in [0, world_size) = [0, {world_size})", repr(rank))
    C.check_positive_int("page_size", page_size)
    C.check_choice("layout", layout, SHARD_LAYOUTS)
    ip = _host_int("indptr", indptr)
    C.check_indptr_host("indptr", ip)
    last = _host_int("last_page_len", last_page_len)
    bs = ip.numel() - 1
    if last.numel() != bs:
        raise C.value_error("last_page_len", f"shape [batch_size] = [{bs}]", C.shape_str(last.shape))
    idx = _host_int("indices", indices)
    nnz = int(ip[-1])
    if idx.numel() < nnz:
        raise C.value_error("indices", f"at least indptr[-1] = {nnz} entries", idx.numel())
    num_pages = ip[1:] - ip[:-1]
    if bool(((last < 0) | (last > page_size) | ((num_pages > 0) & (last < 1))).any()):
        raise C.value_error("last_page_len", f"values in [1, page_size = {page_size}] for requests with pages", "other")
    seq_lens = torch.where(num_pages > 0, (num_pages - 1) * page_size + last, torch.zeros_like(num_pages))
    req = torch.repeat_interleave(torch.arange(bs), num_pages)
    logical = torch.arange(nnz) - ip[:-1][req]
    keep = _page_owner(logical, num_pages[req], world_size, layout) == rank
    local_req = req[keep]
    local_logical = logical[keep]
    counts = torch.bincount(local_req, minlength=bs)
    local_ip = torch.zeros(bs + 1, dtype=torch.int64)
    local_ip[1:] = torch.cumsum(counts, 0)
    holds_last = torch.zeros(bs, dtype=torch.bool)
    holds_last[local_req[local_logical == num_pages[local_req] - 1]] = True
    local_last = torch.where(counts == 0, 0, torch.where(holds_last, last, page_size))
    kv_lens = torch.where(counts > 0, (counts - 1) * page_size + local_last, torch.zeros_like(counts))
    global_ids = idx[:nnz][keep]
    local_indices = torch.arange(global_ids.numel()) if compact else global_ids
    return PageTableShard(
        indptr=local_ip.to(torch.int32),
        indices=local_indices.to(torch.int32),
        last_page_len=local_last.to(torch.int32),
        logical_pages=local_logical,
        global_indices=global_ids.to(torch.int32),
        kv_lens=kv_lens,
        seq_lens=seq_lens,
        page_size=page_size,
        world_size=world_size,
        rank=rank,
        layout=layout,
    )


def shard_kv_lens(seq_lens, page_size: int, world_size: int, layout: str = "contiguous") -> torch.Tensor:
    """Tokens each rank holds of each request under ``layout``: int64 ``[world_size, batch_size]``."""
    lens = _host_int("seq_lens", seq_lens)
    C.check_positive_int("page_size", page_size)
    C.check_positive_int("world_size", world_size)
    C.check_choice("layout", layout, SHARD_LAYOUTS)
    if bool((lens < 0).any()):
        raise C.value_error("seq_lens", "non-negative lengths", "a negative length")
    pages = (lens + page_size - 1) // page_size
    ip = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    ip[1:] = torch.cumsum(pages, 0)
    last = torch.where(pages > 0, lens - (pages - 1) * page_size, torch.zeros_like(lens))
    idx = torch.arange(int(ip[-1]), dtype=torch.int32)
    return torch.stack(
        [shard_page_table(ip, idx, last, page_size, world_size, r, layout).kv_lens for r in range(world_size)]
    )


# ----------------------------------------------------------------------------- zig-zag sharding
def zigzag_chunk_bounds(seq_len: int, world_size: int) -> list[int]:
    """Boundaries of the ``2 * world_size`` chunks of a sequence of ``seq_len`` tokens (``2W + 1`` offsets;
    the first ``seq_len % 2W`` chunks are one token longer)."""
    n = 2 * world_size
    base, extra = divmod(int(seq_len), n)
    bounds = [0]
    for c in range(n):
        bounds.append(bounds[-1] + base + (1 if c < extra else 0))
    return bounds


def zigzag_indices(seq_lens, world_size: int, rank: int) -> torch.Tensor:
    """Global rows (into the batch's concatenated sequences) that rank ``rank`` holds, in its local order:
    chunk ``rank`` of every request, then chunk ``2 * world_size - 1 - rank`` of every request. int64.

    ``x_local = x[zigzag_indices(seq_lens, W, r)]`` shards q, k or v; the same indices place the local
    output back (``out[idx] = o_local``), and ``idx - request_start`` are the tokens' positions (for RoPE).

    Examples
    --------
    >>> from flashinfer_triton.distributed import zigzag_indices
    >>> zigzag_indices([8], 2, 0).tolist(), zigzag_indices([8], 2, 1).tolist()
    ([0, 1, 6, 7], [2, 3, 4, 5])
    """
    lens = _host_int("seq_lens", seq_lens)
    C.check_positive_int("world_size", world_size)
    if not isinstance(rank, int) or not 0 <= rank < world_size:
        raise C.value_error("rank", f"an int in [0, world_size) = [0, {world_size})", repr(rank))
    starts = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    starts[1:] = torch.cumsum(lens, 0)
    parts: list[torch.Tensor] = []
    for chunk in (rank, 2 * world_size - 1 - rank):
        for b, n in enumerate(lens.tolist()):
            bounds = zigzag_chunk_bounds(n, world_size)
            parts.append(torch.arange(bounds[chunk], bounds[chunk + 1], dtype=torch.int64) + starts[b])
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.int64)


def zigzag_indptr(seq_lens, world_size: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunk sizes of rank ``rank``'s two segments: int64 ``([B], [B])`` for chunks ``rank`` and
    ``2W - 1 - rank`` of every request."""
    lens = _host_int("seq_lens", seq_lens)
    first, second = [], []
    for n in lens.tolist():
        b = zigzag_chunk_bounds(n, world_size)
        first.append(b[rank + 1] - b[rank])
        c = 2 * world_size - 1 - rank
        second.append(b[c + 1] - b[c])
    return torch.tensor(first, dtype=torch.int64), torch.tensor(second, dtype=torch.int64)


# ----------------------------------------------------------------------------- combining states
def _pick_method(method: str, world_size: int, rows: int, heads: int, head_dim: int, config=None) -> str:
    """The collective of ``method`` ("auto": by the gathered size, ``config`` a ``DistributedConfig``)."""
    if method != "auto":
        return method
    cfg = config or _config.DISTRIBUTED
    if world_size * rows * heads * (head_dim + 1) * 4 <= cfg.allgather_max_bytes:
        return "allgather"
    return "reduce_scatter"


class _StateCombiner:
    """Combines every rank's ``(o [rows, H, D] float32, lse [rows, H] float32 base 2)`` into the state over
    all ranks' keys, with buffers allocated once (``run`` allocates only merge_states' outputs)."""

    def __init__(self, group, world_size, rank, rows, heads, head_dim, device, method, gather_output):
        self.group, self.world_size, self.rank = group, world_size, rank
        self.rows, self.heads, self.head_dim = rows, heads, head_dim
        self.method, self.gather_output = method, gather_output
        w = world_size
        self.heads_per_rank = -(-heads // w)
        hs = self.heads_per_rank
        self.head_start = min(rank * hs, heads)
        self.head_stop = min(rank * hs + hs, heads)
        f32 = dict(dtype=torch.float32, device=device)
        if w == 1:
            return
        # Collective buffers are [world_size * rows, ...]: every backend splits them along dim 0 into the
        # ranks' pieces, each the shape of the local tensor (gloo insists on it); the views below add the W dim.
        if method == "allgather":
            self.pack = torch.empty((rows, heads, head_dim + 1), **f32)
            self.gathered = torch.empty((w * rows, heads, head_dim + 1), **f32)
        else:
            self.lse_all = torch.empty((w * rows, heads), **f32)
            self.padded = torch.zeros((rows, hs * w, head_dim), **f32) if hs * w != heads else None
            self.send = torch.empty((w * rows, hs, head_dim), **f32)
            self.shard = torch.empty((rows, hs, head_dim), **f32)
            if gather_output:
                self.full = torch.empty((w * rows, hs, head_dim), **f32)

    def combine(self, o: torch.Tensor, lse: torch.Tensor):
        """(o, lse) over all ranks: full heads when ``gather_output`` else this rank's head range."""
        dist = _dist()
        if self.world_size == 1:
            if self.gather_output:
                return o, lse
            return o[:, self.head_start : self.head_stop], lse[:, self.head_start : self.head_stop]
        rows, heads, d, w, hs = self.rows, self.heads, self.head_dim, self.world_size, self.heads_per_rank
        if self.method == "allgather":
            self.pack[..., :d].copy_(o)
            self.pack[..., d].copy_(lse)
            dist.all_gather_into_tensor(self.gathered, self.pack, group=self.group)
            g = self.gathered.view(w, rows, heads, d + 1).permute(1, 0, 2, 3)  # [rows, W, H, D + 1]
            vo, so = _merge_states(g[..., :d], g[..., d])
            if self.gather_output:
                return vo, so
            return vo[:, self.head_start : self.head_stop], so[:, self.head_start : self.head_stop]
        dist.all_gather_into_tensor(self.lse_all, lse, group=self.group)
        lse_all = self.lse_all.view(w, rows, heads)
        peak = lse_all.amax(0)
        finite = torch.isfinite(peak)
        peak = torch.where(finite, peak, torch.zeros_like(peak))
        total = torch.exp2(lse_all - peak).sum(0)  # >= 1 where some rank saw a key
        lse_g = torch.where(finite, torch.log2(total) + peak, torch.full_like(peak, float("-inf")))
        scale = torch.where(finite, torch.exp2(lse - torch.where(finite, lse_g, torch.zeros_like(lse_g))), 0.0)
        send_view = self.send.view(w, rows, hs, d).permute(1, 0, 2, 3)  # [rows, W, hs, D] view of the send buffer
        if self.padded is None:
            torch.mul(o.view(rows, w, hs, d), scale.view(rows, w, hs, 1), out=send_view)
        else:
            torch.mul(o, scale.unsqueeze(-1), out=self.padded[:, :heads])
            send_view.copy_(self.padded.view(rows, w, hs, d))
        dist.reduce_scatter_tensor(self.shard, self.send, group=self.group)
        if not self.gather_output:
            n = self.head_stop - self.head_start
            return self.shard[:, :n], lse_g[:, self.head_start : self.head_stop]
        dist.all_gather_into_tensor(self.full, self.shard, group=self.group)
        return self.full.view(w, rows, hs, d).permute(1, 0, 2, 3).reshape(rows, w * hs, d)[:, :heads], lse_g


def _merge_states(v, s):
    from ._merge_api import merge_states

    return merge_states(v, s)


def combine_states(o: torch.Tensor, lse: torch.Tensor, group=None, *, method: str = "auto", gather_output=True,
                   lse_base=2) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """Merge every rank's attention state over its keys into the state over all ranks' keys.

    Parameters
    ----------
    o : ``[rows, num_heads, head_dim]``, float16/bfloat16/float32, the same shape on every rank.
    lse : ``[rows, num_heads]`` float32, **base 2** (as the wrappers' ``return_lse`` gives); ``-inf`` for a
        row that saw no key on this rank.
    method : "allgather", "reduce_scatter" or "auto" (by size; see the module docstring).
    gather_output : False returns only this rank's heads ``[h0, h1)`` with ``h0 = rank * ceil(H / W)``.

    Returns ``(o, lse)``: o in the dtype of the input o, lse float32 in ``lse_base``. A one-off call: the
    wrappers keep their buffers between calls instead.
    """
    world_size, rank = _group_info(group, "combine_states")
    C.check_choice("method", method, COMBINE_METHODS)
    base = _check_lse_base(lse_base)
    C.check_tensor("o", o, dim=3, dtypes=(torch.float16, torch.bfloat16, torch.float32))
    C.check_tensor("lse", lse, dim=2, dtypes=(torch.float32,), device=o.device)
    if tuple(lse.shape) != tuple(o.shape[:2]):
        raise C.value_error("lse", f"shape o.shape[:2] = {C.shape_str(o.shape[:2])}", C.shape_str(lse.shape))
    rows, heads, d = o.shape
    chosen = _pick_method(method, world_size, rows, heads, d)
    _exchange_plan(group, "combine_states", None, dict(shape=tuple(o.shape), method=chosen, gather=gather_output), {})
    comb = _StateCombiner(group, world_size, rank, rows, heads, d, o.device, chosen, bool(gather_output))
    vo, so = comb.combine(o.float().contiguous(), lse.contiguous())
    return vo.to(o.dtype), (so * LN2 if base != 2.0 else so.clone())


# ----------------------------------------------------------------------------- sharded-cache wrappers
class _ShardedCacheBase:
    """Shared by the decode and append wrappers: the group, the combiner and the output stage."""

    _where = "ContextParallel"

    def __init__(self, float_workspace_buffer, kv_layout, group, combine, gather_output, lse_base):
        C.check_tensor("float_workspace_buffer", float_workspace_buffer)
        C.check_kv_layout(kv_layout)
        C.check_choice("combine", combine, COMBINE_METHODS)
        self._lse_base = _check_lse_base(lse_base)
        self._group = group
        self._world_size, self._rank = _group_info(group, self._where)
        self._device = float_workspace_buffer.device
        self._workspace = float_workspace_buffer
        self._kv_layout = kv_layout
        self._combine_method = combine
        self._gather_output = bool(gather_output)
        self._combiner: _StateCombiner | None = None
        self._planned = None

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def combine_method(self) -> str:
        """The method the last ``plan()`` chose ("allgather" or "reduce_scatter")."""
        self._require_plan()
        return self._combiner.method

    @property
    def head_range(self) -> tuple[int, int]:
        """``(h0, h1)``: the query heads this rank's output holds when ``gather_output=False``."""
        self._require_plan()
        return self._combiner.head_start, self._combiner.head_stop

    def _require_plan(self):
        if self._planned is None:
            raise RuntimeError(f"{self._where}.run(): call plan() first")
        return self._planned

    def _make_combiner(self, rows, heads, head_dim):
        method = _pick_method(self._combine_method, self._world_size, rows, heads, head_dim)
        c = self._combiner
        if c is None or (c.rows, c.heads, c.head_dim, c.method, c.gather_output) != (
            rows,
            heads,
            head_dim,
            method,
            self._gather_output,
        ):
            c = _StateCombiner(
                self._group, self._world_size, self._rank, rows, heads, head_dim, self._device, method,
                self._gather_output,
            )  # fmt: skip
        return c

    def _finish(self, o, lse, out, lse_out, return_lse, out_dtype):
        vo, so = self._combiner.combine(o, lse)
        if out is None:
            out = torch.empty(vo.shape, dtype=out_dtype, device=vo.device)
        elif tuple(out.shape) != tuple(vo.shape) or out.device != vo.device:
            raise C.value_error(
                "out", f"a tensor of shape {C.shape_str(vo.shape)} on {vo.device}", C.shape_str(out.shape)
            )
        out.copy_(vo)
        if not return_lse:
            return out
        if lse_out is None:
            lse_out = torch.empty(so.shape, dtype=torch.float32, device=so.device)
        elif tuple(lse_out.shape) != tuple(so.shape) or lse_out.dtype != torch.float32:
            raise C.value_error("lse", f"float32 of shape {C.shape_str(so.shape)}", C.shape_str(lse_out.shape))
        if self._lse_base == 2.0:
            lse_out.copy_(so)
        else:
            torch.mul(so, LN2, out=lse_out)
        return out, lse_out

    def _check_out_args(self, out, lse, return_lse):
        if out is not None:
            C.check_tensor("out", out, dim=3, device=self._device)
        if lse is not None:
            if not return_lse:
                raise ValueError("lse: given but return_lse=False")
            C.check_tensor("lse", lse, dim=2, dtypes=(torch.float32,), device=self._device)


class ContextParallelDecodeWrapper(_ShardedCacheBase):
    """Batch decode over a paged KV cache whose pages are sharded across the ranks of ``group``.

    Every rank passes the same queries and its own share of the page table (from :func:`shard_page_table`,
    or any split of each request's pages into disjoint sets); ``run()`` decodes the local share with the
    single-GPU :class:`~flashinfer_triton.BatchDecodeWithPagedKVCacheWrapper` and combines the ranks' states.

    Parameters
    ----------
    float_workspace_buffer : uint8 scratch on the compute device (for the local decode's split-KV states).
    kv_layout : "NHD" or "HND", of this rank's cache.
    group : a ``torch.distributed`` process group (None: the default group). NCCL for CUDA tensors, gloo for
        CPU tensors.
    combine : "auto" (by size), "allgather" (all-gather + merge_states) or "reduce_scatter" (all-gather of the
        LSE + reduce-scatter of the rescaled outputs over heads).
    gather_output : True: every rank gets all heads; False: each rank gets its head range
        (:attr:`head_range`), which saves the last all-gather of the reduce-scatter path.
    lse_base : 2 (default, FlashInfer) or "e" for the LSE ``run(return_lse=True)`` returns.
    use_cuda_graph, paged_kv_*_buffer : as in the single-GPU wrapper (fixed batch size; ``plan()`` copies the
        local page table into the buffers, so a graph captured around ``run()`` replays after a new plan).

    ``plan()`` synchronizes the group once (an all-gather of an options fingerprint); ``run()`` issues the
    collectives on the current stream and never waits on the host.

    Examples
    --------
    Without an initialized process group the wrapper refuses to start:

    >>> import torch
    >>> from flashinfer_triton.distributed import ContextParallelDecodeWrapper
    >>> ContextParallelDecodeWrapper(torch.empty(1 << 20, dtype=torch.uint8))  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    ...
    RuntimeError: ContextParallelDecodeWrapper: torch.distributed is not initialized; ...

    On a group (here one CPU process; under ``torchrun`` each rank passes its own share):

    >>> import os, tempfile, torch.distributed as dist, flashinfer_triton as fi
    >>> from flashinfer_triton.distributed import shard_page_table
    >>> store = os.path.join(tempfile.mkdtemp(), "store")
    >>> dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    >>> cache = torch.randn(6, 2, 16, 2, 64, dtype=torch.float16)
    >>> indptr = torch.tensor([0, 2, 6], dtype=torch.int32); indices = torch.arange(6, dtype=torch.int32)
    >>> last = torch.tensor([5, 16], dtype=torch.int32)
    >>> s = shard_page_table(indptr, indices, last, 16, dist.get_world_size(), dist.get_rank(), "interleaved")
    >>> w = ContextParallelDecodeWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    >>> w.plan(s.indptr, s.indices, s.last_page_len, 8, 2, 64, 16, seq_lens=s.seq_lens, shard_layout="interleaved")
    >>> o, lse = w.run(torch.randn(2, 8, 64, dtype=torch.float16), cache, return_lse=True)
    >>> o.shape, lse.shape, w.combine_method
    (torch.Size([2, 8, 64]), torch.Size([2, 8]), 'allgather')
    >>> dist.destroy_process_group()
    """

    _where = "ContextParallelDecodeWrapper"

    def __init__(
        self,
        float_workspace_buffer: torch.Tensor,
        kv_layout: str = "NHD",
        group=None,
        *,
        combine: str = "auto",
        gather_output: bool = True,
        lse_base=2,
        use_cuda_graph: bool = False,
        use_tensor_cores: bool = False,
        paged_kv_indptr_buffer: torch.Tensor | None = None,
        paged_kv_indices_buffer: torch.Tensor | None = None,
        paged_kv_last_page_len_buffer: torch.Tensor | None = None,
    ):
        super().__init__(float_workspace_buffer, kv_layout, group, combine, gather_output, lse_base)
        from .decode import BatchDecodeWithPagedKVCacheWrapper

        self._use_cuda_graph = bool(use_cuda_graph)
        self._inner = BatchDecodeWithPagedKVCacheWrapper(
            float_workspace_buffer,
            kv_layout,
            use_cuda_graph=use_cuda_graph,
            use_tensor_cores=use_tensor_cores,
            paged_kv_indptr_buffer=paged_kv_indptr_buffer,
            paged_kv_indices_buffer=paged_kv_indices_buffer,
            paged_kv_last_page_len_buffer=paged_kv_last_page_len_buffer,
        )
        self._o_part = None
        self._lse_part = None

    def plan(
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
        q_data_type="float16",
        kv_data_type=None,
        sm_scale: float | None = None,
        o_data_type=None,
        non_blocking: bool = True,
        *,
        seq_lens=None,
        shard_layout: str | None = None,
        fixed_split_size: int | None = None,
        disable_split_kv: bool = False,
    ) -> None:
        """Plan this rank's share: ``indptr [B + 1]``, ``indices``, ``last_page_len [B]`` (int32) are the local
        page table, ``B`` the same on every rank. ``seq_lens [B]`` (optional) are the whole requests' lengths:
        with ``shard_layout`` ("contiguous" / "interleaved") each rank checks that its share is the one that
        layout gives, and the group checks that the shares add up to ``seq_lens``. Other options as in the
        single-GPU wrapper; the in-kernel position encodings and windows are rejected (positions are global).
        Collective: every rank of the group must call it."""
        error = None
        same: dict = {}
        local_tokens = 0
        total = None
        try:
            _check_global_positions(pos_encoding_mode, window_left)
            if shard_layout is not None:
                C.check_choice("shard_layout", shard_layout, SHARD_LAYOUTS)
            C.check_index_tensor("indptr", indptr)
            C.check_index_tensor("last_page_len", last_page_len)
            bs = last_page_len.shape[0]
            if indptr.shape[0] != bs + 1:
                raise C.value_error("indptr", f"shape [len(last_page_len) + 1] = [{bs + 1}]", C.shape_str(indptr.shape))
            ip = indptr.detach().to("cpu", torch.int64)
            last = last_page_len.detach().to("cpu", torch.int64)
            pages = ip[1:] - ip[:-1]
            kv_lens = torch.where(pages > 0, (pages - 1) * page_size + last, torch.zeros_like(pages))
            local_tokens = int(kv_lens.sum())
            if seq_lens is not None:
                lens = _host_int("seq_lens", seq_lens)
                if lens.numel() != bs:
                    raise C.value_error("seq_lens", f"shape [batch_size] = [{bs}]", C.shape_str(lens.shape))
                total = int(lens.sum())
                if shard_layout is not None:
                    want = shard_kv_lens(lens, page_size, self._world_size, shard_layout)[self._rank]
                    if not torch.equal(want, kv_lens):
                        bad = int((want != kv_lens).nonzero()[0, 0])
                        raise C.value_error(
                            "indptr",
                            f"this rank's {shard_layout} share of seq_lens (request {bad}: {int(want[bad])} tokens)",
                            f"{int(kv_lens[bad])} tokens",
                        )
                elif bool((kv_lens > lens).any()):
                    raise C.value_error("indptr", "a share no longer than seq_lens per request", "a longer one")
            q_dtype = C.parse_dtype("q_data_type", q_data_type)
            out_dtype = C.parse_dtype("o_data_type", o_data_type, q_dtype)
            self._inner.plan(
                indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
                logits_soft_cap=logits_soft_cap, q_data_type=q_data_type, kv_data_type=kv_data_type,
                sm_scale=sm_scale, o_data_type=torch.float32, non_blocking=non_blocking,
                fixed_split_size=fixed_split_size, disable_split_kv=disable_split_kv,
            )  # fmt: skip
            combiner = self._make_combiner(bs, num_qo_heads, head_dim)
            same = dict(
                batch_size=bs, num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                page_size=page_size, q_data_type=str(q_dtype), kv_data_type=str(kv_data_type),
                o_data_type=str(out_dtype), sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                combine=combiner.method, gather_output=self._gather_output, lse_base=self._lse_base,
                use_cuda_graph=self._use_cuda_graph, shard_layout=shard_layout,
                seq_lens=None if seq_lens is None else tuple(_host_int("seq_lens", seq_lens).tolist()),
            )  # fmt: skip
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        counts = _exchange_plan(self._group, self._where, error, same, dict(tokens=local_tokens))
        if total is not None and int(counts[:, 0].sum()) != total:
            raise ValueError(
                f"{self._where}: the ranks' shares hold {int(counts[:, 0].sum())} tokens in all, seq_lens sum to "
                f"{total}: the page tables are not a split of the requests"
            )
        self._combiner = combiner
        if self._o_part is None or tuple(self._o_part.shape) != (bs, num_qo_heads, head_dim):
            self._o_part = torch.empty((bs, num_qo_heads, head_dim), dtype=torch.float32, device=self._device)
            self._lse_part = torch.empty((bs, num_qo_heads), dtype=torch.float32, device=self._device)
        self._planned = _ShardedPlan(rows=bs, out_dtype=out_dtype, heads=num_qo_heads, head_dim=head_dim)

    begin_forward = plan

    def run(
        self,
        q: torch.Tensor,
        paged_kv_cache,
        *,
        out: torch.Tensor | None = None,
        lse: torch.Tensor | None = None,
        return_lse: bool = False,
        q_scale: float | None = None,
        k_scale: float | None = None,
        v_scale: float | None = None,
    ):
        """Decode ``q [B, num_qo_heads, head_dim]`` (the same on every rank) against this rank's
        ``paged_kv_cache``. Returns ``o [B, H, D]`` (``[B, h1 - h0, D]`` with ``gather_output=False``) and,
        with ``return_lse``, ``lse`` float32 in ``lse_base``. Collective; no host synchronization."""
        p = self._require_plan()
        self._check_out_args(out, lse, return_lse)
        self._inner.run(
            q, paged_kv_cache, out=self._o_part, lse=self._lse_part, return_lse=True,
            q_scale=q_scale, k_scale=k_scale, v_scale=v_scale,
        )  # fmt: skip
        return self._finish(self._o_part, self._lse_part, out, lse, return_lse, p.out_dtype)

    def _run_local(self, q, paged_kv_cache):
        """The local decode alone (no communication): for measuring the communication share."""
        self._inner.run(q, paged_kv_cache, out=self._o_part, lse=self._lse_part, return_lse=True)

    def _run_combine(self):
        """The combination alone on the last partial states: for measuring the communication share."""
        return self._combiner.combine(self._o_part, self._lse_part)


class ContextParallelAppendWrapper(_ShardedCacheBase):
    """Append (chunked) prefill over a paged KV cache sharded across the ranks of ``group``.

    The new tokens' queries are the same on every rank; their keys and values are already in the cache,
    appended to whichever rank owns their pages (as an engine appends before attending). Each rank attends
    the queries to its pages, the ranks' states are combined as in :class:`ContextParallelDecodeWrapper`.
    ``causal`` keeps key position ``j`` for query ``i`` iff ``j <= seq_len - qo_len + i`` (bottom right, in
    global positions): local pages entirely before the new tokens are attended without a mask, the few
    pages from the first new token on with a custom mask built at ``plan()``.

    Parameters as in :class:`ContextParallelDecodeWrapper`.
    """

    _where = "ContextParallelAppendWrapper"

    def __init__(self, float_workspace_buffer, kv_layout="NHD", group=None, *, combine="auto", gather_output=True,
                 lse_base=2):  # fmt: skip
        super().__init__(float_workspace_buffer, kv_layout, group, combine, gather_output, lse_base)
        from .prefill import BatchPrefillWithPagedKVCacheWrapper

        self._prefix = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)
        self._tail = BatchPrefillWithPagedKVCacheWrapper(float_workspace_buffer, kv_layout)

    def plan(
        self,
        qo_indptr,
        shard: PageTableShard,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = True,
        sm_scale: float | None = None,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
    ) -> None:
        """Plan: ``qo_indptr [B + 1]`` (int32) splits the new tokens' query rows (the same on every rank);
        ``shard`` is this rank's :class:`PageTableShard` of the cache that already holds the new tokens
        (``shard.seq_lens[b] >= qo_len[b]``). Collective."""
        error = None
        same: dict = {}
        try:
            if not isinstance(shard, PageTableShard):
                raise C.type_error("shard", "a PageTableShard (see shard_page_table)", type(shard).__name__)
            if shard.world_size != self._world_size or shard.rank != self._rank:
                raise C.value_error(
                    "shard",
                    f"the share of rank {self._rank} of {self._world_size}",
                    f"rank {shard.rank} of {shard.world_size}",
                )
            C.check_index_tensor("qo_indptr", qo_indptr)
            qo = qo_indptr.detach().to("cpu", torch.int64)
            C.check_indptr_host("qo_indptr", qo)
            bs = shard.seq_lens.numel()
            if qo.numel() != bs + 1:
                raise C.value_error("qo_indptr", f"shape [batch_size + 1] = [{bs + 1}]", C.shape_str(qo.shape))
            qo_lens = qo[1:] - qo[:-1]
            if bool((qo_lens > shard.seq_lens).any()):
                raise C.value_error("qo_indptr", "qo_len <= seq_len for every request", "a longer query")
            q_dtype = C.parse_dtype("q_data_type", q_data_type)
            out_dtype = C.parse_dtype("o_data_type", o_data_type, q_dtype)
            self._plan_parts(qo, qo_lens, shard, num_qo_heads, num_kv_heads, head_dim, bool(causal), sm_scale,
                             logits_soft_cap, q_data_type, kv_data_type)  # fmt: skip
            rows = int(qo[-1])
            combiner = self._make_combiner(rows, num_qo_heads, head_dim)
            same = dict(
                qo_indptr=tuple(qo.tolist()), seq_lens=tuple(shard.seq_lens.tolist()), num_qo_heads=num_qo_heads,
                num_kv_heads=num_kv_heads, head_dim=head_dim, page_size=shard.page_size, causal=bool(causal),
                sm_scale=sm_scale, logits_soft_cap=logits_soft_cap, q_data_type=str(q_dtype),
                o_data_type=str(out_dtype), combine=combiner.method, gather_output=self._gather_output,
                lse_base=self._lse_base, layout=shard.layout,
            )  # fmt: skip
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        _exchange_plan(self._group, self._where, error, same, {})
        self._combiner = combiner
        f32 = dict(dtype=torch.float32, device=self._device)
        self._o_part = torch.empty((rows, num_qo_heads, head_dim), **f32)
        self._lse_part = torch.empty((rows, num_qo_heads), **f32)
        self._o_tail = torch.empty((rows, num_qo_heads, head_dim), **f32)
        self._lse_tail = torch.empty((rows, num_qo_heads), **f32)
        self._planned = _ShardedPlan(rows=rows, out_dtype=out_dtype)

    def _plan_parts(self, qo, qo_lens, shard, hq, hkv, d, causal, sm_scale, cap, q_dt, kv_dt):
        """Split every request's local pages into those all queries see (no mask) and the rest (masked)."""
        ps = shard.page_size
        ip = shard.indptr.to(torch.int64)
        bs = qo_lens.numel()
        first_new = shard.seq_lens - qo_lens  # global position of each request's first new token
        if causal:
            req = torch.repeat_interleave(torch.arange(bs), ip[1:] - ip[:-1])
            in_prefix = (shard.logical_pages + 1) * ps <= first_new[req]
        else:
            in_prefix = torch.ones(shard.logical_pages.numel(), dtype=torch.bool)
        # pages are listed in increasing position within a request, so each part is a contiguous run
        n_prefix = torch.zeros(bs, dtype=torch.int64)
        masks = []
        tail_ip, tail_last = [0], []
        pre_last = []
        idx = shard.indices.to(torch.int64)
        pre_idx, tail_idx = [], []
        for b in range(bs):
            lo, hi = int(ip[b]), int(ip[b + 1])
            k = int(in_prefix[lo:hi].sum())
            n_prefix[b] = k
            pre_idx.append(idx[lo : lo + k])
            tail_idx.append(idx[lo + k : hi])
            pre_last.append(0 if k == 0 else (ps if k < hi - lo else int(shard.last_page_len[b])))
            nt = hi - lo - k
            tail_ip.append(tail_ip[-1] + nt)
            tail_last.append(0 if nt == 0 else int(shard.last_page_len[b]))
            if causal:
                logical = shard.logical_pages[lo + k : hi]
                pos = (logical[:, None] * ps + torch.arange(ps)[None, :]).reshape(-1)
                pos = pos[: max(nt - 1, 0) * ps + tail_last[-1]] if nt else pos[:0]
                qpos = first_new[b] + torch.arange(int(qo_lens[b]))
                masks.append((pos[None, :] <= qpos[:, None]).reshape(-1))
        pre_ip = torch.zeros(bs + 1, dtype=torch.int64)
        pre_ip[1:] = torch.cumsum(n_prefix, 0)
        i32 = dict(dtype=torch.int32)
        common = dict(sm_scale=sm_scale, logits_soft_cap=cap, q_data_type=q_dt, kv_data_type=kv_dt,
                      o_data_type=torch.float32)  # fmt: skip
        dev = self._device
        self._prefix.plan(
            qo.to(dev, torch.int32), pre_ip.to(dev, torch.int32), torch.cat(pre_idx).to(dev, torch.int32),
            torch.tensor(pre_last, **i32).to(dev), hq, hkv, d, ps, causal=False, **common,
        )  # fmt: skip
        self._has_tail = causal and tail_ip[-1] > 0
        if self._has_tail:
            self._tail.plan(
                qo.to(dev, torch.int32), torch.tensor(tail_ip, **i32).to(dev), torch.cat(tail_idx).to(dev, torch.int32),
                torch.tensor(tail_last, **i32).to(dev), hq, hkv, d, ps, custom_mask=torch.cat(masks).to(dev), **common,
            )  # fmt: skip

    def run(self, q: torch.Tensor, paged_kv_cache, *, out=None, lse=None, return_lse: bool = False):
        """Attend ``q [qo_indptr[-1], H, D]`` (the same on every rank) over the sharded cache. Returns ``o``
        (all heads, or :attr:`head_range` with ``gather_output=False``) and with ``return_lse`` the LSE in
        ``lse_base``. Collective."""
        from ._merge_api import merge_state_in_place

        p = self._require_plan()
        self._check_out_args(out, lse, return_lse)
        self._prefix.run(q, paged_kv_cache, out=self._o_part, lse=self._lse_part, return_lse=True)
        if self._has_tail:
            self._tail.run(q, paged_kv_cache, out=self._o_tail, lse=self._lse_tail, return_lse=True)
            merge_state_in_place(self._o_part, self._lse_part, self._o_tail, self._lse_tail)
        return self._finish(self._o_part, self._lse_part, out, lse, return_lse, p.out_dtype)


# ----------------------------------------------------------------------------- ring prefill
@dataclass
class _RingCall:
    """One attention call of a ring step: query rows ``[q0, q1)`` against key rows ``[k0, k1)`` of the
    block in hand, with its own planned ragged wrapper."""

    wrapper: object
    q0: int
    q1: int
    k0: int
    k1: int


class RingPrefillWrapper:
    """Prefill with queries and keys sharded across the ranks of ``group`` (ring attention).

    Each request's sequence is cut into ``2W`` chunks; rank ``r`` holds chunks ``r`` and ``2W - 1 - r`` of
    q, k and v (:func:`zigzag_indices` gives its rows: first chunk of every request, then second chunk of
    every request). ``run()`` takes ``W`` steps: at each it starts sending the KV block in hand to rank
    ``r + 1`` and receiving the next from ``r - 1`` (``batch_isend_irecv``), attends the local queries to the
    block in hand, merges the state into the accumulator and waits for the transfer. Under ``causal`` the
    zig-zag gives every rank and step the same work: the own block is causal, a block from a lower rank is
    seen whole by the queries against its first chunk, a block from a higher rank whole by the second chunk.

    Parameters
    ----------
    float_workspace_buffer : uint8 scratch on the compute device.
    group : ``torch.distributed`` process group (None: default).
    lse_base : 2 (default) or "e".

    ``plan(seq_lens, ...)`` is collective (one fingerprint all-gather); ``run(q, k, v)`` returns this rank's
    rows of the output (and LSE), in its local order.
    """

    _where = "RingPrefillWrapper"

    def __init__(self, float_workspace_buffer: torch.Tensor, group=None, *, lse_base=2):
        C.check_tensor("float_workspace_buffer", float_workspace_buffer)
        self._lse_base = _check_lse_base(lse_base)
        self._group = group
        self._world_size, self._rank = _group_info(group, self._where)
        w, r = self._world_size, self._rank
        # P2P ops name their peers by global rank
        glob = (lambda i: i) if group is None else (lambda i: _dist().get_global_rank(group, i))
        self._peers = (glob((r + 1) % w), glob((r - 1) % w))
        self._workspace = float_workspace_buffer
        self._device = float_workspace_buffer.device
        self._planned = None
        self._wrappers: list = []

    @property
    def world_size(self) -> int:
        return self._world_size

    @property
    def rank(self) -> int:
        return self._rank

    def _wrapper(self, i):
        from .prefill import BatchPrefillWithRaggedKVCacheWrapper

        while len(self._wrappers) <= i:
            self._wrappers.append(BatchPrefillWithRaggedKVCacheWrapper(self._workspace))
        return self._wrappers[i]

    def plan(
        self,
        seq_lens,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        causal: bool = False,
        sm_scale: float | None = None,
        logits_soft_cap: float | None = None,
        q_data_type="float16",
        kv_data_type=None,
        o_data_type=None,
    ) -> None:
        """Plan for requests of ``seq_lens [B]`` tokens (whole lengths, the same on every rank; q and k have
        the same length, ``causal`` is then the ordinary lower-triangular mask). Collective."""
        error = None
        same: dict = {}
        try:
            lens = _host_int("seq_lens", seq_lens)
            if bool((lens < 0).any()):
                raise C.value_error("seq_lens", "non-negative lengths", "a negative length")
            C.check_heads(num_qo_heads, num_kv_heads)
            C.check_head_dim(head_dim)
            q_dtype = C.parse_dtype("q_data_type", q_data_type)
            out_dtype = C.parse_dtype("o_data_type", o_data_type, q_dtype)
            self._build(lens, num_qo_heads, num_kv_heads, head_dim, bool(causal), sm_scale, logits_soft_cap,
                        q_data_type, kv_data_type)  # fmt: skip
            same = dict(
                seq_lens=tuple(lens.tolist()), num_qo_heads=num_qo_heads, num_kv_heads=num_kv_heads,
                head_dim=head_dim, causal=bool(causal), sm_scale=sm_scale, logits_soft_cap=logits_soft_cap,
                q_data_type=str(q_dtype), kv_data_type=str(kv_data_type), o_data_type=str(out_dtype),
                lse_base=self._lse_base,
            )  # fmt: skip
        except (ValueError, TypeError, RuntimeError) as e:
            error = e
        _exchange_plan(self._group, self._where, error, same, {})
        kv_dtype = q_dtype if kv_data_type is None else C.parse_dtype("kv_data_type", kv_data_type)
        self._planned = _RingPlan(out_dtype=out_dtype, heads=num_qo_heads, kv_heads=num_kv_heads, head_dim=head_dim,
                                  q_dtype=q_dtype, kv_dtype=kv_dtype)  # fmt: skip

    begin_forward = plan

    def _build(self, lens, hq, hkv, d, causal, sm_scale, cap, q_dt, kv_dt):
        """The attention calls of every ring step (their wrappers planned here, so ``run()`` only launches)."""
        w, r = self._world_size, self._rank
        bs = lens.numel()
        seg = [zigzag_indptr(lens, w, j) for j in range(w)]  # per rank: (first chunk sizes, second chunk sizes)
        rows = [int(a.sum() + b.sum()) for a, b in seg]
        qa, qb = seg[r]
        na = int(qa.sum())
        self._rows_local = rows[r]
        self._rows = rows
        self._max_rows = max(rows)
        common = dict(sm_scale=sm_scale, logits_soft_cap=cap, q_data_type=q_dt, kv_data_type=kv_dt,
                      o_data_type=torch.float32)  # fmt: skip
        calls_per_step: list[list[_RingCall]] = []
        n_wrappers = 0

        def indptr(sizes):
            t = torch.zeros(bs + 1, dtype=torch.int32)
            t[1:] = torch.cumsum(sizes, 0)
            return t

        def add(step_calls, q_sizes, q0, k_sizes, k0, is_causal):
            nonlocal n_wrappers
            nq, nk = int(q_sizes.sum()), int(k_sizes.sum())
            if nq == 0 or nk == 0:
                return
            wr = self._wrapper(n_wrappers)
            n_wrappers += 1
            wr.plan(indptr(q_sizes), indptr(k_sizes), hq, hkv, d, causal=is_causal, **common)
            step_calls.append(_RingCall(wr, q0, q0 + nq, k0, k0 + nk))

        for step in range(w):
            j = (r - step) % w  # whose block is in hand at this step
            ka, kb = seg[j]
            nka = int(ka.sum())
            calls: list[_RingCall] = []
            # With one request both chunks of q (and of k) are adjacent rows, so pieces fuse into one call.
            if not causal:
                if bs == 1:
                    add(calls, qa + qb, 0, ka + kb, 0, False)
                else:
                    for qs, q0 in ((qa, 0), (qb, na)):
                        add(calls, qs, q0, ka, 0, False)
                        add(calls, qs, q0, kb, nka, False)
            elif j == r:
                if bs == 1:
                    add(calls, qa + qb, 0, ka + kb, 0, True)
                else:
                    add(calls, qa, 0, ka, 0, True)
                    add(calls, qb, na, ka, 0, False)
                    add(calls, qb, na, kb, nka, True)
            elif j < r:
                if bs == 1:
                    add(calls, qa + qb, 0, ka, 0, False)
                else:
                    add(calls, qa, 0, ka, 0, False)
                    add(calls, qb, na, ka, 0, False)
            else:
                if bs == 1:
                    add(calls, qb, na, ka + kb, 0, False)
                else:
                    add(calls, qb, na, ka, 0, False)
                    add(calls, qb, na, kb, nka, False)
            calls_per_step.append(calls)
        self._steps = calls_per_step
        self._bufs = None

    def _ring_buffers(self, k, v):
        shape = (self._max_rows,) + tuple(k.shape[1:])
        key = (shape, k.dtype, k.device)
        if self._bufs is None or self._bufs[0] != key:
            mk = lambda: torch.empty(shape, dtype=k.dtype, device=k.device)  # noqa: E731
            self._bufs = (key, [(mk(), mk()), (mk(), mk())])
        return self._bufs[1]

    def _check_inputs(self, q, k, v):
        p = self._planned
        n = self._rows_local
        # every check before the first transfer: a rank that raised after posting its sends would leave the
        # others waiting in the ring
        C.check_tensor("q", q, dim=3, device=self._device, dtypes=(p.q_dtype,))
        C.check_shape("q", q, (n, p.heads, p.head_dim), "[local rows, num_qo_heads, head_dim]")
        C.check_tensor("k", k, dim=3, device=self._device, dtypes=(p.kv_dtype,))
        C.check_shape("k", k, (n, p.kv_heads, p.head_dim), "[local rows, num_kv_heads, head_dim]")
        C.check_tensor("v", v, dim=3, device=self._device, dtypes=(k.dtype,))
        C.check_shape("v", v, tuple(k.shape), "the shape of k")

    def run(self, q, k, v, *, out=None, lse=None, return_lse: bool = False):
        """Ring attention of this rank's ``q [n, Hq, D]`` over every rank's ``k, v [n_r, Hkv, D]`` (NHD; ``n``
        the rows :func:`zigzag_indices` gives this rank). Returns ``o [n, Hq, D]`` (and ``lse [n, Hq]`` float32
        in ``lse_base``), in the local row order. Collective."""
        from ._merge_api import merge_state_in_place

        if self._planned is None:
            raise RuntimeError(f"{self._where}.run(): call plan() first")
        self._check_inputs(q, k, v)
        if out is not None:
            C.check_tensor("out", out, dim=3, device=self._device, dtypes=(self._planned.out_dtype,))
            C.check_shape("out", out, tuple(q.shape), "the shape of q")
        if lse is not None:
            if not return_lse:
                raise ValueError("lse: given but return_lse=False")
            C.check_tensor("lse", lse, dim=2, dtypes=(torch.float32,), device=self._device)
            C.check_shape("lse", lse, tuple(q.shape[:2]), "[local rows, num_qo_heads]")
        w, r = self._world_size, self._rank
        n, hq, d = q.shape
        acc_o = torch.zeros((n, hq, d), dtype=torch.float32, device=q.device)
        acc_l = torch.full((n, hq), float("-inf"), dtype=torch.float32, device=q.device)
        part_o = torch.empty_like(acc_o)
        part_l = torch.empty_like(acc_l)
        k = k.contiguous()
        v = v.contiguous()
        bufs = self._ring_buffers(k, v) if w > 1 else None
        cur_k, cur_v = k, v
        for step in range(w):
            reqs = []
            if step + 1 < w:
                # the block this rank holds next step is the one rank r - 1 holds now
                src_next = (r - step - 1) % w
                rk, rv = bufs[step % 2]
                reqs = self._start_transfer(cur_k, cur_v, rk[: self._rows[src_next]], rv[: self._rows[src_next]])
            for c in self._steps[step]:
                po, pl = part_o[c.q0 : c.q1], part_l[c.q0 : c.q1]
                c.wrapper.run(q[c.q0 : c.q1], cur_k[c.k0 : c.k1], cur_v[c.k0 : c.k1], out=po, lse=pl, return_lse=True)
                merge_state_in_place(acc_o[c.q0 : c.q1], acc_l[c.q0 : c.q1], po, pl)
            for req in reqs:
                req.wait()
            if step + 1 < w:
                rk, rv = bufs[step % 2]
                m = self._rows[(r - step - 1) % w]
                cur_k, cur_v = rk[:m], rv[:m]
        return self._output(acc_o, acc_l, out, lse, return_lse)

    def _output(self, acc_o, acc_l, out, lse, return_lse):
        if out is None:
            out = torch.empty(acc_o.shape, dtype=self._planned.out_dtype, device=acc_o.device)
        out.copy_(acc_o)
        if not return_lse:
            return out
        if lse is None:
            lse = torch.empty_like(acc_l)
        if self._lse_base == 2.0:
            lse.copy_(acc_l)
        else:
            torch.mul(acc_l, LN2, out=lse)
        return out, lse

    def _run_comm_only(self, k, v):
        """The ring's transfers alone (no attention): for measuring the communication share."""
        w, r = self._world_size, self._rank
        if w == 1:
            return
        bufs = self._ring_buffers(k, v)
        cur_k, cur_v = k, v
        for step in range(w - 1):
            rk, rv = bufs[step % 2]
            m = self._rows[(r - step - 1) % w]
            for req in self._start_transfer(cur_k, cur_v, rk[:m], rv[:m]):
                req.wait()
            cur_k, cur_v = rk[:m], rv[:m]

    def _start_transfer(self, send_k, send_v, recv_k, recv_v) -> list:
        """Post the send of the block in hand to rank r + 1 and the receive of rank r - 1's. An empty block
        (a rank whose chunks are all empty) is skipped on both sides, which agree on its size from plan()."""
        dist = _dist()
        nxt, prv = self._peers
        ops = []
        if send_k.shape[0] > 0:
            ops += [
                dist.P2POp(dist.isend, send_k, nxt, group=self._group),
                dist.P2POp(dist.isend, send_v, nxt, group=self._group),
            ]
        if recv_k.shape[0] > 0:
            ops += [
                dist.P2POp(dist.irecv, recv_k, prv, group=self._group),
                dist.P2POp(dist.irecv, recv_v, prv, group=self._group),
            ]
        return dist.batch_isend_irecv(ops) if ops else []
