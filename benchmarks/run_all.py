"""Every benchmark in one command, then the README's performance tables regenerated from the JSON.

    PYTHONPATH=src python3 benchmarks/run_all.py                 # run all, write JSON, rewrite README tables
    PYTHONPATH=src python3 benchmarks/run_all.py --only decode,prefill
    PYTHONPATH=src python3 benchmarks/run_all.py --out DIR       # JSON under DIR/<gpu>/ (a GPU machine's $OUT)
    python3 benchmarks/run_all.py --tables-only                  # no GPU: tables from the existing JSON
    python3 benchmarks/run_all.py --check                        # exit 1 when the README's tables are stale
    PYTHONPATH=src python3 benchmarks/run_all.py --prebuild      # only FlashInfer's JIT builds (make bench-prebuild)

Each benchmark times ours against FlashInfer in the same process when FlashInfer is importable (else ours
alone) and writes ``benchmarks/results/<gpu>/<op>.json``. The README's tables sit between the
``<!-- perf:begin -->`` and ``<!-- perf:end -->`` markers and are rebuilt here from the newest JSON of each
operation, so the numbers in the README are always those of a results file in the repository.
This module imports neither torch nor Triton: ``--tables-only`` and ``--check`` run anywhere.

FlashInfer compiles each kernel variant on its first use (30-120 s each, tens of variants), and a fresh machine
has none built. A run with FlashInfer therefore first runs every benchmark's build-only mode (``--fi-build-only
DONE_FILE``, or bench_ops's ``--prebuild-only``) at once, one process per benchmark, and waits for them, so that
no timed benchmark pays a compile; ``--prebuild`` does only that, ``--no-prebuild`` skips it.
"""

from __future__ import annotations

import argparse
import contextlib
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS_DIR = os.path.join(HERE, "results")
README = os.path.join(ROOT, "README.md")
BEGIN, END = "<!-- perf:begin -->", "<!-- perf:end -->"

# (op, script, arguments of the run whose JSON the README shows). Scripts that are absent are skipped.
# bench_distributed.py runs under torchrun on several GPUs (docs/distributed.md) and bench_minisglang.py
# needs mini-sglang staged (docs/minisglang.md): not run here; a distributed.json present is tabled.
BENCHMARKS = [
    ("decode", "bench_decode.py", ["--graph"]),
    ("prefill", "bench_prefill.py", ["--fa3", "--no-flex"]),
    ("cascade", "bench_cascade.py", []),
    ("vllm", "bench_vllm_paged.py", ["--graph"]),
    ("page", "bench_page.py", []),
    ("host", "bench_host.py", []),
    ("ops", "bench_ops.py", []),
    ("flash_attn", "bench_flash_attn.py", []),
    ("engine", "bench_engine.py", ["--random", "--libs", "flashinfer_triton", "flashinfer"]),
    ("decode-flex", "bench_decode_flex.py", []),
]
# The README's tables, in this order (each op has its table function in TABLES). decode-flex (ours against
# FlexAttention, not FlashInfer) stays in its JSON.
TABLE_ORDER = ["decode", "prefill", "cascade", "vllm", "page", "host", "engine", "ops", "flash_attn", "distributed"]


# ----------------------------------------------------------------------------- reading results


def load_results(results_dir: str = RESULTS_DIR) -> dict:
    """``{op: doc}`` with the newest ``<gpu>/<op>.json`` of each op (dated references are not tables)."""
    newest: dict = {}
    for path in sorted(glob.glob(os.path.join(results_dir, "*", "*.json"))):
        op = os.path.splitext(os.path.basename(path))[0]
        if re.match(r"\d{4}-\d{2}-\d{2}-", op):
            continue
        with open(path) as f:
            doc = json.load(f)
        doc["_gpu_dir"] = os.path.basename(os.path.dirname(path))
        if op not in newest or str(doc.get("date", "")) > str(newest[op].get("date", "")):
            newest[op] = doc
    return newest


def _flashinfer_version(doc: dict) -> str | None:
    return doc.get("flashinfer") or (doc.get("meta") or {}).get("flashinfer")


