"""Stage vLLM's paged-attention and cache tests to run against ``flashinfer_triton.vllm`` as a client.

    python scripts/stage_vllm_tests.py --src VLLM [--rev REV] [--dest .vllm-tests]
    python scripts/stage_vllm_tests.py run [--suites paged-attention cache] [runner options]

``VLLM`` is a vLLM checkout or git directory (``--rev``: the commit to read, default HEAD) from the generation whose
``tests/kernels/attention/test_attention.py`` still tests ``paged_attention_v1`` / ``v2`` on CUDA (before vLLM made
that test ROCm-only). Copied unchanged into ``DEST`` (git-ignored: ``.vllm-tests/`` is listed in
``.git/info/exclude``, never committed): ``tests/kernels/attention/{test_attention,test_cache,conftest}.py`` and
``tests/kernels/allclose_default.py``. Written beside them by this script: a ``vllm`` package whose ``_custom_ops``
and ``torch.ops._C`` / ``torch.ops._C_cache_ops`` entry points are backed by ``flashinfer_triton.vllm`` (the ops are
registered with ``torch.library.custom_op``, so the tests' ``opcheck`` calls run PyTorch's real op checks), the small
vLLM utilities the tests import (dtype names, seeding, random caches), vLLM's ``tests/kernels/utils.py`` pieces they
use, and import-only placeholders for what only the out-of-scope tests use (xformers, vLLM's attention layer).

Then, on a GPU machine (docs/conformance.md has the revision, the case selection and the pass counts), each suite
under scripts/stage_flashinfer_tests.py's runner (a seeded order, a deadline, a summary line per suite):

    python scripts/stage_vllm_tests.py run --suites paged-attention --gpu 0 --workers 16 --seed 0 --timeout 500

``--suites``: ``paged-attention`` (``test_paged_attention``), ``cache`` (``test_cache.py`` without the MLA tests).
Give each suite one GPU (``--gpu``): with more than one visible, vLLM's tests parametrise over two devices.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import stage_flashinfer_tests as runner  # noqa: E402 (the client-suite runner, shared)

ROOT = Path(__file__).resolve().parent.parent

# vLLM's tests that cover flashinfer_triton.vllm: pytest's arguments, run from the staging folder
SUITES = {
    "paged-attention": ["tests/kernels/attention/test_attention.py", "-k", "test_paged_attention"],
    "cache": [
        "tests/kernels/attention/test_cache.py",
        "-k",
        "(copy_blocks or reshape_and_cache or swap_blocks or fp8_e4m3_conversion) and not mla",
    ],
}

COPIED = [
    "tests/kernels/attention/test_attention.py",
    "tests/kernels/attention/test_cache.py",
    "tests/kernels/attention/conftest.py",
    "tests/kernels/allclose_default.py",
]

SHIM = {}

SHIM["pytest.ini"] = """[pytest]
addopts = -p no:cacheprovider
markers =
    skip_global_cleanup: vLLM's marker (no effect here)
    core_model: vLLM's marker (no effect here)
"""

SHIM["vllm/__init__.py"] = '''\
"""Client shim: the parts of vLLM its kernel tests import, backed by flashinfer_triton (staged, not vLLM)."""
'''

SHIM["vllm/_custom_ops.py"] = '''\
"""vLLM's ``_custom_ops`` entry points used by its paged-attention and cache tests, on flashinfer_triton.vllm.

