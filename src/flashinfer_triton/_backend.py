"""The one seam between the public API and the compute paths.

Every attention entry point (single/batch, decode/prefill, paged/ragged, cascade levels) is reduced
by the public modules to the same description, then handed to one implementation:

* ``AttentionOptions``: everything fixed at ``plan()`` that selects a kernel variant.
* ``AttentionBatch``: the batch's index tensors on the compute device plus host copies of the lengths.
* KV as two 4-D views ``k, v`` of shape ``[num_pages, page_size, num_kv_heads, head_dim]`` with any
  strides (last dim contiguous). NHD and HND, 5-D, tuple and 3-D caches, ragged and single-request KV
  are all just strides of such a view. Ragged/single KV uses ``paged=False`` and ``page_size=1``:
  token ``j`` of request ``b`` is row ``kv_indptr[b] + j`` (no page indices).
  Paged KV: token ``j`` of request ``b`` lives in page ``kv_indices[kv_indptr[b] + j // page_size]``,
  slot ``j % page_size``.

An implementation is a module (or object) with two functions::

    plan(opts, batch, workspace) -> plan_obj        # host side, may allocate, may read host lengths
    run(plan_obj, opts, batch, q, k, v, out, lse, *, qk_scale_mult, v_scale)   # device only, no sync

``run`` writes ``out [total_q, Hq, D]`` (dtype of out) and, when ``lse`` is not None,
``lse [total_q, Hq]`` float32 in base 2. ``qk_scale_mult`` multiplies ``opts.sm_scale`` (fp8 q/k
scales), ``v_scale`` multiplies the output. A row with no visible key gets ``o = 0`` and ``lse = -inf``.

Which implementation runs is decided here and nowhere else (``select_impl``): CUDA tensors go to the
Triton kernels, CPU tensors to the PyTorch path, and CPU tensors to the Triton kernels when
``TRITON_INTERPRET=1`` was set before import.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from dataclasses import dataclass, field

import torch

from ._env import INTERPRET

POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")

# The one copy of the flag: the implementation modules read it as ``_backend._INTERPRET`` (a module attribute
# read), so that a test patches this one name.
_INTERPRET = INTERPRET


@functools.cache
def triton_available() -> bool:
    """True when Triton imports (it does on every platform torch ships it for)."""
    try:
        import triton  # noqa: F401
    except Exception:  # pragma: no cover - depends on the installation
        return False
    return True


def use_triton(device: torch.device) -> bool:
    """Whether tensors on ``device`` run the Triton kernels (CUDA, or CPU under TRITON_INTERPRET=1)."""
    device = torch.device(device)
    if device.type == "cuda":
        return triton_available()
    if device.type == "cpu":
        return _INTERPRET and triton_available()
    return False


@dataclass(frozen=True)
class AttentionOptions:
    """What ``plan()`` fixes: shapes, mask rule, score transform. Selects the kernel variant."""

    num_qo_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int  # 1 for ragged / single-request KV
    paged: bool  # True: page table; False: ragged rows kv_indptr[b] + j
    causal: bool = False
    window_left: int = -1  # -1: no window
    logits_soft_cap: float = 0.0  # 0: no cap
    sm_scale: float = 1.0
    pos_encoding_mode: str = "NONE"  # "NONE" | "ROPE_LLAMA" | "ALIBI"
    rope_scale: float = 1.0
    rope_theta: float = 1e4
    has_custom_mask: bool = False
    is_decode: bool = False  # every request has exactly one query (decode wrappers)
    q_dtype: torch.dtype = torch.float16
    kv_dtype: torch.dtype = torch.float16
    o_dtype: torch.dtype = torch.float16
    # Performance hints; they never change results.
    use_tensor_cores: bool = False
    disable_split_kv: bool = False
    fixed_split_size: int | None = None

    @property
    def group_size(self) -> int:
        return self.num_qo_heads // self.num_kv_heads


@dataclass
class AttentionBatch:
    """The batch on the compute device (written by ``plan()``, read by ``run()``) and host copies.

    In CUDA-graph mode the device tensors are the caller's persistent buffers (sliced to the batch);
    their contents change at each ``plan()`` but their addresses do not.
    """

    batch_size: int
    qo_indptr: torch.Tensor  # int32 [B+1], device
    kv_indptr: torch.Tensor  # int32 [B+1], device: page indptr (paged) or token indptr (ragged)
    kv_indices: torch.Tensor | None  # int32 [nnz_pages], device; None when not paged
    kv_lens: torch.Tensor  # int32 [B], device: KV tokens of each request
    qo_indptr_host: torch.Tensor  # int64 [B+1], cpu
    kv_lens_host: torch.Tensor  # int64 [B], cpu
    kv_indptr_host: torch.Tensor | None = None  # int64 [B+1], cpu
    # custom mask: packed bits, bitorder little, one segment per request starting at a byte boundary;
    # bit (i * kv_len + j) of request b's segment is query i, key j (True = attend).
    mask_packed: torch.Tensor | None = None  # uint8, device
    mask_indptr: torch.Tensor | None = None  # int32 [B+1], device, byte offsets of the segments
    alibi_slopes: torch.Tensor | None = None  # float32 [Hq], device (ALIBI only)
    extra: dict = field(default_factory=dict)

    @property
    def device(self) -> torch.device:
        return self.qo_indptr.device


@dataclass
class Workspace:
    """Memory the caller lent to the wrapper. Implementations carve their buffers out of it."""

    float_buffer: torch.Tensor  # uint8, caller's float workspace (engines pass 128 MB)
    int_buffer: torch.Tensor  # uint8, the wrapper's int workspace (shareable between wrappers)
    cuda_graph: bool = False  # launch shape must not depend on the lengths
    max_batch_size: int | None = None  # fixed batch capacity in CUDA-graph mode
    max_total_q: int | None = None  # fixed query-row capacity in CUDA-graph mode, when known
    # The wrapper's own dict, where an eager plan keeps its packed host array, device array and their views, so
    # that the wrapper's next plan of the same layout rewrites them instead of allocating (None: never kept).
    reuse: dict | None = None


# The one dispatch table: for each operation, the Triton implementation modules in the order they are tried
# (an attention module also has to accept the variant: ``supports(opts)``). Tensors on a device that does not run
# Triton, or an operation none of whose modules exists or accepts, take the PyTorch path.
REGISTRY: dict[str, tuple[str, ...]] = {
    "attention": ("_decode_impl", "_prefill_impl"),
    "merge": ("_merge_impl",),
    "page": ("_page_impl",),
    "quantization": ("_quantization_impl",),
}
_KERNELS: dict = {}  # (operation, device) -> module or None, resolved once


def kernels_for(op: str, device: torch.device):
    """The Triton implementation module of ``op`` (a ``REGISTRY`` key other than "attention") for tensors on
    ``device``, or None for the PyTorch path. One dict lookup after the first call per (op, device)."""
    key = (op, device)
    impl = _KERNELS.get(key, False)
    if impl is False:
        impl = None
        if use_triton(device):
            for name in REGISTRY[op]:
                impl = _impl_module(name)
                if impl is not None:
                    break
        _KERNELS[key] = impl
    return impl


def select_impl(opts: AttentionOptions, device: torch.device):
    """Return the attention implementation module for this variant on this device."""
    if use_triton(device):
        impl = _triton_impl(opts)
        if impl is not None:
            return impl
    from . import _torch_backend

    return _torch_backend


def _triton_impl(opts: AttentionOptions):
    """The Triton attention implementation that covers ``opts``, or None while none does."""
    for name in REGISTRY["attention"]:
        module = _impl_module(name)
        if module is None:
            continue
        supports = getattr(module, "supports", None)
        if supports is not None and supports(opts):
            return module
    return None


_IMPL_MODULES: dict = {}


def _impl_module(name: str):
    """The implementation module ``name`` (imported once), or None when it does not exist.

    A missing module means that kernel family is not built; an error inside one must surface.
    """
    if name not in _IMPL_MODULES:
        found = importlib.util.find_spec(f"{__package__}.{name}") is not None
        _IMPL_MODULES[name] = importlib.import_module(f"{__package__}.{name}") if found else None
    return _IMPL_MODULES[name]
