"""vLLM's PagedAttention API (``flashinfer_triton.vllm``) beside our CSR decode and FlashInfer, same data.

For each case of the README's decode table (fp16, block size 16): one set of random pages in
FlashInfer's NHD layout ``[pages, 16, Hkv, D]`` and the same pages re-laid in vLLM's layout
(``key_cache [pages, Hkv, D/8, 16, 8]``, ``value_cache [pages, Hkv, D, 16]``), a shuffled page table
(CSR for ours/FlashInfer, ``block_tables`` for vLLM's API). Timed in one process on one GPU:

* ``v1`` / ``v2``: ``paged_attention_v1`` / ``paged_attention_v2`` (ours, vLLM layout), one row each;
* ``csr``: our ``BatchDecodeWithPagedKVCacheWrapper`` on the CSR cache (plan once, ``run`` timed);
* ``flashinfer``: FlashInfer's wrapper on the CSR cache, the better of ``use_tensor_cores`` False/True.

Rows: ``case, version, ours_ms, ours_tbps, csr_ms, flashinfer_ms, ratio = flashinfer_ms / ours_ms,
ratio_vs_csr = csr_ms / ours_ms`` (target >= 0.95 on every row), ``vllm_pick`` (the version vLLM's own
heuristic would call), host submission time and the largest difference from the CSR output.

    PYTHONPATH=src python3 benchmarks/bench_vllm_paged.py --out DIR [--no-flashinfer] [--cases 1x32768,...]
        [--graph] [--variants v1,v1-n32-s4,v2-r0,...]

``--graph`` adds each version's and CSR's time replayed from CUDA graphs (``*_graph_ms``, no host gaps;
``ratio_vs_csr_graph``). ``--variants`` replaces the rows (``v1`` / ``v2``: the default configuration) with
configurations of our kernel (``_config.VllmDecodeConfig``): the version, then optionally ``-nN`` / ``-wN`` /
``-sN`` (keys per tile / warps / stages), ``-rN`` (register cap, 0: none), ``-mkN`` (states per step of the fused
merge / v2 reduction), ``-whole`` (v1 never split); the other fields are the default configuration's for the
case (``_vllm_impl.default_config``). See ``parse_label``.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _common as C  # noqa: E402

# (name, batch, kv_len, hq, hkv, head_dim)
CASES = [
    ("1x32768 32/8", 1, 32768, 32, 8, 128),
    ("16x8192 32/8", 16, 8192, 32, 8, 128),
    ("64x4096 32/8", 64, 4096, 32, 8, 128),
    ("128x2048 32/8", 128, 2048, 32, 8, 128),
    ("256x1024 32/8", 256, 1024, 32, 8, 128),
    ("64x4096 32/32", 64, 4096, 32, 32, 128),
    ("64x4096 64/8", 64, 4096, 64, 8, 128),
]
BLOCK = 16
DTYPE = torch.float16


def vllm_pick(num_seqs: int, num_heads: int, max_seq_len: int) -> str:
    """vLLM's choice between its two kernels (its paged-attention backend's heuristic)."""
    parts = -(-max_seq_len // 512)
    return "v1" if max_seq_len <= 8192 and (parts == 1 or num_seqs * num_heads > 512) else "v2"


def build(case, device, seed=0):
    """Rotating copies of one random paged cache in both layouts, a shuffled page table, q."""
    name, bsz, kv_len, hq, hkv, d = case
    pages_per = -(-kv_len // BLOCK)
    indptr, indices, last, total = C.page_table([kv_len] * bsz, BLOCK, seed=seed)
    x = 16 // DTYPE.itemsize
    n_rot = C.num_rotations(2 * total * BLOCK * hkv * d * DTYPE.itemsize)
    csr, vl = [], []
    for _ in range(n_rot):
        k = torch.randn((total, BLOCK, hkv, d), dtype=DTYPE, device=device)
        v = torch.randn((total, BLOCK, hkv, d), dtype=DTYPE, device=device)
        csr.append((k, v))
        kc = k.view(total, BLOCK, hkv, d // x, x).permute(0, 2, 3, 1, 4).contiguous()
        vc = v.permute(0, 2, 3, 1).contiguous()
        vl.append((kc, vc))
    return dict(
        indptr=indptr.to(device),
        indices=indices.to(device),
        last=last.to(device),
        block_tables=indices.view(bsz, pages_per).to(device),
        seq_lens=torch.full((bsz,), kv_len, dtype=torch.int32, device=device),
        csr=csr,
        vllm=vl,
        q=torch.randn((bsz, hq, d), dtype=DTYPE, device=device),
        nbytes=C.decode_bytes(bsz, kv_len, hq, hkv, d, DTYPE.itemsize, DTYPE.itemsize),
    )


def parse_label(label, head_dim):
    """(version, configuration or None for the default) of a row label such as ``v1``, ``v2-r0``, ``v1-n32-w4-s2``,
    ``v1-whole``, ``v2-mk8`` (see the module docstring); an unknown part raises ValueError."""
    from dataclasses import replace

    from flashinfer_triton import _vllm_impl

    version, parts = label[:2], label.split("-")[1:]
    if version not in ("v1", "v2"):
        raise ValueError(f"--variants: {label!r} does not start with v1 or v2")
    if not parts:
        return version, None
    fields = {}
    for part in parts:
        if part == "whole":
            fields["split_v1"] = False
        elif part[:2] == "mk" and part[2:].isdigit():
            fields["merge_max_k"] = int(part[2:])
        elif part[:1] in "nwsr" and part[1:].isdigit():
            key = {"n": "block_n", "w": "num_warps", "s": "num_stages", "r": "maxnreg"}[part[0]]
            fields[key] = int(part[1:]) or None if key == "maxnreg" else int(part[1:])
        else:
            raise ValueError(f"--variants: unknown part {part!r} in {label!r}")
    return version, replace(_vllm_impl.default_config(head_dim, DTYPE), **fields)


def vllm_fns(case, data, version, config=None):
    """The public ``paged_attention_v1/v2`` on each cache copy; with ``config``, the implementation's ``run()`` on
    the same arguments with that configuration."""
    from flashinfer_triton import _vllm_impl, vllm

    name, bsz, kv_len, hq, hkv, d = case
    q, bt, sl = data["q"], data["block_tables"], data["seq_lens"]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    parts = -(-kv_len // vllm.PARTITION_SIZE)
    es = torch.empty((bsz, hq, parts), dtype=torch.float32, device=q.device)
    ml = torch.empty_like(es)
    tmp = torch.empty((bsz, hq, parts, d), dtype=DTYPE, device=q.device)

    def make(kc, vc):
        if config is not None:
            kw = dict(num_kv_heads=hkv, scale=scale, alibi_slopes=None, k_scale=1.0, v_scale=1.0, max_seq_len=kv_len,
                      config=config)  # fmt: skip
            if version == "v2":
                kw.update(partitioned=True, max_num_partitions=parts, exp_sums=es, max_logits=ml, tmp_out=tmp)
            else:
                kw.update(partitioned=False)
            return lambda: _vllm_impl.run(q, kc, vc, out, bt, sl, **kw)
        if version == "v1":
            return lambda: vllm.paged_attention_v1(
                out, q, kc, vc, hkv, scale, bt, sl, BLOCK, kv_len, None, "auto", 1.0, 1.0
            )
        return lambda: vllm.paged_attention_v2(
            out, es, ml, tmp, q, kc, vc, hkv, scale, bt, sl, BLOCK, kv_len, None, "auto", 1.0, 1.0
        )

    return [make(kc, vc) for kc, vc in data["vllm"]], out


def graph_ms(fns):
    """Median ms of the callables replayed from CUDA graphs (one graph each, replayed in turn)."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for f in fns:
            f()
    torch.cuda.current_stream().wait_stream(stream)
    graphs = []
    for f in fns:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            f()
        graphs.append(g)
    return C.bench(C.rotating([g.replay for g in graphs]))


