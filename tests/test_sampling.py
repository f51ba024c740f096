"""``flashinfer_triton.sampling`` against exact float64 distributions.

* ``test_*_inverse_cdf``: the uniforms are fixed (``_uniforms`` patched), so every draw must be the
  exact inverse CDF of the filtered, renormalised reference distribution at that uniform. This pins the
  kept set and the draw rule exactly, on the PyTorch path and on the Triton kernel, for every sampler but
  top-p alone, which draws by rejection rounds (its chain is pinned in ``test_sampling_topp.py``); the
  row-split kernels' exact top-p threshold, which FlashInfer 0.2's caller-drawn uniforms still take, is
  pinned here through the kernels' launch.
* ``test_*_chi_square``: many draws at fixed generator seeds against the exact distribution (Pearson's
  chi-square at p = 1e-4; a token outside the kept set fails at once): the PyTorch path and the
  interpreter kernel on small vocabularies, the GPU kernel on vocabularies of 32k to 256k.
* renorm / mask / softmax: against the reference for every dtype; chain speculative sampling: the
  emitted token's distribution equals the target's, and the bookkeeping.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET, assert_close
from flashinfer_triton import _config, clear_host_caches, host_caches, sampling
from helpers import use_config

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def _paths(gpu: bool = True):
    ps = [pytest.param("torch", id="torch"), pytest.param("kernel", id="kernel", marks=pytest.mark.interpret)]
    if gpu:
        ps.append(pytest.param("gpu", id="gpu", marks=pytest.mark.gpu))
    return ps


def _device(path: str) -> str:
    if path == "torch":
        if INTERPRET:
            pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


# ----------------------------------------------------------------------------------------------- reference


def ref_kept(p: torch.Tensor, top_k=None, top_p=None, min_p=None, order="joint") -> torch.Tensor:
    """Kept probabilities (float64, renormalised) of one row under the filters, from a sort."""
    p = p.double().cpu()
    V = p.numel()
    keep = torch.ones(V, dtype=torch.bool)
    srt, perm = torch.sort(p, descending=True)
    if top_k is not None and 0 < top_k < V:
        keep &= p >= srt[top_k - 1]
    if top_p is not None and top_p < 1.0:
        base = torch.where(keep, p, 0.0) if order == "top_k_first" else p
        s = torch.sort(base, descending=True).values
        m = int(torch.searchsorted(torch.cumsum(s, 0), top_p * base.sum()))
        keep &= p >= s[min(m, V - 1)]
    if min_p is not None:
        keep &= p >= min_p * p.max()
    w = torch.where(keep, p, 0.0)
    return w / w.sum()


def ref_kept_rows(p: torch.Tensor, top_k=None, top_p=None, order="joint") -> torch.Tensor:
    """``ref_kept`` of every row at once (per-row ``top_k`` / ``top_p`` tensors), in float64 on the rows'
    device."""
    p = p.double()
    n, V = p.shape
    keep = torch.ones_like(p, dtype=torch.bool)
    srt = torch.sort(p, 1, descending=True).values
    if top_k is not None:
        k = top_k.long().to(p.device)
        kth = srt.gather(1, (k.clamp(1, V) - 1)[:, None])
        keep &= ~((k > 0) & (k < V))[:, None] | (p >= kth)
    if top_p is not None:
        tp = top_p.double().to(p.device)
        base = torch.where(keep, p, 0.0) if order == "top_k_first" else p
        sb = torch.sort(base, 1, descending=True).values if order == "top_k_first" else srt
        m = torch.searchsorted(torch.cumsum(sb, 1), (tp * base.sum(1))[:, None].contiguous()).clamp(max=V - 1)
        keep &= ~(tp < 1.0)[:, None] | (p >= sb.gather(1, m))
    w = torch.where(keep, p, 0.0)
    return w / w.sum(1, keepdim=True)


def chi_square_ok(samples: torch.Tensor, dist: torch.Tensor, what: str) -> None:
    """Pearson's chi-square of the draws against ``dist`` (p = 1e-4; rare cells pooled); a draw outside
    the support fails outright."""
    samples = samples.long().cpu()
    n = samples.numel()
    V = dist.numel()
    assert int(samples.min()) >= 0 and int(samples.max()) < V, f"{what}: sample out of range"
    outside = dist[samples] == 0
    assert not outside.any(), f"{what}: token {int(samples[outside][0])} drawn outside the kept set"
    counts = torch.bincount(samples, minlength=V).double()
    exp = dist * n
    big = exp >= 5
    obs_c = torch.cat([counts[big], counts[~big].sum()[None]])
    exp_c = torch.cat([exp[big], exp[~big].sum()[None]])
    sel = exp_c > 0
    obs_c, exp_c = obs_c[sel], exp_c[sel]
    stat = float(((obs_c - exp_c) ** 2 / exp_c).sum())
    dof = max(int(sel.sum()) - 1, 1)
    z = 3.719  # one-sided normal quantile of 1e-4; Wilson-Hilferty approximation of the chi-square quantile
    crit = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert stat < crit, f"{what}: chi-square {stat:.1f} >= {crit:.1f} (dof {dof}, {n} draws)"


def _probs(rows: int, V: int, device, dtype=torch.float32, scale=1.5) -> torch.Tensor:
    return torch.softmax(torch.randn(rows, V) * scale, dim=1).to(device=device, dtype=dtype)


def _gap_top_p(p: torch.Tensor, m: int) -> float:
    """A top_p whose nucleus is exactly the top ``m + 1`` tokens, halfway between two cumulative sums."""
    cs = torch.cumsum(torch.sort(p.double().cpu(), descending=True).values, 0)
    return float((cs[m - 1] + cs[m]) / 2) / float(cs[-1])


# Each case: (name, call(probs_or_logits, indices, **kw), reference kept distribution of a row).
def _cases(p: torch.Tensor):
    k1, k2 = 3, 6
    tp1, tp2 = _gap_top_p(p[0], 4), _gap_top_p(p[1], 2)
    dev = p.device
    return [
        ("sampling_from_probs", lambda x, idx, n, **kw: sampling.sampling_from_probs(x, idx, **kw),
         lambda r: ref_kept(p[r])),
        ("top_k", lambda x, idx, n, **kw: sampling.top_k_sampling_from_probs(x, k1, idx, **kw),
         lambda r: ref_kept(p[r], top_k=k1)),
        ("top_p", lambda x, idx, n, **kw: sampling.top_p_sampling_from_probs(x, tp1, idx, **kw),
         lambda r: ref_kept(p[r], top_p=tp1)),
        ("min_p", lambda x, idx, n, **kw: sampling.min_p_sampling_from_probs(x, 0.2, idx, **kw),
         lambda r: ref_kept(p[r], min_p=0.2)),
        ("top_k_top_p_joint_per_row",
         lambda x, idx, n, **kw: sampling.top_k_top_p_sampling_from_probs(
             x, torch.tensor([k2, k1], device=dev)[idx.long()], torch.tensor([tp1, tp2], device=dev)[idx.long()],
             idx, filter_apply_order="joint", **kw),
         lambda r: ref_kept(p[r], top_k=[k2, k1][r], top_p=[tp1, tp2][r])),
        ("top_k_top_p_k_first",
         lambda x, idx, n, **kw: sampling.top_k_top_p_sampling_from_probs(x, k2, 0.6, idx, **kw),
         lambda r: ref_kept(p[r], top_k=k2, top_p=0.6, order="top_k_first")),
    ]  # fmt: skip


# ----------------------------------------------------------------------------------------------- exact draws


@pytest.mark.parametrize("path", _paths())
def test_sampling_inverse_cdf(path, monkeypatch):
    """Fixed uniforms: each draw is the reference inverse CDF of the kept distribution."""
    dev = _device(path)
    V = 4096 if path == "gpu" else 48
    _check_inverse_cdf(_probs(2, V, dev, scale=3.0 if path == "gpu" else 1.5), monkeypatch)


def _small_chunks(**fields) -> _config.SamplingConfig:
    """The default sampling configuration with chunks of 256: rows of a thousand entries split into four."""
    return dataclasses.replace(_config.SAMPLING, chunk_min=256, chunk_max=256, **fields)


# (fields of the sampling configuration, whether bands overflow the slots): enough slots; too few (the second
# level, and for the bands it cannot narrow to 16 the row-wise search); a coarse top-p grid (a binade a pivot) over
# slots for the whole row, its candidates searched from memory 16 at a time and the fallback's tile smaller than the
# row; a top-p grid over 16 binades, 4 pivots a binade.
ROW_SPLIT_CASES = [
    pytest.param(dict(cand_slots=512), False, id="candidates"),
    pytest.param(dict(cand_slots=16), True, id="fallback"),
    pytest.param(dict(cand_slots=1024, pivots_p=32, search_cells=128, finish_block=64), False, id="coarse"),
    pytest.param(dict(cand_slots=512, pivots_p=64, binades_p=16), False, id="binades"),
]


@pytest.mark.interpret
@pytest.mark.parametrize(("fields", "falls_back"), ROW_SPLIT_CASES)
def test_row_split_inverse_cdf(fields, falls_back, monkeypatch, request):
    """Rows cut into several chunks (forced small): the pivot counts, the candidate band and the
    chunk-wise draw give the reference inverse CDF; with too few candidate slots, rows whose band
    overflows take the second level (or the exact single-program search), with the same draws. The interpreter
    runs the kernels as Python, so it also sees which rows left the first level: none with enough slots."""
    from flashinfer_triton.kernels import sampling as kernels

    dev = "cuda" if HAS_CUDA else "cpu"
    if dev == "cpu" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    use_config(request, sampling=_small_chunks(**fields))
    fallbacks = []
    search_row, fine = kernels._thresholds, kernels._fine_threshold

    def counted(*args, **kwargs):  # called by the finish only when a row falls back
        fallbacks.append(1)
        return search_row(*args, **kwargs)

    def counted_fine(*args, **kwargs):  # only when a row's band overflows the slots
        fallbacks.append(2)
        return fine(*args, **kwargs)

    if INTERPRET:  # compiled kernels resolve the @triton.jit search at compile time: only the interpreter can count
        monkeypatch.setattr(kernels, "_thresholds", counted)
        monkeypatch.setattr(kernels, "_fine_threshold", counted_fine)
    p = _probs(3, 1000, dev, scale=3.0)
    _check_inverse_cdf(p[:2], monkeypatch, n_u=4)
    # A wide nucleus (hundreds of candidates: more than 16 slots hold), logits, and the split softmax.
    u = torch.rand(3, 1, device=dev)
    monkeypatch.setattr(sampling, "_uniforms", lambda n, n_u, *a, **k: u[:n])
    logits = torch.randn(3, 1000, device=dev) * 2
    for name, got, dist in [
        ("top_p 0.97", _top_p_exact(p, 0.97, u), lambda r: ref_kept(p[r], top_p=0.97)),
        ("logits", sampling.sampling_from_logits(logits), lambda r: torch.softmax(logits[r].double().cpu(), 0)),
    ]:
        for r in range(3):
            cdf = torch.cumsum(dist(r), 0)
            ur = float(u[r])
            if (cdf - ur).abs().min() > 1e-5:
                expect = int(torch.searchsorted(cdf, torch.tensor([ur], dtype=torch.float64), right=True))
                assert int(got[r]) == expect, f"{name}: row {r}: got {int(got[r])}, expected {expect}"
    assert_close(sampling.softmax(logits, 0.7), torch.softmax(logits.double() / 0.7, 1), 1e-6, 1e-3, name="softmax")
    if INTERPRET:
        if falls_back:
            assert 2 in fallbacks, f"no row overflowed {fields}: the second level went untested"
        else:
            assert not fallbacks, f"{len(fallbacks)} rows fell back with {fields}"


@pytest.mark.interpret
def test_row_split_pivot_mismatch_falls_back(monkeypatch, request):
    """The pivot pass classifies elements by integer interval indices, the compaction by float compares on
    the pivot values the band pass computes (``_pivots``, one program a row). Should those values ever
    disagree with the intervals (a differently rounded pivot), the compaction's per-chunk counts disagree
    with the offsets: every such row must take the exact row-wise search, with the reference draws.
    Doubling the band pass's pivot values makes the two disagree."""
    from flashinfer_triton.kernels import sampling as kernels

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    use_config(request, sampling=_small_chunks())
    rows, V = 2, 1000
    calls, fallbacks = [], []
    pivots, search_row = kernels._pivots, kernels._thresholds

    def shifted(*args, **kwargs):
        v, *rest = pivots(*args, **kwargs)
        calls.append(1)
        return (v * 2.0, *rest)  # a binade: elements near every band edge cross it

    def counted(*args, **kwargs):
        fallbacks.append(1)
        return search_row(*args, **kwargs)

    monkeypatch.setattr(kernels, "_pivots", shifted)
    monkeypatch.setattr(kernels, "_thresholds", counted)
    p = _probs(rows, V, dev, scale=3.0)
    u = torch.tensor([[0.3], [0.8]], device=dev)
    monkeypatch.setattr(sampling, "_uniforms", lambda n, n_u, *a, **k: u[:n])
    got = _top_p_exact(p, 0.9, u).cpu()
    assert len(calls) == rows and len(fallbacks) == rows  # the band pass: one program a row
    for r in range(rows):
        cdf = torch.cumsum(ref_kept(p[r], top_p=0.9), 0)
        expect = int(torch.searchsorted(cdf, u[r].double().cpu(), right=True))
        assert int(got[r]) == expect, f"row {r}: got {int(got[r])}, expected {expect}"


