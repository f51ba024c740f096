"""``flashinfer_triton.norm`` against a float64 reference: every op, dtype and shape class.

``path`` selects where an op runs: ``torch`` (CPU tensors, the PyTorch path), ``kernel`` (the Triton
kernel: CUDA, or the CPU under ``TRITON_INTERPRET=1``; small shapes) and ``gpu`` (the kernel on the
model shapes: hidden 576 and 4096, batch 1 to 512).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET, assert_close, poison
from flashinfer_triton import _config, norm
from helpers import use_config

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = [(1, 64), (3, 200), (5, 576)]
LARGE = [(1, 576), (37, 576), (512, 576), (1, 4096), (128, 4096), (512, 4096)]


def _paths():
    return [
        pytest.param("torch", SMALL, id="torch"),
        pytest.param("kernel", SMALL, id="kernel", marks=pytest.mark.interpret),
        pytest.param("gpu", LARGE, id="gpu", marks=pytest.mark.gpu),
    ]


def _device(path: str) -> str:
    if path == "torch":
        if INTERPRET:
            pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


def ref_rms(x, w, eps, bias=0.0):
    x = x.double()
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * (w.double() + bias)


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_rmsnorm(path, shapes, dtype, gemma):
    dev = _device(path)
    fn = norm.gemma_rmsnorm if gemma else norm.rmsnorm
    for b, h in shapes:
        x = torch.randn(b, h, device=dev).to(dtype)
        w = (torch.rand(h, device=dev) + 0.5).to(dtype)
        out = poison(torch.empty_like(x))
        got = fn(x, w, eps=1e-5, out=out)
        assert got is out
        assert_close(out, ref_rms(x, w, 1e-5, 1.0 if gemma else 0.0), name=f"{fn.__name__} {b}x{h}")
        assert_close(fn(x, w), ref_rms(x, w, 1e-6, 1.0 if gemma else 0.0), name=f"{fn.__name__} default eps")


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rmsnorm_3d_strided(path, shapes, dtype):
    """Per-head norm (QK-norm): ``[tokens, heads, head_dim]`` views of a wider buffer."""
    dev = _device(path)
    for b, _ in shapes:
        buf = torch.randn(b, 6, 80, device=dev).to(dtype)
        x = buf[:, 1:5, :64]
        w = torch.randn(64, device=dev).to(dtype)
        got = norm.rmsnorm(x, w)
        assert_close(got, ref_rms(x, w, 1e-6), name="3-D rmsnorm")


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gemma", [False, True])
def test_fused_add_rmsnorm(path, shapes, dtype, gemma):
    dev = _device(path)
    fn = norm.gemma_fused_add_rmsnorm if gemma else norm.fused_add_rmsnorm
    for b, h in shapes:
        x = torch.randn(b, h, device=dev).to(dtype)
        r = torch.randn(b, h, device=dev).to(dtype)
        w = torch.randn(h, device=dev).to(dtype)
        s = x.double() + r.double()
        exp_x = ref_rms(s, w, 1e-6, 1.0 if gemma else 0.0)
        assert fn(x, r, w) is None
        assert_close(r, s, name="residual")
        assert_close(x, exp_x, name="input (normalised)")


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
def test_layernorm(path, shapes, dtype):
    dev = _device(path)
    for b, h in shapes:
        x = (torch.randn(b, h, device=dev) * 3 + 1).to(dtype)
        g = torch.randn(h, device=dev)
        beta = torch.randn(h, device=dev)
        got = norm.layernorm(x, g, beta, eps=1e-5)
        xd = x.double()
        mean = xd.mean(-1, keepdim=True)
        var = (xd - mean).pow(2).mean(-1, keepdim=True)
        assert_close(got, (xd - mean) / torch.sqrt(var + 1e-5) * g.double() + beta.double(), name="layernorm")


@pytest.mark.gpu
def test_enable_pdl():
    """``enable_pdl=True`` (a programmatic dependent launch on sm_90+) gives the same results."""
    for b, h in ((1, 4096), (37, 576)):
        x = torch.randn(b, h, device="cuda").to(torch.bfloat16)
        r = torch.randn(b, h, device="cuda").to(torch.bfloat16)
        w = torch.randn(h, device="cuda").to(torch.bfloat16)
        out = poison(torch.empty_like(x))
        norm.rmsnorm(x, w, out=out, enable_pdl=True)
        assert_close(out, ref_rms(x, w, 1e-6), name=f"rmsnorm pdl {b}x{h}")
        s = x.double() + r.double()
        norm.fused_add_rmsnorm(x, r, w, enable_pdl=True)
        assert_close(r, s, name="residual pdl")
        assert_close(x, ref_rms(s, w, 1e-6), name="fused_add_rmsnorm pdl")


def test_bound_forms_cache(monkeypatch, request):
    """The launch cache of the row kernels: the first call of a form launches through ``FastKernel.run`` and binds,
    later calls pass the leading tensors' addresses to the bound launch; another form, an address off a 16-byte
    boundary, or a form that cannot be bound take ``FastKernel.run``."""
    from flashinfer_triton.kernels import _row_forms as rows

    calls = []

    class Fast:
        def run(self, *args, grid, warmup, **opts):
            calls.append(("run", grid, args[1]))
            return "compiled"

    class Bound:
        def over(self, rows, *ptrs):
            calls.append(("bound", rows, ptrs))
            return True

    binds = []

    def fake_bind(fast, kernel, args, grid, n_lead):
        binds.append((kernel, grid, n_lead))
        return Bound() if args[1] != "unbindable" else None

    monkeypatch.setattr(rows, "bind", fake_bind)
    monkeypatch.setattr(rows, "hooks_set", lambda: False)
    # the short launch path on, whatever the environment says (the interpreter's default is off)
    use_config(request, host_path=dataclasses.replace(_config.HOST_PATH, fast_launch=True))
    forms = rows.BoundForms(Fast(), 1)
    a, b = torch.randn(64), torch.randn(64)
    forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
    assert calls == [("run", (3,), 7)] and binds == [("compiled", (3,), 1)]
    forms.launch(("form", 1), (b, 7), (3,), num_warps=1)
    assert calls[-1] == ("bound", 3, (b.data_ptr(),)) and len(binds) == 1
    # the rows are no part of a form: its bound launch takes each call's own
    forms.launch(("form", 1), (b, 7), (5,), num_warps=1)
    assert calls[-1] == ("bound", 5, (b.data_ptr(),)) and len(binds) == 1
    forms.launch(("form", 2), (b, 8), (3,), num_warps=1)
    assert calls[-1] == ("run", (3,), 8) and len(binds) == 2
    off = torch.randn(65)[1:]  # 4 bytes past a 16-byte boundary
    forms.launch(("form", 1), (off, 7), (3,), num_warps=1)
    assert calls[-1] == ("run", (3,), 7) and len(binds) == 2
    forms.launch(("form", 3), (a, "unbindable"), (3,), num_warps=1)
    forms.launch(("form", 3), (a, "unbindable"), (3,), num_warps=1)
    assert calls[-2:] == [("run", (3,), "unbindable")] * 2 and len(binds) == 3
    # a Tensor subclass (a model's nn.Parameter weight) passes its address like a plain tensor
    w = torch.nn.Parameter(torch.randn(64, dtype=torch.float16), requires_grad=False)
    forms.launch(("form", 1), (w, 7), (3,), num_warps=1)
    assert calls[-1] == ("bound", 3, (w.data_ptr(),))


@pytest.mark.gpu
def test_norm_forms_across_token_counts():
    """An engine's calls at changing token counts, one token first: each call of a kept call form (``_row_forms``,
    bound launches) matches the reference; 3-D views of a qkv row (a q/k norm) included."""
    w = torch.randn(576, device="cuda").to(torch.bfloat16)
    wd = torch.randn(64, device="cuda").to(torch.bfloat16)
    for t in (1, 37, 1, 256, 5):
        x = torch.randn(t, 576, device="cuda").to(torch.bfloat16)
        r = torch.randn(t, 576, device="cuda").to(torch.bfloat16)
        assert_close(norm.rmsnorm(x, w, 1e-6), ref_rms(x, w, 1e-6), name=f"rmsnorm t={t}")
        x32 = x.double() + r.double()
        norm.fused_add_rmsnorm(x, r, w, 1e-6)
        assert_close(r, x32, name=f"fused_add residual t={t}")
        assert_close(x, ref_rms(x32, w, 1e-6), name=f"fused_add t={t}")
        qkv = torch.randn(t, 15 * 64, device="cuda").to(torch.bfloat16)
        q = qkv[:, : 9 * 64].unflatten(1, (9, 64))
        assert_close(norm.rmsnorm(q, wd, 1e-6), ref_rms(q, wd, 1e-6), name=f"rmsnorm 3-D t={t}")


def test_errors():
    x = torch.randn(4, 64)
    w = torch.randn(64)
    with pytest.raises(ValueError, match="weight"):
        norm.rmsnorm(x, torch.randn(32))
    with pytest.raises(TypeError, match="input"):
        norm.rmsnorm(x.int(), w)
    with pytest.raises(ValueError, match="input"):
        norm.rmsnorm(torch.randn(64), w)
    with pytest.raises(ValueError, match="out"):
        norm.rmsnorm(x, w, out=torch.empty(4, 32))
    with pytest.raises(TypeError, match="out"):
        norm.rmsnorm(x, w, out=torch.empty(4, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="residual"):
        norm.fused_add_rmsnorm(x, torch.randn(3, 64), w)
    with pytest.raises(ValueError, match="input"):
        norm.rmsnorm(x.t(), torch.randn(4))
    with pytest.raises(ValueError, match="eps"):
        norm.rmsnorm(x, w, eps=-1.0)
    for eps in (float("inf"), float("nan")):  # (the message promises a finite value)
        with pytest.raises(ValueError, match="eps: expected a finite value >= 0"):
            norm.rmsnorm(x, w, eps=eps)
    with pytest.raises(TypeError, match="enable_pdl"):
        norm.rmsnorm(x, w, enable_pdl="yes")
    with pytest.raises(ValueError, match="beta"):
        norm.layernorm(x, w, torch.randn(63))
    # A failed call writes nothing.
    r = torch.randn(4, 64)
    before = (x.clone(), r.clone())
    with pytest.raises(ValueError):
        norm.fused_add_rmsnorm(x, r, torch.randn(65))
    assert torch.equal(x, before[0]) and torch.equal(r, before[1])


def test_bound_forms_follow_the_host_path_switch(monkeypatch):
    """With the short launch path switched off (``HostPathConfig.fast_launch=False``, the way tests and benchmarks
    compare the two paths), a form bound before takes ``FastKernel.run`` instead of its bound launch, and a form
    first seen while it is off is bound once it is on again."""
    from flashinfer_triton.kernels import _row_forms as rows

    calls = []

    class Fast:
        def run(self, *args, grid, warmup, **opts):
            calls.append("run")
            return "compiled"

    class Bound:
        def over(self, rows, *ptrs):
            calls.append("bound")
            return True

    def fake_bind(fast, kernel, args, grid, n_lead):
        return Bound() if _config.HOST_PATH.fast_launch else None  # (the real bind is off with the short path)

    monkeypatch.setattr(rows, "bind", fake_bind)
    monkeypatch.setattr(rows, "hooks_set", lambda: False)
    forms = rows.BoundForms(Fast(), 1)
    a = torch.randn(64)
    on = dataclasses.replace(_config.HOST_PATH, fast_launch=True)
    off = dataclasses.replace(on, fast_launch=False)
    with _config.using(host_path=on):
        forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
        forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
        assert calls == ["run", "bound"]
    with _config.using(host_path=off):
        forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
        assert calls[-1] == "run"
        forms.launch(("form", 2), (a, 8), (3,), num_warps=1)
    with _config.using(host_path=on):
        forms.launch(("form", 2), (a, 8), (3,), num_warps=1)
        forms.launch(("form", 2), (a, 8), (3,), num_warps=1)
        assert calls[-1] == "bound"


def test_compiled_calls_check_and_pass_what_eager_does(monkeypatch):
    """Inside compiled code (the custom ops) ``out`` and ``enable_pdl`` are refused as eagerly (Dynamo reports the
    error it traced), and ``enable_pdl`` reaches the launch instead of being dropped for the configuration's default."""
    x, w = torch.randn(4, 64), torch.randn(64)
    torch._dynamo.reset()
    f = torch.compile(lambda x, w, o: norm.rmsnorm(x, w, out=o), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="out: expected dtype float32"):
        f(x, w, torch.empty(4, 64, dtype=torch.float16))
    for call in (
        lambda x, w: norm.rmsnorm(x, w, enable_pdl="yes"),
        lambda x, w: norm.fused_add_rmsnorm(x, x.clone(), w, enable_pdl="yes"),
    ):
        torch._dynamo.reset()
        with pytest.raises(Exception, match="enable_pdl: expected None or a bool"):
            torch.compile(call, backend="eager", fullgraph=True)(x, w)
    seen = []
    check = norm._check_pdl
    monkeypatch.setattr(norm, "_check_pdl", lambda v: seen.append(v) or check(v))
    torch._dynamo.reset()
    out = poison(torch.empty_like(x))
    torch.compile(lambda x, w, o: norm.rmsnorm(x, w, out=o, enable_pdl=False), backend="eager", fullgraph=True)(
        x, w, out
    )
    assert_close(out, ref_rms(x, w, 1e-6), name="compiled rmsnorm")
    torch._dynamo.reset()
    r = torch.randn(4, 64)
    torch.compile(lambda x, r, w: norm.fused_add_rmsnorm(x, r, w, enable_pdl=False), backend="eager", fullgraph=True)(
        x.clone(), r, w
    )
    assert seen and all(v is False for v in seen), seen