def csr_fns(case, data, ws):
    import flashinfer_triton as fit

    name, bsz, kv_len, hq, hkv, d = case
    w = fit.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD")
    w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, BLOCK, q_data_type=DTYPE, kv_data_type=DTYPE)
    q = data["q"]
    return [lambda kv=kv: w.run(q, kv) for kv in data["csr"]], (lambda: w.run(q, data["csr"][0]))


def flashinfer_ms(fi, case, data, ws):
    """Best of FlashInfer's two decode paths (ms), its output, and per-path details."""
    name, bsz, kv_len, hq, hkv, d = case
    best, best_out, info = None, None, {}
    for tc in (False, True):
        key = "fi_tc" if tc else "fi"
        try:
            w = fi.BatchDecodeWithPagedKVCacheWrapper(ws, "NHD", use_tensor_cores=tc)
            w.plan(data["indptr"], data["indices"], data["last"], hq, hkv, d, BLOCK, q_data_type=DTYPE,
                   kv_data_type=DTYPE)  # fmt: skip
            q = data["q"]
            out = w.run(q, data["csr"][0])
            ms = C.bench(C.rotating([lambda kv=kv, w=w, q=q: w.run(q, kv) for kv in data["csr"]]))
            info[f"{key}_ms"] = ms
            if best is None or ms < best:
                best, best_out = ms, out
        except Exception as exc:  # pragma: no cover - depends on the machine
            info[f"{key}_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
    return best, best_out, info


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-flashinfer", action="store_true")
    ap.add_argument("--cases", default=None, help="comma-separated case name prefixes (default: all)")
    ap.add_argument("--graph", action="store_true")
    ap.add_argument("--variants", default=None, help="row labels, e.g. v1,v1-n32-s4,v2-r0 (replaces the rows)")
    args = ap.parse_args()
    device = torch.device("cuda")
    fi = None if args.no_flashinfer else C.import_flashinfer()
    meta = {
        "device": torch.cuda.get_device_name(),
        "block_size": BLOCK,
        "dtype": "float16",
        "flashinfer": getattr(fi, "__version__", None) if fi is not None else None,
        "ratio": "flashinfer_ms / ours_ms",
        "ratio_vs_csr": "csr_ms / ours_ms (target >= 0.95)",
    }
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    fi_ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    cases = CASES
    if args.cases:
        wanted = [c.strip() for c in args.cases.split(",") if c.strip()]
        cases = [c for c in CASES if any(c[0].startswith(w) for w in wanted)]
    rows = []
    for case in cases:
        name, bsz, kv_len, hq, hkv, d = case
        data = build(case, device)
        cfns, cfirst = csr_fns(case, data, ws)
        csr_out = cfirst().clone()
        csr_ms = C.bench(C.rotating(cfns))
        csr_host = C.host_time_us(cfns[0])
        csr_graph = None
        if args.graph:
            try:
                csr_graph = graph_ms(cfns)
            except Exception as exc:
                print(f"[csr graph] {type(exc).__name__}: {exc}", flush=True)
        fms, fout, finfo = (None, None, {}) if fi is None else flashinfer_ms(fi, case, data, fi_ws)
        pick = vllm_pick(bsz, hq, kv_len)
        versions = ["v1", "v2"]
        if args.variants:
            versions = [v.strip() for v in args.variants.split(",") if v.strip()]
        for label in versions:
            version, config = parse_label(label, d)
            row = dict(case=name, version=label, vllm_pick=pick == version)
            try:
                fns, out = vllm_fns(case, data, version, config)
                fns[0]()
                row["maxdiff_vs_csr"] = float((out.float() - csr_out.float()).abs().max())
                if fout is not None:
                    row["maxdiff_vs_flashinfer"] = float((out.float() - fout.float()).abs().max())
                ms = C.bench(C.rotating(fns))
                row.update(ours_ms=ms, ours_tbps=C.tbps(data["nbytes"], ms), host_us=C.host_time_us(fns[0]))
                row["ratio_vs_csr"] = csr_ms / ms
                if fms is not None:
                    row["ratio"] = fms / ms
                if csr_graph is not None:
                    row["ours_graph_ms"] = graph_ms(fns)
                    row["csr_graph_ms"] = csr_graph
                    row["ratio_vs_csr_graph"] = csr_graph / row["ours_graph_ms"]
            except Exception as exc:  # a failure is reported in the row, the table goes on
                row["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
            row.update(csr_ms=csr_ms, csr_tbps=C.tbps(data["nbytes"], csr_ms), csr_host_us=csr_host)
            row["flashinfer_ms"] = fms
            row.update(finfo)
            rows.append(row)
            C.print_table(
                [row],
                ["case", "version", "vllm_pick", "ours_ms", "ours_tbps", "csr_ms", "flashinfer_ms", "ratio",
                 "ratio_vs_csr", "ours_graph_ms", "csr_graph_ms", "ratio_vs_csr_graph", "maxdiff_vs_csr", "host_us",
                 "csr_host_us"],
            )  # fmt: skip
            C.write_json("vllm", rows, meta, args.out)  # partial results survive a timeout
        if csr_graph is not None and args.variants:
            # CSR again after the rows: the drift between the two CSR figures bounds the comparison's noise.
            csr_end = graph_ms(cfns)
            for row in rows:
                if row["case"] == name:
                    row["csr_graph_ms_end"] = csr_end
            print(f"[{name}] CSR graph {csr_graph * 1e3:.1f} us before the rows, {csr_end * 1e3:.1f} after", flush=True)
            C.write_json("vllm", rows, meta, args.out)
        del data, cfns, cfirst
        torch.cuda.empty_cache()
    path = C.write_json("vllm", rows, meta, args.out)
    print(f"[bench] wrote {path}")


if __name__ == "__main__":
    main()
