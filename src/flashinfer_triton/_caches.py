"""What the library keeps on the host between calls, read-only: ``host_caches()`` and ``clear_host_caches()``.

Several entry points keep per-call-form state so that a repeated call skips its host work (see
``docs/host-path.md``): the single-request calls keep their plans and their bound launches, ``merge_state`` and
``merge_states`` their bound launches, the sampling kernels their launch plans, the flash-attn functions their
planned wrappers, ``append_paged_kv_cache`` its checked argument forms (and their bound launches), the norm,
activation and rope kernels their bound launches. Below them the kernel paths keep what a repeated input form
would otherwise work out again: the tensor descriptors the bound launches encoded, the Gluon decode kernel's page
geometry per cache form, the vLLM kernel's launch settings per call form, and the K/V an eager prefill has seen
(its second launch over the same K/V reads them through descriptors). Each cache is bounded and keyed by values
a caller can see (options, shapes, dtypes, device, addresses). ``host_caches()`` lists them as plain records,
without exposing the cached objects; ``clear_host_caches()`` forgets them (the next call of each form plans and
binds again).

A module that was never imported has an empty cache: neither function imports one.
"""

from __future__ import annotations

import sys
import types
from typing import NamedTuple

import torch

from ._checks import value_error

__all__ = ["CachedForm", "HOST_CACHES", "clear_host_caches", "host_caches"]


class CachedForm(NamedTuple):
    """One entry of a host cache.

    ``op``: the call it serves (``"single_decode_with_kv_cache"``, ``"sample"``, ...); ``shapes``: the shapes its
    key fixes (tensor shapes, or sizes such as ``(rows, vocab)``); ``dtypes`` and ``device``: those of its
    tensors; ``layout``: the KV layout (``"NHD"`` / ``"HND"``) where the key holds one; ``bound``: later calls of
    the form launch the compiled kernels directly (``_launch.bind``); ``plan_id``: the ``PlanInfo.plan_id`` of the
    plan the entry holds (None where it holds none)."""

    op: str
    shapes: tuple = ()
    dtypes: tuple = ()
    device: torch.device | None = None
    layout: str | None = None
    bound: bool = False
    plan_id: int | None = None


# cache name -> (module, attribute): every cache ``host_caches()`` reports, in the order it reports them
HOST_CACHES: dict[str, tuple[str, str]] = {
    "single_plans": ("_wrapper", "_SINGLE_PLANS"),
    "single_forms": ("_wrapper", "_SINGLE_FAST"),
    "merge_state": ("_merge_api", "_MERGE_BOUND"),
    "merge_states": ("_merge_api", "_STATES_BOUND"),
    "sampling": ("kernels.sampling", "_PLANS"),
    "flash_attn": ("flash_attn", "_PLANS"),
    "append_forms": ("page", "_CHECKED_FORMS"),
    "tensor_descriptors": ("_launch", "_DESC_CACHE"),
    "gluon_geometries": ("_decode_impl", "_GLUON_GEOMS"),
    "vllm_settings": ("_vllm_impl", "_STATIC"),
    "tma_inputs": ("_prefill_impl", "_TMA_SEEN"),
    "row_forms": ("kernels._row_forms", "ROW_FORMS"),
}

_SINGLE_OPS = {1: "single_decode_with_kv_cache", 2: "single_prefill_with_kv_cache"}
_LAYOUTS = ("NHD", "HND")


def _store(name: str):
    """The cache object named ``name``, or None while its module is not imported."""
    module, attr = HOST_CACHES[name]
    mod = sys.modules.get(f"{__package__}.{module}")
    return None if mod is None else getattr(mod, attr)


def _of_type(key: tuple, kind) -> tuple:
    return tuple(x for x in key if isinstance(x, kind))


def _device(key: tuple) -> torch.device | None:
    found = _of_type(key, torch.device)
    return found[0] if found else None


def _planned(wrapper):
    """The current ``Plan`` of a wrapper (a core wrapper, or a public one around it), or None."""
    if wrapper is None:
        return None
    core = getattr(wrapper, "_w", wrapper)
    return getattr(core, "_planned", None)