def _top_p_exact(p: torch.Tensor, top_p: float, u: torch.Tensor) -> torch.Tensor:
    """Top-p alone through the exact threshold and one uniform a row (the row-split kernels), launched directly: the
    public top-p sampler draws by rejection rounds unless given FlashInfer 0.2's uniforms."""
    from flashinfer_triton.kernels import sampling as kernels

    n = p.shape[0]
    out = torch.full((n,), -1, dtype=torch.int32, device=p.device)
    valid = torch.zeros(n, dtype=torch.bool, device=p.device)
    kernels.launch_sample(p, None, u, out, valid, None, top_p, None, False, False)
    assert bool(valid.all())
    return out


def _check_inverse_cdf(p: torch.Tensor, monkeypatch, n_u: int = 8) -> None:
    dev = p.device
    u = ((torch.arange(n_u, dtype=torch.float64) + torch.rand(n_u, dtype=torch.float64)) / n_u).float()
    idx = torch.arange(2, dtype=torch.int32, device=dev).repeat_interleave(n_u)
    uu = u.repeat(2)[:, None].to(dev)
    monkeypatch.setattr(sampling, "_uniforms", lambda n, n_u, *a, **k: uu[:n])
    for name, call, ref in _cases(p):
        if name == "top_p":
            continue  # (top-p alone draws by rejection rounds: test_sampling_topp.py)
        got = call(p, idx, 2 * n_u).cpu()
        for r in range(2):
            cdf = torch.cumsum(ref(r), 0)
            for j in range(n_u):
                uj = float(u[j])
                if (cdf - uj).abs().min() < 1e-5:
                    continue  # a uniform on a CDF step: float rounding may pick either side
                expect = int(torch.searchsorted(cdf, torch.tensor([uj], dtype=torch.float64), right=True))
                assert int(got[r * n_u + j]) == expect, (
                    f"{name}: row {r}, u={uj:.6f}: got {int(got[r * n_u + j])}, expected {expect}"
                )