def _timed_flashinfer(doc: dict) -> bool:
    """Whether FlashInfer was timed in the run: a row with a FlashInfer time or of FlashInfer itself."""
    return any(
        r.get("lib") == "flashinfer" or any(k.startswith("flashinfer") and v is not None for k, v in r.items())
        for r in doc.get("rows", [])
    )


def _caption(doc: dict, command: str) -> str:
    """GPU, date and versions as the JSON records them; what it does not record is said to be missing, never
    guessed (a FlashInfer version only when the run wrote one)."""
    parts = [doc["_gpu_dir"], str(doc["date"])[:10] if doc.get("date") else "date not recorded"]
    if doc.get("torch"):
        parts.append(f"torch {doc['torch']}")
    if doc.get("triton"):
        parts.append(f"Triton {doc['triton']}")
    if doc.get("nccl"):
        parts.append(f"NCCL {doc['nccl']}")
    fi = _flashinfer_version(doc)
    if fi:
        parts.append(f"FlashInfer {fi}")
    elif _timed_flashinfer(doc):
        parts.append("FlashInfer version not recorded")
    return " · ".join(parts) + f" · `{command}`"


def _f(v, nd: int = 2) -> str:
    return "-" if v is None else f"{v:.{nd}f}"


def _table(header: list, rows: list) -> list:
    out = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return out


def _ratio(fi_ms, ours_ms):
    return None if not fi_ms or not ours_ms else fi_ms / ours_ms


# ----------------------------------------------------------------------------- one table per operation


def table_decode(doc: dict) -> list:
    rows = []
    for r in doc["rows"]:
        fi_tbps = r["bytes"] / (r["flashinfer_ms"] * 1e-3) / 1e12 if r.get("flashinfer_ms") else None
        rows.append([r["case"], _f(r["ours_tbps"]), _f(fi_tbps), _f(_ratio(r.get("flashinfer_ms"), r["ours_ms"]), 3)])
    return [
        "**Decode** (`BatchDecodeWithPagedKVCacheWrapper.run()`, TB/s of KV read once; case = batch x keys,"
        " query/KV heads, fp16 unless noted, page size 16 unless noted; FlashInfer: the better of its CUDA-core"
        " and tensor-core decode)",
        "",
        *_table(["case", "ours TB/s", "FlashInfer TB/s", "ratio"], rows),
    ]


def table_prefill(doc: dict) -> list:
    def tflops(r, key):
        return r["flops"] / (r[key] * 1e-3) / 1e12 if r.get(key) else None

    rows = []
    for r in doc["rows"]:
        rows.append(
            [
                r["case"],
                _f(tflops(r, "ours_ms"), 0),
                _f(tflops(r, "flashinfer_ms"), 0),
                _f(tflops(r, "flashinfer_fa3_ms"), 0),
                _f(tflops(r, "sdpa_cudnn_ms"), 0),
                _f(_ratio(r.get("flashinfer_ms"), r["ours_ms"])),
                _f(_ratio(r.get("flashinfer_fa3_ms"), r["ours_ms"])),
            ]
        )
    return [
        "**Prefill** (`BatchPrefillWith{Ragged,Paged}KVCacheWrapper.run()` / `single_prefill_with_kv_cache`,"
        " TFLOP/s, causal rows count visible pairs; case = query tokens, query/KV heads, head dim; fp16 unless"
        " noted; FI fa2 / fa3: FlashInfer's two backends, `-` where one was not measured; it has fa3 only for head"
        " dims 64/128/256 without a custom mask or fp8 K/V)",
        "",
        *_table(["case", "ours", "FI fa2", "FI fa3", "SDPA cuDNN", "ratio fa2", "ratio fa3"], rows),
    ]


