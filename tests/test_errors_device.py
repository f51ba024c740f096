"""Bad indices in the vLLM layer: a block-table entry past the cache, a length past the block table (or, for v2,
past max_seq_len), a slot or a block number past the cache.

CPU tensors: a ValueError naming the argument before anything is written. Kernels (the interpreter, the GPU): no
read or write outside the tensors (outputs sit inside guarded buffers whose guards must stay untouched), the
offending work's results are NaN, the others' correct, and the error is recorded on the device until
``flashinfer_triton.check_errors()`` (or a wrapper's ``plan()``) raises it and clears it.
"""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import DEVICE, HAS_CUDA, INTERPRET, assert_close_named
from flashinfer_triton import _errors, vllm
from test_vllm import TOL, Case

CPU_TORCH = pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="host checks of CPU tensors (the PyTorch path)")


def _drain_errors():
    """Read and clear every device's error record (``check_errors`` raises the first one it finds and clears it)."""
    for _ in range(64):
        try:
            fi.check_errors()
            return
        except RuntimeError:
            continue
    raise AssertionError("check_errors() kept raising")


@pytest.fixture(autouse=True)
def _no_pending_error():
    """Every test starts and ends with no recorded error (a failing test must not leak one into the next)."""
    _drain_errors()
    yield
    _drain_errors()


def _guarded(shape, dtype, device):
    """A NaN-filled tensor inside a buffer with 256 guard elements either side (value 7)."""
    n = 1
    for s in shape:
        n *= s
    buf = torch.full((n + 512,), 7.0, dtype=dtype, device=device)
    view = buf[256 : 256 + n].view(shape)
    view.fill_(float("nan"))
    return buf, view


def _guards_intact(buf):
    return bool((buf[:256] == 7).all()) and bool((buf[-256:] == 7).all())


