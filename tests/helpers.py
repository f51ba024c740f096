"""Test data built independently of the library. Paged caches come from ``flashinfer_triton.testing``, the builders
the benchmarks use too."""

from __future__ import annotations

import contextlib

import torch

from flashinfer_triton import _config
from flashinfer_triton.testing import block_table, make_paged, nan_unused_slots, page_table, paged_caches

__all__ = [
    "FP8",
    "LaunchRecorder",
    "block_table",
    "case_id",
    "expected_decode",
    "fresh_lasting_tensors",
    "plan_as_on_h100",
    "i32",
    "make_paged",
    "nan_unused_slots",
    "page_table",
    "paged_caches",
    "rand_kv",
    "record_epilogues",
    "use_config",
]

FP8 = getattr(torch, "float8_e4m3fn", None)


def i32(*values, device="cpu") -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=device)


def rand_kv(n, heads, dim, dtype, device):
    """Random K/V values; fp8 ones are drawn in float32 then cast."""
    x = torch.randn(n, heads, dim, device=device)
    return x.to(dtype)


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


def fresh_lasting_tensors(monkeypatch) -> None:
    """The library's process-lasting tensors (the error records with their reads in flight, the stand-in pointers,
    the bytes the output templates view) start empty for the rest of the test, as in a fresh process; the earlier
    ones come back at its teardown. White-box: it swaps the registries of ``_errors``, ``_launch`` and ``_wrapper``
    (nothing public starts a process afresh)."""
    from flashinfer_triton import _errors, _launch, _wrapper

    monkeypatch.setattr(_errors, "_FLAGS", {})
    monkeypatch.setattr(_errors, "_DIRTY", set())  # (devices of earlier tests' records: not in this _FLAGS)
    monkeypatch.setattr(_errors, "_READS", {})
    monkeypatch.setattr(_launch, "_STAND_INS", {})
    monkeypatch.setattr(_wrapper, "_TEMPLATE_BASES", {})  # (the 16 bytes the output templates view, per device)


def plan_as_on_h100(monkeypatch, *impls) -> None:
    """Host-side choices as on an H100 running compiled Triton, from any machine, for the rest of the test: the
    interpreter flag off, the Gluon kernels' device check passing for CUDA devices, 132 SMs for each implementation
    module in ``impls``. White-box (a device state simulated): for tests of plans and launch settings; nothing may
    launch."""
    from flashinfer_triton import _backend, _sm90

    monkeypatch.setattr(_backend, "_INTERPRET", False)
    monkeypatch.setattr(_sm90, "gluon_device_ok", lambda device: device.type == "cuda")
    for impl in impls:
        monkeypatch.setattr(impl, "_num_sms", lambda device: 132)


def record_epilogues(monkeypatch, launch=True):
    """Records each launch of the Gluon prefill kernels as (kernel, staged): ``"one-shot"`` or ``"persistent"``, and
    the ``EPI_SMEM`` constexpr it was launched with (its default where not passed), i.e. whether that launch runs
    the epilogue through shared memory. White-box: the kernels ``_run_gluon`` launches (``_GLUON_KERNEL``,
    ``_GLUON_PERSIST``) replaced by recorders for the rest of the test; ``launch=False``: nothing launches (the
    launch arguments on any machine)."""
    from flashinfer_triton import _prefill_impl as impl
    from flashinfer_triton._launch import FastKernel
    from flashinfer_triton.kernels.prefill_sm90 import _prefill_gluon_kernel
    from flashinfer_triton.kernels.prefill_sm90_persist import _prefill_gluon_persist_kernel

    seen = []

    class Recorder:
        def __init__(self, fast, kind, fn):
            self.fast, self.kind = fast, kind
            self.i = fn.arg_names.index("EPI_SMEM")
            self.default = fn.params[self.i].default

        def __getattr__(self, name):  # (_launch.bind's reads: the real kernel's)
            return getattr(self.fast, name)

        def run(self, *args, **kw):
            seen.append((self.kind, bool(args[self.i] if len(args) > self.i else self.default)))
            return self.fast.run(*args, **kw) if launch else None

    for attr, kind, fn in (
        ("_GLUON_KERNEL", "one-shot", _prefill_gluon_kernel),
        ("_GLUON_PERSIST", "persistent", _prefill_gluon_persist_kernel),
    ):
        kernels = getattr(impl, attr)
        monkeypatch.setattr(impl, attr, [Recorder(kernels[0] if kernels else FastKernel(fn), kind, fn)])
    return seen


def use_config(request, **families) -> None:
    """``_config.using(**families)`` for the rest of the test: undone at its teardown (``request``: the test's
    pytest ``request`` fixture). For tests that switch a family's configuration part-way or from a helper."""
    stack = contextlib.ExitStack()
    request.addfinalizer(stack.close)
    stack.enter_context(_config.using(**families))
