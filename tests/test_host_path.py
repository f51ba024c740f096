"""The host path: what plan() and run() may and may not do on the host.

An engine calls plan() once per step and run() once per layer; neither may wait for the GPU when the caller's
page table is on the host (FlashInfer's plan() reads lengths that live on the host, and so do ours). On the
GPU, ``torch.cuda.set_sync_debug_mode("error")`` turns every synchronizing call torch makes (a blocking copy, an
``.item()``, a stream synchronize) into an error.
"""

from __future__ import annotations

import pathlib
import re

import pytest
import torch

import flashinfer_triton as fi
from conftest import DEVICE, INTERPRET
from helpers import page_table

SRC = pathlib.Path(__file__).resolve().parents[1] / "src" / "flashinfer_triton"


def test_environment_read_in_one_module():
    """Only ``_env`` reads environment variables, and its docstring names each one it reads."""
    readers = sorted(
        p.relative_to(SRC).as_posix()
        for p in SRC.rglob("*.py")
        if re.search(r"os\.environ|os\.getenv", p.read_text()) and p.name != "_env.py"
    )
    assert readers == [], f"environment read outside _env: {readers}"
    env = (SRC / "_env.py").read_text()
    doc = env.split('"""')[1]
    for name in re.findall(r'_flag\("([A-Z0-9_]+)"', env):
        assert f"``{name}``" in doc, name


def test_configs_are_frozen():
    """The tuning of every kernel family is a frozen dataclass: a plan's configuration cannot change under it."""
    import dataclasses

    from flashinfer_triton import _config

    for cfg in (
        _config.MERGE,
        _config.PAGE,
        _config.GLUON_PREFILL,
        _config.GLUON_DECODE,
        _config.PrefillConfig(64, 64, 4, 3),
        _config.DecodeConfig(64, 16, 128, True, 4, 3),
    ):
        field = dataclasses.fields(cfg)[0].name
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(cfg, field, getattr(cfg, field))


def _paged(bs, keys, ps, hkv, d, device, gen):
    indptr, indices, last, num_pages = page_table([keys] * bs, ps, spare_pages=3, seed=int(gen.initial_seed()))
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).half().to(device)
    return indptr, indices, last, cache


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs,keys", [(1, 512), (8, 1024), (1, 32768)], ids=["bs1-512", "bs8-1024", "bs1-32768-split"])
def test_decode_plan_and_run_never_sync(bs, keys):
    """Decode: plan() with the page table on the host, then run(), under sync debug mode "error" (after one warm
    call, which compiles the kernels); the result is still right."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(bs)
    hq, hkv, d, ps = 32, 8, 128, 16
    indptr, indices, last, cache = _paged(bs, keys, ps, hkv, d, dev, gen)
    q = torch.randn(bs, hq, d, generator=gen).half().to(dev)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    want = w.run(q, cache).clone()
    torch.cuda.synchronize()
    out = torch.full_like(q, float("nan"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):  # the first plan after the warm one and a re-plan of the same shapes
            w.plan(indptr, indices, last, hq, hkv, d, ps)
            w.run(q, cache, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs,qlen,keys", [(1, 128, 512), (4, 256, 1024)], ids=["1x128-512", "4x256-1024"])
def test_prefill_plan_and_run_never_sync(bs, qlen, keys):
    """Paged causal prefill: plan() with host tables, then run(), under sync debug mode "error"."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(qlen)
    hq, hkv, d, ps = 32, 8, 128, 16
    indptr, indices, last, cache = _paged(bs, keys, ps, hkv, d, dev, gen)
    qo = torch.arange(bs + 1, dtype=torch.int32) * qlen
    q = torch.randn(bs * qlen, hq, d, generator=gen).half().to(dev)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True)
    want = w.run(q, cache).clone()
    torch.cuda.synchronize()
    out = torch.full_like(q, float("nan"))
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(2):
            w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True)
            w.run(q, cache, out=out)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    torch.testing.assert_close(out, want, atol=0, rtol=0)


def test_plan_info_cpu():
    """plan_info(): None before plan(); on the CPU (no kernels) the PyTorch path, unsplit, unbound; frozen."""
    import dataclasses

    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    assert w.plan_info() is None
    w.plan(i32(0, 2), i32(0, 1), i32(5), 4, 2, 64, 16)
    info = w.plan_info()
    assert (info.backend, info.split, info.bound, info.grid) == ("torch", False, False, None)
    with pytest.raises(dataclasses.FrozenInstanceError):
        info.split = True
    assert (info.batch_size, info.total_q, info.max_page_index) == (1, 1, 1)
    assert (info.options.num_qo_heads, info.options.page_size) == (4, 16)
    assert info.arrays["kv_lens"].tolist() == [21] and info.arrays["kv_indptr"].tolist() == [0, 2]
    info.arrays["kv_lens"][0] = 7  # a copy: the plan keeps its own
    assert w.plan_info().arrays["kv_lens"].tolist() == [21] and w.plan_info().plan_id == info.plan_id
    w.plan(i32(0, 1, 3), i32(2, 0, 1), i32(16, 3), 4, 2, 64, 16)  # an eager re-plan builds a new plan
    again = w.plan_info()
    assert again.plan_id != info.plan_id and again.options is info.options  # (the same checked options)
    assert (again.batch_size, again.max_page_index, again.arrays["kv_lens"].tolist()) == (2, 2, [16, 19])
    p = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
    p.plan(i32(0, 3), i32(0, 9), 4, 2, 64, causal=True)
    assert p.plan_info().backend == "torch" and p.plan_info().total_q == 3


def test_plan_keeps_one_binding():
    """A plan takes the binding of its first run() only; a CUDA-graph re-plan in place drops it."""
    from flashinfer_triton import _wrapper

    plan = _wrapper.Plan(None, None, None, None, 4, 10)
    assert (plan.fast_run, plan.bind_tried) == (None, False)
    plan.attach_binding(None)  # a first run whose form could not bind
    with pytest.raises(RuntimeError, match="first run"):
        plan.attach_binding(None)
    first = plan.plan_id
    plan.replanned_in_place(6, 12)
    assert (plan.total_q, plan.max_page_index, plan.bind_tried, plan.plan_id) == (6, 12, False, first)
    assert _wrapper.Plan(None, None, None, None, 4, 10).plan_id != first


@pytest.mark.parametrize("paged", [True, False])
def test_prefill_plan_one_copy(monkeypatch, paged):
    """A prefill plan() stages the batch's index arrays and its work list in ONE host-to-device copy: the batch's
    device arrays and the plan's work list are views of one buffer, each array still 16-byte aligned, with the
    values given."""
    from flashinfer_triton import _backend

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # the Triton plan on the CPU (no launch)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    ws = torch.empty(1 << 22, dtype=torch.uint8)
    qo = i32(0, 3, 8, 9)
    if paged:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        indptr, indices, last = i32(0, 2, 3, 6), i32(5, 1, 0, 2, 3, 4), i32(7, 16, 1)
        w.plan(qo, indptr, indices, last, 4, 2, 64, 16, causal=True)
        want = dict(kv_indptr=indptr, kv_lens=i32(23, 16, 33))
    else:
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        kv = i32(0, 20, 45, 50)
        w.plan(qo, kv, 4, 2, 64, causal=True)
        want = dict(kv_indptr=kv, kv_lens=i32(20, 25, 5))
    info = w.plan_info()
    base = info.storages["work"]
    for name, t in dict(qo_indptr=qo, **want).items():
        assert info.storages[name] == base, name  # one buffer: one copy
        assert info.addresses[name] % 16 == 0 and torch.equal(info.arrays[name], t), name
    assert "stage" not in info.batch_extra
    if paged:  # (on the device already, here the CPU: the caller's tensor, not copied)
        assert info.addresses["kv_indices"] == indices.data_ptr()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "kind,bs,qlen,keys,split_size",
    [("decode", 1, 1, 512, None), ("decode", 8, 1, 1024, None), ("prefill", 1, 128, 512, None),
     ("prefill", 1, 64, 8192, 2048)],
    ids=["decode-bs1-512", "decode-bs8-1024", "prefill-1x128-512", "prefill-1x64-8192-split"],
)  # fmt: skip
def test_bound_run_matches_general_path(kind, bs, qlen, keys, split_size):
    """After the first run() of a plan binds its launch (the Gluon kernels' on Hopper, a split plan's two
    launches), calls of the same form with other queries, outputs and caches (other addresses: descriptors are
    encoded per address) write exactly what the general path writes for them."""
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(keys + qlen)
    hq, hkv, d, ps = 32, 8, 128, 16
    indptr, indices, last, cache = _paged(bs, keys, ps, hkv, d, dev, gen)
    caches = (cache, torch.randn(cache.shape, generator=gen).half().to(dev), cache)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    if kind == "decode":
        w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, ps)
    else:
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        qo = torch.arange(bs + 1, dtype=torch.int32) * qlen
        w.plan(qo, indptr, indices, last, hq, hkv, d, ps, causal=True, fixed_split_size=split_size)
    rows = bs * qlen
    w.run(torch.randn(rows, hq, d, generator=gen).half().to(dev), cache)  # binds
    info = w.plan_info()
    assert info.bound
    if split_size is not None:
        assert info.split
    for c in caches:
        q = torch.randn(rows, hq, d, generator=gen).half().to(dev)
        got = torch.full_like(q, float("nan"))
        want = torch.full_like(q, float("nan"))
        w.run(q, c, out=got)
        w.run(q, c, out=want, window_left=-1)  # (an explicit window: never the bound launch)
        torch.cuda.synchronize()
        assert not got.isnan().any()
        torch.testing.assert_close(got, want, atol=0, rtol=0)


def test_append_checks_once_per_argument_form(monkeypatch, request):
    """append_paged_kv_cache checks an argument set's forms once: a call of a known form skips the checks and
    still writes the right slots; any other form (a dtype, a shape, a layout) goes through them and gets the
    error naming the argument, known forms or not."""
    from flashinfer_triton import page

    fi.clear_host_caches("append_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("append_forms"))
    calls = []
    orig = page._check_append
    monkeypatch.setattr(page, "_check_append", lambda *a: calls.append(1) or orig(*a))
    gen = torch.Generator().manual_seed(3)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    caches = {"NHD": torch.zeros(3, 2, 4, 2, 8), "HND": torch.zeros(3, 2, 2, 4, 8)}  # 4 slots a page, 2 heads
    cache = caches["NHD"]
    args = lambda key, c=cache: (key, -key, i32(0, 1), i32(5, 0), c, i32(0, 2, 1), i32(0, 2, 3), i32(2, 1))  # noqa: E731
    for layout in ("NHD", "NHD", "HND", "HND"):
        key = torch.randn(2, 2, 8, generator=gen)
        cache = caches[layout]
        cache.zero_()
        fi.append_paged_kv_cache(*args(key, cache), kv_layout=layout)
        k = cache[:, 0] if layout == "NHD" else cache[:, 0].transpose(1, 2)
        v = cache[:, 1] if layout == "NHD" else cache[:, 1].transpose(1, 2)
        torch.testing.assert_close(k[2, 1], key[0])  # request 0, position 5: its second page (2), slot 1
        torch.testing.assert_close(v[1, 0], -key[1])  # request 1, position 0: page 1, slot 0
        assert k.abs().sum() == key.abs().sum()  # nothing else written
    assert len(calls) == 2  # one check per form (NHD, HND)
    assert [f.layout for f in fi.host_caches()["append_forms"]] == ["NHD", "HND"]
    cache = caches["NHD"]
    key = torch.randn(2, 2, 8, generator=gen)
    bad = [
        ((key.double(), -key.double(), *args(key)[2:]), "append_key"),
        ((key, -key, i32(0, 1).long(), *args(key)[3:]), "batch_indices"),
        ((key[:1], -key[:1], *args(key)[2:]), "batch_indices"),
        ((key, -key, *args(key)[2:4], cache[:, :1], *args(key)[5:]), "paged_kv_cache"),
    ]
    for a, name in bad:
        with pytest.raises((TypeError, ValueError), match=name):
            fi.append_paged_kv_cache(*a)
    fi.append_paged_kv_cache(*args(key))
    assert len(calls) == 2 + len(bad)


class _OpCount:
    """Counts, over one call, the torch operations dispatched (a ``TorchDispatchMode``) and the Python-level calls
    (``sys.setprofile``: Python functions and C functions, numpy's ufuncs excepted): what a plan() costs on the
    host, counted rather than timed, so that the counts are exact on any machine. (The garbage collector is off
    while counting: a collection would run other objects' finalizers inside the call.)"""

    def __init__(self, fn):
        import gc
        import sys

        from torch.utils._python_dispatch import TorchDispatchMode

        class Ops(TorchDispatchMode):
            n = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                Ops.n += 1
                return func(*args, **(kwargs or {}))

        fn()  # (a first call fills the per-wrapper caches)
        calls = [0]

        def prof(frame, event, arg):
            if event in ("call", "c_call"):
                calls[0] += 1

        gc.collect()
        gc.disable()
        try:
            sys.setprofile(prof)
            try:
                fn()
            finally:
                sys.setprofile(None)
            with Ops():
                fn()
        finally:
            gc.enable()
        self.torch_ops, self.calls = Ops.n, calls[0]


def _plans(monkeypatch):
    """(name, batch size -> a plan() call) of the host-table plans an engine makes each step, on the Triton path
    (``use_triton`` forced on the CPU: the plans are built, nothing is launched)."""
    from flashinfer_triton import _backend

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    ws = torch.empty(1 << 24, dtype=torch.uint8)
    gen = torch.Generator().manual_seed(22)
    hq, hkv, d, ps, keys = 32, 8, 128, 16, 1000

    def table(bs):
        return page_table([keys] * bs, ps, seed=int(torch.randint(1 << 30, (1,), generator=gen)))[:3]

    def decode(bs):
        t, w = table(bs), fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
        return lambda: w.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16)

    def prefill(bs):
        t, w = table(bs), fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        qo = torch.arange(bs + 1, dtype=torch.int32) * 100
        return lambda: w.plan(qo, *t, hq, hkv, d, ps, causal=True, q_data_type=torch.float16)

    def ragged(bs):
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        qo, kv = (torch.arange(bs + 1, dtype=torch.int32) * n for n in (100, keys))
        return lambda: w.plan(qo, kv, hq, hkv, d, causal=True, q_data_type=torch.float16)

    return [("decode", decode), ("prefill", prefill), ("ragged", ragged)]