The same functions are registered as ``torch.ops._C.paged_attention_v1`` / ``_v2`` and
``torch.ops._C_cache_ops.*`` (``torch.library.custom_op``, schemas as vLLM's), which the tests pass to ``opcheck``.
"""

from __future__ import annotations

import torch

from flashinfer_triton import vllm as _fv


@torch.library.custom_op("_C::paged_attention_v1", mutates_args=("out",))
def _pa_v1(out: torch.Tensor, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
           num_kv_heads: int, scale: float, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
           max_seq_len: int, alibi_slopes: torch.Tensor | None, kv_cache_dtype: str, k_scale: torch.Tensor,
           v_scale: torch.Tensor, tp_rank: int, blocksparse_local_blocks: int, blocksparse_vert_stride: int,
           blocksparse_block_size: int, blocksparse_head_sliding_step: int) -> None:
    _fv.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
                           blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                           blocksparse_head_sliding_step)


@torch.library.custom_op("_C::paged_attention_v2", mutates_args=("out", "exp_sums", "max_logits", "tmp_out"))
def _pa_v2(out: torch.Tensor, exp_sums: torch.Tensor, max_logits: torch.Tensor, tmp_out: torch.Tensor,
           query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, num_kv_heads: int, scale: float,
           block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, max_seq_len: int,
           alibi_slopes: torch.Tensor | None, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor,
           tp_rank: int, blocksparse_local_blocks: int, blocksparse_vert_stride: int, blocksparse_block_size: int,
           blocksparse_head_sliding_step: int) -> None:
    _fv.paged_attention_v2(out, exp_sums, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                           v_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                           blocksparse_block_size, blocksparse_head_sliding_step)


@torch.library.custom_op("_C_cache_ops::reshape_and_cache", mutates_args=("key_cache", "value_cache"))
def _rc(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
        slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    _fv.reshape_and_cache(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


@torch.library.custom_op("_C_cache_ops::reshape_and_cache_flash", mutates_args=("key_cache", "value_cache"))
def _rcf(key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
         slot_mapping: torch.Tensor, kv_cache_dtype: str, k_scale: torch.Tensor, v_scale: torch.Tensor) -> None:
    _fv.reshape_and_cache_flash(key, value, key_cache, value_cache, slot_mapping, kv_cache_dtype, k_scale, v_scale)


@torch.library.custom_op("_C_cache_ops::copy_blocks", mutates_args=("key_caches", "value_caches"))
def _cb(key_caches: list[torch.Tensor], value_caches: list[torch.Tensor], block_mapping: torch.Tensor) -> None:
    _fv.copy_blocks(key_caches, value_caches, block_mapping)


@torch.library.custom_op("_C_cache_ops::swap_blocks", mutates_args=("dst",))
def _sb(src: torch.Tensor, dst: torch.Tensor, block_mapping: torch.Tensor) -> None:
    _fv.swap_blocks(src, dst, block_mapping)


@torch.library.custom_op("_C_cache_ops::convert_fp8", mutates_args=("dst_cache",))
def _cf(dst_cache: torch.Tensor, src_cache: torch.Tensor, scale: float, kv_cache_dtype: str) -> None:
    _fv.convert_fp8(dst_cache, src_cache, scale, kv_cache_dtype)


for _op in (_pa_v1, _pa_v2, _rc, _rcf, _cb, _sb, _cf):
    _op.register_fake(lambda *args, **kwargs: None)  # in-place ops: nothing to make


def paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens, block_size,
                       max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank=0,
                       blocksparse_local_blocks=0, blocksparse_vert_stride=0, blocksparse_block_size=64,
                       blocksparse_head_sliding_step=0):
    _fv.paged_attention_v1(out, query, key_cache, value_cache, num_kv_heads, scale, block_tables, seq_lens,
                           block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale, v_scale, tp_rank,
                           blocksparse_local_blocks, blocksparse_vert_stride, blocksparse_block_size,
                           blocksparse_head_sliding_step)


def paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
                       block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                       v_scale, tp_rank=0, blocksparse_local_blocks=0, blocksparse_vert_stride=0,
                       blocksparse_block_size=64, blocksparse_head_sliding_step=0):
    _fv.paged_attention_v2(out, exp_sum, max_logits, tmp_out, query, key_cache, value_cache, num_kv_heads, scale,
                           block_tables, seq_lens, block_size, max_seq_len, alibi_slopes, kv_cache_dtype, k_scale,
                           v_scale, tp_rank, blocksparse_local_blocks, blocksparse_vert_stride,
                           blocksparse_block_size, blocksparse_head_sliding_step)


reshape_and_cache = _fv.reshape_and_cache
reshape_and_cache_flash = _fv.reshape_and_cache_flash
copy_blocks = _fv.copy_blocks
swap_blocks = _fv.swap_blocks
convert_fp8 = _fv.convert_fp8


def get_max_shared_memory_per_block_device_attribute(device: int) -> int:
    return torch.cuda.get_device_properties(device).shared_memory_per_block_optin


def __getattr__(name):
    raise NotImplementedError(f"vllm._custom_ops.{name} is not provided by the flashinfer_triton shim")
'''

SHIM["vllm/platforms/__init__.py"] = '''"""``current_platform`` as vLLM's tests use it: CUDA, not ROCm."""

import random

import numpy as np
import torch


class _Platform:
    def is_rocm(self) -> bool:
        return False

    def is_navi(self) -> bool:
        return False

    def is_cuda(self) -> bool:
        return True

    def is_cpu(self) -> bool:
        return False

    def seed_everything(self, seed=None) -> None:
        if seed is not None:
            random.seed(seed)
            np.random.seed(seed)
            torch.manual_seed(seed)


current_platform = _Platform()
'''

SHIM["vllm/utils/__init__.py"] = '''\
"""The vLLM utilities its kernel tests import: dtype names, shared memory size, random KV caches."""

from __future__ import annotations

import torch

STR_DTYPE_TO_TORCH_DTYPE = {
    "float32": torch.float32, "half": torch.half, "bfloat16": torch.bfloat16, "float": torch.float,
    "fp8": torch.uint8, "fp8_e4m3": torch.uint8, "fp8_e5m2": torch.uint8,
}


def get_max_shared_memory_bytes(gpu: int = 0) -> int:
    return int(torch.cuda.get_device_properties(gpu).shared_memory_per_block_optin)


def get_kv_cache_torch_dtype(cache_dtype, model_dtype=None) -> torch.dtype:
    if isinstance(cache_dtype, torch.dtype):
        return cache_dtype
    if cache_dtype == "auto":
        if isinstance(model_dtype, torch.dtype):
            return model_dtype
        return STR_DTYPE_TO_TORCH_DTYPE[model_dtype]
    return STR_DTYPE_TO_TORCH_DTYPE[cache_dtype]


def _fill(t: torch.Tensor, cache_dtype, low: float, high: float) -> None:
    if cache_dtype == "fp8":
        from vllm import _custom_ops as ops

        tmp = torch.empty(t.shape, dtype=torch.float16, device=t.device).uniform_(low, high)
        ops.convert_fp8(t, tmp)
    else:
        t.uniform_(low, high)


def create_kv_caches_with_random(num_blocks, block_size, num_layers, num_heads, head_size, cache_dtype,
                                 model_dtype=None, seed=None, device="cuda"):
    from vllm.platforms import current_platform

    if cache_dtype == "fp8" and head_size % 16:
        raise ValueError(f"fp8 caches need a head size multiple of 16, got {head_size}")
    current_platform.seed_everything(seed)
    dtype = get_kv_cache_torch_dtype(cache_dtype, model_dtype)
    scale = head_size**-0.5
    x = 16 // torch.tensor([], dtype=dtype).element_size()
    keys, values = [], []
    for _ in range(num_layers):
        k = torch.empty((num_blocks, num_heads, head_size // x, block_size, x), dtype=dtype, device=device)
        _fill(k, cache_dtype, -scale, scale)
        keys.append(k)
    for _ in range(num_layers):
        v = torch.empty((num_blocks, num_heads, head_size, block_size), dtype=dtype, device=device)
        _fill(v, cache_dtype, -scale, scale)
        values.append(v)
    return keys, values


def create_kv_caches_with_random_flash(num_blocks, block_size, num_layers, num_heads, head_size, cache_dtype,
                                       model_dtype=None, seed=None, device="cuda", cache_layout="NHD"):
    from vllm.platforms import current_platform

    current_platform.seed_everything(seed)
    dtype = get_kv_cache_torch_dtype(cache_dtype, model_dtype)
    order = (0, 1, 2, 3, 4) if cache_layout == "NHD" else (0, 1, 3, 2, 4)
    logical = (num_blocks, 2, block_size, num_heads, head_size)
    scale = head_size**-0.5
    keys, values = [], []
    for _ in range(num_layers):
        kv = torch.empty(tuple(logical[i] for i in order), dtype=dtype, device=device).permute(*order)
        _fill(kv, cache_dtype, -scale, scale)
        keys.append(kv[:, 0])
        values.append(kv[:, 1])
    return keys, values
'''

SHIM["tests/kernels/utils.py"] = '''\
"""The pieces of vLLM's tests/kernels/utils.py that its attention and cache tests use."""

from __future__ import annotations

import torch

DEFAULT_OPCHECK_TEST_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor")
ALL_OPCHECK_TEST_UTILS = DEFAULT_OPCHECK_TEST_UTILS + ("test_aot_dispatch_dynamic",)


def opcheck(op, args, kwargs=None, *, test_utils=ALL_OPCHECK_TEST_UTILS, raise_exception=True, cond=True):
    """PyTorch's checks of a registered op (schema, autograd registration, fake tensors, ...)."""
    if not cond:
        return {}
    return torch.library.opcheck(op, args, kwargs, test_utils=test_utils, raise_exception=raise_exception)
'''

_PLACEHOLDER = '''"""Import-only placeholder: only tests outside the staged scope use it."""


def _unavailable(*args, **kwargs):
    raise NotImplementedError("not provided by the flashinfer_triton shim (out-of-scope test)")


class _Unavailable:
    def __init__(self, *args, **kwargs):
        _unavailable()
'''
SHIM["vllm/attention/__init__.py"] = _PLACEHOLDER + "\nAttention = MultiHeadAttention = _Unavailable\n"
SHIM["vllm/attention/layer.py"] = _PLACEHOLDER + "\nAttention = MultiHeadAttention = _Unavailable\n"
SHIM["vllm/attention/backends/__init__.py"] = ""
SHIM["vllm/attention/backends/xformers.py"] = _PLACEHOLDER + "\n_make_alibi_bias = _unavailable\n"
SHIM["vllm/model_executor/__init__.py"] = ""
SHIM["vllm/model_executor/layers/__init__.py"] = ""
SHIM["vllm/model_executor/layers/attention.py"] = _PLACEHOLDER + "\nAttention = MMEncoderAttention = _Unavailable\n"
SHIM["xformers/__init__.py"] = _PLACEHOLDER
SHIM["xformers/ops/__init__.py"] = _PLACEHOLDER + "\nmemory_efficient_attention_forward = _unavailable\n"
SHIM["xformers/ops/fmha/__init__.py"] = ""
SHIM["xformers/ops/fmha/attn_bias.py"] = _PLACEHOLDER + "\nBlockDiagonalCausalMask = _Unavailable\n"


def _read(src: str, rev: str, path: str) -> str:
    if os.path.isdir(os.path.join(src, "tests")):  # a checkout
        with open(os.path.join(src, path), encoding="utf-8") as f:
            return f.read()
    return subprocess.run(["git", "--git-dir", src, "show", f"{rev}:{path}"], check=True, capture_output=True,
                          text=True).stdout  # fmt: skip


def run(argv) -> int:
    ap = argparse.ArgumentParser(description="run staged vLLM tests under the client-suite runner")
    ap.add_argument("--dest", default=str(ROOT / ".vllm-tests"), help="the staging folder")
    ap.add_argument("--suites", nargs="+", choices=sorted(SUITES), default=sorted(SUITES))
    runner.add_run_options(ap, str(ROOT / "out" / "client-suites"))
    a = ap.parse_args(argv)
    dest = Path(a.dest).resolve()
    if not (dest / "vllm" / "_custom_ops.py").is_file():
        raise SystemExit(f"--dest: {dest} holds no staged vLLM tests: stage them first")
    suites = [{"name": f"vllm-{n}", "cwd": str(dest), "args": SUITES[n], "pythonpath": [str(dest)]} for n in a.suites]
    return runner.run_from_args(suites, a)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["run"]:
        return run(argv[1:])
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--src", required=True, help="a vLLM checkout or git directory")
    ap.add_argument("--rev", default="HEAD", help="the commit to read from a git directory")
    ap.add_argument("--dest", default=".vllm-tests", help="the staging folder (git-ignored)")
    args = ap.parse_args(argv)
    for path in COPIED:
        text = _read(args.src, args.rev, path)
        if path.endswith("test_attention.py") and "paged_attention_v1" not in text:
            sys.exit(f"{path} at {args.rev} no longer tests paged_attention_v1 on CUDA: take an earlier vLLM")
        out = os.path.join(args.dest, path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    for path, text in SHIM.items():
        out = os.path.join(args.dest, path)
        os.makedirs(os.path.dirname(out), exist_ok=True)
        with open(out, "w", encoding="utf-8") as f:
            f.write(text)
    print(f"staged {len(COPIED)} vLLM test files and {len(SHIM)} shim files into {args.dest}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