def table_cascade(doc: dict) -> list:
    casc, merge = [], []
    tc = {}
    for r in doc["rows"]:
        m = re.match(r"cascade b(\d+)-shared(\d+)-own(\d+)\S* vs (.*)", r["case"])
        if m and m.group(4).startswith("FI tensor-core decode"):
            tc[(m.group(1), m.group(2))] = r["flashinfer_ms"]
    for r in doc["rows"]:
        m = re.match(r"cascade b(\d+)-shared(\d+)-own(\d+)\S* vs FI MultiLevelCascadeAttentionWrapper", r["case"])
        if m:
            casc.append(
                [
                    f"{m.group(1)} x {m.group(2)} (+{m.group(3)} own)",
                    _f(r["ours_ms"], 3),
                    _f(r["flashinfer_ms"], 3),
                    _f(r["ratio"]),
                    _f(r.get("ours_graph_ms"), 3),
                    _f(r.get("flashinfer_graph_ms"), 3),
                    _f(r.get("graph_ratio")),
                    _f(tc.get((m.group(1), m.group(2))), 3),
                ]
            )
        elif r["case"].startswith("merge_state"):
            merge.append(
                [
                    r["case"],
                    _f(r["ours_ms"] * 1e3, 1),
                    _f(r["flashinfer_ms"] * 1e3, 1),
                    _f(r["ratio"]),
                    _f(r.get("graph_ratio")),
                    _f(r.get("after_write_ratio")),
                ]
            )
    out = [
        "**Cascade** (`MultiLevelCascadeAttentionWrapper.run()`, two levels, 32/8 heads, D128, ms; case ="
        " requests x shared prefix tokens; eager by `do_bench`, then replayed in a CUDA graph; last column:"
        " FlashInfer's tensor-core batch decode over the unshared cache, for scale)",
        "",
        *_table(
            ["requests x shared", "ours", "FlashInfer", "ratio", "ours graph", "FI graph", "graph ratio", "FI decode"],
            casc,
        ),
    ]
    if merge:
        out += [
            "",
            "**Merge** (`merge_states` N x K states / `merge_state_in_place` N rows, 32 heads, D128, us; eager"
            " with L2 flushed; graph: replayed in a CUDA graph; after write: merging states just written, as an"
            " engine does)",
            "",
            *_table(["case", "ours us", "FlashInfer us", "ratio", "graph ratio", "after-write ratio"], merge),
        ]
    return out


def table_vllm(doc: dict) -> list:
    rows = []
    for r in doc["rows"]:
        rows.append(
            [
                r["case"],
                r["version"] + (" (default)" if r.get("vllm_pick") else ""),
                _f(r["ours_tbps"] * r["ours_ms"] / r["ours_graph_ms"] if r.get("ours_graph_ms") else r["ours_tbps"]),
                _f(r.get("ratio_vs_csr_graph"), 3),
                _f(r.get("ratio"), 3),
            ]
        )
    return [
        "**vLLM layout** (`flashinfer_triton.vllm.paged_attention_v1/v2`, block size 16, fp16; vs CSR: our"
        " `BatchDecodeWithPagedKVCacheWrapper` on the same data, both replayed in CUDA graphs; vs FlashInfer:"
        " its decode on the equivalent CSR cache, eager)",
        "",
        *_table(["case", "version", "ours TB/s", "vs our CSR decode", "vs FlashInfer"], rows),
    ]


def table_page(doc: dict) -> list:
    rows = []
    for r in doc["rows"]:
        rows.append(
            [
                r["case"],
                _f(r.get("ours_graph_gbps"), 0),
                _f(r.get("flashinfer_graph_gbps"), 0),
                _f(r.get("graph_ratio")),
                _f(r.get("ratio")),
                f"{_f(r.get('ours_host_us'), 0)} / {_f(r.get('flashinfer_host_us'), 0)}",
            ]
        )
    return [
        "**Page append** (`append_paged_kv_cache`, GB/s in a CUDA graph; eager ratio by `do_bench`; host: us"
        " per eager call, ours / FlashInfer)",
        "",
        *_table(["case", "ours GB/s", "FI GB/s", "graph ratio", "eager ratio", "host us"], rows),
    ]


