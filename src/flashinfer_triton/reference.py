"""The specification in code: every computation of FlashInfer's attention API, written plainly.

Per-request loops, float32 math on upcast inputs, no fused kernels and no cleverness. Tests compare
every fast path (the vectorized PyTorch path and the Triton kernels) against these functions, and
these functions are themselves tested against independent code (``torch.nn.functional.
scaled_dot_product_attention``, ``numpy.packbits``, hand-worked cases).

Conventions (FlashInfer's):

* the log-sum-exp is base 2: ``lse = log2(sum_j exp(s_j))``;
* ``causal`` is aligned to the bottom right: key ``j`` is visible to query ``i`` iff
  ``j <= i + kv_len - qo_len``; ``window_left = w >= 0`` keeps keys with
  ``j >= i + kv_len - qo_len - w``;
* a row that sees no key gets ``o = 0`` and ``lse = -inf``;
* ALiBi with a soft cap: ``s = cap * tanh(sm_scale * (q.k * sm_scale + slope * (j - i)) / cap)``, FlashInfer's
  order (the bias first, ``sm_scale`` applied once more inside the cap).

Outputs are float32 (``o``) and float32 (``lse``); callers cast as they need.
"""

from __future__ import annotations

import math

import torch

LOG2E = 1.4426950408889634

__all__ = [
    "alibi_slopes",
    "apply_rope_llama",
    "attention",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "paged_kv_to_dense",
    "batch_decode_with_paged_kv_cache",
    "batch_prefill_with_paged_kv_cache",
    "batch_prefill_with_ragged_kv_cache",
    "multi_level_cascade_attention",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "append_paged_kv_cache",
    "get_batch_indices_positions",
    "get_seq_lens",
    "packbits",
    "segment_packbits",
    "unpack_segment_mask",
]


# ----------------------------------------------------------------------------- building blocks
def alibi_slopes(num_heads: int) -> torch.Tensor:
    """FlashInfer's ``get_alibi_slopes``: float32 ``[num_heads]``.

    ``n = 2**floor(log2(H))``; slopes ``2**(-8k/n)`` for ``k = 1..n``, then ``2**(-4(2k-1)/n)`` for
    ``k = 1..H-n``.
    """
    n = 2 ** math.floor(math.log2(num_heads))
    slopes = [2.0 ** (-8.0 * k / n) for k in range(1, n + 1)]
    slopes += [2.0 ** (-4.0 * (2 * k - 1) / n) for k in range(1, num_heads - n + 1)]
    return torch.tensor(slopes, dtype=torch.float32)


