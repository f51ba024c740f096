"""flashinfer_triton.distributed against the single-process reference, on real process groups.

CPU: gloo, processes started with torch.multiprocessing (one spawn of 2 processes on the default group, one
of 8 processes whose sub-groups of 3 and 4 ranks run side by side, then all 8 together). Every case runs
on every rank of its group; after each case the ranks all-gather whether it passed, so a failure on one
rank stops them all instead of leaving the others in a collective.

GPU: NCCL, one process per GPU (2, 4 and 8 ranks, as many as are visible), spawned by pytest, or
``torchrun --nproc_per_node N tests/test_distributed.py`` for the same cases on torchrun's group.
"""

from __future__ import annotations

import datetime
import math
import os
import sys

import pytest
import torch

from conftest import LSE_TOL, assert_close, poison
from flashinfer_triton import distributed as cp
from flashinfer_triton import reference
from helpers import make_paged, page_table

HQ, HKV, D = 4, 2, 16
WS_BYTES = 8 << 20


# ----------------------------------------------------------------------------- cases (run on every rank)
def _ws(device):
    return torch.empty(WS_BYTES, dtype=torch.uint8, device=device)


def _local_cache(cache, shard, kv_layout):
    """This rank's own cache: only its pages (the shard was made with compact=True)."""
    return cache[shard.global_indices.long().to(cache.device)].contiguous()


def _check_lse(lse, expected_base2, lse_base, name="lse"):
    factor = math.log(2.0) if lse_base == "e" else 1.0
    assert_close(lse, expected_base2 * factor, *LSE_TOL, name=name)


def decode_case(group, device, *, lens, layout, combine, gather=True, lse_base=2, ps=4, kv_layout="NHD", hq=HQ,
                dtype=torch.float16, graph=False):  # fmt: skip
    """Decode with each request's pages sharded over the group, against the reference on the whole cache."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(len(lens) * 131 + sum(lens))
    cache, indptr, indices, last, _, _ = make_paged(lens, ps, HKV, D, dtype, device, layout=kv_layout)
    q = torch.randn(len(lens), hq, D, device=device).to(dtype)
    shard = cp.shard_page_table(indptr, indices, last, ps, w, r, layout, compact=True)
    local = _local_cache(cache, shard, kv_layout)
    wrapper = cp.ContextParallelDecodeWrapper(
        _ws(device), kv_layout, group, combine=combine, gather_output=gather, lse_base=lse_base
    )
    wrapper.plan(shard.indptr.to(device), shard.indices.to(device), shard.last_page_len.to(device), hq, HKV, D, ps,
                 q_data_type=dtype, seq_lens=shard.seq_lens, shard_layout=layout)  # fmt: skip
    h0, h1 = wrapper.head_range if not gather else (0, hq)
    out = poison(torch.empty(len(lens), h1 - h0, D, dtype=dtype, device=device))
    lse = poison(torch.empty(len(lens), h1 - h0, dtype=torch.float32, device=device))
    o, l_ = wrapper.run(q, local, out=out, lse=lse, return_lse=True)
    assert o.data_ptr() == out.data_ptr() and l_.data_ptr() == lse.data_ptr()
    o_ref, lse_ref = reference.batch_decode_with_paged_kv_cache(
        q.cpu(), cache.cpu(), indptr.cpu(), indices.cpu(), last.cpu(), kv_layout
    )
    assert_close(o, o_ref[:, h0:h1], name=f"o rank {r}")
    _check_lse(l_, lse_ref[:, h0:h1], lse_base, name=f"lse rank {r}")
    if combine != "auto":
        assert wrapper.combine_method == combine


def ring_case(group, device, *, lens, causal, lse_base=2, hq=HQ, dtype=torch.float16):
    """Ring prefill over zig-zag shards, against the reference on the whole sequences."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(7 + sum(lens))
    total = sum(lens)
    q = torch.randn(total, hq, D, device=device).to(dtype)
    k = torch.randn(total, HKV, D, device=device).to(dtype)
    v = torch.randn(total, HKV, D, device=device).to(dtype)
    idx = cp.zigzag_indices(lens, w, r).to(device)
    wrapper = cp.RingPrefillWrapper(_ws(device), group, lse_base=lse_base)
    wrapper.plan(torch.tensor(lens), hq, HKV, D, causal=causal, q_data_type=dtype)
    out = poison(torch.empty(idx.numel(), hq, D, dtype=dtype, device=device))
    lse = poison(torch.empty(idx.numel(), hq, dtype=torch.float32, device=device))
    o, l_ = wrapper.run(q[idx], k[idx], v[idx], out=out, lse=lse, return_lse=True)
    ip = torch.zeros(len(lens) + 1, dtype=torch.int32)
    ip[1:] = torch.cumsum(torch.tensor(lens), 0)
    o_ref, lse_ref = reference.batch_prefill_with_ragged_kv_cache(q.cpu(), k.cpu(), v.cpu(), ip, ip, causal=causal)
    assert_close(o, o_ref[idx.cpu()], name=f"ring o rank {r}")
    _check_lse(l_, lse_ref[idx.cpu()], lse_base, name=f"ring lse rank {r}")