def _plan_fields(wrapper) -> tuple[bool, int | None]:
    p = _planned(wrapper)
    return (False, None) if p is None else (p.fast_run is not None, p.plan_id)


def _single_plan(key: tuple, w) -> CachedForm:
    # key: (is_decode, device, qo_len, kv_len, num_qo_heads, num_kv_heads, head_dim, q dtype, kv dtype, options...)
    is_decode, device, qo_len, kv_len, hq, hkv, d, q_dtype, kv_dtype = key[:9]
    bound, plan_id = _plan_fields(w)
    op = _SINGLE_OPS[1 if is_decode else 2]
    return CachedForm(op, ((qo_len, hq, d), (kv_len, hkv, d)), (q_dtype, kv_dtype), device, None, bound, plan_id)


def _single_form(key: tuple, sb) -> CachedForm:
    # key: (tag, option types, options, then shape, strides, dtype and device of q, k and v)
    tag, _, options = key[:3]
    layout = next((o for o in options if type(o) is str and o in _LAYOUTS), None)
    _, plan_id = _plan_fields(sb.plan)
    rest = key[3:]
    return CachedForm(
        _SINGLE_OPS.get(tag, str(tag)), _of_type(rest, torch.Size), _of_type(rest, torch.dtype), _device(rest),
        layout, True, plan_id,
    )  # fmt: skip


def _merge_form(key: tuple) -> CachedForm:
    # key: (shape, dtype, device, contiguous) of v_a, s_a, v_b, s_b
    return CachedForm("merge_state", _of_type(key, torch.Size), _of_type(key, torch.dtype), _device(key), None, True)


def _merge_states_form(key: tuple) -> CachedForm:
    # key: (shape, strides, dtype, device) of v and s
    return CachedForm("merge_states", _of_type(key, torch.Size), _of_type(key, torch.dtype), _device(key), None, True)


def _sampling_plan(key: tuple, plan) -> CachedForm:
    # key: (operation, rows, vocabulary size, then strides, dtypes, device and the flags of the call)
    return CachedForm(
        str(key[0]), ((key[1], key[2]),), _of_type(key, torch.dtype), _device(key), None, plan.bound is not None
    )


def _flash_attn_plan(key: tuple, entry) -> CachedForm:
    # key: ((form, plain options...), index tensors' keys); entry: (weak references, wrapper)
    plain = key[0]
    bound, plan_id = _plan_fields(entry[1])
    return CachedForm(f"flash_attn:{plain[0]}", (), _of_type(plain, torch.dtype), _device(plain), None, bound, plan_id)


def _append_form(key: tuple, bound) -> CachedForm:
    # key: (kv_layout, number of cache tensors, then shape, strides, dtype and device of each tensor argument)
    layout = key[0] if type(key[0]) is str and key[0] in _LAYOUTS else None
    shapes, dtypes = _of_type(key, torch.Size), _of_type(key, torch.dtype)
    return CachedForm("append_paged_kv_cache", shapes, dtypes, _device(key), layout, bound is not None)


def _descriptor(key: tuple) -> CachedForm:
    # key: (address, dtype, shape, strides, block shape, padding, launcher metadata) of one encoded descriptor
    _, dtype, shape, _, block, *_ = key
    return CachedForm("tensor_descriptor", (tuple(shape), tuple(block)), (dtype,), None, None, True)


def _gluon_geometry(key: tuple) -> CachedForm:
    # key: (shape, strides, dtype and 16-byte alignment of the K and V caches, page size, head dim)
    k_shape, v_shape, _, _, k_dtype, v_dtype = key[:6]
    return CachedForm("decode:gluon", (tuple(k_shape), tuple(v_shape)), (k_dtype, v_dtype))


def _vllm_setting(key: tuple) -> CachedForm:
    # key: (heads, KV heads, head dim, block size, x, q dtype, alibi, tensor scales, partitioned, config)
    hq, hkv, d, block_size, _, q_dtype, _, _, partitioned = key[:9]
    op = "paged_attention_v2" if partitioned else "paged_attention_v1"
    return CachedForm(op, ((hq, d), (hkv, d, block_size)), (q_dtype,))