def table_host(doc: dict) -> list:
    rows = [
        [r["case"], _f(r.get("ours_us"), 1), _f(r.get("flashinfer_us"), 1), _f(r.get("ratio"))] for r in doc["rows"]
    ]
    note = ["", f"_{doc['note']}_"] if doc.get("note") else []
    return [
        "**Host time** (us per eager call: back-to-back calls, one sync at the end; fp16, page size 16)",
        "",
        *_table(["call", "ours us", "FlashInfer us", "ratio"], rows),
        *note,
    ]


def table_engine(doc: dict) -> list:
    rows = []
    for r in doc["rows"]:
        if r.get("lib") != "flashinfer_triton/flashinfer":
            continue
        rows.append(
            [
                r["case"],
                _f(r["ours_decode_tokens_per_s"], 0),
                _f(r["flashinfer_decode_tokens_per_s"], 0),
                _f(r["ratio"]),
                _f(r.get("ours_graph_replay_ms")),
                _f(r.get("flashinfer_graph_replay_ms")),
            ]
        )
    what = (doc.get("meta") or {}).get("model", "")
    return [
        f"**Engine** (`make demo`'s serving engine, {what}, bf16, CUDA-graph decode; decode tokens/s and GPU time"
        " of one captured decode step, ms)",
        "",
        *_table(["batch", "ours tok/s", "FI tok/s", "ratio", "ours step ms", "FI step ms"], rows),
    ]


