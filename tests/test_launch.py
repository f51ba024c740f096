"""The short launch path (``_launch.FastKernel``): its key must separate arguments at least as finely as
Triton's own specialization, and a hit must launch the compiled kernel Triton chose for that key.

These run on the CPU without a GPU: Triton's binder is built for sm_90 with a stand-in driver (what
``JITFunction.run`` asks of the driver before compiling), and the launch itself is a stub."""

from __future__ import annotations

import dataclasses
import itertools
import os

import pytest
import torch

from flashinfer_triton import _config, _env, _launch, clear_host_caches, host_caches
from helpers import page_table

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"), reason="the interpreter has no binder or compiled kernels"
)


def _host_path(fast_launch: bool) -> _config.using:
    """The host-path configuration with the short launch path switched on or off (whatever the environment says)."""
    return _config.using(host_path=dataclasses.replace(_config.HOST_PATH, fast_launch=fast_launch))


@pytest.fixture
def fast_launch():
    """The short launch path on for the test. Entering and leaving a configuration clears the host caches: no
    launch bound to a stand-in kernel or driver outlives the test."""
    with _host_path(True):
        yield


@pytest.fixture
def triton_on_cpu(monkeypatch):
    """CPU tensors take the Triton path for the test (plans and argument lists; the launches are stand-ins).
    White-box: the implementations resolved per (operation, device) and the single-request workspaces start empty,
    since on the CPU they were resolved for the PyTorch path; the earlier ones come back after the test."""
    from flashinfer_triton import _backend, _wrapper

    monkeypatch.setattr(_backend, "use_triton", lambda device: True)
    monkeypatch.setattr(_backend, "_KERNELS", {})
    monkeypatch.setattr(_wrapper, "_WORKSPACES", {})


class _StandInDriver:
    def __init__(self):
        from triton.backends.compiler import GPUTarget

        self.target = GPUTarget("cuda", 90, 32)
        self.device = 0

    def get_current_target(self):
        return self.target

    def get_current_device(self):
        return self.device

    def get_current_stream(self, device=None):
        return 1234


@pytest.fixture
def stand_in():
    from triton.runtime import driver

    d = _StandInDriver()
    prev = driver._active  # reset_active() would create the real driver (none on a machine without a GPU)
    driver.set_active(d)
    try:
        yield d
    finally:
        driver._active = prev


def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe(x_ptr, y_ptr, n, stride, scale, flag, opt, BLOCK: tl.constexpr, MODE: tl.constexpr):
        i = tl.arange(0, BLOCK)
        tl.store(y_ptr + i * stride, tl.load(x_ptr + i, mask=i < n) * scale + MODE)

    return probe


def _triton_key(fn, args):
    """Triton's own cache key for a launch of ``fn`` with these arguments (its binder, its key function)."""
    from triton.runtime.jit import compute_cache_key

    _, kernel_key_cache, _, _, binder = fn.device_caches[0]
    _, specialization, options = binder(*args)
    return compute_cache_key(kernel_key_cache, specialization, options)


def _variants():
    buf = torch.empty(64, dtype=torch.float16)
    bufs = [buf, buf[1:], buf[8:], buf[16:], buf.float(), buf.float()[2:]]
    ints = [0, 1, 2, 15, 16, 17, 32, -16, -5, (1 << 31) - 16, 1 << 31, (1 << 31) + 1, 1 << 40, (1 << 63) + 16]
    for x, y, n, stride in itertools.product(bufs[:3] + bufs[4:5], bufs[:2] + bufs[3:4], ints, [1, 16, 48, 7]):
        yield [x, y, n, stride, 0.5, True, None, 16, 0]
    yield from (
        [bufs[0], bufs[2], 16, 16, 2.0, False, None, 16, 0],
        [bufs[5], bufs[0], 16, 16, 0.5, True, None, 32, 1],
    )


def test_key_at_least_as_fine_as_triton(stand_in):
    """Two argument lists with the same FastKernel key have the same Triton cache key (the converse need not
    hold). Pointers at every 16-byte alignment class, ints around 1 / multiples of 16 / the i32, i64, u64
    ranges, floats, bools, None and constexprs."""
    fn = _kernel()
    const_pos = frozenset(i for i, p in enumerate(fn.params) if p.is_constexpr)
    seen: dict = {}
    n = 0
    for args in _variants():
        ours = _launch.spec_key(args, const_pos)
        assert ours is not None
        theirs = _triton_key(fn, args)
        prev = seen.setdefault(ours, theirs)
        assert prev == theirs, f"one FastKernel key, two Triton keys: {args[:4]}"
        n += 1
    assert n > 300 and len(seen) > 40  # the variants do cover many classes


def test_key_classes():
    """The classification itself, on the cases where Triton's differ."""
    k = _launch._int_class
    assert k(1) == 1 and k(0) != k(1) and k(16) == k(32) and k(16) != k(17)
    assert k(1 << 31) == k(1 << 32)  # both i64 multiples of 16
    assert k((1 << 31) - 16) != k(1 << 31)  # i32 vs i64
    assert k((1 << 63) + 16) != k(1 << 40)  # u64 vs i64
    x = torch.empty(8, dtype=torch.float16)
    assert _launch.spec_key([x], frozenset()) != _launch.spec_key([x[1:]], frozenset())
    assert _launch.spec_key([x], frozenset()) != _launch.spec_key([x.float()], frozenset())
    assert _launch.spec_key([object()], frozenset()) is None  # unknown types take Triton's path
    assert _launch.spec_key([3, 4], frozenset({0})) != _launch.spec_key([5, 4], frozenset({0}))  # constexpr values


class _Compiled:
    def __init__(self, log):
        self.function = "fn"
        self.packed_metadata = "meta"
        self.log = log

    def run(self, *a):
        self.log.append(("direct", a))


class _FakeJit:
    """What FastKernel needs of a JITFunction: params, arg_names and run (here: a recorded slow path)."""

    def __init__(self, fn):
        self.params = fn.params
        self.arg_names = fn.arg_names
        self.log: list = []
        self.compiled = _Compiled(self.log)

    def run(self, *args, grid, warmup, **options):
        self.log.append(("triton", args, grid, options))
        return self.compiled


def test_hits_launch_the_compiled_kernel(stand_in, fast_launch):
    """First call of a key: Triton's path; the same key again: the compiled kernel with the current stream,
    the grid padded to 3-D and every argument in order; a new alignment, int class, constexpr, option or
    device: Triton's path again."""
    fake = _FakeJit(_kernel())
    fk = _launch.FastKernel(fake)
    x = torch.empty(64, dtype=torch.float16)
    y = torch.empty(64, dtype=torch.float16)
    base = [x, y, 16, 16, 0.5, True, None, 16, 0]

    def call(args, grid=(4,), **opts):
        fake.log.clear()
        fk.run(*args, grid=grid, warmup=False, num_warps=4, **opts)
        return fake.log[0][0]

    # the key FastKernel builds (constexpr values by getter, runtime classes) is spec_key's, the one tested above
    assert (fk._get_const(base), _launch._runtime_key(fk._get_rt(base))) == _launch.spec_key(base, fk._const_pos)
    assert call(base) == "triton"
    assert call(base) == "direct"
    assert fake.log[0][1][:4] == (4, 1, 1, 1234) and fake.log[0][1][9:] == tuple(base)
    assert call([x, y, 32, 48, 0.25, False, None, 16, 0], grid=(2, 3)) == "direct"  # same classes
    assert fake.log[0][1][:3] == (2, 3, 1)
    for changed in (
        [x[1:], y, 16, 16, 0.5, True, None, 16, 0],  # misaligned pointer
        [x, y, 1, 16, 0.5, True, None, 16, 0],  # an int equal to 1
        [x, y, 17, 16, 0.5, True, None, 16, 0],  # not a multiple of 16
        [x, y, 1 << 32, 16, 0.5, True, None, 16, 0],  # past int32
        [x, y.float(), 16, 16, 0.5, True, None, 16, 0],  # dtype
        [x, y, 16, 16, 0.5, True, None, 32, 0],  # constexpr
    ):
        assert call(changed) == "triton", changed
    assert call(base, num_stages=2) == "triton"  # options
    stand_in.device = 1
    assert call(base) == "triton"  # another device
    stand_in.device = 0
    with _host_path(False):
        assert call(base) == "triton"  # switched off


