"""``flashinfer_triton.vllm`` (vLLM's PagedAttention API) against a float32 reference written here from
vLLM's definition (the cache layout gathered by hand), cross-checked with ``reference.attention``.

Kernel cases (``interpret``) are tiny; the ``gpu`` set covers the head sizes, block sizes, GQA, dtypes.
Unmarked cases run the PyTorch path on the CPU (and the kernels on CUDA).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from conftest import DEVICE, HAS_CUDA, INTERPRET, assert_close_named
from flashinfer_triton import reference, vllm
from helpers import block_table, plan_as_on_h100

TOL = {torch.float16: (3e-3, 3e-3), torch.bfloat16: (2e-2, 2e-2), torch.float32: (1e-4, 1e-4)}
CACHE_DTYPES = {"auto": None, "fp8": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn,
                "fp8_e5m2": torch.float8_e5m2}  # fmt: skip


class Case:
    """Random vLLM-layout caches holding ``lens`` tokens per sequence, blocks in shuffled order."""

    def __init__(self, lens, num_heads, num_kv_heads, head_size, block_size, dtype=torch.float16,
                 kv_cache_dtype="auto", scales=(1.0, 1.0), alibi=False, spare_blocks=3, extra_table=1):  # fmt: skip
        self.lens, self.block_size, self.dtype = list(lens), block_size, dtype
        self.num_kv_heads, self.kv_cache_dtype = num_kv_heads, kv_cache_dtype
        cache_dtype = CACHE_DTYPES[kv_cache_dtype] or dtype
        x = 16 // torch.empty(0, dtype=cache_dtype).element_size()
        max_blocks = max([-(-n // block_size) for n in lens] + [1]) + extra_table
        # unused table entries: garbage a kernel must never read
        table, num_blocks = block_table(
            lens, block_size, max_blocks=max_blocks, spare_blocks=spare_blocks, fill=-7, seed=None
        )
        self.query = torch.randn(len(lens), num_heads, head_size, device=DEVICE).to(dtype)
        kc = torch.randn(num_blocks, num_kv_heads, head_size // x, block_size, x, device=DEVICE)
        vc = torch.randn(num_blocks, num_kv_heads, head_size, block_size, device=DEVICE)
        self.key_cache, self.value_cache = kc.to(cache_dtype), vc.to(cache_dtype)
        if cache_dtype != dtype:  # vLLM allocates fp8 caches as uint8
            self.key_cache, self.value_cache = self.key_cache.view(torch.uint8), self.value_cache.view(torch.uint8)
        self.block_tables = table.to(DEVICE)
        self.seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        self.max_seq_len = max(lens + [0])
        self.scale = 1.0 / math.sqrt(head_size) * 1.3
        self.alibi = reference.alibi_slopes(num_heads).to(DEVICE).float() if alibi else None
        self.k_scale, self.v_scale = scales

    def cache_values(self):
        """float32 K and V caches (fp8 widened and multiplied by the scales, as vLLM reads them)."""
        cache_dtype = CACHE_DTYPES[self.kv_cache_dtype]
        kc, vc = self.key_cache, self.value_cache
        if cache_dtype is not None:
            kc, vc = kc.view(cache_dtype), vc.view(cache_dtype)
        ks = float(self.k_scale) if not isinstance(self.k_scale, torch.Tensor) else self.k_scale.item()
        vs = float(self.v_scale) if not isinstance(self.v_scale, torch.Tensor) else self.v_scale.item()
        return kc.float().cpu() * ks, vc.float().cpu() * vs

    def gather(self, b):
        """Sequence b's keys and values [n, Hkv, D], addressed element by element as vLLM defines it:
        key (j, h, d) at key_cache[block_tables[b, j // bs], h, d // x, j % bs, d % x], value (j, h, d) at
        value_cache[block_tables[b, j // bs], h, d, j % bs]."""
        if not hasattr(self, "_values"):
            self._values = self.cache_values()
        kc, vc = self._values
        n, bs = self.lens[b], self.block_size
        x = kc.shape[-1]
        j = torch.arange(n)[:, None, None]
        h = torch.arange(kc.shape[1])[None, :, None]
        d = torch.arange(kc.shape[2] * x)[None, None, :]
        blk = self.block_tables.cpu().long()[b][j // bs]
        return kc[blk, h, d // x, j % bs, d % x], vc[blk, h, d, j % bs]

    def expected(self):
        """Per sequence: out [Hq, D], and per 512-key partition (max_logits, exp_sums, tmp_out)."""
        num_seqs, num_heads, head_size = self.query.shape
        group = num_heads // self.num_kv_heads
        parts = max(1, -(-self.max_seq_len // vllm.PARTITION_SIZE))
        out = torch.zeros(num_seqs, num_heads, head_size)
        ml = torch.full((num_seqs, num_heads, parts), float("-inf"))
        es = torch.zeros(num_seqs, num_heads, parts)
        tmp = torch.zeros(num_seqs, num_heads, parts, head_size)
        for b, n in enumerate(self.lens):
            k, v = self.gather(b)
            k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
            q = self.query[b].float().cpu()
            s = torch.einsum("hd,nhd->hn", q, k) * self.scale
            if self.alibi is not None:
                s = s + self.alibi.cpu()[:, None] * (torch.arange(n) - n + 1).float()[None, :]
            if n == 0:
                continue
            out[b] = torch.einsum("hn,nhd->hd", torch.softmax(s, -1), v)
            for p in range(parts):
                sl = slice(p * vllm.PARTITION_SIZE, min((p + 1) * vllm.PARTITION_SIZE, n))
                if sl.start >= n:
                    break
                m = s[:, sl].max(-1).values
                e = torch.exp(s[:, sl] - m[:, None])
                ml[b, :, p], es[b, :, p] = m, e.sum(-1)
                tmp[b, :, p] = torch.einsum("hn,nhd->hd", e, v[sl]) / e.sum(-1)[:, None]
        return out, ml, es, tmp

    def cross_check(self, out):
        """The same data through the library's own reference (NHD K/V per sequence)."""
        for b, n in enumerate(self.lens):
            if n == 0:
                continue
            k, v = self.gather(b)
            o, _ = reference.attention(self.query[b : b + 1].float().cpu(), k, v, sm_scale=self.scale,
                                       pos_encoding_mode="ALIBI" if self.alibi is not None else "NONE")  # fmt: skip
            assert_close_named(f"out[{b}] vs reference.attention", out[b], o[0], *TOL[self.dtype])

    def run_v1(self):
        out = torch.full_like(self.query, float("nan"))
        vllm.paged_attention_v1(out, self.query, self.key_cache, self.value_cache, self.num_kv_heads, self.scale,
                                self.block_tables, self.seq_lens, self.block_size, self.max_seq_len, self.alibi,
                                self.kv_cache_dtype, self.k_scale, self.v_scale)  # fmt: skip
        return out

    def run_v2(self, tmp_dtype=None):
        num_seqs, num_heads, head_size = self.query.shape
        parts = max(1, -(-self.max_seq_len // vllm.PARTITION_SIZE))
        out = torch.full_like(self.query, float("nan"))
        es = torch.full((num_seqs, num_heads, parts), float("nan"), device=DEVICE)
        ml = torch.full_like(es, float("nan"))
        tmp = torch.full((num_seqs, num_heads, parts, head_size), float("nan"), device=DEVICE,
                         dtype=tmp_dtype or self.dtype)  # fmt: skip
        vllm.paged_attention_v2(out, es, ml, tmp, self.query, self.key_cache, self.value_cache, self.num_kv_heads,
                                self.scale, self.block_tables, self.seq_lens, self.block_size, self.max_seq_len,
                                self.alibi, self.kv_cache_dtype, self.k_scale, self.v_scale)  # fmt: skip
        return out, ml, es, tmp


def check_v1(case):
    out = case.run_v1()
    want, _, _, _ = case.expected()
    assert_close_named("out", out, want, *TOL[case.dtype])
    case.cross_check(out.float().cpu())


def check_v2(case, tmp_dtype=None):
    out, ml, es, tmp = case.run_v2(tmp_dtype)
    want, ml_w, es_w, tmp_w = case.expected()
    atol, rtol = TOL[case.dtype]
    assert_close_named("out", out, want, atol, rtol)
    assert_close_named("max_logits", ml, ml_w, 1e-3, 1e-3)
    assert_close_named("exp_sums", es, es_w, 1e-3 * es_w.max().item(), 2e-3)
    assert_close_named("tmp_out", tmp, tmp_w, atol, rtol)
    case.cross_check(out.float().cpu())


# ---------------------------------------------------------------- kernel cases, tiny (interpreter)


@pytest.mark.interpret
@pytest.mark.parametrize("alibi", [False, True], ids=["plain", "alibi"])
def test_v1_gqa(alibi):
    check_v1(Case([37, 5, 0, 16], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, alibi=alibi))


@pytest.mark.interpret
def test_v2_partitions_alibi():
    # 600 keys = one full 512-key partition + 88; the 3-key sequence leaves its second partition empty.
    check_v2(Case([600, 3], num_heads=3, num_kv_heads=1, head_size=64, block_size=32, alibi=True))


@pytest.mark.interpret
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e5m2"])
def test_v1_fp8_scale_tensors(kv_cache_dtype):
    scales = (torch.tensor([0.7], device=DEVICE), torch.tensor([1.9], device=DEVICE))
    check_v1(Case([19, 8], num_heads=2, num_kv_heads=2, head_size=80, block_size=8,
                  kv_cache_dtype=kv_cache_dtype, scales=scales))  # fmt: skip


@pytest.mark.interpret
def test_v1_fp8_d80_padded_head():
    """Head size 80 in a 128-wide tile (masked chunks) with fp8 keys (x = 16): whole-block tiles and the masked
    tail tile."""
    scales = (torch.tensor([0.7], device=DEVICE), torch.tensor([1.9], device=DEVICE))
    check_v1(Case([150, 19, 8], num_heads=2, num_kv_heads=2, head_size=80, block_size=8, kv_cache_dtype="fp8",
                  scales=scales))  # fmt: skip


@pytest.mark.interpret
def test_v2_bf16_float_tmp_out():
    check_v2(Case([40], num_heads=2, num_kv_heads=1, head_size=96, block_size=8, dtype=torch.bfloat16),
             tmp_dtype=torch.float32)  # fmt: skip


def _poison_tails(case):
    """NaN in every slot past each sequence's end within its last block (vLLM leaves them unwritten)."""
    bs = case.block_size
    table = case.block_tables.cpu()
    for b, n in enumerate(case.lens):
        if n % bs:
            blk = int(table[b, n // bs])
            case.key_cache[blk, :, :, n % bs :, :] = float("nan")
            case.value_cache[blk, :, :, n % bs :] = float("nan")


def run_with_config(case, config, partitioned=False):
    """The kernel through ``_vllm_impl.run`` with a given tuning (the public functions use the default); returns
    v1's ``out`` or v2's (out, max_logits, exp_sums, tmp_out)."""
    from flashinfer_triton import _vllm_impl

    num_seqs, num_heads, head_size = case.query.shape
    parts = max(1, -(-case.max_seq_len // vllm.PARTITION_SIZE))
    out = torch.full_like(case.query, float("nan"))
    es = torch.full((num_seqs, num_heads, parts), float("nan"), device=DEVICE)
    ml = torch.full_like(es, float("nan"))
    tmp = torch.full((num_seqs, num_heads, parts, head_size), float("nan"), device=DEVICE, dtype=case.dtype)
    kc, vc, ks, vs, strides = vllm._check_attention_args(
        out, case.query, case.key_cache, case.value_cache, case.num_kv_heads, case.scale, case.block_tables,
        case.seq_lens, case.block_size, case.max_seq_len, case.alibi, case.kv_cache_dtype, case.k_scale, case.v_scale,
    )  # fmt: skip
    _vllm_impl.run(case.query, kc, vc, out, case.block_tables, case.seq_lens, num_kv_heads=case.num_kv_heads,
                   scale=case.scale, alibi_slopes=case.alibi, k_scale=ks, v_scale=vs, partitioned=partitioned,
                   max_seq_len=case.max_seq_len, max_num_partitions=parts, exp_sums=es, max_logits=ml, tmp_out=tmp,
                   strides=strides, config=config)  # fmt: skip
    return (out, ml, es, tmp) if partitioned else out


@pytest.mark.interpret
@pytest.mark.parametrize("split,block_n", [(True, 64), (False, 64), (False, 16)], ids=["v1-split", "v1-whole",
                                                                                     "v1-whole-n16"])  # fmt: skip
def test_v1_internal_split_nan_tails(split, block_n):
    """v1 with few sequences and long contexts is cut into chunks merged in the same launch (the result is
    v1's); NaN in the unwritten slots of last blocks never leaks; a second call (counters reset) agrees.
    ``block_n`` 16: one block per whole tile."""
    from flashinfer_triton import _vllm_impl

    config = _vllm_impl.VllmDecodeConfig(block_n=block_n, split_v1=split)
    case = Case([600, 300, 3, 0, 17], num_heads=3, num_kv_heads=1, head_size=64, block_size=16, alibi=True)
    _poison_tails(case)
    if DEVICE.type == "cpu":
        # The interpreter counts 4 SMs: 5 programs leave it idle, so the 600 keys are cut into chunks.
        assert _vllm_impl._v1_chunk(5, 1, 600, 64, 4) == 384
        # the split rule is the configuration's (384-key chunks by default): no split once 5 programs count as
        # enough, or chunks of at least 448 keys
        assert _vllm_impl._v1_chunk(5, 1, 600, 64, 4, replace(config, split_min_waves=1.0)) == 0
        assert _vllm_impl._v1_chunk(5, 1, 600, 64, 4, replace(config, min_chunk=448)) == 448
    want, _, _, _ = case.expected()
    for _ in range(2):
        out = run_with_config(case, config)
        assert_close_named("out", out, want, *TOL[case.dtype])


@pytest.mark.interpret
def test_v2_fused_reduce_repeat():
    """v2 partitions reduced in the decode launch by the last partition program: GQA group 3, a sequence leaving
    partitions empty, NaN tails, two calls agree."""
    case = Case([1100, 7, 513], num_heads=6, num_kv_heads=2, head_size=64, block_size=16, alibi=True)
    _poison_tails(case)
    for _ in range(2):
        check_v2(case)


def _expected_cache(key, value, kc, vc, slots, cache_dtype, scales, fp8_max):
    """The caches after the write, built token by token and element by element (float32 -> cache dtype)."""
    kc, vc = kc.clone(), vc.clone()
    x = kc.shape[-1]
    bs = vc.shape[-1]
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        blk, off = slot // bs, slot % bs
        k, v = key[t].float().cpu(), value[t].float().cpu()
        if fp8_max:
            k = (k / scales[0]).clamp(-fp8_max, fp8_max)
            v = (v / scales[1]).clamp(-fp8_max, fp8_max)
        for d in range(k.shape[-1]):
            kc[blk, :, d // x, off, d % x] = k[:, d].to(cache_dtype)
            vc[blk, :, d, off] = v[:, d].to(cache_dtype)
    return kc, vc


@pytest.mark.interpret
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8_e4m3", "fp8_e5m2"])
def test_reshape_and_cache_writes_exact_slots(kv_cache_dtype):
    num_tokens, hkv, d, bs, num_blocks = 6, 2, 32, 8, 4
    dtype = torch.float16
    cache_dtype = CACHE_DTYPES[kv_cache_dtype] or dtype
    x = 16 // torch.empty(0, dtype=cache_dtype).element_size()
    scales = (0.5, 2.0) if kv_cache_dtype != "auto" else (1.0, 1.0)
    key = (torch.randn(num_tokens, hkv, d, device=DEVICE) * 3).to(dtype)
    value = (torch.randn(num_tokens, hkv, d, device=DEVICE) * 3).to(dtype)
    if cache_dtype != dtype:
        # Values exactly representable after the division: Triton's interpreter rounds float -> fp8 wrongly
        # at binade boundaries (7.86 -> 4.0), so the byte check tests addressing and scaling, not rounding.
        key = (key.float().cpu().to(cache_dtype).float() * scales[0]).to(dtype).to(DEVICE)
        value = (value.float().cpu().to(cache_dtype).float() * scales[1]).to(dtype).to(DEVICE)
    key[0, 0, 0] = 5000.0  # saturates e4m3 (448) with the scale below
    # The whole cache starts as random bytes; token 2 is padding (-1); slots spread over blocks.
    kc = torch.randint(0, 256, (num_blocks * hkv * d * bs * cache_dtype.itemsize,), dtype=torch.uint8)
    vc = torch.randint(0, 256, (num_blocks * hkv * d * bs * cache_dtype.itemsize,), dtype=torch.uint8)
    kc = kc.view(cache_dtype).view(num_blocks, hkv, d // x, bs, x).to(DEVICE)
    vc = vc.view(cache_dtype).view(num_blocks, hkv, d, bs).to(DEVICE)
    slots = torch.tensor([9, 0, -1, 31, 17, 8], dtype=torch.int64, device=DEVICE)
    fp8_max = {torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}.get(cache_dtype, 0.0)
    want_k, want_v = _expected_cache(key, value, kc.cpu(), vc.cpu(), slots.cpu(), cache_dtype, scales, fp8_max)
    if cache_dtype != dtype:
        kc_arg, vc_arg = kc.view(torch.uint8), vc.view(torch.uint8)
        ks, vs = torch.tensor([scales[0]], device=DEVICE), scales[1]
    else:
        kc_arg, vc_arg, ks, vs = kc, vc, 1.0, 1.0
    vllm.reshape_and_cache(key, value, kc_arg, vc_arg, slots.to(torch.int32 if fp8_max else torch.int64),
                           kv_cache_dtype, ks, vs)  # fmt: skip
    for name, got, want in (("key_cache", kc, want_k), ("value_cache", vc, want_v)):
        g, w = got.cpu().view(torch.uint8).reshape(-1), want.view(torch.uint8).reshape(-1)
        bad = torch.nonzero(g != w)
        assert bad.numel() == 0, f"{name}: {bad.numel()} bytes differ, first at byte {bad[0].item()}"


# ---------------------------------------------------------------- PyTorch path / host side (CPU run)


@pytest.mark.skipif(INTERPRET, reason="the PyTorch path runs without the interpreter")
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_torch_path_v1_v2(kv_cache_dtype):
    case = Case([600, 33, 1], num_heads=4, num_kv_heads=2, head_size=64, block_size=16, alibi=True,
                kv_cache_dtype=kv_cache_dtype, scales=(0.8, 1.2))  # fmt: skip
    check_v1(case)
    check_v2(case)


def test_errors_name_the_argument():
    case = Case([20], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    out = torch.empty_like(case.query)

    def call(**kw):
        args = dict(out=out, query=case.query, key_cache=case.key_cache, value_cache=case.value_cache,
                    num_kv_heads=2, scale=0.1, block_tables=case.block_tables, seq_lens=case.seq_lens,
                    block_size=16, max_seq_len=20, alibi_slopes=None, kv_cache_dtype="auto",
                    k_scale=1.0, v_scale=1.0)  # fmt: skip
        args.update(kw)
        vllm.paged_attention_v1(**args)

    cases = [
        (dict(num_kv_heads=3), ValueError, "num_kv_heads"),
        (dict(block_size=8), ValueError, "block_size"),
        (dict(block_size=12), ValueError, "block_size"),
        (dict(kv_cache_dtype="int8"), ValueError, "kv_cache_dtype"),
        (dict(kv_cache_dtype="fp8"), TypeError, "key_cache"),
        (dict(seq_lens=case.seq_lens.long()), TypeError, "seq_lens"),
        (dict(block_tables=case.block_tables[:, :1].contiguous(), max_seq_len=20), ValueError, "max_seq_len"),
        (dict(value_cache=case.value_cache.transpose(2, 3)), ValueError, "value_cache"),
        (dict(out=out[:, :2]), ValueError, "out"),
        (dict(query=case.query.float(), out=out.float()), TypeError, "key_cache"),  # float32 needs a float32 cache
        (dict(query=case.query.double()), TypeError, "query"),
        (dict(alibi_slopes=torch.ones(3)), ValueError, "alibi_slopes"),
        (dict(k_scale=torch.ones(2)), ValueError, "k_scale"),
        (dict(v_scale=-1.0), ValueError, "v_scale"),
        # Each check of the common-case fast path (_common_case_ok) must send these to the full checks.
        (dict(num_kv_heads=0), ValueError, "num_kv_heads"),
        (dict(k_scale=0.0), ValueError, "k_scale"),
        (dict(k_scale=float("nan")), ValueError, "k_scale"),
        (dict(scale=float("inf")), TypeError, "scale"),
        (dict(max_seq_len=-1), ValueError, "max_seq_len"),
        (dict(query=torch.empty(1, 4, 64, 2, dtype=torch.float16)[..., 0]), ValueError, "query: expected a contig"),
        (dict(query=case.query[:, :, :36].contiguous(), out=out[:, :, :36].contiguous()), ValueError, "query: .*head"),
        (dict(out=out.bfloat16()), TypeError, "out"),
        (dict(out=torch.empty(1, 4, 64, 2, dtype=torch.float16)[..., 0]), ValueError, "out"),
        (dict(key_cache=case.key_cache.bfloat16()), TypeError, "key_cache"),
        (dict(key_cache=case.key_cache[:, :1]), ValueError, "key_cache"),
        (dict(key_cache=case.key_cache.transpose(0, 1).contiguous().transpose(0, 1)), None, None),
        (dict(key_cache=case.key_cache.transpose(3, 2).contiguous().transpose(3, 2)), ValueError, "key_cache"),
        (dict(value_cache=case.value_cache[:1]), ValueError, "value_cache"),
        (dict(value_cache=case.value_cache.transpose(2, 3).contiguous().transpose(2, 3)), ValueError, "value_cache"),
        (dict(block_tables=case.block_tables.t().contiguous().t()), None, None),
        (dict(block_tables=torch.cat([case.block_tables] * 2, 1)[:, ::2]), ValueError, "block_tables"),
        (dict(block_tables=case.block_tables.long()), TypeError, "block_tables"),
        (dict(block_tables=case.block_tables[:0]), ValueError, "block_tables"),
        (dict(seq_lens=torch.cat([case.seq_lens] * 2)[::2]), None, None),  # stride 2 of one element: contiguous
        (dict(seq_lens=case.seq_lens[:0]), ValueError, "seq_lens"),
    ]
    for kw, exc, name in cases:
        if exc is None:  # valid (unusual strides the layout allows): runs
            call(**kw)
            continue
        with pytest.raises(exc, match=name):
            call(**kw)
    es = torch.empty(1, 4, 1, device=case.query.device)
    tmp_wrong = torch.empty(1, 4, 1, 32, dtype=torch.float16, device=case.query.device)
    two = Case([20, 5], num_heads=4, num_kv_heads=2, head_size=64, block_size=16)
    strided_keys = two.key_cache.transpose(3, 4).contiguous().transpose(3, 4)
    for bad, name in ((dict(seq_lens=torch.stack([two.seq_lens] * 2, 1)[:, 0]), "seq_lens"),
                      (dict(key_cache=strided_keys), "key_cache")):  # fmt: skip
        args = [torch.empty_like(two.query), two.query, two.key_cache, two.value_cache, 2, 0.1, two.block_tables,
                bad.get("seq_lens", two.seq_lens), 16, 20, None, "auto", 1.0, 1.0]  # fmt: skip
        if "key_cache" in bad:
            args[2] = bad["key_cache"]
        with pytest.raises(ValueError, match=name):
            vllm.paged_attention_v1(*args)
    tmp = torch.empty(1, 4, 1, 64, dtype=torch.float16, device=case.query.device)

    def call_v2(es, ml, tmp):
        vllm.paged_attention_v2(out, es, ml, tmp, case.query, case.key_cache, case.value_cache, 2, 0.1,
                                case.block_tables, case.seq_lens, 16, 20, None, "auto", 1.0, 1.0)  # fmt: skip

    call_v2(es, es.clone(), tmp)
    bad_v2 = [
        ((es, es.clone(), tmp_wrong), "tmp_out"),
        ((es, es.clone(), tmp[:, :2]), "tmp_out"),
        ((es, es.clone(), tmp[:, :, :0]), "tmp_out"),
        ((es, es.clone(), tmp.transpose(2, 3)), "tmp_out"),
        ((es, es.clone(), tmp.long()), "tmp_out"),
        ((es[:, :, :0], es.clone(), tmp), "exp_sums"),
        ((es.half(), es.clone(), tmp), "exp_sums"),
        ((es, es[:, :3].clone(), tmp), "max_logits"),
        ((es, torch.empty(1, 4, 2, device=es.device)[:, :, :1], tmp), "max_logits"),
        ((es, torch.empty(1, 4, 1, 2, device=es.device)[..., 0], tmp), "max_logits"),
    ]
    for bufs, name in bad_v2:
        with pytest.raises((ValueError, TypeError), match=name):
            call_v2(*bufs)
    key = torch.randn(3, 2, 64, dtype=torch.float16, device=case.query.device)
    with pytest.raises(ValueError, match="slot_mapping"):
        vllm.reshape_and_cache(
            key, key, case.key_cache, case.value_cache, torch.zeros(2, dtype=torch.int64, device=key.device), "auto"
        )
    with pytest.raises(TypeError, match="value"):
        vllm.reshape_and_cache(
            key, key.float(), case.key_cache, case.value_cache, torch.zeros(3, dtype=torch.int64, device=key.device)
        )


def _named(grid, args, kw):
    """A recorded launch as (grid, (), every argument by parameter name): the launches pass them positionally."""
    from flashinfer_triton import _vllm_impl

    names = _vllm_impl._kernel.arg_names
    assert len(args) == len(names)
    return grid, (), {**dict(zip(names, args)), **kw}


@pytest.mark.skipif(INTERPRET or HAS_CUDA, reason="records the launches on CPU tensors (no kernel runs)")
def test_run_cached_settings_follow_config(monkeypatch):
    """_vllm_impl.run caches what shapes, dtypes and the config fix (constexprs, workspace views): a repeated call
    launches with the same arguments (the same workspace views), a config passed in is followed, and a grown
    workspace is seen by the next call. The kernel is not run: its launch is recorded."""
    from flashinfer_triton import _vllm_impl, clear_host_caches, host_caches

    launches = []
    monkeypatch.setattr(_vllm_impl._kernel, "run", lambda *a, grid, warmup, **kw: launches.append(_named(grid, a, kw)))
    plan_as_on_h100(monkeypatch, _vllm_impl)  # the compiled path's settings
    clear_host_caches("vllm_settings")
    inputs = {}

    def v1(bsz, kv_len, config=None):
        if (bsz, kv_len) not in inputs:
            pages = bsz * kv_len // 16
            q = torch.randn(bsz, 32, 128, dtype=torch.float16)
            inputs[bsz, kv_len] = (q, torch.empty(pages, 8, 16, 16, 8, dtype=torch.float16),
                                   torch.empty(pages, 8, 128, 16, dtype=torch.float16), torch.empty_like(q),
                                   torch.zeros(bsz, kv_len // 16, dtype=torch.int32),
                                   torch.full((bsz,), kv_len, dtype=torch.int32))  # fmt: skip
        _vllm_impl.run(*inputs[bsz, kv_len], num_kv_heads=8, scale=0.1, alibi_slopes=None, k_scale=1.0, v_scale=1.0,
                       partitioned=False, max_seq_len=kv_len, config=config)  # fmt: skip
        return launches[-1]

    def same(x, y):
        (ga, aa, ka), (gb, ab, kb) = x, y
        if ga != gb or len(aa) != len(ab) or ka.keys() != kb.keys():
            return False
        pairs = list(zip(aa, ab)) + [(ka[k], kb[k]) for k in ka]
        return all(
            (u.data_ptr(), u.shape, u.stride(), u.dtype) == (v.data_ptr(), v.shape, v.stride(), v.dtype)
            if isinstance(u, torch.Tensor) else (type(u), u) == (type(v), v)
            for u, v in pairs
        )  # fmt: skip

    first = v1(1, 32768)
    assert first[2]["SPLIT"] and first[2]["v1_chunk"] > 0  # the internal split path
    ws = _vllm_impl.split_workspace(torch.device("cpu"))
    assert first[2]["tmp_ptr"].untyped_storage().data_ptr() == ws[0].untyped_storage().data_ptr()
    again = v1(1, 32768)
    assert same(first, again) and again[2]["tmp_ptr"] is first[2]["tmp_ptr"]  # cached views of the same workspace
    (form,) = host_caches()["vllm_settings"]  # one call form: its settings worked out once
    assert form.op == "paged_attention_v1" and form.shapes == ((32, 128), (8, 128, 16))
    assert form.dtypes == (torch.float16,)
    assert first[2]["BLOCK_N"] == 64 and first[2]["num_warps"] == 4 and first[2]["maxnreg"] == 128
    tiles = v1(1, 32768, _vllm_impl.VllmDecodeConfig(block_n=32, num_stages=6, maxnreg=None))
    assert tiles[2]["BLOCK_N"] == 32 and tiles[2]["num_stages"] == 6 and "maxnreg" not in tiles[2]
    assert not v1(1, 32768, _vllm_impl.VllmDecodeConfig(split_v1=False))[2]["SPLIT"]
    assert same(v1(1, 32768), first)  # the default again: the same launch as the first
    # A larger request grows (replaces) the workspace: the next small call takes views of the new buffer.
    v1(2, 65536)
    grown = _vllm_impl.split_workspace(torch.device("cpu"))
    assert grown is not ws
    small = v1(1, 32768)
    assert small[2]["tmp_ptr"].untyped_storage().data_ptr() == grown[0].untyped_storage().data_ptr()
    # float32 queries: their own tiles (IEEE dot products, no register cap).
    cfg = _vllm_impl.default_config(128, torch.float32)
    assert cfg.block_n == 32 and cfg.maxnreg is None
    assert _vllm_impl.default_config(120, torch.float16) == _vllm_impl.default_config(128, torch.float16)


# ---------------------------------------------------------------- larger set (CUDA)


GPU_SHAPES = [(d, 16) for d in (32, 64, 80, 96, 112, 120, 128, 192, 256)] + [(128, 8), (128, 32), (256, 32), (64, 8)]


@pytest.mark.gpu
@pytest.mark.parametrize("head_size,block_size", GPU_SHAPES, ids=[f"D{d}-bs{b}" for d, b in GPU_SHAPES])
def test_gpu_head_and_block_sizes(head_size, block_size):
    case = Case([1, 17, 513, 1500, 2048], num_heads=8, num_kv_heads=2, head_size=head_size, block_size=block_size)
    check_v1(case)
    check_v2(case)


GPU_GQA = [
    (1, torch.float16, False),
    (3, torch.float16, False),
    (8, torch.float16, False),
    (1, torch.bfloat16, False),
    (4, torch.bfloat16, False),
    (7, torch.bfloat16, False),
    (1, torch.float16, True),
    (4, torch.float16, True),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "group,dtype,alibi", GPU_GQA, ids=[f"g{g}-{str(t)[6:]}-{'alibi' if a else 'plain'}" for g, t, a in GPU_GQA]
)
def test_gpu_gqa_dtypes(group, dtype, alibi):
    case = Case([700, 5, 4096, 1023], num_heads=2 * group, num_kv_heads=2, head_size=128, block_size=16,
                dtype=dtype, alibi=alibi)  # fmt: skip
    check_v1(case)
    check_v2(case)


GPU_TILES = [
    (64, 8, 8, torch.float16, "auto"),
    (80, 16, 1, torch.bfloat16, "auto"),
    (120, 32, 4, torch.float16, "auto"),
    (192, 16, 7, torch.bfloat16, "auto"),
    (128, 16, 4, torch.bfloat16, "fp8_e4m3"),
    (96, 32, 3, torch.float16, "fp8_e5m2"),
    (80, 8, 3, torch.bfloat16, "fp8_e4m3"),
    (32, 16, 8, torch.float32, "auto"),
    (120, 16, 4, torch.float32, "auto"),
    (256, 32, 1, torch.float32, "auto"),
    (128, 16, 4, torch.float32, "fp8"),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "head_size,block_size,group,dtype,kv_cache_dtype",
    GPU_TILES,
    ids=[f"D{d}-bs{b}-g{g}-{str(t)[6:]}-{c}" for d, b, g, t, c in GPU_TILES],
)
def test_gpu_padded_heads_fp8_float32(head_size, block_size, group, dtype, kv_cache_dtype):
    """Padded head sizes (masked chunks), fp8 caches and float32 queries compiled for the GPU: v1 (whole and split)
    and v2, NaN in the unwritten slots of last blocks."""
    scales = (torch.tensor([0.37], device=DEVICE), torch.tensor([2.5], device=DEVICE))
    case = Case([1, 37, 700, 3000], num_heads=2 * group, num_kv_heads=2, head_size=head_size,
                block_size=block_size, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                scales=scales if kv_cache_dtype != "auto" else (1.0, 1.0))  # fmt: skip
    if kv_cache_dtype == "auto":
        _poison_tails(case)
    check_v1(case)
    check_v2(case)
    split = Case([9000, 5], num_heads=2 * group, num_kv_heads=2, head_size=head_size, block_size=block_size,
                 dtype=dtype)  # fmt: skip
    _poison_tails(split)
    check_v1(split)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_gpu_fp8(kv_cache_dtype, dtype):
    scales = (torch.tensor([0.37], device=DEVICE), torch.tensor([2.5], device=DEVICE))
    case = Case([1300, 64, 9], num_heads=16, num_kv_heads=4, head_size=128, block_size=16, dtype=dtype,
                kv_cache_dtype=kv_cache_dtype, scales=scales)  # fmt: skip
    check_v1(case)
    check_v2(case)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_gpu_reshape_and_cache_then_attention(kv_cache_dtype):
    """Write a batch's K/V with reshape_and_cache, then attend over it: the cache round trip."""
    lens, hq, hkv, d, bs = [300, 1025], 8, 4, 128, 16
    case = Case(lens, num_heads=hq, num_kv_heads=hkv, head_size=d, block_size=bs, kv_cache_dtype=kv_cache_dtype,
                scales=(0.5, 0.25) if kv_cache_dtype != "auto" else (1.0, 1.0))  # fmt: skip
    slots = []
    table = case.block_tables.cpu()
    for b, n in enumerate(lens):
        slots += [int(table[b, j // bs]) * bs + j % bs for j in range(n)]
    slot_mapping = torch.tensor(slots + [-1, -1], dtype=torch.int64, device=DEVICE)
    key = torch.randn(len(slots) + 2, hkv, d, device=DEVICE).half()
    value = torch.randn(len(slots) + 2, hkv, d, device=DEVICE).half()
    vllm.reshape_and_cache(key, value, case.key_cache, case.value_cache, slot_mapping, kv_cache_dtype,
                           case.k_scale, case.v_scale)  # fmt: skip
    # The cache read back (times the scales) is the written K/V, to the cache format's precision.
    rtol = {"auto": 1e-3, "fp8": 0.07}[kv_cache_dtype]
    start = 0
    for b, n in enumerate(lens):
        k, v = case.gather(b)
        assert_close_named(f"key_cache[{b}]", k, key[start : start + n], 2e-2 * case.k_scale, rtol)
        assert_close_named(f"value_cache[{b}]", v, value[start : start + n], 2e-2 * case.v_scale, rtol)
        start += n
    check_v2(case)
    check_v1(case)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_v1_internal_split_long():
    """v1 on few long sequences (split inside, merged by the last chunk), NaN tails, repeated calls."""
    case = Case([20000, 5, 3001, 0], num_heads=32, num_kv_heads=8, head_size=128, block_size=16)
    _poison_tails(case)
    want, _, _, _ = case.expected()
    for _ in range(3):
        out = case.run_v1()
        assert_close_named("out", out, want, *TOL[case.dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA")
def test_gpu_cuda_graph_replay_new_lengths():
    """v1 and v2 captured in one CUDA graph after an eager warm-up, replayed after the lengths and the block table
    changed in place (max_seq_len fixed, as vLLM captures): out and v2's partition states equal the reference each
    time."""
    case = Case([20000, 5, 3001, 777], num_heads=32, num_kv_heads=8, head_size=128, block_size=16)
    num_seqs, num_heads, head_size = case.query.shape
    parts = -(-case.max_seq_len // vllm.PARTITION_SIZE)
    out1, out2 = torch.empty_like(case.query), torch.empty_like(case.query)
    es = torch.empty((num_seqs, num_heads, parts), device=DEVICE)
    ml = torch.empty_like(es)
    tmp = torch.empty((num_seqs, num_heads, parts, head_size), device=DEVICE, dtype=case.dtype)
    args = (case.query, case.key_cache, case.value_cache, case.num_kv_heads, case.scale, case.block_tables,
            case.seq_lens, case.block_size, case.max_seq_len, None, "auto", 1.0, 1.0)  # fmt: skip

    def step():
        vllm.paged_attention_v1(out1, *args)
        vllm.paged_attention_v2(out2, es, ml, tmp, *args)

    step()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        step()
    num_blocks, max_blocks = case.key_cache.shape[0], case.block_tables.shape[1]
    for lens in ([20000, 5, 3001, 777], [1, 19000, 0, 4097], [512, 513, 1024, 15000]):
        spare = num_blocks - sum(-(-n // case.block_size) for n in lens)
        table, _ = block_table(lens, case.block_size, max_blocks=max_blocks, spare_blocks=spare, fill=-7, seed=None)
        case.block_tables.copy_(table)
        case.seq_lens.copy_(torch.tensor(lens, dtype=torch.int32))
        case.lens = list(lens)
        for t in (out1, out2, es, ml, tmp):
            t.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        want, ml_w, es_w, tmp_w = case.expected()
        atol, rtol = TOL[case.dtype]
        assert_close_named(f"v1 out {lens}", out1, want, atol, rtol)
        assert_close_named(f"v2 out {lens}", out2, want, atol, rtol)
        assert_close_named(f"max_logits {lens}", ml, ml_w, 1e-3, 1e-3)
        assert_close_named(f"exp_sums {lens}", es, es_w, 1e-3 * es_w.max().item(), 2e-3)
        assert_close_named(f"tmp_out {lens}", tmp, tmp_w, atol, rtol)
