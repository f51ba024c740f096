"""Triton merge kernels (``_merge_impl``) against the reference: merge_state(s), in place, partial merges."""

from __future__ import annotations

import pytest
import torch
from triton.experimental import gluon
from triton.experimental.gluon import language as gl

from conftest import DEVICE, HAS_CUDA, INTERPRET, assert_close_named
from flashinfer_triton import _merge_impl, reference
from flashinfer_triton._backend import use_triton
from flashinfer_triton._config import MergeConfig
from flashinfer_triton.kernels.decode_sm90 import _dec_merge

needs_triton = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")
needs_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
TOL = {torch.float16: 2e-3, torch.bfloat16: 1.6e-2, torch.float32: 1e-5}
DTYPES = [torch.float16, torch.bfloat16, torch.float32]


def states(shape, d, dtype, *, gen, empty_frac=0.25):
    """Random states with some ``-inf`` (empty) entries whose ``v`` is garbage on purpose."""
    v = torch.randn((*shape, d), generator=gen).to(dtype)
    s = torch.randn(shape, generator=gen) * 4
    empty = torch.rand(shape, generator=gen) < empty_frac
    s[empty] = float("-inf")
    v[empty] = 1e4 if dtype != torch.float16 else 6e4
    return v.to(DEVICE), s.to(DEVICE)


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
def test_merge_state(dtype):
    gen = torch.Generator().manual_seed(0)
    v_a, s_a = states((7, 3), 64, dtype, gen=gen)
    v_b, s_b = states((7, 3), 64, dtype, gen=gen)
    s_a[0, 0] = s_b[0, 0] = float("-inf")  # both empty: v = 0, s = -inf
    v, s = _merge_impl.merge_state(v_a, s_a, v_b, s_b)
    v_ref, s_ref = reference.merge_state(v_a.cpu(), s_a.cpu(), v_b.cpu(), s_b.cpu())
    assert v.dtype == dtype and s.dtype == torch.float32
    assert_close_named("v", v, v_ref, TOL[dtype], TOL[dtype])
    assert_close_named("s", s, s_ref, 1e-5)
    assert float(v[0, 0].abs().max()) == 0.0 and s[0, 0].item() == float("-inf")


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("masked", [False, True], ids=["nomask", "mask"])
def test_merge_state_in_place(masked):
    gen = torch.Generator().manual_seed(1)
    v, s = states((9, 2), 48, torch.float16, gen=gen)
    v_o, s_o = states((9, 2), 48, torch.float16, gen=gen)
    mask = (torch.rand(9, generator=gen) < 0.5).to(DEVICE) if masked else None
    v_ref, s_ref = v.clone().cpu(), s.clone().cpu()
    reference.merge_state_in_place(v_ref, s_ref, v_o.cpu(), s_o.cpu(), None if mask is None else mask.cpu())
    _merge_impl.merge_state_in_place(v, s, v_o, s_o, mask)
    assert_close_named("v", v, v_ref, TOL[torch.float16], TOL[torch.float16])
    assert_close_named("s", s, s_ref, 1e-5)


