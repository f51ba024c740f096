"""One small launch of every Hopper-era attention path, for compute-sanitizer; each output checked against the float32
reference.

On the GPU machine (``make gpu-sanitize`` runs both steps):

    PYTHONPATH=src python3 scripts/sanitize_kernels.py                  # compile and check every case first
    PYTHONPATH=src compute-sanitizer --tool memcheck --error-exitcode 1 --print-limit 20 \\
        python3 scripts/sanitize_kernels.py
    PYTHONPATH=src compute-sanitizer --tool racecheck --error-exitcode 1 \\
        python3 scripts/sanitize_kernels.py --only gluon

Run it once without the sanitizer first: Triton's compiles then come from its cache (compiling under the sanitizer
takes minutes). ``--shard I/N`` runs every N-th case, so that N processes can compile the cases side by side.

The cases: the Gluon prefill kernel (head dims 64, 128 and 256; GQA groups 1, 3, 5, 7; ragged K/V and pages of 8,
16 and 64 keys in both layouts; causal and full; a split plan with its merge launch), the prefill variants the
Gluon kernel may or may not take (page size 1, window, soft cap, custom mask, fp8 K/V), the Gluon decode kernel
(head dims 128 and 256, split and unsplit), the Triton kernels at head dims 320 and 512, and vLLM's layout (v1 and
v2). The Gluon configurations are widened to every head dim and group the prefill kernel supports and to every
decode plan (unsplit ones too), as the kernel tests do. Each case prints the kernel that ran (``gluon`` /
``triton``), and a case meant for the Gluon kernel fails when it did not take it on an sm_90 GPU with Gluon on.

Inputs are sized exactly (no padding after q, K/V, the page tables or the outputs), every cache slot no request
owns holds NaN, and outputs are filled with NaN before the call. The CUDA caching allocator is turned off
(``PYTORCH_NO_CUDA_MEMORY_CACHING=1``, set here unless already set) so that every tensor is its own allocation and
memcheck sees a read past its end; the library's workspaces are single buffers, so a stray access inside one is
not seen. ``--device cpu`` runs the same cases through the library's PyTorch path (a check of this script only).

Exit status 1 when an output is off or a case missed its kernel; the sanitizer's own errors come from its
``--error-exitcode``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import os
import sys
import time

os.environ.setdefault("PYTORCH_NO_CUDA_MEMORY_CACHING", "1")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import torch  # noqa: E402

import flashinfer_triton as fi  # noqa: E402
from flashinfer_triton import _config, _decode_impl, _prefill_impl, _sm90  # noqa: E402
from flashinfer_triton import reference as R  # noqa: E402
from flashinfer_triton import vllm as V  # noqa: E402
from flashinfer_triton.testing import block_table, make_paged, paged_caches  # noqa: E402

FP16, BF16 = torch.float16, torch.bfloat16
FP8 = getattr(torch, "float8_e4m3fn", None)
# (o atol, o rtol) by query dtype against the float32 reference; lse (base 2) within LSE_TOL.
TOL = {FP16: (5e-3, 5e-3), BF16: (3e-2, 3e-2)}
LSE_TOL = (5e-3, 5e-3)


@dataclasses.dataclass(frozen=True)
class Case:
    name: str
    kind: str  # ragged | paged | decode | vllm_v1 | vllm_v2
    args: dict
    gluon: bool = False  # meant for the Gluon kernel (on sm_90 with Gluon on)
    split: bool | None = None  # the plan splits the KV (None: not checked)


def _cases() -> list[Case]:
    g, c = True, dict(causal=True)
    return [
        # Gluon prefill: head dims, groups that do not divide 128, pages, a split plan
        Case("gluon-prefill-d128-g1-causal", "ragged", dict(lens=[(300, 300), (130, 700)], hq=2, hkv=2, d=128, **c), g),
        Case(
            "gluon-prefill-d64-g2-full-bf16",
            "ragged",
            dict(lens=[(200, 333), (130, 5)], hq=4, hkv=2, d=64, dtype=BF16),
            g,
        ),  # fmt: skip
        Case(
            "gluon-prefill-d256-g1-causal-bf16",
            "ragged",
            dict(lens=[(200, 500), (129, 129)], hq=2, hkv=2, d=256, dtype=BF16, **c),
            g,
        ),  # fmt: skip
        Case("gluon-prefill-d128-g3-causal", "ragged", dict(lens=[(150, 400), (43, 43)], hq=6, hkv=2, d=128, **c), g),
        Case(
            "gluon-prefill-d128-g5-full-bf16",
            "ragged",
            dict(lens=[(100, 333), (30, 5)], hq=10, hkv=2, d=128, dtype=BF16),
            g,
        ),  # fmt: skip
        Case("gluon-prefill-d128-g7-causal", "ragged", dict(lens=[(120, 700), (17, 17)], hq=7, hkv=1, d=128, **c), g),
        Case(
            "gluon-prefill-paged-ps8-g4-causal",
            "paged",
            dict(lens=[(150, 300), (130, 77)], hq=8, hkv=2, d=128, ps=8, **c),
            g,
        ),  # fmt: skip
        Case(
            "gluon-prefill-paged-ps16-d256-g2-full-HND-bf16",
            "paged",
            dict(lens=[(150, 400)], hq=4, hkv=2, d=256, ps=16, layout="HND", dtype=BF16),
            g,
        ),
        Case(
            "gluon-prefill-paged-ps64-g1-causal",
            "paged",
            dict(lens=[(200, 333), (130, 64)], hq=2, hkv=2, d=128, ps=64, **c),
            g,
        ),  # fmt: skip
        Case("gluon-prefill-split-g4-full", "ragged", dict(lens=[(64, 9000)], hq=8, hkv=2, d=128), g, split=True),
        # prefill variants without the Gluon flag: whichever kernel the plan picks (the window and the soft cap take the
        # Gluon kernel on sm_90; pages of 1 key, custom masks and fp8 K/V the Triton one)
        Case("prefill-paged-ps1-causal", "paged", dict(lens=[(100, 300), (30, 30)], hq=8, hkv=2, d=128, ps=1, **c)),
        Case("prefill-window-g4", "ragged", dict(lens=[(200, 600)], hq=8, hkv=2, d=128, window_left=100, **c)),
        Case("prefill-softcap-g1", "ragged", dict(lens=[(200, 400)], hq=2, hkv=2, d=128, logits_soft_cap=30.0, **c)),
        Case("prefill-custom-mask-g2", "ragged", dict(lens=[(150, 300), (40, 90)], hq=4, hkv=2, d=128, mask=True)),
        Case(
            "prefill-paged-fp8-kv-ps16",
            "paged",
            dict(lens=[(150, 300)], hq=8, hkv=2, d=128, ps=16, kv_dtype=FP8, k_scale=0.8, v_scale=1.25, **c),
        ),  # fmt: skip
        # Gluon decode (unsplit and split), head dims 128 and 256
        Case(
            "gluon-decode-d128-g4",
            "decode",
            dict(lens=[1, 17, 64, 65, 200, 256], hq=32, hkv=8, d=128, ps=16),
            g,
            split=False,
        ),  # fmt: skip
        Case("gluon-decode-d128-g4-split", "decode", dict(lens=[9000, 33], hq=32, hkv=8, d=128, ps=16), g, split=True),
        Case(
            "gluon-decode-d256-g2-bf16",
            "decode",
            dict(lens=[1, 100, 256], hq=8, hkv=4, d=256, ps=16, dtype=BF16),
            g,
            split=False,
        ),  # fmt: skip
        Case(
            "gluon-decode-d256-g4-split-bf16",
            "decode",
            dict(lens=[6000], hq=8, hkv=2, d=256, ps=16, dtype=BF16),
            g,
            split=True,
        ),  # fmt: skip
        # the Triton kernels past head dim 256
        Case("prefill-d512-causal", "ragged", dict(lens=[(40, 100), (7, 7)], hq=4, hkv=2, d=512, causal=True)),
        Case("prefill-d320-paged-causal", "paged", dict(lens=[(20, 50), (7, 7)], hq=4, hkv=2, d=320, ps=16, **c)),
        Case("decode-d512-paged", "decode", dict(lens=[300, 17], hq=4, hkv=2, d=512, ps=16)),
        Case("decode-d320-paged", "decode", dict(lens=[100, 5], hq=4, hkv=2, d=320, ps=16)),
        # vLLM's cache layout
        Case("vllm-v1-d128-g4-bs16", "vllm_v1", dict(lens=[700, 33, 1], hq=16, hkv=4, d=128, bs=16)),
        Case("vllm-v2-d128-g2-bs16", "vllm_v2", dict(lens=[1500, 100], hq=8, hkv=4, d=128, bs=16)),
    ]


# ----------------------------------------------------------------------------- checks
class Mismatch(AssertionError):
    pass


def _close(name: str, got: torch.Tensor, want: torch.Tensor, atol: float, rtol: float) -> float:
    """The worst |got - want| (NaN never passes, -inf must match); raises Mismatch past atol + rtol |want|."""
    got, want = got.detach().float().cpu(), want.detach().float().cpu()
    if got.shape != want.shape:
        raise Mismatch(f"{name}: shape {tuple(got.shape)} != {tuple(want.shape)}")
    same_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    err = torch.where(same_inf, torch.zeros_like(got), (got - want).abs()).nan_to_num(nan=math.inf)
    bound = atol + rtol * want.abs().nan_to_num(posinf=0.0, neginf=0.0)
    bad = err > bound
    if bad.any():
        raise Mismatch(f"{name}: {int(bad.sum())} of {got.numel()} off, worst error {err.max().item():.3g}")
    return err.max().item() if err.numel() else 0.0


def _nan(x: torch.Tensor) -> torch.Tensor:
    return x.fill_(float("nan"))


def _check_rows(out, lse, expected, dtype) -> float:
    """out / lse rows against ``expected``: a list of (row start, o, lse) per request."""
    worst = 0.0
    for b, (start, eo, el) in enumerate(expected):
        n = eo.shape[0]
        worst = max(worst, _close(f"out[{b}]", out[start : start + n], eo, *TOL[dtype]))
        if lse is not None:
            worst = max(worst, _close(f"lse[{b}]", lse[start : start + n], el, *LSE_TOL))
    return worst


def _ws(device) -> torch.Tensor:
    return torch.empty(64 << 20, dtype=torch.uint8, device=device)


def _indptr(counts) -> torch.Tensor:
    return torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int32)


def _ref_opts(a: dict) -> dict:
    return {k: a[k] for k in ("causal", "window_left", "logits_soft_cap") if k in a}


# ----------------------------------------------------------------------------- runners
def _run_ragged(a: dict, dev) -> float:
    dtype, hq, hkv, d = a.get("dtype", FP16), a["hq"], a["hkv"], a["d"]
    qo, kv = [x for x, _ in a["lens"]], [y for _, y in a["lens"]]
    qi, ki = _indptr(qo), _indptr(kv)
    q = torch.randn(sum(qo), hq, d, device=dev).to(dtype)
    k = torch.randn(sum(kv), hkv, d, device=dev).to(dtype)
    v = torch.randn(sum(kv), hkv, d, device=dev).to(dtype)
    masks = None
    extra = {k_: a[k_] for k_ in ("causal", "window_left", "logits_soft_cap") if k_ in a}
    if a.get("mask"):  # a band of random width per row, plus a few random keys: partial, full and empty tiles
        masks = []
        for n_q, n_k in zip(qo, kv):
            i = torch.arange(n_q)[:, None] + (n_k - n_q)
            j = torch.arange(n_k)[None, :]
            masks.append(((j <= i) & (j > i - 64)) | (torch.rand(n_q, n_k) < 0.05))
        extra["custom_mask"] = torch.cat([m.reshape(-1) for m in masks]).to(dev)
    w = fi.BatchPrefillWithRaggedKVCacheWrapper(_ws(dev), "NHD")
    w.plan(qi.to(dev), ki.to(dev), hq, hkv, d, q_data_type=dtype, **extra)
    out = _nan(torch.empty_like(q))
    lse = _nan(torch.empty(q.shape[:2], dtype=torch.float32, device=dev))
    w.run(q, k, v, out=out, lse=lse)
    expected = []
    for b in range(len(qo)):
        qs, ks = int(qi[b]), int(ki[b])
        opts = _ref_opts(a) if masks is None else dict(custom_mask=masks[b])
        eo, el = R.attention(q[qs : qs + qo[b]], k[ks : ks + kv[b]], v[ks : ks + kv[b]], **opts)
        expected.append((qs, eo, el))
    return _check_rows(out, lse, expected, dtype)


def _run_paged(a: dict, dev) -> float:
    dtype, hq, hkv, d, ps = a.get("dtype", FP16), a["hq"], a["hkv"], a["d"], a["ps"]
    kv_dtype, layout = a.get("kv_dtype", dtype), a.get("layout", "NHD")
    qo, kv = [x for x, _ in a["lens"]], [y for _, y in a["lens"]]
    cache, indptr, indices, last, ks, vs = make_paged(kv, ps, hkv, d, dtype, dev, layout, nan_unused=True)
    if kv_dtype != dtype:  # (fp8 values drawn in the query dtype, NaN slots included, then cast)
        cache, ks, vs = cache.to(kv_dtype), [x.to(kv_dtype) for x in ks], [x.to(kv_dtype) for x in vs]
    qi = _indptr(qo)
    q = torch.randn(sum(qo), hq, d, device=dev).to(dtype)
    w = fi.BatchPrefillWithPagedKVCacheWrapper(_ws(dev), layout)
    w.plan(qi.to(dev), indptr, indices, last, hq, hkv, d, ps, q_data_type=dtype, kv_data_type=kv_dtype,
           **{k: a[k] for k in ("causal", "window_left", "logits_soft_cap") if k in a})  # fmt: skip
    scales = {k: a[k] for k in ("k_scale", "v_scale") if k in a}
    out = _nan(torch.empty_like(q))
    lse = _nan(torch.empty(q.shape[:2], dtype=torch.float32, device=dev))
    w.run(q, cache, out=out, lse=lse, **scales)
    expected = []
    for b in range(len(qo)):
        qs = int(qi[b])
        eo, el = R.attention(q[qs : qs + qo[b]], ks[b], vs[b], **_ref_opts(a), **scales)
        expected.append((qs, eo, el))
    return _check_rows(out, lse, expected, dtype)


def _run_decode(a: dict, dev) -> float:
    dtype, hq, hkv, d, ps = a.get("dtype", FP16), a["hq"], a["hkv"], a["d"], a["ps"]
    cache, indptr, indices, last, ks, vs = make_paged(a["lens"], ps, hkv, d, dtype, dev, nan_unused=True)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(_ws(dev), "NHD")
    w.plan(indptr, indices, last, hq, hkv, d, ps, q_data_type=dtype)
    q = torch.randn(len(a["lens"]), hq, d, device=dev).to(dtype)
    out = _nan(torch.empty_like(q))
    lse = _nan(torch.empty(q.shape[:2], dtype=torch.float32, device=dev))
    w.run(q, cache, out=out, lse=lse)
    expected = [(b, *R.attention(q[b : b + 1], ks[b], vs[b])) for b in range(len(a["lens"]))]
    return _check_rows(out, lse, expected, dtype)


def _run_vllm(a: dict, dev, v2: bool) -> float:
    """vLLM's layout: keys [blocks, Hkv, D/8, bs, 8], values [blocks, Hkv, D, bs] (fp16), a block table whose
    entries past each sequence's blocks hold -7 (never to be read)."""
    lens, hq, hkv, d, bs = a["lens"], a["hq"], a["hkv"], a["d"], a["bs"]
    nblk = [-(-n // bs) for n in lens]
    table, num_blocks = block_table(lens, bs, max_blocks=max(nblk) + 1, spare_blocks=2, fill=-7, seed=None)
    ((kp, vp),) = paged_caches(num_blocks, bs, hkv, d, FP16, dev)  # NHD pages, then vLLM's layout
    key_cache = kp.view(num_blocks, bs, hkv, d // 8, 8).permute(0, 2, 3, 1, 4).contiguous()
    value_cache = vp.permute(0, 2, 3, 1).contiguous()
    q = torch.randn(len(lens), hq, d, device=dev).half()
    out = _nan(torch.empty_like(q))
    scale = d**-0.5
    tab, seq_lens, max_len = table.to(dev), torch.tensor(lens, dtype=torch.int32, device=dev), max(lens)
    if v2:
        parts = -(-max_len // V.PARTITION_SIZE)
        exp_sums = _nan(torch.empty(len(lens), hq, parts, dtype=torch.float32, device=dev))
        max_logits = _nan(torch.empty_like(exp_sums))
        tmp_out = _nan(torch.empty(len(lens), hq, parts, d, dtype=FP16, device=dev))
        V.paged_attention_v2(out, exp_sums, max_logits, tmp_out, q, key_cache, value_cache, hkv, scale, tab,
                             seq_lens, bs, max_len)  # fmt: skip
    else:
        V.paged_attention_v1(out, q, key_cache, value_cache, hkv, scale, tab, seq_lens, bs, max_len)
    expected = []
    for b, n in enumerate(lens):
        blocks = table[b, : nblk[b]].long().to(dev)
        kb, vb = kp[blocks].reshape(-1, hkv, d)[:n], vp[blocks].reshape(-1, hkv, d)[:n]
        eo, _ = R.attention(q[b : b + 1], kb, vb, sm_scale=scale)
        expected.append((b, eo, None))
    return _check_rows(out, None, expected, FP16)


RUNNERS = {
    "ragged": _run_ragged,
    "paged": _run_paged,
    "decode": _run_decode,
    "vllm_v1": lambda a, dev: _run_vllm(a, dev, False),
    "vllm_v2": lambda a, dev: _run_vllm(a, dev, True),
}


# ----------------------------------------------------------------------------- driver
def _watch_gluon():
    """Wraps both Gluon launchers: each records (which, split) of the plans it ran into the returned list."""
    ran: list[tuple[str, bool]] = []
    real_p, real_d = _prefill_impl._run_gluon, _decode_impl._run_gluon

    def prefill(p, *a, **kw):
        ran.append(("prefill", p.part_o is not None))
        return real_p(p, *a, **kw)

    def decode(p, *a, **kw):
        ran.append(("decode", p.chunk is not None))
        return real_d(p, *a, **kw)

    _prefill_impl._run_gluon, _decode_impl._run_gluon = prefill, decode
    return ran


def _widen_gluon() -> _config.using:
    """Every head dim and group the Gluon prefill kernel supports (D64 group 1 included), every decode plan it
    covers (as a ``_config.using`` block; FLASHINFER_TRITON_GLUON=0 keeps Gluon off)."""
    widen = {
        "gluon_prefill": dataclasses.replace(
            _config.GLUON_PREFILL, head_dims=(64, 128, 256), groups=tuple(range(1, 17)), d64_min_group=1
        )
    }
    if _config.GLUON_DECODE.plans != "none":
        widen["gluon_decode"] = dataclasses.replace(_config.GLUON_DECODE, plans="all")
    return _config.using(**widen)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", nargs="*", default=[], help="run the cases whose names contain any of these")
    ap.add_argument("--shard", default="0/1", help="I/N: every N-th case from the I-th (compiling in parallel)")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    cases = [c for c in _cases() if not args.only or any(s in c.name for s in args.only)]
    i, n = (int(x) for x in args.shard.split("/"))
    cases = cases[i::n]
    if args.list:
        print("\n".join(c.name for c in cases))
        return 0
    dev = torch.device(args.device)
    on_gpu = dev.type == "cuda"
    if on_gpu and not torch.cuda.is_available():
        print("no CUDA device (--device cpu runs the PyTorch path)", file=sys.stderr)
        return 2
    with _widen_gluon():
        return _run_cases(cases, dev, on_gpu, args.seed)


def _run_cases(cases, dev, on_gpu: bool, seed: int) -> int:
    want_gluon = on_gpu and _config.GLUON_PREFILL.enabled and _sm90.gluon_device_ok(dev)
    ran = _watch_gluon()
    failed = 0
    for case in cases:
        if case.kind == "paged" and case.args.get("kv_dtype", 0) is None:
            print(f"{case.name:50s} skipped (torch without float8)")
            continue
        torch.manual_seed(seed)
        ran.clear()
        t0 = time.perf_counter()
        try:
            worst = RUNNERS[case.kind](case.args, dev)
            if on_gpu:
                torch.cuda.synchronize()
            problems = []
            kernel = "torch" if not on_gpu else ("gluon" if ran else "triton")
            if want_gluon and case.gluon and not ran:
                problems.append("did not take the Gluon kernel")
            if ran and case.split is not None and any(s != case.split for _, s in ran):
                problems.append(f"split {[s for _, s in ran]}, expected {case.split}")
            status = "ok" if not problems else "FAILED: " + "; ".join(problems)
        except Exception as e:  # (a mismatch, or the library's error: the other cases still run)
            kernel = ("gluon" if ran else "triton") if on_gpu else "torch"
            worst, status = math.nan, f"FAILED: {type(e).__name__}: {e}"
        failed += not status.startswith("ok")
        split = "split" if any(s for _, s in ran) else ""
        print(f"{case.name:50s} {kernel:6s} {split:5s} max err {worst:.2e}  {time.perf_counter() - t0:6.2f} s  "
              f"{status}", flush=True)  # fmt: skip
    print(f"{len(cases) - failed} of {len(cases)} cases ok")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