def apply_rope_llama(
    x: torch.Tensor, positions: torch.Tensor, rope_scale: float = 1.0, rope_theta: float = 1e4
) -> torch.Tensor:
    """Rotate-half (non-interleaved) rotary embedding of ``x [L, H, D]`` at ``positions [L]``.

    Frequency ``t`` (``0 <= t < D/2``) is ``rope_theta ** (-2t/D) / rope_scale``; the pair
    ``(x[t], x[t + D/2])`` is rotated by ``position * freq_t``. Computed in float32.
    """
    x = x.float()
    d = x.shape[-1]
    half = d // 2
    t = torch.arange(half, dtype=torch.float32, device=x.device)
    freq = rope_theta ** (-2.0 * t / d) / rope_scale  # [D/2]
    angle = positions.to(torch.float32)[:, None] * freq[None, :]  # [L, D/2]
    cos = torch.cos(angle)[:, None, :]
    sin = torch.sin(angle)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = False,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    pos_encoding_mode: str = "NONE",
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    custom_mask: torch.Tensor | None = None,
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One request: ``q [qo_len, Hq, D]`` over ``k, v [kv_len, Hkv, D]`` (NHD).

    Returns ``o [qo_len, Hq, D]`` float32 and ``lse [qo_len, Hq]`` float32 (base 2).
    ``custom_mask`` is bool ``[qo_len, kv_len]`` (True = attend) and replaces ``causal``.
    """
    qo_len, num_qo_heads, head_dim = q.shape
    kv_len, num_kv_heads, _ = k.shape
    group = num_qo_heads // num_kv_heads
    device = q.device
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(head_dim)
    scale = sm_scale * (1.0 if q_scale is None else float(q_scale)) * (1.0 if k_scale is None else float(k_scale))
    qf, kf, vf = q.float(), k.float(), v.float()
    if pos_encoding_mode == "ROPE_LLAMA":
        rs = 1.0 if rope_scale is None else rope_scale
        rt = 1e4 if rope_theta is None else rope_theta
        q_pos = torch.arange(qo_len, device=device) + (kv_len - qo_len)
        qf = apply_rope_llama(qf, q_pos, rs, rt)
        kf = apply_rope_llama(kf, torch.arange(kv_len, device=device), rs, rt)
    # Each query head h reads KV head h // group.
    kf = kf.repeat_interleave(group, dim=1)  # [kv_len, Hq, D]
    vf = vf.repeat_interleave(group, dim=1)
    s = torch.einsum("qhd,khd->hqk", qf, kf) * scale  # [Hq, qo_len, kv_len]
    i = torch.arange(qo_len, device=device)[:, None]
    j = torch.arange(kv_len, device=device)[None, :]
    capped = logits_soft_cap is not None and logits_soft_cap > 0
    if pos_encoding_mode == "ALIBI":
        slopes = alibi_slopes(num_qo_heads).to(device)
        s = s + slopes[:, None, None] * (j - i).float()[None]
        if capped:
            # FlashInfer 0.7's order with both: the bias joins the scaled score, and the (fp8-scaled) sm_scale
            # applies once more inside the cap (SPEC.md, "The math").
            s = logits_soft_cap * torch.tanh(s * scale / logits_soft_cap)
    elif capped:
        s = logits_soft_cap * torch.tanh(s / logits_soft_cap)
    visible = torch.ones(qo_len, kv_len, dtype=torch.bool, device=device)
    diag = i + (kv_len - qo_len)  # the key aligned with query i
    if custom_mask is not None:
        visible = custom_mask.to(device=device, dtype=torch.bool).reshape(qo_len, kv_len).clone()
    elif causal:
        visible &= j <= diag
    if window_left is not None and window_left >= 0:
        visible &= j >= diag - window_left
    s = s.masked_fill(~visible[None], float("-inf"))
    lse_e = torch.logsumexp(s, dim=-1)  # [Hq, qo_len], -inf for rows with no key
    has_key = torch.isfinite(lse_e)
    p = torch.exp(s - torch.where(has_key, lse_e, torch.zeros_like(lse_e))[..., None])
    p = torch.where(has_key[..., None], p, torch.zeros_like(p))
    o = torch.einsum("hqk,khd->qhd", p, vf)
    if v_scale is not None:
        o = o * float(v_scale)
    lse = (lse_e * LOG2E).transpose(0, 1).contiguous()  # [qo_len, Hq]
    return o, lse


def _to_nhd(x: torch.Tensor, kv_layout: str) -> torch.Tensor:
    """``[kv_len, H, D]`` from a single-request K or V in ``kv_layout``."""
    return x if kv_layout == "NHD" else x.transpose(0, 1)


# ----------------------------------------------------------------------------- single request
def single_decode_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    q_scale: float | None = None,
    k_scale: float | None = None,
    v_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    sm_scale: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
):
    """``q [Hq, D]`` over one request's K/V; returns ``o [Hq, D]`` (and ``lse [Hq]``), float32."""
    o, lse = attention(
        q[None],
        _to_nhd(k, kv_layout),
        _to_nhd(v, kv_layout),
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        q_scale=q_scale,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return (o[0], lse[0]) if return_lse else o[0]


def single_prefill_with_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    custom_mask: torch.Tensor | None = None,
    packed_custom_mask: torch.Tensor | None = None,
    causal: bool = False,
    kv_layout: str = "NHD",
    pos_encoding_mode: str = "NONE",
    sm_scale: float | None = None,
    window_left: int = -1,
    logits_soft_cap: float | None = None,
    rope_scale: float | None = None,
    rope_theta: float | None = None,
    return_lse: bool = False,
    k_scale: float | None = None,
    v_scale: float | None = None,
):
    """``q [qo_len, Hq, D]`` over one request's K/V; returns ``o`` (and ``lse``), float32."""
    kn, vn = _to_nhd(k, kv_layout), _to_nhd(v, kv_layout)
    if packed_custom_mask is not None and custom_mask is None:
        n = q.shape[0] * kn.shape[0]
        custom_mask = unpack_bits(packed_custom_mask, n, "little").reshape(q.shape[0], kn.shape[0])
    o, lse = attention(
        q,
        kn,
        vn,
        causal=causal,
        window_left=window_left,
        logits_soft_cap=logits_soft_cap,
        sm_scale=sm_scale,
        pos_encoding_mode=pos_encoding_mode,
        rope_scale=rope_scale,
        rope_theta=rope_theta,
        custom_mask=custom_mask,
        k_scale=k_scale,
        v_scale=v_scale,
    )
    return (o, lse) if return_lse else o