def test_bound_forms_bind_after_launch_hooks_go(monkeypatch, request):
    """A form first launched while a launch hook is set (a profiler: Triton's launcher, nothing bound) is bound by
    a later call without hooks, instead of being marked unbindable for good."""
    from flashinfer_triton.kernels import _row_forms as rows

    calls = []

    class Fast:
        def run(self, *args, grid, warmup, **opts):
            calls.append("run")
            return "compiled"

    hooks = [True]

    class Bound:
        def over(self, rows, *ptrs):
            calls.append("bound")
            return True

    monkeypatch.setattr(rows, "bind", lambda *a: None if hooks[0] else Bound())
    monkeypatch.setattr(rows, "hooks_set", lambda: hooks[0])
    use_config(request, host_path=dataclasses.replace(_config.HOST_PATH, fast_launch=True))
    forms = rows.BoundForms(Fast(), 1)
    a = torch.randn(64)
    forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
    hooks[0] = False
    forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
    forms.launch(("form", 1), (a, 7), (3,), num_warps=1)
    assert calls == ["run", "run", "bound"]


@pytest.mark.gpu
def test_compiled_enable_pdl_reaches_the_launch(monkeypatch):
    """Inside compiled code ``enable_pdl`` decides the launch as in eager calls: False launches plainly, None takes
    ``NormConfig.pdl`` (a programmatic dependent launch on sm_90+)."""
    from flashinfer_triton import clear_host_caches
    from flashinfer_triton._config import capability

    seen = []
    launch = norm.launch_norm

    def recorded(*args, pdl=False, **kw):
        seen.append(pdl)
        return launch(*args, pdl=pdl, **kw)

    monkeypatch.setattr(norm, "launch_norm", recorded)
    clear_host_caches("row_forms")  # (a form bound by an earlier test would launch without launch_norm)
    x = torch.randn(4, 576, device="cuda").to(torch.bfloat16)
    w = torch.randn(576, device="cuda").to(torch.bfloat16)
    for enable_pdl in (False, None):
        torch._dynamo.reset()
        got = torch.compile(lambda x, w, e=enable_pdl: norm.rmsnorm(x, w, enable_pdl=e), backend="eager")(x, w)
        assert_close(got, ref_rms(x, w, 1e-6), name=f"compiled rmsnorm enable_pdl={enable_pdl}")
    assert seen == [False, capability(x.device)[0] >= 9 and _config.NORM.pdl]