def test_hooks_and_short_argument_lists_take_triton_path(stand_in, fast_launch, monkeypatch):
    from triton import knobs

    fake = _FakeJit(_kernel())
    fk = _launch.FastKernel(fake)
    x = torch.empty(64, dtype=torch.float16)
    args = [x, x, 16, 16, 0.5, True, None, 16, 0]
    fk.run(*args, grid=(1,), warmup=False)
    fk.run(*args[:-1], grid=(1,), warmup=False)  # a defaulted trailing constexpr left out
    fk.run(*args, grid=lambda meta: (1,), warmup=False)  # a grid function: Triton evaluates it
    fk.run(*args, grid=(1,), warmup=False)
    assert [e[0] for e in fake.log] == ["triton", "triton", "triton", "direct"]
    hook = knobs.runtime.launch_enter_hook
    if hasattr(hook, "add"):  # Triton 3.6: a hook chain, empty unless a profiler adds to it
        hook.add(_noop_hook)
        try:
            fk.run(*args, grid=(1,), warmup=False)
        finally:
            hook.remove(_noop_hook)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", _noop_hook)  # a plain callable
    fk.run(*args, grid=(1,), warmup=False)
    assert [e[0] for e in fake.log][4:] == ["triton"] * (2 if hasattr(hook, "add") else 1)


def _noop_hook(*a):
    return None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_fast_path_on_gpu_matches_triton_path(monkeypatch):
    """On the GPU: the second call of a key launches directly (no new cache entry, no JITFunction.run), with
    the same result as Triton's path; a misaligned view (another specialization) gets its own entry and a
    correct result."""
    from flashinfer_triton import _merge_impl, reference
    from flashinfer_triton.cascade import merge_state

    fk = _merge_impl._merge_pair_kernel
    # Start from an empty short-path cache: an earlier test in this process may have launched this specialization.
    monkeypatch.setattr(fk, "_cache", {})
    g = torch.Generator(device="cuda").manual_seed(0)
    base = torch.randn(2, 1000 * 8 * 128 + 8, device="cuda", generator=g).half()
    s = torch.randn(2, 1000, 8, device="cuda", generator=g)

    def views(off):
        va = base[0, off : off + 1000 * 8 * 128].view(1000, 8, 128)
        vb = base[1, off : off + 1000 * 8 * 128].view(1000, 8, 128)
        return va, s[0], vb, s[1]

    calls = []
    real = fk.fn.run

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    fk.fn.run = counting
    try:
        for off in (0, 0, 0, 3, 3):
            va, sa, vb, sb = views(off)
            got_v, got_s = merge_state(va, sa, vb, sb)
            want_v, want_s = reference.merge_state(va.float(), sa, vb.float(), sb)
            torch.testing.assert_close(got_v.float(), want_v, atol=2e-3, rtol=2e-3)
            torch.testing.assert_close(got_s, want_s, atol=1e-4, rtol=1e-4)
    finally:
        fk.fn.run = real
    assert len(calls) == 2, f"Triton's path taken {len(calls)} times (want: once per specialization)"


def test_key_at_least_as_fine_as_triton_on_the_prefill_kernel(stand_in):
    """The same property on the real prefill kernel (66 parameters): argument lists as ``_prefill_impl.run``
    builds them for a CPU plan (recorded, not launched), with the query at every 2-byte offset (alignment
    classes), other head counts and strides, with and without lse, paged and ragged."""
    import sys

    from flashinfer_triton import _prefill_impl as impl
    from flashinfer_triton.kernels.prefill import _prefill_kernel

    sys.path.insert(0, os.path.dirname(__file__))
    from test_prefill_kernels import make_case  # noqa: E402

    seen_args = []

    class _Rec:
        def run(self, *args, **kw):
            seen_args.append(args)

    from flashinfer_triton._backend import Workspace

    old = list(impl._KERNELS)
    impl._KERNELS[:] = [_Rec(), _Rec()]  # white-box: the kernel pair run() launches, replaced by recorders
    try:
        for paged, hq, lse in ((True, 4, True), (False, 4, False), (True, 8, False)):
            case = make_case([(5, 40), (3, 20)], hq=hq, hkv=2, paged=paged, causal=True)
            opts = case["opts"]
            ws = Workspace(
                float_buffer=torch.empty(1 << 20, dtype=torch.uint8), int_buffer=torch.empty(1 << 16, dtype=torch.uint8)
            )
            p = impl.plan(opts, case["batch"], ws)
            for off in range(0, 9):
                base = torch.empty(case["q"].numel() + 16, dtype=case["q"].dtype)
                q = base[off : off + case["q"].numel()].view(case["q"].shape)
                out = torch.empty_like(q)
                lse_t = torch.empty(q.shape[:2]) if lse else None
                impl.run(p, opts, case["batch"], q, case["k4"], case["v4"], out, lse_t)
    finally:
        impl._KERNELS[:] = old
    assert len(seen_args) == 27
    const_pos = frozenset(i for i, p in enumerate(_prefill_kernel.params) if p.is_constexpr)
    seen: dict = {}
    for args in seen_args:
        ours = _launch.spec_key(args, const_pos)
        assert ours is not None
        theirs = _triton_key(_prefill_kernel, args)
        assert seen.setdefault(ours, theirs) == theirs
    assert len(seen) >= 6  # alignment classes x variants


def test_short_path_only_on_tested_triton_releases():
    """The short path reads Triton's launch internals: it is on only for the releases it is tested with (the
    installed one here, which CI pins), and any other release launches through Triton's own path."""
    import triton

    assert _launch.version_tested(triton.__version__), "the installed Triton is not in TESTED_TRITON"
    assert _launch.TRITON_TESTED
    assert _config.HOST_PATH.fast_launch == (_env.FAST_LAUNCH and not _env.INTERPRET)
    assert _launch.version_tested("3.6.0") and _launch.version_tested("3.6.1+git1234")
    assert not _launch.version_tested("3.5.1") and not _launch.version_tested("3.7.0")
    assert not _launch.version_tested("nightly")