@pytest.mark.interpret
@needs_triton
def test_merge_state_in_place_strided():
    """A non-contiguous v (a slice) is merged in place through a copy and written back."""
    gen = torch.Generator().manual_seed(2)
    big, s = states((5, 4), 64, torch.float32, gen=gen)
    v = big[:, :2]
    s = s[:, :2]
    v_o, s_o = states((5, 2), 64, torch.float32, gen=gen)
    v_ref, s_ref = v.clone().cpu(), s.clone().cpu()
    reference.merge_state_in_place(v_ref, s_ref, v_o.cpu(), s_o.cpu())
    untouched = big[:, 2:].clone()
    _merge_impl.merge_state_in_place(v, s, v_o, s_o)
    assert_close_named("v", v, v_ref, 1e-5, 1e-5)
    assert_close_named("s", s, s_ref, 1e-5)
    assert torch.equal(big[:, 2:], untouched)


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
@pytest.mark.parametrize("k", [0, 1, 5])
@pytest.mark.parametrize("tiling", ["few", "many"])
def test_merge_states(dtype, k, tiling):
    """The online kernel (any state count); "many": its many-rows tiling (heads per tile, one state per step),
    forced on a small input."""
    cfg = MergeConfig(fixed_max_k=0, few_pairs=0 if tiling == "many" else MergeConfig.few_pairs)
    gen = torch.Generator().manual_seed(3)
    v, s = states((4, k, 3), 80, dtype, gen=gen)
    if k:
        s[1, :, 0] = float("-inf")  # a row with every state empty
    vo, so = _merge_impl.merge_states(v, s, config=cfg)
    if k == 0:
        # reference.merge_states indexes state 0 before its K == 0 branch; the rule is v = 0, s = -inf.
        v_ref, s_ref = torch.zeros(4, 3, 80), torch.full((4, 3), float("-inf"))
    else:
        v_ref, s_ref = reference.merge_states(v.cpu(), s.cpu())
    assert vo.shape == (4, 3, 80) and vo.dtype == dtype
    assert_close_named("v", vo, v_ref, TOL[dtype], TOL[dtype])
    assert_close_named("s", so, s_ref, 1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_merge_gpu_large(dtype):
    gen = torch.Generator().manual_seed(5)
    v, s = states((1000, 7, 32), 128, dtype, gen=gen, empty_frac=0.1)
    vo, so = _merge_impl.merge_states(v, s)
    v_ref, s_ref = reference.merge_states(v, s)
    assert_close_named("v", vo, v_ref, TOL[dtype], TOL[dtype])
    assert_close_named("s", so, s_ref, 1e-4)
    v_b, s_b = states((1000, 7, 32), 128, dtype, gen=gen)
    vm, sm = _merge_impl.merge_state(v[:, 0], s[:, 0], v_b[:, 0], s_b[:, 0])
    v_ref, s_ref = reference.merge_state(v[:, 0], s[:, 0], v_b[:, 0], s_b[:, 0])
    assert_close_named("v pair", vm, v_ref, TOL[dtype], TOL[dtype])
    assert_close_named("s pair", sm, s_ref, 1e-4)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("k", [4, 20], ids=["fixed-kernel", "online-kernel"])
def test_merge_states_bound_form_gpu(k):
    """The public merge_states binds the launch of a form after its first checked call; the later calls of that
    form take the bound launch, with new states each time (strided v and s), and agree with the reference."""
    import dataclasses

    import flashinfer_triton as fi
    from flashinfer_triton import _config, _launch

    gen = torch.Generator().manual_seed(8)
    with _config.using(host_path=dataclasses.replace(_config.HOST_PATH, fast_launch=True)):
        for i in range(3):
            # strided views whose addresses stay on 16-byte boundaries (the short path's condition: 4 float32
            # heads past the start of s)
            big_v, big_s = states((9, k, 8), 80, torch.float16, gen=gen)
            v, s = big_v[:, :, 4:], big_s[:, :, 4:]
            vo, so = fi.merge_states(v, s)
            v_ref, s_ref = reference.merge_states(v.cpu(), s.cpu())
            assert_close_named(f"v call {i}", vo, v_ref, TOL[torch.float16], TOL[torch.float16])
            assert_close_named(f"s call {i}", so, s_ref, 1e-4)
        forms = fi.host_caches()["merge_states"]
        if _launch.TRITON_TESTED:
            assert [(f.shapes, f.bound) for f in forms] == [((v.shape, s.shape), True)]


# Configurations of the fixed-K kernel (merge_states): small tiles (256 values per program) so that there are
# several, with and without the streaming hints.
FIXED_CONFIGS = {
    "fixed": MergeConfig(fixed_tile_values=256),
    "fixed-nohint": MergeConfig(fixed_tile_values=256, stream_hints=False),
}


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("variant", list(FIXED_CONFIGS))
@pytest.mark.parametrize("k", [2, 5])
@pytest.mark.parametrize("d", [80, 64], ids=["d80-masked", "d64-even"])
def test_merge_states_fixed(variant, k, d):
    """Several tiles per launch; with D = 64 and 4 heads the tiles fit exactly (the unmasked kernel), with D = 80
    and 3 heads they do not (masked)."""
    gen = torch.Generator().manual_seed(6)
    h = 3 if d == 80 else 4
    v, s = states((3, k, h), d, torch.float16, gen=gen)
    s[1, :, 0] = float("-inf")  # a row with every state empty
    out_v = torch.full((3, h, d), float("nan"), dtype=torch.float16, device=DEVICE)
    out_s = torch.full((3, h), float("nan"), device=DEVICE)
    _merge_impl._launch_fixed(v, s, out_v, out_s, FIXED_CONFIGS[variant])
    v_ref, s_ref = reference.merge_states(v.cpu(), s.cpu())
    assert_close_named("v", out_v, v_ref, TOL[torch.float16], TOL[torch.float16])
    assert_close_named("s", out_s, s_ref, 1e-5)
    assert float(out_v[1, 0].float().abs().max()) == 0.0 and out_s[1, 0].item() == float("-inf")


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("fixed_max_k", [16, 0], ids=["fixed-kernel", "online-kernel"])
def test_merge_states_config_picks_kernel(fixed_max_k, monkeypatch):
    """``MergeConfig.fixed_max_k`` decides which kernel merge_states launches; both agree with the reference (an
    empty row included), and the fixed-count kernel gets the configured tile."""
    from helpers import LaunchRecorder

    rec = LaunchRecorder(_merge_impl._merge_fixed_kernel)
    monkeypatch.setattr(_merge_impl, "_merge_fixed_kernel", rec)
    gen = torch.Generator().manual_seed(9)
    k, h, d = 4, 8, 64
    v, s = states((5, k, h), d, torch.float16, gen=gen)
    s[2, :, 3] = float("-inf")
    cfg = MergeConfig(fixed_max_k=fixed_max_k, fixed_tile_values=1024)
    out_v, out_s = _merge_impl.merge_states(v, s, config=cfg)
    v_ref, s_ref = reference.merge_states(v.cpu(), s.cpu())
    assert_close_named("v", out_v, v_ref, TOL[torch.float16], TOL[torch.float16])
    assert_close_named("s", out_s, s_ref, 1e-5)
    if fixed_max_k:
        assert len(rec.seen) == 1 and rec.seen[0]["BLOCK_H"] == 1024 // (k * d)  # heads per program
    else:
        assert rec.seen == []


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda t: str(t)[6:])
def test_merge_states_fixed_public(dtype):
    """Through ``merge_states`` (K = 16, the largest unrolled count; strided v), default tiles."""
    gen = torch.Generator().manual_seed(7)
    big, s = states((2, 16, 4), 64, dtype, gen=gen)
    v = big[:, :, 1:]
    s = s[:, :, 1:]
    vo, so = _merge_impl.merge_states(v, s)
    v_ref, s_ref = reference.merge_states(v.cpu(), s.cpu())
    assert vo.dtype == dtype
    assert_close_named("v", vo, v_ref, TOL[dtype], TOL[dtype])
    assert_close_named("s", so, s_ref, 1e-5)


