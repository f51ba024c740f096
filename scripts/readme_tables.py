"""Markdown tables for the README from one day's benchmark JSON files.

    python scripts/readme_tables.py [--date 2026-11-22] [--gpu NVIDIA-H100-80GB-HBM3]

Reads benchmarks/results/<date>-<gpu>-<op>.json for decode, prefill, cascade, page, vllm, engine and
decode-flex, and prints one table per file (rows the benchmark could not run are shown with their reason).
"""

from __future__ import annotations

import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "..", "benchmarks", "results")


def load(date, gpu, op):
    path = os.path.join(RESULTS, f"{date}-{gpu}-{op}.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def fmt(v, nd=3):
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.{nd}f}" if abs(v) < 100 else f"{v:.0f}"
    return str(v)


def table(header, rows):
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(fmt(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def tbps(nbytes, ms):
    return None if not nbytes or not ms else nbytes / (ms * 1e-3) / 1e12


def decode(d):
    rows = []
    for r in d["rows"]:
        if "bytes" not in r:
            continue
        fi_tb = tbps(r["bytes"], r.get("flashinfer_ms"))
        rows.append([r["case"], r.get("ours_tbps"), r.get("ours_graph_tbps"), fi_tb, r.get("ratio")])
    return table(["case", "ours TB/s", "ours TB/s (graph)", "FlashInfer TB/s", "ratio"], rows)


def prefill(d):
    rows = []
    for r in d["rows"]:
        fl = r.get("flops")

        def tf(ms, fl=fl):
            return None if not ms or not fl else fl / (ms * 1e-3) / 1e12

        fa3 = r.get("flashinfer_fa3_ms")
        rows.append(
            [
                r["case"],
                tf(r.get("ours_ms")),
                tf(r.get("flashinfer_ms")),
                tf(fa3),
                tf(r.get("sdpa_cudnn_ms")),
                tf(r.get("flex_ms")),
                r.get("ratio"),
                (fa3 / r["ours_ms"]) if fa3 and r.get("ours_ms") else None,
            ]
        )
    head = ["case", "ours", "FI fa2", "FI fa3", "SDPA cuDNN", "Flex", "ratio fa2", "ratio fa3"]
    return "TFLOP/s\n\n" + table(head, rows)


def generic(d, cols):
    return table(cols, [[r.get(c) for c in cols] for r in d["rows"]])


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--date", default="2026-11-22")
    ap.add_argument("--gpu", default="NVIDIA-H100-80GB-HBM3")
    a = ap.parse_args()
    for op, fn in (
        ("decode", decode),
        ("decode-flex", lambda d: generic(d, ["case", "ours_tbps", "flex_tbps", "ratio", "note"])),
        ("vllm", lambda d: generic(d, ["case", "version", "ours_tbps", "ratio_vs_csr", "ratio", "error"])),
        ("prefill", prefill),
        ("cascade", lambda d: generic(d, ["case", "ours_ms", "ours_graph_ms", "flashinfer_ms", "ratio", "note"])),
        ("page", lambda d: generic(d, ["case", "ours_ms", "flashinfer_ms", "ratio", "graph_ratio"])),
        (
            "engine",
            lambda d: generic(
                d,
                ["case", "lib", "ours_decode_tokens_per_s", "flashinfer_decode_tokens_per_s", "ratio", "same_tokens"],
            ),
        ),
    ):
        d = load(a.date, a.gpu, op)
        if d is None:
            print(f"## {op}: no results file\n")
            continue
        print(f"## {op} ({d.get('date')}, {d.get('gpu')})\n")
        print(fn(d))
        print()


if __name__ == "__main__":
    main()