def append_case(group, device, *, lens, qo_lens, layout, causal=True, combine="auto", ps=4, dtype=torch.float16):
    """New queries over a sharded cache that already holds their keys, against the reference."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(11 + sum(lens))
    cache, indptr, indices, last, _, _ = make_paged(lens, ps, HKV, D, dtype, device)
    qo = torch.zeros(len(lens) + 1, dtype=torch.int32)
    qo[1:] = torch.cumsum(torch.tensor(qo_lens), 0)
    q = torch.randn(int(qo[-1]), HQ, D, device=device).to(dtype)
    shard = cp.shard_page_table(indptr, indices, last, ps, w, r, layout, compact=True)
    wrapper = cp.ContextParallelAppendWrapper(_ws(device), "NHD", group, combine=combine, lse_base="e")
    wrapper.plan(qo, shard, HQ, HKV, D, causal=causal, q_data_type=dtype)
    o, l_ = wrapper.run(q, _local_cache(cache, shard, "NHD"), return_lse=True)
    o_ref, lse_ref = reference.batch_prefill_with_paged_kv_cache(
        q.cpu(), qo, cache.cpu(), indptr.cpu(), indices.cpu(), last.cpu(), causal=causal
    )
    assert_close(o, o_ref, name=f"append o rank {r}")
    _check_lse(l_, lse_ref, "e", name=f"append lse rank {r}")


def combine_case(group, device, *, method, gather):
    """combine_states on states over a random split of the keys, against attention over all of them."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(23)
    rows, n = 5, 40
    q = torch.randn(rows, HQ, D, device=device)
    k = torch.randn(n, HKV, D, device=device)
    v = torch.randn(n, HKV, D, device=device)
    owner = torch.randint(0, w + 1, (n,)) % w  # an uneven split: rank 0 gets about twice the others' keys
    mine = (owner == r).nonzero().reshape(-1).to(device)
    o_part, lse_part = reference.attention(q, k[mine], v[mine])
    o, lse = cp.combine_states(o_part.half(), lse_part, group, method=method, gather_output=gather, lse_base="e")
    o_ref, lse_ref = reference.attention(q, k, v)
    hs = -(-HQ // w)
    h0, h1 = (0, HQ) if gather else (min(r * hs, HQ), min(r * hs + hs, HQ))
    assert o.dtype == torch.float16
    assert_close(o, o_ref[:, h0:h1], name=f"combined o rank {r}")
    _check_lse(lse, lse_ref[:, h0:h1], "e", name=f"combined lse rank {r}")


def _expect_error(exc_types, match, fn):
    try:
        fn()
    except exc_types as e:
        assert match in str(e), f"unexpected message: {e}"
        return str(e)
    raise AssertionError(f"expected {exc_types} matching {match!r}")


def errors_case(group, device):
    """Bad input raises on every rank (nothing hangs); the group is usable afterwards."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    lens = [9, 14]
    cache, indptr, indices, last, _, _ = make_paged(lens, 4, HKV, D, torch.float16, device)
    shard = cp.shard_page_table(indptr, indices, last, 4, w, r, "contiguous")
    wrapper = cp.ContextParallelDecodeWrapper(_ws(device), "NHD", group)
    args = (shard.indptr, shard.indices, shard.last_page_len, HQ, HKV, D, 4)
    # options that differ across ranks: found by the plan-time fingerprint exchange
    _expect_error(ValueError, "options differ across ranks: sm_scale", lambda: wrapper.plan(*args, sm_scale=0.1 + r))
    # one rank's share is not the one its layout gives: it names the argument, the others name the rank
    # (rank 0 takes the last rank's share, the smallest: another rank's share may hold as many tokens as its own)
    if r == 0:
        bad = cp.shard_page_table(indptr, indices, last, 4, w, w - 1, "contiguous")
        badargs = (bad.indptr, bad.indices, bad.last_page_len, HQ, HKV, D, 4)
        _expect_error(ValueError, "indptr", lambda: wrapper.plan(*badargs, seq_lens=lens, shard_layout="contiguous"))
    else:
        _expect_error(RuntimeError, "failed on rank(s) [0]",
                      lambda: wrapper.plan(*args, seq_lens=lens, shard_layout="contiguous"))  # fmt: skip
    # shares that do not add up to seq_lens (no layout given: only the group can tell)
    _expect_error(ValueError, "not a split", lambda: wrapper.plan(*args, seq_lens=[lens[0] + 4, lens[1]]))
    # positions are global: in-kernel RoPE is refused on every rank
    _expect_error(ValueError, "pos_encoding_mode", lambda: wrapper.plan(*args, pos_encoding_mode="ROPE_LLAMA"))
    _expect_error(
        RuntimeError, "call plan() first", lambda: cp.RingPrefillWrapper(_ws(device), group).run(None, None, None)
    )
    ring = cp.RingPrefillWrapper(_ws(device), group)
    _expect_error(ValueError, "options differ across ranks: causal", lambda: ring.plan([8], HQ, HKV, D, causal=r == 0))
    ring.plan([8], HQ, HKV, D, causal=True)
    idx = cp.zigzag_indices([8], w, r)
    q_ok = torch.randn(idx.numel(), HQ, D, device=device).half()
    k_bad = torch.randn(idx.numel() + 1, HKV, D, device=device).half()
    _expect_error(ValueError, "k:", lambda: ring.run(q_ok, k_bad, k_bad))
    # dtypes are checked against the plan before the first transfer (a rank raising after it would strand the ring)
    k_ok = torch.randn(idx.numel(), HKV, D, device=device).half()
    _expect_error(TypeError, "q:", lambda: ring.run(q_ok.float(), k_ok, k_ok))
    _expect_error(
        TypeError, "out:", lambda: ring.run(q_ok, k_ok, k_ok, out=torch.empty_like(q_ok, dtype=torch.float32))
    )
    # the group still works: a plan after all these succeeds
    wrapper.plan(*args, seq_lens=lens, shard_layout="contiguous")


def membership_case(group, device):
    """A process outside a group is refused before any collective."""
    import torch.distributed as dist

    sub = dist.new_group(ranks=[0])
    if dist.get_rank() != 0:
        _expect_error(ValueError, "not a member", lambda: cp.ContextParallelDecodeWrapper(_ws(device), "NHD", sub))
        _expect_error(ValueError, "not a member", lambda: cp.RingPrefillWrapper(_ws(device), sub))


def _import_example():
    """examples/long_context_cp.py as a module. Workers running example_case call this before
    init_process_group: the example imports transformers, whose import of torch.distributed.checkpoint while
    a process group exists keeps that group alive after destroy_process_group(); its gloo threads then outlive
    Python's shutdown and can abort the process there."""
    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    import long_context_cp

    return long_context_cp


def example_case(group, device):
    """examples/long_context_cp.py: a small request through the Llama forward pass, ring prefill then sharded
    decode, equal to the one-device run."""
    long_context_cp = _import_example()
    dtype = torch.float32 if device.type == "cpu" else torch.float16
    assert long_context_cp.serve(96, 3, 1, device, dtype)


def _run_cases(group, device, cases):
    """Run ``cases`` on every rank of ``group``; after each, all ranks learn whether any rank failed."""
    import torch.distributed as dist

    for name, fn, kw in cases:
        error = None
        try:
            fn(group, device, **kw)
        except Exception as e:  # reported to the group below, then re-raised
            error = e
        flags = [None] * dist.get_world_size(group)
        dist.all_gather_object(flags, None if error is None else f"{type(error).__name__}: {error}", group=group)
        failed = [i for i, f in enumerate(flags) if f is not None]
        if error is not None:
            raise AssertionError(f"case {name} (rank {dist.get_rank(group)}): {error}") from error
        if failed:
            raise AssertionError(f"case {name} failed on rank(s) {failed} of its group: {flags[failed[0]]}")


def _cpu_cases(world_size):
    """Cases for a group of ``world_size`` ranks (fewer and smaller as it grows)."""
    ragged = [37, 0, 1, 6, 50]
    cases = []
    for layout in cp.SHARD_LAYOUTS:
        cases.append((f"decode-{layout}-ag", decode_case, dict(lens=ragged, layout=layout, combine="allgather")))
        cases.append((
            f"decode-{layout}-rs", decode_case,
            dict(lens=ragged, layout=layout, combine="reduce_scatter", lse_base="e", kv_layout="HND"),
        ))  # fmt: skip
    cases += [
        ("decode-rs-heads", decode_case, dict(lens=ragged, layout="interleaved", combine="reduce_scatter",
                                              gather=False)),
        ("decode-ag-heads-odd", decode_case, dict(lens=[3, 29], layout="contiguous", combine="allgather",
                                                  gather=False, hq=6)),
        ("decode-rs-odd-heads", decode_case, dict(lens=[0, 3, 29], layout="interleaved", combine="reduce_scatter",
                                                  hq=6)),
        ("combine-ag", combine_case, dict(method="allgather", gather=True)),
        ("combine-rs-heads", combine_case, dict(method="reduce_scatter", gather=False)),
        ("ring-causal-ragged", ring_case, dict(lens=[37, 5, 1, 0, 24], causal=True)),
        ("ring-causal-one", ring_case, dict(lens=[61], causal=True, lse_base="e")),
        ("ring-full-ragged", ring_case, dict(lens=[19, 3, 0], causal=False)),
        ("ring-full-one", ring_case, dict(lens=[40], causal=False)),
        ("append-causal-contig", append_case, dict(lens=[30, 7, 22], qo_lens=[9, 7, 1], layout="contiguous")),
        ("append-causal-inter", append_case, dict(lens=[30, 7, 22], qo_lens=[9, 2, 0], layout="interleaved",
                                                  combine="reduce_scatter")),
        ("append-full", append_case, dict(lens=[13, 26], qo_lens=[4, 5], layout="interleaved", causal=False)),
    ]  # fmt: skip
    # larger groups (sharing the CI machine's two cores 8 ways) run a subset; 2 ranks run everything
    keep = {
        3: ("decode-contiguous-ag", "decode-interleaved-rs", "decode-rs-odd-heads", "combine-rs-heads",
            "ring-causal-ragged", "ring-full-ragged", "append-causal-inter"),
        4: ("decode-interleaved-ag", "decode-contiguous-rs", "ring-causal-ragged"),
        8: ("decode-interleaved-rs", "ring-causal-ragged"),
    }.get(world_size)  # fmt: skip
    return cases if keep is None else [c for c in cases if c[0] in keep]


def _cpu_worker(rank, world_size, init_file, plan):
    import torch.distributed as dist

    torch.set_num_threads(1)
    # importing the module (done by this file) initialized neither CUDA nor torch.distributed
    assert not dist.is_initialized() and not torch.cuda.is_initialized()
    if plan == "two":  # runs example_case: its imports come before the process group (see _import_example)
        _import_example()
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=120),
    )  # fmt: skip
    try:
        device = torch.device("cpu")
        if plan == "kernels":  # under TRITON_INTERPRET=1 the local attention and merges run the Triton kernels
            keep = ("decode-interleaved-rs", "decode-ag-heads-odd", "ring-causal-ragged", "append-causal-inter")
            _run_cases(None, device, [c for c in _cpu_cases(2) if c[0] in keep])
        elif plan == "two":
            _run_cases(None, device, _cpu_cases(2) + [("errors", errors_case, {})])
            _run_cases(None, device, [("membership", membership_case, {}), ("example", example_case, {})])
        else:  # eight processes: groups of 3 and of 4 side by side, then all 8
            g3 = dist.new_group(ranks=[0, 1, 2])
            g4 = dist.new_group(ranks=[3, 4, 5, 6])
            if rank < 3:
                _run_cases(g3, device, _cpu_cases(3) + [("errors", errors_case, {})])
            elif rank < 7:
                _run_cases(g4, device, _cpu_cases(4) + [("errors", errors_case, {})])
            _run_cases(None, device, _cpu_cases(8))
    finally:
        dist.destroy_process_group()


