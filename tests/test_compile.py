"""torch.compile over the library's entry points: the custom ops are what Dynamo sees, plan() stays outside.

A Llama-shaped block (RMSNorm, q/k/v projections, rope, paged KV append, our attention, MLP) compiles with
``fullgraph=True`` and no graph break, and computes what eager mode computes, through a prefill step and a
decode step, and after re-planning (no new trace). CPU runs use the PyTorch path and ``aot_eager`` (the fake
implementations, functionalization of the in-place ops); the GPU test uses Inductor with CUDA graphs.
"""

from __future__ import annotations

import sys
import types

import pytest
import torch
import torch._dynamo.testing
import torch.nn.functional as F

import flashinfer_triton as fi
from conftest import assert_close, poison
from flashinfer_triton import _errors, reference
from helpers import block_table, fresh_lasting_tensors, i32, make_paged

HQ, HKV, D, HIDDEN, PAGE = 4, 2, 16, 64, 4


def _rope(x, pos, theta=1e4):
    half = x.shape[-1] // 2
    freq = theta ** (-torch.arange(half, dtype=torch.float32, device=x.device) / half)
    ang = pos.to(torch.float32)[:, None] * freq[None, :]
    cos, sin = ang.cos()[:, None, :], ang.sin()[:, None, :]
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).to(x.dtype)


class Block(torch.nn.Module):
    def __init__(self, dtype, device):
        super().__init__()
        kw = dict(bias=False, dtype=dtype, device=device)
        self.qkv = torch.nn.Linear(HIDDEN, (HQ + 2 * HKV) * D, **kw)
        self.o = torch.nn.Linear(HQ * D, HIDDEN, **kw)
        self.gate_up = torch.nn.Linear(HIDDEN, 4 * HIDDEN, **kw)
        self.down = torch.nn.Linear(2 * HIDDEN, HIDDEN, **kw)
        self.n1 = torch.nn.Parameter(torch.rand(HIDDEN, dtype=dtype, device=device) + 0.5)
        self.n2 = torch.nn.Parameter(torch.rand(HIDDEN, dtype=dtype, device=device) + 0.5)
        self.requires_grad_(False)  # inference: the KV append writes the cache in place

    def forward(self, x, pos, cache, table, attn):
        """``table``: (batch_indices, positions, kv_indices, kv_indptr, last_page_len) of the new tokens."""
        t = x.shape[0]
        q, k, v = self.qkv(fi.rmsnorm(x, self.n1)).split([HQ * D, HKV * D, HKV * D], -1)
        q, k = fi.apply_rope_pos_ids(q.view(t, HQ, D), k.view(t, HKV, D), pos)
        bi, positions, kv_indices, kv_indptr, last = table
        fi.append_paged_kv_cache(k, v.reshape(t, HKV, D), bi, positions, cache, kv_indices, kv_indptr, last)
        h, residual = self.o(attn.run(q, cache).reshape(t, HQ * D)), x.clone()
        fi.fused_add_rmsnorm(h, residual, self.n2)  # residual += h; h = rmsnorm(residual)
        return residual + self.down(fi.silu_and_mul(self.gate_up(h)))


class TorchBlock(Block):
    """The same block in plain PyTorch ops (a reference for the library's norm, rope and activation)."""

    def forward(self, x, pos, cache, table, attn):
        t = x.shape[0]
        q, k, v = self.qkv(_norm(x, self.n1)).split([HQ * D, HKV * D, HKV * D], -1)
        q, k = _rope(q.view(t, HQ, D), pos), _rope(k.view(t, HKV, D), pos)
        bi, positions, kv_indices, kv_indptr, last = table
        fi.append_paged_kv_cache(k, v.reshape(t, HKV, D), bi, positions, cache, kv_indices, kv_indptr, last)
        x = x + self.o(attn.run(q, cache).reshape(t, HQ * D))
        g, u = self.gate_up(_norm(x, self.n2)).chunk(2, -1)
        return x + self.down(F.silu(g) * u)