@pytest.mark.parametrize("path", _paths())
def test_sampling_from_logits_inverse_cdf(path, monkeypatch):
    dev = _device(path)
    logits = (torch.randn(3, 40) * 2).to(dev)
    u = torch.rand(3, 1).to(dev)
    monkeypatch.setattr(sampling, "_uniforms", lambda n, n_u, *a, **k: u[:n])
    got = sampling.sampling_from_logits(logits).cpu()
    for r in range(3):
        cdf = torch.cumsum(torch.softmax(logits[r].double().cpu(), 0), 0)
        expect = int(torch.searchsorted(cdf, u[r].double().cpu(), right=True))
        if (cdf - float(u[r])).abs().min() > 1e-5:
            assert int(got[r]) == expect


# ----------------------------------------------------------------------------------------------- statistics


@pytest.mark.parametrize("seed", [0, 1])
def test_sampling_chi_square_torch(seed):
    if INTERPRET:
        pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
    p = _probs(2, 32, "cpu")
    n = 4000
    idx = torch.arange(2, dtype=torch.int32).repeat(n)
    for name, call, ref in _cases(p):
        gen = torch.Generator().manual_seed(seed)
        s = call(p, idx, 2 * n, generator=gen)
        assert s.dtype == torch.int32
        for r in range(2):
            chi_square_ok(s[r::2], ref(r), f"{name} row {r}")


@pytest.mark.interpret
def test_sampling_chi_square_kernel():
    """The interpreter runs one program at a time: few draws, few cells, on the filtered sampler."""
    dev = "cuda" if HAS_CUDA else "cpu"
    if dev == "cpu" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    p = torch.tensor([[0.05, 0.3, 0.02, 0.2, 0.13, 0.25, 0.01, 0.04]], device=dev)
    n = 160
    idx = torch.zeros(n, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    s = sampling.top_k_top_p_sampling_from_probs(p, 5, 0.8, idx, filter_apply_order="joint", generator=gen)
    chi_square_ok(s, ref_kept(p[0], top_k=5, top_p=0.8), "joint top-k top-p (interpreter)")


@pytest.mark.interpret
def test_band_over_the_slots_chi_square_kernel(monkeypatch, request):
    """A flat row (every probability within a few percent of the others: a band of one pivot interval holding the
    whole row, more than the 16 slots): the second level's bins narrow it, and the draws follow the exact joint
    top-k / top-p distribution (chi-square), with no row on the row-wise search. The nucleus is kept small (6 of
    24 tokens) so that 60 draws see every kept token: a threshold one token off fails the support check (a
    chi-square over 15 near-equal cells of 8 draws each would miss a dropped token)."""
    from flashinfer_triton.kernels import sampling as kernels

    if not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    use_config(request, sampling=_small_chunks(cand_slots=16))
    paths = []
    search_row, fine = kernels._thresholds, kernels._fine_threshold
    monkeypatch.setattr(kernels, "_thresholds", lambda *a, **k: paths.append("row") or search_row(*a, **k))
    monkeypatch.setattr(kernels, "_fine_threshold", lambda *a, **k: paths.append("fine") or fine(*a, **k))
    gen = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(1, 24, generator=gen) * 0.02, dim=1).to(dev)
    n = 60
    idx = torch.zeros(n, dtype=torch.int32, device=dev)
    g = torch.Generator(device=dev).manual_seed(3)
    s = sampling.top_k_top_p_sampling_from_probs(p, 8, 0.25, idx, filter_apply_order="joint", generator=g)
    want = ref_kept(p[0], top_k=8, top_p=0.25)
    assert int((want > 0).sum()) == 6  # (top-p binds: 6 tokens, each drawn with probability 1 - (5/6)^60 ~ 1)
    chi_square_ok(s, want, "joint top-k 8 top-p 0.25, flat row over the slots")
    drawn = sorted(set(s.cpu().tolist()))
    assert drawn == (want > 0).nonzero()[:, 0].tolist(), f"drew {drawn}"
    assert paths and set(paths) == {"fine"}, f"paths taken: {sorted(set(paths))}"


@pytest.mark.gpu
def test_sampling_chi_square_gpu():
    """Large vocabularies (32000, 256000): 24 hot tokens over a floor of tiny probabilities; every op,
    20k draws a row, all in one launch (``indices`` repeat the rows). One test, so one process compiles
    each kernel variant once."""
    dev = "cuda"
    for V in (32000, 256000):
        w = torch.rand(2, V, device=dev) * 1e-7
        hot = torch.stack([torch.randperm(V, device=dev)[:24] for _ in range(2)])
        w.scatter_(1, hot, torch.rand(2, 24, device=dev) + 0.2)
        p = w / w.sum(1, keepdim=True)
        n = 20000
        idx = torch.arange(2, dtype=torch.int32, device=dev).repeat(n)
        for name, call, ref in _cases(p):
            gen = torch.Generator(device=dev).manual_seed(7)
            s = call(p, idx, 2 * n, generator=gen)
            for r in range(2):
                chi_square_ok(s[r::2], ref(r), f"{name} V={V} row {r}")