def _spawn(fn, nprocs, *args):
    import torch.multiprocessing as mp

    mp.spawn(fn, args=(nprocs, *args), nprocs=nprocs, join=True)


# ----------------------------------------------------------------------------- CPU tests
def test_cp_gloo_two_ranks(tmp_path):
    """2 ranks, default group: decode (both layouts, both combines, heads sharded), ring prefill, append,
    errors, membership."""
    _spawn(_cpu_worker, 2, str(tmp_path / "store"), "two")


@pytest.mark.interpret
def test_cp_gloo_two_ranks_kernels(tmp_path):
    """2 ranks with the Triton kernels (the interpreter on the CPU): decode with float32 partial states,
    the ragged prefill calls of the ring, the masked append, merge_states on strided gathered states."""
    _spawn(_cpu_worker, 2, str(tmp_path / "store"), "kernels")


def test_cp_gloo_three_four_eight_ranks(tmp_path):
    """8 processes: a 3-rank and a 4-rank sub-group side by side, then all 8 on small shapes."""
    _spawn(_cpu_worker, 8, str(tmp_path / "store"), "eight")


def test_shard_page_table_layouts():
    """Both layouts partition every request's pages, keep their order, and agree with shard_kv_lens."""
    page_size = 4
    lens = torch.tensor([0, 1, 4, 5, 37, 64])
    pages = (lens + page_size - 1) // page_size
    ip, indices, last, _ = page_table(lens.tolist(), page_size, spare_pages=3, seed=None)
    for layout in cp.SHARD_LAYOUTS:
        for w in (1, 2, 3, 8):
            shards = [cp.shard_page_table(ip, indices, last, page_size, w, r, layout) for r in range(w)]
            assert torch.equal(sum(s.kv_lens for s in shards), lens)
            assert torch.equal(cp.shard_kv_lens(lens, page_size, w, layout), torch.stack([s.kv_lens for s in shards]))
            for b in range(len(lens)):
                got = sorted(
                    (int(s.logical_pages[j]), int(s.indices[j]))
                    for s in shards
                    for j in range(s.indptr[b], s.indptr[b + 1])
                )
                assert got == [(p, int(indices[ip[b] + p])) for p in range(int(pages[b]))], (layout, w, b)
                if layout == "contiguous":
                    counts = [int(s.indptr[b + 1] - s.indptr[b]) for s in shards]
                    assert max(counts) - min(counts) <= 1
            compact = cp.shard_page_table(ip, indices, last, page_size, w, w - 1, layout, compact=True)
            assert compact.indices.tolist() == list(range(compact.indices.numel()))


