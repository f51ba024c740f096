"""Test data built independently of the library: dense per-request K/V written into paged caches."""

from __future__ import annotations

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)


def i32(*values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def rand_kv(n, heads, dim, dtype, device):
    """Random K/V values; fp8 ones are drawn in float32 then cast."""
    x = torch.randn(n, heads, dim, device=device)
    return x.to(dtype)


def make_paged(kv_lens, page_size, num_kv_heads, head_dim, dtype, device, layout="NHD", form="5d", spare_pages=2):
    """A paged cache holding random per-request K/V; pages assigned in shuffled order.

    Returns (cache, indptr, indices, last_page_len, ks, vs) with ks[b], vs[b] the dense NHD K/V of request b.
    form: "5d" (one tensor), "tuple" (a (k, v) pair of 4-D tensors), "3d" (a pair of [slots, H, D], page size 1,
    the same in both layouts).
    """
    pages_per = [-(-n // page_size) for n in kv_lens]
    total_pages = sum(pages_per) + spare_pages
    perm = torch.randperm(total_pages)
    k_pages = torch.randn(total_pages, page_size, num_kv_heads, head_dim, device=device).to(dtype)
    v_pages = torch.randn(total_pages, page_size, num_kv_heads, head_dim, device=device).to(dtype)
    indptr, indices, last, ks, vs = [0], [], [], [], []
    cursor = 0
    for n, p in zip(kv_lens, pages_per):
        pages = perm[cursor : cursor + p]
        cursor += p
        indices += pages.tolist()
        indptr.append(indptr[-1] + p)
        last.append(n - (p - 1) * page_size if p else 0)
        ks.append(k_pages[pages.to(device)].reshape(-1, num_kv_heads, head_dim)[:n])
        vs.append(v_pages[pages.to(device)].reshape(-1, num_kv_heads, head_dim)[:n])
    if form == "3d":
        assert page_size == 1
        cache = (k_pages[:, 0], v_pages[:, 0])  # [slots, H, D] whatever the layout
    else:
        kc, vc = k_pages, v_pages
        if layout == "HND":
            kc, vc = kc.transpose(1, 2).contiguous(), vc.transpose(1, 2).contiguous()
        cache = torch.stack([kc, vc], dim=1) if form == "5d" else (kc, vc)
    return (
        cache,
        torch.tensor(indptr, dtype=torch.int32, device=device),
        torch.tensor(indices, dtype=torch.int32, device=device),
        torch.tensor(last, dtype=torch.int32, device=device),
        ks,
        vs,
    )


def case_id(**kw) -> str:
    return "-".join(f"{k}{v}" for k, v in kw.items())


def expected_decode(q, ks, vs, **opts):
    """The float32 reference for one query row per request: (out [B, Hq, D], lse [B, Hq])."""
    from flashinfer_triton import reference as R

    outs, lses = [], []
    for b in range(q.shape[0]):
        o, lse = R.attention(q[b : b + 1].float(), ks[b].float(), vs[b].float(), **opts)
        outs.append(o[0])
        lses.append(lse[0])
    return torch.stack(outs), torch.stack(lses)


class LaunchRecorder:
    """Stands in for a Triton kernel that the library launches positionally (``kernel.run(*args, ...)``):
    records each launch's arguments by parameter name in ``seen``, then launches the real kernel."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.arg_names = kernel.arg_names
        self.seen: list[dict] = []

    def run(self, *args, **kw):
        self.seen.append(dict(zip(self.arg_names, args, strict=False)))
        return self.kernel.run(*args, **kw)
