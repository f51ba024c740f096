"""The library's entry points as torch custom ops, so that ``torch.compile`` traces through them.

Dynamo cannot trace ``run()``'s launch path (host-side plans, Triton launches), so inside compiled code the
wrappers' ``run()``, the merge functions and ``append_paged_kv_cache`` call the ops registered here instead
(``torch.compiler.is_compiling()`` picks; eager calls keep the direct path, which is cheaper on the host: see
``benchmarks/bench_flash_attn.py --mode dispatch``). Each op has a fake implementation, so Dynamo, AOTAutograd
and Inductor see only shapes and dtypes.

``plan()`` stays outside the graph, as in FlashInfer: the run ops take a *handle*, an int naming the wrapper,
fixed when the graph is traced (:func:`handle`). At run time the op calls the wrapper's direct ``run()``, so it
uses whatever the wrapper's latest ``plan()`` prepared. The output dtype is read from the plan at trace time;
a later ``plan()`` with another ``o_data_type`` needs a new trace. Under CUDA graphs
(``mode="reduce-overhead"``) the wrapper must be a CUDA-graph wrapper (``use_cuda_graph=True``), exactly as
for a hand-captured graph: replays reuse the captured launches, which read the plan buffers ``plan()`` rewrites.
"""

from __future__ import annotations

import ctypes
import weakref

import torch

LIB = "flashinfer_triton"

_LIVE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _constant_result(fn):
    """``torch.compiler.assume_constant_result(fn)`` without importing Dynamo: that decorator sets one attribute,
    which Dynamo reads when it meets the call. Importing Dynamo (and with it Inductor) here would more than double
    the library's import time and the process's Python heap for every user, compiling or not
    (``tests/test_compile.py`` checks that the decorator still does only this)."""
    fn._dynamo_marked_constant = True
    return fn


@_constant_result
def _register(key: int) -> int:
    """Record the live object whose ``id()`` is ``key``; returns ``key``.

    Called with ``id(wrapper)`` of an object that is alive (the one being traced or run), and evaluated for
    real while Dynamo traces (``assume_constant_result``: the graph holds the int). Dynamo guards the traced
    ``id()`` on the wrapper object, so compiled code called with another wrapper is traced again."""
    if _LIVE.get(key) is None:
        _LIVE[key] = ctypes.cast(key, ctypes.py_object).value
    return key


def handle(wrapper) -> int:
    """The int that names ``wrapper`` to the run ops (its ``id()``, recorded in a weak registry)."""
    return _register(id(wrapper))


def _wrapper(key: int):
    w = _LIVE.get(key)
    if w is None:
        raise RuntimeError(f"{LIB}: the wrapper of compiled handle {key} no longer exists (was it garbage collected?)")
    return w


def _planned_o_dtype(w, q: torch.Tensor) -> torch.dtype:
    """The output dtype the wrapper's current plan writes (q's dtype when it cannot tell)."""
    core = getattr(w, "_w", None)
    o_dtype = getattr(core, "planned_out_dtype", None) if core is not None else None
    if o_dtype is not None:
        return o_dtype
    fused = getattr(w, "_fused", None)
    if fused is not None:
        return fused.opts.o_dtype
    levels = getattr(w, "_wrappers", None)
    if levels:
        return _planned_o_dtype(levels[0], q)
    return q.dtype


def _kv_args(form: str, kv: list[torch.Tensor]):
    """The run() arguments after q, rebuilt from the op's flat tensor list."""
    if form == "cache":
        return (kv[0],)
    if form == "pair":
        return ((kv[0], kv[1]),)
    if form == "ragged":
        return (kv[0], kv[1])
    raise ValueError(f"{LIB}: unknown KV form {form!r}")


@torch.library.custom_op(f"{LIB}::wrapper_run", mutates_args=())
def _wrapper_run(
    key: int,
    q: torch.Tensor,
    kv: list[torch.Tensor],
    form: str,
    q_scale: float | None,
    k_scale: float | None,
    v_scale: float | None,
    window_left: int | None,
    return_lse: bool,
) -> list[torch.Tensor]:
    w = _wrapper(key)
    kw = {}
    for name, value in (("q_scale", q_scale), ("k_scale", k_scale), ("v_scale", v_scale), ("window_left", window_left)):
        if value is not None:
            kw[name] = value
    res = w.run(q, *_kv_args(form, kv), return_lse=return_lse, **kw)
    return list(res) if return_lse else [res]


@_wrapper_run.register_fake
def _(key, q, kv, form, q_scale, k_scale, v_scale, window_left, return_lse):
    out = q.new_empty(q.shape, dtype=_planned_o_dtype(_wrapper(key), q))
    if not return_lse:
        return [out]
    return [out, q.new_empty(q.shape[:2], dtype=torch.float32)]