# The counts of one plan() of the current code (torch operations, Python-level calls), with some room. A change that
# needs more host work per plan than this raises them here, with its measured host time in the commit.
_PLAN_BOUNDS = {"decode": (6, 92), "prefill": (8, 136), "ragged": (22, 115)}


def test_plan_host_work_bounded(monkeypatch):
    """plan() with host page tables does the same host work whatever the batch size (no call per request, no
    torch operation per request), within the bounds above: small tables (up to 16 requests, read as Python ints)
    and larger ones (numpy arithmetic) each cost the same at every size."""
    for name, make in _plans(monkeypatch):
        for sizes in ((2, 9, 16), (17, 64)):
            counts = [_OpCount(make(bs)) for bs in sizes]
            got = {(c.torch_ops, c.calls) for c in counts}
            assert len(got) == 1, f"{name} plan(): host work grows with the batch: {sorted(got)}"
            ops, calls = got.pop()
            assert ops <= _PLAN_BOUNDS[name][0], f"{name} plan(): {ops} torch operations"
            assert calls <= _PLAN_BOUNDS[name][1], f"{name} plan(): {calls} Python-level calls"
            assert ops > 0 and calls > 0  # (the counters count)
            if sizes[0] == 2:
                one = _OpCount(make(1))  # one request: at most the work of a small batch
                assert one.torch_ops <= ops and one.calls <= calls, name


# Python-level calls of a prefill plan() on the persistent Gluon grid (as an H100 plans it): its lists add a loop over
# the schedule's blocks of rounds (a third of the rounds left each, so about log1.5 of the rounds) for ragged batches,
# and one over the rounds (at most persist_single_max_units_per_sm) for one request. Measured: ragged 173 at 33
# requests to 217 at 2048, one request 168-179; the one-shot plan of the same batches 109.
_PERSIST_PLAN_CALLS = {33: 185, 512: 215, 2048: 230, "single": 190}


def test_persist_plan_host_work_bounded(monkeypatch):
    """plan() on the persistent grid, as on an H100: as many torch operations as the one-shot plan of the same
    wrapper (the lists ride in the work list's array and copy), and Python-level calls within the bounds above,
    growing with the logarithm of the batch (the schedule's blocks), not with the batch."""
    from flashinfer_triton import _backend, _prefill_impl
    from helpers import plan_as_on_h100

    plan_as_on_h100(monkeypatch, _prefill_impl)
    real = _prefill_impl._gluon_candidate
    monkeypatch.setattr(_prefill_impl, "_gluon_candidate", lambda o, d, g: real(o, torch.device("cuda", 0), g))
    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    ws = torch.empty(1 << 26, dtype=torch.uint8)

    def count(qo, kv, hkv):
        w = fi.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        c = _OpCount(lambda: w.plan(qo, kv, 32, hkv, 128, causal=True, q_data_type=torch.float16))
        return c, w._w.current_plan.plan.persist_nprog

    one_shot, nprog = count(*(torch.arange(18, dtype=torch.int32) * n for n in (100, 1000)), 8)
    assert nprog == 0
    for bs in (33, 512, 2048):
        c, nprog = count(*(torch.arange(bs + 1, dtype=torch.int32) * n for n in (100, 1000)), 8)
        assert nprog == 132, bs
        assert c.torch_ops == one_shot.torch_ops, (bs, c.torch_ops, one_shot.torch_ops)
        assert c.calls <= _PERSIST_PLAN_CALLS[bs], (bs, c.calls)
    for n in (2048, 4096):
        c, nprog = count(torch.tensor([0, n], dtype=torch.int32), torch.tensor([0, n], dtype=torch.int32), 32)
        assert nprog == 132, n
        assert c.calls <= _PERSIST_PLAN_CALLS["single"], (n, c.calls)


def test_eager_replan_same_layout_rewrites_in_place(monkeypatch):
    """An eager plan() whose layout (batch size, work list shape, staged sizes) equals the previous plan's rewrites
    that plan's arrays at the same addresses, and holds what a fresh wrapper's plan of the same batch holds."""
    from flashinfer_triton import _backend

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    gen = torch.Generator().manual_seed(7)
    ws = torch.empty(1 << 24, dtype=torch.uint8)
    hq, hkv, d, ps = 8, 2, 64, 16

    def table(last_len):
        # the same page counts (5 a request: so the same layout), other page indices and last-page lengths
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        return page_table([4 * ps + n for n in last_len], ps, seed=seed)[:3]

    qo = torch.tensor([0, 7, 9, 30], dtype=torch.int32)
    kinds = {
        "decode": (
            lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD"),
            lambda w, t: w.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16),
        ),
        "prefill": (
            lambda: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
            lambda w, t: w.plan(qo, *t, hq, hkv, d, ps, causal=True, q_data_type=torch.float16),
        ),
    }
    for name, (make, plan) in kinds.items():
        w = make()
        plan(w, table([16, 3, 9]))
        first = w.plan_info()
        t = table([5, 16, 1])
        plan(w, t)
        info, fresh = w.plan_info(), make()
        plan(fresh, t)
        want = fresh.plan_info()
        assert info.plan_id != first.plan_id, name
        for key in ("qo_indptr", "kv_indptr", "kv_lens", "work"):
            assert info.addresses[key] == first.addresses[key], (name, key)
        assert set(info.arrays) == set(want.arrays), name
        for key, x in want.arrays.items():
            if x.dtype.is_floating_point:  # (the partial-state buffers: workspace, not written by plan())
                continue
            assert torch.equal(info.arrays[key], x), (name, key)
        assert info.arrays["kv_lens"].tolist() == [69, 80, 65], name


def test_merge_state_known_form_two_allocations(request):
    """merge_state of a form whose launch is bound dispatches two torch operations (its outputs) and launches
    with the seven addresses; another form goes through the checks."""
    from flashinfer_triton import _merge_api

    gen = torch.Generator().manual_seed(5)
    va, vb = (torch.randn(6, 4, 16, generator=gen).half() for _ in range(2))
    sa, sb = (torch.randn(6, 4, generator=gen) for _ in range(2))
    got = []
    fi.clear_host_caches("merge_state")
    request.addfinalizer(lambda: fi.clear_host_caches("merge_state"))  # (the stand-in must not outlive the test)
    _merge_api.keep_bound_launch(va, sa, vb, sb, lambda *a: got.append(a) or True)  # (a stand-in for the launch)
    (form,) = fi.host_caches()["merge_state"]
    assert form.bound and form.shapes == (va.shape, sa.shape, vb.shape, sb.shape)
    c = _OpCount(lambda: fi.merge_state(va, sa, vb, sb))
    assert c.torch_ops == 2 and len(got) == 3
    ov, os_ = fi.merge_state(va, sa, vb, sb)
    assert ov.shape == va.shape and ov.dtype == va.dtype and ov.is_contiguous() and os_.dtype == torch.float32
    assert got[-1] == (va.data_ptr(), sa.data_ptr(), vb.data_ptr(), sb.data_ptr(), ov.data_ptr(), os_.data_ptr(),
                       sa.data_ptr())  # fmt: skip
    with pytest.raises(TypeError, match="v_b"):  # a form never bound: checked
        fi.merge_state(va, sa, vb.float(), sb)


def test_replan_inherits_binding_only_for_the_same_launch(monkeypatch):
    """An eager re-plan takes over the previous plan's binding when it gives run() the same launch (same options,
    rows, array addresses and plan fields) and the bound cache holds its pages; a plan of another batch size, or
    one that addresses a page past the bound cache, starts unbound (its first run() checks and binds again)."""
    from flashinfer_triton import _backend, _wrapper
    from flashinfer_triton._layout import paged_kv_views

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # the Triton plans on the CPU (no launch)
    gen = torch.Generator().manual_seed(11)
    ws = torch.empty(1 << 24, dtype=torch.uint8)
    hq, hkv, d, ps = 8, 2, 64, 16
    cache = torch.randn(20, 2, ps, hkv, d, generator=gen).half()

    pages = torch.empty(15, dtype=torch.int32)  # (on the CPU the plan keeps the caller's page indices: one buffer)

    def table(bs, top=20):
        if top > 20:  # the first request's first page past the bound cache's 20 pages
            pages.copy_(torch.cat((torch.tensor([top - 1]), torch.randperm(top - 1, generator=gen)[:14])))
        else:
            pages.copy_(torch.randperm(top, generator=gen)[:15])
        last = torch.randint(1, ps + 1, (bs,), generator=gen, dtype=torch.int32)
        return torch.arange(bs + 1, dtype=torch.int32) * 5, pages[: bs * 5], last

    kinds = {
        "decode": (
            lambda: fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD"),
            lambda w, t: w.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16),
            lambda bs: bs,
        ),
        "prefill": (
            lambda: fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD"),
            lambda w, t: w.plan(
                torch.arange(len(t[2]) + 1, dtype=torch.int32) * 3,
                *t,
                hq,
                hkv,
                d,
                ps,
                causal=True,
                q_data_type=torch.float16,
            ),  # fmt: skip
            lambda bs: 3 * bs,
        ),
    }
    for name, (make, plan, rows) in kinds.items():
        w = make()
        plan(w, table(3))
        q = torch.randn(rows(3), hq, d, generator=gen).half()
        out = torch.empty_like(q)
        k4, v4 = paged_kv_views(cache, "NHD")
        binding = _wrapper.RunBinding.of(
            [(lambda *a: True, (q, k4, v4, out, out))], q, cache, k4, v4, out, None, False, (None, None, None)
        )
        assert binding is not None and binding.kv_rows == 20
        # white-box: the binding a first run() would attach, attached to the current plan (nothing launches here)
        w._w._planned.attach_binding(binding)
        plan(w, table(3))  # same layout, other pages and lengths: the same launch
        # (bound and settled with no run() since: the attached binding, handed on by the re-plan)
        info = w.plan_info()
        assert info.bound and info.bind_tried, name
        first = info.plan_id
        plan(w, table(3))
        info = w.plan_info()
        assert info.bound and info.bind_tried and info.plan_id != first, name
        plan(w, table(3, top=30))  # a page index past the bound cache's 20
        info = w.plan_info()
        assert info.max_page_index == 29 and not info.bound and not info.bind_tried, name
        plan(w, table(3))
        assert not w.plan_info().bound, name  # (a plan that started unbound has nothing to hand on)
        w._w._planned.attach_binding(binding)  # (white-box, as above)
        plan(w, table(2))  # another batch size: other arrays and rows
        assert not w.plan_info().bound, name


