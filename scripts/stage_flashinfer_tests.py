#!/usr/bin/env python3
"""Stage FlashInfer's own attention tests and run them against flashinfer_triton, as a client would.

    python scripts/stage_flashinfer_tests.py stage GIT_DIR [--out DIR] [--tags v0.2.0 NEWEST]
    python scripts/stage_flashinfer_tests.py run [--out DIR] [--suites TAG ...] [--cases N] [--seed S] [--sample N]
        [--part K/N] [--workers W] [--timeout S] [--margin S] [--gpu IDS] [--log DIR]
    python scripts/stage_flashinfer_tests.py summary LOG_DIR
    python scripts/stage_flashinfer_tests.py shim [--out DIR]

``stage`` exports each tag's test files from a FlashInfer git directory (a bare clone works) into ``DIR``
(default ``.flashinfer-tests``, added to ``.git/info/exclude``: their files are never committed here), then
writes a ``conftest.py`` shim per suite. The shim calls ``flashinfer_triton.as_flashinfer()``, provides what
the tests import beyond the attention API (``flashinfer.jit``, ``flashinfer.utils`` helpers; anything else
they reach raises NotImplementedError when used, so no case can pass on a stub), and deselects the cases
outside what flashinfer_triton claims (head dims above 512 or not a multiple of 16, fp8 queries, NVFP4,
JIT-variant and multi-item-scoring tests, non-FlashInfer backends such as trtllm-gen / cudnn / cute-dsl).
``NEWEST`` defaults to the repository's newest release tag (rc tags count when nothing newer exists).

``run`` runs the staged suites at once (CUDA required: the tests put their tensors on ``cuda:0``), each one
pytest with ``--workers W`` pytest-xdist processes, under this script's pytest plugin (``PLUGIN``): ``--cases N
--seed S`` a uniform random sample of N in-scope cases in a seeded random order (``--seed`` alone: every case
in that order; ``--cases`` alone: an even share per test function; ``--sample N``: every N-th case; ``--part
K/N``: the K-th of N interleaved parts, one per GPU), no case started in the last ``--margin`` seconds before
``--timeout``, and one record per case (verdict, seconds, Triton compile time). It writes per suite a log,
JUnit XML, the records and a summary line in which every selected case that did not run counts as not run.
``summary`` prints the summary lines of a log folder (parts added up). scripts/stage_vllm_tests.py runs
vLLM's tests under the same runner. ``shim`` rewrites the staged suites' generated ``conftest.py`` (``run``
does too).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# The files of each generation that exercise what flashinfer_triton implements.
FILES = {
    "v0.2": [
        "tests/alibi_reference.py",
        "tests/rope_reference.py",
        "tests/jit_utils.py",
        "tests/test_batch_decode_kernels.py",
        "tests/test_batch_prefill_kernels.py",
        "tests/test_alibi.py",
        "tests/test_logits_cap.py",
        "tests/test_sliding_window.py",
        "tests/test_page.py",
        "tests/test_quantization.py",
        "tests/test_shared_prefix_kernels.py",
        "tests/test_decode_prefill_lse.py",
        "tests/test_non_contiguous_decode.py",
        "tests/test_non_contiguous_prefill.py",
        "tests/test_tensor_cores_decode.py",
        "tests/test_decode_fp8_calibration_scale.py",
    ],
    "new": [
        "tests/__init__.py",
        "tests/attention/__init__.py",
        "tests/test_helpers/__init__.py",
        "tests/test_helpers/alibi_reference.py",
        "tests/test_helpers/jit_utils.py",
        "tests/test_helpers/rope_reference.py",
        "tests/test_helpers/sink_attention_reference.py",
        "tests/test_helpers/test_helpers.py",
        "tests/test_helpers/utils_fp4.py",
        "tests/attention/test_batch_decode_kernels.py",
        "tests/attention/test_batch_prefill_kernels.py",
        "tests/attention/test_single_prefill.py",
        "tests/attention/test_alibi.py",
        "tests/attention/test_logits_cap.py",
        "tests/attention/test_sliding_window.py",
        "tests/attention/test_page.py",
        "tests/attention/test_shared_prefix_kernels.py",
        "tests/attention/test_decode_prefill_lse.py",
        "tests/attention/test_non_contiguous_decode.py",
        "tests/attention/test_non_contiguous_prefill.py",
        "tests/attention/test_tensor_cores_decode.py",
        "tests/attention/test_decode_fp8_calibration_scale.py",
    ],
}

SHIM = r'''"""Written by flashinfer_triton's scripts/stage_flashinfer_tests.py: FlashInfer's tests as a client."""

import importlib.abc
import importlib.machinery
import sys
import types

import pytest
import torch

import flashinfer_triton

flashinfer = flashinfer_triton.as_flashinfer()


class _Unavailable:
    """What the tests reach beyond the attention API: usable as a name, an error when used."""

    def __init__(self, name):
        self._name = name

    def __call__(self, *args, **kwargs):
        raise NotImplementedError(f"{self._name}: not part of flashinfer_triton")

    def __getattr__(self, attr):
        return _Unavailable(f"{self._name}.{attr}")

    def __mro_entries__(self, bases):
        return (object,)

    def __or__(self, other):  # in annotations: ``Config | None``
        return self

    __ror__ = __or__


def _capability(device=None):
    return torch.cuda.get_device_capability(device)


_UTILS = {
    "has_flashinfer_jit_cache": lambda: True,  # skips the JIT warm-up fixtures
    "has_flashinfer_cubin": lambda: True,
    "get_compute_capability": _capability,
    "is_sm90a_supported": lambda device=None: _capability(device)[0] == 9,
    "is_sm100a_supported": lambda device=None: False,
    "is_sm110a_supported": lambda device=None: False,
    "is_sm120a_supported": lambda device=None: False,
    "is_sm121a_supported": lambda device=None: False,
    "determine_attention_backend": lambda *a, **k: "fa2",
    "is_fa3_backend_supported": lambda *a, **k: True,
    "device_support_pdl": lambda device=None: False,
}


class _StubModule(types.ModuleType):
    def __getattr__(self, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Unavailable(f"{self.__name__}.{attr}")


_STUBS = ("flashinfer.jit", "flashinfer.utils", "flashinfer.fp4_quantization", "flashinfer.attention",
          "flashinfer.gemm", "flashinfer.sampling", "flashinfer.triton", "flashinfer.mla", "flashinfer.testing")


class _StubFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        if name in _STUBS or any(name.startswith(s + ".") for s in _STUBS):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        mod = _StubModule(spec.name)
        mod.__path__ = []
        if spec.name == "flashinfer.utils":
            mod.__dict__.update(_UTILS)
        if spec.name == "flashinfer.jit":
            mod.has_prebuilt_ops = True
            mod.parallel_load_modules = lambda *a, **k: None
            mod.build_jit_specs = lambda *a, **k: None
            mod.MissingJITCacheError = type("MissingJITCacheError", (Exception,), {})
            mod.JitSpec = type("JitSpec", (), {})
        return mod

    def exec_module(self, module):
        parent, _, child = module.__name__.rpartition(".")
        if parent == "flashinfer" and not hasattr(flashinfer, child):
            setattr(flashinfer, child, module)


sys.meta_path.insert(0, _StubFinder())
for _name in ("flashinfer.jit", "flashinfer.utils"):
    __import__(_name)
# submodules the helpers import from modules that are plain modules here (not packages)
for _name in ("flashinfer.quantization.nvfp4_quantization_utils", "flashinfer.decode.cute_dsl"):
    sys.modules.setdefault(_name, _StubModule(_name))

_OUT_OF_SCOPE_NAMES = re.compile(
    r"nvfp4|multi_item|smem_probe|sink|fp8_prefill|block_sparse|mla|xqa|trtllm|cudnn|cute"
)
_OUT_OF_SCOPE_BACKENDS = {"trtllm-gen", "trtllm-gen-native", "cudnn", "cute-dsl", "cutile", "trtllm"}


def _out_of_scope(item):
    if _OUT_OF_SCOPE_NAMES.search(item.name.split("[")[0]):
        return "feature not claimed"
    params = getattr(getattr(item, "callspec", None), "params", {})
    for key in ("head_dim", "head_dim_qk", "head_dim_vo", "head_size"):
        d = params.get(key)
        if isinstance(d, int) and (d > 512 or d % 16):
            return f"{key}={d}"
    if params.get("backend") in _OUT_OF_SCOPE_BACKENDS:
        return f"backend={params['backend']}"
    fp8 = {getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2")}
    if params.get("q_dtype") in fp8 or params.get("dtype_q") in fp8:
        return "fp8 queries"
    for key in ("kv_dtype", "dtype_kv"):
        if params.get(key) in (torch.uint8, "nvfp4"):
            return "NVFP4 KV"
    return None


def pytest_collection_modifyitems(config, items):
    # what flashinfer_triton claims; the runner's plugin then samples and orders what is left (trylast)
    keep, drop = [], []
    for item in items:
        (drop if _out_of_scope(item) else keep).append(item)
    items[:] = keep
    if drop:
        config.hook.pytest_deselected(items=drop)
'''.replace("import types\n", "import re\nimport types\n", 1)


def git(git_dir: str, *args: str, **kw) -> subprocess.CompletedProcess:
    return subprocess.run(["git", f"--git-dir={git_dir}", *args], check=True, capture_output=True, **kw)


def newest_tag(git_dir: str) -> str:
    tags = git(git_dir, "tag", text=True).stdout.split()

    def key(t):
        m = re.match(r"v(\d+)\.(\d+)\.(\d+)(?:\.post(\d+))?(rc(\d+))?$", t)
        if not m:
            return None
        a, b, c, post, rc, rcn = m.groups()
        return (int(a), int(b), int(c), 0 if rc else 1, int(rcn or 0), int(post or 0))

    ranked = sorted((k, t) for t in tags if (k := key(t)) is not None)
    return ranked[-1][1]


def stage(git_dir: str, out: Path, tags: list[str]) -> None:
    out.mkdir(parents=True, exist_ok=True)
    exclude = ROOT / ".git" / "info" / "exclude"
    rel = os.path.relpath(out.resolve(), ROOT)
    if not rel.startswith(".."):
        lines = exclude.read_text().splitlines() if exclude.exists() else []
        if f"/{rel}/" not in lines:
            exclude.parent.mkdir(parents=True, exist_ok=True)
            exclude.write_text("\n".join(lines + [f"/{rel}/"]) + "\n")
    for tag in tags:
        kind = "v0.2" if tag.startswith("v0.2.") else "new"
        dest = out / tag
        listed = git(git_dir, "ls-tree", "-r", "--name-only", tag, "tests", text=True).stdout.split()
        files = [f for f in FILES[kind] if f in listed]
        with tempfile.TemporaryFile() as tmp:
            tmp.write(git(git_dir, "archive", tag, *files).stdout)
            tmp.seek(0)
            with tarfile.open(fileobj=tmp) as tar:
                tar.extractall(dest, filter="data")
        (dest / "tests" / "conftest.py").write_text(SHIM)
        if kind == "new":
            (dest / "tests" / "attention" / "conftest.py").write_text("# (FlashInfer's JIT prebuild hooks: not used)\n")
        (dest / "pytest.ini").write_text("[pytest]\naddopts = -p no:cacheprovider\nfilterwarnings = ignore\n")
        print(f"staged {tag}: {len(files)} files in {dest}")


# The pytest plugin every client suite runs under (written to a scratch folder, loaded with ``-p``): it picks
# and orders the cases, stops starting new ones at the suite's deadline, and writes one JSON line per case
# (verdict, seconds, Triton compile time) from each process as the case ends, so the counts survive a suite
# that is cut or killed. pytest-xdist's controller does not collect; its workers all collect alike.
PLUGIN = r'''"""pytest plugin of flashinfer_triton's client-suite runner (scripts/stage_flashinfer_tests.py)."""