def _norm(x, w):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * w


_MAX_PAGES = 5
# Row b: the pages request b grows into (a fixed shuffle of the 16-page cache, so earlier tokens stay put).
_BLOCKS, _ = block_table([_MAX_PAGES * PAGE] * 3, PAGE, spare_blocks=1, seed=3)


def _step(lens_before, new, device):
    """Page table after appending ``new[b]`` tokens to each request, and the append's index tensors."""
    lens = [a + n for a, n in zip(lens_before, new)]
    pages = [-(-n // PAGE) for n in lens]
    indptr = [0]
    for p in pages:
        indptr.append(indptr[-1] + p)
    indices = torch.cat([_BLOCKS[b, :p] for b, p in enumerate(pages)])
    last = [n - (p - 1) * PAGE for n, p in zip(lens, pages)]
    bi = torch.cat([torch.full((n,), b, dtype=torch.int32) for b, n in enumerate(new)])
    pos = torch.cat([torch.arange(a, a + n, dtype=torch.int32) for a, n in zip(lens_before, new)])
    qo = [0]
    for n in new:
        qo.append(qo[-1] + n)
    t = dict(qo=i32(*qo), indptr=i32(*indptr), indices=indices, last=i32(*last), bi=bi, pos=pos)
    return {k: x.to(device) for k, x in t.items()}, lens


def _plan_prefill(w, t, dtype):
    w.plan(t["qo"], t["indptr"], t["indices"], t["last"], HQ, HKV, D, PAGE, causal=True, q_data_type=dtype)


def _plan_decode(w, t, dtype):
    w.plan(t["indptr"], t["indices"], t["last"], HQ, HKV, D, PAGE, q_data_type=dtype)


def _table(t):
    return (t["bi"], t["pos"], t["indices"], t["indptr"], t["last"])


def _run_block_steps(block, fn, device, dtype, after_step=None):
    """Prefill then four decode steps (re-planned between them) through ``fn``; returns outputs and the cache."""
    ws = torch.empty(1 << 20, dtype=torch.uint8, device=device)
    prefill = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    decode = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    gen = torch.Generator(device="cpu").manual_seed(1)
    cache = torch.randn(16, 2, PAGE, HKV, D, generator=gen).to(device, dtype)
    outs, lens = [], [0, 0, 0]
    for new in ([5, 9, 3], [1, 1, 1], [1, 1, 1], [1, 1, 1], [1, 1, 1]):
        t, lens_after = _step(lens, new, device)
        x = torch.randn(sum(new), HIDDEN, generator=gen).to(device, dtype)
        if new[0] > 1:
            _plan_prefill(prefill, t, dtype)
            w = prefill
        else:
            _plan_decode(decode, t, dtype)
            w = decode
        outs.append(fn(x, t["pos"], cache, _table(t), w))
        lens = lens_after
        if after_step is not None:
            after_step()
    return outs, cache


def test_block_compiles_without_graph_breaks_and_matches_eager():
    dtype, device = torch.float32, torch.device("cpu")
    block = Block(dtype, device)
    eager_out, eager_cache = _run_block_steps(block, block, device, dtype)
    torch_block = TorchBlock(dtype, device)
    torch_block.load_state_dict(block.state_dict())
    torch_out, torch_cache = _run_block_steps(torch_block, torch_block, device, dtype)
    for a, e in zip(eager_out, torch_out):  # the library's ops against plain PyTorch
        assert_close(a, e, atol=1e-4, rtol=1e-4)

    counter = torch._dynamo.testing.CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    compiled = torch.compile(block, backend=counter, fullgraph=True)
    frames = []
    comp_out, comp_cache = _run_block_steps(block, compiled, device, dtype, lambda: frames.append(counter.frame_count))
    for a, e in zip(comp_out, eager_out):
        assert_close(a, e, atol=1e-5, rtol=1e-5)
    assert_close(comp_cache, eager_cache, atol=1e-5, rtol=1e-5, name="cache")
    # traces come from new shapes only (until Dynamo marks them dynamic); the last decode steps, re-planned with
    # other lengths and page counts, run the same graph
    assert frames[-1] == frames[-3], frames

    # the attention inside the block against the float32 reference: the decode step's last layer output is
    # not enough on its own (an unwritten or stale output would pass the eager comparison too), so check the
    # cached keys the compiled appends wrote
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    t, _ = _step([0, 0, 0], [5, 9, 3], device)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(ws)
    _plan_prefill(w, t, dtype)
    explain = torch._dynamo.explain(block)(torch.randn(17, HIDDEN), t["pos"], comp_cache.clone(), _table(t), w)
    assert explain.graph_break_count == 0, explain.break_reasons
    assert explain.graph_count == 1


def _cache_and_plan_inputs(device, dtype):
    cache, indptr, indices, last, ks, vs = make_paged([7, 12], PAGE, HKV, D, dtype, device)
    return cache, indptr, indices, last, ks, vs


def test_compiled_attention_entry_points_match_reference():
    """Ragged prefill, paged decode (with lse), cascade and the three merges, each inside one compiled graph."""
    device, dtype = torch.device("cpu"), torch.float32
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    cache, indptr, indices, last, ks, vs = _cache_and_plan_inputs(device, dtype)
    q_dec = torch.randn(2, HQ, D)
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    dec.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)

    kr, vr = torch.randn(19, HKV, D), torch.randn(19, HKV, D)
    q_pre = torch.randn(9, HQ, D)
    rag = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
    rag.plan(i32(0, 4, 9), i32(0, 7, 19), HQ, HKV, D, causal=True, q_data_type=dtype)

    # cascade: request 0's first page as a prefix shared by both requests, then each one's own pages
    casc = fi.MultiLevelCascadeAttentionWrapper(2, ws)
    casc.plan(
        [i32(0, 2), i32(0, 1, 2)],
        [i32(0, 1), i32(0, 1, 4)],
        [indices[:1], indices[1:5]],
        [i32(PAGE), i32(int(last[0]), int(last[1]))],
        HQ, HKV, D, PAGE, q_data_type=dtype,
    )  # fmt: skip
    casc_k = [ks[0], torch.cat([ks[0][:PAGE], ks[1]])]
    casc_v = [vs[0], torch.cat([vs[0][:PAGE], vs[1]])]

    def f(q_dec, q_pre, cache, kr, vr):
        o_dec, s_dec = dec.run(q_dec, cache, return_lse=True)
        o_pre = rag.run(q_pre, kr, vr)
        o_casc = casc.run(q_dec, cache)
        vm, sm = fi.merge_state(o_dec, s_dec, o_casc, s_dec - 1.0)
        v_all, s_all = fi.merge_states(torch.stack([o_dec, o_casc], 1), torch.stack([s_dec, s_dec + 0.5], 1))
        acc_v, acc_s = o_dec.clone(), s_dec.clone()
        fi.merge_state_in_place(acc_v, acc_s, o_casc, s_dec + 2.0)
        return o_dec, s_dec, o_pre, o_casc, vm, sm, v_all, s_all, acc_v, acc_s

    explain = torch._dynamo.explain(f)(q_dec, q_pre, cache, kr, vr)
    assert explain.graph_break_count == 0, explain.break_reasons
    compiled = torch.compile(f, backend="aot_eager", fullgraph=True)
    got = compiled(q_dec, q_pre, cache, kr, vr)
    want = f(q_dec, q_pre, cache, kr, vr)
    for a, e in zip(got, want):
        assert_close(a, e, atol=1e-5, rtol=1e-5)

    # and the eager values themselves against the reference
    sm_scale = D**-0.5
    for b in range(2):
        o, s = reference.attention(q_dec[b : b + 1], ks[b], vs[b], sm_scale=sm_scale)
        assert_close(got[0][b : b + 1], o, name="decode o")
        assert_close(got[1][b : b + 1], s, name="decode lse")
        o, _ = reference.attention(q_dec[b : b + 1], casc_k[b], casc_v[b], sm_scale=sm_scale)
        assert_close(got[3][b : b + 1], o, name="cascade o")
    for qs, qe, ks_, ke in ((0, 4, 0, 7), (4, 9, 7, 19)):
        o, _ = reference.attention(q_pre[qs:qe], kr[ks_:ke], vr[ks_:ke], causal=True, sm_scale=sm_scale)
        assert_close(got[2][qs:qe], o, name="ragged prefill o")


def test_compiled_run_writes_callers_out_and_lse():
    device, dtype = torch.device("cpu"), torch.float32
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    cache, indptr, indices, last, ks, vs = _cache_and_plan_inputs(device, dtype)
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    dec.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=dtype)
    q = torch.randn(2, HQ, D)
    out, lse = poison(torch.empty(2, HQ, D)), poison(torch.empty(2, HQ))

    def f(q, cache, out, lse):
        dec.run(q, cache, out=out, lse=lse)
        return out * 1.0

    res = torch.compile(f, backend="aot_eager", fullgraph=True)(q, cache, out, lse)
    want_o, want_s = dec.run(q, cache, return_lse=True)
    assert_close(out, want_o)
    assert_close(lse, want_s, name="lse")
    assert_close(res, want_o)