def test_declared_triton_range_is_the_tested_releases():
    """pyproject.toml allows exactly the Triton releases the short path is tested with: no release it would
    install launches through an untested path."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml").read_text()
    deps = re.search(r"^dependencies = \[(.*)\]", text, re.M)[1]
    (spec,) = re.findall(r'"(triton\b[^"]*)"', deps)
    m = re.fullmatch(r"triton>=(\d+)\.(\d+),<(\d+)\.(\d+)", spec.replace(" ", ""))
    assert m, f"triton requirement {spec!r}: expected a '>=X.Y,<X.Z' range"
    lo, hi = (int(m[1]), int(m[2])), (int(m[3]), int(m[4]))
    allowed = {(lo[0], minor) for minor in range(lo[1], hi[1])} if lo[0] == hi[0] else None
    assert allowed == set(_launch.TESTED_TRITON), (spec, _launch.TESTED_TRITON)


def _ptrs(args):
    return tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args)


def test_decode_run_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch):
    """A decode plan's first run() binds its launch (RunBinding): later calls with tensors of the same form
    launch the compiled kernel directly with exactly the arguments the general path passes (pointers as
    ints); a call of another form (q strides, another cache, out dtype, return_lse, scales), or a
    launch hook takes the general path, which checks again (a cache too small for the page table raises)."""
    from triton import knobs

    from flashinfer_triton import _decode_impl
    from flashinfer_triton import decode as dmod

    fake = _FakeJit(_decode_impl._decode_jit)
    monkeypatch.setattr(_decode_impl, "_decode_kernel", _launch.FastKernel(fake))
    gen = torch.Generator().manual_seed(0)
    hq, hkv, d, ps = 4, 2, 64, 16
    indptr, indices, last, num_pages = page_table([23, 48], ps, spare_pages=1, seed=0)  # 2 and 3 pages, one spare
    cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).half()

    def planned():
        w = dmod.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
        w.plan(indptr, indices, last, hq, hkv, d, ps)
        return w

    w = planned()

    def launch(*args, **kw):
        fake.log.clear()
        res = w.run(*args, **kw)
        (kind, got, *_), *rest = fake.log
        assert not rest
        return kind, (got[9:] if kind == "direct" else got), res  # (direct: after grid, stream, function, ...)

    q = torch.randn(2, hq, d, generator=gen).half()
    assert not w.plan_info().bound
    assert launch(q, cache)[0] == "triton"  # the first run of the kernel's key: Triton's path, and the binding
    assert w.plan_info().bound
    for kv, kw in (
        (cache, {}),
        ((cache[:, 0], cache[:, 1]), {}),  # the (k, v) form
        (cache, dict(return_lse=True)),
        (cache, dict(k_scale=0.5)),
    ):
        # a new wrapper's plan: its first run binds the form it is given (a re-plan would keep the previous binding)
        w = planned()
        assert not w.plan_info().bound
        launch(q, kv, **kw)
        info = w.plan_info()
        assert info.bound
        q2 = torch.randn(2, hq, d, generator=gen).half()
        out = torch.full((2, hq, d), float("nan"), dtype=torch.float16)
        kind, fast_args, res = launch(q2, kv, out=out, **kw)
        # the same call through the general path (window_left passed: never the bound one)
        kind_ref, ref_args, ref_res = launch(q2, kv, out=out, window_left=-1, **kw)
        now = w.plan_info()  # (one binding per plan, kept by the call the general path took)
        assert kind == kind_ref == "direct" and now.bound and now.plan_id == info.plan_id
        fast_args, ref_args = list(_ptrs(fast_args)), list(_ptrs(ref_args))
        if kw.get("return_lse"):  # each call's own lse (position 4)
            assert fast_args[4] == res[1].data_ptr() and ref_args[4] == ref_res[1].data_ptr()
            fast_args[4] = ref_args[4] = None
        assert fast_args == ref_args, kw
        assert (res[0] if kw.get("return_lse") else res) is out
        if kw.get("return_lse"):
            assert res[1].shape == (2, hq) and res[1].dtype == torch.float32
        assert not any(isinstance(a, torch.Tensor) for a in launch(q2, kv, **kw)[1])  # bound: pointers as ints
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    launch(q, cache)
    # other forms: the general path (tensors passed, not bound ints)
    strided = torch.randn(2, hq, 2 * d, generator=gen).half()[..., :d]
    for args, kw in (
        ((strided, cache), {}),
        ((q, torch.randn(7, 2, ps, hkv, d, generator=gen).half()), {}),
        ((q, cache), dict(out=torch.empty(2, hq, d, dtype=torch.bfloat16))),
    ):
        try:
            kind, got, _ = launch(*args, **kw)
        except (TypeError, ValueError):
            continue  # the general path's check (out dtype)
        assert any(isinstance(a, torch.Tensor) for a in got), kw
    with pytest.raises(ValueError, match="paged_kv_indices"):
        launch(q, torch.randn(3, 2, ps, hkv, d, generator=gen).half())  # pages past this cache: the general check
    w.plan(indptr, indices, last, hq, hkv, d, ps)
    assert w.plan_info().bound  # a re-plan of the same launch keeps the binding (Plan.inherit_binding)
    launch(q, cache)
    stand_in.device = 1  # another current device: the general path (Triton's, for a key of that device)
    assert launch(q, cache)[0] == "triton"
    stand_in.device = 0
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)
    kind, got, _ = launch(q, cache)
    assert kind == "triton"  # a hook: Triton's path


@pytest.mark.parametrize("form", ["paged", "ragged"])
def test_prefill_run_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch, form):
    """Prefill (paged and ragged K/V): after the first run() of a plan, a call of the same form launches the
    bound kernel with exactly the general path's arguments (out in the three places the unsplit kernel takes
    it); another form takes the general path."""
    from flashinfer_triton import _prefill_impl
    from flashinfer_triton import prefill as pmod
    from flashinfer_triton.kernels import prefill as kp

    fake = _FakeJit(kp._prefill_kernel)
    monkeypatch.setattr(_prefill_impl, "_KERNELS", [_launch.FastKernel(fake), _launch.FastKernel(fake)])
    gen = torch.Generator().manual_seed(1)
    hq, hkv, d, ps = 4, 2, 64, 16
    qo = torch.tensor([0, 3, 8], dtype=torch.int32)
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    if form == "paged":
        indptr, indices, last, num_pages = page_table([23, 48], ps, spare_pages=1, seed=1)
        cache = torch.randn(num_pages, 2, ps, hkv, d, generator=gen).half()
        w = pmod.BatchPrefillWithPagedKVCacheWrapper(ws, "NHD")
        plan_args = (qo, indptr, indices, last, hq, hkv, d, ps)
        kv, other = (cache,), (torch.randn(7, 2, ps, hkv, d, generator=gen).half(),)
    else:
        kv_indptr = torch.tensor([0, 20, 45], dtype=torch.int32)
        w = pmod.BatchPrefillWithRaggedKVCacheWrapper(ws, "NHD")
        plan_args = (qo, kv_indptr, hq, hkv, d)
        kv = tuple(torch.randn(45, hkv, d, generator=gen).half() for _ in range(2))
        other = tuple(torch.randn(50, hkv, d, generator=gen).half() for _ in range(2))

    def launch(*args, **kw):
        fake.log.clear()
        res = w.run(*args, **kw)
        (kind, got, *_), *rest = fake.log
        assert not rest
        return kind, (got[9:] if kind == "direct" else got), res

    q = torch.randn(8, hq, d, generator=gen).half()
    for kw, hit in ((dict(), True), (dict(return_lse=True), False)):
        w.plan(*plan_args, causal=True)
        launch(q, *kv)  # binds the form without lse
        q2 = torch.randn(8, hq, d, generator=gen).half()
        out = torch.full((8, hq, d), float("nan"), dtype=torch.float16)
        kind, fast_args, res = launch(q2, *kv, out=out, **kw)
        assert hit == (not any(isinstance(a, torch.Tensor) for a in fast_args)), kw  # bound: pointers as ints
        kind_ref, ref_args, ref_res = launch(q2, *kv, out=out, window_left=-1, **kw)
        fast_args, ref_args = list(_ptrs(fast_args)), list(_ptrs(ref_args))
        if kw.get("return_lse"):
            assert fast_args[4] == res[1].data_ptr() and ref_args[4] == ref_res[1].data_ptr()
            fast_args[4] = ref_args[4] = None
        else:
            assert fast_args[4] == out.data_ptr()  # no lse: out stands in
        assert fast_args[5] == fast_args[6] == out.data_ptr()
        assert fast_args == ref_args, kw
    kind, got, _ = launch(q, *other)
    assert any(isinstance(a, torch.Tensor) for a in got)


@pytest.mark.parametrize("return_lse", [False, True])
def test_split_prefill_run_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch, return_lse):
    """A split prefill plan binds both of its launches (the attention kernel, then the merge of the split rows):
    a later call of the same form launches both directly, with exactly the general path's arguments (the merge
    with the call's out and lse)."""
    from flashinfer_triton import _prefill_impl
    from flashinfer_triton import prefill as pmod
    from flashinfer_triton.kernels import prefill as kp

    fake, fake_merge = _FakeJit(kp._prefill_kernel), _FakeJit(kp._merge_partials_kernel)
    fake_merge.log = fake.log  # one log, in launch order
    fake_merge.compiled = _Compiled(fake.log)
    monkeypatch.setattr(_prefill_impl, "_KERNELS", [_launch.FastKernel(fake), _launch.FastKernel(fake_merge)])
    gen = torch.Generator().manual_seed(2)
    hq, hkv, d = 4, 2, 64
    w = pmod.BatchPrefillWithRaggedKVCacheWrapper(torch.empty(1 << 22, dtype=torch.uint8), "NHD")
    w.plan(torch.tensor([0, 3, 8], dtype=torch.int32), torch.tensor([0, 300, 700], dtype=torch.int32), hq, hkv, d,
           fixed_split_size=64)  # fmt: skip
    info = w.plan_info()
    assert info.split and info.backend == "triton" and not info.bound and not info.cuda_graph
    k, v = (torch.randn(700, hkv, d, generator=gen).half() for _ in range(2))

    def launch(*args, **kw):
        fake.log.clear()
        res = w.run(*args, return_lse=return_lse, **kw)
        assert len(fake.log) == 2  # attention, merge
        return [(kind, got[9:] if kind == "direct" else got) for kind, got, *_ in fake.log], res

    launch(torch.randn(8, hq, d, generator=gen).half(), k, v)  # Triton's path for both kernels, then the binding
    assert w.plan_info().bound
    q = torch.randn(8, hq, d, generator=gen).half()
    out = torch.full((8, hq, d), float("nan"), dtype=torch.float16)
    fast, res = launch(q, k, v, out=out)
    ref, ref_res = launch(q, k, v, out=out, window_left=-1)  # the general path (window_left: never bound)
    assert [kind for kind, _ in fast] == [kind for kind, _ in ref] == ["direct", "direct"]
    for (_, got), (_, want) in zip(fast, ref, strict=True):
        assert not any(isinstance(a, torch.Tensor) for a in got)  # bound: pointers as ints
        got, want = list(got), list(_ptrs(want))
        if return_lse:  # each call's own lse: the attention kernel's position 4, the merge's 5
            lse_pos = 4 if len(got) > 20 else 5
            assert got[lse_pos] == res[1].data_ptr() and want[lse_pos] == ref_res[1].data_ptr()
            got[lse_pos] = want[lse_pos] = None
        assert got == want
    assert fast[1][1][4] == out.data_ptr()  # the merge writes the call's out