# ----------------------------------------------------------------------------- paged and ragged
def paged_kv_to_dense(
    paged_kv_cache, kv_layout: str, indptr, indices, last_page_len, request: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gather request ``request``'s keys and values as ``[kv_len, Hkv, D]`` (NHD) tensors.

    ``paged_kv_cache`` is a 5-D tensor (``[P, 2, PS, H, D]`` NHD / ``[P, 2, H, PS, D]`` HND), a
    ``(k, v)`` tuple of 4-D tensors, or a tuple of 3-D ``[slots, H, D]`` tensors (page size 1).
    """
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k_cache.dim() == 3:  # [slots, H, D]: one token a page
        k_cache, v_cache = k_cache[:, None], v_cache[:, None]
        if kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if kv_layout == "HND":  # [P, H, PS, D] -> [P, PS, H, D]
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    page_size = k_cache.shape[1]
    start, end = int(indptr[request]), int(indptr[request + 1])
    num_pages = end - start
    if num_pages == 0:
        shape = (0, k_cache.shape[2], k_cache.shape[3])
        return k_cache.new_empty(shape), v_cache.new_empty(shape)
    kv_len = (num_pages - 1) * page_size + int(last_page_len[request])
    pages = indices[start:end].long().to(k_cache.device)
    k = k_cache[pages].reshape(num_pages * page_size, k_cache.shape[2], k_cache.shape[3])[:kv_len]
    v = v_cache[pages].reshape(num_pages * page_size, v_cache.shape[2], v_cache.shape[3])[:kv_len]
    return k, v


def _mask_segment(custom_mask, mask_offset: int, qo_len: int, kv_len: int):
    if custom_mask is None:
        return None
    return custom_mask[mask_offset : mask_offset + qo_len * kv_len].reshape(qo_len, kv_len)


def batch_decode_with_paged_kv_cache(
    q: torch.Tensor,
    paged_kv_cache,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
    **options,
):
    """``q [B, Hq, D]``, one query per request; returns ``o [B, Hq, D]`` and ``lse [B, Hq]``."""
    outs, lses = [], []
    for b in range(q.shape[0]):
        k, v = paged_kv_to_dense(paged_kv_cache, kv_layout, indptr, indices, last_page_len, b)
        o, lse = attention(q[b : b + 1], k, v, **options)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def batch_prefill_with_paged_kv_cache(
    q: torch.Tensor,
    qo_indptr: torch.Tensor,
    paged_kv_cache,
    indptr: torch.Tensor,
    indices: torch.Tensor,
    last_page_len: torch.Tensor,
    kv_layout: str = "NHD",
    custom_mask: torch.Tensor | None = None,
    **options,
):
    """Ragged queries ``q [qo_indptr[-1], Hq, D]`` over a paged cache.

    ``custom_mask`` is the flat bool array of all requests' ``[qo_len, kv_len]`` masks, concatenated.
    Returns ``o`` and ``lse`` for every query row.
    """
    outs, lses, offset = [], [], 0
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        k, v = paged_kv_to_dense(paged_kv_cache, kv_layout, indptr, indices, last_page_len, b)
        mask = _mask_segment(custom_mask, offset, qe - qs, k.shape[0])
        offset += (qe - qs) * k.shape[0]
        o, lse = attention(q[qs:qe], k, v, custom_mask=mask, **options)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def batch_prefill_with_ragged_kv_cache(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    qo_indptr: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_layout: str = "NHD",
    custom_mask: torch.Tensor | None = None,
    **options,
):
    """Ragged queries over ragged K/V ``[kv_indptr[-1], Hkv, D]`` (NHD; HND is ``[Hkv, nnz, D]``)."""
    kn, vn = _to_nhd(k, kv_layout), _to_nhd(v, kv_layout)
    outs, lses, offset = [], [], 0
    for b in range(len(qo_indptr) - 1):
        qs, qe = int(qo_indptr[b]), int(qo_indptr[b + 1])
        ks, ke = int(kv_indptr[b]), int(kv_indptr[b + 1])
        mask = _mask_segment(custom_mask, offset, qe - qs, ke - ks)
        offset += (qe - qs) * (ke - ks)
        o, lse = attention(q[qs:qe], kn[ks:ke], vn[ks:ke], custom_mask=mask, **options)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs), torch.cat(lses)


def multi_level_cascade_attention(
    q: torch.Tensor,
    qo_indptr_arr,
    paged_kv_cache,
    paged_kv_indptr_arr,
    paged_kv_indices_arr,
    paged_kv_last_page_len_arr,
    kv_layout: str = "NHD",
    causal: bool = False,
    **options,
):
    """Cascade attention: each level is a batch prefill over its own page table (a level's request
    ``r`` serves query rows ``qo_indptr[r]:qo_indptr[r+1]``); ``causal`` applies to the last level
    only. The levels' states are merged. Returns ``o`` and ``lse`` for every query row."""
    num_levels = len(qo_indptr_arr)
    o_acc = lse_acc = None
    for level in range(num_levels):
        o, lse = batch_prefill_with_paged_kv_cache(
            q,
            qo_indptr_arr[level],
            paged_kv_cache,
            paged_kv_indptr_arr[level],
            paged_kv_indices_arr[level],
            paged_kv_last_page_len_arr[level],
            kv_layout,
            causal=causal and level == num_levels - 1,
            **options,
        )
        if o_acc is None:
            o_acc, lse_acc = o, lse
        else:
            o_acc, lse_acc = merge_state(o_acc, lse_acc, o, lse)
    return o_acc, lse_acc


# ----------------------------------------------------------------------------- attention states
def merge_state(v_a, s_a, v_b, s_b) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention states over disjoint key sets (``v [..., D]``, base-2 ``s [...]``).

    ``s = log2(2**s_a + 2**s_b)``, ``v = (2**s_a v_a + 2**s_b v_b) / 2**s``. An empty side
    (``s = -inf``) leaves the other unchanged; two empty sides give ``v = 0, s = -inf``.
    Returns float32 tensors.
    """
    v_a, v_b, s_a, s_b = v_a.float(), v_b.float(), s_a.float(), s_b.float()
    m = torch.maximum(s_a, s_b)
    m_safe = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    w_a = torch.exp2(s_a - m_safe)
    w_b = torch.exp2(s_b - m_safe)
    total = w_a + w_b
    empty = total == 0
    denom = torch.where(empty, torch.ones_like(total), total)
    v = (v_a * w_a[..., None] + v_b * w_b[..., None]) / denom[..., None]
    s = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log2(denom))
    return v, s


def merge_state_in_place(v, s, v_other, s_other, mask=None) -> None:
    """``(v, s) <- merge((v, s), (v_other, s_other))`` in place, only on rows where ``mask`` is True."""
    v_new, s_new = merge_state(v, s, v_other, s_other)
    if mask is not None:
        keep = ~mask.to(torch.bool)
        v_new = torch.where(keep[:, None, None] if v.dim() == 3 else keep[:, None], v.float(), v_new)
        s_new = torch.where(keep[:, None] if s.dim() == 2 else keep, s.float(), s_new)
    v.copy_(v_new.to(v.dtype))
    s.copy_(s_new.to(s.dtype))


def merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``K`` states: ``v [N, K, H, D]``, ``s [N, K, H]`` -> ``v [N, H, D]``, ``s [N, H]`` (float32)."""
    num_states = v.shape[1]
    if num_states == 0:
        return v.new_zeros(v.shape[0], v.shape[2], v.shape[3]).float(), s.new_full(
            (s.shape[0], s.shape[2]), float("-inf")
        ).float()
    v_acc, s_acc = v[:, 0].float(), s[:, 0].float()
    for k in range(1, num_states):
        v_acc, s_acc = merge_state(v_acc, s_acc, v[:, k], s[:, k])
    return v_acc, s_acc


# ----------------------------------------------------------------------------- page helpers
def get_seq_lens(kv_indptr, kv_last_page_len, page_size: int) -> torch.Tensor:
    """KV length of each request: ``(num_pages - 1) * page_size + last_page_len``, 0 without pages."""
    num_pages = (kv_indptr[1:] - kv_indptr[:-1]).long()
    lens = (num_pages - 1).clamp(min=0) * page_size + kv_last_page_len.long()
    return torch.where(num_pages > 0, lens, torch.zeros_like(lens)).to(torch.int32)


def get_batch_indices_positions(append_indptr, seq_lens, nnz: int):
    """For each appended token: its request and its position in that request's KV (int32 each).

    Request ``b`` appends ``append_indptr[b+1] - append_indptr[b]`` tokens at the end of its
    ``seq_lens[b]`` tokens (the length after appending).
    """
    batch_indices = torch.empty(nnz, dtype=torch.int32)
    positions = torch.empty(nnz, dtype=torch.int32)
    for b in range(len(append_indptr) - 1):
        start, end = int(append_indptr[b]), int(append_indptr[b + 1])
        for t in range(start, end):
            batch_indices[t] = b
            positions[t] = int(seq_lens[b]) - (end - start) + (t - start)
    return batch_indices, positions


def append_paged_kv_cache(
    append_key,
    append_value,
    batch_indices,
    positions,
    paged_kv_cache,
    kv_indices,
    kv_indptr,
    kv_last_page_len,
    kv_layout: str = "NHD",
) -> None:
    """Write token ``t`` at position ``positions[t]`` of request ``batch_indices[t]``: page
    ``kv_indices[kv_indptr[b] + pos // page_size]``, slot ``pos % page_size``. Touches nothing else."""
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache[:, 0], paged_kv_cache[:, 1]
    if k_cache.dim() == 3:
        k_cache, v_cache = k_cache[:, None], v_cache[:, None]
        if kv_layout == "HND":
            k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    if kv_layout == "HND":
        k_cache, v_cache = k_cache.transpose(1, 2), v_cache.transpose(1, 2)
    page_size = k_cache.shape[1]
    for t in range(append_key.shape[0]):
        b, pos = int(batch_indices[t]), int(positions[t])
        page = int(kv_indices[int(kv_indptr[b]) + pos // page_size])
        k_cache[page, pos % page_size] = append_key[t].to(k_cache.dtype)
        v_cache[page, pos % page_size] = append_value[t].to(v_cache.dtype)


# ----------------------------------------------------------------------------- bit packing
def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """``numpy.packbits`` of a flat bool tensor: 8 elements a byte, the last byte zero-padded."""
    bits = x.reshape(-1).to(torch.bool).tolist()
    out = []
    for start in range(0, len(bits), 8):
        chunk = bits[start : start + 8]
        byte = 0
        for idx, bit in enumerate(chunk):
            if bit:
                byte |= 1 << (7 - idx if bitorder == "big" else idx)
        out.append(byte)
    return torch.tensor(out, dtype=torch.uint8)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` on its own; returns ``(packed, new_indptr)``
    with ``new_indptr = cumsum(ceil(len / 8))``."""
    pieces, new_indptr = [], [0]
    for i in range(len(indptr) - 1):
        seg = x[int(indptr[i]) : int(indptr[i + 1])]
        packed = packbits(seg, bitorder)
        pieces.append(packed)
        new_indptr.append(new_indptr[-1] + packed.numel())
    packed = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8)
    return packed, torch.tensor(new_indptr, dtype=torch.int32)


def unpack_bits(packed: torch.Tensor, n: int, bitorder: str = "little") -> torch.Tensor:
    """The first ``n`` bits of ``packed`` (uint8) as a bool tensor."""
    shifts = torch.arange(8, device=packed.device)
    if bitorder == "big":
        shifts = 7 - shifts
    bits = (packed.to(torch.int32)[:, None] >> shifts[None, :]) & 1
    return bits.reshape(-1)[:n].to(torch.bool)


def unpack_segment_mask(packed: torch.Tensor, mask_indptr, qo_lens, kv_lens, bitorder: str = "little"):
    """Inverse of ``segment_packbits`` for a batch mask: the flat bool mask of all requests."""
    parts = []
    for b in range(len(qo_lens)):
        start = int(mask_indptr[b])
        parts.append(unpack_bits(packed[start : int(mask_indptr[b + 1])], int(qo_lens[b]) * int(kv_lens[b]), bitorder))
    return torch.cat(parts) if parts else torch.empty(0, dtype=torch.bool)
