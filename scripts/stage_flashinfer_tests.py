#!/usr/bin/env python3
"""Stage FlashInfer's own attention tests and run them against flashinfer_triton, as a client would.

    python scripts/stage_flashinfer_tests.py stage GIT_DIR [--out DIR] [--tags v0.2.0 NEWEST]
    python scripts/stage_flashinfer_tests.py run [--out DIR] [--sample N | --cases N [--seed S]] [--workers W]
        [--timeout S] [--log DIR]
    python scripts/stage_flashinfer_tests.py shim [--out DIR]

``stage`` exports each tag's test files from a FlashInfer git directory (a bare clone works) into ``DIR``
(default ``.flashinfer-tests``, added to ``.git/info/exclude``: their files are never committed here), then
writes a ``conftest.py`` shim per suite. The shim calls ``flashinfer_triton.as_flashinfer()``, provides what
the tests import beyond the attention API (``flashinfer.jit``, ``flashinfer.utils`` helpers; anything else
they reach raises NotImplementedError when used, so no case can pass on a stub), and deselects the cases
outside what flashinfer_triton claims (head dims above 512 or not a multiple of 16, fp8 queries, NVFP4,
JIT-variant and multi-item-scoring tests, non-FlashInfer backends such as trtllm-gen / cudnn / cute-dsl).
``NEWEST`` defaults to the repository's newest release tag (rc tags count when nothing newer exists).

``run`` runs each staged suite with pytest (CUDA required: the tests put their tensors on ``cuda:0``),
``--sample N`` keeping every N-th selected case (``--cases N``: about N cases a suite, an even share per test
function, run round-robin; with ``--seed S`` a uniform random sample of N drawn with that seed), every suite at
once (``--workers W``: W pytest-xdist processes each), and prints and logs the pass counts. ``shim`` rewrites
the staged suites' generated ``conftest.py`` after this script changed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
import os
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
    keep, drop = [], []
    for item in items:
        (drop if _out_of_scope(item) else keep).append(item)
    step = int(os.environ.get("FI_SAMPLE", "1"))
    cases = int(os.environ.get("FI_CASES", "0"))
    seed = os.environ.get("FI_SEED", "")
    if os.environ.get("FI_SCOPE_FILE"):  # (pytest-xdist's controller does not collect: the workers write it)
        with open(os.environ["FI_SCOPE_FILE"], "w") as f:
            f.write(f"in scope: {len(keep)} cases, out of scope: {len(drop)}\n")
    if step > 1:
        drop += [it for i, it in enumerate(keep) if i % step]
        keep = keep[::step]
    if cases > 0 and len(keep) > cases and seed:
        # a uniform random sample, drawn the same way in every process (pytest-xdist workers collect alike)
        import random

        picked = sorted(random.Random(int(seed)).sample(range(len(keep)), cases))
        chosen = set(picked)
        drop += [it for i, it in enumerate(keep) if i not in chosen]
        keep = [keep[i] for i in picked]
        random.Random(int(seed) + 1).shuffle(keep)  # a time limit then cuts every test function alike
    elif cases > 0 and len(keep) > cases:
        # about this many cases: an even share per test function, evenly spread over its parameters, run
        # round-robin so that a time limit cuts every function's share alike
        groups = {}
        for it in keep:
            groups.setdefault(it.nodeid.split("[")[0], []).append(it)
        share = max(1, cases // len(groups))
        picked = [g[:: max(1, -(-len(g) // share))] for g in groups.values()]
        chosen = {id(it) for g in picked for it in g}
        drop += [it for it in keep if id(it) not in chosen]
        keep = [g[i] for i in range(max(map(len, picked))) for g in picked if i < len(g)]
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


VERDICT = re.compile(
    r"^\[gw\d+\] \[ *\d+%\] (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS) tests/|"
    r"^tests/\S+ (PASSED|FAILED|ERROR|SKIPPED|XFAIL|XPASS)",
    re.M,
)


def run(
    out: Path,
    sample: int,
    timeout: int,
    log_dir: Path | None,
    cases: int = 0,
    seed: int | None = None,
    workers: int = 0,
    grace: int = 20,
) -> int:
    """Every staged suite at once (each its own pytest, ``workers`` pytest-xdist processes when > 0), each cut
    after ``timeout`` seconds with its whole process group (SIGINT, then SIGKILL ``grace`` seconds later); the
    per-case verdicts are counted from -v output."""
    env = dict(os.environ, FI_SAMPLE=str(sample), FI_CASES=str(cases), FI_SEED="" if seed is None else str(seed))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    log_dir = log_dir or Path(tempfile.mkdtemp())
    log_dir.mkdir(parents=True, exist_ok=True)
    procs = {}
    for suite in sorted(p for p in out.iterdir() if (p / "tests" / "conftest.py").exists()):
        cmd = [sys.executable, "-m", "pytest", "tests", "-v", "-rfE", "--tb=line"]
        if workers > 0:
            cmd += ["-n", str(workers)]
        log = log_dir / f"flashinfer-tests-{suite.name}.log"
        env["FI_SCOPE_FILE"] = str(log_dir / f"flashinfer-tests-{suite.name}.scope")
        f = open(log, "w")  # noqa: SIM115 (closed once the suite ends: the suites run at once)
        proc = subprocess.Popen(
            cmd, cwd=suite, env=dict(env), stdout=f, stderr=subprocess.STDOUT, start_new_session=True
        )
        procs[suite.name] = (proc, f, log, time.time())
    deadline = time.time() + timeout
    while time.time() < deadline and any(p.poll() is None for p, *_ in procs.values()):
        time.sleep(1)
    late = [p for p, *_ in procs.values() if p.poll() is None]
    for p in late:  # SIGINT first: pytest then prints its summary (each failure's reason) for the cases that ran
        os.killpg(p.pid, signal.SIGINT)
    end = time.time() + grace
    while time.time() < end and any(p.poll() is None for p in late):
        time.sleep(1)
    for p in late:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)  # the xdist workers too
        p.wait()
    summary = {}
    for name, (proc, f, log, start) in procs.items():
        rc = 124 if proc in late else proc.returncode
        f.close()
        text = log.read_text(errors="replace")
        counts = {}
        for m in VERDICT.finditer(text):
            verdict = (m.group(1) or m.group(2)).lower()
            counts[verdict] = counts.get(verdict, 0) + 1
        scope_file = log_dir / f"flashinfer-tests-{name}.scope"
        scope = re.search(r"in scope: (\d+) cases", scope_file.read_text()) if scope_file.exists() else None
        if scope:
            counts["in_scope"] = int(scope.group(1))
        sel = re.search(r"collected (\d+) items(?: / (\d+) deselected)?", text)
        if sel:
            counts["collected"] = int(sel.group(1))
            counts["deselected"] = int(sel.group(2) or 0)
        summary[name] = dict(counts, rc=rc, seconds=round(time.time() - start, 1), sample=sample, cases=cases,
                             seed=seed, workers=workers)  # fmt: skip
        print(name, summary[name])
    (log_dir / "flashinfer-tests-summary.json").write_text(json.dumps(summary, indent=2))
    return 0 if all(s["rc"] == 0 for s in summary.values()) else 1


def write_shims(out: Path) -> None:
    """Rewrite the generated conftest of every staged suite (after this script changed)."""
    for suite in sorted(p for p in out.iterdir() if (p / "tests" / "conftest.py").exists()):
        (suite / "tests" / "conftest.py").write_text(SHIM)
        print(f"shim rewritten: {suite / 'tests' / 'conftest.py'}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    s = sub.add_parser("stage")
    s.add_argument("git_dir")
    s.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    s.add_argument("--tags", nargs="*")
    r = sub.add_parser("run")
    r.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    r.add_argument("--sample", type=int, default=1)
    r.add_argument("--cases", type=int, default=0)
    r.add_argument("--timeout", type=int, default=3600)
    r.add_argument("--seed", type=int, help="with --cases: a uniform random sample drawn with this seed")
    r.add_argument("--workers", type=int, default=0, help="pytest-xdist processes per suite (0: one process)")
    r.add_argument("--log")
    h = sub.add_parser("shim")
    h.add_argument("--out", default=str(ROOT / ".flashinfer-tests"))
    a = ap.parse_args()
    if a.cmd == "stage":
        stage(a.git_dir, Path(a.out), a.tags or ["v0.2.0", newest_tag(a.git_dir)])
        return 0
    if a.cmd == "shim":
        write_shims(Path(a.out))
        return 0
    return run(Path(a.out), a.sample, a.timeout, Path(a.log) if a.log else None, a.cases, a.seed, a.workers)


if __name__ == "__main__":
    sys.exit(main())
