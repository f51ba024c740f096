"""Top-p alone: rejection rounds (kernels/sampling.py ``_topp_reject_kernel``, and the same rounds on the PyTorch
path), against a float64 replay of the chain written here row by row.

* ``test_topp_chain``: the uniforms fixed (``_uniforms`` patched), each draw equals the replay: round r's proposals
  are the float64 inverse CDF of the row restricted to ``{y > low}`` at ``u[r*K+j] * c_r``, accepted when
  ``G(x0) = sum_{y > x0} y < top_p * M``; after the rounds, the kept set's inverse CDF at ``u[R*K]``. Draws with a
  decision within 1e-5 of its threshold are skipped, as ``test_*_inverse_cdf`` skips uniforms on a CDF step. Row
  kinds: peaked, flat, tied levels, half zeros; unnormalised rows (round 0 unusable, or mostly missed), fp16 / bf16;
  per-row top_p, indices, a strided batch whose padding and unused rows are NaN; one, two or three proposals (three
  by the batch rule, its threshold lowered to the test's batch), few rounds (the exact fallback after them) and none
  (the fallback alone). Both layouts: one program a row, and round 0 split over chunks of the row (short chunks, so
  that the interpreter's small rows split), whose later rounds and fallback run after it.
* ``test_topp_same_draws_torch_and_kernel``: the PyTorch path and the kernel draw the same tokens from the same
  generator state (the same uniforms).
* ``test_topp_chi_square``, ``test_topp_split_chi_square``: many draws against the kept distribution (a token
  outside it fails at once), one program a row and round 0 split.
* ``test_topp_split_rule``: which batches split round 0, into how many chunks.
* ``test_topp_three_proposals_rule``: which batches take three proposals a round; the uniforms a row, the PyTorch
  path's rounds and both layouts' launches follow it.
* ``test_topp_split_pdl_and_cuda_graph_gpu``: the split path's four launches with and without programmatic dependent
  launches, against one program a row, and in a CUDA graph.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET
from flashinfer_triton import _config, sampling
from flashinfer_triton.kernels import sampling as kernels
from helpers import use_config
from test_sampling import chi_square_ok, ref_kept, ref_kept_rows

C0 = 1.0 + 2.0**-10
GROW = 1.0 + 2.0**-12
TOL = 1e-5
USABLE0 = 1.0 - 2.0**-16


def _f32(v: float) -> float:
    return float(torch.tensor(v, dtype=torch.float32))


def kept(p: torch.Tensor, top_p: float) -> torch.Tensor:
    """x kept iff the mass strictly above it is < top_p * sum (top_p >= 1: every positive entry), from a sort."""
    if top_p >= 1.0:
        return p > 0
    s, perm = torch.sort(p, descending=True)
    above = torch.cumsum(s, 0) - s
    first = torch.ones_like(s, dtype=torch.bool)
    first[1:] = s[1:] != s[:-1]
    tie_start = torch.cummax(torch.where(first, torch.arange(s.numel()), 0), 0).values
    g = torch.empty_like(p)
    g[perm] = above[tie_start]  # ties: the mass above the first of them
    return ((g < top_p * p.sum()) | (g == 0)) & (p > 0)


def _inv(w: torch.Tensor, t: float):
    """(first index whose running sum exceeds t, or -1; distance of t from the nearest step)."""
    cs = torch.cumsum(w, 0)
    hit = (cs > t) & (w > 0)
    if not bool(hit.any()):
        return -1, abs(float(cs[-1]) - t)
    i = int(hit.int().argmax())
    return i, min(abs(float(cs[i]) - t), abs(t - float(cs[i] - w[i])))


def chain(p: torch.Tensor, top_p: float, u: torch.Tensor, K: int, R: int):
    """(index, valid, margin, round) of the rejection chain in float64 (``p``: a float64 CPU row, ``u``: its R*K+1
    uniforms); ``margin``: the closest any decision came to its threshold, relative to the row's mass; ``round``: the
    round that drew the index (R: the exact fallback)."""
    low, high, q = 0.0, C0, C0
    target = float("inf")
    margin = float("inf")
    usable0 = False
    M = float(p.sum())
    if M <= 0:
        return 0, False, margin, 0

    def G(v):
        return float(p[p > v].sum())

    for r in range(R):
        c = C0 if r == 0 else q * GROW
        w = torch.where(p > low, p, 0.0)
        props = []
        for j in range(K):
            i, mg = _inv(w, float(u[r * K + j]) * c)
            margin = min(margin, mg / c)
            props.append(i)
        high_piv = high
        if r == 0:
            target = top_p * M if top_p < 1.0 else float("inf")
            high = min(high, M)
            usable0 = M <= C0 * USABLE0
            margin = min(margin, abs(M - C0 * USABLE0) / M)
            q = M
        for i in props:
            if i >= 0:
                g0 = G(float(p[i]))
                # (G = 0, nothing above, is exact in any precision: no margin)
                if target != float("inf") and g0 != 0:
                    margin = min(margin, abs(g0 - target) / M)
                if (g0 < target or g0 == 0) and (r > 0 or usable0):
                    return i, True, margin, r
        nl, nq, nh = low, q, high
        for i in props:
            if i < 0:
                continue
            x0 = float(p[i])
            x1 = _f32(_f32(_f32(x0) + _f32(high_piv)) * 0.5)
            g0, g1 = G(x0), G(x1)
            if target != float("inf") and g1 != 0:
                margin = min(margin, abs(g1 - target) / M)
            if g0 >= target and g0 != 0 and x0 > nl:
                nl, nq = x0, g0
            if g1 >= target and g1 != 0:
                if x1 > nl:
                    nl, nq = x1, g1
            else:
                nh = min(nh, x1)
        low, q, high = nl, nq, nh
    if top_p < 1.0:  # the kept set's edge: the mass at or above each distinct value, nearest the target
        srt = torch.sort(p, descending=True).values
        ends = torch.ones_like(srt, dtype=torch.bool)
        ends[:-1] = srt[:-1] != srt[1:]
        margin = min(margin, float((torch.cumsum(srt, 0)[ends] - top_p * M).abs().min()) / M)
    w = torch.where(kept(p, top_p), p, 0.0)
    i, mg = _inv(w, float(u[R * K]) * float(w.sum()))
    margin = min(margin, mg / float(w.sum()))
    if i < 0:
        i = int(torch.nonzero(w > 0)[-1])
    return i, True, margin, R


def rows(kind: str, V: int, g: torch.Generator) -> torch.Tensor:
    """A float32 probability row of one kind, drawn in float64."""
    if kind == "peaked":
        x = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64) * 3, 0)
    elif kind == "flat":
        x = torch.softmax(torch.randn(V, generator=g, dtype=torch.float64), 0)
    elif kind == "ties":
        x = torch.randint(1, 18, (V,), generator=g).double()
    elif kind == "halfzero":
        x = torch.rand(V, generator=g, dtype=torch.float64)
        x[V // 2 :] = 0
    else:
        raise ValueError(kind)
    return (x / x.sum()).float()


PATHS = [pytest.param("torch", id="torch"), pytest.param("kernel", id="kernel", marks=pytest.mark.interpret),
         pytest.param("gpu", id="gpu", marks=pytest.mark.gpu)]  # fmt: skip


def _device(path: str) -> str:
    if path == "torch":
        if INTERPRET:
            pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


# (configuration fields, row scale, dtype). Small tiles (1 warp of [2, 128]) make the interpreter's rows many tiles
# long at little cost; the defaults' [1, 4096] tiles run too. ONE keeps every round in one program a row; SPLIT
# splits round 0 into chunks of 128-256 entries on the interpreter's rows (2 chunks of 4096 on the GPU's), walked in
# 1-warp tiles of 128.
ONE = dict(topp_split_max_batch=0)
SMALL = dict(topp_warps_small_batch=1, topp_tile_rows_small_batch=2)
SPLIT = dict(topp_split_max_batch=64, topp_split_chunk=128, topp_split_warps=1, topp_split_tile_rows=1, **SMALL)
# Three proposals a round by the batch rule: from 16 rows on, the interpreter's batch (the GPU's and PyTorch's is 48).
THREE = dict(topp_three_proposals_min_batch=16)
CASES = [
    pytest.param(dict(**ONE), 1.0, torch.float32, id="K2-default-tiles"),
    pytest.param(dict(topp_proposals=1, **ONE, **SMALL), 1.0, torch.float32, id="K1"),
    pytest.param(dict(**THREE, **ONE, **SMALL), 1.0, torch.float32, id="K3"),
    pytest.param(dict(**THREE, **ONE, **SMALL), 1.0, torch.bfloat16, id="K3-bf16"),
    pytest.param(dict(topp_proposals=1, **THREE, **ONE), 1.0, torch.float32, id="K3-default-tiles"),
    pytest.param(dict(topp_rounds=1, topp_stages=0, **ONE, **SMALL), 1.0, torch.float32, id="fallback"),
    pytest.param(dict(topp_rounds=0, **SMALL), 1.0, torch.float32, id="fallback-alone"),
    pytest.param(dict(**ONE, **SMALL), 3.0, torch.float32, id="unnormalised-above"),
    pytest.param(dict(**ONE, **SMALL), 0.25, torch.float16, id="unnormalised-below-fp16"),
    pytest.param(dict(**ONE, **SMALL), 1.0, torch.bfloat16, id="bf16"),
    # (the pivot pass reading the sampling pass's tiles most recent first, as from the rule's batch on; the cases
    # above run below it, in index order: the same chain; 16 is the interpreter's batch, the GPU's is 48)
    pytest.param(dict(topp_pivot_recent_first_min_batch=16, **ONE, **SMALL), 1.0, torch.float32, id="recent-first"),
    pytest.param(
        dict(topp_pivot_recent_first_min_batch=1, topp_stages=0, **ONE, **SMALL),
        1.0,
        torch.float32,
        id="recent-first-unstaged",
    ),  # fmt: skip
    pytest.param(
        dict(topp_pivot_recent_first_min_batch=1, **ONE, **SMALL), 1.0, torch.bfloat16, id="recent-first-bf16"
    ),  # fmt: skip
    pytest.param(dict(**SPLIT), 1.0, torch.float32, id="split-K2"),
    pytest.param(dict(topp_proposals=1, **SPLIT), 1.0, torch.float32, id="split-K1"),
    pytest.param(dict(**THREE, **SPLIT), 1.0, torch.float32, id="split-K3"),
    pytest.param(dict(topp_rounds=2, **THREE, **SPLIT), 0.25, torch.float16, id="split-K3-fallback-fp16"),
    pytest.param(dict(topp_rounds=1, topp_stages=0, **SPLIT), 1.0, torch.float32, id="split-fallback"),
    pytest.param(dict(**SPLIT), 3.0, torch.float32, id="split-unnormalised-above"),
    pytest.param(dict(**SPLIT), 0.25, torch.float16, id="split-unnormalised-below-fp16"),
]


def _sms(dev: str) -> int:
    """The SM count the launch plans with (an H100's off CUDA)."""
    return _config.num_sms(torch.device(dev)) if dev == "cuda" else 132


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize(("fields", "scale", "dtype"), CASES)
def test_topp_chain(path, fields, scale, dtype, monkeypatch, request):
    dev = _device(path)
    cfg = dataclasses.replace(_config.SAMPLING, **fields)
    use_config(request, sampling=cfg)
    n = 16 if path == "kernel" else 48
    K, R = cfg.topp_proposals_at(n), cfg.topp_rounds
    assert (K == 3) == ("topp_three_proposals_min_batch" in fields), f"proposals a round: {K}"
    g = torch.Generator().manual_seed(17)
    V = {"gpu": 6000, "kernel": 2500 if "topp_warps_small_batch" not in fields else 1100, "torch": 2500}[path]
    kinds = ["peaked", "flat", "ties", "halfzero"]
    x = (torch.stack([rows(k, V, g) for k in kinds]) * scale).to(dtype)
    # rows 1, 3, 5, 7 of a batch whose other rows and row padding are NaN: never read
    big = torch.full((2 * len(kinds), V + 40), float("nan"), dtype=dtype)
    big[1::2, :V] = x
    xs = big.to(dev)[:, :V]
    split = kernels.topp_split_chunk(n, V, _sms(dev), cfg) > 0
    if path != "torch":  # (the layout each case means to run)
        assert split == ("topp_split_chunk" in fields), f"round 0 split: {split}"
    idx = torch.randint(0, len(kinds), (n,), generator=g)
    tp = torch.tensor([0.2, 0.5, 0.9, 0.99, 1.0, 0.05, 0.0])[torch.arange(n) % 7]
    u = torch.rand(n, R * K + 1, generator=g)
    asked = []
    monkeypatch.setattr(sampling, "_uniforms", lambda nn, n_u, *a, **k: asked.append(n_u) or u[:nn, :n_u].to(dev))
    got, valid = sampling.top_p_sampling_from_probs(xs, tp.to(dev), indices=(2 * idx + 1).to(dev), return_valid=True)
    assert asked == [R * K + 1], f"uniforms asked a row: {asked}, expected {R * K + 1}"
    assert got.dtype == torch.int64 and valid.dtype == torch.bool
    got, valid = got.cpu(), valid.cpu()
    x64 = x.double()
    compared = 0
    rounds = []
    for d in range(n):
        ref, ok, margin, rnd = chain(x64[int(idx[d])], float(tp[d]), u[d].double(), K, R)
        if margin < TOL:
            continue
        compared += 1
        rounds.append(rnd)
        assert int(got[d]) == ref and bool(valid[d]) == ok, f"draw {d}: got {int(got[d])}, chain {ref} (round {rnd})"
    assert compared >= n // 2
    if split and R > 0:  # (some draws take the rounds after a split round 0, in its last kernel)
        assert max(rounds) >= 1, rounds


@pytest.mark.parametrize("layout", [pytest.param(ONE, id="one"), pytest.param(SPLIT, id="split")])
@pytest.mark.parametrize("path", PATHS)
def test_topp_empty_and_nan_rows(path, layout, request):
    """A row without mass, or with a NaN (whose sum is NaN): invalid, token 0, at once; its neighbours draw as usual.
    With ``check_nan`` the NaN is refused by name before anything is drawn, as FlashInfer does."""
    dev = _device(path)
    use_config(request, sampling=dataclasses.replace(_config.SAMPLING, **layout))
    assert (kernels.topp_split_chunk(4, 320, _sms(dev), _config.SAMPLING) > 0) == (layout is SPLIT)
    # (a multiple of 16, as the other small rows here: no compile of its own)
    x = torch.zeros(4, 320, device=dev)
    x[1, 17] = 0.5
    x[3, 5], x[3, 40], x[3, 41] = 0.5, float("nan"), 0.5
    for top_p in (0.9, torch.tensor([0.9, 0.0, 1.0, 0.5], device=dev)):
        s, v = sampling.top_p_sampling_from_probs(x, top_p, return_valid=True)
        assert v.tolist() == [False, True, False, False] and s.tolist() == [0, 17, 0, 0], (s.tolist(), v.tolist())
    with pytest.raises(ValueError, match="probs"):
        sampling.top_p_sampling_from_probs(x, 0.9, check_nan=True)
    assert sampling.top_p_sampling_from_probs(x[:3], 0.9, check_nan=True).tolist() == [0, 17, 0]


@pytest.mark.interpret
def test_topp_same_draws_torch_and_kernel(monkeypatch):
    """The PyTorch path runs the kernel's rounds on the same uniforms: from the same generator state the two draw
    the same tokens (a decision within float32 rounding of its threshold may flip: none does here)."""
    dev = "cuda" if HAS_CUDA else "cpu"
    if dev == "cpu" and not INTERPRET:
        pytest.skip("needs TRITON_INTERPRET=1")
    g = torch.Generator().manual_seed(4)
    p = torch.softmax(torch.randn(6, 900, generator=g) * 2, 1).to(dev)
    tp = torch.tensor([0.3, 0.6, 0.9, 0.95, 0.99, 1.0], device=dev)
    draws = {}
    for name in ("kernel", "torch"):
        if name == "torch":
            monkeypatch.setattr(sampling, "use_triton", lambda device: False)
        gen = torch.Generator(device=dev).manual_seed(11)
        draws[name] = sampling.top_p_sampling_from_probs(p, tp, generator=gen).cpu()
    assert torch.equal(draws["kernel"], draws["torch"]), (draws["kernel"].tolist(), draws["torch"].tolist())


@pytest.mark.parametrize("rule", [pytest.param(0, id="K2"), pytest.param(80, id="K3")])
@pytest.mark.parametrize("path", PATHS)
def test_topp_chi_square(path, rule, request):
    """Many draws of one row (its index repeated: a batch of them) against its kept distribution, with two proposals a
    round (the three-proposal rule off) and with three (the batch of draws is past the rule's 80 rows)."""
    if path == "kernel" and rule == 0:
        pytest.skip("the interpreter's two-proposal draws: test_topp_split_chi_square and the chain cases")
    dev = _device(path)
    cfg = dataclasses.replace(_config.SAMPLING, topp_three_proposals_min_batch=rule)
    use_config(request, sampling=cfg)
    g = torch.Generator().manual_seed(5)
    V, tp = 24, 0.8
    p = torch.softmax(torch.randn(V, generator=g) * 1.5, 0)
    n = {"torch": 20_000, "kernel": 400, "gpu": 200_000}[path]
    gen = torch.Generator(device=dev).manual_seed(9)
    got = sampling.top_p_sampling_from_probs(
        p[None].to(dev), tp, indices=torch.zeros(n, dtype=torch.int32, device=dev), generator=gen
    )
    assert cfg.topp_proposals_at(n) == (3 if rule else 2)
    keep = kept(p.double(), tp)
    # the test's kept set against test_sampling's (another sort)
    assert torch.equal(keep, ref_kept(p, top_p=tp) > 0)
    chi_square_ok(got.cpu(), (p.double() * keep) / (p.double() * keep).sum(), "top-p 0.8 by rejection rounds")


@pytest.mark.parametrize("path", [p for p in PATHS if p.id != "torch"])
def test_topp_split_chi_square(path, request):
    """Round 0 split over chunks: many draws of one row against its kept distribution. The row's 24 tokens lie 100
    entries apart among zeros; at batch 50 on 132 SMs a row splits into chunks of 2048 and 352 entries, with tokens in
    both, so a target can fall in either. (Tiles of [1, 512]: a chunk is a few tiles, which keeps the interpreter's
    thousands of programs short.)"""
    dev = _device(path)
    use_config(request, sampling=dataclasses.replace(_config.SAMPLING, **dict(SPLIT, topp_split_warps=4)))
    g = torch.Generator().manual_seed(5)
    V, tp = 2400, 0.8
    w = torch.softmax(torch.randn(24, generator=g) * 1.5, 0)
    p = torch.zeros(V)
    p[::100] = w
    n, batch = {"kernel": (400, 50), "gpu": (200_000, 50)}[path]
    assert kernels.topp_split_chunk(batch, V, _sms(dev), _config.SAMPLING) > 0
    gen = torch.Generator(device=dev).manual_seed(9)
    idx = torch.zeros(batch, dtype=torch.int32, device=dev)
    got = torch.cat([sampling.top_p_sampling_from_probs(p[None].to(dev), tp, indices=idx, generator=gen).cpu()
                     for _ in range(n // batch)])  # fmt: skip
    assert bool((got % 100 == 0).all()), "a draw of a zero entry"
    keep = kept(w.double(), tp)
    chi_square_ok(got // 100, (w.double() * keep) / (w.double() * keep).sum(), "top-p 0.8, round 0 split")


def test_topp_split_rule():
    """Round 0 splits below ``topp_split_max_batch`` rows (with rounds to run) into at least two chunks a row, every
    row's chunks within one wave of the SMs; a chunk is a power of two of at least ``topp_split_chunk`` entries."""
    cfg = _config.SamplingConfig()
    rule = kernels.topp_split_chunk
    assert rule(1, 128256, 132, cfg) == 4096 and rule(1, 49152, 132, cfg) == 4096
    assert rule(16, 128256, 132, cfg) == 16384 and rule(17, 128256, 132, cfg) == 0
    wide = dataclasses.replace(cfg, topp_split_max_batch=64)
    assert rule(64, 128256, 132, wide) == 65536
    assert rule(1, 4096, 132, cfg) == 0  # one chunk: nothing to split
    assert rule(cfg.topp_split_max_batch + 1, 1 << 20, 132, cfg) == 0
    assert rule(67, 128256, 132, dataclasses.replace(cfg, topp_split_max_batch=256)) == 0  # under two chunks a row
    assert rule(1, 128256, 132, dataclasses.replace(cfg, topp_rounds=0)) == 0  # the fallback alone
    assert rule(1, 128256, 132, dataclasses.replace(cfg, topp_split_max_batch=0)) == 0
    for sms in (4, 78, 132):
        for n in range(1, 65):
            for V in (1000, 32000, 49152, 128256, 256000):
                ch = rule(n, V, sms, cfg)
                if ch:
                    assert ch & (ch - 1) == 0 and ch >= cfg.topp_split_chunk
                    assert -(-V // ch) >= 2 and n * -(-V // ch) <= sms, (sms, n, V, ch)


def test_topp_three_proposals_rule(monkeypatch, request):
    """Three proposals a round from ``topp_three_proposals_min_batch`` rows on (80; 0: never), else
    ``topp_proposals``. A row's uniforms, the PyTorch path's rounds and the kernels' launches (one program a row, and
    round 0 split with its workspace) all follow ``SamplingConfig.topp_proposals_at``, so either path draws the same
    tokens from the same uniforms. No kernel runs: the launches are recorded."""
    cfg = _config.SamplingConfig()
    assert cfg.topp_three_proposals_min_batch == 80
    assert [cfg.topp_proposals_at(n) for n in (1, 16, 79, 80, 81, 256, 1 << 20)] == [2, 2, 2, 3, 3, 3, 3]
    assert [sampling._topp_uniforms(n, cfg) for n in (79, 80)] == [16 * 2 + 1, 16 * 3 + 1]
    one = dataclasses.replace(cfg, topp_proposals=1)
    assert [one.topp_proposals_at(n) for n in (79, 80)] == [1, 3]
    assert dataclasses.replace(cfg, topp_three_proposals_min_batch=0).topp_proposals_at(1 << 20) == 2
    assert dataclasses.replace(cfg, topp_three_proposals_min_batch=1).topp_proposals_at(1) == 3
    assert sampling._topp_uniforms(80, dataclasses.replace(cfg, topp_rounds=0)) == 1  # (the fallback alone)

    seen = []
    monkeypatch.setattr(kernels, "_launch", lambda kernel, grid, *a, **kw: seen.append(("one", grid[0], kw["K"])))
    monkeypatch.setattr(kernels, "_run", lambda plan, lead: seen.append(
        ("split", plan.ws_numel, [consts["K"] for *_, consts in plan.steps[1:]])))  # fmt: skip
    V = 128256
    for n in (79, 80):
        u = torch.zeros(n, sampling._topp_uniforms(n, cfg))
        kernels.launch_topp_reject(torch.zeros(n, V), None, u, torch.zeros(n, dtype=torch.int32),
                                   torch.zeros(n, dtype=torch.bool), 0.9, cfg)  # fmt: skip
    assert seen == [("one", 79, 2), ("one", 80, 3)], seen
    # Round 0 split (its rule lowered to 16 rows here): chunks of 16384, 8 a row; three proposals take two more
    # regions of pivot sums a chunk and a third proposal a row.
    low = dataclasses.replace(cfg, topp_three_proposals_min_batch=16)
    seen.clear()
    for n in (15, 16):
        assert kernels.topp_split_chunk(n, V, 132, low) == 16384
        u = torch.zeros(n, sampling._topp_uniforms(n, low))
        kernels.launch_topp_reject(torch.zeros(n, V), None, u, torch.zeros(n, dtype=torch.int32),
                                   torch.zeros(n, dtype=torch.bool), 0.9, low)  # fmt: skip
    assert seen == [("split", 6 * 15 * 8 + 2 * 15, [2, 2, 2]), ("split", 8 * 16 * 8 + 3 * 16, [3, 3, 3])], seen

    # The PyTorch path asks for as many uniforms a row and runs as many proposals a round.
    monkeypatch.setattr(sampling, "use_triton", lambda device: False)
    asked, rounds = [], []
    real_uniforms, real_reject = sampling._uniforms, sampling._torch_topp_reject
    monkeypatch.setattr(sampling, "_uniforms", lambda n, n_u, *a: asked.append(n_u) or real_uniforms(n, n_u, *a))
    monkeypatch.setattr(
        sampling, "_torch_topp_reject", lambda x, p, u, K, R: rounds.append(K) or real_reject(x, p, u, K, R)
    )
    use_config(request, sampling=cfg)
    p = torch.softmax(torch.randn(1, 64) * 2, 1)
    for n in (79, 80):
        sampling.top_p_sampling_from_probs(p, 0.9, indices=torch.zeros(n, dtype=torch.int32))
    assert (asked, rounds) == ([33, 49], [2, 3]), (asked, rounds)


def test_topp_seed_offset_reproducible():
    """seed / offset (ints, or int64 tensors of length 1 or the batch) and generators: the same state draws the same
    tokens, another offset or a later call on the generator other ones."""
    dev = "cuda" if HAS_CUDA else "cpu"
    p = torch.softmax(torch.randn(4, 64, device=dev) * 2, 1)
    a = sampling.top_p_sampling_from_probs(p, 0.9, seed=5, offset=8)
    assert torch.equal(a, sampling.top_p_sampling_from_probs(p, 0.9, seed=5, offset=8))
    st = torch.tensor([5], dtype=torch.int64, device=dev)
    c = sampling.top_p_sampling_from_probs(p, 0.9, seed=st, offset=torch.tensor([8], dtype=torch.int64, device=dev))
    d = sampling.top_p_sampling_from_probs(p, 0.9, seed=st.expand(4), offset=torch.full((4,), 8, device=dev))
    assert torch.equal(a, c) and torch.equal(c, d)
    # offsets a call's uniforms apart: disjoint counters
    step = sampling._topp_uniforms(4, _config.SAMPLING)
    draws = {
        tuple(sampling.top_p_sampling_from_probs(p, 0.9, seed=5, offset=o).tolist()) for o in range(0, 3 * step, step)
    }
    assert len(draws) > 1, "the offset does not change the draws"
    g1 = torch.Generator(device=dev).manual_seed(3)
    g2 = torch.Generator(device=dev).manual_seed(3)
    first = sampling.top_p_sampling_from_probs(p, 0.9, generator=g1)
    assert torch.equal(first, sampling.top_p_sampling_from_probs(p, 0.9, generator=g2))
    later = {tuple(sampling.top_p_sampling_from_probs(p, 0.9, generator=g1).tolist()) for _ in range(3)}
    assert later != {tuple(first.tolist())}, "the generator does not advance"


@pytest.mark.gpu
def test_topp_gpu_matches_torch_path_on_large_rows(monkeypatch):
    """Vocabularies of 49152-256000 at batch 1-256, peaked and flat rows, per-row top_p: the GPU kernels (both launch
    shapes of the one-program kernel: below and above one row an SM; round 0 split at batch <= 16; two proposals a
    round below 80 rows, three from 80 on) and the PyTorch path draw the same tokens from the same uniforms, except
    where the float64 replay puts a decision within float32 rounding of its threshold; every draw is in the kept
    set."""
    dev = "cuda"
    cfg = _config.SAMPLING
    torch.manual_seed(21)
    for V, batch, scale in ((128256, 256, 3.0), (49152, 32, 1.0), (256000, 1, 2.0), (128256, 200, 1.0),
                            (128256, 8, 3.0), (49152, 64, 3.0), (49152, 79, 3.0), (49152, 80, 3.0),
                            (128256, 128, 1.0), (49152, 160, 3.0)):  # fmt: skip
        n_u = sampling._topp_uniforms(batch, cfg)
        p = torch.softmax(torch.randn(batch, V, device=dev) * scale, 1)
        tp = torch.rand(batch, device=dev) * 0.9 + 0.1
        u = torch.rand(batch, n_u, device=dev)
        monkeypatch.setattr(sampling, "_uniforms", lambda nn, k, *a, u=u, **kw: u[:nn, :k])
        got = sampling.top_p_sampling_from_probs(p, tp).cpu()
        monkeypatch.setattr(sampling, "_uniforms", lambda nn, k, *a, u=u, **kw: u[:nn, :k].cpu())
        ref = sampling.top_p_sampling_from_probs(p.cpu(), tp.cpu())
        for d in (got != ref).nonzero()[:, 0].tolist():
            _, _, margin, _ = chain(p[d].double().cpu(), float(tp[d]), u[d].double().cpu(),
                                    cfg.topp_proposals_at(batch), cfg.topp_rounds)  # fmt: skip
            assert margin < TOL, f"V={V} B={batch} row {d}: GPU {int(got[d])}, PyTorch path {int(ref[d])}"
        inside = ref_kept_rows(p, top_p=tp).gather(1, got.to(dev).long()[:, None])[:, 0] > 0
        assert bool(inside.all()), f"V={V} B={batch}: rows {(~inside).nonzero()[:4, 0].tolist()} outside the kept set"


@pytest.mark.gpu
def test_topp_split_pdl_and_cuda_graph_gpu(monkeypatch):
    """Round 0 split (4 launches a call): programmatic dependent launches change only when each kernel starts, so the
    same uniforms draw the same tokens with and without them and as one program a row does (but for decisions within
    float32 rounding of a threshold); captured in a CUDA graph, replays draw afresh, inside the kept set."""
    dev = "cuda"
    cfg = _config.SAMPLING
    torch.manual_seed(8)
    for V, batch in ((128256, 4), (49152, 16)):  # (at most topp_split_max_batch rows split round 0)
        assert kernels.topp_split_chunk(batch, V, _sms(dev), cfg) > 0
        n_u = sampling._topp_uniforms(batch, cfg)
        p = torch.softmax(torch.randn(batch, V, device=dev) * 3, 1)
        tp = torch.rand(batch, device=dev) * 0.9 + 0.1
        u = torch.rand(batch, n_u, device=dev)
        draws = {}
        with monkeypatch.context() as mp:
            mp.setattr(sampling, "_uniforms", lambda nn, k, *a, u=u, **kw: u[:nn, :k])
            for name, fields in (("pdl", {}), ("plain", dict(pdl=False)), ("one", dict(topp_split_max_batch=0))):
                with _config.using(sampling=dataclasses.replace(cfg, **fields)):
                    draws[name] = sampling.top_p_sampling_from_probs(p, tp).cpu()
        assert torch.equal(draws["pdl"], draws["plain"]), f"V={V} B={batch}: draws differ with pdl"
        for d in (draws["pdl"] != draws["one"]).nonzero()[:, 0].tolist():
            _, _, margin, _ = chain(p[d].double().cpu(), float(tp[d]), u[d].double().cpu(),
                                    cfg.topp_proposals_at(batch), cfg.topp_rounds)  # fmt: skip
            assert margin < TOL, f"V={V} B={batch} row {d}: split {int(draws['pdl'][d])}, one {int(draws['one'][d])}"
        sampling.top_p_sampling_from_probs(p, tp)  # (the default configuration's plan, outside the capture)
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            out = sampling.top_p_sampling_from_probs(p, tp)
        seen = set()
        for _ in range(4):
            g.replay()
            torch.cuda.synchronize()
            seen.add(tuple(out.tolist()))
            inside = ref_kept_rows(p, top_p=tp).gather(1, out.long()[:, None])[:, 0] > 0
            assert bool(inside.all()), f"V={V} B={batch}: a replay drew outside the kept set"
        assert len(seen) > 1, "replays repeat the same draws"