def test_single_known_form_launches_directly(request):
    """single_decode / single_prefill of a form whose launch is bound go straight to it with the caller's q, k, v
    addresses (two torch operations with lse: the outputs, in their public shapes); any other form, or a tensor
    scale, goes through the checks and gets the error naming the argument."""
    from flashinfer_triton import _wrapper

    fi.clear_host_caches("single_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("single_forms"))  # (stand-ins must not outlive the test)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(8, 64, generator=gen).half()
    qp = torch.randn(5, 8, 64, generator=gen).half()
    k, v = (torch.randn(40, 2, 64, generator=gen).half() for _ in range(2))
    got = []
    for tag, qq, options, shapes in (
        (1, q, ("NHD", "NONE", False, None, None, None, -1, None, None, None, None, True, "log2"), (q.shape, (8,))),
        (2, qp, (None, None, None, None, True, "NHD", "NONE", False, None, -1, None, None, None, "auto", True, None,
                 None, False, "log2"), (qp.shape, (5, 8))),
    ):  # fmt: skip
        sb = _wrapper.SingleBinding()
        sb.launch, sb.then, sb.out_thrice, sb.no_lse_ptr = (lambda *a: got.append(a) or True), (), False, 0
        sb.o_dtype, sb.out_shape, sb.lse_shape, sb.plan = torch.float16, shapes[0], shapes[1], None
        _wrapper.keep_single_form(_wrapper.single_fast_key(tag, options, qq, k, v), sb)
    assert [f.op for f in fi.host_caches()["single_forms"]] == [
        "single_decode_with_kv_cache",
        "single_prefill_with_kv_cache",
    ]
    c = _OpCount(lambda: fi.single_decode_with_kv_cache(q, k, v, return_lse=True))
    assert c.torch_ops == 2 and len(got) == 3  # (_OpCount calls it three times)
    o, lse = fi.single_decode_with_kv_cache(q, k, v, return_lse=True)
    assert o.shape == q.shape and lse.shape == (8,) and o.dtype == torch.float16 and lse.dtype == torch.float32
    assert got[-1] == (q.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr(), lse.data_ptr())
    o, lse = fi.single_prefill_with_kv_cache(qp, k, v, causal=True, return_lse=True)
    assert o.shape == qp.shape and lse.shape == (5, 8) and len(got) == 5
    assert got[-1][:4] == (qp.data_ptr(), k.data_ptr(), v.data_ptr(), o.data_ptr())
    with pytest.raises(TypeError, match="v"):  # a form never bound: checked
        fi.single_decode_with_kv_cache(q, k, v.float(), return_lse=True)
    with pytest.raises(ValueError, match="scale_k"):  # a per-head scale of the wrong length: checked
        fi.single_prefill_with_kv_cache(qp, k, v, scale_k=torch.ones(3), causal=True, return_lse=True)
    assert len(got) == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("layout", ["NHD", "HND"])
def test_single_calls_bound_form_match_reference(layout):
    """Repeated single_decode / single_prefill calls of one form (the later ones through the bound launch, new
    q, k and v each time) match the float32 reference, lse included."""
    from flashinfer_triton import reference

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(17)
    hq, hkv, d, n = 16, 4, 128, 300
    kshape = (n, hkv, d) if layout == "NHD" else (hkv, n, d)
    for _ in range(4):
        k, v = (torch.randn(kshape, generator=gen).half().to(dev) for _ in range(2))
        q = torch.randn(hq, d, generator=gen).half().to(dev)
        o, lse = fi.single_decode_with_kv_cache(q, k, v, kv_layout=layout, return_lse=True)
        ro, rl = reference.single_decode_with_kv_cache(q.float(), k.float(), v.float(), layout, return_lse=True)
        torch.testing.assert_close(o.float(), ro, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, rl, atol=2e-3, rtol=2e-3)
        qp = torch.randn(37, hq, d, generator=gen).half().to(dev)
        op = fi.single_prefill_with_kv_cache(qp, k, v, causal=True, kv_layout=layout)
        rp = reference.single_prefill_with_kv_cache(qp.float(), k.float(), v.float(), causal=True, kv_layout=layout)
        torch.testing.assert_close(op.float(), rp, atol=2e-3, rtol=2e-3)
    # NHD: the decode form was bound after its first call, so the later calls took it
    if layout == "NHD":
        assert layout in {f.layout for f in fi.host_caches()["single_forms"] if f.op == "single_decode_with_kv_cache"}


@pytest.mark.interpret
def test_split_prefill_replan_same_shape_interpret():
    """A split prefill plan() repeated with another page table of the same shape (its partial-state views and arrays
    kept from the previous plan) runs to the float32 reference each time."""
    from flashinfer_triton import reference

    gen = torch.Generator().manual_seed(23)
    hq, hkv, d, ps, qlen, kv_len = 4, 2, 32, 16, 24, 96
    ws = torch.empty(1 << 22, dtype=torch.uint8, device=DEVICE)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    cache = torch.randn(10, 2, ps, hkv, d, generator=gen).half().to(DEVICE)
    qo = torch.tensor([0, qlen], dtype=torch.int32)
    for _ in range(2):
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        indptr, pages, last, _ = page_table([kv_len], ps, spare_pages=10 - kv_len // ps, seed=seed)
        w.plan(qo, indptr, pages, last, hq, hkv, d, ps, causal=True, q_data_type=torch.float16,
               fixed_split_size=2)  # fmt: skip
        assert w.plan_info().split
        q = torch.randn(qlen, hq, d, generator=gen).half().to(DEVICE)
        out = torch.full_like(q, float("nan"))
        w.run(q, cache, out=out)
        k = cache[pages.long(), 0].reshape(-1, hkv, d).float().cpu()
        v = cache[pages.long(), 1].reshape(-1, hkv, d).float().cpu()
        want = reference.single_prefill_with_kv_cache(q.float().cpu(), k, v, causal=True)
        torch.testing.assert_close(out.float().cpu(), want, atol=2e-3, rtol=2e-3)


def _replan_steps(dev):
    """Steps of an engine on one wrapper each (decode, prefill): plan(), then run() over three layers' caches,
    with the step's table the same as the last one's, or of other lengths and pages but the same page counts
    (the same layout: a re-plan that may keep the binding), or of another batch size; every output against the
    float32 reference of its request."""
    from flashinfer_triton import reference

    gen = torch.Generator().manual_seed(29)
    hq, hkv, d, ps, num_pages = 16, 4, 128, 16, 40
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    caches = [torch.randn(num_pages, 2, ps, hkv, d, generator=gen).half().to(dev) for _ in range(3)]

    def table(bs):
        # 6 pages a request (one layout per batch size), the last one partly filled
        lens = (5 * ps + torch.randint(1, ps + 1, (bs,), generator=gen)).tolist()
        seed = int(torch.randint(1 << 30, (1,), generator=gen))
        return page_table(lens, ps, spare_pages=num_pages - 6 * bs, seed=seed)[:3]

    def kv_of(cache, t, i):
        pages = t[1][int(t[0][i]) : int(t[0][i + 1])].long()
        n = (len(pages) - 1) * ps + int(t[2][i])
        return (cache[pages.cpu(), j].reshape(-1, hkv, d)[:n].float().cpu() for j in (0, 1))

    tables = [table(3)]
    tables += [tables[0], table(3), table(3), table(2), table(2)]
    dw = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    pw = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    for t in tables:
        bs, qlen = len(t[2]), 5
        dw.plan(*t, hq, hkv, d, ps, q_data_type=torch.float16)
        qo = torch.arange(bs + 1, dtype=torch.int32) * qlen
        pw.plan(qo, *t, hq, hkv, d, ps, causal=True, q_data_type=torch.float16)
        for cache in caches:
            q = torch.randn(bs, hq, d, generator=gen).half().to(dev)
            qp = torch.randn(bs * qlen, hq, d, generator=gen).half().to(dev)
            got, gotp = torch.full_like(q, float("nan")), torch.full_like(qp, float("nan"))
            dw.run(q, cache, out=got)
            pw.run(qp, cache, out=gotp)
            for i in range(bs):
                k, v = kv_of(cache, t, i)
                want = reference.single_decode_with_kv_cache(q[i].float().cpu(), k, v)
                torch.testing.assert_close(got[i].float().cpu(), want, atol=2e-3, rtol=2e-3)
                wantp = reference.single_prefill_with_kv_cache(qp[i * qlen : (i + 1) * qlen].float().cpu(), k, v,
                                                               causal=True)  # fmt: skip
                torch.testing.assert_close(gotp[i * qlen : (i + 1) * qlen].float().cpu(), wantp, atol=2e-3, rtol=2e-3)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_engine_steps_with_kept_bindings_match_reference():
    """An engine's eager steps on the GPU, where re-plans of the same layout keep the bound launches (the Gluon
    kernels' on Hopper, descriptors kept per cache): every layer's output of every step is right."""
    _replan_steps(torch.device("cuda"))


def test_engine_steps_cpu():
    """The same steps on the CPU (the PyTorch path): the step sequence and its reference hold there too."""
    _replan_steps(torch.device("cpu"))


def _table(kv_lens, ps):
    """(indptr, indices, last_page_len) int32 CPU tensors of requests of ``kv_lens`` keys, pages in order."""
    pages = [-(-k // ps) for k in kv_lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    last = [(k - 1) % ps + 1 if k else 0 for k in kv_lens]
    i32 = torch.int32
    return torch.tensor(indptr, dtype=i32), torch.arange(indptr[-1], dtype=i32), torch.tensor(last, dtype=i32)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _prefill_lists(qo_lens, kv_lens, kv_indptr, tile_t, bn, chunk, causal, window_left):
    """The work list and merge list of a paged prefill plan, one loop per tile and item (the rules of
    ``_prefill_impl.plan``): tiles of ``tile_t`` tokens, each over its visible keys, split into chunks of ``chunk``
    keys (0: no split), longest ranges first (stable); each row ends with its request's first query row, queries,
    keys and first page-table entry (``_work_row``)."""
    items, merges, base, q0 = [], [], 0, 0
    for r, (qo, kv) in enumerate(zip(qo_lens, kv_lens)):
        req = [q0, qo, kv, kv_indptr[r]]
        for t0 in range(0, qo, tile_t):
            n_tok = min(qo - t0, tile_t)
            ke = min(max(min(t0 + tile_t, qo) + kv - qo, 0), kv) if causal else kv
            ks = min(max(t0 + kv - qo - window_left, 0) // bn * bn, ke) if window_left >= 0 else 0
            if not chunk:
                items.append([r, t0, ks, ke, -1, 1, 0, 0, *req])
                continue
            splits = max(1, -(-(ke - ks) // chunk))
            for s in range(splits):
                a = ks + s * chunk
                prow = base + s if splits > 1 else -1
                items.append([r, t0, a, min(ke, a + chunk), prow, splits, 0, base, *req])
            if splits > 1:
                merges += [[q0 + t0 + u, base + u * splits, splits] for u in range(n_tok)]
                base += n_tok * splits
        q0 += qo
    return sorted(items, key=lambda it: it[2] - it[3]), merges


@pytest.mark.parametrize("paged", [True, False], ids=["paged", "ragged"])
def test_prefill_work_rows_carry_request_fields(monkeypatch, paged):
    """Every work row of a prefill plan ends with its request's first query row, queries, keys and kv_indptr entry
    (``_work_row``: the kernels read them from the row, not from the batch's index arrays), on every planning path
    (few tiles on Python ints, numpy, split pieces; eager through the wrapper and CUDA-graph mode), and the work list
    has a row for every program of the grid (CUDA-graph mode: zeros past the live count), so a program loads its
    row before comparing it with that count."""
    import numpy as np

    from flashinfer_triton import _backend, _prefill_impl, _work_row
    from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    monkeypatch.setattr(_prefill_impl, "_num_sms", lambda device: 132)
    nf, at = _work_row.WORK_FIELDS, _work_row.REQ_AT
    assert nf == _prefill_impl._WORK_FIELDS
    ps, hkv, group = (16 if paged else 1), 2, 4
    batches = {  # qo_lens, kv_lens (an empty request, a request of one query, kv_len 1 and 97)
        "few": ([7, 0, 33, 1], [97, 5, 40, 1]),
        "many": ([3, 130, 0, 17, 64, 1] * 4, [300, 130, 9, 97, 1000, 1] * 4),
        "split": ([40, 2], [3000, 2100]),
    }
    seen = set()
    for name, (qo_lens, kv_lens) in batches.items():
        qo = np.concatenate([[0], np.cumsum(qo_lens)]).astype(np.int64)
        kv = np.array(kv_lens, dtype=np.int64)
        kv_ip = np.concatenate([[0], np.cumsum(-(-kv // ps))])  # (paged: the page indptr; ragged: key rows)
        kw = dict(fixed_split_size=512) if name == "split" else {}
        i32 = lambda x: torch.from_numpy(x).int()  # noqa: E731
        buf = torch.empty(1 << 24, dtype=torch.uint8)
        if paged:
            w = fi.BatchPrefillWithPagedKVCacheWrapper(buf, "NHD")
            last = np.array([(k - 1) % ps + 1 if k else 0 for k in kv_lens], dtype=np.int64)
            w.plan(i32(qo), i32(kv_ip), torch.arange(int(kv_ip[-1])).int(), i32(last), group * hkv, hkv, 128, ps,
                   causal=True, **kw)  # fmt: skip
        else:
            w = fi.BatchPrefillWithRaggedKVCacheWrapper(buf, "NHD")
            w.plan(i32(qo), i32(kv_ip), group * hkv, hkv, 128, causal=True, **kw)
        plans = [w._w.current_plan.plan]
        opts = AttentionOptions(num_qo_heads=group * hkv, num_kv_heads=hkv, head_dim=128, page_size=ps, paged=paged,
                                causal=True)  # fmt: skip
        batch = AttentionBatch(len(kv), i32(qo), i32(kv_ip), None, i32(kv), torch.from_numpy(qo),
                               torch.from_numpy(kv), torch.from_numpy(kv_ip))  # fmt: skip
        ws = Workspace(torch.empty(1 << 20, dtype=torch.uint8), torch.empty(1 << 22, dtype=torch.uint8),
                       cuda_graph=True, max_batch_size=32, max_total_q=1024)  # fmt: skip
        plans.append(_prefill_impl.plan(opts, batch, ws))
        for graph, p in enumerate(plans):
            case = (name, "graph" if graph else "eager")
            rows = p.work.cpu().numpy().astype(np.int64)
            n = p.num_work_host
            assert rows.shape == (p.grid0, nf) and int(p.num_work[0]) == n and 0 < n <= p.grid0, case
            b = rows[:n, 0]
            want = np.stack([qo[b], qo[b + 1] - qo[b], kv[b], kv_ip[b]], axis=1)
            assert np.array_equal(rows[:n, at:], want), case
            assert not rows[n:].any(), case  # (programs past the live count: an empty range)
            seen.add((name, bool(graph), p.part_o is not None, p.grid0 > n))
    assert ("split", False, True, False) in seen and ("few", True, False, True) in seen, seen


@pytest.mark.parametrize("seed", range(4))
def test_prefill_plan_lists_match_loop_reference(monkeypatch, seed):
    """Paged prefill plans of random batches (causal or not, sliding window, fixed or automatic split, split
    disabled; 4 to 264 SMs) hold the work list and merge list that a loop over tiles and items makes: the numpy
    planning code is a faster form of these rules, not other rules. Planned twice (the second rewrites the
    kept arrays), both compared."""
    import random

    from flashinfer_triton import _backend, _prefill_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    rng = random.Random(seed)
    ws = torch.empty(1 << 26, dtype=torch.uint8)
    for _ in range(40):
        bs = rng.choice([1, 1, 2, 4, 8, 17, 33])
        ps, hkv, group = rng.choice([1, 16]), rng.choice([1, 2, 8]), rng.choice([1, 2, 4])
        qo_lens = [rng.choice([0, 1, 17, 128, rng.randrange(1, 600)]) for _ in range(bs)]
        kv_lens = [max(0, q + rng.choice([0, 100, 512, rng.randrange(0, 3000), -rng.randrange(50)])) for q in qo_lens]
        sms = rng.choice([4, 132, 264])
        monkeypatch.setattr(_prefill_impl, "_num_sms", lambda device, sms=sms: sms)
        kw = rng.choice(
            [dict(causal=True), dict(), dict(causal=True, window_left=rng.choice([0, 30, 200]))]
            + [dict(causal=True, fixed_split_size=rng.choice([16, 100])), dict(causal=True, disable_split_kv=True)]
        )
        qo = [0]
        for q in qo_lens:
            qo.append(qo[-1] + q)
        w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        table = _table(kv_lens, ps)
        for _ in range(2):
            w.plan(torch.tensor(qo, dtype=torch.int32), *table, hkv * group, hkv, 64, ps, **kw)
            p = w._w.current_plan.plan
            cfg, opts = p.config, w._w.current_plan.opts
            bn, ranges, chunk = cfg.block_n, [], 0
            # the split rule: whole waves of the programs the GPU holds, or the fixed size
            for q, k in zip(qo_lens, kv_lens):
                for t0 in range(0, q, p.tile_t):
                    ke = min(max(min(t0 + p.tile_t, q) + k - q, 0), k) if kw.get("causal") else k
                    wl = kw.get("window_left", -1)
                    ranges.append(ke - (min(max(t0 + k - q - wl, 0) // bn * bn, ke) if wl >= 0 else 0))
            units = len(ranges) * hkv
            if ranges and not kw.get("disable_split_kv"):
                if kw.get("fixed_split_size"):
                    chunk = -(-kw["fixed_split_size"] // bn) * bn
                elif (
                    units < sms
                    and max(ranges) >= 8 * bn
                    and (
                        # (the longest tile's work or K/V bytes at their minimums: 0 on the interpreter's tiles)
                        4 * p.tile_t * group * max(ranges) * 64 >= cfg.split_min_tile_flops
                        or 2 * max(ranges) * 64 * 2 >= cfg.split_min_tile_bytes
                    )
                ):
                    target = cfg.split_pieces or min(
                        _prefill_impl._programs_per_sm(cfg, opts) * sms // units, cfg.split_max_pieces
                    )
                    if target >= 2:
                        chunk = max(_cdiv(_cdiv(max(ranges), target), bn) * bn, 4 * bn)
            items, merges = _prefill_lists(
                qo_lens, kv_lens, table[0].tolist(), p.tile_t, bn, chunk, kw.get("causal", False),
                kw.get("window_left", -1),
            )  # fmt: skip
            case = f"{qo_lens} over {kv_lens}, {kw}, {sms} SMs"
            assert p.work.tolist() == items, case
            assert p.num_work.tolist() == [len(items)] and p.num_work_host == len(items), case
            assert (p.merge.tolist() if p.merge is not None else []) == merges, case
            assert p.num_merge_host == len(merges), case


def test_prefill_small_batch_plans_match_numpy_path(monkeypatch):
    """Batches of a few requests and tiles are planned on Python ints (``_tiles_small``): over random batches (causal
    or not, sliding windows, empty requests, splits for 4 to 264 SMs, tiles of the CPU's and the H100's Gluon
    shapes) every device array and host figure of the plan equals the numpy path's, which the loop reference
    above holds to the rules."""
    import random

    from flashinfer_triton import _backend, _config, _prefill_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    rng = random.Random(5)
    ws = torch.empty(1 << 26, dtype=torch.uint8)
    gluon_tile = _config.GluonPrefillConfig().tile
    small_batch = _prefill_impl._SMALL_BATCH
    hits = 0
    for _ in range(60):
        bs = rng.choice([1, 1, 2, 3, 5])
        hkv, group = rng.choice([1, 2, 8]), rng.choice([1, 2, 4])
        qo_lens = [rng.choice([0, 1, 7, 32, 128, rng.randrange(1, 300)]) for _ in range(bs)]
        kv_lens = [max(0, q + rng.choice([0, 100, 512, rng.randrange(0, 3000), -rng.randrange(50)])) for q in qo_lens]
        sms = rng.choice([4, 132, 264])
        monkeypatch.setattr(_prefill_impl, "_num_sms", lambda device, sms=sms: sms)
        kw = rng.choice(
            [dict(causal=True), dict(), dict(causal=True, window_left=rng.choice([0, 30, 200]))]
            + [dict(causal=True, fixed_split_size=100), dict(causal=True, disable_split_kv=True)]
        )
        config = gluon_tile if group <= 4 and rng.random() < 0.5 else None  # (128-row tiles of 128 keys)
        qo = [0]
        for q in qo_lens:
            qo.append(qo[-1] + q)
        table = _table(kv_lens, 16)
        plans = []
        for small in (small_batch, 0):  # (0: every batch takes the numpy path)
            monkeypatch.setattr(_prefill_impl, "_SMALL_BATCH", small)
            w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
            w.plan(torch.tensor(qo, dtype=torch.int32), *table, hkv * group, hkv, 64, 16, **kw)
            core = w._w
            batch = core.current_plan.batch
            if config is not None:  # the implementation's plan with the given tile, on the wrapper's batch
                p = _prefill_impl.plan(core.current_plan.opts, batch, core._workspace(), config=config)
            else:
                p = core.current_plan.plan
            plans.append(p)
        case = f"{qo_lens} over {kv_lens}, {kw}, {sms} SMs, config {config}"
        got, want = plans
        hits += 0 < got.num_work_host <= _prefill_impl._SMALL_TILES and got.merge is None
        for name in ("config", "tile_t", "grid0", "num_work_host", "num_merge_host", "work_flops"):
            assert getattr(got, name) == getattr(want, name), (name, case)
        for name in ("work", "num_work", "merge", "num_merge"):
            a, b = getattr(got, name), getattr(want, name)
            assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), (name, case)
    assert hits >= 10  # (the Python-int path ran)


def test_prefill_split_only_where_it_pays(monkeypatch):
    """An eager plan splits its KV (a merge launch more) only where the unsplit kernel's longest tile outlasts that
    launch's host time: with the H100's tiles and 132 SMs, a single request of 128 queries over 1024 keys (32/8,
    D128) runs in one launch, 128 over 2048, 16 over 16384, few-row tiles over long K/V and fp8 K/V past the byte
    minimum still split into whole waves; split_pieces forces a split, and the interpreter's tiles split at any
    size (no launch cost to weigh)."""
    from dataclasses import replace

    from flashinfer_triton import _config, _prefill_impl
    from flashinfer_triton._backend import AttentionBatch, AttentionOptions, Workspace

    monkeypatch.setattr(_prefill_impl, "_num_sms", lambda device: 132)
    ws = Workspace(torch.empty(1 << 24, dtype=torch.uint8), torch.empty(1 << 20, dtype=torch.uint8))
    gluon_tile = _config.GluonPrefillConfig().tile  # 128 x 128: 32 tokens of a group of 4
    small_tile = _config.PrefillConfig(16, 64, 4, 3)  # the H100's tile for a few queries: 4 tokens of a group of 4

    def p_opts(kw):
        return AttentionOptions(32, 8, 128, 1, False, causal=True, **kw)

    def plan(qo, kv, cfg, **kw):
        opts = p_opts(kw)
        qi, ki = torch.tensor([0, qo]), torch.tensor([0, kv])
        batch = AttentionBatch(1, qi.int(), ki.int(), None, ki[1:].int(), qi, ki[1:], ki)
        p = _prefill_impl.plan(opts, batch, ws, config=cfg)
        n_tiles = -(-qo // p.tile_t)
        return p, n_tiles

    fp8 = torch.float8_e4m3fn
    cases = [  # (queries, keys, config, options, split)
        (128, 1024, gluon_tile, {}, False),  # 4 tiles of 128 rows x <= 1024 keys: 67 MFLOP, 0.5 MB
        (128, 1220, gluon_tile, {}, False),  # 79.96 MFLOP
        (128, 1221, gluon_tile, {}, True),  # 80.02 MFLOP
        (128, 2048, gluon_tile, {}, True),
        (16, 16384, gluon_tile, {}, True),
        (4, 1024, small_tile, {}, False),  # 16 rows: 8 MFLOP, 0.5 MB (split before this rule: 16 KV tiles)
        (4, 1953, small_tile, {}, False),  # 999,936 bytes of K/V
        (4, 1954, small_tile, {}, True),  # 1,000,448
        (4, 8192, small_tile, dict(kv_dtype=fp8), True),  # 2 MB at one byte a value
        (4, 2048, small_tile, dict(kv_dtype=fp8), False),
    ]
    for qo, kv, cfg, kw, want in cases:
        p, n_tiles = plan(qo, kv, cfg, **kw)
        case = (qo, kv, cfg.block_m, kw)
        assert (p.merge is not None) == want, case
        assert p.num_work_host == n_tiles if not want else p.num_work_host > n_tiles, case
        if want:  # whole waves of the programs the GPU holds (x 8 KV heads)
            assert p.num_work_host * 8 <= 132 * _prefill_impl._programs_per_sm(cfg, p_opts(kw)), case
    # the rule reads only the config: forced pieces split, zero minimums split whatever the size
    p, n_tiles = plan(128, 1024, replace(gluon_tile, split_pieces=2))
    assert p.merge is not None and p.num_work_host == 2 * n_tiles
    p, n_tiles = plan(128, 1024, replace(gluon_tile, split_min_tile_flops=0.0, split_min_tile_bytes=0.0))
    assert p.merge is not None
    cpu_cfg = _prefill_impl.choose_config(AttentionOptions(32, 8, 128, 1, False, causal=True), 512, torch.device("cpu"))
    assert cpu_cfg.split_min_tile_flops == cpu_cfg.split_min_tile_bytes == 0
    assert _config.PrefillConfig(64, 64, 4, 3).split_min_tile_flops > 0


def test_decode_small_split_work_lists_match_numpy_path(monkeypatch):
    """Split decode work lists of a few requests are built on Python ints: over random lengths, chunks, sliding-window
    starts and alignments, eager (slots = chunks) and CUDA-graph-like (spare work slots and batch rows) layouts, the
    array written is the numpy path's, entry for entry, and so are the live count and the longest chunk count."""
    import random

    import numpy as np

    from flashinfer_triton import _decode_impl as impl

    rng = random.Random(11)
    checked = 0
    for _ in range(200):
        bsz = rng.randrange(1, impl._SMALL_SPLIT + 1)
        lens = np.array([rng.choice([0, 1, 64, 1000, rng.randrange(0, 5000)]) for _ in range(bsz)], dtype=np.int64)
        window = rng.choice([None, 0, 100, 700])
        starts = 0 if window is None else np.maximum(lens - 1 - window, 0)
        lens_eff = lens - starts
        chunk = rng.choice([64, 256, 320, 1024])
        align = rng.choice([0, 64])
        chunks = int(np.maximum((lens_eff + chunk - 1) // chunk, 1).sum())
        work_cap = chunks + rng.choice([0, 0, 3, 40])
        batch_cap = bsz + rng.choice([0, 0, 2])
        if work_cap > impl._SMALL_WORK:
            continue
        n_counters = batch_cap * rng.choice([1, 8])
        got, want = (np.full(4 * work_cap + batch_cap + 2 + n_counters, 0, dtype=np.int32) for _ in range(2))
        a = impl._work_host(bsz, work_cap, batch_cap, n_counters, starts, lens, lens_eff, chunk, align, out=got)
        monkeypatch.setattr(impl, "_SMALL_SPLIT", 0)  # (0: the numpy path)
        b = impl._work_host(bsz, work_cap, batch_cap, n_counters, starts, lens, lens_eff, chunk, align, out=want)
        monkeypatch.undo()
        case = (lens.tolist(), window, chunk, align, work_cap, batch_cap)
        assert a[1:] == b[1:] and np.array_equal(got, want), case
        checked += 1
    assert checked >= 150


def test_decode_work_lists_from_lists_match_numpy_path(monkeypatch):
    """A table's lengths as Python lists (the CUDA-graph decode re-plan reads small tables as lists) build
    the split work list on Python ints whatever the batch size: over random lengths, windows (list starts),
    alignments and layouts, the array, live count and longest chunk count are the numpy path's."""
    import random

    import numpy as np

    from flashinfer_triton import _decode_impl as impl

    rng = random.Random(5)
    for _ in range(150):
        bsz = rng.randrange(0, 65)
        choices = (0, 1, 63, 64, 65, 1000)
        lens = np.array([rng.choice([*choices, rng.randrange(0, 5000)]) for _ in range(bsz)], dtype=np.int64)
        window = rng.choice([None, 0, 100, 700])
        starts = 0 if window is None else np.maximum(lens - 1 - window, 0)
        lens_eff = lens - starts
        chunk = rng.choice([64, 256, 320, 1024])
        align = rng.choice([0, 64])
        work_cap = int(np.maximum((lens_eff + chunk - 1) // chunk, 1).sum()) + rng.choice([0, 3])
        batch_cap = bsz + rng.choice([0, 2])
        n_counters = batch_cap * rng.choice([1, 8])
        got, want = (np.zeros(4 * work_cap + batch_cap + 2 + n_counters, dtype=np.int32) for _ in range(2))
        start_l = 0 if window is None else starts.tolist()
        a = impl._work_host(bsz, work_cap, batch_cap, n_counters, start_l, lens.tolist(), lens_eff.tolist(), chunk,
                            align, out=got)  # fmt: skip
        monkeypatch.setattr(impl, "_SMALL_SPLIT", 0)  # (0: the numpy path)
        b = impl._work_host(bsz, work_cap, batch_cap, n_counters, starts, lens, lens_eff, chunk, align, out=want)
        monkeypatch.undo()
        case = (lens.tolist(), window, chunk, align, work_cap, batch_cap)
        assert a[1:] == b[1:] and np.array_equal(got, want), case


def test_small_table_lists_match_general_path(monkeypatch):
    """``read_table(lists=True)`` reads host tables of up to ``_SMALL_TABLE`` requests as Python lists and larger ones
    whose requests all have pages as int32 views (``_compact_host_table``): over random tables of up to 64 requests
    (empty requests, pages of 1 and 16, bad indptr and last_page_len entries) it gives the general path's arrays,
    page count and range, or raises its error."""
    import random

    import numpy as np

    from flashinfer_triton import _wrapper

    rng = random.Random(3)
    raised = compact = 0
    for _ in range(300):
        bs = rng.randrange(1, 65)
        ps = rng.choice([1, 16])
        p_empty = rng.choice([0.0, 0.3])
        pages = [rng.choice([0, 1, 2, 5, 40]) if rng.random() < p_empty else rng.randrange(1, 40) for _ in range(bs)]
        last = [rng.randrange(1, ps + 1) if p else rng.choice([0, 0, ps]) for p in pages]
        if rng.random() < 0.15:  # one bad entry: a decreasing indptr or a last page length out of range
            i = rng.randrange(bs)
            if rng.random() < 0.5:
                pages[i] = -1
            else:
                last[i] = rng.choice([0, ps + 1]) if pages[i] else ps + 1
        indptr = torch.tensor([0, *np.cumsum(pages).tolist()], dtype=torch.int32)
        nnz = max(int(indptr[-1]), 0)
        indices = torch.randint(0, 1000, (nnz + rng.choice([0, 3]),), dtype=torch.int32)
        lp = torch.tensor(last, dtype=torch.int32)
        try:
            got = _wrapper.read_table(indptr, indices, lp, ps, lists=True)
        except ValueError as e:
            got = str(e)
        with monkeypatch.context() as m:
            m.setattr(_wrapper, "_SMALL_TABLE", 0)
            try:
                want = _wrapper.read_table(indptr, indices, lp, ps)
            except ValueError as e:
                want = str(e)
        case = (pages, last, ps)
        if isinstance(want, str):
            assert got == want, case
            raised += 1
            continue
        assert (got.n, got.nnz, got.max_index) == (want.n, want.nnz, want.max_index), case
        if bs <= _wrapper._SMALL_TABLE:
            assert got.lists is not None and got.indptr is None  # (the arrays are made on request only)
            lens = got.lists[2]
        else:
            assert got.lists is None
            compact += min(pages) > 0
            assert (got.indptr.dtype == np.int32) == (min(pages) > 0), case  # (the compact read: views)
            assert np.array_equal(got.kv_lens, want.kv_lens), case
            lens = got.kv_lens
        assert _wrapper.same_lengths(torch.tensor(want.kv_lens, dtype=torch.int32), lens)
        assert not _wrapper.same_lengths(torch.tensor(want.kv_lens, dtype=torch.int32) + 1, lens)
        got.with_arrays()
        for i, name in enumerate(("indptr", "last", "kv_lens")):
            if got.lists is not None:
                assert got.lists[i] == getattr(want, name).tolist(), (case, name)
            assert getattr(got, name).dtype == np.int64 and np.array_equal(getattr(got, name), getattr(want, name))
    assert raised >= 20 and compact >= 50


@pytest.mark.parametrize("window", [-1, 150])
def test_graph_decode_replan_from_lists_matches_arrays(monkeypatch, window):
    """The CUDA-graph decode re-plan of a small host table (Python lists) writes what the numpy path writes: the
    staged region, the work list, the caller's buffers and the batch's host kv_indptr / kv_lens (int64), step after
    step of growing lengths, with and without a sliding window, below and above ``_SMALL_SPLIT`` requests."""
    from flashinfer_triton import _backend, _decode_impl, _wrapper

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the Triton planner on CPU tensors)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)

    def state(w):
        core = w._w
        p, b = core._planned.plan, core._planned.batch
        region = core._layout[4][2][0]
        bufs = (core._paged_kv_indptr_buf, core._paged_kv_last_page_len_buf, core._paged_kv_indices_buf)
        return (region.tolist(), p.num_work, p.chunk, [x.tolist() for x in bufs], b.kv_indptr_host.tolist(),
                b.kv_lens_host.tolist(), b.kv_lens_host.dtype, b.kv_indptr_host.dtype)  # fmt: skip

    for bs in (1, 8, 24):
        ws = [torch.empty(64 << 20, dtype=torch.uint8) for _ in range(2)]
        ws_lists, ws_arrays = (
            fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                w, torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs * 1100, dtype=torch.int32),
                torch.ones(bs, dtype=torch.int32),
            )
            for w in ws
        )  # fmt: skip
        for step in range(4):
            lens = [300 + step + 37 * i for i in range(bs)]
            indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
            kw = dict(indices=torch.randperm(bs * 1100, dtype=torch.int32)[: sum(lens)],
                      last_page_len=torch.ones(bs, dtype=torch.int32), num_qo_heads=9, num_kv_heads=3, head_dim=64,
                      page_size=1, window_left=window, seq_lens=torch.tensor(lens, dtype=torch.int32),
                      q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
            ws_lists.plan(indptr, **kw)
            # (no window: split, the work list path under test; the window's 151 keys run whole)
            assert (ws_lists._w._planned.plan.chunk is not None) == (window < 0)
            with monkeypatch.context() as m:  # (the general path's int64 arrays)
                m.setattr(_wrapper, "_SMALL_TABLE", 0)
                m.setattr(_wrapper, "_compact_host_table", lambda *a: None)
                ws_arrays.plan(indptr, **kw)
            assert state(ws_lists) == state(ws_arrays), (bs, step)


@pytest.mark.parametrize("bs", [1, 16, 17, 64, 65])
def test_graph_decode_replan_lists_at_batch_boundaries(monkeypatch, bs):
    """The list path against the numpy one at the batch sizes where it changes hands (16 / 17 requests: the split
    work list per request or in numpy, a table read as lists or as int32 views; 64 / 65: the split rule's sums on
    Python ints or in numpy), with pages of 1 and 16 keys, empty requests and one-key requests, sliding windows that
    leave requests split, and ``fixed_split_size``."""
    import random

    from flashinfer_triton import _backend, _decode_impl, _wrapper

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the Triton planner on CPU tensors)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)

    def state(w):
        core = w._w
        p, b = core._planned.plan, core._planned.batch
        bufs = (core._paged_kv_indptr_buf, core._paged_kv_last_page_len_buf, core._paged_kv_indices_buf)
        return (core._layout[4][2][0].tolist(), p.num_work, p.chunk, [x.tolist() for x in bufs],
                b.kv_indptr_host.tolist(), b.kv_lens_host.tolist())  # fmt: skip

    rng = random.Random(bs)
    split = 0
    for ps in (1, 16):
        for window in (-1, 40, 300):
            for fixed in (None, 2):
                max_pages = 3000 // ps + 2
                ws_lists, ws_arrays = (
                    fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                        torch.empty(64 << 20, dtype=torch.uint8), torch.zeros(bs + 1, dtype=torch.int32),
                        torch.zeros(bs * max_pages, dtype=torch.int32), torch.ones(bs, dtype=torch.int32),
                    )
                    for _ in range(2)
                )  # fmt: skip
                for step in range(2):
                    lens = [rng.choice([0, 1, 17, rng.randrange(0, 3000)]) for _ in range(bs)]
                    pages = [-(-n // ps) for n in lens]
                    last = [n - (p - 1) * ps if p else 0 for n, p in zip(lens, pages)]
                    indptr = torch.tensor([0, *pages], dtype=torch.int32).cumsum(0).to(torch.int32)
                    kw = dict(indices=torch.randperm(bs * max_pages, dtype=torch.int32)[: sum(pages)],
                              last_page_len=torch.tensor(last, dtype=torch.int32), num_qo_heads=8, num_kv_heads=1,
                              head_dim=64, page_size=ps, window_left=window,
                              seq_lens=torch.tensor(lens, dtype=torch.int32), q_data_type=torch.bfloat16,
                              kv_data_type=torch.bfloat16, fixed_split_size=fixed)  # fmt: skip
                    ws_lists.plan(indptr, **kw)
                    with monkeypatch.context() as m:  # (the general path's int64 arrays, numpy's work list)
                        m.setattr(_wrapper, "_SMALL_TABLE", 0)
                        m.setattr(_wrapper, "_compact_host_table", lambda *a: None)
                        m.setattr(_decode_impl, "_SMALL_SPLIT", 0)
                        ws_arrays.plan(indptr, **kw)
                    assert state(ws_lists) == state(ws_arrays), (ps, window, fixed, step)
                    split += ws_lists._w._planned.plan.chunk is not None
    assert split >= 6  # (the split work list itself compared, not only whole requests)


def test_graph_decode_replan_keeps_no_plan_alive(monkeypatch):
    """What the CUDA-graph decode re-plan keeps between calls (its split rule's fixed inputs per plan object) holds
    no plan: once the wrapper and its workspace are dropped, the plan goes too, and with it the workspace's memory
    (its work list and partial outputs are views of the caller's buffers)."""
    import gc
    import weakref

    from flashinfer_triton import _backend, _decode_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the Triton planner on CPU tensors)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)
    bs = 4
    ws = torch.empty(64 << 20, dtype=torch.uint8)
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
        ws, torch.zeros(bs + 1, dtype=torch.int32), torch.zeros(bs * 100, dtype=torch.int32),
        torch.ones(bs, dtype=torch.int32),
    )  # fmt: skip
    indptr = torch.arange(0, 50 * bs + 1, 50, dtype=torch.int32)
    for _ in range(2):  # (the second plan: the re-plan's kept inputs taken)
        w.plan(indptr, torch.arange(50 * bs, dtype=torch.int32), torch.ones(bs, dtype=torch.int32), 9, 3, 64, 1,
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
    plan = weakref.ref(w._w._planned.plan)
    assert plan() is not None
    del w, ws
    gc.collect()
    assert plan() is None


@pytest.mark.interpret
@pytest.mark.parametrize("seed", range(3))
def test_graph_decode_device_work_list_matches_host(monkeypatch, seed):
    """The work list a CUDA-graph decode plan builds on the device (``_decode_impl.DeviceWorkList``) is the host
    planner's, entry for entry: over random batches of 1-70 requests (empty requests, lengths around the chunk,
    page sizes 1 and 16), with and without a sliding window, fixed split sizes, split disabled, and batches past
    the split rule's request count (no split), the whole staged region (arrays, work rows, work_indptr, live
    count, counters) and the caller's buffers equal those of the host path, plan after plan on one layout, with the
    page indices on the device (aligned or not), on the host, or already in the caller's buffer."""
    import random

    from flashinfer_triton import _backend, _decode_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)  # (the Triton planner on CPU tensors)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)
    rng = random.Random(seed)

    def state(w):
        core = w._w
        region = core._layout[4][2][0]
        bufs = (core._paged_kv_indptr_buf, core._paged_kv_last_page_len_buf, core._paged_kv_indices_buf)
        b = core._planned.batch
        return (region.tolist(), core._planned.plan.chunk, [x.tolist() for x in bufs], b.kv_indptr_host.tolist(),
                b.kv_lens_host.tolist())  # fmt: skip

    cases = 0
    for _ in range(8):
        bs, ps = rng.choice([1, 3, 8, 17, 32, 48, 70]), rng.choice([1, 1, 16])
        opts = rng.choice([{}, {}, {"window_left": rng.choice([0, 37, 1500])},
                           {"fixed_split_size": rng.choice([1, 40])}, {"disable_split_kv": True}])  # fmt: skip
        ws = [torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE) for _ in range(2)]
        bufs = [
            (torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE), torch.zeros(bs * 3000, dtype=torch.int32,
             device=DEVICE), torch.ones(bs, dtype=torch.int32, device=DEVICE))
            for _ in range(2)
        ]  # fmt: skip
        dev_w, host_w = (fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(w, *b) for w, b in zip(ws, bufs))
        for _ in range(3):
            choices = [0, 1, ps, 63, 64, 65, 129]
            lens = [rng.choice([*choices, rng.randint(0, 3000), rng.randint(0, 3000)]) for _ in range(bs)]
            pages = [-(-n // ps) for n in lens]
            last = [n - (p - 1) * ps if p else 0 for n, p in zip(lens, pages)]
            indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
            kw = dict(indices=torch.randperm(bs * 3000, dtype=torch.int32)[: sum(pages)].to(DEVICE),
                      last_page_len=torch.tensor(last, dtype=torch.int32), num_qo_heads=8, num_kv_heads=2,
                      head_dim=64, page_size=ps, seq_lens=torch.tensor(lens, dtype=torch.int32),
                      q_data_type=torch.float16, kv_data_type=torch.float16, **opts)  # fmt: skip
            form = rng.choice(["device", "device", "off-16-bytes", "host", "the buffer"])
            idx = kw.pop("indices")
            if form == "off-16-bytes":  # (the launch bound with aligned indices must not take these)
                idx = torch.cat([idx[:1], idx])[1:]
            elif form == "host":  # (copied apart from the launch)
                idx = idx.cpu()
            dev_idx = host_idx = idx
            if form == "the buffer":  # an engine's way: the indices already in the buffer (nothing to copy)
                dev_idx, host_idx = (b[1][: idx.shape[0]] for b in bufs)
                dev_idx.copy_(idx)
                host_idx.copy_(idx)
            dev_w.plan(indptr, dev_idx, **kw)
            with monkeypatch.context() as m:
                m.setattr(_decode_impl, "builds_work_on_device", lambda device: False)
                host_w.plan(indptr, host_idx, **kw)
            assert host_w._w._layout[4][2][6] is None and dev_w._w._layout[4][2][6] is not None
            assert dev_w._w._planned.plan.num_work is None
            assert state(dev_w) == state(host_w), (bs, ps, opts, lens)
            cases += dev_w._w._planned.plan.chunk is not None
    assert cases or seed  # (seed 0 splits)


@pytest.mark.parametrize("seed", range(3))
def test_fused_cascade_lists_match_loop_reference(monkeypatch, seed):
    """The fused cascade plan of random two- and three-level batches holds the work list, merge list and batch
    arrays that loops over levels, pieces and tiles make (``_FusedCascade``'s rules, the split counts given)."""
    import random

    import numpy as np

    from flashinfer_triton import _backend, _prefill_impl, cascade

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    rng = random.Random(seed)
    ws = torch.empty(1 << 26, dtype=torch.uint8)
    seen = 0
    for _ in range(30):
        levels, bs, ps = rng.choice([2, 3]), rng.choice([1, 3, 8]), rng.choice([1, 16])
        hkv, group = rng.choice([1, 8]), rng.choice([1, 4])
        qlen = rng.choice([1, 1, 3, 40])
        sms = rng.choice([4, 132])
        monkeypatch.setattr(_prefill_impl, "_num_sms", lambda device, sms=sms: sms)
        monkeypatch.setattr(cascade, "_num_sms", lambda device, sms=sms: sms)
        total = qlen * bs
        qo_l, kv_l = [], []
        for lv in range(levels):
            n = bs if lv == levels - 1 or rng.random() < 0.5 else 1
            qo_l.append([0, total] if n == 1 else [i * qlen for i in range(bs + 1)])
            kv_l.append([rng.choice([0, 17, 300, 2048, rng.randrange(0, 5000)]) for _ in range(n)])
        tables = [_table(k, ps) for k in kv_l]
        cw = fi.MultiLevelCascadeAttentionWrapper(levels, ws, "NHD")
        cw.plan(
            [torch.tensor(q, dtype=torch.int32) for q in qo_l],
            *([t[i] for t in tables] for i in range(3)),
            hkv * group,
            hkv,
            64,
            ps,
        )
        f = cw._fused
        if f is None:
            continue
        seen += 1
        p, bn = f.plan, f.plan.config.block_n
        tiles = [  # per level: (request, first token, KV length) of each query tile
            [(r, t0, k) for r, k in enumerate(kv) for t0 in range(0, qo[r + 1] - qo[r], p.tile_t)]
            for qo, kv in zip(qo_l, kv_l)
        ]
        ranges = [np.array([k for _, _, k in t], dtype=np.int64) for t in tiles]
        opts = f.opts
        splits = cascade._choose_splits(
            ranges, bn, sms, total, opts.num_qo_heads, hkv, opts.head_dim, opts.kv_dtype.itemsize
        )
        slots = sum(splits)
        items, req_base, slot_base, kv_base = [], 0, 0, 0
        for qo, t, s_l, table in zip(qo_l, tiles, splits, tables):
            for s in range(s_l):
                for r, t0, k in t:
                    piece = _cdiv(_cdiv(k, s_l), bn) * bn
                    prow = (qo[r] + t0) * slots + slot_base + s if slots > 1 else -1
                    # (then the request's first query row, queries, keys, first page in the concatenated batch)
                    req = [qo[r], qo[r + 1] - qo[r], k, int(table[0][r]) + kv_base]
                    rng_s = [min(s * piece, k), min((s + 1) * piece, k)]
                    items.append([r + req_base, t0, *rng_s, prow, slots, 0, 0, *req])
            req_base += len(qo)
            slot_base += s_l
            kv_base += int(table[0][-1])
        items.sort(key=lambda it: it[2] - it[3])
        case = f"{qo_l} over {kv_l}, {sms} SMs"
        assert p.work.tolist() == items and p.num_work.tolist() == [len(items)], case
        merges = [[u, u * slots, slots] for u in range(total)] if slots > 1 else []
        assert (p.merge.tolist() if p.merge is not None else []) == merges, case
        b, kv_ip, off = f.batch, [], 0
        for t in tables:
            kv_ip += [x + off for x in t[0].tolist()]
            off += int(t[0][-1])
        assert b.qo_indptr.tolist() == sum(qo_l, []) == b.qo_indptr_host.tolist(), case
        assert b.kv_indptr.tolist() == kv_ip, case
        assert b.kv_lens.tolist() == sum((k + [0] for k in kv_l), []) == b.kv_lens_host.tolist(), case
        assert b.kv_indices.tolist() == sum((t[1].tolist() for t in tables), []) or not any(sum(kv_l, [])), case
    assert seen > 5


def test_prefill_graph_plan_stages_batch_once(monkeypatch):
    """A CUDA-graph prefill plan() stages the batch's arrays and refills the caller's buffers once per plan (one
    copy into the fixed-address stage, one refill of the buffers), and a re-plan leaves what a first plan leaves."""
    from flashinfer_triton import _backend, _wrapper

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    calls = []
    staged = _wrapper._AttentionWrapper._graph_batch_arrays

    def counted(self, *args, **kwargs):
        calls.append(1)
        return staged(self, *args, **kwargs)

    monkeypatch.setattr(_wrapper._AttentionWrapper, "_graph_batch_arrays", counted)
    ws = torch.empty(1 << 24, dtype=torch.uint8)
    bs, ps = 4, 16

    def graph_wrapper():
        i32 = torch.int32
        bufs = dict(
            qo_indptr_buf=torch.zeros(bs + 1, dtype=i32), paged_kv_indptr_buf=torch.zeros(bs + 1, dtype=i32),
            paged_kv_indices_buf=torch.zeros(512, dtype=i32), paged_kv_last_page_len_buf=torch.zeros(bs, dtype=i32),
        )  # fmt: skip
        return fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD", use_cuda_graph=True, max_total_q=64, **bufs), bufs

    w, bufs = graph_wrapper()
    for qo_lens, kv_lens in (([5, 1, 30, 7], [40, 1, 300, 7]), ([2, 2, 2, 2], [100, 17, 0, 2]), ([9] * 4, [900] * 4)):
        qo = torch.tensor([0] + [sum(qo_lens[: i + 1]) for i in range(bs)], dtype=torch.int32)
        table = _table(kv_lens, ps)
        args = (qo, *table, 8, 2, 64, ps)
        calls.clear()
        w.plan(*args, causal=True)
        assert len(calls) == 1
        fresh = graph_wrapper()[0]
        fresh.plan(*args, causal=True)
        for name in ("qo_indptr", "kv_indptr", "kv_lens"):
            got, want = getattr(w._w.current_plan.batch, name), getattr(fresh._w.current_plan.batch, name)
            assert got.tolist() == want.tolist(), name
        assert w._w.current_plan.plan.work.tolist() == fresh._w.current_plan.plan.work.tolist()
        assert w._w.current_plan.plan.num_work.tolist() == fresh._w.current_plan.plan.num_work.tolist()
        assert bufs["qo_indptr_buf"].tolist() == qo.tolist()
        assert bufs["paged_kv_indptr_buf"].tolist() == table[0].tolist()
        assert bufs["paged_kv_last_page_len_buf"].tolist() == table[2].tolist()
        assert bufs["paged_kv_indices_buf"][: int(table[0][-1])].tolist() == table[1].tolist()


def test_merge_state_bound_form_key_holds_every_field(request):
    """merge_state's bound launch serves only its exact form: a v_b of the same shape that is not contiguous, a v of
    another dtype or an s of another shape go through the checks (the general path: right results, or the error
    naming the argument), never to the launch kept for the contiguous float16 form."""
    from flashinfer_triton import _merge_api, reference

    gen = torch.Generator().manual_seed(8)
    va, vb = (torch.randn(6, 4, 16, generator=gen).half() for _ in range(2))
    sa, sb = (torch.randn(6, 4, generator=gen) for _ in range(2))
    got = []
    fi.clear_host_caches("merge_state")
    request.addfinalizer(lambda: fi.clear_host_caches("merge_state"))
    _merge_api.keep_bound_launch(va, sa, vb, sb, lambda *a: got.append(a) or True)
    wide = torch.randn(6, 4, 32, generator=gen).half()
    cases = [
        (va, sa, wide[..., :16], sb),  # same shape and dtype, rows 32 apart
        (va.float(), sa, vb.float(), sb),  # another dtype
        (va[:5], sa[:5], vb[:5], sb[:5]),  # another shape
    ]
    for a in cases:
        ov, os_ = fi.merge_state(*a)
        rv, rs = reference.merge_state(*a)
        torch.testing.assert_close(ov.float(), rv, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(os_, rs, atol=1e-5, rtol=1e-5)
    assert got == []  # (none of them reached the kept launch)
    for bad, name, exc in (
        ((va, sa, vb, sb.double()), "s_b", TypeError),
        ((va, sa, vb, sb[:, :3]), "s_b", ValueError),
        ((va, sa.t(), vb, sb), "s_a", ValueError),
    ):
        with pytest.raises(exc, match=name):
            fi.merge_state(*bad)
    fi.merge_state(va, sa, vb, sb)
    assert len(got) == 1  # (the kept form itself still launches)


def test_append_known_form_key_rechecks_changed_forms(monkeypatch, request):
    """append_paged_kv_cache's form key: a strided index tensor, a kv_last_page_len of another dtype or length, or
    appended rows of another stride are other forms, checked again (the error naming the argument, or the right
    slots written); a bound form launches with the call's eight addresses and still runs the CPU's range checks."""
    from flashinfer_triton import page

    fi.clear_host_caches("append_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("append_forms"))
    calls = []
    orig = page._check_append
    monkeypatch.setattr(page, "_check_append", lambda *a: calls.append(1) or orig(*a))
    gen = torch.Generator().manual_seed(4)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = torch.randn(3, 2, 4, 2, 8, generator=gen)  # 3 pages of 4 slots, 2 heads, head dim 8
    key = torch.randn(2, 2, 8, generator=gen)
    bi, pos, idx, indptr, last = i32(0, 1), i32(5, 0), i32(0, 2, 1), i32(0, 2, 3), i32(2, 1)
    fi.append_paged_kv_cache(key, -key, bi, pos, cache, idx, indptr, last)
    assert len(calls) == 1
    strided = i32(0, 7, 1, 7)[::2]  # [0, 1] at stride 2
    for args, name, exc in (
        ((key, -key, strided, pos, cache, idx, indptr, last), "batch_indices", ValueError),
        ((key, -key, bi, pos, cache, idx, i32(0, 7, 2, 7, 3, 7)[::2], last), "kv_indptr", ValueError),
        ((key, -key, bi, pos, cache, idx, indptr, last.long()), "kv_last_page_len", TypeError),
        ((key, -key, bi, pos, cache, idx, indptr, i32(2, 1, 1)), "kv_last_page_len", ValueError),
        ((torch.randn(2, 2, 16, generator=gen)[..., ::2], -key, bi, pos, cache, idx, indptr, last), "append_key",
         ValueError),
    ):  # fmt: skip
        with pytest.raises(exc, match=name):
            fi.append_paged_kv_cache(*args)
    assert len(calls) == 6
    rows = torch.randn(2, 2, 32, generator=gen)[..., :8]  # rows 64 apart: another form, written right
    cache.zero_()
    fi.append_paged_kv_cache(rows, -rows, bi, pos, cache, idx, indptr, last)
    assert len(calls) == 7
    want = torch.zeros_like(cache)
    want[2, :, 1] = torch.stack([rows[0], -rows[0]])  # request 0, position 5: its second page (2), slot 1
    want[1, :, 0] = torch.stack([rows[1], -rows[1]])  # request 1, position 0: page 1, slot 0
    torch.testing.assert_close(cache, want, atol=0, rtol=0)  # (nothing else written)
    # the first form with a stand-in bound launch (white-box: CPU tensors never bind)
    launched = []
    form = page._forms_key("NHD", cache, key, -key, bi, pos, idx, indptr, last)
    v_off = cache[:, 1].data_ptr() - cache.data_ptr()
    page._CHECKED_FORMS[form] = (lambda *a: launched.append(a) or True, 0, v_off, False, cache.device, 3, 4, True)
    key2, val2 = (torch.randn(2, 2, 8, generator=gen) for _ in range(2))
    bi2, pos2 = i32(1, 0), i32(1, 3)
    fi.append_paged_kv_cache(key2, val2, bi2, pos2, cache, idx, indptr, last)
    assert launched == [(key2.data_ptr(), val2.data_ptr(), bi2.data_ptr(), pos2.data_ptr(), cache.data_ptr(),
                         cache[:, 1].data_ptr(), idx.data_ptr(), indptr.data_ptr())]  # fmt: skip
    with pytest.raises(ValueError, match="positions"):  # request 1 holds one page: position 4 is past it
        fi.append_paged_kv_cache(key2, val2, bi2, i32(4, 3), cache, idx, indptr, last)
    assert len(launched) == 1 and len(calls) == 7


def test_append_last_form_follows_the_kept_forms(monkeypatch, request):
    """append_paged_kv_cache keeps the last form it looked up beside the kept forms: calls alternating between two
    forms, or repeating one, are checked once per form and write exactly their slots; emptying the kept forms
    (clear_host_caches) or storing one forgets the last form too, so the next call is checked again."""
    from flashinfer_triton import page, reference

    fi.clear_host_caches("append_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("append_forms"))
    calls = []
    orig = page._check_append
    monkeypatch.setattr(page, "_check_append", lambda *a: calls.append(1) or orig(*a))
    gen = torch.Generator().manual_seed(12)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    bi, pos, idx, indptr, last = i32(0, 1), i32(5, 0), i32(0, 2, 1), i32(0, 2, 3), i32(2, 1)
    nhd, hnd = torch.randn(3, 2, 4, 2, 8, generator=gen), torch.randn(3, 2, 2, 4, 8, generator=gen)
    for step, layout in enumerate(("NHD", "NHD", "HND", "NHD", "HND", "clear", "HND", "HND")):
        if layout == "clear":
            fi.clear_host_caches("append_forms")
            assert page._CHECKED_FORMS.last is None
            continue
        cache = nhd if layout == "NHD" else hnd
        key, value = (torch.randn(2, 2, 8, generator=gen) for _ in range(2))
        want = cache.clone()
        reference.append_paged_kv_cache(key, value, bi, pos, want, idx, indptr, last, layout)
        fi.append_paged_kv_cache(key, value, bi, pos, cache, idx, indptr, last, kv_layout=layout)
        torch.testing.assert_close(cache, want, atol=0, rtol=0)
        assert len(calls) == (1 if step < 2 else 2 if step < 6 else 3), (step, layout)
    form = page._forms_key("HND", hnd, key, value, bi, pos, idx, indptr, last)
    assert page._CHECKED_FORMS.last[0] == form
    page._CHECKED_FORMS[form] = None  # (stored again: the last form is forgotten)
    assert page._CHECKED_FORMS.last is None


def test_single_bound_outputs_fresh_contiguous(request):
    """A bound single-request form allocates fresh, contiguous outputs in the form's public shapes and dtypes
    (an o_dtype other than q's included), never memory the library keeps; a q of the same shape with other
    strides is another form (checked, computed by the general path)."""
    from flashinfer_triton import _wrapper, reference

    fi.clear_host_caches("single_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("single_forms"))
    gen = torch.Generator().manual_seed(6)
    qp = torch.randn(5, 8, 64, generator=gen).half()
    k, v = (torch.randn(40, 2, 64, generator=gen).half() for _ in range(2))
    got = []
    options = (None, None, None, torch.float32, True, "NHD", "NONE", False, None, -1, None, None, None, "auto", True,
               None, None, False, "log2")  # fmt: skip
    sb = _wrapper.SingleBinding()
    sb.launch, sb.then, sb.out_thrice, sb.no_lse_ptr = (lambda *a: got.append(a) or True), (), False, 0
    sb.o_dtype, sb.out_shape, sb.lse_shape, sb.plan = torch.float32, qp.shape, qp.shape[:2], None
    _wrapper.keep_single_form(_wrapper.single_fast_key(2, options, qp, k, v), sb)
    seen = set()
    kept = _wrapper._TEMPLATE_BASES[qp.device]  # (what the output templates view)
    for _ in range(3):
        o, lse = fi.single_prefill_with_kv_cache(qp, k, v, o_dtype=torch.float32, causal=True, return_lse=True)
        assert (o.shape, o.dtype, lse.shape, lse.dtype) == (qp.shape, torch.float32, (5, 8), torch.float32)
        assert o.is_contiguous() and lse.is_contiguous()
        assert o.untyped_storage().nbytes() == o.numel() * 4 and lse.untyped_storage().nbytes() == lse.numel() * 4
        assert o.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
        seen |= {o.data_ptr(), lse.data_ptr()}
    assert len(got) == 3 and len(seen) >= 2
    q_t = torch.randn(8, 5, 64, generator=gen).half().transpose(0, 1)  # q's shape, other strides
    o = fi.single_prefill_with_kv_cache(q_t, k, v, o_dtype=torch.float32, causal=True, return_lse=True)[0]
    want = reference.single_prefill_with_kv_cache(q_t.float(), k.float(), v.float(), causal=True)
    torch.testing.assert_close(o, want, atol=2e-3, rtol=2e-3)
    assert len(got) == 3
    with pytest.raises(ValueError, match="k"):  # another head dim: checked, named
        fi.single_prefill_with_kv_cache(qp, k[..., :32], v[..., :32], o_dtype=torch.float32, causal=True,
                                        return_lse=True)  # fmt: skip


def test_run_binding_outputs_fresh_contiguous():
    """A wrapper's bound run() allocates fresh, contiguous outputs of q's shape in the planned output dtype (lse
    float32 [rows, heads]) that own their memory (never the templates' kept bytes), and launches with the call's
    addresses; an out of the bound form is written in place, and another q form or a caller's out of other strides
    takes the general path (None)."""
    from flashinfer_triton import _wrapper

    gen = torch.Generator().manual_seed(8)
    q = torch.randn(6, 4, 64, generator=gen).half()
    cache = torch.randn(5, 2, 16, 2, 64, generator=gen).half()
    k4, v4 = cache.unbind(1)
    for with_lse in (False, True):
        got = []
        out0 = torch.empty(q.shape, dtype=torch.float32)
        lse0 = torch.empty(6, 4) if with_lse else None
        stand_in = torch.empty(1)  # (the kernel's lse pointer without lse)
        lead = (q, k4, v4, out0, lse0 if with_lse else stand_in)
        b = _wrapper.RunBinding.of(
            [(lambda *a, got=got: got.append(a) or True, lead)], q, cache, k4, v4, out0, lse0, False, (None, None, None)
        )
        assert b is not None and b.alloc_out
        kept = _wrapper._TEMPLATE_BASES[q.device]
        outs = []
        for _ in range(3):
            q2, c2 = torch.randn(q.shape, generator=gen).half(), torch.randn(cache.shape, generator=gen).half()
            res = b(q2, c2, None, with_lse, (None, None, None))
            o, lse = res if with_lse else (res, None)
            assert (o.shape, o.dtype, o.is_contiguous()) == (q.shape, torch.float32, True)
            assert o.untyped_storage().nbytes() == o.numel() * 4
            assert o.untyped_storage().data_ptr() != kept.untyped_storage().data_ptr()
            lp = stand_in.data_ptr()
            if with_lse:
                assert (lse.shape, lse.dtype, lse.is_contiguous()) == ((6, 4), torch.float32, True)
                assert lse.untyped_storage().nbytes() == lse.numel() * 4
                lp = lse.data_ptr()
            k_at, v_at = c2.data_ptr(), c2[:, 1].data_ptr()
            assert got[-1] == (q2.data_ptr(), k_at, v_at, o.data_ptr(), lp)
            outs.append(o)
        assert len({o.data_ptr() for o in outs}) == 3  # (each call's own output)
        mine = torch.full(q.shape, float("nan"))
        assert b(q, cache, mine, with_lse, (None, None, None)) is not None and got[-1][3] == mine.data_ptr()
        q_t = torch.randn(4, 6, 64, generator=gen).half().transpose(0, 1)  # q's shape, other strides
        assert b(q_t, cache, None, with_lse, (None, None, None)) is None
        strided = torch.empty(6, 4, 128)[..., :64]
        assert b(q, cache, strided, with_lse, (None, None, None)) is None
        assert len(got) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("keys,split", [(1024, False), (4096, True)], ids=["1024-whole", "4096-split"])
def test_single_prefill_split_rule_gpu(keys, split, request):
    """single_prefill of 128 queries (32/8, D128, causal) on the GPU: over 1024 keys one launch (the split would not
    pay for its merge launch), over 4096 keys split into pieces and merged; both match the float32 reference, the
    first call (planned, checked) and the later ones (the bound form) alike, lse included."""
    from flashinfer_triton import _wrapper, reference

    fi.clear_host_caches("single_plans", "single_forms")
    request.addfinalizer(lambda: fi.clear_host_caches("single_plans", "single_forms"))
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(keys)
    for _ in range(3):
        q = torch.randn(128, 32, 128, generator=gen).half().to(dev)
        k, v = (torch.randn(keys, 8, 128, generator=gen).half().to(dev) for _ in range(2))
        o, lse = fi.single_prefill_with_kv_cache(q, k, v, causal=True, return_lse=True)
        ro, rl = reference.single_prefill_with_kv_cache(q.float(), k.float(), v.float(), causal=True, return_lse=True)
        torch.testing.assert_close(o.float(), ro, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(lse, rl, atol=2e-3, rtol=2e-3)
    (w,) = _wrapper._SINGLE_PLANS.values()
    assert w.plan_info().split == split
    assert [f.bound for f in fi.host_caches()["single_forms"]] == [True]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("return_lse", [False, True], ids=["out", "out-lse"])
def test_bound_run_allocated_outputs_gpu(return_lse):
    """A prefill wrapper's bound run() without out allocates each call's own contiguous outputs (from the kept
    templates) and they hold the float32 reference's values, call after call with new q."""
    from flashinfer_triton import reference

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(31)
    hq, hkv, d, ps, qlen, keys = 32, 8, 128, 16, 128, 512
    indptr, indices, last, cache = _paged(1, keys, ps, hkv, d, dev, gen)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), "NHD")
    w.plan(torch.tensor([0, qlen], dtype=torch.int32), indptr, indices, last, hq, hkv, d, ps, causal=True)
    pages = indices[: int(indptr[1])].long()
    k = cache[pages, 0].reshape(-1, hkv, d)[:keys].float()
    v = cache[pages, 1].reshape(-1, hkv, d)[:keys].float()
    outs = []
    for _ in range(4):
        q = torch.randn(qlen, hq, d, generator=gen).half().to(dev)
        got = w.run(q, cache, return_lse=return_lse)
        o, lse = got if return_lse else (got, None)
        assert w.plan_info().bound
        assert (o.shape, o.dtype, o.is_contiguous()) == (q.shape, torch.float16, True)
        ro, rl = reference.single_prefill_with_kv_cache(q.float(), k, v, causal=True, return_lse=True)
        torch.testing.assert_close(o.float(), ro, atol=2e-3, rtol=2e-3)
        if return_lse:
            assert (lse.shape, lse.dtype, lse.is_contiguous()) == ((qlen, hq), torch.float32, True)
            torch.testing.assert_close(lse, rl, atol=2e-3, rtol=2e-3)
        outs.append(o)
    assert len({o.data_ptr() for o in outs}) == 4


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_merge_and_append_bound_forms_match_reference():
    """Repeated merge_state and append_paged_kv_cache calls of one form (after the first, through the bound launch)
    with new tensors each time: merge_state matches the float32 reference and append writes exactly the addressed
    slots, every time."""
    from flashinfer_triton import reference

    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(21)
    for _ in range(4):
        va, vb = (torch.randn(64, 32, 128, generator=gen).half().to(dev) for _ in range(2))
        sa, sb = (torch.randn(64, 32, generator=gen).to(dev) for _ in range(2))
        ov, os_ = fi.merge_state(va, sa, vb, sb)
        rv, rs = reference.merge_state(va, sa, vb, sb)
        torch.testing.assert_close(ov.float(), rv, atol=2e-3, rtol=2e-3)
        torch.testing.assert_close(os_, rs, atol=1e-5, rtol=1e-5)
    assert any(f.bound and f.shapes[0] == (64, 32, 128) for f in fi.host_caches()["merge_state"])
    i32 = lambda x: torch.tensor(x, dtype=torch.int32, device=dev)  # noqa: E731
    ps, hkv, d = 16, 8, 128
    lens = [40, 17, 64]  # keys after the append
    pages = [(n + ps - 1) // ps for n in lens]
    indptr = i32([0, *torch.tensor(pages).cumsum(0).tolist()])
    num_pages = sum(pages) + 2
    indices = torch.randperm(num_pages, generator=gen)[: sum(pages)].to(torch.int32).to(dev)
    last = i32([(n - 1) % ps + 1 for n in lens])
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).half().to(dev)
    for step in range(3):
        bi = i32([0, 1, 2])
        pos = i32([lens[0] - 1 - step, lens[1] - 1 - step, lens[2] - 1 - step])
        key, value = (torch.randn(3, hkv, d, generator=gen).half().to(dev) for _ in range(2))
        want = cache.clone()
        for t in range(3):
            page_ = int(indices[int(indptr[t]) + int(pos[t]) // ps])
            want[page_, 0, int(pos[t]) % ps] = key[t]
            want[page_, 1, int(pos[t]) % ps] = value[t]
        fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
        torch.testing.assert_close(cache, want, atol=0, rtol=0)
    assert any(f.bound for f in fi.host_caches()["append_forms"])


def test_range_checked_binding_reads_the_range_first():
    """A binding taken over while the page range is still on the device launches only once the range, read at
    its first call, fits the bound cache; then the plan holds the binding itself. Out of range: None (the
    checking path raises its error)."""
    from flashinfer_triton import _wrapper

    calls = []

    class Bound:
        kv_rows = 20

        def __call__(self, *a):
            calls.append(a)
            return "launched"

    class FakePlan:
        pass

    for hi, lo, ok in ((19, 0, True), (20, 0, False), (5, -1, False)):
        p = FakePlan()
        p.max_page_index = _wrapper.PendingPageRange([hi])
        p.max_page_index._value = (lo, hi)  # (as read from the pinned copy)
        b = Bound()
        p.fast_run = rc = _wrapper.RangeCheckedBinding(b, p)
        got = rc("q", "kv", None, False, (None, None, None))
        assert (got == "launched") == ok
        assert (p.fast_run is b) == ok and (p.fast_run is rc) != ok


@pytest.mark.interpret
def test_device_page_range_matches_aminmax(monkeypatch):
    """The one-launch range of device page indices (``_wrapper.DeviceRange``, ``kernels/page_range.py``): the range
    torch's min / max gives, over sizes of one and several programs, with a negative index, zero and the int32
    extremes; the accumulator is reset for the next launch; a range overwritten by its wrapper's next plan() is
    refused rather than read; ``check_page_range`` raises the same named errors. On the CPU the kernel runs in the
    interpreter on host tensors; on the GPU it writes pinned memory and the second launch is the bound one."""
    from flashinfer_triton import _wrapper

    if DEVICE.type != "cuda":
        monkeypatch.setattr(_wrapper, "_INTERPRET_RANGES", True)
        monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    scratch = _wrapper.RangeScratch()
    gen = torch.Generator().manual_seed(5)
    sizes = (1, 7, 1024, 8192, 8193, 20000) + ((300000,) if DEVICE.type == "cuda" else ())
    for n in sizes:
        for special in (None, 0, -3, 2**31 - 1, -(2**31)):
            x = torch.randint(1, 1 << 20, (n,), generator=gen, dtype=torch.int32)
            if special is not None:
                x[int(torch.randint(0, n, (1,), generator=gen))] = special
            r = _wrapper.PendingPageRange.of_device(x.to(DEVICE), "paged_kv_indices", scratch)
            assert type(r.parts()[0][0]) is _wrapper.DeviceRange
            lo, hi = (int(v) for v in torch.aminmax(x))
            assert r.value() == (min(0, lo), max(-1, hi)), (n, special)
    dr = scratch.device_range(DEVICE)
    assert dr is r.parts()[0][0]  # (``cuda`` names the current device: the state the launches went through)
    assert dr.acc.tolist() == [2**31 - 1, -(2**31), 0, 0]
    if DEVICE.type == "cuda":
        assert dr.bound, "the range launch binds at its first launch"
    a = _wrapper.PendingPageRange.of_device(torch.tensor([4, -3, 9], dtype=torch.int32, device=DEVICE), "idx", scratch)
    b = _wrapper.PendingPageRange.of_device(torch.tensor([2, 11], dtype=torch.int32, device=DEVICE), "idx", scratch)
    assert b.value() == (0, 11)
    with pytest.raises(RuntimeError, match="overwritten by a later plan"):
        a.value()
    with pytest.raises(ValueError, match="page indices < the cache's 11 pages.*page index of 11"):
        _wrapper.check_page_range(b, 11)
    _wrapper.check_page_range(b, 12)
    c = _wrapper.PendingPageRange.of_device(torch.tensor([4, -3, 9], dtype=torch.int32, device=DEVICE), "idx", scratch)
    with pytest.raises(ValueError, match="non-negative page indices.*page index of -3"):
        _wrapper.check_page_range(c, 100)


@pytest.mark.skipif(INTERPRET, reason="the interpreter's kernels have no parameters to bind")
def test_device_page_range_binds_once_per_device(monkeypatch):
    """The GPU path of the one-launch page range (``_wrapper.DeviceRange``) on the CPU, with a stand-in driver and
    compiled kernel (what Triton 3.6's ``JITFunction.run`` returns): the first launch goes through Triton's path and
    binds, later launches take the bound launch with the indices' address, their count and the sequence number,
    and the device spelled ``cuda`` or ``cuda:<current>`` finds the same state, bound launch included."""
    import dataclasses

    from triton.runtime import driver

    from flashinfer_triton import _config, _launch, _wrapper
    from flashinfer_triton.kernels.page_range import _page_range_kernel

    class Compiled:  # Triton's compiled kernel: its launcher records the launches
        function, packed_metadata = "fn", "meta"

        def __init__(self):
            self.launches = []

        def run(self, *a):
            self.launches.append(a)

    compiled = Compiled()

    class Jit:  # the kernel's parameters; Triton's run (compile and launch) counted
        params, arg_names = _page_range_kernel.params, _page_range_kernel.arg_names
        runs = 0

        def run(self, *args, grid, warmup, **options):
            Jit.runs += 1
            return compiled

    class Driver:
        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 1234

    class OnHost(_wrapper.DeviceRange):  # a DeviceRange of a CUDA device whose buffers are host tensors
        __slots__ = ()

        def __init__(self, device):
            self.device, self.seq, self.bound = device, 0, None
            self.acc = torch.tensor([2**31 - 1, -(2**31), 0, 0], dtype=torch.int32)
            self.out = torch.zeros(2, dtype=torch.int64)
            self.words = self.out.numpy()

        usable = staticmethod(lambda device: True)

    monkeypatch.setattr(driver, "_active", Driver())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(_config, "HOST_PATH", dataclasses.replace(_config.HOST_PATH, fast_launch=True))
    monkeypatch.setattr(_wrapper, "DeviceRange", OnHost)
    monkeypatch.setattr(_wrapper, "_RANGE_KERNEL", _launch.FastKernel(Jit()))
    cuda0 = torch.device("cuda", 0)
    scratch = _wrapper.RangeScratch()
    r = scratch.device_range(cuda0)
    x = torch.arange(20000, dtype=torch.int32)
    assert r.launch(x[:5]) == (r, 1)
    assert Jit.runs == 1 and compiled.launches == []  # (the first launch: Triton's path, which launched)
    assert isinstance(r.bound, _launch.BoundLaunch)
    for seq, n in ((2, 9000), (3, 20000)):
        assert r.launch(x[:n]) == (r, seq)
        g0 = -(-n // (OnHost.BLOCK * OnHost.ITERS))
        assert compiled.launches[-1][:4] == (g0, 1, 1, 1234)
        assert compiled.launches[-1][-7:] == (x.data_ptr(), n, seq, r.acc.data_ptr(), r.out.data_ptr(), 1024, 8)
    assert Jit.runs == 1 and len(compiled.launches) == 2
    assert scratch.device_range(torch.device("cuda")) is r and scratch.device_range(cuda0) is r
    fresh = _wrapper.RangeScratch()
    r2 = fresh.device_range(torch.device("cuda"))
    assert r2.device == cuda0 and fresh.device_range(cuda0) is r2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_prefill_replan_device_indices_keeps_binding():
    """mini-sglang's prefill form (host indptr, device page indices, page size 1): a re-plan of the same batch
    takes over the binding, its first run() launches bound with the output of a fresh plan's checking path, and
    a re-plan whose pages pass the bound cache still raises the named error at run()."""
    dev = torch.device("cuda")
    hq, hkv, d, slots, bs = 9, 3, 64, 4096, 4
    gen = torch.Generator().manual_seed(3)
    kc = torch.randn(slots, 1, hkv, d, generator=gen).to(dev, torch.bfloat16)
    vc = torch.randn(slots, 1, hkv, d, generator=gen).to(dev, torch.bfloat16)
    cu = torch.arange(bs + 1, dtype=torch.int32) * 64
    idx = torch.randperm(slots, generator=gen)[: bs * 64].to(dev, torch.int32)
    kw = dict(
        qo_indptr=cu, paged_kv_indptr=cu, paged_kv_indices=idx,
        paged_kv_last_page_len=torch.ones(bs, dtype=torch.int32),
        num_qo_heads=hq, num_kv_heads=hkv, head_dim_qk=d, page_size=1, causal=True,
        seq_lens=torch.full((bs,), 64, dtype=torch.int32), q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16,
    )  # fmt: skip
    q = torch.randn(bs * 64, hq, d, generator=gen).to(dev, torch.bfloat16)
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(**kw)
    w.run(q, (kc, vc))
    w.plan(**kw)
    assert w.plan_info().bound
    got = w.run(q, (kc, vc))
    assert w.plan_info().bound
    ref_w = fi.BatchPrefillWithPagedKVCacheWrapper(torch.empty_like(ws), "NHD")
    ref_w.plan(**kw)
    ref = ref_w.run(q, (kc, vc))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    small = (kc[: slots // 2], vc[: slots // 2])  # the same form but fewer pages than the indices address
    w.plan(**kw)
    with pytest.raises(ValueError, match="paged_kv_indices"):
        w.run(q, small)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("bs", [1, 8, 32])
def test_graph_decode_plan_device_indices_refills_buffers(monkeypatch, bs):
    """mini-sglang's CUDA-graph decode form (host indptr / last_page_len / seq_lens, device page indices, page
    size 1): every plan refills the caller's three buffers (one foreach copy) and reads the table like the
    general path (the small-table path covers device indices)."""
    from flashinfer_triton import _wrapper

    dev = torch.device("cuda")
    ws = torch.empty(64 << 20, dtype=torch.uint8, device=dev)
    bufs = (
        torch.zeros(bs + 1, dtype=torch.int32, device=dev),
        torch.full((bs * 1024,), -7, dtype=torch.int32, device=dev),
        torch.zeros(bs, dtype=torch.int32, device=dev),
    )
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(ws, *bufs, "NHD")
    for step in range(3):
        lens = [300 + step + 7 * i for i in range(bs)]
        indptr = torch.tensor([0] + lens, dtype=torch.int32).cumsum(0).to(torch.int32)
        idx = torch.randperm(65536, device=dev, dtype=torch.int32)[: sum(lens)]
        last = torch.ones(bs, dtype=torch.int32)
        w.plan(indptr, idx, last, 9, 3, 64, 1, seq_lens=torch.tensor(lens, dtype=torch.int32),
               q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)  # fmt: skip
        torch.cuda.synchronize()
        assert torch.equal(bufs[0].cpu(), indptr) and torch.equal(bufs[2].cpu(), last)
        assert torch.equal(bufs[1][: sum(lens)], idx)
        small = _wrapper.read_table(indptr, idx, last, 1)
        with monkeypatch.context() as m:
            m.setattr(_wrapper, "_SMALL_TABLE", 0)  # the general path
            general = _wrapper.read_table(indptr, idx, last, 1)
        for name in ("n", "nnz"):
            assert getattr(small, name) == getattr(general, name)
        for name in ("indptr", "last", "kv_lens"):
            assert (getattr(small, name) == getattr(general, name)).all()
        assert small.max_index.value() == (min(0, int(idx.min())), int(idx.max()))  # (lo: the negative one, else 0)


@pytest.mark.interpret
@pytest.mark.parametrize("form", ["strided-indices", "strided-buffers"])
def test_graph_decode_device_work_list_strided(monkeypatch, form):
    """A CUDA-graph decode plan with page indices that are a strided 1-D view (``check_index_tensor`` takes any
    1-D int32 tensor), or caller ``indptr`` / ``last_page_len`` buffers that are strided views, leaves the same
    caller buffers and stage as the host path (whose ``torch`` copies follow strides): the device launch, which
    addresses its tensors contiguously, must not take them as they are."""
    from flashinfer_triton import _backend, _decode_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)
    bs, ps = 5, 16
    lens = [37, 1, 200, 16, 90]
    pages = [-(-n // ps) for n in lens]
    last = [n - (p - 1) * ps for n, p in zip(lens, pages)]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    nnz = int(indptr[-1])
    perm = torch.randperm(4 * nnz, dtype=torch.int32)[:nnz].to(DEVICE)
    if form == "strided-indices":
        idx = torch.stack([perm, -torch.ones_like(perm)], 1).reshape(-1)[::2]  # [nnz], stride 2
        assert idx.stride(0) == 2 and torch.equal(idx, perm)
    else:
        idx = perm

    def buffers():
        if form == "strided-buffers":
            ip = torch.full((2 * (bs + 1),), -7, dtype=torch.int32, device=DEVICE)[::2]
            lp = torch.full((2 * bs,), -7, dtype=torch.int32, device=DEVICE)[::2]
        else:
            ip = torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE)
            lp = torch.ones(bs, dtype=torch.int32, device=DEVICE)
        return ip, torch.zeros(4 * nnz, dtype=torch.int32, device=DEVICE), lp

    kw = dict(last_page_len=torch.tensor(last, dtype=torch.int32), num_qo_heads=8, num_kv_heads=2, head_dim=64,
              page_size=ps, q_data_type=torch.float16, kv_data_type=torch.float16)  # fmt: skip
    got = []
    for on_device in (True, False):
        w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE),
                                                           *buffers())  # fmt: skip
        with monkeypatch.context() as m:
            m.setattr(_decode_impl, "builds_work_on_device", lambda device, v=on_device: v)
            w.plan(indptr, idx, **kw)
        core = w._w
        ip_b, lp_b, ix_b = core._paged_kv_indptr_buf, core._paged_kv_last_page_len_buf, core._paged_kv_indices_buf
        got.append((core._layout[4][2][0].tolist(), ip_b.tolist(), lp_b.tolist(), ix_b[:nnz].tolist()))
    assert got[1][1] == indptr.tolist() and got[1][2] == last and got[1][3] == perm.tolist()  # (the host path)
    assert got[0] == got[1]


@pytest.mark.interpret
@pytest.mark.parametrize("why", ["launch-hook", "fast-launch-off", "misaligned-first"])
def test_graph_decode_device_work_list_bound_launch_rules(monkeypatch, why):
    """The work-list launch of a CUDA-graph decode plan keeps the bound-launch rules of the library's other bound
    launches (``_row_forms.BoundForms``): a launch hook set (a profiler) or the short path switched off
    (``HostPathConfig.fast_launch``) takes Triton's launcher even where a bound launch exists, and a first call
    whose page indices are off a 16-byte boundary binds nothing, so that a later aligned call can bind."""
    from flashinfer_triton import _config, _decode_impl, _launch

    bs, ps = 3, 16
    lens = [37, 1, 200]
    pages = [-(-n // ps) for n in lens]
    last = [n - (p - 1) * ps for n, p in zip(lens, pages)]
    indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
    nnz = int(indptr[-1])
    bufs = (torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE), torch.zeros(64, dtype=torch.int32, device=DEVICE),
            torch.ones(bs, dtype=torch.int32, device=DEVICE))  # fmt: skip
    w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=DEVICE), *bufs)
    kw = dict(last_page_len=torch.tensor(last, dtype=torch.int32), num_qo_heads=8, num_kv_heads=2, head_dim=64,
              page_size=ps, q_data_type=torch.float16, kv_data_type=torch.float16)  # fmt: skip
    idx = torch.randperm(64, dtype=torch.int32)[:nnz].to(DEVICE)
    if why == "misaligned-first":
        import dataclasses

        calls = []
        monkeypatch.setattr(_decode_impl, "_bind", lambda *a: calls.append(a[2][0].data_ptr() % 16) or None)
        monkeypatch.setattr(_decode_impl, "hooks_set", lambda: False, raising=False)
        monkeypatch.setattr(_config, "HOST_PATH", dataclasses.replace(_config.HOST_PATH, fast_launch=True))
        w.plan(indptr, torch.cat([idx[:1], idx])[1:], **kw)  # (off 16 bytes)
        w.plan(indptr, idx, **kw)
        assert calls == [0], calls  # (not bound off 16 bytes: bound at the aligned call)
        assert bufs[1][:nnz].tolist() == idx.tolist()
        return

    class Bound:  # a bound launch that records being used instead of launching
        used = 0

        def over(self, *a):
            Bound.used += 1
            return True

    import dataclasses

    w.plan(indptr, idx, **kw)
    device_list = w._w._layout[4][2][6]
    assert device_list is not None
    device_list.bound = Bound()
    monkeypatch.setattr(_launch, "hooks_set", lambda: why == "launch-hook")
    monkeypatch.setattr(_decode_impl, "hooks_set", lambda: why == "launch-hook", raising=False)
    for fast in (True, False):  # (the short path on, as on a GPU, then off)
        used = Bound.used
        bufs[1].zero_()
        # (set on the object the launch reads: ``_config.using`` would clear the host caches and the layout)
        monkeypatch.setattr(_config, "HOST_PATH", dataclasses.replace(_config.HOST_PATH, fast_launch=fast))
        w.plan(indptr, idx, **kw)
        # the bound launch only with the short path on and no hook set (the stand-in then launches nothing)
        bound = fast and why != "launch-hook"
        assert Bound.used == used + bound, (why, fast)
        if not bound:
            assert bufs[1][:nnz].tolist() == idx.tolist()  # (launched through Triton's launcher)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")
def test_graph_decode_device_work_list_other_current_device(monkeypatch):
    """A CUDA-graph decode wrapper on ``cuda:1`` planned while ``cuda:0`` is the current device (a plan() made only
    torch calls before the work list moved to the device: they follow the tensors' device) writes what the host path
    writes, at the first plan (compile and bind) and at later ones (the bound launch declines another device)."""
    from flashinfer_triton import _decode_impl

    dev = torch.device("cuda", 1)
    bs, ps = 4, 16
    got = []
    for on_device in (True, False):
        bufs = (torch.zeros(bs + 1, dtype=torch.int32, device=dev), torch.zeros(256, dtype=torch.int32, device=dev),
                torch.ones(bs, dtype=torch.int32, device=dev))  # fmt: skip
        w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(64 << 20, dtype=torch.uint8, device=dev), *bufs)
        states = []
        for lens in ([37, 1, 2000, 0], [5, 900, 16, 3000], [1, 1, 1, 1]):
            pages = [-(-n // ps) for n in lens]
            last = [n - (p - 1) * ps if p else 0 for n, p in zip(lens, pages)]
            indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
            idx = torch.randperm(256, dtype=torch.int32, generator=torch.Generator().manual_seed(len(states)))
            idx = idx[: int(indptr[-1])].to(dev)
            with torch.cuda.device(0), monkeypatch.context() as m:
                m.setattr(_decode_impl, "builds_work_on_device", lambda device, v=on_device: v)
                w.plan(indptr, idx, torch.tensor(last, dtype=torch.int32), 8, 2, 64, ps, q_data_type=torch.float16)
            torch.cuda.synchronize(dev)
            states.append((w._w._layout[4][2][0].tolist(), [b.tolist() for b in bufs]))
        got.append(states)
    assert got[0] == got[1]


@pytest.mark.interpret
@pytest.mark.parametrize("bs", [600, 1100])
def test_graph_decode_device_work_list_large_batch(monkeypatch, bs):
    """The device-built work list at engine graph sizes past a few hundred requests (``BLOCK_B`` 1024 and 2048:
    the launch takes 8 and 16 warps there) equals the host path's, split (fixed split sizes, the automatic rule)
    and unsplit, with empty requests and a sliding window."""
    import random

    from flashinfer_triton import _backend, _decode_impl

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    monkeypatch.setattr(_decode_impl, "_num_sms", lambda device: 132)
    rng = random.Random(bs)
    ps, max_pages = 16, 40
    got = []
    for on_device in (True, False):
        bufs = (torch.zeros(bs + 1, dtype=torch.int32, device=DEVICE),
                torch.zeros(bs * max_pages, dtype=torch.int32, device=DEVICE),
                torch.ones(bs, dtype=torch.int32, device=DEVICE))  # fmt: skip
        w = fi.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(torch.empty(256 << 20, dtype=torch.uint8, device=DEVICE),
                                                           *bufs)  # fmt: skip
        rng.seed(bs)
        states = []
        for opts in ({"fixed_split_size": 4}, {}, {"window_left": 100}):
            lens = [rng.choice([0, 1, 17, rng.randint(1, ps * max_pages)]) for _ in range(bs)]
            lens[0] = ps * max_pages  # (a long request: the automatic rule splits one of them)
            pages = [-(-n // ps) for n in lens]
            last = [n - (p - 1) * ps if p else 0 for n, p in zip(lens, pages)]
            indptr = torch.tensor([0] + pages, dtype=torch.int32).cumsum(0).to(torch.int32)
            gen = torch.Generator().manual_seed(len(states))  # (the same indices for both paths)
            idx = torch.randperm(bs * max_pages, dtype=torch.int32, generator=gen)[: int(indptr[-1])].to(DEVICE)
            with monkeypatch.context() as m:
                m.setattr(_decode_impl, "builds_work_on_device", lambda device, v=on_device: v)
                w.plan(indptr, idx, torch.tensor(last, dtype=torch.int32), 32, 8, 128, ps,
                       q_data_type=torch.float16, **opts)  # fmt: skip
            p = w._w._planned.plan
            assert (w._w._layout[4][2][6] is not None) == on_device and (p.num_work is None) == on_device
            states.append((p.chunk, p.work.tolist(), [b.tolist() for b in bufs]))
        got.append(states)
    assert got[0][0][0] is not None, [s[0] for s in got[0]]  # (the fixed split size splits)
    assert got[0] == got[1]