def test_compiled_code_follows_the_wrapper_it_is_given():
    """One compiled function, two wrappers planned for the requests in opposite orders (same shapes): each call
    runs its own wrapper's plan (Dynamo guards the wrapper, the op calls the one it was given)."""
    ws = torch.empty(1 << 20, dtype=torch.uint8)
    cache, indptr, indices, last, ks, vs = _cache_and_plan_inputs(torch.device("cpu"), torch.float32)
    w_fwd = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    w_fwd.plan(indptr, indices, last, HQ, HKV, D, PAGE, q_data_type=torch.float32)
    n0 = int(indptr[1])
    w_rev = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w_rev.plan(i32(0, int(indptr[2]) - n0, int(indptr[2])), torch.cat([indices[n0:], indices[:n0]]), last.flip(0),
               HQ, HKV, D, PAGE, q_data_type=torch.float32)  # fmt: skip
    compiled = torch.compile(lambda q, cache, w: w.run(q, cache) * 2.0, backend="aot_eager", fullgraph=True)
    q = torch.randn(2, HQ, D)
    got_fwd = compiled(q, cache, w_fwd)
    got_rev = compiled(q, cache, w_rev)
    for row in range(2):
        for got, b in ((got_fwd, row), (got_rev, 1 - row)):
            o, _ = reference.attention(q[row : row + 1], ks[b], vs[b], sm_scale=D**-0.5)
            assert_close(got[row : row + 1], 2.0 * o)


