"""The Gluon prefill kernel on a persistent grid (kernels/prefill_sm90_persist.py): one program per SM running the
static schedule the plan computes (_prefill_impl._persist_lists) for batches of several requests with ragged K/V.

On an sm_90 GPU: ragged batches at the edges (requests without queries, without keys, of one token, queries past
the keys, runs by rows, windows, soft caps, NaN past the batch's keys, causal and full, with and without lse, the
few-tile plan's lists and the array plan's) against the float32 reference with NaN-filled outputs and the
persistent launch forced (``persist_min_units_per_sm=0``), on 132 programs and on 3 (many units a program: the
ring's phases and the query tile's run on across units), and a wrapper's bound launch under the default rule,
carried over a re-plan of the same layout. Without a GPU: which plans take it, the schedule itself (every unit
once, in sequence order, one a round, balanced), and the lists' place in the work list's array (rewritten in place
by a wrapper's re-plan of the same layout, which keeps the binding)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import INTERPRET, assert_close_named
from flashinfer_triton import _config, reference
from flashinfer_triton._backend import AttentionOptions, Workspace
from flashinfer_triton._config import GluonPrefillConfig
from flashinfer_triton.testing import ragged_lens
from helpers import plan_as_on_h100, record_epilogues, use_config

IS_SM90 = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


def _impl():
    from flashinfer_triton import _prefill_impl

    return _prefill_impl


def _gcfg(min_units=0):
    return GluonPrefillConfig(head_dims=(64, 128, 256), groups=tuple(range(1, 17)), d64_min_group=1,
                              persist_min_units_per_sm=min_units)  # fmt: skip


# (lens [(qo, kv), ...], make_case kwargs, tile_t, lse). At most 16 query tiles (full-g1-bf16-tail-nan): the plan's
# few-tile path, whose work list is built from Python lists; more: its array path.
PERSIST_CASES = {
    "causal-g4-edges": (
        [(300, 300), (200, 1000), (129, 129), (0, 40), (40, 0), (1, 1), (700, 700)],
        dict(hq=8, hkv=2, d=128, causal=True),
        32,
        True,
    ),  # fmt: skip
    "full-g1-bf16-tail-nan": (
        [(300, 700), (130, 5), (64, 64)],
        dict(hq=2, hkv=2, d=128, dtype=torch.bfloat16, kv_tail_nan=True),
        128,
        True,
    ),  # fmt: skip
    "full-g2-tail-nan-no-lse": (
        [(600, 900), (300, 7), (1, 300), (250, 250)],
        dict(hq=4, hkv=2, d=128, kv_tail_nan=True),
        64,
        False,
    ),  # fmt: skip
    "causal-g5-rows-qo>kv": (
        [(300, 700), (25, 25), (1, 40), (100, 60)],
        dict(hq=10, hkv=2, d=128, causal=True),
        25,
        True,
    ),  # fmt: skip
    "window-softcap-causal-g4": (
        [(300, 300), (200, 1000), (129, 129)],
        dict(hq=8, hkv=2, d=128, causal=True, window_left=100, soft_cap=5.0),
        32,
        False,
    ),  # fmt: skip
    "causal-g8-bf16": (
        [(500, 500), (77, 900), (16, 16)],
        dict(hq=16, hkv=2, d=128, causal=True, dtype=torch.bfloat16),
        16,
        True,
    ),  # fmt: skip
    # Runs by rows (groups 3 and 7) with requests of no keys and of no queries, four KV heads
    # (the unit's KV head field past 1); group 16's TMA copies of 8 tokens with causal rows that see no key (queries
    # past the keys: units of zero KV tiles between units of odd and even tile counts, on the query tile's TMA
    # phases); a window without the causal mask
    "full-g3-rows-hkv4-edges": (
        [(300, 500), (0, 30), (50, 0), (1, 1), (170, 170), (2, 700)],
        dict(hq=12, hkv=4, d=128),
        42,
        True,
    ),  # fmt: skip
    "causal-g7-rows-window": (
        [(400, 400), (90, 300), (18, 18), (19, 5), (0, 0)],
        dict(hq=14, hkv=2, d=128, causal=True, window_left=64),
        18,
        True,
    ),  # fmt: skip
    "causal-g16-qo>kv-zero-tiles": (
        [(200, 120), (64, 600), (9, 9), (300, 300), (40, 0)],
        dict(hq=32, hkv=2, d=128, causal=True),
        8,
        True,
    ),  # fmt: skip
    "window-full-g2": (
        [(300, 900), (128, 128), (5, 700), (70, 0)],
        dict(hq=4, hkv=2, d=128, window_left=200),
        64,
        True,
    ),  # fmt: skip
}


def _run(case_id, sms, monkeypatch, request):
    from test_prefill_kernels import TOL, expected, make_case

    impl = _impl()
    lens, kw, tile_t, with_lse = PERSIST_CASES[case_id]
    case = make_case(lens, paged=False, **kw)
    use_config(request, gluon_prefill=_gcfg())
    monkeypatch.setattr(impl, "_num_sms", lambda device: sms)
    epilogues = record_epilogues(monkeypatch)
    launches = []
    real = impl._run_gluon

    def spy(*a, **kw2):
        launches.append(a[0].persist_nprog)
        return real(*a, **kw2)

    monkeypatch.setattr(impl, "_run_gluon", spy)
    opts, dev = case["opts"], torch.device("cuda")
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, case["batch"], ws)
    q = case["q"].to(dev)
    k, v = case["k4"].to(dev), case["v4"].to(dev)
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[opts.o_dtype]
    # Outputs inside NaN-filled buffers with guard rows on both sides: no store may land outside the batch's rows
    # (tokens past a request's end, rows past TILE_T x GROUP), and every row of it must be written.
    guard = 67
    outs = []
    for _ in range(2):  # (a second launch of the same plan: nothing on the device carries over)
        o_buf = torch.full((q.shape[0] + 2 * guard, *q.shape[1:]), float("nan"), dtype=opts.o_dtype, device=dev)
        out = o_buf[guard : guard + q.shape[0]]
        l_buf = lse = None
        if with_lse:
            l_buf = torch.full((q.shape[0] + 2 * guard, q.shape[1]), float("nan"), dtype=torch.float32, device=dev)
            lse = l_buf[guard : guard + q.shape[0]]
        impl.run(p, opts, case["batch"], q, k, v, out, lse, qk_scale_mult=0.8)
        torch.cuda.synchronize()
        assert_close_named("o", out, want_o, atol, rtol)
        assert o_buf[:guard].isnan().all() and o_buf[guard + q.shape[0] :].isnan().all(), "o stored out of bounds"
        if with_lse:
            assert_close_named("lse", lse, want_lse, latol, latol)
            assert l_buf[:guard].isnan().all() and l_buf[guard + q.shape[0] :].isnan().all(), "lse out of bounds"
        outs.append((out.clone(), None if lse is None else lse.clone()))
    # A static schedule and one writer per output row: the two launches agree bit for bit (a race on the query
    # tile or the ring, reading another unit's data, would not be repeatable).
    assert torch.equal(outs[0][0], outs[1][0]) and (not with_lse or torch.equal(outs[0][1], outs[1][1]))
    units = p.num_work_host * opts.num_kv_heads
    assert p.config.gluon and p.tile_t == tile_t and p.part_o is None
    assert launches == [min(sms, units)] * 2 and p.persist_nprog == min(sms, units)
    # The one-shot grid on the same work list runs the same per-item arithmetic (attend_ring, write_tile): the two
    # agree far inside the reference's tolerance.
    with _config.using(gluon_prefill=_gcfg(-1)):
        p1 = impl.plan(opts, case["batch"], Workspace(float_buffer=ws.float_buffer, int_buffer=ws.int_buffer))
    assert p1.persist_nprog == 0 and p1.num_work_host == p.num_work_host
    out1 = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=dev)
    lse1 = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=dev) if with_lse else None
    impl.run(p1, opts, case["batch"], q, k, v, out1, lse1, qk_scale_mult=0.8)
    torch.cuda.synchronize()
    tight = 1e-3 if opts.o_dtype == torch.float16 else 8e-3
    assert_close_named("o (persistent vs one-shot)", outs[1][0], out1, tight, tight)
    if with_lse:
        assert_close_named("lse (persistent vs one-shot)", outs[1][1], lse1, 1e-5, 1e-5)
    # Each launch staged its output rows through shared memory (D128: the persistent kernel's 128-key tiles hold
    # both consumers' rows in a K buffer); a gate that fell back to the register stores fails here
    assert kw["d"] == 128 and epilogues == [("persistent", True)] * 2 + [("one-shot", True)], epilogues


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("sms", [132, 3])
@pytest.mark.parametrize("case_id", list(PERSIST_CASES))
def test_ragged_persist_against_reference(case_id, sms, monkeypatch, request):
    _run(case_id, sms, monkeypatch, request)


@pytest.mark.parametrize("out_dtype", ["q", "other"])
@pytest.mark.parametrize(
    "case_id", ["causal-g4-edges", "full-g3-rows-hkv4-edges", "causal-g7-rows-window", "single-causal-d256-g1-lse"]
)  # fmt: skip
def test_persist_staged_launch(case_id, out_dtype, monkeypatch, request):
    """Which store path each launch takes, on any machine (as on an H100, 3 SMs; the kernels stand in): the
    persistent grid and the one-shot one on the same work list stage the output rows (``EPI_SMEM``) where the
    output has q's dtype, except the persistent D256 one (64-key tiles: a K buffer too small for both consumers'
    rows); an output of another dtype goes from the registers on both."""
    from dataclasses import replace

    from test_prefill_kernels import make_case

    impl = _h100_planner(monkeypatch)
    monkeypatch.setattr(impl, "_num_sms", lambda device: 3)
    epilogues = record_epilogues(monkeypatch, launch=False)
    if case_id in SINGLE_CASES:
        lens, kw, tile_t, _lse = SINGLE_CASES[case_id]
        lens = [lens]
    else:
        lens, kw, tile_t, _lse = PERSIST_CASES[case_id]
    case = make_case(lens, paged=False, **kw)
    opts, batch = case["opts"], case["batch"]
    same = out_dtype == "q"
    if not same:
        opts = replace(opts, o_dtype=torch.bfloat16 if opts.q_dtype == torch.float16 else torch.float16)
    q, k, v = case["q"], case["k4"], case["v4"]
    out = torch.empty(q.shape, dtype=opts.o_dtype)
    cfg = replace_cfg(_gcfg(), persist_single_max_units_per_sm=1 << 20)
    with _config.using(gluon_prefill=cfg):
        p = impl.plan(opts, batch, _ws())
        assert p.persist_nprog == 3 and p.tile_t == tile_t and p.part_o is None
        impl._run_gluon(p, opts, batch, q, k, v, out, None, 0.1)
    with _config.using(gluon_prefill=replace_cfg(cfg, persist_min_units_per_sm=-1, persist_single_max_units_per_sm=0)):
        p1 = impl.plan(opts, batch, _ws())
        assert p1.persist_nprog == 0
        impl._run_gluon(p1, opts, batch, q, k, v, out, None, 0.1)
    assert epilogues == [("persistent", same and kw["d"] == 128), ("one-shot", same)], epilogues


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_ragged_persist_wrapper_bound_run(monkeypatch, request):
    """The default rule on a batch past it (8 requests x 1000 tokens, 32/8: 2048 units over 132 SMs): the
    wrapper's first run binds the persistent launch, later runs with other q take it and match the reference; a
    re-plan of another batch of the same layout (the lengths reversed: other lists, same sizes) rewrites the lists
    in place and its first run already takes the bound launch (one general-path launch in all)."""
    import flashinfer_triton as fi

    impl = _impl()
    use_config(request, gluon_prefill=GluonPrefillConfig())
    calls = []
    real = impl._run_gluon

    def spy(*a, **kw):
        calls.append(a[0].persist_nprog)
        return real(*a, **kw)

    monkeypatch.setattr(impl, "_run_gluon", spy)
    dev = torch.device("cuda")
    hq, hkv, d = 32, 8, 128
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 24, dtype=torch.uint8, device=dev), "NHD")
    addrs = set()
    for lens in ([1000 + 37 * i for i in range(8)], [1000 + 37 * i for i in range(8)][::-1]):
        ind = torch.tensor([0] + list(np.cumsum(lens)), dtype=torch.int32, device=dev)
        w.plan(ind, ind, hq, hkv, d, causal=True)
        n = int(ind[-1])
        k, v = (torch.randn(n, hkv, d, device=dev).half() for _ in range(2))
        qs = []
        for _ in range(3):
            q = torch.randn(n, hq, d, device=dev).half()
            qs.append(q)
            out = w.run(q, k, v)
            torch.cuda.synchronize()
            starts = [0] + list(np.cumsum(lens))[:-1]
            want = torch.cat([reference.attention(q[a:a + m], k[a:a + m], v[a:a + m], causal=True)[0]
                              for m, a in zip(lens, starts, strict=True)])  # fmt: skip
            assert_close_named("o", out, want, 5e-3, 5e-3)
        info = w.plan_info()
        assert info.backend == "gluon" and info.bound
        assert info.details["persist_nprog"] == torch.cuda.get_device_properties(dev).multi_processor_count
        addrs.add((info.addresses["persist_cta"], info.addresses["persist_units"]))
    assert len(addrs) == 1 and calls == [info.details["persist_nprog"]]


def test_ragged_persist_replan_rewrites_lists_in_place(monkeypatch, request):
    """The persistent lists live in the plan's work-list array (one host-to-device copy, 16-byte aligned): a
    wrapper's eager re-plan of another batch of the same layout (batch size, query rows, work items) rewrites them
    at the same addresses (a graph captured, or a launch bound, on the previous plan reads the new lists) and takes
    over the previous plan's binding; a plan of more units gets a larger array (unbound). Each plan's lists and
    work list are those of a fresh wrapper's plan of its batch. The few-tile path and the array path, without a
    GPU (as on an H100)."""
    import flashinfer_triton as fi
    from flashinfer_triton import _backend, _wrapper

    _h100_planner(monkeypatch)
    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the plan on the CPU; nothing launches)
    use_config(request, gluon_prefill=_gcfg())
    hq, hkv, d = 4, 2, 128
    names = ("work", "persist_cta", "persist_units")

    def plan(w, lens):
        ind = torch.tensor([0] + [int(x) for x in np.cumsum(lens)], dtype=torch.int32)
        w.plan(ind, ind, hq, hkv, d, causal=True)
        return w.plan_info()

    big = list(ragged_lens(12, 100, 3000))
    moved = big[::-1]  # (other lists, the same sizes)
    pairs = (([300, 130, 64, 1, 200], [200, 1, 300, 64, 130]), (big, moved))
    for first, second in pairs:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD")
        a = plan(w, first)
        assert a.details["persist_nprog"] > 0 and a.storages["persist_units"] == a.storages["work"]
        assert a.addresses["persist_cta"] % 16 == 0 and a.addresses["persist_units"] % 16 == 0
        n = sum(first)
        q = torch.empty(n, hq, d, dtype=torch.float16)
        k = v = torch.empty(n, hkv, d, dtype=torch.float16)
        out = torch.empty_like(q)
        binding = _wrapper.RunBinding.of([(lambda *x: True, (q, k, v, out, out))], q, (k, v), k, v, out, None, False,
                                         (None, None, None))  # fmt: skip
        assert binding is not None
        w._w._planned.attach_binding(binding)  # (white-box: what a first run() would attach)
        b = plan(w, second)
        assert b.bound and b.bind_tried and b.plan_id != a.plan_id
        fresh = plan(fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD"), second)
        for name in names:
            assert b.addresses[name] == a.addresses[name], name
            assert torch.equal(b.arrays[name], fresh.arrays[name]), name
        assert not torch.equal(b.arrays["persist_units"], a.arrays["persist_units"])
        # more units: a larger array, at another address, unbound
        c = plan(w, first + [500])
        assert not c.bound and c.arrays["persist_units"].numel() > b.arrays["persist_units"].numel()
        assert c.addresses["persist_units"] != b.addresses["persist_units"]
        want = plan(fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD"),
                    first + [500])  # fmt: skip
        for name in names:
            assert torch.equal(c.arrays[name], want.arrays[name]), name


def _h100_planner(monkeypatch):
    """``_prefill_impl`` planning as on an H100 (132 SMs, the Gluon kernel's device check passing), from any machine."""
    impl = _impl()
    plan_as_on_h100(monkeypatch, impl)
    real = impl._gluon_candidate
    monkeypatch.setattr(impl, "_gluon_candidate", lambda o, d, g: real(o, torch.device("cuda", 0), g))
    return impl


def _batch(lens, kv=None):
    from flashinfer_triton._backend import AttentionBatch

    qi = torch.tensor([0] + [int(x) for x in np.cumsum(lens)], dtype=torch.int64)
    ki = qi if kv is None else torch.tensor([0] + [int(x) for x in np.cumsum(kv)], dtype=torch.int64)
    kl = ki[1:] - ki[:-1]
    return AttentionBatch(len(lens), qi.int(), ki.int(), None, kl.int(), qi, kl, ki)


def _ws(graph=False):
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8), int_buffer=torch.empty(1 << 22, dtype=torch.uint8)
    )
    if graph:
        ws.cuda_graph, ws.max_total_q, ws.max_batch_size = True, 1 << 18, 128
    return ws