@pytest.mark.parametrize("return_lse", [False, True])
def test_cascade_run_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch, return_lse):
    """The fused cascade's first run() binds its two launches (all levels' attention, then the merge): a later
    call of the same form launches both directly with exactly the general path's arguments."""
    from flashinfer_triton import _prefill_impl
    from flashinfer_triton import cascade as cmod
    from flashinfer_triton.kernels import prefill as kp

    fake, fake_merge = _FakeJit(kp._prefill_kernel), _FakeJit(kp._merge_partials_kernel)
    fake_merge.log = fake.log
    fake_merge.compiled = _Compiled(fake.log)
    monkeypatch.setattr(_prefill_impl, "_KERNELS", [_launch.FastKernel(fake), _launch.FastKernel(fake_merge)])
    gen = torch.Generator().manual_seed(5)
    hq, hkv, d, ps, bs = 4, 2, 64, 16, 3
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    cache = torch.randn(12, 2, ps, hkv, d, generator=gen).half()

    def planned():
        w = cmod.MultiLevelCascadeAttentionWrapper(2, torch.empty(1 << 22, dtype=torch.uint8), "NHD")
        w.plan(
            [i32(0, bs), i32(*range(bs + 1))],
            [i32(0, 6), i32(0, 2, 4, 6)],
            [i32(*range(6)), i32(*range(6, 12))],
            [i32(ps), i32(ps, 5, 9)],
            hq, hkv, d, ps,
        )  # fmt: skip
        return w

    # A first wrapper's run compiles both kernels' keys, so that the general path of the next wrapper's first run
    # launches the compiled kernels directly as well (its arguments are then comparable to the bound launches').
    planned().run(torch.randn(bs, hq, d, generator=gen).half(), cache, return_lse=return_lse)
    w = planned()
    info = w.plan_info().fused
    assert info is not None and not info.bound

    def launch(q):
        fake.log.clear()
        res = w.run(q, cache, return_lse=return_lse)
        assert len(fake.log) == 2  # attention, merge
        return [(kind, got[9:] if kind == "direct" else got) for kind, got, *_ in fake.log], res

    q = torch.randn(bs, hq, d, generator=gen).half()
    ref, ref_res = launch(q)  # the first run: the general path, which binds the form
    assert w.plan_info().fused.bound
    fast, res = launch(q)
    for (kind, got), (kind_ref, want) in zip(fast, ref, strict=True):
        assert kind == kind_ref == "direct" and not any(isinstance(a, torch.Tensor) for a in got)
        got, want = list(got), list(_ptrs(want))
        outs = (res, ref_res) if not return_lse else (res[0], ref_res[0])
        assert outs[0].data_ptr() in got and outs[1].data_ptr() in want
        got = [None if a in (outs[0].data_ptr(), res[1].data_ptr() if return_lse else -1) else a for a in got]
        want = [None if a in (outs[1].data_ptr(), ref_res[1].data_ptr() if return_lse else -1) else a for a in want]
        assert got == want


def test_single_decode_run_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch):
    """single_decode_with_kv_cache keeps its plan per (lengths, options) and, from the second call of a form
    on, launches the plan's bound kernel with the general path's arguments."""
    from flashinfer_triton import _decode_impl
    from flashinfer_triton import decode as dmod

    fake = _FakeJit(_decode_impl._decode_jit)
    monkeypatch.setattr(_decode_impl, "_decode_kernel", _launch.FastKernel(fake))
    clear_host_caches("single_plans", "single_forms")
    gen = torch.Generator().manual_seed(2)
    k, v = (torch.randn(40, 2, 64, generator=gen).half() for _ in range(2))

    def call(q, **kw):
        fake.log.clear()
        res = dmod.single_decode_with_kv_cache(q, k, v, **kw)
        (kind, got, *_), *rest = fake.log
        assert not rest
        return kind, _ptrs(got[9:] if kind == "direct" else got), res

    call(torch.randn(4, 64, generator=gen).half())  # plans, runs, binds
    (info,) = host_caches()["single_plans"]
    assert info.op == "single_decode_with_kv_cache" and info.shapes == ((1, 4, 64), (40, 2, 64)) and info.bound
    q = torch.randn(4, 64, generator=gen).half()
    kind, fast_args, res = call(q)
    kind_ref, ref_args, ref_res = call(q, lse_base="ln")  # (the general path: the bound call is base 2 only)
    (now,) = host_caches()["single_plans"]
    assert kind == kind_ref == "direct" and now.bound and now.plan_id == info.plan_id
    (form,) = host_caches()["single_forms"]  # the call's form, bound to that plan's launch
    assert form.op == "single_decode_with_kv_cache" and form.layout == "NHD" and form.dtypes[0] == torch.float16
    assert form.shapes == ((4, 64), (40, 2, 64), (40, 2, 64)) and form.bound and form.plan_id == info.plan_id
    assert fast_args[0] == q.data_ptr() and fast_args[3] == res.data_ptr() and ref_args[3] == ref_res.data_ptr()
    assert fast_args[:3] + fast_args[4:] == ref_args[:3] + ref_args[4:]