def table_ops(doc: dict) -> list:
    """One line per operation over its cases (shapes, dtypes): host-bound small calls, so a range says more."""
    by_op: dict = {}
    for r in doc["rows"]:
        by_op.setdefault(r.get("op", "?"), []).append(r)
    rows = []
    for op, rs in by_op.items():
        ours = [r["ours_us"] for r in rs if r.get("ours_us")]
        ratios = sorted(r["ratio"] for r in rs if r.get("ratio"))
        rows.append(
            [
                f"`{op}`",
                len(rs),
                f"{_f(min(ours), 1)}-{_f(max(ours), 1)}" if ours else "-",
                f"{_f(ratios[0])}-{_f(ratios[-1])}" if ratios else "-",
                _f(ratios[len(ratios) // 2]) if ratios else "-",
            ]
        )
    return [
        "**Engine ops** (norm, activation, RoPE, sampling; us per call over the cases of `bench_ops.py`: SmolLM2-135M"
        " and Llama-3-8B shapes, 1-256 tokens, bf16)",
        "",
        *_table(["op", "cases", "ours us", "ratio range", "median ratio"], rows),
    ]


def _shape(meta: dict) -> str:
    """``32/8 heads, D128, bfloat16`` from a result's meta (the parts it records)."""
    heads = meta.get("heads")
    if isinstance(heads, (list, tuple)):
        heads = "/".join(str(h) for h in heads)
    parts = [f"{heads} heads" if heads else None, f"D{meta['head_dim']}" if meta.get("head_dim") else None]
    parts.append(str(meta["dtype"]).replace("torch.", "") if meta.get("dtype") else None)
    return ", ".join(p for p in parts if p)


def table_flash_attn(doc: dict) -> list:
    """bench_flash_attn's modes: the kernels table (the flash_attn calls against the same attention through the
    native wrappers, FlashInfer and SDPA), then one line each for the host-time and generate_batch rows."""
    meta = doc.get("meta") or {}
    rows = [
        [r["case"], _f(r["flash_attn_ms"], 3), _f(r.get("ours_native_ms"), 3), _f(r.get("flashinfer_ms"), 3),
         _f(r.get("sdpa_ms"), 3), _f(r.get("ratio"))]
        for r in doc["rows"] if r.get("flash_attn_ms") is not None
    ]  # fmt: skip
    out = [
        "**flash_attn interface** (`flashinfer_triton.flash_attn`: `flash_attn_varlen_func` for prefill,"
        " `flash_attn_with_kvcache` for decode, against the same attention through our wrappers' `run()`,"
        f" FlashInfer and SDPA; GPU ms per call in a CUDA graph, {_shape(meta)}; ratio = FlashInfer / flash_attn call)",
        "",
        *_table(["case", "flash_attn ms", "run() ms", "FlashInfer ms", "SDPA ms", "ratio"], rows),
    ]
    notes = []
    for r in doc["rows"]:
        if r.get("custom_op_us") is not None:
            notes.append(
                f"- Host time, {r['case'].removeprefix('host time, ')}: `run()` {_f(r.get('direct_us'), 1)} us, through"
                f" the `wrapper_run` custom op {_f(r['custom_op_us'], 1)} us, `flash_attn_with_kvcache`"
                f" {_f(r.get('flash_attn_with_kvcache_us'), 1)} us."
            )
        elif "default_tokens_per_s" in r:
            notes.append(
                f"- transformers `{r['case']}` ({r.get('model', '?')}, {r.get('dtype', '?')}): ours"
                f" {_f(r.get('ours_tokens_per_s'), 1)} tokens/s, its default (`{r.get('default_attn', '?')}`)"
                f" {_f(r.get('default_tokens_per_s'), 1)}; ours / default {_f(r.get('ratio'))}."
            )
    return out + ([""] + notes if notes else [])


_DIST_KINDS = {"decode": "decode", "prefill-causal": "causal ring prefill"}


def table_distributed(doc: dict) -> list:
    """Context parallelism: per (operation, case) the time on each GPU count the JSON holds, the speedup over one
    GPU and the share of communication time (``comm_share``) on each count above one."""
    meta = doc.get("meta") or {}
    cases: dict = {}
    for r in doc["rows"]:
        cases.setdefault((r["kind"], r["case"]), {})[r["ngpus"]] = r
    counts = sorted({n for by_n in cases.values() for n in by_n})
    multi = [n for n in counts if n > 1]
    rows = []
    for (kind, case), by_n in cases.items():
        row = [_DIST_KINDS.get(kind, kind), case]
        for n in counts:
            r = by_n.get(n)
            ms = None if r is None else r["ms"]
            row.append(_f(ms, 3 if ms is not None and ms < 10 else 0))
            if n > 1:
                row.append("-" if r is None or r.get("speedup") is None else f"{r['speedup']:.2f}x")
        row.append(" / ".join(_f((by_n.get(n) or {}).get("comm_share"), 3) for n in multi) or "-")
        rows.append(row)
    header = ["operation", "case"]
    for n in counts:
        header += [f"{n} GPU{'s' if n > 1 else ''} ms"] + (["speedup"] if n > 1 else [])
    header.append(f"comm. share at {' / '.join(str(n) for n in multi)}" if multi else "comm. share")
    combine = meta.get("combine", "?")
    nvls = ", NVLink multicast off" if meta.get("nccl_nvls_enable") == "0" else ""
    return [
        "**Context parallelism** (`flashinfer_triton.distributed`: decode over KV sharded across GPUs and causal ring"
        f" prefill; case = requests x tokens each, or tokens; {_shape(meta)}, pages of {meta.get('page_size', '?')},"
        f" `combine={combine!r}`{nvls}; ms = the slowest rank's time, speedup = one GPU's time for the same work"
        " over it)",
        "",
        *_table(header, rows),
    ]


TABLES = {
    "decode": table_decode,
    "prefill": table_prefill,
    "cascade": table_cascade,
    "vllm": table_vllm,
    "page": table_page,
    "host": table_host,
    "engine": table_engine,
    "ops": table_ops,
    "flash_attn": table_flash_attn,
    "distributed": table_distributed,
}
assert set(TABLES) == set(TABLE_ORDER)
COMMANDS = {op: f"python3 benchmarks/{script} {' '.join(args)}".strip() for op, script, args in BENCHMARKS}
COMMANDS["engine"] = "python3 benchmarks/bench_engine.py --random --libs flashinfer_triton flashinfer"
COMMANDS["distributed"] = "torchrun --nproc_per_node N benchmarks/bench_distributed.py"


def _command(op: str, doc: dict) -> str:
    """The command that wrote ``doc``: bench_flash_attn's modes are those its JSON records (run_all runs only the
    GPU-kernel one, which needs nothing beyond torch)."""
    modes = (doc.get("meta") or {}).get("modes")
    if op == "flash_attn" and modes:
        return f"python3 benchmarks/bench_flash_attn.py --mode {' '.join(modes)}"
    return COMMANDS.get(op, f"benchmarks/results/*/{op}.json")


def render_tables(results_dir: str = RESULTS_DIR) -> str:
    """The README's performance block (without its markers), from the newest JSON of each op."""
    docs = load_results(results_dir)
    ops = [op for op in TABLE_ORDER if op in docs]
    lines = []
    for op in ops:
        doc = docs[op]
        if not doc.get("rows"):
            continue
        lines += TABLES[op](doc)
        lines += ["", "<sub>" + _caption(doc, _command(op, doc)) + "</sub>", ""]
    missing = [op for op in ("decode", "prefill", "cascade", "vllm", "host") if op not in docs]
    if missing:
        lines += [f"Not measured yet: {', '.join(missing)} (`make bench` writes them).", ""]
    return "\n".join(lines).rstrip() + "\n"


def replace_block(text: str, block: str) -> str:
    """``text`` with the part between the perf markers replaced by ``block``."""
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return text[: i + len(BEGIN)] + "\n" + block + text[j:]


def current_block(text: str) -> str:
    i, j = text.find(BEGIN), text.find(END)
    if i < 0 or j < i:
        raise ValueError(f"README has no {BEGIN} ... {END} block")
    return text[i + len(BEGIN) + 1 : j]


def update_readme(readme: str = README, results_dir: str = RESULTS_DIR, check: bool = False) -> bool:
    """Rewrite (or, with ``check``, only compare) the README's tables; True when they were up to date."""
    with open(readme) as f:
        text = f.read()
    new = replace_block(text, render_tables(results_dir))
    if new == text:
        return True
    if not check:
        with open(readme, "w") as f:
            f.write(new)
    return False


# ----------------------------------------------------------------------------- running the benchmarks


def _env() -> dict:
    env = dict(os.environ)
    src = os.path.join(ROOT, "src")
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def prebuild_commands(only: set | None, folder: str) -> list:
    """``[(op, command, done file or None)]``: each benchmark's build-only mode, with the arguments of its run
    (they choose the variants, e.g. prefill's ``--fa3``); benchmarks without one are left out."""
    cmds = []
    for op, script, args in BENCHMARKS:
        path = os.path.join(HERE, script)
        if (only and op not in only) or not os.path.exists(path):
            continue
        with open(path) as f:
            source = f.read()
        done = os.path.join(folder, f"{op}.done")
        if '"--fi-build-only"' in source:
            cmds.append((op, [sys.executable, path, *args, "--fi-build-only", done], done))
        elif '"--prebuild-only"' in source:
            cmds.append((op, [sys.executable, path, *args, "--prebuild-only"], None))
    return cmds


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


def prebuild(only: set | None, timeout: float, folder: str | None = None) -> dict:
    """Run every build-only mode at once and wait (at most ``timeout`` seconds in all); print each variant's line
    and a summary. Returns ``{op: exit status}`` ("timeout" for a process stopped at the limit)."""
    folder = folder or tempfile.mkdtemp(prefix="fi-prebuild-")
    os.makedirs(folder, exist_ok=True)
    t0 = time.perf_counter()
    procs = []
    with contextlib.ExitStack() as logs:
        for op, cmd, done in prebuild_commands(only, folder):
            print(f"[prebuild] {op}: {' '.join(cmd[1:])}", flush=True)
            log = logs.enter_context(open(os.path.join(folder, f"{op}.log"), "w"))
            proc = subprocess.Popen(cmd, env=_env(), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
            procs.append((op, proc, log.name, done))
        status = {}
        for op, proc, _, _ in procs:
            try:
                status[op] = proc.wait(timeout=max(1.0, timeout - (time.perf_counter() - t0)))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                status[op] = "timeout"
    for op, _, log_name, done in procs:
        lines = _read(log_name).splitlines()
        variants = [ln for ln in lines if ": built in " in ln or ": FAILED " in ln]
        for ln in variants:
            print(f"[prebuild] {op}: {ln}", flush=True)
        if status[op] != 0:  # the reason is in the log's tail
            for ln in lines[-5:]:
                print(f"[prebuild] {op} | {ln}", flush=True)
        failed = sum(": FAILED " in ln for ln in variants)
        summary = f"[prebuild] {op}: exit {status[op]}, {len(variants) - failed} built, {failed} failed"
        if done:
            summary += "; " + (_read(done).strip() if os.path.exists(done) else "no done file")
        print(summary, flush=True)
    print(f"[prebuild] all done in {time.perf_counter() - t0:.0f} s; logs in {folder}", flush=True)
    return status


def run_benchmarks(only: set | None, no_flashinfer: bool, timeout: float, out: str | None = None) -> dict:
    env = _env()
    status = {}
    for op, script, args in BENCHMARKS:
        path = os.path.join(HERE, script)
        if (only and op not in only) or not os.path.exists(path):
            continue
        with open(path) as f:
            source = f.read()
        if no_flashinfer:
            args = [a for a in args if a != "flashinfer"] + (["--no-flashinfer"] if "--no-flashinfer" in source else [])
        out_flag = next((f for f in ('"--out"', '"--out-dir"') if f in source), None)
        if out and out_flag is None:
            print(f"[run_all] {op}: {script} takes no results folder; it writes to benchmarks/results", flush=True)
        cmd = [sys.executable, path, *args] + ([out_flag.strip('"'), out] if out and out_flag else [])
        print(f"[run_all] {op}: {' '.join(cmd[1:])}", flush=True)
        t0 = time.perf_counter()
        try:
            rc = subprocess.run(cmd, env=env, cwd=ROOT, timeout=timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        status[op] = rc
        print(f"[run_all] {op}: exit {rc} in {time.perf_counter() - t0:.0f} s", flush=True)
    return status


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tables-only", action="store_true", help="regenerate the README's tables from existing JSON")
    ap.add_argument("--check", action="store_true", help="exit 1 when the README's tables differ from the JSON")
    ap.add_argument("--only", default=None, help="comma-separated ops: " + ",".join(op for op, _, _ in BENCHMARKS))
    ap.add_argument("--no-flashinfer", action="store_true", help="time ours only")
    ap.add_argument("--timeout", type=float, default=1800.0, help="seconds per benchmark")
    ap.add_argument("--readme", default=README)
    ap.add_argument("--results", default=RESULTS_DIR, help="results folder the tables are read from")
    ap.add_argument("--out", default=None, help="results folder the benchmarks write to (and the tables read)")
    ap.add_argument(
        "--prebuild", action="store_true", help="only build FlashInfer's JIT modules, all benchmarks at once"
    )
    ap.add_argument("--no-prebuild", action="store_true", help="run the benchmarks without building FlashInfer first")
    ap.add_argument("--prebuild-timeout", type=float, default=1500.0, help="seconds for all the builds together")
    args = ap.parse_args(argv)
    only = set(args.only.split(",")) if args.only else None
    if args.prebuild:
        status = prebuild(only, args.prebuild_timeout)
        return 0 if all(rc == 0 for rc in status.values()) else 1
    if args.out:
        args.results = args.out
    if args.check:
        ok = update_readme(args.readme, args.results, check=True)
        print("README tables up to date" if ok else "README tables differ from the JSON: run --tables-only")
        return 0 if ok else 1
    failed = []
    if not args.tables_only:
        if not (args.no_flashinfer or args.no_prebuild):
            prebuild(only, args.prebuild_timeout)  # a failed build is reported; its benchmark reports it again
        status = run_benchmarks(only, args.no_flashinfer, args.timeout, args.out)
        failed = [op for op, rc in status.items() if rc != 0]
    update_readme(args.readme, args.results)
    print(f"README tables regenerated from {os.path.relpath(args.results, ROOT)}")
    if failed:
        print(f"[run_all] failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
