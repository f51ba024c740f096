"""The public surface: FlashInfer's names, module layout and the flashinfer alias."""

from __future__ import annotations

import subprocess
import sys

import flashinfer_triton as fi

NAMES = {
    "decode": [
        "single_decode_with_kv_cache",
        "BatchDecodeWithPagedKVCacheWrapper",
        "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    ],
    "prefill": [
        "single_prefill_with_kv_cache",
        "single_prefill_with_kv_cache_return_lse",
        "BatchPrefillWithPagedKVCacheWrapper",
        "BatchPrefillWithRaggedKVCacheWrapper",
    ],
    "cascade": [
        "merge_state",
        "merge_state_in_place",
        "merge_states",
        "MultiLevelCascadeAttentionWrapper",
        "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
        "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    ],
    "page": ["append_paged_kv_cache", "get_batch_indices_positions", "get_seq_lens"],
    "quantization": ["packbits", "segment_packbits"],
}


def test_every_name_is_exported_at_top_level_and_in_its_module():
    for module, names in NAMES.items():
        mod = getattr(fi, module)
        for name in names:
            assert getattr(fi, name) is getattr(mod, name), name
            assert name in fi.__all__ and name in mod.__all__, name


def test_wrapper_aliases_exist():
    for cls in (
        fi.BatchDecodeWithPagedKVCacheWrapper,
        fi.BatchPrefillWithPagedKVCacheWrapper,
        fi.BatchPrefillWithRaggedKVCacheWrapper,
    ):
        for attr in (
            "plan",
            "run",
            "begin_forward",
            "forward",
            "forward_return_lse",
            "run_return_lse",
            "end_forward",
            "reset_workspace_buffer",
        ):
            assert callable(getattr(cls, attr)), f"{cls.__name__}.{attr}"
    assert fi.BatchDecodeWithPagedKVCacheWrapper.begin_forward is fi.BatchDecodeWithPagedKVCacheWrapper.plan


def test_as_flashinfer_makes_flashinfer_imports_resolve():
    code = (
        "import flashinfer_triton; flashinfer_triton.as_flashinfer()\n"
        "import flashinfer\n"
        "from flashinfer.prefill import BatchPrefillWithPagedKVCacheWrapper\n"
        "from flashinfer.decode import single_decode_with_kv_cache\n"
        "import flashinfer.cascade, flashinfer.page, flashinfer.quantization\n"
        "assert flashinfer is flashinfer_triton\n"
        "assert BatchPrefillWithPagedKVCacheWrapper is flashinfer_triton.BatchPrefillWithPagedKVCacheWrapper\n"
        "assert flashinfer.cascade.merge_states is flashinfer_triton.merge_states\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ok"