def test_handle_names_a_live_wrapper():
    from flashinfer_triton import _custom_ops

    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    key = _custom_ops.handle(w)
    assert _custom_ops.handle(w) == key
    del w
    with pytest.raises(RuntimeError, match="no longer exists"):
        _custom_ops._wrapper(key)


def test_registry_marks_what_dynamos_decorator_marks():
    """The handle registry is marked for Dynamo by hand (no Dynamo import at the library's import): the mark must
    be exactly what ``torch.compiler.assume_constant_result`` adds to a function, in this torch."""
    from flashinfer_triton import _custom_ops

    def plain():
        return 0

    def marked():
        return 0

    before = dict(vars(marked))
    torch.compiler.assume_constant_result(marked)
    added = {k: v for k, v in vars(marked).items() if before.get(k, object()) is not v}
    assert added == {k: v for k, v in vars(_custom_ops._constant_result(plain)).items()}
    assert vars(_custom_ops._register).items() >= added.items()


def test_import_leaves_dynamo_unimported():
    """Importing the library and installing it as ``flashinfer`` does not import Dynamo or Inductor."""
    import subprocess

    code = (
        "import sys, flashinfer_triton as f; f.as_flashinfer(); import flashinfer; "
        "print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]", r.stdout


@pytest.mark.gpu
def test_block_compiles_under_cuda_graphs(monkeypatch):
    """Inductor with ``mode="reduce-overhead"``: CUDA-graph wrappers, re-planned between replays. The library's
    lasting tensors (the error record the append kernel writes, stand-in pointers) are created inside the compiled
    function's first run here, as in a process whose first call is a compiled one: Inductor refuses a graph pool
    that holds them."""
    fresh_lasting_tensors(monkeypatch)
    import torch._inductor.config as inductor_config

    # a refused pool then names the allocation site of the tensor it holds
    monkeypatch.setattr(inductor_config.triton, "cudagraph_trees_history_recording", True)
    device, dtype = torch.device("cuda"), torch.float16
    block = Block(dtype, device)
    ws = torch.empty(32 << 20, dtype=torch.uint8, device=device)
    bs, max_pages = 3, 16
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(
        ws,
        use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.empty(max_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device=device),
    )
    cache = torch.randn(max_pages, 2, PAGE, HKV, D, dtype=dtype, device=device)
    eager_cache = cache.clone()
    torch._dynamo.mark_static_address(cache)  # written in place by the graph: CUDA graphs need its address fixed
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    compiled = torch.compile(block, mode="reduce-overhead", fullgraph=True)
    lens = [6, 10, 3]
    gen = torch.Generator(device="cpu").manual_seed(2)
    for _ in range(5):  # warm-up, capture, then replays after new plans
        t, lens_after = _step(lens, [1, 1, 1], device)
        x = torch.randn(bs, HIDDEN, generator=gen).to(device, dtype)
        _plan_decode(dec, t, dtype)
        got = compiled(x, t["pos"], cache, _table(t), dec).clone()
        want = block(x, t["pos"], eager_cache, _table(t), dec)
        assert_close(got, want, atol=2e-2, rtol=2e-2)
        assert_close(cache, eager_cache, name="cache")
        lens = lens_after
    skips = dict(torch._dynamo.utils.counters["inductor"])
    assert not any("cudagraph_skips" in key for key in skips), skips  # the steps did run as CUDA graphs


@pytest.mark.gpu
def test_lasting_tensors_stay_outside_a_memory_pool_of_the_calling_thread():
    """CUDA-graph trees route every allocation of the recording thread, on any stream, into the graph's pool
    (``use_mem_pool`` does the same): a lasting tensor must not come from there."""
    device = torch.device("cuda", torch.cuda.current_device())
    pool = torch.cuda.MemPool()
    side = torch.cuda.Stream()
    with torch.cuda.use_mem_pool(pool), torch.cuda.stream(side):
        in_pool = torch.randn(1024, device=device)
        kept = _errors.lasting_zeros(4, torch.int32, device)
    segments = [(s["address"], s["address"] + s["total_size"]) for s in pool.snapshot()]

    def pooled(t):
        return any(lo <= t.data_ptr() < hi for lo, hi in segments)

    assert pooled(in_pool)  # the check sees the pool's allocations
    assert not pooled(kept)
    assert kept.device == device and kept.dtype == torch.int32 and kept.tolist() == [0, 0, 0, 0]
    del in_pool


def _library_modules() -> list[types.ModuleType]:
    return [m for name, m in sys.modules.items() if name.split(".")[0] == "flashinfer_triton" and m is not None]


def _kept_tensors(roots, device: torch.device) -> dict:
    """``id -> tensor`` for every tensor on ``device``'s type reachable from ``roots`` (modules: their globals)
    through dicts, lists, tuples, sets and the library's own objects (attributes and slots)."""
    found, seen, stack = {}, set(), []
    for r in roots:
        stack += list(vars(r).values()) if isinstance(r, types.ModuleType) else [r]
    while stack:
        x = stack.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.device.type == device.type:
                found[id(x)] = x
        elif isinstance(x, dict):
            stack += list(x.keys()) + list(x.values())
        elif isinstance(x, (list, tuple, set, frozenset)):
            stack += list(x)
        elif not isinstance(x, type) and type(x).__module__.split(".")[0] == "flashinfer_triton":
            stack += list(getattr(x, "__dict__", {}).values())
            for cls in type(x).__mro__:
                for name in getattr(cls, "__slots__", ()):
                    if hasattr(x, name):
                        stack.append(getattr(x, name))
    return found


@pytest.mark.interpret
def test_block_steps_keep_no_tensor_they_allocate(monkeypatch, device):
    """What a compiled step runs (the block's ops and a CUDA-graph wrapper's run(), re-planned between steps) keeps
    no tensor it allocates on the wrapper or in the library's module state, except through ``lasting_zeros``:
    under ``mode="reduce-overhead"`` that allocation would come from the graph's pool, which Inductor refuses while
    a tensor outside the outputs holds it. The lasting records start empty here, as in a fresh process."""
    original, made = _errors.lasting_zeros, []

    def recording(n, dtype, dev):
        made.append(original(n, dtype, dev))
        return made[-1]

    for m in _library_modules():
        if getattr(m, "lasting_zeros", None) is original:
            monkeypatch.setattr(m, "lasting_zeros", recording)
    fresh_lasting_tensors(monkeypatch)
    dtype, bs, max_pages = torch.float32, 3, 16
    block = Block(dtype, device)
    dec = fi.BatchDecodeWithPagedKVCacheWrapper(
        torch.empty(1 << 20, dtype=torch.uint8, device=device),
        use_cuda_graph=True,
        paged_kv_indptr_buffer=torch.empty(bs + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.empty(max_pages, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.empty(bs, dtype=torch.int32, device=device),
    )
    cache = torch.randn(max_pages, 2, PAGE, HKV, D, dtype=dtype, device=device)
    ref_cache = cache.clone()
    ref_block = TorchBlock(dtype, device)
    ref_block.load_state_dict(block.state_dict())
    lens = [6, 10, 3]
    for _ in range(2):
        t, lens = _step(lens, [1, 1, 1], device)
        x = torch.randn(bs, HIDDEN, dtype=dtype, device=device)
        _plan_decode(dec, t, dtype)
        before = _kept_tensors([dec, *_library_modules()], device)
        got = block(x, t["pos"], cache, _table(t), dec)
        after = _kept_tensors([dec, *_library_modules()], device)
        # (a view of a lasting tensor allocates nothing: the bound run()'s output templates view 16 lasting bytes)
        lasting = {m.untyped_storage().data_ptr() for m in made}
        new = [v for k, v in after.items() if k not in before and v.untyped_storage().data_ptr() not in lasting]
        assert not new, [(tuple(v.shape), v.dtype) for v in new]
        assert_close(got, ref_block(x, t["pos"], ref_cache, _table(t), dec), atol=1e-3, rtol=1e-3)
    # the guard saw the lazily created record: the first append made it through lasting_zeros
    n_made = len(made)
    record = _errors.error_flag(cache.device)
    assert len(made) == n_made and any(v is record for v in made)


def test_compiled_run_refuses_what_eager_refuses():
    """A parameter run() refuses eagerly is refused inside compiled code too (never silently dropped)."""
    cache, indptr, indices, last, _, _ = make_paged([9, 4], 4, 2, 32, torch.float32, "cpu")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    w.plan(indptr, indices, last, 4, 2, 32, 4, q_data_type=torch.float32)
    q = torch.randn(2, 4, 32)
    for kw, name in ((dict(kv_cache_sf=torch.ones(1)), "kv_cache_sf"), (dict(q_len_per_req=5), "q_len_per_req")):
        torch._dynamo.reset()
        f = torch.compile(lambda q, c, kw=kw: w.run(q, c, **kw), backend="eager", fullgraph=True)
        with pytest.raises(Exception, match=name):
            f(q, cache)