def _tma_input(key: tuple) -> CachedForm:
    # key: (K address, V address, K shape, K strides, V strides, dtype)
    return CachedForm("prefill:tma", (tuple(key[2]),), (key[5],))


def _row_form(key: tuple, bound) -> CachedForm:
    # key: (kernel name, form key): a public function's checked call form (an op name, then shapes without the token
    # count, strides, dtypes, devices and scalars) or the launch's own (the grid's second axis, the arguments after
    # the tensors, the tensors' dtypes, warps)
    name, form = key
    return CachedForm(name, (), _of_type(form, torch.dtype), _device(form), None, bound is not False)


def _entries(name: str, store) -> tuple[CachedForm, ...]:
    if name == "single_plans":
        return tuple(_single_plan(k, w) for k, w in list(store.items()))
    if name == "single_forms":
        return tuple(_single_form(k, sb) for k, sb in list(store.items()))
    if name == "merge_state":
        return tuple(_merge_form(k) for k in list(store))
    if name == "merge_states":
        return tuple(_merge_states_form(k) for k in list(store))
    if name == "sampling":
        return tuple(_sampling_plan(k, p) for k, p in list(store.items()))
    if name == "append_forms":
        return tuple(_append_form(k, b) for k, b in list(store.items()))
    if name == "tensor_descriptors":
        return tuple(_descriptor(k) for k in list(store))
    if name == "gluon_geometries":
        return tuple(_gluon_geometry(k) for k in list(store))
    if name == "vllm_settings":
        return tuple(_vllm_setting(k) for k in list(store))
    if name == "tma_inputs":
        return tuple(_tma_input(k) for k in list(store))
    if name == "row_forms":
        return tuple(_row_form(k, b) for k, b in store.items())
    return tuple(_flash_attn_plan(k, e) for k, e in list(store._entries.items()))


def host_caches() -> types.MappingProxyType:
    """Every host-side cache of per-call-form state, read-only: cache name -> tuple of :class:`CachedForm`
    (least recently added or used first). Names: ``"single_plans"`` (the plans of ``single_decode_with_kv_cache``
    / ``single_prefill_with_kv_cache`` per lengths and options), ``"single_forms"`` (their bound launches per
    argument form), ``"merge_state"`` and ``"merge_states"`` (their bound launches per argument form),
    ``"sampling"`` (the sampling kernels' launch plans per call form), ``"flash_attn"`` (the planned wrappers of
    the flash-attn functions), ``"append_forms"`` (the argument forms ``append_paged_kv_cache`` checked, and their
    bound launches); the kernel paths' caches: ``"tensor_descriptors"`` (the descriptors bound launches encoded,
    per address and geometry: shapes ``(tensor shape, block shape)``), ``"gluon_geometries"`` (the Gluon decode
    kernel's page geometry per K/V cache form, also for a form it does not take), ``"vllm_settings"`` (the vLLM
    kernel's launch settings per call form: shapes ``((heads, head_dim), (kv_heads, head_dim, block_size))``),
    ``"tma_inputs"`` (the K/V an eager prefill launch has seen; a later launch over them reads through
    descriptors), ``"row_forms"`` (the norm, activation and rope launches bound per call form: ``op`` is the
    kernel, ``"norm"``, ``"activation"`` or ``"rope"``).
    Reads no device memory."""
    out = {}
    for name in HOST_CACHES:
        store = _store(name)
        out[name] = () if store is None else _entries(name, store)
    return types.MappingProxyType(out)


def clear_host_caches(*names: str) -> None:
    """Forget the entries of the caches ``names`` (every cache of :func:`host_caches` when none is named): the
    next call of each form plans and binds again. Raises ValueError for an unknown name before clearing any."""
    for name in names:
        if type(name) is not str or name not in HOST_CACHES:
            raise value_error("names", f"cache names among {', '.join(HOST_CACHES)}", repr(name))
    for name in names or tuple(HOST_CACHES):
        store = _store(name)
        if store is not None:
            store.clear()
