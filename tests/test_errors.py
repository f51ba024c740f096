"""Bad input: each case raises the named error, naming the argument, before anything is written."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from helpers import i32, make_paged

WS = torch.empty(1 << 20, dtype=torch.uint8)


def _decode_ready(page_size=16, **kw):
    cache, indptr, indices, last, _, _ = make_paged([5, 20], page_size, 2, 64, torch.float16, "cpu")
    w = fi.BatchDecodeWithPagedKVCacheWrapper(WS)
    w.plan(indptr, indices, last, 8, 2, 64, page_size, **kw)
    return w, cache


def _q(b=2, h=8, d=64, dtype=torch.float16):
    return torch.randn(b, h, d).to(dtype)


def _prefill_plan(**over):
    args = dict(
        qo_indptr=i32(0, 2, 5),
        paged_kv_indptr=i32(0, 1, 3),
        paged_kv_indices=i32(0, 1, 2),
        paged_kv_last_page_len=i32(4, 7),
        num_qo_heads=8,
        num_kv_heads=2,
        head_dim_qk=64,
        page_size=16,
    )
    args.update(over)
    fi.BatchPrefillWithPagedKVCacheWrapper(WS).plan(**args)


def _decode_plan(*args, **kw):
    base = [i32(0, 1, 3), i32(0, 1, 2), i32(4, 7), 8, 2, 64, 16]
    for i, a in enumerate(args):
        if a is not None:
            base[i] = a
    fi.BatchDecodeWithPagedKVCacheWrapper(WS).plan(*base, **kw)


def _run_decode(q=None, cache_fn=None, **kw):
    w, cache = _decode_ready()
    if cache_fn is not None:
        cache = cache_fn(cache)
    w.run(_q() if q is None else q, cache, **kw)


CASES = [
    # id, callable, error type, text the message must contain
    ("layout", lambda: fi.BatchDecodeWithPagedKVCacheWrapper(WS, "NDH"), ValueError, "kv_layout"),
    ("workspace-type", lambda: fi.BatchDecodeWithPagedKVCacheWrapper([0] * 8), TypeError, "float_workspace_buffer"),
    ("heads-divisible", lambda: _decode_plan(None, None, None, 9, 2), ValueError, "num_qo_heads"),
    ("head-dim", lambda: _decode_plan(None, None, None, 8, 2, 72), ValueError, "head_dim"),
    ("head-dim-too-big", lambda: _decode_plan(None, None, None, 8, 2, 1024), ValueError, "head_dim"),
    ("indptr-float", lambda: _decode_plan(torch.tensor([0.0, 1.0, 3.0])), TypeError, "indptr"),
    ("indptr-decreasing", lambda: _decode_plan(i32(0, 2, 1)), ValueError, "indptr"),
    ("indptr-start", lambda: _decode_plan(i32(1, 2, 3)), ValueError, "indptr"),
    ("indices-short", lambda: _decode_plan(None, i32(0, 1)), ValueError, "indices"),
    ("indices-negative", lambda: _decode_plan(None, i32(0, -1, 2)), ValueError, "indices"),
    ("last-page-len-zero", lambda: _decode_plan(None, None, i32(0, 7)), ValueError, "last_page_len"),
    ("last-page-len-big", lambda: _decode_plan(None, None, i32(4, 17)), ValueError, "last_page_len"),
    ("last-page-len-shape", lambda: _decode_plan(None, None, i32(4)), ValueError, "last_page_len"),
    ("page-size", lambda: _decode_plan(None, None, None, 8, 2, 64, 0), ValueError, "page_size"),
    ("pos-encoding", lambda: _decode_plan(pos_encoding_mode="ROPE"), ValueError, "pos_encoding_mode"),
    ("window", lambda: _decode_plan(window_left=-3), ValueError, "window_left"),
    ("soft-cap", lambda: _decode_plan(logits_soft_cap=-1.0), ValueError, "logits_soft_cap"),
    ("q-dtype-name", lambda: _decode_plan(q_data_type="float64"), TypeError, "q_data_type"),
    ("kv-dtype", lambda: _decode_plan(kv_data_type=torch.bfloat16), TypeError, "kv_data_type"),
    ("unknown-kwarg", lambda: _decode_plan(foo=1), TypeError, "foo"),
    ("seq-lens-mismatch", lambda: _decode_plan(seq_lens=i32(4, 8)), ValueError, "seq_lens"),
    ("run-q-shape", lambda: _run_decode(q=_q(b=3)), ValueError, "q"),
    ("run-q-dtype", lambda: _run_decode(q=_q(dtype=torch.bfloat16)), TypeError, "q"),
    ("run-q-heads", lambda: _run_decode(q=_q(h=4)), ValueError, "q"),
    ("run-cache-dtype", lambda: _run_decode(cache_fn=lambda c: c.bfloat16()), TypeError, "paged_kv_cache"),
    ("run-cache-4d", lambda: _run_decode(cache_fn=lambda c: c[:, 0]), ValueError, "paged_kv_cache"),
    (
        "run-cache-heads",
        lambda: _run_decode(cache_fn=lambda c: c[:, :, :, :1].contiguous()),
        ValueError,
        "num_kv_heads",
    ),
    ("run-cache-pages", lambda: _run_decode(cache_fn=lambda c: c[:1]), ValueError, "paged_kv_indices"),
    (
        "run-cache-tuple-mismatch",
        lambda: _run_decode(cache_fn=lambda c: (c[:, 0], c[:, 1, :2])),
        ValueError,
        "paged_kv_cache",
    ),
    ("run-out-dtype", lambda: _run_decode(out=torch.empty(2, 8, 64)), TypeError, "out"),
    ("run-out-shape", lambda: _run_decode(out=torch.empty(2, 8, 32, dtype=torch.float16)), ValueError, "out"),
    ("run-lse-dtype", lambda: _run_decode(lse=torch.empty(2, 8, dtype=torch.float16)), TypeError, "lse"),
    (
        "run-positional-not-v02",
        lambda: _decode_ready()[0].run(_q(), _decode_ready()[1], "scale"),
        NotImplementedError,
        r"\*args",
    ),
    ("run-noncontig-last", lambda: _run_decode(q=torch.randn(2, 64, 8).half().transpose(1, 2)), ValueError, "q"),
    ("k-scale-shape", lambda: _run_decode(k_scale=torch.ones(2)), ValueError, "k_scale"),
    ("prefill-qo-indptr", lambda: _prefill_plan(qo_indptr=i32(0, 2)), ValueError, "qo_indptr"),
    ("prefill-head-dim-vo", lambda: _prefill_plan(head_dim_vo=128), ValueError, "head_dim_vo"),
    (
        "prefill-mask-size",
        lambda: _prefill_plan(custom_mask=torch.ones(7, dtype=torch.bool)),
        ValueError,
        "custom_mask",
    ),
    (
        "prefill-packed-mask-size",
        lambda: _prefill_plan(packed_custom_mask=torch.ones(2, dtype=torch.uint8)),
        ValueError,
        "packed_custom_mask",
    ),
    (
        "prefill-packed-mask-dtype",
        lambda: _prefill_plan(packed_custom_mask=torch.ones(9, dtype=torch.int32)),
        TypeError,
        "packed_custom_mask",
    ),
    (
        "ragged-kv-indptr",
        lambda: fi.BatchPrefillWithRaggedKVCacheWrapper(WS).plan(i32(0, 2), i32(0, 5, 3), 8, 2, 64),
        ValueError,
        "kv_indptr",
    ),
    (
        "single-decode-q-dim",
        lambda: fi.single_decode_with_kv_cache(_q(), torch.randn(4, 2, 64).half(), torch.randn(4, 2, 64).half()),
        ValueError,
        "q",
    ),
    (
        "single-decode-kv-heads",
        lambda: fi.single_decode_with_kv_cache(
            torch.randn(8, 64).half(), torch.randn(4, 3, 64).half(), torch.randn(4, 3, 64).half()
        ),
        ValueError,
        "q",
    ),
    (
        "single-decode-v-shape",
        lambda: fi.single_decode_with_kv_cache(
            torch.randn(8, 64).half(), torch.randn(4, 2, 64).half(), torch.randn(5, 2, 64).half()
        ),
        ValueError,
        "v",
    ),
    (
        "single-prefill-kv-dtype",
        lambda: fi.single_prefill_with_kv_cache(
            torch.randn(3, 8, 64).half(), torch.randn(4, 2, 64).bfloat16(), torch.randn(4, 2, 64).bfloat16()
        ),
        TypeError,
        "k",
    ),
    (
        "single-prefill-mask-shape",
        lambda: fi.single_prefill_with_kv_cache(
            torch.randn(3, 8, 64).half(),
            torch.randn(4, 2, 64).half(),
            torch.randn(4, 2, 64).half(),
            custom_mask=torch.ones(3, 5, dtype=torch.bool),
        ),
        ValueError,
        "custom_mask",
    ),
    (
        "merge-shape",
        lambda: fi.merge_state(torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 8), torch.randn(3, 3)),
        ValueError,
        "s_b",
    ),
    (
        "merge-lse-dtype",
        lambda: fi.merge_state(torch.randn(3, 2, 8), torch.randn(3, 2).half(), torch.randn(3, 2, 8), torch.randn(3, 2)),
        TypeError,
        "s_a",
    ),
    ("merge-states-dim", lambda: fi.merge_states(torch.randn(3, 2, 8), torch.randn(3, 2)), ValueError, "v"),
    (
        "merge-mask-dtype",
        lambda: fi.merge_state_in_place(
            torch.randn(3, 2, 8), torch.randn(3, 2), torch.randn(3, 2, 8), torch.randn(3, 2), mask=torch.ones(3)
        ),
        TypeError,
        "mask",
    ),
    (
        "cascade-levels",
        lambda: fi.MultiLevelCascadeAttentionWrapper(2, WS).plan(
            [i32(0, 1)], [i32(0, 1)], [i32(0)], [i32(1)], 8, 2, 64, 16
        ),
        ValueError,
        "qo_indptr_arr",
    ),
    ("packbits-bitorder", lambda: fi.packbits(torch.ones(3, dtype=torch.bool), "middle"), ValueError, "bitorder"),
    ("packbits-dim", lambda: fi.packbits(torch.ones(3, 3, dtype=torch.bool)), ValueError, "x"),
    (
        "segment-packbits-indptr",
        lambda: fi.segment_packbits(torch.ones(4, dtype=torch.bool), i32(0, 9)),
        ValueError,
        "indptr",
    ),
    ("seq-lens-index-dtype", lambda: fi.get_seq_lens(torch.tensor([0.0, 1.0]), i32(1), 16), TypeError, "kv_indptr"),
    ("positions-nnz", lambda: fi.get_batch_indices_positions(i32(0, 2), i32(2), -1), ValueError, "nnz"),
]


@pytest.mark.parametrize("fn,exc,text", [c[1:] for c in CASES], ids=[c[0] for c in CASES])
def test_bad_input_raises(fn, exc, text):
    with pytest.raises(exc, match=text):
        fn()


def _append_args(**over):
    cache = torch.randn(4, 2, 16, 2, 64).half()
    args = dict(
        append_key=torch.randn(3, 2, 64).half(),
        append_value=torch.randn(3, 2, 64).half(),
        batch_indices=i32(0, 0, 1),
        positions=i32(0, 1, 0),
        paged_kv_cache=cache,
        kv_indices=i32(2, 3),
        kv_indptr=i32(0, 1, 2),
        kv_last_page_len=i32(2, 1),
    )
    args.update(over)
    return args


APPEND_CASES = [
    ("key-shape", dict(append_key=torch.randn(3, 2, 32).half()), ValueError, "append_key"),
    ("value-count", dict(append_value=torch.randn(2, 2, 64).half()), ValueError, "append_value"),
    ("batch-indices-dtype", dict(batch_indices=torch.tensor([0, 0, 1])), TypeError, "batch_indices"),
    ("batch-index-range", dict(batch_indices=i32(0, 0, 2)), ValueError, "batch_indices"),
    ("position-past-pages", dict(positions=i32(0, 16, 0)), ValueError, "positions"),
    ("page-out-of-cache", dict(kv_indices=i32(2, 9)), ValueError, "kv_indices"),
    ("cache-shape", dict(paged_kv_cache=torch.randn(4, 3, 16, 2, 64).half()), ValueError, "paged_kv_cache"),
]


@pytest.mark.parametrize("over,exc,text", [c[1:] for c in APPEND_CASES], ids=[c[0] for c in APPEND_CASES])
def test_bad_append_raises_and_writes_nothing(over, exc, text):
    args = _append_args(**over)
    before = args["paged_kv_cache"].clone()
    with pytest.raises(exc, match=text):
        fi.append_paged_kv_cache(**args)
    assert torch.equal(args["paged_kv_cache"], before)


def test_failed_run_leaves_out_untouched():
    w, cache = _decode_ready()
    out = torch.full((2, 8, 64), 7.0, dtype=torch.float16)
    with pytest.raises(TypeError):
        w.run(_q(), cache.bfloat16(), out=out)
    assert bool((out == 7).all())


def test_messages_do_not_print_tensor_contents():
    with pytest.raises(ValueError) as info:
        _decode_plan(i32(0, 2, 1))
    assert "tensor(" not in str(info.value)


@pytest.mark.parametrize("name", ["sm_scale", "rope_scale", "rope_theta"])
def test_non_numeric_scales_are_named(name):
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(1 << 20, dtype=torch.uint8))
    args = (torch.tensor([0, 1], dtype=torch.int32), torch.tensor([0], dtype=torch.int32),
            torch.tensor([3], dtype=torch.int32), 4, 2, 64, 16)  # fmt: skip
    with pytest.raises(TypeError, match=name):
        w.plan(*args, **{name: "bad"})