def test_merge_state_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch):
    """merge_state keeps the bound launch of a form that passed its checks: a later call of that form launches it
    with the general path's arguments (its own pointers); another form, or a bad one, takes the general path."""
    from flashinfer_triton import _merge_api, _merge_impl
    from flashinfer_triton.kernels import merge as km

    fake = _FakeJit(km._merge_pair_kernel)
    monkeypatch.setattr(_merge_impl, "_merge_pair_kernel", _launch.FastKernel(fake))
    clear_host_caches("merge_state")
    gen = torch.Generator().manual_seed(4)

    def states(n=6):
        return torch.randn(n, 4, 32, generator=gen).half(), torch.randn(n, 4, generator=gen)

    def call(*a):
        fake.log.clear()
        out = _merge_api.merge_state(*a)
        (kind, got, *_), *rest = fake.log
        assert not rest
        return kind, _ptrs(got[9:] if kind == "direct" else got), out

    call(*states(), *states())  # checks, launches, binds
    (form,) = host_caches()["merge_state"]
    assert form.shapes == ((6, 4, 32), (6, 4)) * 2 and form.dtypes == (torch.float16, torch.float32) * 2 and form.bound
    a, b = states(), states()
    kind, fast_args, (ov, os_) = call(*a, *b)
    clear_host_caches("merge_state")  # the general path for the same call
    kind_ref, ref_args, (rv, rs) = call(*a, *b)
    assert kind == kind_ref == "direct"
    assert fast_args[4:6] == (ov.data_ptr(), os_.data_ptr()) and ref_args[4:6] == (rv.data_ptr(), rs.data_ptr())
    assert fast_args[:4] + fast_args[6:] == ref_args[:4] + ref_args[6:]
    assert fast_args[:4] == (a[0].data_ptr(), a[1].data_ptr(), b[0].data_ptr(), b[1].data_ptr())
    call(*states(7), *states(7))  # another form: the general path, which binds it too
    assert [f.shapes[0] for f in host_caches()["merge_state"]] == [(6, 4, 32), (7, 4, 32)]
    with pytest.raises(ValueError, match="v_b"):
        _merge_api.merge_state(*states(), *states(7))


def test_merge_states_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch):
    """merge_states keeps the bound launch of a form (shapes, strides, dtypes and device of v and s) that passed its
    checks: a later call of it launches directly with the general path's arguments (its own pointers); another
    form takes the general path and is bound too; a bad call is still refused; past fixed_max_k states the online
    kernel binds as well."""
    from flashinfer_triton import _merge_api, _merge_impl
    from flashinfer_triton.kernels import merge as km

    fixed, online = _FakeJit(km._merge_fixed_kernel), _FakeJit(km._merge_states_kernel)
    monkeypatch.setattr(_merge_impl, "_merge_fixed_kernel", _launch.FastKernel(fixed))
    monkeypatch.setattr(_merge_impl, "_merge_states_kernel", _launch.FastKernel(online))
    gen = torch.Generator().manual_seed(5)

    def states(k=3):
        return torch.randn(6, k, 4, 32, generator=gen).half(), torch.randn(6, k, 4, generator=gen)

    def call(fake, v, s):
        fixed.log.clear()
        online.log.clear()
        out = _merge_api.merge_states(v, s)
        (kind, got, *_), *rest = fake.log
        assert not rest and not (online if fake is fixed else fixed).log
        return kind, _ptrs(got[9:] if kind == "direct" else got), out

    assert call(fixed, *states())[0] == "triton"  # checks, launches, binds
    (form,) = host_caches()["merge_states"]
    assert form.op == "merge_states" and form.shapes == ((6, 3, 4, 32), (6, 3, 4)) and form.bound
    assert form.dtypes == (torch.float16, torch.float32) and form.device == torch.device("cpu")
    v, s = states()
    kind, fast_args, (ov, os_) = call(fixed, v, s)
    assert (ov.shape, ov.dtype, os_.shape, os_.dtype) == ((6, 4, 32), torch.float16, (6, 4), torch.float32)
    clear_host_caches("merge_states")  # the general path for the same call
    kind_ref, ref_args, (rv, rs) = call(fixed, v, s)
    assert kind == kind_ref == "direct"
    assert fast_args[:4] == (v.data_ptr(), s.data_ptr(), ov.data_ptr(), os_.data_ptr())
    assert ref_args[:4] == (v.data_ptr(), s.data_ptr(), rv.data_ptr(), rs.data_ptr())
    assert fast_args[4:] == ref_args[4:]
    v6, s6 = states(6)
    _, args, _ = call(fixed, v6[:, ::2], s6[:, ::2])  # every other state: strides of another form
    assert args[7:13] == (v6.stride(0), 2 * v6.stride(1), v6.stride(2), s6.stride(0), 2 * s6.stride(1), s6.stride(2))
    assert len(host_caches()["merge_states"]) == 2
    with pytest.raises(ValueError, match=r"shape v\.shape\[:3\]"):
        _merge_api.merge_states(v, s[:5])
    assert call(online, *states(20))[0] == "triton"  # past fixed_max_k: the online kernel
    assert call(online, *states(20))[0] == "direct" and len(host_caches()["merge_states"]) == 3


def _desc_kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def probe_desc(a_ptr, x_desc, y_desc, o_ptr, n, BLOCK: tl.constexpr):
        tl.store(o_ptr + tl.arange(0, BLOCK), tl.load(a_ptr + tl.arange(0, BLOCK)) + n)

    return probe_desc


class _DescCompiled:
    """A compiled kernel with two descriptor parameters, its launcher shaped as Triton 3.6's (a descriptor wrapper
    around the raw launch, holding the descriptor positions and metadata)."""

    def __init__(self, log, metas):
        self.function = "fn"
        self.packed_metadata = "meta"

        def make_inner(launcher, tensordesc_indices, tensordesc_meta):
            def inner(*args):
                return (launcher, tensordesc_indices, tensordesc_meta)

            return inner

        class _Launcher:
            global_scratch_size = 0
            profile_scratch_size = 0
            launch_cooperative_grid = False
            launch_pdl = True

        self.run = _Launcher()
        self.run.launch = make_inner(lambda *a: log.append(("raw", a)), {1, 2}, metas)