@pytest.mark.gpu
def test_sampling_kept_set_gpu():
    """Every draw of every row lies in the row's exact kept set (per-row top_k / top_p), on vocabularies
    of 32000-256000 at batch 1-512; top-p alone over wide nuclei too."""
    dev = "cuda"
    for V in (32000, 128256, 256000):
        for batch in (1, 37, 512):
            p = torch.softmax(torch.randn(batch, V, device=dev) * 4, dim=1)
            top_k = torch.randint(1, 200, (batch,), device=dev)
            top_p = torch.rand(batch, device=dev) * 0.9 + 0.05
            for order in ("top_k_first", "joint"):
                s = sampling.top_k_top_p_sampling_from_probs(p, top_k, top_p, filter_apply_order=order).long()
                kept = ref_kept_rows(p, top_k, top_p, order).gather(1, s[:, None])[:, 0]
                assert (kept > 0).all(), f"V={V} B={batch} {order}: rows {(kept == 0).nonzero()[:4, 0].tolist()}"
            s = sampling.top_p_sampling_from_probs(p, top_p).long()
            kept = ref_kept_rows(p, top_p=top_p).gather(1, s[:, None])[:, 0]
            assert (kept > 0).all(), f"V={V} B={batch} top_p: rows {(kept == 0).nonzero()[:4, 0].tolist()}"
            s = sampling.sampling_from_probs(p, check_nan=True).long()
            assert (p.gather(1, s[:, None]) > 0).all()


@pytest.mark.gpu
def test_row_split_matches_row_wise_gpu():
    """The row-split kernels and the one-program-per-row search draw the same tokens from the same
    uniforms (both are exact; a differently rounded running sum may flip a draw sitting on a CDF step),
    on the benchmark's vocabularies at batch 1, 32 and 256 (all in one test: one compile per variant)."""
    from flashinfer_triton.kernels import sampling as kernels

    dev = "cuda"
    for V in (49152, 128256):
        for batch in (1, 32, 256):
            p = torch.softmax(torch.randn(batch, V, device=dev) * 3, dim=1)
            u = torch.rand(batch, device=dev)
            top_k = torch.randint(1, 300, (batch,), device=dev, dtype=torch.int32)
            top_p = torch.rand(batch, device=dev) * 0.9 + 0.05
            for k, tp, k_first in [(None, None, False), (top_k, None, False), (None, top_p, False), (50, 0.9, True),
                                   (top_k, top_p, True), (top_k, top_p, False)]:  # fmt: skip
                got = []
                for launch in (kernels._launch_sample_split, kernels._launch_sample_rowwise):
                    out = torch.full((batch,), -1, dtype=torch.int32, device=dev)
                    valid = torch.zeros(batch, dtype=torch.int8, device=dev)
                    launch(p, None, u, out, valid, k, tp, None, False, k_first)
                    assert bool(valid.bool().all())
                    got.append(out.cpu())
                diff = int((got[0] != got[1]).sum())
                what = f"V={V} B={batch} k={k is not None} p={tp is not None} k_first={k_first}"
                assert diff <= batch // 100, f"{what}: {diff} draws differ"
            sm = torch.full_like(p, float("nan"))
            kernels._launch_softmax_split(p, sm, 0.8)
            assert_close(sm, torch.softmax(p.double() / 0.8, 1), 1e-6, 1e-3, name="row-split softmax")


@pytest.mark.gpu
def test_flat_rows_second_level_gpu():
    """Flat rows (softmax of randn and of 2 * randn at V=128256: top-p bands of thousands of elements, over the 8192
    slots for randn; and a constant row, whose band is the whole row): the row-split kernels draw what the
    one-program-per-row search draws from the same uniforms, and every draw lies in the exact kept set."""
    from flashinfer_triton.kernels import sampling as kernels

    dev = "cuda"
    V, batch = 128256, 32
    torch.manual_seed(11)
    for what, p in [("randn", torch.softmax(torch.randn(batch, V, device=dev), 1)),
                    ("2 randn", torch.softmax(torch.randn(batch, V, device=dev) * 2, 1)),
                    ("constant", torch.full((batch, V), 1.0 / V, device=dev))]:  # fmt: skip
        u = torch.rand(batch, device=dev)
        top_k = torch.randint(1, 20000, (batch,), device=dev, dtype=torch.int32)
        top_p = torch.rand(batch, device=dev) * 0.9 + 0.05
        for k, tp, k_first in [(None, top_p, False), (top_k, None, False), (top_k, top_p, True), (top_k, top_p, False)]:
            got = []
            for launch in (kernels._launch_sample_split, kernels._launch_sample_rowwise):
                out = torch.full((batch,), -1, dtype=torch.int32, device=dev)
                valid = torch.zeros(batch, dtype=torch.int8, device=dev)
                launch(p, None, u, out, valid, k, tp, None, False, k_first)
                assert bool(valid.bool().all())
                got.append(out.cpu())
            case = f"{what} k={k is not None} p={tp is not None} k_first={k_first}"
            # (the two sum the kept mass in different orders; a kept entry of a flat row weighs ~1e-5, so a draw
            # whose target lies within a float32 rounding of a CDF step, rare, may flip)
            assert int((got[0] != got[1]).sum()) <= 2, f"{case}: {int((got[0] != got[1]).sum())} draws differ"
            order = "top_k_first" if k_first else "joint"
            kept = ref_kept_rows(p, k, tp, order).gather(1, got[0].to(dev).long()[:, None])[:, 0]
            assert (kept > 0).all(), f"{case}: rows {(kept == 0).nonzero()[:4, 0].tolist()} outside the kept set"


@pytest.mark.gpu
def test_row_split_pdl_same_draws_gpu():
    """Programmatic dependent launches (``SamplingConfig.pdl``) change only when each kernel starts: from the same
    uniforms the row-split kernels draw the same tokens, and softmax writes the same values, as without them, also
    when captured in a CUDA graph."""
    from flashinfer_triton.kernels import sampling as kernels

    dev = "cuda"
    V = 128256
    results = {}
    for pdl in (False, True):
        with _config.using(sampling=dataclasses.replace(_config.SAMPLING, pdl=pdl)):
            torch.manual_seed(3)
            for batch in (1, 256):
                p = torch.softmax(torch.randn(batch, V, device=dev) * 3, dim=1)
                u = torch.rand(batch, device=dev)
                top_k = torch.randint(1, 300, (batch,), device=dev, dtype=torch.int32)
                top_p = torch.rand(batch, device=dev) * 0.9 + 0.05
                for j, (k, tp, k_first) in enumerate([(None, None, False), (top_k, None, False), (None, top_p, False),
                                                      (top_k, top_p, True)]):  # fmt: skip
                    out = torch.full((batch,), -1, dtype=torch.int32, device=dev)
                    valid = torch.zeros(batch, dtype=torch.int8, device=dev)
                    kernels._launch_sample_split(p, None, u, out, valid, k, tp, None, False, k_first)
                    results[pdl, batch, j] = out.cpu()
                sm = torch.full_like(p, float("nan"))
                kernels._launch_softmax_split(p, sm, 0.8)
                results[pdl, batch, "softmax"] = sm.cpu()
                # captured in a CUDA graph (compiled above): the replay draws as the eager launches did
                if pdl:
                    out = torch.full((batch,), -1, dtype=torch.int32, device=dev)
                    valid = torch.zeros(batch, dtype=torch.int8, device=dev)
                    torch.cuda.synchronize()
                    g = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(g):
                        kernels._launch_sample_split(p, None, u, out, valid, top_k, top_p, None, False, True)
                    g.replay()
                    torch.cuda.synchronize()
                    results[pdl, batch, "graph"] = out.cpu()
    for key, plain in results.items():
        if key[0]:
            continue
        with_pdl = results[(True, *key[1:])]
        assert torch.equal(plain, with_pdl), f"B={key[1]} case {key[2]}: results differ with pdl"
        if key[2] == 3:
            assert torch.equal(plain, results[True, key[1], "graph"]), f"B={key[1]}: graph replay differs"