import json
import os
import random
import sys
import time

import pytest

_ENV = os.environ
_WORKER = _ENV.get("PYTEST_XDIST_WORKER", "main")
_DEADLINE = float(_ENV.get("CLIENT_DEADLINE") or "inf")
# pytest-xdist's workers run the cases and report them to the controller, which records the verdicts; a
# process of its own (no -n) does both
_ROLE = "worker" if "PYTEST_XDIST_WORKER" in _ENV else "recorder"
_out = None
_cases = {}
_compile = [0.0, 0, 0]  # seconds compiling, kernels compiled, kernels taken from Triton's on-disk cache
_listening = False


def select(nodeids, cases=0, seed=None, step=1):
    """The indices of the cases to run, in run order.

    ``step``: every step-th case. ``cases`` with ``seed``: a uniform random sample of that many, in a seeded
    random order (so a time limit leaves a uniform sample of what ran); ``seed`` alone: every case in that
    order. ``cases`` alone: an even share per test function, evenly spread over its parameters, round-robin.
    """
    idx = list(range(len(nodeids)))[:: max(1, step)]
    if cases > 0 and len(idx) > cases and seed is None:
        groups = {}
        for i in idx:
            groups.setdefault(nodeids[i].split("[")[0], []).append(i)
        share = max(1, cases // len(groups))
        picked = [g[:: max(1, -(-len(g) // share))] for g in groups.values()]
        return [g[k] for k in range(max(map(len, picked))) for g in picked if k < len(g)]
    if cases > 0 and len(idx) > cases:
        idx = sorted(random.Random(seed).sample(idx, cases))
    if seed is not None:
        random.Random(seed + 1).shuffle(idx)
    return idx


def verdict(phases):
    """One case's verdict from its reports: {when: (outcome, was_xfail)} for setup / call / teardown."""
    setup, call, teardown = (phases.get(w) for w in ("setup", "call", "teardown"))
    if setup and setup[0] == "failed":
        return "error"
    if setup and setup[0] == "skipped":
        return "xfail" if setup[1] else "skipped"
    if call is None:
        return "error"
    if call[0] == "failed":
        return "failed"
    if call[0] == "skipped":
        return "xfail" if call[1] else "skipped"
    if teardown and teardown[0] == "failed":
        return "error"
    return "xpass" if call[1] else "passed"


def _emit(rec):
    global _out
    folder = _ENV.get("CLIENT_RECORDS")
    if not folder:
        return
    if _out is None:
        os.makedirs(folder, exist_ok=True)
        _out = open(os.path.join(folder, f"records-{_WORKER}-{os.getpid()}.jsonl"), "a", buffering=1)  # noqa: SIM115
    _out.write(json.dumps(rec) + "\n")


def _listen():
    # Triton's compile hook, once Triton is loaded (never imported here): compile time per case
    global _listening
    if _listening or "triton" not in sys.modules:
        return
    _listening = True
    try:
        from triton import knobs
    except ImportError:
        return
    chained = knobs.compilation.listener

    def listener(*, src, metadata, metadata_group, times, cache_hit, **kw):
        if cache_hit:
            _compile[2] += 1
        else:
            _compile[0] += times.total / 1e6
            _compile[1] += 1
        if chained is not None:
            chained(src=src, metadata=metadata, metadata_group=metadata_group, times=times, cache_hit=cache_hit,
                    **kw)  # fmt: skip

    knobs.compilation.listener = listener


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    seed = _ENV.get("CLIENT_SEED")
    order = select([it.nodeid for it in items], int(_ENV.get("CLIENT_CASES") or 0),
                   int(seed) if seed else None, int(_ENV.get("CLIENT_STEP") or 1))  # fmt: skip
    shard, shards = map(int, (_ENV.get("CLIENT_SHARD") or "0/1").split("/"))
    order = order[shard::shards]  # one of several processes (e.g. on several GPUs) sharing the selection
    chosen = set(order)
    drop = [it for i, it in enumerate(items) if i not in chosen]
    in_scope = len(items)
    items[:] = [items[i] for i in order]
    if drop:
        config.hook.pytest_deselected(items=drop)
    if _WORKER in ("main", "gw0"):
        _emit({"event": "selected", "in_scope": in_scope, "nodeids": [it.nodeid for it in items]})
    _emit({"event": "collected", "t": time.time()})


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_protocol(item, nextitem):
    if time.time() > _DEADLINE:
        return True  # past the suite's deadline: not run, and no report says otherwise
    return None


def pytest_runtest_logstart(nodeid, location):
    _listen()
    _compile[:] = [0.0, 0, 0]
    _cases[nodeid] = {"start": time.time(), "phases": {}, "seconds": 0.0, "message": "", "compile": None}


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    # (in the process that ran the case) the compile figures ride on the teardown report to pytest-xdist's
    # controller, which records every verdict, those of crashed workers included
    item.user_properties.append(("triton_compile", [round(_compile[0], 3), _compile[1], _compile[2]]))
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized() and torch.cuda.memory_reserved() > (4 << 30):
        # the suites share a GPU among several processes: what a large case cached goes back for the others
        import gc

        gc.collect()
        torch.cuda.empty_cache()


def pytest_runtest_logreport(report):
    if _ROLE == "worker":
        return
    case = _cases.setdefault(report.nodeid, {"start": time.time(), "phases": {}, "seconds": 0.0, "message": "",
                                             "compile": None})  # fmt: skip
    crashed = report.when not in ("setup", "call", "teardown")  # pytest-xdist's report of a crashed worker
    case["phases"][report.when] = (report.outcome, hasattr(report, "wasxfail"))
    case["seconds"] += report.duration or 0.0
    for key, value in report.user_properties:
        if key == "triton_compile":
            case["compile"] = value
    if report.failed and not case["message"]:
        crash = getattr(report.longrepr, "reprcrash", None)
        case["message"] = (crash.message if crash is not None else str(report.longrepr))[:300]
    if report.when != "teardown" and not crashed:
        return
    del _cases[report.nodeid]
    node = getattr(report, "node", None)
    compile_s, compiled, loads = case["compile"] or (0.0, 0, 0)
    _emit({"event": "case", "nodeid": report.nodeid, "verdict": "error" if crashed else verdict(case["phases"]),
           "seconds": round(case["seconds"], 3), "start": round(case["start"], 3),
           "worker": getattr(getattr(node, "gateway", None), "id", _WORKER), "compile_s": compile_s,
           "compiled": compiled, "cache_loads": loads, "message": case["message"]})  # fmt: skip
'''

VERDICTS = ("passed", "failed", "error", "skipped", "xfail", "xpass")


def read_records(records: Path) -> tuple[dict | None, dict[str, dict], list[float]]:
    """The selection (or None if no process reached it), each reported case by node id, and when each
    process finished collecting."""
    selected, cases, collected = None, {}, []
    for path in sorted(records.glob("records-*.jsonl")) if records.is_dir() else []:
        for line in path.read_text(errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:  # the last line of a killed process
                continue
            if rec["event"] == "selected":
                selected = rec
            elif rec["event"] == "case":
                cases[rec["nodeid"]] = rec
            elif rec["event"] == "collected":
                collected.append(rec["t"])
    return selected, cases, collected


def summarize(name: str, records: Path, meta: dict) -> dict:
    """Counts of one suite from its records: every selected case is passed / failed / ... or not run."""
    selected, cases, collected = read_records(records)
    s = {"suite": name, **meta}
    s.update(dict.fromkeys(VERDICTS, 0))
    for rec in cases.values():
        s[rec["verdict"]] += 1
    ran = len(cases)
    s["ran"] = ran
    if selected is None:
        s["in_scope"] = s["selected"] = None
        s["not_run"] = None  # nothing was collected: the log says why
    else:
        s["in_scope"] = selected["in_scope"]
        s["selected"] = len(selected["nodeids"])
        s["not_run"] = len(set(selected["nodeids"]) - set(cases))
    times = sorted(r["seconds"] for r in cases.values())
    s["case_seconds"] = round(sum(times), 1)
    s["case_median_s"] = round(times[len(times) // 2], 3) if times else None
    s["compile_seconds"] = round(sum(r["compile_s"] for r in cases.values()), 1)
    s["kernels_compiled"] = sum(r["compiled"] for r in cases.values())
    s["cache_loads"] = sum(r["cache_loads"] for r in cases.values())
    starts = sorted(t - meta["launched"] for t in collected) if "launched" in meta else []
    s["startup_median_s"] = round(starts[len(starts) // 2], 1) if starts else None
    s["failures"] = sorted(f"{r['nodeid']}: {r['message']}" for r in cases.values()
                           if r["verdict"] in ("failed", "error", "xpass"))  # fmt: skip
    per_fn = {}
    for r in cases.values():
        fn = per_fn.setdefault(r["nodeid"].split("[")[0], [0, 0.0, 0.0])
        fn[0] += 1
        fn[1] += r["seconds"]
        fn[2] += r["compile_s"]
    s["per_function"] = {k: {"cases": n, "seconds": round(t, 1), "compile_seconds": round(c, 1)}
                         for k, (n, t, c) in sorted(per_fn.items(), key=lambda kv: -kv[1][1])}  # fmt: skip
    return s


def summary_line(s: dict) -> str:
    """One line per suite, as docs/conformance.md quotes it."""
    counts = ", ".join(f"{s[v]} {v}" for v in VERDICTS if v not in ("xpass",) or s[v])
    sel = "" if s.get("seed") is None else f", seed {s['seed']}"
    head = f"{s['suite']}: in scope {s['in_scope']}, selected {s['selected']}{sel}, ran {s['ran']}"
    tail = f"; not run {s['not_run']}"
    if s["not_run"]:
        tail += " (time limit)" if s.get("cut") else " (see the log)"
    wall = f"; {s.get('seconds')} s, {s.get('workers')} workers"
    return head + ": " + counts + tail + wall


def timing_line(s: dict) -> str:
    """Where the suite's time went: per case, Triton compiles, process start-up (imports and collection)."""
    share = f" ({100 * s['compile_seconds'] / s['case_seconds']:.0f}% of case time)" if s["case_seconds"] else ""
    return (
        f"{s['suite']} time: {s['case_seconds']} s in cases"
        + ("" if s["case_median_s"] is None else f" (median {s['case_median_s']} s a case)")
        + "; Triton "
        f"compiled {s['kernels_compiled']} kernels in {s['compile_seconds']} s{share}, "
        f"{s['cache_loads']} taken from its cache; start-up to collected: {s['startup_median_s']} s"
    )


def run_suites(
    suites: list[dict], log_dir: Path, timeout: int, margin: int = 45, grace: int = 20, workers: int = 0,
    cases: int = 0, seed: int | None = None, step: int = 1, dist: str = "load", gpu: str | None = None,
    shard: tuple[int, int] = (0, 1),
) -> int:  # fmt: skip
    """Every suite at once, each its own pytest (``workers`` pytest-xdist processes when > 0) under the plugin.

    A suite's processes start no case after ``timeout - margin`` seconds (those count as not run); at
    ``timeout`` the process group gets SIGINT, and SIGKILL ``grace`` seconds later. A suite is a dict with
    ``name``, ``cwd``, ``args`` (pytest's arguments) and optionally ``env`` and ``pythonpath``. ``shard``
    ``(k, n)`` runs the k-th of n interleaved parts of the selection (its summary carries a ``-part<k>of<n>``
    suffix; ``summary`` adds the parts up).
    """
    log_dir.mkdir(parents=True, exist_ok=True)
    plugin_dir = Path(tempfile.mkdtemp(prefix="client-run-"))
    (plugin_dir / "client_run_plugin.py").write_text(PLUGIN)
    procs = {}
    for suite in suites:
        name = suite["name"] + (f"-part{shard[0]}of{shard[1]}" if shard[1] > 1 else "")
        records = log_dir / f"{name}.records"
        if records.is_dir():
            for old in records.glob("records-*.jsonl"):
                old.unlink()
        launched = time.time()
        # (a runner started from inside a pytest-xdist worker must not hand its workers that role)
        env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTEST_XDIST", "PYTEST_CURRENT_TEST"))}
        env.update(suite.get("env", {}))
        paths = [str(plugin_dir), *suite.get("pythonpath", []), str(ROOT / "src"), env.get("PYTHONPATH")]
        env["PYTHONPATH"] = os.pathsep.join(filter(None, paths))
        env.update(CLIENT_RECORDS=str(records), CLIENT_DEADLINE=str(launched + timeout - margin),
                   CLIENT_CASES=str(cases), CLIENT_SEED="" if seed is None else str(seed),
                   CLIENT_STEP=str(step), CLIENT_SHARD=f"{shard[0]}/{shard[1]}")  # fmt: skip
        if gpu is not None:
            env["CUDA_VISIBLE_DEVICES"] = gpu
        cmd = [sys.executable, "-m", "pytest", *suite["args"], "-p", "client_run_plugin", "-v", "-rfE",
               "--tb=line", f"--junitxml={log_dir / (name + '.xml')}"]  # fmt: skip
        if workers > 0:
            cmd += ["-n", str(workers), "--dist", dist]
        f = open(log_dir / f"{name}.log", "w")  # noqa: SIM115 (closed once the suite ends: the suites run at once)
        f.write(" ".join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(
            cmd, cwd=suite["cwd"], env=env, stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs[name] = (proc, f, records, launched)
    deadline = time.time() + timeout
    ended = {}
    while True:
        for name, (p, *_) in procs.items():
            if name not in ended and p.poll() is not None:
                ended[name] = time.time()
        if len(ended) == len(procs) or time.time() >= deadline:
            break
        time.sleep(0.2)
    late = [p for p, *_ in procs.values() if p.poll() is None]
    for p in late:  # SIGINT first: pytest then prints its summary (each failure's reason) for the cases that ran
        os.killpg(p.pid, signal.SIGINT)
    end = time.time() + grace
    while time.time() < end and any(p.poll() is None for p in late):
        time.sleep(0.2)
    for p in late:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the xdist workers too
        p.wait()
    shutil.rmtree(plugin_dir, ignore_errors=True)
    bad = False
    for name, (proc, f, records, launched) in procs.items():
        f.close()
        seconds = round(ended.get(name, time.time()) - launched, 1)
        meta = {"rc": 124 if proc in late else proc.returncode, "seconds": seconds,
                "launched": launched, "workers": workers, "cases": cases, "seed": seed, "step": step,
                "timeout": timeout, "gpu": gpu, "shard": list(shard)}  # fmt: skip
        s = summarize(name, records, meta)
        s["cut"] = bool(s["not_run"]) and meta["seconds"] >= timeout - margin  # else: the log says why
        lines = [summary_line(s), timing_line(s)]
        (log_dir / f"{name}.summary.json").write_text(json.dumps(s, indent=1))
        (log_dir / f"{name}.summary.txt").write_text("\n".join(lines + s["failures"]) + "\n")
        print("\n".join(lines + s["failures"][:20]))
        bad |= bool(s["failed"] or s["error"] or s["xpass"] or s["selected"] is None or meta["rc"] not in (0, 124))
    return 1 if bad else 0


def flashinfer_suites(out: Path, names: list[str] | None) -> list[dict]:
    staged = sorted(p for p in out.iterdir() if (p / "tests" / "conftest.py").exists()) if out.is_dir() else []
    if names:
        missing = sorted(set(names) - {p.name for p in staged})
        if missing:
            raise SystemExit(f"--suites: not staged in {out}: {', '.join(missing)}")
        staged = [p for p in staged if p.name in names]
    if not staged:
        raise SystemExit(f"no staged suite in {out}: run `stage` first")
    for p in staged:  # the generated conftest always matches this script
        (p / "tests" / "conftest.py").write_text(SHIM)
    return [{"name": f"flashinfer-tests-{p.name}", "cwd": str(p), "args": ["tests"]} for p in staged]


def write_shims(out: Path) -> None:
    """Rewrite the generated conftest of every staged suite (after this script changed)."""
    for suite in sorted(p for p in out.iterdir() if (p / "tests" / "conftest.py").exists()):
        (suite / "tests" / "conftest.py").write_text(SHIM)
        print(f"shim rewritten: {suite / 'tests' / 'conftest.py'}")


def add_run_options(r: argparse.ArgumentParser, log_default: str) -> None:
    """The runner's options, shared with scripts/stage_vllm_tests.py."""
    r.add_argument("--cases", type=int, default=0, help="about this many cases a suite (0: all)")
    r.add_argument("--seed", type=int, help="a uniform random sample (with --cases) in a random order, this seed")
    r.add_argument("--sample", type=int, default=1, help="every N-th case")
    r.add_argument("--workers", type=int, default=0, help="pytest-xdist processes per suite (0: one process)")
    r.add_argument("--dist", default="load", help="pytest-xdist's --dist")
    r.add_argument("--timeout", type=int, default=3600, help="seconds before a suite is stopped")
    r.add_argument("--margin", type=int, default=45, help="no case starts in a suite's last MARGIN seconds")
    r.add_argument("--gpu", help="CUDA_VISIBLE_DEVICES for the suite's processes")
    r.add_argument("--part", default="0/1", help="K/N: the K-th (from 0) of N interleaved parts of the selection")
    r.add_argument("--log", default=log_default, help="logs, JUnit XML, per-case records and summaries")


def run_from_args(suites: list[dict], a: argparse.Namespace) -> int:
    if a.cases < 0 or a.sample < 1 or a.workers < 0 or a.timeout <= 0 or not 0 <= a.margin < a.timeout:
        raise SystemExit("--cases, --workers >= 0, --sample >= 1, --timeout > 0 and 0 <= --margin < --timeout")
    m = re.fullmatch(r"(\d+)/(\d+)", a.part)
    if not m or not int(m.group(1)) < int(m.group(2)):
        raise SystemExit(f"--part: K/N with 0 <= K < N, got {a.part!r}")
    if int(m.group(2)) > 1 and a.seed is None:
        raise SystemExit("--part needs --seed: the parts must be drawn alike")
    return run_suites(suites, Path(a.log), a.timeout, a.margin, workers=a.workers, cases=a.cases, seed=a.seed,
                      step=a.sample, dist=a.dist, gpu=a.gpu, shard=(int(m.group(1)), int(m.group(2))))  # fmt: skip


def combine(parts: list[dict]) -> dict:
    """One suite's summary from those of its parts (``--part K/N``, each a share of one seeded selection)."""
    s = dict(parts[0], suite=re.sub(r"-part\d+of\d+$", "", parts[0]["suite"]))
    for key in (*VERDICTS, "ran", "selected", "not_run", "case_seconds", "compile_seconds", "kernels_compiled",
                "cache_loads", "workers"):  # fmt: skip
        s[key] = None if any(p[key] is None for p in parts) else round(sum(p[key] for p in parts), 1)
    s["seconds"] = max(p["seconds"] for p in parts)
    s["cut"] = any(p.get("cut") for p in parts)
    s["failures"] = sorted(f for p in parts for f in p["failures"])
    s["case_median_s"] = s["startup_median_s"] = None  # (medians of the parts do not add up)
    per_fn = {}
    for p in parts:
        for fn, t in p["per_function"].items():
            acc = per_fn.setdefault(fn, dict.fromkeys(t, 0))
            for k, v in t.items():
                acc[k] = round(acc[k] + v, 1)
    s["per_function"] = dict(sorted(per_fn.items(), key=lambda kv: -kv[1]["seconds"]))
    return s


def print_summaries(log_dir: Path, top: int = 8) -> int:
    """The summary lines of the suites logged in ``log_dir`` (parts added up), with the test functions that
    took most time."""
    found = sorted(log_dir.glob("*.summary.json"))
    groups = {}
    for path in found:
        s = json.loads(path.read_text())
        groups.setdefault(re.sub(r"-part\d+of\d+$", "", s["suite"]), []).append(s)
    for parts in groups.values():
        s = combine(parts) if len(parts) > 1 else parts[0]
        print(summary_line(s))
        print(timing_line(s))
        for fn, t in list(s["per_function"].items())[:top]:
            print(f"    {t['seconds']:8.1f} s {t['cases']:6d} cases {t['compile_seconds']:8.1f} s compiling  {fn}")
        for failure in s["failures"]:
            print("    " + failure)
    return 0 if found else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("git_dir")
    s.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    s.add_argument("--tags", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    r.add_argument("--suites", nargs="*", help="staged tags to run (default: every one)")
    add_run_options(r, str(ROOT / "out" / "client-suites"))
    h = sub.add_parser("shim")
    h.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    m = sub.add_parser("summary")
    m.add_argument("log")
    a = ap.parse_args()
    if a.cmd == "stage":
        stage(a.git_dir, Path(a.out), a.tags or ["v0.2.0", newest_tag(a.git_dir)])
        return 0
    if a.cmd == "shim":
        write_shims(Path(a.out))
        return 0
    if a.cmd == "summary":
        return print_summaries(Path(a.log))
    return run_from_args(flashinfer_suites(Path(a.out), a.suites), a)


if __name__ == "__main__":
    sys.exit(main())