def test_descriptor_launch_binding(stand_in, fast_launch, monkeypatch):
    """A kernel with tensor-descriptor parameters (the Gluon kernels) binds too: the bound launch takes the
    descriptors' tensors as addresses and passes the raw launcher exactly what a hit of the short path passes
    (each descriptor encoded for that address, with the bound geometry); encodings are kept per address; a
    descriptor among the bound arguments, or a launcher other than the one we know, does not bind."""
    import triton.backends.nvidia.driver as nvdriver
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    encodes = []

    def encode(desc, meta):
        encodes.append(desc.base.data_ptr())
        return [("tmap", desc.base.data_ptr(), tuple(desc.shape), tuple(desc.strides), meta["swizzle"]),
                *desc.shape, *desc.strides]  # fmt: skip

    monkeypatch.setattr(nvdriver, "make_tensordesc_arg", encode)
    metas = [dict(swizzle=s, elem_size=2, elem_type=6, block_size=[16, 64], fp4_padded=False) for s in (3, 2)]
    fake = _FakeJit(_desc_kernel())
    fake.compiled = _DescCompiled(fake.log, metas)
    fk = _launch.FastKernel(fake)
    lay = gl.NVMMASharedLayout.get_default_for([16, 64], gl.float16)
    gen = torch.Generator().manual_seed(0)

    def tensors():
        a, o = torch.randn(64, generator=gen), torch.empty(64)
        x, y = (torch.randn(40, 128, generator=gen).half() for _ in range(2))
        return a, x, y, o

    def descs(x, y):
        return (TensorDescriptor(x, [40, 128], [128, 1], [16, 64], lay),
                TensorDescriptor(y, [40, 128], [128, 1], [16, 64], lay))  # fmt: skip

    a, x, y, o = tensors()
    args = [a, *descs(x, y), o, 16, 64]
    fake.log.clear()
    compiled = fk.run(*args, grid=(3, 2), warmup=False, num_warps=4)
    assert fake.log[-1][0] == "triton"
    bound = _launch.bind(fk, compiled, args, (3, 2), 4)
    assert isinstance(bound, _launch.DescBoundLaunch)
    for a, x, y, o in (tensors(), tensors()):
        fake.log.clear()
        fk.run(a, *descs(x, y), o, 16, 64, grid=(3, 2), warmup=False, num_warps=4)  # a hit of the short path
        assert bound(a.data_ptr(), x.data_ptr(), y.data_ptr(), o.data_ptr())
        (kind, hit), (kind_b, got) = fake.log
        assert kind == kind_b == "raw"
        assert got[:3] == (3, 2, 1) and got[5:7] == (False, True)  # grid, cooperative, pdl
        assert _ptrs(hit) == got
        assert got[14] == ("tmap", x.data_ptr(), (40, 128), (128, 1), 3)
        assert got[19] == ("tmap", y.data_ptr(), (40, 128), (128, 1), 2)
        n = len(encodes)
        bound(a.data_ptr(), x.data_ptr(), y.data_ptr(), o.data_ptr())
        assert len(encodes) == n  # encoded once per address
    kept = host_caches()["tensor_descriptors"]  # (x and y of each call)
    assert len(kept) == 4 and all(f.shapes == ((40, 128), (16, 64)) and f.dtypes == (torch.float16,) for f in kept)
    assert _launch.bind(fk, compiled, args, (3, 2), 2) is None  # a descriptor among the bound arguments
    other = _Compiled(fake.log)  # a launcher without Triton's descriptor wrapper
    assert _launch.bind(fk, other, args, (3, 2), 4) is None


@pytest.mark.parametrize("form", ["5d-NHD", "5d-HND", "pair-NHD"])
def test_append_binding(stand_in, fast_launch, triton_on_cpu, monkeypatch, form):
    """append_paged_kv_cache: the first call of a form checks and binds its launch; later calls of that form
    launch it directly with exactly the arguments the kernel's general launch gets (K and V located in the
    cache as the general path's views locate them); another form takes the general path."""
    from flashinfer_triton import _page_impl
    from flashinfer_triton import page as pg
    from flashinfer_triton.kernels import page as kpage

    clear_host_caches("append_forms")
    fake = _FakeJit(kpage._append_paged_kv_kernel)
    monkeypatch.setattr(_page_impl, "_append_paged_kv_kernel", _launch.FastKernel(fake))
    gen = torch.Generator().manual_seed(3)
    layout = form.split("-")[1]
    pages, ps, h, d = 6, 16, 2, 64
    shape = (pages, ps, h, d) if layout == "NHD" else (pages, h, ps, d)
    if form.startswith("5d"):
        cache = torch.randn(pages, 2, *shape[1:], generator=gen).half()
    else:
        cache = tuple(torch.randn(*shape, generator=gen).half() for _ in range(2))
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    indptr, indices, last = i32(0, 2, 5), i32(4, 0, 1, 5, 2), i32(3, 9)
    bi, pos = i32(0, 1, 1), i32(18, 40, 41)

    def call(n=3):
        fake.log.clear()
        key, value = (torch.randn(n, h, d, generator=gen).half() for _ in range(2))
        pg.append_paged_kv_cache(key, value, bi[:n], pos[:n], cache, indices, indptr, last, kv_layout=layout)
        (kind, got, *_), *rest = fake.log
        assert not rest
        return kind, (got[9:] if kind == "direct" else got), (key, value)

    assert call()[0] == "triton"  # checked, launched through Triton's path, bound
    (entry,) = host_caches()["append_forms"]
    assert entry.op == "append_paged_kv_cache" and entry.bound and entry.layout == layout
    for _ in range(2):
        kind, got, (key, value) = call()
        assert kind == "direct"  # (addresses only: the bound launch)
        fake.log.clear()
        k4, v4 = pg._cache_views(cache, layout)
        _page_impl.append_paged_kv_cache(key, value, bi, pos, k4, v4, indices, indptr)  # the general launch
        assert got == _ptrs(fake.log[0][1][9:])
    kind, got, _ = call(2)  # another form (2 tokens): checked and launched with tensors, then bound too
    assert any(isinstance(a, torch.Tensor) for a in got)
    assert call(2)[0] == "direct"


@pytest.fixture
def row_kernels(monkeypatch):
    """The norm, activation and rope kernels replaced by recorded stand-ins (``_FakeJit``), CPU tensors routed to
    them, no call form kept from earlier tests: {kernel name: its stand-in}."""
    from flashinfer_triton import activation, norm, rope
    from flashinfer_triton.kernels import activation as ka
    from flashinfer_triton.kernels import norm as kn
    from flashinfer_triton.kernels import rope as kr

    fakes = {}
    for name, forms, kernel in (
        ("norm", kn._norm_forms, kn._norm_kernel),
        ("activation", ka._act_forms, ka._act_and_mul_kernel),
        ("rope", kr._rope_forms, kr._rope_kernel),
    ):
        fakes[name] = _FakeJit(kernel)
        monkeypatch.setattr(forms, "fast", _launch.FastKernel(fakes[name]))
    for mod in (norm, activation, rope):
        monkeypatch.setattr(mod, "use_triton", lambda device: True)
    clear_host_caches("row_forms")
    yield fakes
    clear_host_caches("row_forms")


_H, _HQ, _HK, _D = 96, 3, 1, 32  # (a SmolLM2-like layout: q and k views of one qkv row of 3 + 1 + 1 heads)


def _qkv(t, gen):
    qkv = torch.randn(t, (_HQ + 2 * _HK) * _D, generator=gen).half()
    return qkv[:, : _HQ * _D], qkv[:, _HQ * _D : (_HQ + _HK) * _D]