def test_seed_offset_and_generator_reproducible():
    dev = "cuda" if HAS_CUDA else "cpu"
    p = _probs(4, 64, dev)
    a = sampling.top_k_sampling_from_probs(p, 10, seed=5, offset=8)
    b = sampling.top_k_sampling_from_probs(p, 10, seed=5, offset=8)
    assert torch.equal(a, b)
    st = torch.tensor([5], dtype=torch.int64, device=dev)
    c = sampling.top_k_sampling_from_probs(p, 10, seed=st, offset=torch.tensor([8], dtype=torch.int64, device=dev))
    d = sampling.top_k_sampling_from_probs(p, 10, seed=st.expand(4), offset=torch.full((4,), 8, device=dev))
    assert torch.equal(c, d)
    draws = {tuple(sampling.sampling_from_probs(p, seed=5, offset=o).tolist()) for o in range(0, 40, 4)}
    assert len(draws) > 1, "the offset does not change the draws"
    g1 = torch.Generator(device=dev).manual_seed(3)
    g2 = torch.Generator(device=dev).manual_seed(3)
    assert torch.equal(sampling.sampling_from_probs(p, generator=g1), sampling.sampling_from_probs(p, generator=g2))


@pytest.mark.gpu
def test_cuda_graph_capture():
    """Sampling captures in a CUDA graph (no host sync) and draws afresh on every replay."""
    dev = "cuda"
    p = _probs(64, 32000, dev)
    top_k = torch.full((64,), 50, device=dev, dtype=torch.int32)
    top_p = torch.full((64,), 0.9, device=dev)
    sampling.top_k_top_p_sampling_from_probs(p, top_k, top_p)  # compile outside the capture
    sampling.sampling_from_logits(p)
    sampling.top_p_sampling_from_probs(p, top_p)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = sampling.top_k_top_p_sampling_from_probs(p, top_k, top_p)
        out2 = sampling.sampling_from_logits(p)
        out3 = sampling.top_p_sampling_from_probs(p, top_p)  # (top-p alone: the rejection rounds)
    seen, seen3 = set(), set()
    for _ in range(4):
        g.replay()
        torch.cuda.synchronize()
        seen.add(tuple(out.tolist()))
        seen3.add(tuple(out3.tolist()))
        assert out2.min() >= 0
        inside = ref_kept_rows(p, top_p=top_p).gather(1, out3.long()[:, None])[:, 0] > 0
        assert bool(inside.all()), "top-p alone drew outside the kept set in a replay"
    assert len(seen) > 1 and len(seen3) > 1, "replays repeat the same draws"
    kept_ok = torch.stack([ref_kept(p[r].cpu(), 50, 0.9, order="top_k_first")[out[r].cpu()] > 0 for r in range(64)])
    assert kept_ok.all()


# ----------------------------------------------------------------------------------------------- transforms


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
def test_softmax(path, dtype):
    dev = _device(path)
    shapes = [(1, 32000), (37, 128256), (512, 32000)] if path == "gpu" else [(3, 100)]
    for b, V in shapes:
        x = (torch.randn(b, V, device=dev) * 3).to(dtype)
        assert_close(sampling.softmax(x), torch.softmax(x.double(), 1), 1e-6, 1e-3, name="softmax")
        t = torch.rand(b, device=dev) + 0.5
        got = sampling.softmax(x, temperature=t)
        assert got.dtype == torch.float32
        assert_close(got, torch.softmax(x.double() / t.double()[:, None], 1), 1e-6, 1e-3, name="softmax per-row T")
        assert_close(sampling.softmax(x, 0.7), torch.softmax(x.double() / 0.7, 1), 1e-6, 1e-3, name="softmax T")


def _softmax_cases(x, dev, name):
    """Scalar, per-row and default temperatures against the float64 reference."""
    assert_close(sampling.softmax(x), torch.softmax(x.double(), 1), 1e-6, 1e-3, name=name)
    t = torch.rand(x.shape[0], device=dev) + 0.5
    got = sampling.softmax(x, temperature=t)
    assert got.dtype == torch.float32
    assert_close(got, torch.softmax(x.double() / t.double()[:, None], 1), 1e-6, 1e-3, name=f"{name} per-row T")
    assert_close(sampling.softmax(x, 0.7), torch.softmax(x.double() / 0.7, 1), 1e-6, 1e-3, name=f"{name} T")


