"""The wrapper members FlashInfer 0.7.2 added around its own backends and workspaces.

* ``workspace_size(...)`` (decode and paged prefill wrappers): ``(float_bytes, int_bytes)`` that ``plan(...)``
  with the same arguments uses of the caller's workspaces. It plans on a probe wrapper of the same configuration
  (scratch copies of the int workspace and of the CUDA-graph page-table buffers; a plan never writes the float
  workspace, only ``run()`` does), then measures how far the views its plan record keeps reach into each
  buffer. The wrapper's
  own plan and buffers are untouched. A plan here adapts to the float workspace it is lent (a smaller one splits
  the KV less), so the float size is what a plan uses of the current workspace, plus 256 bytes of alignment
  slack; eager plans keep their work lists in fresh device arrays, so their int size is 0.
* ``resolved_backend`` (decode wrapper): what the last ``plan()`` resolved ``backend="auto"`` to, ``"triton"``
  (this package's Triton kernels) or ``"torch"`` (its PyTorch path, CPU tensors); ``"auto"`` before the first
  plan; an explicit backend name (or one assigned to ``_backend``) reports itself, as in FlashInfer.
* ``prewarm_paged_kv_stride_variant(variant="independent")`` (decode, paged prefill, cascade wrappers): FlashInfer
  loads a second JIT module for K and V caches with different strides. The kernels here take K's and V's strides
  as separate arguments, so there is no variant to load: after FlashInfer's checks (a completed ``plan()``, the
  one variant name) it does nothing.
"""

from __future__ import annotations

import torch

_ALIGN_SLACK = 256  # the prefill plans align their split partials to 256 bytes inside the float workspace


def buffer_use(obj, buffer: torch.Tensor, max_depth: int = 8) -> int:
    """Bytes from ``buffer``'s start to the end of the furthest view of it reachable from ``obj`` (0 if none).
    Views that reach the buffer's end are the buffer itself or "the rest of it" handed on to be carved, not a
    use: they do not count."""
    if buffer is None or buffer.numel() == 0:
        return 0
    storage = buffer.untyped_storage().data_ptr()
    base = buffer.data_ptr()
    size = buffer.numel() * buffer.element_size()
    end = 0
    seen = set()
    stack = [(obj, 0)]
    while stack:
        x, depth = stack.pop()
        if id(x) in seen or depth > max_depth:
            continue
        seen.add(id(x))
        if isinstance(x, torch.Tensor):
            if x.device == buffer.device and x.numel() and x.untyped_storage().data_ptr() == storage:
                last = sum((n - 1) * st for n, st in zip(x.shape, x.stride()) if n > 0)
                x_end = x.data_ptr() - base + (last + 1) * x.element_size()
                if x_end < size:
                    end = max(end, x_end)
            continue
        if isinstance(x, dict):
            stack.extend((v, depth + 1) for v in x.values())
        elif isinstance(x, (list, tuple)):
            stack.extend((v, depth + 1) for v in x)
        elif type(x).__module__.startswith("flashinfer_triton"):
            fields = dict(getattr(x, "__dict__", {}))
            for name in getattr(type(x), "__slots__", ()):
                if hasattr(x, name):
                    fields[name] = getattr(x, name)
            stack.extend((v, depth + 1) for v in fields.values())
    return max(end, 0)


def workspace_size(wrapper, probe, plan_kwargs: dict) -> tuple[int, int]:
    """``(float_bytes, int_bytes)`` of ``probe.plan(**plan_kwargs)``, ``probe`` a fresh wrapper configured as
    ``wrapper`` (its CUDA-graph buffers scratch copies): it is lent ``wrapper``'s float workspace and a scratch
    int workspace of the same size."""
    w = wrapper._w
    float_buffer = w._float_workspace_buffer
    int_buffer = torch.empty_like(w._int_workspace_buffer)
    probe.reset_workspace_buffer(float_buffer, int_buffer)
    probe._backend = w._backend
    probe.plan(**plan_kwargs)
    # the plan records (a multi-token decode plans on a second core); the wrappers keep whole-buffer references
    plans = [core.current_plan for core in (probe._w, getattr(probe, "_multi", None)) if core is not None]
    float_bytes = buffer_use(plans, float_buffer)
    if float_bytes:
        float_bytes = min(float_bytes + _ALIGN_SLACK, float_buffer.numel() * float_buffer.element_size())
    return float_bytes, buffer_use(plans, int_buffer)


def scratch_like(buffer):
    """An uninitialised tensor shaped as ``buffer`` (None stays None): a probe's CUDA-graph buffer."""
    return None if buffer is None else torch.empty_like(buffer)


def resolved_backend(backend: str, planned) -> str:
    """See the module docstring; ``planned`` is the active core's plan record (None before any plan)."""
    if backend != "auto":
        return backend
    if planned is None:
        return "auto"
    impl = planned.impl
    return "torch" if impl.__name__.rsplit(".", 1)[-1] == "_torch_backend" else "triton"


def prewarm_paged_kv_stride_variant(wrapper_name: str, planned: bool, variant) -> None:
    """FlashInfer's checks, then nothing to load (see the module docstring)."""
    if not isinstance(variant, str):
        raise TypeError(f"variant: expected a string ('independent'), got {type(variant).__name__}")
    if variant != "independent":
        raise ValueError(f"variant: expected 'independent', got {variant!r}")
    if not planned:
        raise RuntimeError(
            f"{wrapper_name}.prewarm_paged_kv_stride_variant(): plan() must complete before prewarming a "
            "paged-KV-stride variant"
        )