def test_zigzag_indices_partition():
    lens = [0, 1, 7, 16, 33]
    for w in (1, 2, 3, 4):
        rows = torch.cat([cp.zigzag_indices(lens, w, r) for r in range(w)])
        assert sorted(rows.tolist()) == list(range(sum(lens)))
        for r in range(w):
            first, second = cp.zigzag_indptr(lens, w, r)
            assert int(first.sum() + second.sum()) == cp.zigzag_indices(lens, w, r).numel()
    assert cp.zigzag_indices([8], 2, 0).tolist() == [0, 1, 6, 7]
    assert cp.zigzag_indices([8], 2, 1).tolist() == [2, 3, 4, 5]


def test_errors_without_group():
    """Local checks need no process group; the wrappers refuse to start without one."""
    one = torch.tensor([0, 1], dtype=torch.int32)
    with pytest.raises(ValueError, match="world_size"):
        cp.shard_page_table(one, one[:1], torch.tensor([1], dtype=torch.int32), 4, 0, 0)
    with pytest.raises(ValueError, match="rank"):
        cp.shard_page_table(one, one[:1], torch.tensor([1], dtype=torch.int32), 4, 2, 2)
    with pytest.raises(ValueError, match="layout"):
        cp.shard_page_table(one, one[:1], torch.tensor([1], dtype=torch.int32), 4, 2, 0, "striped")
    with pytest.raises(ValueError, match="last_page_len"):
        cp.shard_page_table(one, one[:1], torch.tensor([5], dtype=torch.int32), 4, 2, 0)
    with pytest.raises(RuntimeError, match="not initialized"):
        cp.ContextParallelDecodeWrapper(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(RuntimeError, match="not initialized"):
        cp.RingPrefillWrapper(torch.empty(64, dtype=torch.uint8))
    with pytest.raises(ValueError, match="lse_base"):
        cp._check_lse_base(10)


def test_package_attribute():
    """``flashinfer_triton.distributed`` resolves through the package (imported on first use)."""
    import flashinfer_triton as fi

    assert fi.distributed is cp
    with pytest.raises(AttributeError):
        fi.no_such_module  # noqa: B018


def test_docstring_examples():
    import doctest

    result = doctest.testmod(cp, optionflags=doctest.NORMALIZE_WHITESPACE | doctest.ELLIPSIS)
    assert result.attempted > 0 and result.failed == 0


# ----------------------------------------------------------------------------- GPU (NCCL)
def _gpu_cases(world_size):
    big = [4096, 0, 1, 777, 10000]
    cases = []
    for layout in cp.SHARD_LAYOUTS:
        for combine in ("allgather", "reduce_scatter"):
            cases.append((f"decode-{layout}-{combine}", decode_case,
                          dict(lens=big, layout=layout, combine=combine, ps=16, hq=32)))  # fmt: skip
    cases += [
        ("decode-heads", decode_case, dict(lens=big, layout="interleaved", combine="reduce_scatter", gather=False,
                                           ps=16, hq=32, dtype=torch.bfloat16)),
        ("decode-graph", decode_graph_case, dict(lens=[5000, 1, 300], ps=16)),
        ("ring-causal-one", ring_case, dict(lens=[3000], causal=True)),
        ("ring-causal-ragged", ring_case, dict(lens=[1024, 7, 0, 517], causal=True, lse_base="e")),
        ("ring-full", ring_case, dict(lens=[700, 300], causal=False, dtype=torch.bfloat16)),
        ("append-causal", append_case, dict(lens=[3000, 40], qo_lens=[200, 17], layout="interleaved", ps=16)),
        ("errors", errors_case, {}),
        ("example", example_case, {}),
    ]  # fmt: skip
    return cases


def decode_graph_case(group, device, *, lens, ps):
    """The decode wrapper captured in a CUDA graph with its collectives; replays after a new plan()."""
    import torch.distributed as dist

    w, r = dist.get_world_size(group), dist.get_rank(group)
    torch.manual_seed(5)
    cap = 64
    bufs = dict(
        paged_kv_indptr_buffer=torch.empty(len(lens) + 1, dtype=torch.int32, device=device),
        paged_kv_indices_buffer=torch.empty(4096, dtype=torch.int32, device=device),
        paged_kv_last_page_len_buffer=torch.empty(len(lens), dtype=torch.int32, device=device),
    )
    wrapper = cp.ContextParallelDecodeWrapper(_ws(device), "NHD", group, combine="reduce_scatter", use_cuda_graph=True,
                                              **bufs)  # fmt: skip
    q = torch.randn(len(lens), cap, D, device=device).half()
    out = torch.empty_like(q)
    steps = [make_paged(step_lens, ps, HKV, D, torch.float16, device) for step_lens in (lens, [n + 37 for n in lens])]
    # the graph reads one cache tensor: each step's pages are copied into its first pages
    pool = torch.empty((max(s[0].shape[0] for s in steps),) + tuple(steps[0][0].shape[1:]), dtype=torch.float16,
                       device=device)  # fmt: skip
    for step, (cache, indptr, indices, last, _, _) in enumerate(steps):
        shard = cp.shard_page_table(indptr, indices, last, ps, w, r, "interleaved")
        wrapper.plan(shard.indptr.to(device), shard.indices.to(device), shard.last_page_len.to(device), cap, HKV, D,
                     ps)  # fmt: skip
        pool[: cache.shape[0]].copy_(cache)
        if step == 0:
            graph = torch.cuda.CUDAGraph()
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s):
                wrapper.run(q, pool, out=out)  # warm-up outside the graph
            torch.cuda.current_stream().wait_stream(s)
            with torch.cuda.graph(graph):
                wrapper.run(q, pool, out=out)
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        o_ref, _ = reference.batch_decode_with_paged_kv_cache(
            q.cpu(), cache.cpu(), indptr.cpu(), indices.cpu(), last.cpu()
        )
        assert_close(out, o_ref, name=f"graph replay {step} rank {r}")