def _units(p, hkv):
    """The plan's persistent lists on the host: per-program offsets, work items, KV heads."""
    cta = p.persist_cta.cpu().numpy().astype(np.int64)
    code = p.persist_units.cpu().numpy().astype(np.int64)
    return cta, code & ((1 << 23) - 1), code >> 23


def test_ragged_persist_plan_choice(monkeypatch, request):
    """Which plans take the persistent launch, on any machine (as on an H100): the bench's 64-request ragged batch
    (34648 units) does, and so does, forced, a plan of the few-tile path; one request, a batch below the threshold,
    the threshold -1, pages, CUDA-graph plans, split plans, custom masks and D64 / D256 do not."""
    from dataclasses import replace

    impl = _h100_planner(monkeypatch)
    opts = AttentionOptions(num_qo_heads=32, num_kv_heads=8, head_dim=128, page_size=1, paged=False, causal=True)
    mixed = list(ragged_lens(64, 100, 4000))
    use_config(request, gluon_prefill=GluonPrefillConfig())
    p = impl.plan(opts, _batch(mixed), _ws())
    assert p.config.gluon and p.tile_t == 32 and p.persist_nprog == 132 and p.part_o is None
    assert p.persist_cta.numel() == 133 and p.persist_units.numel() == p.num_work_host * 8 == 34648
    # one request: the one-shot grid
    assert impl.plan(opts, _batch([16384]), _ws()).persist_nprog == 0
    # below the threshold (16 x 200 tokens, 32/8: 800 units < 8 x 132), or the threshold off / past the batch
    assert impl.plan(opts, _batch([200] * 16), _ws()).persist_nprog == 0
    for off in (-1, 300):
        with _config.using(gluon_prefill=GluonPrefillConfig(persist_min_units_per_sm=off)):
            assert impl.plan(opts, _batch(mixed), _ws()).persist_nprog == 0
    # CUDA-graph plans, D64 (three consumers) and D256 stay one-shot
    assert impl.plan(opts, _batch(mixed), _ws(graph=True)).persist_nprog == 0
    for d in (64, 256):
        assert impl.plan(replace(opts, head_dim=d), _batch(mixed), _ws()).persist_nprog == 0
    # pages: one-shot
    pg = replace(opts, paged=True, page_size=16)
    qi = torch.tensor([0] + [int(x) for x in np.cumsum(mixed)], dtype=torch.int64)
    npages = [-(-x // 16) for x in mixed]
    pi = torch.tensor([0] + [int(x) for x in np.cumsum(npages)], dtype=torch.int64)
    kl = torch.tensor(mixed, dtype=torch.int64)
    from flashinfer_triton._backend import AttentionBatch

    paged = AttentionBatch(64, qi.int(), pi.int(), torch.arange(int(pi[-1])).int(), kl.int(), qi, kl, pi)
    assert impl.plan(pg, paged, _ws()).persist_nprog == 0
    # forced (threshold 0): the few-tile path (3 requests, 6 tiles of 128 tokens, group 1) takes it; a split plan
    # (2 requests x 256 queries over 16384 keys in pieces of 1024 keys) does not
    forced = GluonPrefillConfig(persist_min_units_per_sm=0)
    with _config.using(gluon_prefill=forced):
        g1 = replace(opts, num_qo_heads=2, num_kv_heads=2, causal=False)
        p = impl.plan(g1, _batch([300, 130, 64], kv=[700, 5, 64]), _ws())
        assert p.tile_t == 128 and p.num_work_host == 6 and p.persist_nprog == 12
        cta, item, kvh = _units(p, 2)
        assert np.array_equal(np.sort(item * 2 + kvh), np.arange(12))
        p = impl.plan(replace(opts, fixed_split_size=1024), _batch([256, 256], kv=[16384, 16384]), _ws())
        assert p.part_o is not None and p.persist_nprog == 0
    # a custom mask never takes the Gluon kernel (its plan launches a classification pass: not run here)
    assert not impl._gluon_variant(replace(opts, has_custom_mask=True), torch.device("cuda", 0), forced)


def _check_schedule(p, lens, hkv, nprog):
    """The plan's persistent lists against the sequence (KV head, requests longest first, query tiles last to
    first): every (work item, KV head) once, each program's units one a round in the sequence's order."""
    n = p.num_work_host
    units = n * hkv
    cta, item, kvh = _units(p, hkv)
    assert p.persist_nprog == nprog and len(cta) == nprog + 1
    assert cta[0] == 0 and cta[-1] == units and np.all(np.diff(cta) >= 1)
    assert np.array_equal(np.sort(item * hkv + kvh), np.arange(units))
    work = p.work.cpu().numpy()[:n].astype(np.int64)
    kv = np.asarray(lens, dtype=np.int64)
    rank = np.empty(len(kv), dtype=np.int64)
    rank[(-kv).argsort(kind="stable")] = np.arange(len(kv))
    seq_of_item = np.empty(n, dtype=np.int64)
    seq_of_item[np.lexsort((-work[:, 1], rank[work[:, 0]]))] = np.arange(n)
    place = kvh * n + seq_of_item[item]
    for prog in range(nprog):
        mine = place[cta[prog] : cta[prog + 1]]
        assert np.array_equal(mine // nprog, np.arange(len(mine))), prog


@pytest.mark.parametrize("sms", [3, 5, 132])
def test_persist_schedule_small_grids_and_few_tile_path(monkeypatch, request, sms):
    """The few-tile plan's lists (its work list built from Python lists, the schedule from its tiles as arrays)
    follow the same sequence as the array path's, on 3 and 5 programs (many units each, odd and even round
    counts, a short last round) and on more programs than units (one unit each); planning twice gives the same
    lists (a static schedule: no tie broken differently from one plan to the next)."""
    impl = _h100_planner(monkeypatch)
    monkeypatch.setattr(impl, "_num_sms", lambda device: sms)
    use_config(request, gluon_prefill=_gcfg())
    opts = AttentionOptions(num_qo_heads=4, num_kv_heads=2, head_dim=128, page_size=1, paged=False, causal=True)
    for lens in ([300, 130, 64, 1, 200], [129, 300, 33, 200, 0]):
        b = _batch(lens)
        p = impl.plan(opts, b, _ws())
        assert p.tile_t == 64 and p.num_work_host <= 16  # (the few-tile path)
        units = p.num_work_host * 2
        _check_schedule(p, lens, 2, min(sms, units))
        again = impl.plan(opts, _batch(lens), _ws())
        assert torch.equal(p.persist_cta, again.persist_cta) and torch.equal(p.persist_units, again.persist_units)
    # the array path on the same grids
    lens = list(ragged_lens(12, 100, 3000))
    p = impl.plan(opts, _batch(lens), _ws())
    assert p.num_work_host > 16
    _check_schedule(p, lens, 2, min(sms, p.num_work_host * 2))


def test_persist_gpu_cases_plan_as_named(monkeypatch, request):
    """The GPU cases' batches plan as their names say on an H100 (without a GPU): the Gluon tile of the named
    tokens, forced persistent, unsplit, and the same work list as the one-shot plan the GPU test compares with."""
    from test_prefill_kernels import make_case

    impl = _h100_planner(monkeypatch)
    for case_id, (lens, kw, tile_t, _lse) in PERSIST_CASES.items():
        case = make_case(lens, paged=False, **kw)
        with _config.using(gluon_prefill=_gcfg()):
            p = impl.plan(case["opts"], case["batch"], _ws())
        with _config.using(gluon_prefill=_gcfg(-1)):
            p1 = impl.plan(case["opts"], case["batch"], _ws())
        assert p.config.gluon and p.tile_t == tile_t and p.part_o is None, case_id
        assert p.persist_nprog == min(132, p.num_work_host * kw["hkv"]) and p1.persist_nprog == 0, case_id
        assert np.array_equal(p.work.cpu().numpy(), p1.work.cpu().numpy()), case_id
        _check_schedule(p, [b for _, b in lens], kw["hkv"], p.persist_nprog)


@pytest.mark.parametrize(
    "lens,hq,hkv,causal",
    [
        (list(ragged_lens(64, 100, 4000)), 32, 8, True),  # the bench row
        (list(ragged_lens(16, 1000, 8000)), 32, 8, True),
        (list(ragged_lens(128, 50, 1000)), 32, 8, True),
        (list(ragged_lens(64, 100, 4000)), 32, 32, True),
        ([8192, 8192], 32, 8, True),
        (list(ragged_lens(32, 100, 2000, 1)), 32, 8, True),
        (list(ragged_lens(40, 100, 3000, 2)), 32, 4, False),
    ],
    ids=["64x100-4000", "16x1000-8000", "128x50-1000", "64x100-4000-g1", "2x8192", "32x100-2000", "40x-full-g8"],
)
def test_persist_schedule(monkeypatch, request, lens, hq, hkv, causal):
    """The schedule of the A/B batches as an H100 plans them: every (work item, KV head) exactly once; a program's
    units in the sequence's order (KV head, requests longest first, query tiles last to first), one a round (so the
    programs walk the sequence together); the programs' estimated loads (1 + KV tiles a unit) within 1 % of their
    mean (the schedule the A/B measured ends within 0.1-0.7 %)."""
    impl = _h100_planner(monkeypatch)
    opts = AttentionOptions(num_qo_heads=hq, num_kv_heads=hkv, head_dim=128, page_size=1, paged=False, causal=causal)
    use_config(request, gluon_prefill=GluonPrefillConfig())
    p = impl.plan(opts, _batch(lens), _ws())
    n = p.num_work_host
    units = n * hkv
    nprog = p.persist_nprog
    assert nprog == 132
    cta, item, kvh = _units(p, hkv)
    assert cta[0] == 0 and cta[-1] == units and np.all(np.diff(cta) >= 0)
    assert np.array_equal(np.sort(item * hkv + kvh), np.arange(units))
    # the sequence's place of each (item, KV head)
    work = p.work.cpu().numpy()[:n].astype(np.int64)
    kv = np.asarray(lens, dtype=np.int64)
    rank = np.empty(len(kv), dtype=np.int64)
    rank[(-kv).argsort(kind="stable")] = np.arange(len(kv))
    seq_of_item = np.empty(n, dtype=np.int64)
    seq_of_item[np.lexsort((-work[:, 1], rank[work[:, 0]]))] = np.arange(n)
    place = kvh * n + seq_of_item[item]
    rounds = -(-units // nprog)
    for prog in range(nprog):
        mine = place[cta[prog] : cta[prog + 1]]
        assert np.array_equal(mine // nprog, np.arange(len(mine))), prog  # one unit a round, in order
    assert np.all(np.diff(cta) >= rounds - 1)
    est = 1 + (work[:, 3] - work[:, 2] + 127) // 128
    load = np.add.reduceat(est[item], cta[:-1])
    assert load.max() / load.mean() - 1 < 0.01, (load.max(), load.mean())


# (group, causal, lse, dtype, soft cap, window, runs by rows[, head dim])
_COMPILE_VARIANTS = {
    "causal-g4-lse": (4, True, True, "fp16", False, False, False),
    "full-g1-bf16": (1, False, False, "bf16", False, False, False),
    "qrows-causal-g5": (5, True, True, "fp16", False, False, True),
    "window-softcap-causal-g8": (8, True, False, "bf16", True, True, False),
    # one request at D256 (_persist_single): 64-key tiles, 2 stages
    "causal-g1-d256-lse": (1, True, True, "fp16", False, False, False, 256),
    "causal-g2-d256-bf16": (2, True, False, "bf16", False, False, False, 256),
    # (runs of 18 tokens of a group of 7: the staged rows of 126 busy rows through the last tile's K buffer)
    "qrows-causal-g7-lse": (7, True, True, "fp16", False, False, True),
}
_COMPILE = r"""
import sys
sys.path.insert(0, sys.argv[1])
import _gluon_resources as R
import torch
R._use_stand_in_driver()
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor
from flashinfer_triton.kernels._sm90_common import kernel_layouts
from flashinfer_triton.kernels.prefill_sm90_persist import _prefill_gluon_persist_kernel as kernel
group, causal, lse, dtype, soft_cap, window, q_rows, *rest = eval(sys.argv[2])
d = rest[0] if rest else 128
bn, stages = (128, 3) if d <= 128 else (64, 2)
epi_smem = bn == 128  # (as _run_gluon launches it: the output has q's dtype; 64-key tiles store directly)
tile_t = 128 // group if (128 // group) & (128 // group - 1) == 0 or q_rows else 128 // group // 8 * 8
dt = {"fp16": torch.float16, "bf16": torch.bfloat16}[dtype]
q = torch.empty(256, 8 * group, d, dtype=dt)
k = torch.empty(256, 8, d, dtype=dt)
o = torch.empty_like(q)
lse_t = torch.empty(256, 8 * group, dtype=torch.float32)
ints = torch.zeros(64, dtype=torch.int32)
q2, k2 = q.view(256, -1), k.view(256, -1)
qb = tile_t & -tile_t if tile_t % 8 == 0 else 8
qd = TensorDescriptor(q2, list(q2.shape), list(q2.stride()), [qb, d], kernel_layouts(dtype, qb, bn, d)[0])
kl = kernel_layouts(dtype, tile_t, bn, d)[1]
kd = TensorDescriptor(k2, list(k2.shape), list(k2.stride()), [bn, d], kl)
ck = kernel.warmup(qd, kd, kd, o, lse_t, q2, o, lse_t, ints, ints, ints, 0, 0, d, o.stride(0),
                   o.stride(1), lse_t.stride(0), lse_t.stride(1), 0.1, 0.01, 8 * group, group, d, bn, tile_t, stages,
                   causal, soft_cap, lse, False, False, False, 1, 240, 24 if tile_t & (tile_t - 1) == 0 else 32, 100,
                   window, 2, q2.stride(0), ints, ints, epi_smem, grid=(132,), num_warps=4, maxnreg=168)
R.report(ck)
import re
ptx = ck.asm["ptx"]
# each mbarrier's byte offset in shared memory (registers set from the base by one add, or the base itself)
base = re.findall(r"mov\.b32\s+(%r\d+), global_smem;", ptx)
off = {r: 0 for r in base}
for r, b, c in re.findall(r"add\.s32\s+(%r\d+), (%r\d+), (\d+);", ptx):
    if b in base:
        off[r] = int(c)
inits = re.findall(r"mbarrier\.init\.shared::cta\.b64 \[(%r\d+)\]", ptx)
print("mbarrier offsets", " ".join(str(off.get(r, -1)) for r in inits))
print("data bytes", (128 + 2 * stages * bn) * d * 2)
"""

# Runs by rows of full masks with lse (groups 3 and 7 spilled two row strides' sign words before
# the consumers took them zero-extended), group 16's 8-token copies
_COMPILE_MORE = {
    "qrows-full-g7-lse": (7, False, True, "fp16", False, False, True),
    "qrows-full-g3-lse-bf16": (3, False, True, "bf16", False, False, True),
    "causal-g16-lse": (16, True, True, "fp16", False, False, False),
}


@pytest.mark.skipif(INTERPRET, reason="compiles for sm_90a; the interpreter has no compiler")
@pytest.mark.parametrize("variant", list(_COMPILE_VARIANTS) + list(_COMPILE_MORE))
def test_persist_kernel_compiles_for_sm90(variant):
    """The persistent kernel compiles for sm_90a on any machine (a stand-in driver in a subprocess; nothing is
    launched): 12 warps, no spills, shared memory within the SM's budget."""
    import os
    import subprocess
    import sys

    root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.join(root, "src"), os.environ.get("PYTHONPATH", "")])}
    args = {**_COMPILE_VARIANTS, **_COMPILE_MORE}[variant]
    r = subprocess.run(
        [sys.executable, "-c", _COMPILE, os.path.join(root, "benchmarks"), repr(args)],
        capture_output=True, text=True, timeout=600, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-3000:]
    text = r.stdout
    assert int(text.split("shared ")[1].split(" ")[0]) <= 227 * 1024, text
    assert "num_warps 12" in text and "LOCAL:0" in text and "STACK:0" in text and "STL=0" in text, text
    # Every mbarrier past the query tile and the K/V ring: none overlays a buffer (runs by rows have no query
    # barriers; made and left unused, the allocator would give their bytes to K stage 0, and the copies and the
    # staged epilogue would write over initialized mbarriers)
    data = int(text.split("data bytes ")[1].split()[0])
    offs = [int(x) for x in text.split("mbarrier offsets ")[1].splitlines()[0].split()]
    assert offs and min(offs) >= data, (offs, data)
    # (the same from the allocation pass's offsets and every buffer's bytes, scratch space included)
    assert "mbarrier overlays none" in text, text
    # The output rows' stores: through shared memory (stmatrix) with 128-bit stores at D128; D256's 64-key tiles
    # (a K buffer too small for both consumers' rows) from the registers, 32 bits at a time
    widths = dict(kv.split("=") for kv in text.split("widths ")[1].splitlines()[0].split())
    staged = int(widths.get("STG.E.128", 0)), int(widths.get("STSM.16.M88.4", 0))
    if (args[7:] or (128,))[0] == 128:
        assert min(staged) > 0, text
    else:
        assert staged == (0, 0), text


def test_persist_threshold_is_validated():
    """``persist_min_units_per_sm``: an int, -1 (never) or more."""
    for ok in (-1, 0, 8, 300):
        assert GluonPrefillConfig(persist_min_units_per_sm=ok).persist_min_units_per_sm == ok
    for bad in (-2, 8.0, "8", None, True):
        with pytest.raises(ValueError, match="persist_min_units_per_sm"):
            GluonPrefillConfig(persist_min_units_per_sm=bad)


def test_persist_single_threshold_is_validated():
    """``persist_single_max_units_per_sm``: an int, 0 (never) or more."""
    for ok in (0, 1, 12, 300):
        assert GluonPrefillConfig(persist_single_max_units_per_sm=ok).persist_single_max_units_per_sm == ok
    for bad in (-1, 12.0, "12", None, True):
        with pytest.raises(ValueError, match="persist_single_max_units_per_sm"):
            GluonPrefillConfig(persist_single_max_units_per_sm=bad)


# One request (_persist_single). ((qo, kv), make_case kwargs, tile_t, lse); every case has at least 16 units (work
# items x KV heads), so that it takes the persistent launch on 3 and on 16 programs.
SINGLE_CASES = {
    "single-causal-g1-lse": ((700, 700), dict(hq=4, hkv=4, d=128, causal=True), 128, True),
    "single-causal-g4-append": ((200, 1000), dict(hq=16, hkv=4, d=128, causal=True), 32, False),
    "single-causal-g5-rows-bf16": ((300, 300), dict(hq=10, hkv=2, d=128, causal=True, dtype=torch.bfloat16), 25, True),
    "single-causal-d256-g1-lse": ((400, 400), dict(hq=4, hkv=4, d=256, causal=True), 128, True),
    "single-causal-d256-g2-bf16": ((333, 900), dict(hq=8, hkv=4, d=256, causal=True, dtype=torch.bfloat16), 64, False),
    "single-window-softcap-g4": (
        (600, 600),
        dict(hq=8, hkv=2, d=128, causal=True, window_left=100, soft_cap=5.0),
        32,
        False,
    ),
}


def test_single_gpu_cases_plan_as_named(monkeypatch, request):
    """The single-request GPU cases plan as their names say on an H100 (without a GPU): the Gluon tile of the named
    tokens, unsplit, on the persistent launch of min(16, units) programs with at least 16 units (so that 3 and 16
    programs both run several units or one)."""
    from test_prefill_kernels import make_case

    impl = _h100_planner(monkeypatch)
    monkeypatch.setattr(impl, "_num_sms", lambda device: 16)
    use_config(request, gluon_prefill=replace_cfg(_gcfg(), persist_single_max_units_per_sm=1 << 20))
    for case_id, ((qo, kv), kw, tile_t, _lse) in SINGLE_CASES.items():
        case = make_case([(qo, kv)], paged=False, **kw)
        p = impl.plan(case["opts"], case["batch"], _ws())
        units = p.num_work_host * kw["hkv"]
        assert p.config.gluon and p.tile_t == tile_t and p.part_o is None, case_id
        assert units >= 16 and p.persist_nprog == 16, case_id


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
@pytest.mark.parametrize("sms", [16, 3])
@pytest.mark.parametrize("case_id", list(SINGLE_CASES))
def test_single_persist_against_reference(case_id, sms, monkeypatch, request):
    """One causal request on the persistent launch (forced: any number of units per SM), D128 and D256, NaN-filled
    outputs, two launches of one plan, against the float32 reference."""
    from test_prefill_kernels import TOL, expected, make_case

    impl = _impl()
    (qo, kv), kw, tile_t, with_lse = SINGLE_CASES[case_id]
    case = make_case([(qo, kv)], paged=False, **kw)
    use_config(request, gluon_prefill=replace_cfg(_gcfg(), persist_single_max_units_per_sm=1 << 20))
    monkeypatch.setattr(impl, "_num_sms", lambda device: sms)
    launches = []
    real = impl._run_gluon

    def spy(*a, **kw2):
        launches.append(a[0].persist_nprog)
        return real(*a, **kw2)

    monkeypatch.setattr(impl, "_run_gluon", spy)
    opts, dev = case["opts"], torch.device("cuda")
    ws = Workspace(
        float_buffer=torch.empty(1 << 20, dtype=torch.uint8, device=dev),
        int_buffer=torch.empty(1 << 16, dtype=torch.uint8, device=dev),
    )
    p = impl.plan(opts, case["batch"], ws)
    q = case["q"].to(dev)
    k, v = case["k4"].to(dev), case["v4"].to(dev)
    want_o, want_lse = expected(case, 0.8, 1.0)
    atol, rtol, latol = TOL[opts.o_dtype]
    for _ in range(2):
        out = torch.full(q.shape, float("nan"), dtype=opts.o_dtype, device=dev)
        lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=dev) if with_lse else None
        impl.run(p, opts, case["batch"], q, k, v, out, lse, qk_scale_mult=0.8)
        torch.cuda.synchronize()
        assert_close_named("o", out, want_o, atol, rtol)
        if with_lse:
            assert_close_named("lse", lse, want_lse, latol, latol)
    units = p.num_work_host * opts.num_kv_heads
    assert units >= 16 and p.config.gluon and p.tile_t == tile_t and p.part_o is None
    assert launches == [min(sms, units)] * 2 and p.persist_nprog == min(sms, units)


@pytest.mark.gpu
@pytest.mark.skipif(not IS_SM90, reason="the Gluon kernel runs on sm_90 only")
def test_single_persist_public_bound_run():
    """single_prefill_with_kv_cache under the default rule (4096 32/32 causal: 1024 units, 7.8 an SM on an H100):
    the bound fast path's later calls with other q match the reference."""
    import flashinfer_triton as fi

    dev = torch.device("cuda")
    n, h, d = 4096, 32, 128
    k, v = (torch.randn(n, h, d, device=dev).half() for _ in range(2))
    for _ in range(3):
        q = torch.randn(n, h, d, device=dev).half()
        out = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
        torch.cuda.synchronize()
        want = reference.attention(q, k, v, causal=True)[0]
        assert_close_named("o", out, want, 5e-3, 5e-3)


def replace_cfg(cfg, **kw):
    from dataclasses import replace

    return replace(cfg, **kw)


def test_single_persist_plan_choice(monkeypatch, request):
    """Which single requests take the persistent launch (as on an H100): causal, D128 or D256 (at D256 with the query
    rows copied whole: groups 1, 2, 4, 8, 16), 1 to 12 units per SM (4096 32/32 and 16/16 D256, groups 5 and 7 at
    4096); not D256 by rows, 8192 32/8 (15.5 an SM), 16384, the append row (128
    units on 132 SMs), no mask, CUDA-graph plans, or with the threshold 0."""
    from dataclasses import replace

    impl = _h100_planner(monkeypatch)
    use_config(request, gluon_prefill=GluonPrefillConfig())
    base = AttentionOptions(num_qo_heads=32, num_kv_heads=32, head_dim=128, page_size=1, paged=False, causal=True)

    def nprog(qo, kv, ws=None, **kw):
        return impl.plan(replace(base, **kw), _batch([qo], kv=[kv]), ws or _ws()).persist_nprog

    assert nprog(4096, 4096) == 132
    assert nprog(4096, 4096, num_qo_heads=16, num_kv_heads=16, head_dim=256) == 132
    assert nprog(4096, 4096, num_qo_heads=40, num_kv_heads=8) == 132  # group 5 (25-token runs)
    assert nprog(4096, 4096, num_qo_heads=28, num_kv_heads=4) == 132  # group 7 (18-token runs)
    assert nprog(4096, 4096, num_qo_heads=32, num_kv_heads=16, head_dim=256) == 132  # D256 group 2 (64-token copies)
    # D256 by rows (groups 3, 5, 6, 7: the consumers load their query rows) keeps the one-shot grid
    for hq, hkv in ((48, 16), (40, 8), (48, 8), (28, 4)):
        assert nprog(4096, 4096, num_qo_heads=hq, num_kv_heads=hkv, head_dim=256) == 0, (hq, hkv)
    assert nprog(4096, 4096, causal=False) == 0
    assert nprog(8192, 8192, num_kv_heads=8) == 0  # 2048 units: 15.5 an SM
    assert nprog(16384, 16384, num_kv_heads=8) == 0
    assert nprog(512, 8192, num_kv_heads=8) == 0  # the append row: 128 units, one wave
    assert nprog(4096, 4096, ws=_ws(graph=True)) == 0
    assert nprog(4096, 4096, head_dim=64) == 0
    with _config.using(gluon_prefill=GluonPrefillConfig(persist_single_max_units_per_sm=0)):
        assert nprog(4096, 4096) == 0


@pytest.mark.parametrize(
    "qo,kv,hq,hkv,d",
    [(4096, 4096, 32, 32, 128), (4096, 4096, 16, 16, 256), (4096, 4096, 40, 8, 128), (4096, 4096, 28, 4, 128),
     (2048, 2048, 32, 8, 128), (1024, 1024, 32, 32, 128)],
    ids=["4096-g1", "4096-d256", "4096-g5", "4096-g7", "2048-g4", "1024-g1"],
)  # fmt: skip
def test_single_persist_schedule(monkeypatch, request, qo, kv, hq, hkv, d):
    """_persist_single's lists as an H100 plans them: every (work item, KV head) once; each program's units in the
    sequence's order (sections of KV heads, work-list rows, the section's heads), one a round; estimated loads (1 +
    KV tiles a unit) within 3.2 % of their mean (one-shot grid order, modelled: up to 27 % past the ideal)."""
    impl = _h100_planner(monkeypatch)
    use_config(request, gluon_prefill=GluonPrefillConfig())
    opts = AttentionOptions(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=1, paged=False, causal=True)
    p = impl.plan(opts, _batch([qo], kv=[kv]), _ws())
    n = p.num_work_host
    units = n * hkv
    assert p.persist_nprog == min(132, units)
    cta, item, kvh = _units(p, hkv)
    assert cta[0] == 0 and cta[-1] == units and np.all(np.diff(cta) >= 1)
    assert np.array_equal(np.sort(item * hkv + kvh), np.arange(units))
    sec = 1
    while hkv % (2 * sec) == 0 and 2 * sec * 2 * kv * d * 2 <= impl._PERSIST_SECTION_BYTES:
        sec *= 2
    place = (kvh // sec) * (n * sec) + item * sec + kvh % sec
    rounds = -(-units // p.persist_nprog)
    for prog in range(p.persist_nprog):
        mine = place[cta[prog] : cta[prog + 1]]
        assert np.array_equal(mine // p.persist_nprog, np.arange(len(mine))), prog
    assert np.all(np.diff(cta) >= rounds - 1)
    work = p.work.cpu().numpy()[:n].astype(np.int64)
    bn = p.config.block_n
    est = 1 + (work[:, 3] - work[:, 2] + bn - 1) // bn
    load = np.add.reduceat(est[item], cta[:-1])
    assert load.max() / load.mean() - 1 < 0.032, (load.max(), load.mean())


def test_single_persist_replan_rewrites_lists_in_place(monkeypatch, request):
    """One request's persistent lists (_persist_single) in the work list's array: a wrapper's re-plan of the same
    request (700 queries over 900 keys; another key count would change the plan's key rows, which a binding never
    survives) rewrites them at the same addresses and keeps the binding; the lists are a fresh wrapper's. Without a
    GPU, on 16 programs."""
    import flashinfer_triton as fi
    from flashinfer_triton import _backend, _wrapper

    impl = _h100_planner(monkeypatch)
    monkeypatch.setattr(impl, "_num_sms", lambda device: 16)
    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the plan on the CPU; nothing launches)
    use_config(request, gluon_prefill=replace_cfg(_gcfg(), persist_single_max_units_per_sm=1 << 20))
    hq = hkv = 4
    d = 128

    def plan(w, kv):
        qi = torch.tensor([0, 700], dtype=torch.int32)
        w.plan(qi, torch.tensor([0, kv], dtype=torch.int32), hq, hkv, d, causal=True)
        return w.plan_info()

    w = fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD")
    a = plan(w, 900)
    assert a.details["persist_nprog"] == 16 and a.storages["persist_units"] == a.storages["work"]
    q = torch.empty(700, hq, d, dtype=torch.float16)
    k = v = torch.empty(900, hkv, d, dtype=torch.float16)
    out = torch.empty_like(q)
    binding = _wrapper.RunBinding.of([(lambda *x: True, (q, k, v, out, out))], q, (k, v), k, v, out, None, False,
                                     (None, None, None))  # fmt: skip
    w._w._planned.attach_binding(binding)  # (white-box: what a first run() would attach)
    b = plan(w, 900)
    assert b.bound and b.plan_id != a.plan_id
    fresh = plan(fi.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD"), 900)
    for name in ("work", "persist_cta", "persist_units"):
        assert b.addresses[name] == a.addresses[name], name
        assert torch.equal(b.arrays[name], fresh.arrays[name]), name


@pytest.mark.parametrize(
    "lens,kv,hq,hkv,d,persist",
    [([700], [700], 4, 4, 128, True), ([400], [400], 4, 4, 256, True), ([300, 160], [300, 400], 10, 2, 128, False)],
    ids=["single-d128", "single-d256", "oneshot-g5-rows"],
)
def test_launch_args_match_kernel_params(monkeypatch, request, lens, kv, hq, hkv, d, persist):
    """_run_gluon hands each kernel (the one-shot and the persistent one) exactly one argument per parameter: the
    launch cache (``_launch.FastKernel``) and the bound launch (``_launch.bind``) apply only then, and a kernel
    parameter added with a default would otherwise silently send every launch down Triton's general path and
    leave wrappers unbound. Without a GPU: the kernels stand in, recording their arguments."""
    from flashinfer_triton._launch import FastKernel
    from flashinfer_triton.kernels.prefill_sm90 import _prefill_gluon_kernel
    from flashinfer_triton.kernels.prefill_sm90_persist import _prefill_gluon_persist_kernel

    impl = _h100_planner(monkeypatch)
    monkeypatch.setattr(impl, "_num_sms", lambda device: 16)
    use_config(request, gluon_prefill=replace_cfg(_gcfg(-1), persist_single_max_units_per_sm=1 << 20))
    seen = []

    class StandIn:
        def __init__(self, fn):
            self.n = FastKernel(fn)._n

        def run(self, *args, grid, **kw):
            seen.append((self.n, len(args), grid))

    monkeypatch.setattr(impl, "_GLUON_KERNEL", [StandIn(_prefill_gluon_kernel)])
    monkeypatch.setattr(impl, "_GLUON_PERSIST", [StandIn(_prefill_gluon_persist_kernel)])
    opts = AttentionOptions(num_qo_heads=hq, num_kv_heads=hkv, head_dim=d, page_size=1, paged=False, causal=True)
    batch = _batch(lens, kv=kv)
    p = impl.plan(opts, batch, _ws())
    assert (p.persist_nprog > 0) == persist and p.part_o is None
    q = torch.zeros(sum(lens), hq, d, dtype=torch.float16)
    k = v = torch.zeros(sum(kv), hkv, d, dtype=torch.float16)
    for lse in (None, torch.zeros(q.shape[:2])):
        impl._run_gluon(p, opts, batch, q, k, v, torch.empty_like(q), lse, 0.1, bind=[])
    assert len(seen) == 2 and all(n == got and n > 0 for n, got, _ in seen), seen
    assert all(g == ((p.persist_nprog,) if persist else (p.grid0, hkv)) for *_, g in seen)