def _call(case, partitioned, out, public):
    """v1 or v2 on ``case``; ``public``: through vllm.paged_attention_v* (host checks of CPU tensors), else straight
    to the kernel's host side (no data checks: what a GPU call does)."""
    num_seqs, num_heads, head_size = case.query.shape
    parts = max(1, -(-case.max_seq_len // vllm.PARTITION_SIZE))
    es = torch.full((num_seqs, num_heads, parts), float("nan"), device=case.query.device)
    ml = torch.full_like(es, float("nan"))
    tmp = torch.full((num_seqs, num_heads, parts, head_size), float("nan"), device=case.query.device, dtype=case.dtype)
    args = (case.query, case.key_cache, case.value_cache, case.num_kv_heads, case.scale, case.block_tables,
            case.seq_lens, case.block_size, case.max_seq_len, case.alibi, case.kv_cache_dtype, case.k_scale,
            case.v_scale)  # fmt: skip
    if public:
        if partitioned:
            vllm.paged_attention_v2(out, es, ml, tmp, *args)
        else:
            vllm.paged_attention_v1(out, *args)
        return
    from flashinfer_triton import _vllm_impl

    _vllm_impl.run(case.query, case.key_cache, case.value_cache, out, case.block_tables, case.seq_lens,
                   num_kv_heads=case.num_kv_heads, scale=case.scale, alibi_slopes=None, k_scale=1.0, v_scale=1.0,
                   partitioned=partitioned, max_seq_len=case.max_seq_len, max_num_partitions=parts, exp_sums=es,
                   max_logits=ml, tmp_out=tmp)  # fmt: skip


def _bad_cases():
    """(what, a Case with one bad sequence (index 1), the error message's key words)."""
    out = []
    c = Case([40, 37, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    c.block_tables[1, 1] = c.key_cache.shape[0] + 3  # past the cache
    out.append(("table-entry-past-cache", c, "block_tables"))
    c = Case([40, 37, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    c.block_tables[1, 0] = -5
    out.append(("table-entry-negative", c, "block_tables"))
    c = Case([40, 37, 9], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, extra_table=0)
    c.seq_lens[1] = c.block_tables.shape[1] * 16 + 5  # longer than its row of the block table allows
    out.append(("seq-len-past-table", c, "seq_lens"))
    return out


BAD = _bad_cases()


@CPU_TORCH
@pytest.mark.parametrize("partitioned", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("what", [b[0] for b in BAD])
def test_host_checks_before_writing(what, partitioned):
    _, case, name = next(b for b in BAD if b[0] == what)
    out = torch.full_like(case.query, float("nan"))
    with pytest.raises(ValueError, match=name):
        _call(case, partitioned, out, public=True)
    assert torch.isnan(out).all()  # nothing written


@CPU_TORCH
def test_host_checks_v2_length_past_max_seq_len():
    case = Case([40, 600], num_heads=2, num_kv_heads=1, head_size=64, block_size=16, extra_table=2)
    case.max_seq_len = 500  # one 512-key partition, a 600-key sequence
    out = torch.full_like(case.query, float("nan"))
    with pytest.raises(ValueError, match="seq_lens"):
        _call(case, True, out, public=True)
    assert torch.isnan(out).all()
    _call(case, False, out, public=True)  # v1 covers any length within the block table
    assert not torch.isnan(out).any()


@CPU_TORCH
def test_host_checks_cache_writes():
    hkv, d, bs, nb = 2, 32, 8, 3
    key = torch.randn(4, hkv, d).half()
    kc = torch.randn(nb, hkv, d // 8, bs, 8).half()
    vc = torch.randn(nb, hkv, d, bs).half()
    kc0, vc0 = kc.clone(), vc.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        vllm.reshape_and_cache(key, key, kc, vc, torch.tensor([0, 3, nb * bs, 5]), "auto")
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    fkc, fvc = torch.randn(nb, bs, hkv, d).half(), torch.randn(nb, bs, hkv, d).half()
    f0 = fkc.clone()
    with pytest.raises(ValueError, match="slot_mapping"):
        vllm.reshape_and_cache_flash(key, key, fkc, fvc, torch.tensor([1, nb * bs + 2, -1, 0]), "auto")
    assert torch.equal(fkc, f0)
    with pytest.raises(ValueError, match="block_mapping"):
        vllm.copy_blocks([kc], [vc], torch.tensor([[0, 1], [2, nb]]))
    with pytest.raises(ValueError, match="block_mapping"):
        vllm.copy_blocks([kc], [vc], torch.tensor([[-1, 1]]))
    assert torch.equal(kc, kc0) and torch.equal(vc, vc0)
    with pytest.raises(ValueError, match="block_mapping"):
        vllm.swap_blocks(kc, kc.clone(), torch.tensor([[0, nb]]))


def test_check_errors_reports_and_clears():
    flag = _errors.error_flag(torch.device("cpu"))
    fi.check_errors()  # nothing pending
    flag.copy_(torch.tensor([1, 3, 99, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match=r"block_tables entry .*sequence 3, entry 99"):
        fi.check_errors()
    fi.check_errors()  # cleared
    flag.copy_(torch.tensor([4, 2, 1000, 0], dtype=torch.int32))
    with pytest.raises(RuntimeError, match="slot_mapping"):
        fi.check_errors("cpu")


def test_plan_surfaces_a_pending_error():
    """A wrapper's plan() raises a pending device-side error (then plans normally)."""
    flag = _errors.error_flag(torch.device("cpu"))
    flag.copy_(torch.tensor([2, 0, 5000, 0], dtype=torch.int32))
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8), "NHD")
    args = (torch.tensor([0, 2], dtype=torch.int32), torch.tensor([0, 1], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16)  # fmt: skip
    with pytest.raises(RuntimeError, match="seq_lens"):
        w.plan(*args)
    w.plan(*args)


# ---------------------------------------------------------------- the kernels' own checks (interpreter, GPU)


@pytest.mark.interpret
@pytest.mark.parametrize("partitioned", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("what", [b[0] for b in BAD])
def test_kernel_skips_bad_indices(what, partitioned):
    """Straight to the kernel (no host checks): nothing outside the output is written, the bad sequence's rows are
    NaN, the others correct, and the error is recorded until check_errors()."""
    _, case, name = next(b for b in BAD if b[0] == what)
    case = _fresh(case)
    buf, out = _guarded(tuple(case.query.shape), case.dtype, case.query.device)
    _call(case, partitioned, out, public=False)
    assert _guards_intact(buf)
    assert torch.isnan(out[1].float()).all()
    want = _expected_good(case)
    for b in (0, 2):
        assert_close_named(f"out[{b}]", out[b], want[b], *TOL[case.dtype])
    with pytest.raises(RuntimeError, match=name):
        fi.check_errors()
    fi.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("partitioned", [False, True], ids=["v1", "v2"])
@pytest.mark.parametrize("what", [b[0] for b in BAD])
def test_gpu_public_calls_record_bad_indices(what, partitioned):
    """On CUDA the public functions do not check the data (that would sync): the kernel does."""
    _, case, name = next(b for b in BAD if b[0] == what)
    case = _fresh(case)
    buf, out = _guarded(tuple(case.query.shape), case.dtype, case.query.device)
    _call(case, partitioned, out, public=True)
    torch.cuda.synchronize()
    assert _guards_intact(buf)
    assert torch.isnan(out[1].float()).all()
    with pytest.raises(RuntimeError, match=name):
        fi.check_errors()


@pytest.mark.gpu
def test_gpu_v2_length_past_max_seq_len():
    case = Case([40, 600], num_heads=2, num_kv_heads=1, head_size=64, block_size=16, extra_table=2)
    case.max_seq_len = 500
    out = torch.full_like(case.query, float("nan"))
    _call(case, True, out, public=True)
    assert torch.isnan(out[1].float()).all() and not torch.isnan(out[0].float()).any()
    with pytest.raises(RuntimeError, match="max_seq_len"):
        fi.check_errors()


@pytest.mark.interpret
def test_kernel_cache_writes_skip_bad_indices():
    """reshape_and_cache's kernel skips a slot past the cache, copy_blocks' kernel a pair past it; both record it."""
    from flashinfer_triton.kernels.vllm_cache import launch_copy_blocks, launch_reshape_and_cache

    dev = DEVICE
    hkv, d, bs, nb = 2, 32, 8, 3
    key = torch.randn(3, hkv, d, device=dev).half()
    kbuf, kc = _guarded((nb, hkv, d // 8, bs, 8), torch.float16, dev)
    vbuf, vc = _guarded((nb, hkv, d, bs), torch.float16, dev)
    kc.normal_()
    vc.normal_()
    kc0 = kc.clone()
    one = torch.ones(1, device=dev)
    ks, vs = kc.stride(), vc.stride()
    launch_reshape_and_cache(key, key, kc, vc, torch.tensor([nb * bs, nb * bs + 40, -1], device=dev), one, one, 0.0,
                             (*ks[:4], *vs), 8, bs, nb, _errors.error_flag(dev))  # fmt: skip
    assert _guards_intact(kbuf) and _guards_intact(vbuf) and torch.equal(kc, kc0)
    with pytest.raises(RuntimeError, match="slot_mapping"):
        fi.check_errors()
    launch_copy_blocks(kc.view(torch.int16), torch.tensor([[0, 1], [1, nb + 5], [-2, 0]], device=dev),
                       _errors.error_flag(dev))  # fmt: skip
    assert _guards_intact(kbuf)
    assert torch.equal(kc[1], kc0[0]) and torch.equal(kc[0], kc0[0]) and torch.equal(kc[2], kc0[2])
    with pytest.raises(RuntimeError, match="block_mapping"):
        fi.check_errors()


@pytest.mark.gpu
def test_gpu_cache_writes_record_bad_indices():
    hkv, d, bs, nb = 2, 64, 16, 4
    key = torch.randn(5, hkv, d, device=DEVICE).half()
    kc = torch.randn(nb, hkv, d // 8, bs, 8, device=DEVICE).half()
    vc = torch.randn(nb, hkv, d, bs, device=DEVICE).half()
    kc0 = kc.clone()
    vllm.reshape_and_cache(key, key, kc, vc, torch.tensor([0, nb * bs, 3, -1, 10**6], device=DEVICE), "auto")
    with pytest.raises(RuntimeError, match="slot_mapping"):
        fi.check_errors()
    assert torch.equal(kc[1:], kc0[1:])
    vllm.copy_blocks([kc], [vc], torch.tensor([[1, 2], [0, nb]], device=DEVICE))
    assert torch.equal(kc[2], kc[1])
    with pytest.raises(RuntimeError, match="block_mapping"):
        fi.check_errors()


def _fresh(case):
    """A copy of the case's inputs (the module-level cases are shared between parametrizations)."""
    import copy

    c = copy.copy(case)
    c.block_tables, c.seq_lens = case.block_tables.clone(), case.seq_lens.clone()
    return c


def _expected_good(case):
    """Per-sequence reference outputs, computed on a case with the bad sequence emptied."""
    good = _fresh(case)
    good.seq_lens[1] = 0
    good.lens = list(case.lens)
    good.lens[1] = 0
    good.block_tables[1] = 0
    if hasattr(good, "_values"):
        del good._values
    return good.expected()[0]


# ---------------------------------------------------------------- append_paged_kv_cache's indices

# (what, the third token's (batch index, position), the third page-table entry, the error message's key words):
# two good tokens of request 0, then one bad token. kv_indptr = [0, 2, 3]: request 0 owns pages 1 and 3,
# request 1 the page named by the third entry; the cache has 4 pages of 4 slots.
BAD_APPEND = [
    ("batch-index-past", (2, 0), 0, "batch_indices"),
    ("batch-index-negative", (-1, 0), 0, "batch_indices"),
    ("position-past-pages", (1, 4), 0, "positions"),
    ("position-negative", (1, -3), 0, "positions"),
    ("page-past-cache", (1, 1), 9, "kv_indices"),
    ("page-negative", (1, 1), -2, "kv_indices"),
]


def _append_case(what, device):
    """(key, value, batch_indices, positions, guarded cache buffer, cache [4, 2, 4, 2, 16], kv_indices, kv_indptr,
    last_page_len, the cache as the good tokens leave it)."""
    _, (b, pos), entry, _ = next(c for c in BAD_APPEND if c[0] == what)
    gen = torch.Generator().manual_seed(len(what))
    key = torch.randn(3, 2, 16, generator=gen).half().to(device)
    value = torch.randn(3, 2, 16, generator=gen).half().to(device)
    i32 = lambda *x: torch.tensor(x, dtype=torch.int32, device=device)  # noqa: E731
    buf, cache = _guarded((4, 2, 4, 2, 16), torch.float16, device)
    cache.copy_(torch.randn(cache.shape, generator=gen).half())
    want = cache.clone()
    for t, (page, slot) in enumerate([(3, 1), (1, 0)]):  # (0, 5) and (0, 0)
        want[page, 0, slot], want[page, 1, slot] = key[t], value[t]
    return (key, value, i32(0, 0, b), i32(5, 0, pos), buf, cache, i32(1, 3, entry), i32(0, 2, 3), i32(2, 1), want)


@pytest.mark.parametrize("what", [c[0] for c in BAD_APPEND])
def test_append_host_checks_before_writing(what):
    """CPU tensors: a ValueError naming the argument, and the cache untouched."""
    key, value, bi, pos, _, cache, indices, indptr, last, _ = _append_case(what, torch.device("cpu"))
    before = cache.clone()
    name = next(c[3] for c in BAD_APPEND if c[0] == what)
    with pytest.raises(ValueError, match=name):
        fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
    assert torch.equal(cache, before)


@pytest.mark.interpret
@pytest.mark.parametrize("what", [c[0] for c in BAD_APPEND])
def test_append_kernel_skips_bad_indices(what):
    """Straight to the kernel (no host checks): the good tokens land, the bad one writes nothing, nothing outside the
    cache is touched, and the error is recorded until check_errors()."""
    from flashinfer_triton import _page_impl

    key, value, bi, pos, buf, cache, indices, indptr, _, want = _append_case(what, DEVICE)
    k4, v4 = cache.unbind(1)
    _page_impl.append_paged_kv_cache(key, value, bi, pos, k4, v4, indices, indptr)
    assert _guards_intact(buf)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match=next(c[3] for c in BAD_APPEND if c[0] == what) + ".*token 2"):
        fi.check_errors()
    fi.check_errors()


@pytest.mark.gpu
@pytest.mark.parametrize("what", [c[0] for c in BAD_APPEND])
def test_gpu_append_records_bad_indices(what):
    """On CUDA the public function does not read the indices (that would sync): the kernel checks them."""
    key, value, bi, pos, buf, cache, indices, indptr, last, want = _append_case(what, DEVICE)
    fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
    torch.cuda.synchronize()
    assert _guards_intact(buf)
    assert torch.equal(cache, want)
    with pytest.raises(RuntimeError, match=next(c[3] for c in BAD_APPEND if c[0] == what)):
        fi.check_errors()


def _decode_plan_args(device):
    return (torch.tensor([0, 2], dtype=torch.int32, device=device), torch.tensor([0, 1], dtype=torch.int32,
            device=device), torch.tensor([3], dtype=torch.int32, device=device), 4, 2, 64, 16)  # fmt: skip


@pytest.mark.gpu
def test_gpu_plan_surfaces_an_error_without_waiting():
    """After a kernel recorded an error, plan() enqueues an asynchronous read and returns; a plan() after that read
    completed raises it (and clears it), and the next plans run normally."""
    key, value, bi, pos, _, cache, indices, indptr, last, _ = _append_case("page-past-cache", DEVICE)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE), "NHD")
    args = _decode_plan_args("cpu")
    w.plan(*args)
    torch.cuda.synchronize()
    w.plan(*args)  # nothing pending
    fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
    try:
        w.plan(*args)  # enqueues the read (raises only if the read has already completed)
    except RuntimeError as e:
        assert "kv_indices" in str(e)
    else:
        torch.cuda.synchronize()
        with pytest.raises(RuntimeError, match="kv_indices"):
            w.plan(*args)
    w.plan(*args)
    torch.cuda.synchronize()
    w.plan(*args)
    fi.check_errors()


@pytest.mark.gpu
def test_gpu_plan_never_syncs_for_the_error_record():
    """plan() after checking kernels ran (good indices) never synchronizes: sync debug mode "error" stays silent."""
    key, value, bi, pos, _, cache, indices, indptr, last, _ = _append_case("page-past-cache", DEVICE)
    bi[2], pos[2] = 0, 1  # every token good
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8, device=DEVICE), "NHD")
    args = _decode_plan_args("cpu")
    w.plan(*args)
    fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
    w.plan(*args)  # the first read (its pinned buffer is allocated once)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(3):
            fi.append_paged_kv_cache(key, value, bi, pos, cache, indices, indptr, last)
            w.plan(*args)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    fi.check_errors()
