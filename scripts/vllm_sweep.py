"""Tile sweep of vLLM's paged_attention_v1 (our decode kernel, vLLM layout) against our CSR decode on the
same data, both replayed from CUDA graphs (issue 6: within 5% of CSR).

    PYTHONPATH=src python3 scripts/vllm_sweep.py [--cases 64x4096,256x1024] [--out DIR]

For each case: CSR with its default tiles, then v1 under each (BLOCK_N, num_warps, num_stages) override
(``_decode_impl.CONFIG_OVERRIDE``, which only the vLLM path reads during the sweep: CSR is planned first),
keys loaded as 3-D tiles (default) and as [BLOCK_N, D] tiles; prints the best against CSR.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))

import bench_vllm_paged as B  # noqa: E402

from flashinfer_triton import _decode_impl  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", default="64x4096 32/8,256x1024")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="1,0", help="VLLM_K3D values (0: 2-D keys, 1: 3-D + permute, 2: [N, D/x, x])")
    ap.add_argument("--block-n", default="32,64,128")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    result = []
    for case in [c for c in B.CASES if any(c[0].startswith(p) for p in args.cases.split(","))]:
        data = B.build(case, dev)
        csr, csr_one = B.csr_fns(case, data, ws)
        csr_ms = B.graph_ms(csr)
        rows = []
        for bn, nw, ns, k3d in itertools.product(
            [int(x) for x in args.block_n.split(",")], (4, 8), (2, 3, 4), [int(x) for x in args.modes.split(",")]
        ):
            _decode_impl.CONFIG_OVERRIDE.clear()
            _decode_impl.CONFIG_OVERRIDE.update(BLOCK_N=bn, num_warps=nw, num_stages=ns)
            _decode_impl.VLLM_K3D = k3d
            try:
                fns, out = B.vllm_fns(case, data, "v1")
                fns[0]()
                ref = csr_one()
                diff = float((out.float() - ref.float()).abs().max())
                ms = B.graph_ms(fns)
            except Exception as exc:  # noqa: BLE001 - a config that does not compile is a result too
                rows.append(dict(cfg=[bn, nw, ns, k3d], error=f"{type(exc).__name__}: {str(exc)[:120]}"))
                continue
            rows.append(dict(cfg=[bn, nw, ns, k3d], ms=ms, ratio_vs_csr=csr_ms / ms, maxdiff=diff))
        _decode_impl.CONFIG_OVERRIDE.clear()
        _decode_impl.VLLM_K3D = True
        ok = sorted((r for r in rows if "ms" in r), key=lambda r: r["ms"])
        print(f"{case[0]}: CSR {csr_ms * 1e3:.1f} us")
        for r in ok[:8]:
            print(f"   BLOCK_N {r['cfg'][0]} w{r['cfg'][1]} s{r['cfg'][2]} keys={r['cfg'][3]}: {r['ms'] * 1e3:.1f} us, "
                  f"{r['ratio_vs_csr']:.3f} of CSR, maxdiff {r['maxdiff']:.1e}")  # fmt: skip
        errs = [r for r in rows if "error" in r]
        if errs:
            print(f"   {len(errs)} configs failed, e.g. {errs[0]}")
        result.append(dict(case=case[0], csr_ms=csr_ms, rows=rows))
    if args.out:
        with open(os.path.join(args.out, "vllm-sweep.json"), "w") as f:
            json.dump(dict(gpu=torch.cuda.get_device_name(), cases=result), f, indent=1)


if __name__ == "__main__":
    main()