@pytest.mark.interpret
@needs_triton
def test_merge_pair_kernel():
    """The two-state kernel with an empty pair, then in place under a row mask."""
    gen = torch.Generator().manual_seed(8)
    v_a, s_a = states((6, 2), 64, torch.bfloat16, gen=gen)
    v_b, s_b = states((6, 2), 64, torch.bfloat16, gen=gen)
    s_a[0, 0] = s_b[0, 0] = float("-inf")
    out_v = torch.full((12, 64), float("nan"), dtype=torch.bfloat16, device=DEVICE)
    out_s = torch.full((12,), float("nan"), device=DEVICE)
    _merge_impl._launch_pair(
        v_a.reshape(12, 64),
        64,
        s_a.reshape(12),
        v_b.reshape(12, 64),
        64,
        s_b.reshape(12),
        out_v,
        64,
        out_s,
        12,
        64,
        None,
        1,
    )
    v_ref, s_ref = reference.merge_state(v_a.cpu(), s_a.cpu(), v_b.cpu(), s_b.cpu())
    assert_close_named("v", out_v.view(6, 2, 64), v_ref, TOL[torch.bfloat16], TOL[torch.bfloat16])
    assert_close_named("s", out_s.view(6, 2), s_ref, 1e-5)
    assert float(out_v[0].float().abs().max()) == 0.0 and out_s[0].item() == float("-inf")
    v, s = states((5, 2), 64, torch.float16, gen=gen)
    v_o, s_o = states((5, 2), 64, torch.float16, gen=gen)
    mask = torch.tensor([True, False, True, True, False], device=DEVICE)
    v_ref, s_ref = v.clone().cpu(), s.clone().cpu()
    reference.merge_state_in_place(v_ref, s_ref, v_o.cpu(), s_o.cpu(), mask.cpu())
    _merge_impl.merge_state_in_place(v, s, v_o, s_o, mask)
    assert_close_named("v in place", v, v_ref, TOL[torch.float16], TOL[torch.float16])
    assert_close_named("s in place", s, s_ref, 1e-5)


@gluon.jit
def _gluon_merge_only(po, pl, o, lse, first, count, req, kvh, sob, soh, slb, slh, K: gl.constexpr):
    _dec_merge(po, pl, o, lse, first, count, req, kvh, sob, soh, slb, slh, 32, 4, 4, 128, K, True)


@pytest.mark.skipif(INTERPRET, reason="the interpreter replaces @triton.jit functions: nothing to compile")
def test_fused_merge_compiles_in_gluon():
    """The fused decode merge (``merge.merge_head_rows``, a ``@triton.jit`` function) is the Gluon decode kernel's
    merge too: compiled for sm_90 on the host (no GPU needed), with every state's loads through L2 (``.cg``)."""
    import triton
    from triton.backends.compiler import GPUTarget

    sig = {"po": "*fp32", "pl": "*fp32", "o": "*fp16", "lse": "*fp32", "K": "constexpr"}
    sig.update({n: "i32" for n in ("first", "count", "req", "kvh", "sob", "soh", "slb", "slh")})
    src = gluon._runtime.GluonASTSource(_gluon_merge_only, signature=sig, constexprs={"K": 4})
    ptx = triton.compile(src, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    # per step of K states: K lse loads for the maximum, then K lse and K value loads (4 values per thread)
    assert ptx.count("ld.global.cg") >= 3 * 4, ptx.count("ld.global.cg")
