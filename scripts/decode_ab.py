"""A/B of one ``_decode_impl`` module flag on the decode table (GPU, CUDA-graph replays, same process).

    PYTHONPATH=src python scripts/decode_ab.py --flag CSR_WHOLE_TILES --values False,True [--rounds 3] [--out DIR]
    PYTHONPATH=src python scripts/decode_ab.py --flag FUSED_MERGE,CSR_WHOLE_TILES --values "(True,False);(False,False)"
    (several flags: comma-separated names, values as tuples separated by ";")

For every row of ``benchmarks/bench_decode.py``'s table: a fresh wrapper planned per value, one CUDA graph
per cache copy, replays timed with ``triton.testing.do_bench`` (median), the values alternated ``--rounds``
times; the outputs of every value are compared with the first value's (max abs difference). Prints per row
the median over rounds of each value's time and the ratio first / value (> 1: the value is faster)."""

from __future__ import annotations

import argparse
import ast
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "benchmarks"))
import _common as C  # noqa: E402
import bench_decode as B  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--flag", required=True)
    ap.add_argument("--values", required=True, help="comma-separated Python literals")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--cases", default=None, help="comma-separated case-name prefixes (default: all)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    from flashinfer_triton import _decode_impl as impl

    flags = args.flag.split(",")
    sep = ";" if len(flags) > 1 else ","
    values = [ast.literal_eval(v) for v in args.values.split(sep)]
    if len(flags) == 1:
        values = [(v,) for v in values]
    saved = [getattr(impl, f) for f in flags]
    device = torch.device("cuda")
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=device)
    cases = B.CASES
    if args.cases:
        cases = [c for c in cases if any(c[0].startswith(p) for p in args.cases.split(","))]
    rows = []

    def lab(v):
        return "-".join(map(str, v))

    for case in cases:
        data = B.build(case, device)
        times = {repr(v): [] for v in values}
        outs = {}
        for _ in range(args.rounds):
            for v in values:
                for f, x in zip(flags, v):
                    setattr(impl, f, x)
                try:
                    w = B.ours_wrapper(case, data, ws)
                    outs.setdefault(repr(v), w.run(data["q"], data["caches"][0]).clone())
                    times[repr(v)].append(B.time_graph(w, data["q"], data["caches"]))
                finally:
                    for f, x in zip(flags, saved):
                        setattr(impl, f, x)
        base = values[0]
        row = {"case": case[0]}
        for v in values:
            ms = statistics.median(times[repr(v)])
            row[f"{lab(v)}_ms"] = ms
            row[f"{lab(v)}_tbps"] = C.tbps(data["nbytes"], ms)
            row[f"ratio_{lab(v)}"] = statistics.median(times[repr(base)]) / ms
            row[f"maxdiff_{lab(v)}"] = float((outs[repr(v)].float() - outs[repr(base)].float()).abs().max())
        rows.append(row)
        print(" ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()), flush=True)
        del data
        torch.cuda.empty_cache()
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"decode-ab-{'-'.join(flags)}.json")
        with open(path, "w") as f:
            json.dump({"flags": flags, "values": [repr(v) for v in values], "gpu": torch.cuda.get_device_name(),
                       "rows": rows}, f, indent=1)  # fmt: skip
        print("wrote", path)


if __name__ == "__main__":
    main()