def run_wrapper(wrapper, q, kv_args: tuple, *, out=None, lse=None, return_lse=False, **scales):
    """``wrapper.run(q, *kv_args, ...)`` as the ``wrapper_run`` op: what ``run()`` calls under Dynamo.

    ``kv_args`` is ``(paged_kv_cache,)`` (a 5-D tensor or a ``(k, v)`` tuple) or ``(k, v)`` (ragged).
    ``scales`` holds the keyword arguments ``q_scale``, ``k_scale``, ``v_scale``, ``window_left`` that are not
    None; one the wrapper's ``run()`` does not take is rejected there. ``out`` / ``lse`` given by the caller
    receive a copy of the op's results (custom ops may not return their inputs)."""
    if len(kv_args) == 2:
        form, kv = "ragged", [kv_args[0], kv_args[1]]
    elif isinstance(kv_args[0], (tuple, list)):
        form, kv = "pair", [kv_args[0][0], kv_args[0][1]]
    else:
        form, kv = "cache", [kv_args[0]]
    want_lse = bool(return_lse or lse is not None)
    res = torch.ops.flashinfer_triton.wrapper_run(
        handle(wrapper),
        q,
        kv,
        form,
        scales.get("q_scale"),
        scales.get("k_scale"),
        scales.get("v_scale"),
        scales.get("window_left"),
        want_lse,
    )
    o = res[0]
    if out is not None:
        out.copy_(o)
        o = out
    s = res[1] if want_lse else None
    if lse is not None:
        lse.copy_(s)
        s = lse
    return (o, s) if return_lse else o


