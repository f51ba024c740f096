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
        [--graph] [--k3d]

``--graph`` adds each version's and CSR's time replayed from CUDA graphs (``*_graph_ms``, no host gaps;
``ratio_vs_csr_graph``); ``--k3d`` adds rows ``-k2d`` / ``-k3d`` with the keys loaded as ``[BLOCK_N, D]``
or ``[D/x, BLOCK_N, x]`` tiles (``_decode_impl.VLLM_K3D``; plain rows use the default); ``--r128`` adds
each row again with the variant capped at 128 registers. ``--variants v1-k1,v1-k2,v1-k2-r128,v2-k2`` replaces
the row list: version, then optionally ``-kN`` (``VLLM_K3D = N``: 0 keys as ``[BLOCK_N, D]``, 1 as
``[D/x, BLOCK_N, x]`` + permute, 2 as ``[BLOCK_N, D/x, x]`` without permute; 3-5 whole-block tiles, one page
number per block: 3 keys ``[NB, D/x, bs*x]`` + values ``[NB, D, bs]``, 4 both flat ``[NB, D*bs]``, 5 flat keys +
``[NB, D, bs]`` values), ``-rN`` (register cap N), ``-p``
(page numbers one tile ahead), ``-nN`` / ``-wN`` / ``-sN`` (BLOCK_N / warps / stages), ``-ppN`` (v2: N
512-key partitions per program, ``VLLM_V2_PARTS_PER_PROGRAM``); see ``parse_label``.
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


def parse_label(label):
    """(version, ``_decode_impl`` settings, tile overrides) of a row label such as ``v1``, ``v2-k2d``,
    ``v1-k2-r128``, ``v1-k2-p-n32-w4-s2``: ``-kN`` VLLM_K3D, ``-rN`` VLLM_MAXNREG, ``-p`` VLLM_PAGE_PREFETCH,
    ``-nN`` / ``-wN`` / ``-sN`` BLOCK_N / num_warps / num_stages (``CONFIG_OVERRIDE``), ``-ppN`` (v2)
    VLLM_V2_PARTS_PER_PROGRAM = N (N 512-key partitions walked per program), ``-mkN`` N states per step of the
    fused merge / v2 reduction (MERGE_MAX_K = N, MERGE_TILE unbounded), ``-f0`` / ``-f1`` v2's separate
    reduce launch / the fused reduction also under CUDA-graph capture (default "auto": fused eagerly,
    separate in graphs), ``-op`` the fused merge / reduction online (MERGE_TWO_PASS = False)."""
    settings, tiles = {}, {}
    for part in label.split("-")[1:]:
        if part in ("k2d", "k3d"):
            settings["VLLM_K3D"] = part == "k3d"
        elif part == "p":
            settings["VLLM_PAGE_PREFETCH"] = True
        elif part[:2] == "mk" and part[2:].isdigit():
            settings["MERGE_MAX_K"] = int(part[2:])
            settings["MERGE_TILE"] = 1 << 30
        elif part in ("f0", "f1"):
            settings["VLLM_V2_FUSED"] = part == "f1"
        elif part == "op":
            settings["MERGE_TWO_PASS"] = False
        elif part[:2] == "pp" and part[2:].isdigit():
            settings["VLLM_V2_PARTS_PER_PROGRAM"] = int(part[2:])
        elif part[:1] in "krnws" and part[1:].isdigit():
            key = {"k": "VLLM_K3D", "r": "VLLM_MAXNREG"}.get(part[0])
            if key:
                settings[key] = int(part[1:])
            else:
                tiles[{"n": "BLOCK_N", "w": "num_warps", "s": "num_stages"}[part[0]]] = int(part[1:])
        else:
            raise ValueError(f"--variants: unknown part {part!r} in {label!r}")
    return label[:2], settings, tiles


def vllm_fns(case, data, version):
    from flashinfer_triton import vllm

    name, bsz, kv_len, hq, hkv, d = case
    q, bt, sl = data["q"], data["block_tables"], data["seq_lens"]
    scale = 1.0 / math.sqrt(d)
    out = torch.empty_like(q)
    parts = -(-kv_len // vllm.PARTITION_SIZE)
    es = torch.empty((bsz, hq, parts), dtype=torch.float32, device=q.device)
    ml = torch.empty_like(es)
    tmp = torch.empty((bsz, hq, parts, d), dtype=DTYPE, device=q.device)

    def make(kc, vc):
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
    ap.add_argument("--k3d", action="store_true")
    ap.add_argument("--r128", action="store_true", help="also rows with the vLLM variant capped at 128 registers")
    ap.add_argument("--variants", default=None, help="row labels, e.g. v1-k1,v1-k2,v1-k2-r128 (replaces the rows)")
    args = ap.parse_args()
    from flashinfer_triton import _decode_impl

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
        # Rows "v1"/"v2" run the module's default key tiling; with --k3d, "-k2d" rows force keys as
        # [BLOCK_N, D] tiles and "-k3d" rows as [D/x, BLOCK_N, x] tiles.
        defaults = {
            k: getattr(_decode_impl, k)
            for k in (
                "VLLM_K3D",
                "VLLM_MAXNREG",
                "VLLM_PAGE_PREFETCH",
                "VLLM_V2_PARTS_PER_PROGRAM",
                "MERGE_MAX_K",
                "MERGE_TILE",
                "VLLM_V2_FUSED",
                "MERGE_TWO_PASS",
            )
            if hasattr(_decode_impl, k)  # the vLLM kernel's own settings moved to _vllm_impl.VllmDecodeConfig
        }
        versions = ["v1", "v2"] + (["v1-k2d", "v2-k2d", "v1-k3d", "v2-k3d"] if args.k3d else [])
        versions += [v + "-r128" for v in versions] if args.r128 else []
        if args.variants:
            versions = [v.strip() for v in args.variants.split(",") if v.strip()]
        for label in versions:
            version, settings, tiles = parse_label(label)
            for key, val in {**defaults, **settings}.items():
                setattr(_decode_impl, key, val)
            row = dict(case=name, version=label, vllm_pick=pick == version)
            try:
                fns, out = vllm_fns(case, data, version)
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
            finally:
                for key, val in defaults.items():
                    setattr(_decode_impl, key, val)
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
