"""flashinfer_triton: FlashInfer's attention API for LLM serving, in Python with Triton kernels.

``import flashinfer_triton as flashinfer`` and code written against FlashInfer runs unchanged; or call
``flashinfer_triton.as_flashinfer()`` once so that ``import flashinfer`` and
``from flashinfer.decode import ...`` resolve to this package.

CUDA tensors run Triton kernels; CPU tensors run a PyTorch path (or, with ``TRITON_INTERPRET=1`` set
before import, the Triton kernels in Triton's interpreter). The log-sum-exp is base 2 everywhere, and
``causal`` is aligned to the bottom right, as in FlashInfer.
"""

from __future__ import annotations

import sys

from . import activation, cascade, decode, flash_attn, norm, page, prefill, quantization, reference, rope, sampling
from ._caches import clear_host_caches, host_caches
from ._errors import check_errors
from .activation import *  # noqa: F403  (FlashInfer exports its engine ops at the top level too)
from .cascade import (
    BatchDecodeWithSharedPrefixPagedKVCacheWrapper,
    BatchPrefillWithSharedPrefixPagedKVCacheWrapper,
    MultiLevelCascadeAttentionWrapper,
    merge_state,
    merge_state_in_place,
    merge_states,
)
from .decode import (
    BatchDecodeWithPagedKVCacheWrapper,
    CUDAGraphBatchDecodeWithPagedKVCacheWrapper,
    fast_decode_plan,
    single_decode_with_kv_cache,
)
from .norm import *  # noqa: F403
from .page import append_paged_kv_cache, get_batch_indices_positions, get_seq_lens
from .prefill import (
    BatchPrefillWithPagedKVCacheWrapper,
    BatchPrefillWithRaggedKVCacheWrapper,
    single_prefill_with_kv_cache,
    single_prefill_with_kv_cache_return_lse,
)
from .quantization import packbits, segment_packbits
from .rope import *  # noqa: F403
from .sampling import *  # noqa: F403

__version__ = "0.1.0"

__all__ = [
    "BatchDecodeWithPagedKVCacheWrapper",
    "BatchDecodeWithSharedPrefixPagedKVCacheWrapper",
    "BatchPrefillWithPagedKVCacheWrapper",
    "BatchPrefillWithRaggedKVCacheWrapper",
    "BatchPrefillWithSharedPrefixPagedKVCacheWrapper",
    "CUDAGraphBatchDecodeWithPagedKVCacheWrapper",
    "MultiLevelCascadeAttentionWrapper",
    "append_paged_kv_cache",
    "as_flashinfer",
    "cascade",
    "check_errors",
    "clear_host_caches",
    "decode",
    "flash_attn",
    "fast_decode_plan",
    "get_batch_indices_positions",
    "get_seq_lens",
    "host_caches",
    "merge_state",
    "merge_state_in_place",
    "merge_states",
    "packbits",
    "page",
    "prefill",
    "quantization",
    "reference",
    "segment_packbits",
    "single_decode_with_kv_cache",
    "single_prefill_with_kv_cache",
    "single_prefill_with_kv_cache_return_lse",
]

__all__ += ["activation", "norm", "rope", "sampling"]
__all__ += [*activation.__all__, *norm.__all__, *rope.__all__, *sampling.__all__]

_SUBMODULES = ("decode", "prefill", "cascade", "page", "quantization", "norm", "activation", "rope", "sampling")


def as_flashinfer():
    """Make ``import flashinfer`` (and ``flashinfer.decode``, ``.prefill``, ``.cascade``, ``.page``,
    ``.quantization``) resolve to this package. Returns the package.

    Raises RuntimeError if a different ``flashinfer`` was already imported in this process.
    """
    this = sys.modules[__name__]
    existing = sys.modules.get("flashinfer")
    if existing is not None and existing is not this:
        raise RuntimeError(
            "as_flashinfer(): another 'flashinfer' module is already imported in this process; "
            "call as_flashinfer() before importing it"
        )
    sys.modules["flashinfer"] = this
    for name in _SUBMODULES:
        sys.modules[f"flashinfer.{name}"] = getattr(this, name)
    return this


def __getattr__(name):  # ``flashinfer_triton.distributed`` is imported on first use only
    if name == "distributed":
        return __import__(f"{__name__}.distributed", fromlist=["distributed"])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
