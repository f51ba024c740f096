"""scripts/sanitize_kernels.py (the compute-sanitizer driver) on the CPU: one case of each kind it builds (ragged with
a custom mask, paged fp8 K/V, batch decode past head dim 256, vLLM's v1 and v2) through the library's PyTorch path
against the float32 reference, so that the driver's inputs, calls and checks keep working between GPU runs. In a
subprocess: the script turns the CUDA caching allocator off for its own process."""

from __future__ import annotations

import os
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "scripts", "sanitize_kernels.py")
CASES = ["prefill-custom-mask-g2", "prefill-paged-fp8-kv-ps16", "decode-d320-paged", "vllm-v1", "vllm-v2"]


def _run(*args):
    env = dict(os.environ, TRITON_INTERPRET="0")
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, timeout=300, env=env)


def test_sanitize_script_cases_on_the_torch_path():
    r = _run("--device", "cpu", "--only", *CASES)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    ran = [ln.split()[0] for ln in r.stdout.splitlines() if ln.endswith(" ok") and " torch " in ln]
    assert len(ran) == len(CASES) and all(any(c in name for c in CASES) for name in ran), r.stdout
    assert r.stdout.strip().endswith(f"{len(CASES)} of {len(CASES)} cases ok"), r.stdout


def test_sanitize_script_lists_and_shards_every_case():
    every = _run("--list")
    assert every.returncode == 0, every.stderr[-3000:]
    names = every.stdout.split()
    assert len(names) == len(set(names)) >= 20
    assert _run("--list", "--shard", "1/3").stdout.split() == names[1::3]
