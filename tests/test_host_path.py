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
    pages = -(-keys // ps)
    indptr = torch.arange(bs + 1, dtype=torch.int32) * pages
    indices = torch.randperm(bs * pages + 3, generator=gen)[: bs * pages].to(torch.int32)
    last = torch.full((bs,), keys - (pages - 1) * ps, dtype=torch.int32)
    cache = torch.randn(bs * pages + 3, 2, ps, hkv, d, generator=gen).half().to(device)
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