@pytest.mark.parametrize(
    "path", [pytest.param("kernel", marks=pytest.mark.interpret), pytest.param("gpu", marks=pytest.mark.gpu)]
)
def test_softmax_rows_in_registers(path, request):
    """Softmax with each row held whole in one program's registers (``_softmax_rows_kernel``: rows of at most
    ``softmax_rows_max_vocab`` float32 entries at batches of at least ``softmax_rows_min_batch``): one to three pieces
    a row, the last one partial, rows led by -inf entries; on the GPU the benchmark's vocabularies at the default
    rule's batches and, with the rule lowered, at batch 1 and 37."""
    from flashinfer_triton.kernels import sampling as kernels

    if path == "kernel" and not INTERPRET and not HAS_CUDA:
        pytest.skip("needs TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    if path == "kernel":
        use_config(request, sampling=dataclasses.replace(_config.SAMPLING, softmax_rows_min_batch=1))
        shapes = [(3, 100), (2, 2048), (2, 4097), (2, 6000)]  # (4 warps: pieces of 2048, one to three)
    else:
        shapes = [(256, 49152), (300, 32000), (64, 40000), (128, 49152)]
    for b, V in shapes:
        assert kernels.softmax_rows_shape(b, V, _config.SAMPLING) is not None, (b, V)
        x = torch.randn(b, V, device=dev) * 3
        x[0, :7] = float("-inf")
        _softmax_cases(x, dev, f"softmax rows B={b} V={V}")
    if path == "gpu":
        use_config(request, sampling=dataclasses.replace(_config.SAMPLING, softmax_rows_min_batch=1))
        for b, V in [(1, 49152), (37, 49152), (5, 24576), (3, 1000)]:
            _softmax_cases(torch.randn(b, V, device=dev) * 3, dev, f"softmax rows B={b} V={V}")


@pytest.mark.parametrize(
    "path", [pytest.param("kernel", marks=pytest.mark.interpret), pytest.param("gpu", marks=pytest.mark.gpu)]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_softmax_row_pass(path, dtype, monkeypatch, request):
    """Softmax by persistent programs a row at a time, the write pass backwards (``_softmax_rowpass_kernel``, on where
    ``softmax_rowpass_min_batch`` allows): more rows than programs (each program takes several), rows led by -inf
    entries, 16-bit logits, into a NaN-filled output. The interpreter's short rows take the row pass with the
    registers' path off and its bound lowered to 0."""
    from flashinfer_triton.kernels import sampling as kernels

    if path == "kernel" and not INTERPRET and not HAS_CUDA:
        pytest.skip("needs TRITON_INTERPRET=1")
    dev = "cuda" if HAS_CUDA else "cpu"
    use_config(request, sampling=dataclasses.replace(_config.SAMPLING, softmax_rowpass_min_batch=1))
    if path == "kernel":
        use_config(request, sampling=dataclasses.replace(_config.SAMPLING, softmax_rows_max_vocab=0))
        monkeypatch.setattr(kernels, "_ROWS_MAX_VOCAB", 0)
        shapes = [(140, 50), (3, 5000)]
    else:
        shapes = [(256, 128256), (300, 151936), (37, 128256), (1, 50000)]
    ran = []
    real = kernels._launch_softmax_rowpass
    monkeypatch.setattr(kernels, "_launch_softmax_rowpass", lambda *a, **k: ran.append(1) or real(*a, **k))
    for b, V in shapes:
        x = (torch.randn(b, V, device=dev) * 3).to(dtype)
        x[0, :7] = float("-inf")
        _softmax_cases(x, dev, f"softmax row pass B={b} V={V} {dtype}")
        t = torch.rand(b, device=dev) + 0.5
        out = torch.full((b, V), float("nan"), device=dev)
        ran.clear()
        kernels.launch_softmax(x, out, t)
        assert ran, f"B={b} V={V}: the row pass did not run"
        assert_close(
            out, torch.softmax(x.double() / t.double()[:, None], 1), 1e-6, 1e-3, name=f"row pass B={b} NaN out"
        )


@pytest.mark.parametrize("path", _paths())
def test_softmax_infinite_temperature(path, request, monkeypatch):
    """temperature = inf (scalar, or in one row of a per-row tensor) gives a uniform row over finite logits on every
    softmax path (row split, rows in registers, row pass), as ``softmax(logits / inf)`` does; the padding past a
    row's end takes no part (``-inf * 0`` would be NaN)."""
    from flashinfer_triton.kernels import sampling as kernels

    if path == "kernel" and not INTERPRET and not HAS_CUDA:
        pytest.skip("needs TRITON_INTERPRET=1")
    dev = _device(path)
    base = _config.SAMPLING
    rules = {"split": dataclasses.replace(base, softmax_rows_min_batch=10**6, softmax_rowpass_min_batch=10**6)}
    if path != "torch":
        rules["rows"] = dataclasses.replace(base, softmax_rows_min_batch=1)
        rules["row pass"] = dataclasses.replace(base, softmax_rows_max_vocab=0, softmax_rowpass_min_batch=1)
    V = 1000 if path == "gpu" else 37  # (not a multiple of any tile: every path has padding)
    x = torch.randn(3, V, device=dev) * 3
    for name, cfg in rules.items():
        use_config(request, sampling=cfg)
        if name == "row pass":
            monkeypatch.setattr(kernels, "_ROWS_MAX_VOCAB", 0)
        got = sampling.softmax(x, float("inf"))
        assert_close(got, torch.full((3, V), 1.0 / V, device=dev), 1e-7, 1e-5, name=f"{name}: T=inf")
        t = torch.tensor([0.7, float("inf"), 1.3], device=dev)
        want = torch.softmax(x.double() / t.double()[:, None], 1)
        assert_close(sampling.softmax(x, t), want, 1e-6, 1e-3, name=f"{name}: per-row T with inf")


@pytest.mark.gpu
def test_softmax_paths_cuda_graph_gpu(request):
    """Softmax with rows in registers and by the row pass captures in a CUDA graph: a replay after new logits are
    written in place gives their softmax."""
    dev = "cuda"
    rp = dataclasses.replace(_config.SAMPLING, softmax_rowpass_min_batch=1)
    for cfg, (b, V) in [(_config.SAMPLING, (256, 49152)), (rp, (64, 128256))]:
        use_config(request, sampling=cfg)
        x = torch.randn(b, V, device=dev) * 3
        t = torch.rand(b, device=dev) + 0.5
        sampling.softmax(x, t)  # compile outside the capture
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = sampling.softmax(x, t)
        x.copy_(torch.randn(b, V, device=dev) * 2)
        g.replay()
        torch.cuda.synchronize()
        assert_close(out, torch.softmax(x.double() / t.double()[:, None], 1), 1e-6, 1e-3, name=f"graph B={b} V={V}")


def test_softmax_rule(monkeypatch):
    """Which softmax runs: rows held in registers for float32 rows up to ``softmax_rows_max_vocab`` at batches from
    ``softmax_rows_min_batch``, in at most three pieces of 16 entries a thread at the fewest warps; else the row pass
    over longer rows at batches from ``softmax_rowpass_min_batch``, else the row-split path."""
    from flashinfer_triton.kernels import sampling as kernels

    cfg = _config.SamplingConfig()
    shape = kernels.softmax_rows_shape
    assert shape(256, 49152, cfg) == (32, 16384, 3)
    assert shape(256, 32000, cfg) == (32, 16384, 2)
    assert shape(256, 24576, cfg) == (16, 8192, 3)
    assert shape(64, 100, cfg) == (4, 2048, 1)
    assert shape(256, 49153, cfg) is None and shape(256, 128256, cfg) is None
    assert shape(cfg.softmax_rows_min_batch - 1, 49152, cfg) is None
    assert shape(1, 49152, dataclasses.replace(cfg, softmax_rows_min_batch=1)) == (32, 16384, 3)
    assert shape(256, 1000, dataclasses.replace(cfg, softmax_rows_max_vocab=0)) is None
    calls = []
    names = ("_launch_softmax_rows", "_launch_softmax_rowpass", "_launch_softmax_split")
    for name in names:
        monkeypatch.setattr(kernels, name, lambda *a, _n=name, **k: calls.append(_n))
    off = dataclasses.replace(cfg, softmax_rowpass_min_batch=0)
    no_rows = dataclasses.replace(cfg, softmax_rows_max_vocab=0)
    rp = dataclasses.replace(cfg, softmax_rowpass_min_batch=64)
    # (the row pass only over rows longer than the registers' path ever holds, at batches from
    # softmax_rowpass_min_batch, 128 by default; any dtype)
    f32, bf16 = torch.float32, torch.bfloat16
    cases = [(256, 49152, f32, cfg, names[0]), (64, 49152, f32, cfg, names[0]), (63, 49152, f32, cfg, names[2]),
             (256, 49152, bf16, cfg, names[2]), (32, 49152, f32, cfg, names[2]), (256, 128256, f32, cfg, names[1]),
             (300, 49153, f32, cfg, names[1]), (256, 128256, bf16, cfg, names[1]), (127, 128256, f32, cfg, names[2]),
             (128, 128256, f32, cfg, names[1]),
             (256, 128256, f32, off, names[2]), (256, 49152, f32, no_rows, names[2]), (64, 128256, f32, rp, names[1]),
             (256, 49152, bf16, rp, names[2]), (63, 128256, f32, rp, names[2])]  # fmt: skip
    for n, V, dt, c, want in cases:
        calls.clear()
        with _config.using(sampling=c):
            kernels.launch_softmax(torch.empty(n, 1, dtype=dt).expand(n, V), None, 1.0)
        assert calls == [want], (n, V, dt, calls)


@pytest.mark.parametrize("path", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
def test_renorm_and_mask(path, dtype):
    dev = _device(path)
    shapes = [(1, 32000), (37, 128256), (4, 256000)] if path == "gpu" else [(3, 60)]
    for b, V in shapes:
        p = _probs(b, V, dev, dtype, scale=3.0)
        top_k = torch.randint(1, 40, (b,), device=dev)
        top_p = torch.rand(b, device=dev) * 0.8 + 0.1
        rk = sampling.top_k_renorm_probs(p, top_k)
        rp = sampling.top_p_renorm_probs(p, top_p)
        assert rk.dtype == torch.float32 and rp.dtype == torch.float32
        assert_close(rk, ref_kept_rows(p, top_k=top_k), 1e-6, 1e-4, name=f"top_k_renorm {b}x{V}")
        assert_close(rp, ref_kept_rows(p, top_p=top_p), 1e-6, 1e-4, name=f"top_p_renorm {b}x{V}")
        logits = (torch.randn(b, V, device=dev) * 2).to(dtype)
        m = sampling.top_k_mask_logits(logits, 7)
        assert m.dtype == dtype
        kth = torch.sort(logits.float(), 1, descending=True).values[:, 6:7]
        expect = torch.where(logits.float() >= kth, logits.float(), float("-inf"))
        assert torch.equal(m.float(), expect), "top_k_mask_logits"
        assert torch.equal(sampling.top_k_mask_logits(logits, 0), logits), "top_k = 0 keeps every logit"


# ----------------------------------------------------------------------------------------------- speculative


@pytest.mark.parametrize("path", _paths())
def test_chain_speculative_sampling(path):
    dev = _device(path)
    V, n_spec = 12, 3
    b = 4000 if path != "kernel" else 120
    draft = _probs(1, V * n_spec, "cpu").view(n_spec, V)
    draft = (draft / draft.sum(1, keepdim=True)).to(dev)
    target = _probs(n_spec + 1, V, dev)
    ids = torch.stack([torch.multinomial(draft[i].cpu(), b, replacement=True) for i in range(n_spec)], 1).int().to(dev)
    acc = torch.full((b,), 5, dtype=torch.int32, device=dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    out, acc_out, emit = sampling.chain_speculative_sampling(
        draft.expand(b, n_spec, V), ids, target.expand(b, n_spec + 1, V), acc, None, generator=gen
    )
    assert acc_out is acc and out.shape == (b, n_spec + 1) and out.dtype == torch.int32
    out, emit, acc = out.cpu(), emit.cpu(), acc.cpu()
    assert (acc >= 5 + emit).all() and (acc <= 5 + n_spec).all()
    j = torch.arange(n_spec + 1)[None, :]
    assert torch.equal(out[:, :n_spec][j[:, :n_spec] < emit[:, None]], ids.cpu()[j[:, :n_spec] < emit[:, None]])
    assert (out[j > emit[:, None]] == -1).all()
    assert (out.gather(1, emit[:, None].long()) >= 0).all()
    # Speculative sampling's theorem: the first emitted token is distributed as the target's first row.
    if path != "kernel":
        chi_square_ok(out[:, 0], target[0].double().cpu() / target[0].double().sum().cpu(), "first emitted token")
    # Identical draft and target: every draft token is accepted and a bonus token follows.
    out2, a2, e2 = sampling.chain_speculative_sampling(
        target[:n_spec].expand(8, n_spec, V), ids[:8], target.expand(8, n_spec + 1, V)
    )
    assert (e2 == n_spec).all() and (a2 == n_spec).all() and (out2[:, n_spec] >= 0).all()


# ----------------------------------------------------------------------------------------------- errors


def test_errors():
    p = torch.softmax(torch.randn(4, 16), 1)
    with pytest.raises(ValueError, match="probs"):
        sampling.sampling_from_probs(torch.rand(16))
    with pytest.raises(TypeError, match="probs"):
        sampling.sampling_from_probs(p.int())
    with pytest.raises(ValueError, match="top_p"):
        sampling.top_p_sampling_from_probs(p, 1.5)
    with pytest.raises(TypeError, match="top_k"):
        sampling.top_k_sampling_from_probs(p, 2.5)
    with pytest.raises(ValueError, match="top_k"):
        sampling.top_k_sampling_from_probs(p, torch.tensor([1, 2]))
    with pytest.raises(ValueError, match="filter_apply_order"):
        sampling.top_k_top_p_sampling_from_probs(p, 3, 0.5, filter_apply_order="top_p_first")
    with pytest.raises(ValueError, match="seed"):
        sampling.sampling_from_probs(p, seed=3)
    with pytest.raises(ValueError, match="both"):
        sampling.sampling_from_probs(p, seed=3, offset=torch.tensor([1]))
    with pytest.raises(TypeError, match="indices"):
        sampling.sampling_from_probs(p, indices=torch.tensor([0.0]))
    with pytest.raises(ValueError, match="NaN"):
        sampling.sampling_from_probs(torch.full((2, 8), float("nan")), check_nan=True)
    with pytest.raises(ValueError, match="temperature"):
        sampling.softmax(p, temperature=0.0)
    with pytest.raises(TypeError, match="deterministic"):
        sampling.sampling_from_probs(p, deterministic="yes")
    with pytest.raises(ValueError, match="target_probs"):
        sampling.chain_speculative_sampling(p.view(1, 4, 16), torch.zeros(1, 4, dtype=torch.int32), p.view(1, 4, 16))
    # indices choose rows and set the output dtype.
    s, valid = sampling.sampling_from_probs(p, indices=torch.tensor([3, 3, 0]), return_valid=True)
    assert s.dtype == torch.int64 and s.shape == (3,) and valid.all()


@pytest.mark.parametrize("path", _paths())
def test_strided_indices_pick_their_rows(path):
    """A strided ``indices`` view selects the rows it shows, on every sampler (one token per row holds nearly
    all the mass, so each draw is that token)."""
    dev = _device(path)
    V = 64
    gen = torch.Generator().manual_seed(5)
    w = torch.rand(5, V, generator=gen) + 0.1
    tok = torch.randperm(V, generator=gen)[:5]
    w[torch.arange(5), tok] += 1e7
    p = (w / w.sum(dim=1, keepdim=True)).to(dev)
    idx = torch.tensor([4, 0, 1, 0, 3, 0, 0, 0, 2, 0], dtype=torch.int32, device=dev)[::2]
    assert not idx.is_contiguous()
    want = tok[idx.long().cpu()]
    g = torch.Generator(device=dev).manual_seed(0)
    draws = {
        "plain": sampling.sampling_from_probs(p, idx, generator=g),
        "top_k": sampling.top_k_sampling_from_probs(p, 3, indices=idx, generator=g),
        "top_p": sampling.top_p_sampling_from_probs(p, 0.9, indices=idx, generator=g),
        "min_p": sampling.min_p_sampling_from_probs(p, 0.5, indices=idx, generator=g),
        "top_k_top_p": sampling.top_k_top_p_sampling_from_probs(p, 3, 0.9, indices=idx, generator=g),
    }
    for name, s in draws.items():
        assert torch.equal(s.cpu().long(), want), f"{name}: {s.tolist()} vs {want.tolist()}"


# ----------------------------------------------------------------------------------------------- launch plans


def test_launch_plans_bind_once(monkeypatch, request):
    """The row-split host path: a call form's first call launches each kernel through the general path and
    binds it; later calls of that form launch only the bound launches, with that call's tensors (addresses)
    and filter values; another shape, dtype or chunk setting gets its own plan. Launches are stand-ins here,
    so this runs without a GPU."""
    from flashinfer_triton.kernels import sampling as kernels

    general, bound = [], []

    class Bound:
        def __init__(self, kernel):
            self.kernel = kernel

        def __call__(self, *lead):
            bound.append((self.kernel, lead))
            return True

    def launch(kernel, grid, *args, num_warps=4, **consts):
        general.append(kernel)
        return kernel, args

    monkeypatch.setattr(kernels, "_launch", launch)
    monkeypatch.setattr(kernels, "bind", lambda fast, compiled, full, grid, n_lead: Bound(compiled))
    monkeypatch.setattr(
        kernels,
        "_FAST",
        {
            k: object()
            for k in (kernels._pivot_kernel, kernels._band_kernel, kernels._compact_kernel, kernels._finish_kernel)
        },
    )
    clear_host_caches("sampling")
    request.addfinalizer(clear_host_caches)  # (plans bound to stand-ins must not outlive the test)

    def call(p, k, n=3):
        u = torch.rand(n, 1)
        out = torch.empty(n, dtype=torch.int32)
        valid = torch.empty(n, dtype=torch.bool)
        kernels.launch_sample(p, None, u, out, valid, k, None, None, False, False)
        return u, out, valid

    p = torch.rand(3, 5000)
    call(p, 7)
    assert general == [kernels._pivot_kernel, kernels._band_kernel, kernels._compact_kernel,
                       kernels._finish_kernel] and not bound  # fmt: skip
    general.clear()
    for k in (9, 5000, 0):
        u, out, valid = call(p, k)
        assert not general and len(bound) == 4
        for _, lead in bound:
            assert lead[0] == p.data_ptr() and lead[2] == u.data_ptr() and lead[3] == out.data_ptr()
            assert lead[4] == valid.data_ptr() and lead[7] == min(max(k, 0), 5000)
        bound.clear()
    call(torch.rand(3, 6000), 7)  # another vocabulary: a new plan
    assert len(general) == 4 and not bound
    general.clear()
    default = _config.SAMPLING
    # (set directly, not through _config.using, which would clear the plans: what is checked here is that a plan's
    # key holds the configuration it was built with)
    monkeypatch.setattr(_config, "SAMPLING", dataclasses.replace(default, chunk_max=2048))
    call(p, 7)
    assert len(general) == 4 and not bound
    general.clear()
    monkeypatch.setattr(_config, "SAMPLING", default)
    # The same form 4 bytes off the 16-byte boundary: the general path (Triton specializes on alignment).
    call(torch.rand(3 * 5000 + 1)[1:].view(3, 5000), 7)
    assert len(general) == 4 and not bound
    dtypes = (torch.float32, torch.int32, torch.bool)  # probabilities, samples, valid flags
    plans = [(f.op, f.shapes, f.dtypes, f.bound) for f in host_caches()["sampling"]]
    one = ("sample", ((3, 5000),), dtypes, True)
    assert plans == [one, ("sample", ((3, 6000),), dtypes, True), one]  # (the last: chunk_max 2048)


def test_launch_plans_bind_after_launch_hooks_go(monkeypatch, request):
    """A plan first run while a launch hook is set (a profiler: nothing can be bound then) binds at a later call
    without hooks, instead of staying on the general path for good. Launches are stand-ins (no GPU)."""
    from flashinfer_triton.kernels import sampling as kernels

    general, bound, hooks = [], [], [True]

    def launch(kernel, grid, *args, num_warps=4, **consts):
        general.append(kernel)
        return kernel, args

    def stand_in_bind(fast, compiled, full, grid, n_lead):
        return None if hooks[0] else (lambda *lead: bound.append(compiled) or True)

    steps = (kernels._pivot_kernel, kernels._band_kernel, kernels._compact_kernel, kernels._finish_kernel)
    monkeypatch.setattr(kernels, "_launch", launch)
    monkeypatch.setattr(kernels, "bind", stand_in_bind)
    monkeypatch.setattr(kernels, "hooks_set", lambda: hooks[0])
    monkeypatch.setattr(kernels, "_FAST", {k: object() for k in steps})
    clear_host_caches("sampling")
    request.addfinalizer(clear_host_caches)  # (plans bound to stand-ins must not outlive the test)
    p = torch.rand(3, 5000)

    def call():
        out, valid = torch.empty(3, dtype=torch.int32), torch.empty(3, dtype=torch.bool)
        kernels.launch_sample(p, None, torch.rand(3, 1), out, valid, 7, None, None, False, False)

    call()
    hooks[0] = False
    call()
    assert len(general) == 8 and not bound
    call()
    assert len(general) == 8 and bound == list(steps)


@pytest.mark.parametrize(
    "fields",
    [dict(pivots_p=512), dict(pivots_p=16), dict(pivots_p=100), dict(pivots=12), dict(cand_slots=3000),
     dict(finish_block=32), dict(search_cells=100), dict(binades_p=64), dict(binades_p=12), dict(chunk_max=3000),
     dict(chunk_min=8)],
)  # fmt: skip
def test_sampling_config_rejects_sizes_the_kernels_cannot_hold(fields):
    """The pivot grids are power-of-two ranges, with top-p 32 binades of at most 256 pivots, and the slots, tiles
    and chunks powers of two: any other size is refused by name when the configuration is made, not miscounted
    or failed to compile at the first call."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        _config.SamplingConfig(**fields)
    assert _config.SamplingConfig(pivots_p=32).pivots_p == 32


@pytest.mark.interpret
def test_filtered_sampling_refuses_chunks_over_what_a_pass_holds(device):
    """A configuration whose max_chunks leaves chunks longer than a filtered pass's 32 warps can hold is refused by
    name before anything is launched (top-p alone, drawn by rejection rounds one program a row, has no chunks)."""
    gen = torch.Generator(device=device).manual_seed(0)
    probs = torch.softmax(torch.randn(2, 40000, generator=gen, device=device), dim=-1)
    with _config.using(sampling=dataclasses.replace(_config.SAMPLING, max_chunks=1)):
        with pytest.raises(ValueError, match="SamplingConfig.max_chunks"):
            sampling.top_k_top_p_sampling_from_probs(probs, 50, 0.9, generator=gen)
        with pytest.raises(ValueError, match="SamplingConfig.max_chunks"):
            sampling.top_k_sampling_from_probs(probs, 20, generator=gen)