def _gpu_worker(rank, world_size, init_file):
    import torch.distributed as dist

    _import_example()  # before the process group, see _import_example
    torch.cuda.set_device(rank)
    dist.init_process_group(
        "nccl", init_method=f"file://{init_file}", rank=rank, world_size=world_size,
        timeout=datetime.timedelta(seconds=180), device_id=torch.device("cuda", rank),
    )  # fmt: skip
    try:
        _run_cases(None, torch.device("cuda", rank), _gpu_cases(world_size))
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.parametrize("world_size", [2, 4, 8], ids=lambda n: f"nccl{n}")
def test_cp_nccl(world_size, tmp_path):
    if torch.cuda.device_count() < world_size:
        pytest.skip(f"needs {world_size} GPUs, {torch.cuda.device_count()} visible")
    _spawn(_gpu_worker, world_size, str(tmp_path / "store"))


if __name__ == "__main__":
    # torchrun --nproc_per_node N tests/test_distributed.py: the GPU cases on torchrun's process group
    import torch.distributed as dist

    local = int(os.environ["LOCAL_RANK"])
    _import_example()  # before the process group, see _import_example
    torch.cuda.set_device(local)
    dist.init_process_group("nccl", device_id=torch.device("cuda", local))
    try:
        _run_cases(None, torch.device("cuda", local), _gpu_cases(dist.get_world_size()))
        print(f"rank {dist.get_rank()}: {len(_gpu_cases(dist.get_world_size()))} cases passed")
    finally:
        dist.destroy_process_group()


def test_auto_combine_picks_by_gathered_size():
    """combine="auto": all-gather while world_size x [rows, heads, D + 1] float32 fits the configured size, then
    reduce-scatter; an explicit method is kept whatever the size."""
    from flashinfer_triton._config import DistributedConfig

    cfg = DistributedConfig(allgather_max_bytes=4 * 5 * 2 * 65 * 4)  # exactly 4 ranks x 5 rows x 2 heads x D 64
    assert cp._pick_method("auto", 4, 5, 2, 64, cfg) == "allgather"
    assert cp._pick_method("auto", 4, 6, 2, 64, cfg) == "reduce_scatter"
    assert cp._pick_method("allgather", 4, 6, 2, 64, cfg) == "allgather"
    assert cp._pick_method("auto", 8, 1, 32, 128) == "allgather"  # the default: 8 x 16.5 KB, far under 4 MiB
    assert cp._pick_method("auto", 8, 4096, 32, 128) == "reduce_scatter"
