"""The PyTorch path: the backend contract of ``_backend`` on any device, by per-request gathers.

Each request's keys and values are gathered from the page table (or ragged rows) and handed to the
reference math (``reference.attention``), which is vectorized over heads and queries. It is what CPU
tensors run, and the fallback for variants the Triton kernels do not cover.
"""

from __future__ import annotations

import torch

from . import reference
from ._backend import AttentionBatch, AttentionOptions, Workspace


def supports(opts: AttentionOptions) -> bool:
    return True


def plan(opts: AttentionOptions, batch: AttentionBatch, ws: Workspace):
    return None


def _gather(k4: torch.Tensor, opts: AttentionOptions, batch: AttentionBatch, b: int, kv_len: int):
    start = int(batch.kv_indptr_host[b])
    if opts.paged:
        num_pages = -(-kv_len // opts.page_size)
        pages = batch.kv_indices[start : start + num_pages].long()
        rows = k4[pages].reshape(num_pages * opts.page_size, k4.shape[2], k4.shape[3])
        return rows[:kv_len]
    return k4[start : start + kv_len, 0]


def run(plan_obj, opts, batch, q, k, v, out, lse, *, qk_scale_mult: float = 1.0, v_scale: float = 1.0):
    mask_indptr = None
    if opts.has_custom_mask:
        mask_indptr = batch.extra.get("mask_indptr_host")
        if mask_indptr is None:
            mask_indptr = batch.mask_indptr.cpu()
    for b in range(batch.batch_size):
        qs, qe = int(batch.qo_indptr_host[b]), int(batch.qo_indptr_host[b + 1])
        if qe == qs:
            continue
        kv_len = int(batch.kv_lens_host[b])
        kb = _gather(k, opts, batch, b, kv_len)
        vb = _gather(v, opts, batch, b, kv_len)
        mask = None
        if opts.has_custom_mask:
            seg = batch.mask_packed[int(mask_indptr[b]) : int(mask_indptr[b + 1])]
            mask = reference.unpack_bits(seg, (qe - qs) * kv_len, "little").reshape(qe - qs, kv_len)
        o, s = reference.attention(
            q[qs:qe],
            kb,
            vb,
            causal=opts.causal,
            window_left=opts.window_left,
            logits_soft_cap=opts.logits_soft_cap,
            sm_scale=opts.sm_scale * qk_scale_mult,
            pos_encoding_mode=opts.pos_encoding_mode,
            rope_scale=opts.rope_scale,
            rope_theta=opts.rope_theta,
            custom_mask=mask,
            v_scale=v_scale,
        )
        out[qs:qe] = o.to(out.dtype)
        if lse is not None:
            lse[qs:qe] = s