def _row_call(op, t, gen):
    """(kernel, function, args, kwargs) of one call of ``op`` over ``t`` tokens, on fresh tensors."""
    from flashinfer_triton import activation, norm, rope

    x = torch.randn(t, _H, generator=gen).half()
    w = torch.nn.Parameter(torch.randn(_H, generator=gen).half(), requires_grad=False)
    pos = torch.randint(0, 64, (t,), generator=gen)
    cache = torch.randn(64, _D, generator=gen)
    if op == "rmsnorm":
        return "norm", norm.rmsnorm, (x, w), dict(eps=1e-5)
    if op == "rmsnorm-out":
        return "norm", norm.rmsnorm, (x, w), dict(eps=1e-5, out=torch.empty_like(x), enable_pdl=False)
    if op == "rmsnorm-3d":
        return "norm", norm.rmsnorm, (_qkv(t, gen)[0].unflatten(1, (_HQ, _D)), w[:_D]), dict(eps=1e-5)
    if op == "gemma_rmsnorm":
        return "norm", norm.gemma_rmsnorm, (x, w), dict(eps=1e-5)
    if op == "fused_add_rmsnorm":
        return "norm", norm.fused_add_rmsnorm, (x, torch.randn(t, _H, generator=gen).half(), w), dict(eps=1e-5)
    if op == "layernorm":
        return "norm", norm.layernorm, (x, w.float(), w.float()), dict(eps=1e-5)
    if op in ("silu_and_mul", "gelu_and_mul", "gelu_tanh_and_mul"):  # (gate and up: a view of a wider row)
        gate_up = torch.randn(t, 2 * _H + 16, generator=gen).half()[:, : 2 * _H]
        return "activation", getattr(activation, op), (gate_up,), {}
    if op == "silu_and_mul-out":
        gu = torch.randn(t, 2 * _H, generator=gen).half()
        return "activation", activation.silu_and_mul, (gu,), dict(out=torch.empty(t, _H).half())
    if op == "rope_cos_sin_inplace":
        return "rope", rope.apply_rope_with_cos_sin_cache_inplace, (pos, *_qkv(t, gen), _D, cache), {}
    if op == "rope_cos_sin":
        half = cache[:, : _D // 2].contiguous()  # (rotary_dim 16 of head_dim 32: the rest copied)
        return "rope", rope.apply_rope_with_cos_sin_cache, (pos, *_qkv(t, gen), _D, half, False), {}
    q, k = (x.unflatten(1, (-1, _D)) for x in _qkv(t, gen))
    if op == "rope_pos_ids_inplace":
        return "rope", rope.apply_rope_pos_ids_inplace, (q, k, pos.int()), {}
    assert op == "llama31_rope_pos_ids"
    return "rope", rope.apply_llama31_rope_pos_ids, (q, k, pos), dict(rotary_dim=16, interleave=True)


_ROW_OPS = [
    "rmsnorm", "rmsnorm-out", "rmsnorm-3d", "gemma_rmsnorm", "fused_add_rmsnorm", "layernorm", "silu_and_mul",
    "gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul-out", "rope_cos_sin_inplace", "rope_cos_sin",
    "rope_pos_ids_inplace", "llama31_rope_pos_ids",
]  # fmt: skip


_OWN_SINGLE_TOKEN_FORM = ("rmsnorm-3d", "rope_cos_sin", "rope_pos_ids_inplace", "llama31_rope_pos_ids")


@pytest.mark.parametrize("op", _ROW_OPS)
def test_row_ops_binding(stand_in, fast_launch, row_kernels, op):
    """The norm, activation and rope functions keep the launch of each call form their checks passed, whatever its
    token count: a later call of the form (another token count, its own tensors) launches it directly with exactly
    the arguments and grid the general path gives the same call, a single token's strided views included (their
    views' strides are recomputed, the form's must not be)."""
    gen = torch.Generator().manual_seed(7)

    def launched(call):
        kernel, fn, args, kwargs = call
        fake = row_kernels[kernel]
        fake.log.clear()
        result = fn(*args, **kwargs)
        (kind, got, *rest), *more = fake.log
        assert not more
        grid = got[:3] if kind == "direct" else tuple(rest[0]) + (1,) * (3 - len(rest[0]))
        # (addresses of the call's own tensors by their place in it, of its results as "out")
        outs = [r for r in (result if isinstance(result, tuple) else (result,)) if isinstance(r, torch.Tensor)]
        named = {}
        for i, a in enumerate((*args, kwargs.get("out"))):
            if isinstance(a, torch.Tensor):
                named.setdefault(a.data_ptr(), f"arg{i}")
        for j, r in enumerate(outs):
            named.setdefault(r.data_ptr(), f"out{j}")
        got = got[9:] if kind == "direct" else got
        if any(isinstance(a, torch.Tensor) for a in got):  # (the general path: its tensors themselves)
            kind += "-tensors"
        return kind, grid, tuple(named.get(a, a) if type(a) is int else a for a in _ptrs(got))

    assert launched(_row_call(op, 1, gen))[0] == "triton-tensors"  # checked, launched by Triton's path, bound
    (entry,) = host_caches()["row_forms"]
    assert entry.bound and entry.op == _row_call(op, 1, gen)[0] and entry.device == torch.device("cpu")
    # More tokens: the same form, but where the tensors themselves have other strides for one token (unflatten and
    # empty_like recompute the stride of a dimension of size 1): a form of their own, bound in turn.
    kind = launched(_row_call(op, 5, gen))[0]
    assert (kind != "direct") == (op in _OWN_SINGLE_TOKEN_FORM)
    for t in (3, 1, 5):
        launched(_row_call(op, t, gen))  # (the form of t tokens bound by now, after the clearing below)
        call = _row_call(op, t, gen)
        kind, grid, got = launched(call)
        assert kind == "direct"  # (addresses only: the bound launch)
        clear_host_caches("row_forms")  # the general path for the same call (which binds the form again)
        kind_ref, grid_ref, ref = launched(call)
        # (Triton's path for a Parameter weight, which FastKernel does not classify: the same arguments)
        assert kind_ref in ("direct-tensors", "triton-tensors") and (grid, got) == (grid_ref, ref), t
        assert grid[0] == (t * _HQ if op == "rmsnorm-3d" else t)


@pytest.mark.parametrize("op", ["silu_and_mul", "silu_and_mul-out"])
def test_activation_tiles_binding(stand_in, fast_launch, row_kernels, monkeypatch, op):
    """The activation's several-row tiles: the launch a form keeps is per layout (tile rows, evenness), the row count
    its own leading argument, so a count that fills its last tile, one that does not and a count of the other layout
    each launch with exactly the general path's arguments and grid."""
    from flashinfer_triton import _config
    from flashinfer_triton._config import ActivationConfig

    # (columns in tiles of 32, which divide the width: even rows make an even tile)
    cfg = ActivationConfig(block_min=32, block_max=32, large_min_elements=4 * _H, large_tile=4 * 32)
    monkeypatch.setattr(_config, "ACTIVATION", cfg)
    assert [cfg.layout(t, _H)[:3] for t in (8, 9, 3)] == [(4, 32, True), (4, 32, False), (1, 32, True)]
    gen = torch.Generator().manual_seed(3)

    def launched(call):
        kernel, fn, args, kwargs = call
        fake = row_kernels[kernel]
        fake.log.clear()
        result = fn(*args, **kwargs)
        (kind, got, *rest), *more = fake.log
        assert not more
        grid = got[:3] if kind == "direct" else tuple(rest[0]) + (1,) * (3 - len(rest[0]))
        named = {
            a.data_ptr(): f"arg{i}" for i, a in enumerate((*args, kwargs.get("out"))) if isinstance(a, torch.Tensor)
        }
        named.setdefault(result.data_ptr(), "out")
        got = got[9:] if kind == "direct" else got
        if any(isinstance(a, torch.Tensor) for a in got):
            kind += "-tensors"
        return kind, grid, tuple(named.get(a, a) if type(a) is int else a for a in _ptrs(got))

    calls = {t: _row_call(op, t, gen) for t in (8, 12, 9, 3)}  # (from 4 rows: tiles of 4 rows, even at 8 and 12)
    ref = {}
    for t, call in calls.items():  # the general path's launch of each call
        clear_host_caches("row_forms")
        kind, grid, got = launched(call)
        assert kind in ("direct-tensors", "triton-tensors") and grid[0] == (t if t < 4 else -(-t // 4)), t
        ref[t] = (grid, got)
    clear_host_caches("row_forms")
    kinds = []
    for t in (8, 12, 9, 3, 8, 12, 9, 3):  # every form's launch kept by now: each count takes its own layout's
        kind, grid, got = launched(calls[t])
        assert (grid, got) == ref[t], t
        kinds.append(kind)
    assert kinds[1] == "direct" and kinds[4:] == ["direct"] * 4  # (12 rows: the layout of 8)
    assert all(kinds[i] in ("direct-tensors", "triton-tensors") for i in (0, 2, 3)), kinds


def _bad_row_calls():
    """(op, case id, fn(args, kwargs) -> the arguments of a bad call made from a good call's, error, match)."""

    def put(i, value):  # argument i (-1: the last) replaced, or added after the last
        def bad(a, kw):
            j = i if i >= 0 else len(a) + i
            return (*a[:j], value, *a[j + 1 :]), kw

        return bad

    def key(**changes):
        return lambda a, kw: (a, {**kw, **changes})

    def fewer(i):  # argument i with one token less
        return lambda a, kw: ((*a[:i], a[i][:-1], *a[i + 1 :]), kw)

    norm_bad = [
        ("int-input", put(0, torch.zeros(4, _H, dtype=torch.int32)), TypeError, "input: expected dtype"),
        ("1d-input", put(0, torch.zeros(_H).half()), ValueError, "input: expected a 2-D"),
        ("weight-size", put(-1, torch.zeros(_H - 2).half()), ValueError, "weight: expected shape"),
        ("weight-device", put(-1, torch.zeros(_H).half().to("meta")), ValueError, "weight: expected a tensor on"),
        ("eps-negative", key(eps=-1.0), ValueError, "eps: expected a finite value"),
        ("eps-nan", key(eps=float("nan")), ValueError, "eps: expected a finite value"),
        ("pdl-int", key(enable_pdl=1), TypeError, "enable_pdl: expected None or a bool"),
        ("out-tokens", key(out=torch.zeros(3, _H).half()), ValueError, "out: expected shape"),
        ("out-dtype", key(out=torch.zeros(4, _H)), TypeError, "out: expected dtype"),
    ]  # fmt: skip
    act_bad = [
        ("odd-width", put(0, torch.zeros(4, 2 * _H + 1).half()), ValueError, "input: expected an even"),
        ("pdl-int", key(enable_pdl=1), TypeError, "enable_pdl: expected None or a bool"),
        ("out-tokens", key(out=torch.zeros(3, _H).half()), ValueError, "out: expected shape"),
        ("out-dtype", key(out=torch.zeros(4, _H)), TypeError, "out: expected dtype"),
    ]
    cos_sin_bad = [
        ("positions-tokens", fewer(0), ValueError, "positions: expected shape"),
        ("positions-dtype", lambda a, kw: ((a[0].short(), *a[1:]), kw), TypeError, "positions: expected dtype"),
        ("key-tokens", fewer(2), ValueError, "key: expected 4 rows"),
        ("head-size-bool", put(3, True), ValueError, "head_size: expected a positive int"),
        ("cache-dtype", lambda a, kw: ((*a[:4], a[4].half()), kw), ValueError, "cos_sin_cache should be float32"),
        ("neox-int", put(5, 1), TypeError, "is_neox: expected a bool"),
    ]
    pos_ids_bad = [
        ("pos-tokens", fewer(2), ValueError, "pos_ids: expected shape"),
        ("k-tokens", fewer(1), ValueError, "k: expected shape"),
        ("interleave-int", key(interleave=1), TypeError, "interleave: expected a bool"),
        ("rotary-bool", key(rotary_dim=True), TypeError, "rotary_dim: expected None or an int"),
        ("scale-bool", key(rope_scale=True), TypeError, "rope_scale: expected a float"),
        ("theta-negative", key(rope_theta=-1.0), ValueError, "rope_theta: expected a finite value > 0"),
    ]
    for op in ("rmsnorm", "fused_add_rmsnorm"):
        for name, bad, exc, match in norm_bad:
            if op == "fused_add_rmsnorm" and name.startswith("out"):
                continue
            yield op, name, bad, exc, match
    yield "fused_add_rmsnorm", "residual-tokens", fewer(1), ValueError, "residual: expected shape"
    yield "layernorm", "beta-size", put(2, torch.zeros(_H - 2)), ValueError, "beta: expected shape"
    for name, bad, exc, match in act_bad:
        yield "silu_and_mul", name, bad, exc, match
    for op in ("rope_cos_sin_inplace", "rope_cos_sin"):
        for name, bad, exc, match in cos_sin_bad:
            yield op, name, bad, exc, match
    for name, bad, exc, match in pos_ids_bad:
        yield "rope_pos_ids_inplace", name, bad, exc, match


@pytest.mark.parametrize(
    "op,bad,exc,match",
    [pytest.param(op, bad, exc, match, id=f"{op}-{name}") for op, name, bad, exc, match in _bad_row_calls()],
)
def test_row_ops_keep_their_checks(stand_in, fast_launch, row_kernels, op, bad, exc, match):
    """After a call form's launch is bound, a call that differs from it in anything its checks read (a dtype, a
    shape, a device, a token count of another argument, eps, a flag of another type: 1 for True) is refused with
    the same error as before any call, naming the argument, before anything is launched or written."""
    gen = torch.Generator().manual_seed(8)
    kernel, fn, args, kwargs = _row_call(op, 4, gen)
    if op == "rmsnorm":
        kwargs["enable_pdl"] = True  # (a bool in the bound form: 1 must not meet it)
    fn(*args, **kwargs)
    fn(*args, **kwargs)
    assert row_kernels[kernel].log[-1][0] == "direct" and host_caches()["row_forms"][0].bound
    bad_args, bad_kwargs = bad(args, kwargs)
    before = [
        a.clone() for a in (*bad_args, *bad_kwargs.values()) if isinstance(a, torch.Tensor) and a.device.type == "cpu"
    ]
    row_kernels[kernel].log.clear()
    with pytest.raises(exc, match=match):
        fn(*bad_args, **bad_kwargs)
    assert not row_kernels[kernel].log  # nothing launched
    after = [a for a in (*bad_args, *bad_kwargs.values()) if isinstance(a, torch.Tensor) and a.device.type == "cpu"]
    assert all(torch.equal(b, a) for b, a in zip(before, after, strict=True))


@pytest.mark.parametrize(
    "op", ["rmsnorm", "fused_add_rmsnorm", "silu_and_mul", "rope_cos_sin_inplace", "rope_pos_ids_inplace"]
)
def test_row_ops_no_tokens_after_binding(stand_in, fast_launch, row_kernels, op):
    """No tokens, in a form bound with some: nothing is launched (a grid of no rows is no launch)."""
    gen = torch.Generator().manual_seed(9)
    kernel, fn, args, kwargs = _row_call(op, 4, gen)
    fn(*args, **kwargs)
    fn(*args, **kwargs)
    assert row_kernels[kernel].log[-1][0] == "direct"
    row_kernels[kernel].log.clear()
    kernel, fn, args, kwargs = _row_call(op, 0, gen)
    result = fn(*args, **kwargs)
    assert not row_kernels[kernel].log
    if isinstance(result, torch.Tensor):
        assert result.shape[0] == 0