# ---------------------------------------------------------------------------------------------- state merges
@torch.library.custom_op(f"{LIB}::merge_state", mutates_args=())
def _merge_state(
    v_a: torch.Tensor, s_a: torch.Tensor, v_b: torch.Tensor, s_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    from ._merge_api import merge_state

    v, s = merge_state(v_a, s_a, v_b, s_b)
    return v, s


@_merge_state.register_fake
def _(v_a, s_a, v_b, s_b):
    return torch.empty_like(v_a), torch.empty_like(s_a)


@torch.library.custom_op(f"{LIB}::merge_state_in_place", mutates_args=("v", "s"))
def _merge_state_in_place(
    v: torch.Tensor, s: torch.Tensor, v_other: torch.Tensor, s_other: torch.Tensor, mask: torch.Tensor | None
) -> None:
    from ._merge_api import merge_state_in_place

    merge_state_in_place(v, s, v_other, s_other, mask)


@_merge_state_in_place.register_fake
def _(v, s, v_other, s_other, mask):
    return None


@torch.library.custom_op(f"{LIB}::merge_states", mutates_args=())
def _merge_states(v: torch.Tensor, s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    from ._merge_api import merge_states

    vo, so = merge_states(v, s)
    return vo, so


@_merge_states.register_fake
def _(v, s):
    return v.new_empty((v.shape[0], v.shape[2], v.shape[3])), s.new_empty((s.shape[0], s.shape[2]))


def merge_state(v_a, s_a, v_b, s_b):
    return torch.ops.flashinfer_triton.merge_state(v_a, s_a, v_b, s_b)


def merge_state_in_place(v, s, v_other, s_other, mask=None):
    torch.ops.flashinfer_triton.merge_state_in_place(v, s, v_other, s_other, mask)


def merge_states(v, s):
    return torch.ops.flashinfer_triton.merge_states(v, s)


# ---------------------------------------------------------------------------------------------- KV append
@torch.library.custom_op(f"{LIB}::append_paged_kv_cache", mutates_args=("k_cache", "v_cache"))
def _append_paged_kv_cache(
    append_key: torch.Tensor,
    append_value: torch.Tensor,
    batch_indices: torch.Tensor,
    positions: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor | None,
    kv_indices: torch.Tensor,
    kv_indptr: torch.Tensor,
    kv_last_page_len: torch.Tensor,
    kv_layout: str,
) -> None:
    from .page import append_paged_kv_cache

    cache = k_cache if v_cache is None else (k_cache, v_cache)
    append_paged_kv_cache(
        append_key, append_value, batch_indices, positions, cache, kv_indices, kv_indptr, kv_last_page_len, kv_layout
    )


@_append_paged_kv_cache.register_fake
def _(append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr, lpl, kv_layout):
    return None


def append_paged_kv_cache(
    append_key, append_value, batch_indices, positions, paged_kv_cache, kv_indices, kv_indptr, kv_last_page_len,
    kv_layout="NHD",
):  # fmt: skip
    if isinstance(paged_kv_cache, (tuple, list)):
        k_cache, v_cache = paged_kv_cache
    else:
        k_cache, v_cache = paged_kv_cache, None
    torch.ops.flashinfer_triton.append_paged_kv_cache(
        append_key, append_value, batch_indices, positions, k_cache, v_cache, kv_indices, kv_indptr,
        kv_last_page_len, kv_layout,
    )  # fmt: skip


# ---------------------------------------------------------------------------------------------- norm, activation, rope
@torch.library.custom_op(f"{LIB}::rmsnorm", mutates_args=())
def _rmsnorm_op(
    input: torch.Tensor, weight: torch.Tensor, eps: float, bias: float, enable_pdl: bool | None
) -> torch.Tensor:
    from .norm import _rmsnorm

    return _rmsnorm(input, weight, eps, None, enable_pdl, bias)


@_rmsnorm_op.register_fake
def _(input, weight, eps, bias, enable_pdl):
    return torch.empty_like(input)


def rmsnorm(input, weight, eps, out, bias, enable_pdl=None):
    res = torch.ops.flashinfer_triton.rmsnorm(input, weight, eps, bias, enable_pdl)
    if out is None:
        return res
    out.copy_(res)
    return out


@torch.library.custom_op(f"{LIB}::fused_add_rmsnorm", mutates_args=("input", "residual"))
def _fused_add_rmsnorm_op(
    input: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, bias: float, enable_pdl: bool | None
) -> None:
    from .norm import _fused_add

    _fused_add(input, residual, weight, eps, enable_pdl, bias)


@_fused_add_rmsnorm_op.register_fake
def _(input, residual, weight, eps, bias, enable_pdl):
    return None


def fused_add_rmsnorm(input, residual, weight, eps, bias, enable_pdl=None):
    torch.ops.flashinfer_triton.fused_add_rmsnorm(input, residual, weight, eps, bias, enable_pdl)


@torch.library.custom_op(f"{LIB}::layernorm", mutates_args=())
def _layernorm_op(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor, eps: float) -> torch.Tensor:
    from .norm import layernorm

    return layernorm(input, gemma, beta, eps)


@_layernorm_op.register_fake
def _(input, gemma, beta, eps):
    return torch.empty_like(input)


def layernorm(input, gemma, beta, eps):
    return torch.ops.flashinfer_triton.layernorm(input, gemma, beta, eps)


@torch.library.custom_op(f"{LIB}::act_and_mul", mutates_args=())
def _act_and_mul_op(input: torch.Tensor, act: str, enable_pdl: bool | None) -> torch.Tensor:
    from .activation import _act_and_mul

    return _act_and_mul(input, None, enable_pdl, act)


@_act_and_mul_op.register_fake
def _(input, act, enable_pdl):
    return input.new_empty((*input.shape[:-1], input.shape[-1] // 2))


def act_and_mul(input, out, act, enable_pdl=None):
    res = torch.ops.flashinfer_triton.act_and_mul(input, act, enable_pdl)
    if out is None:
        return res
    out.copy_(res)
    return out


@torch.library.custom_op(f"{LIB}::rope_inplace", mutates_args=("q", "k"))
def _rope_inplace_op(
    q: torch.Tensor,
    k: torch.Tensor,
    pos: torch.Tensor,
    rotary_dim: int,
    interleave: bool,
    cache: torch.Tensor | None,
    params: list[float],
) -> None:
    from .rope import _run

    _run(q, k, q, k, pos, rotary_dim, interleave, cache, tuple(params))


@_rope_inplace_op.register_fake
def _(q, k, pos, rotary_dim, interleave, cache, params):
    return None


@torch.library.custom_op(f"{LIB}::rope", mutates_args=())
def _rope_op(
    q: torch.Tensor,
    k: torch.Tensor,
    pos: torch.Tensor,
    rotary_dim: int,
    interleave: bool,
    cache: torch.Tensor | None,
    params: list[float],
) -> tuple[torch.Tensor, torch.Tensor]:
    from .rope import _run

    q_out, k_out = torch.empty_like(q), torch.empty_like(k)
    _run(q, k, q_out, k_out, pos, rotary_dim, interleave, cache, tuple(params))
    return q_out, k_out


@_rope_op.register_fake
def _(q, k, pos, rotary_dim, interleave, cache, params):
    return torch.empty_like(q), torch.empty_like(k)


def rope(q, k, q_out, k_out, pos, rotary_dim, interleave, cache, params):
    """The rope funnel's call (``q_out``/``k_out`` are ``q``/``k`` themselves, or tensors to fill)."""
    params = [float(x) for x in params]
    if q_out is q and k_out is k:
        torch.ops.flashinfer_triton.rope_inplace(q, k, pos, rotary_dim, interleave, cache, params)
        return
    qr, kr = torch.ops.flashinfer_triton.rope(q, k, pos, rotary_dim, interleave, cache, params)
    q_out.copy_(qr)
    k_out.copy_(kr)
