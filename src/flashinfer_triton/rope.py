"""FlashInfer's ``flashinfer.rope``: rotary position embedding of query and key heads.

Positions come from ``pos_ids`` (one per token), from ``indptr``/``offsets`` (token ``i`` of request
``b`` is at ``offsets[b] + i``; converted to ``pos_ids`` on the device, without a host sync), or index a
precomputed float32 cos/sin cache (``apply_rope_with_cos_sin_cache*``, the vLLM/SGLang form).
``interleave=False`` (NeoX) rotates ``x[j]`` with ``x[j + rot/2]``; ``interleave=True`` rotates
``x[2j]`` with ``x[2j+1]``; both use the frequency ``theta^(-2j/rot) / rope_scale`` of pair ``j``, and
the Llama 3.1 variants blend the scaled and unscaled frequency by wavelength. Only the first
``rotary_dim`` elements of a head rotate; out-of-place variants copy the rest.

CUDA tensors run ``kernels/rope.py``; CPU tensors a PyTorch path (or the kernel under
``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import math

import torch

from . import _custom_ops
from ._backend import use_triton
from ._checks import Q_DTYPES, check_tensor, shape_str, type_error, value_error
from .kernels._row_forms import launch_bound
from .kernels.rope import _rope_forms, launch_rope

__all__ = [
    "apply_llama31_rope",
    "apply_llama31_rope_inplace",
    "apply_llama31_rope_pos_ids",
    "apply_llama31_rope_pos_ids_inplace",
    "apply_rope",
    "apply_rope_inplace",
    "apply_rope_pos_ids",
    "apply_rope_pos_ids_inplace",
    "apply_rope_with_cos_sin_cache",
    "apply_rope_with_cos_sin_cache_inplace",
]

_POS_DTYPES = (torch.int32, torch.int64)

# The checked call forms (as in ``norm``): what the checks of a ``pos_ids`` or cos/sin-cache call read (the
# tensors' shapes but the token count, strides, dtypes and devices, the scalars) fixes its launch but for the
# number of tokens, so a form whose checks passed once and whose launch was bound (``_rope_forms``, keyed by the
# form) launches directly; the token counts of the tensors are compared per call. Scalars enter a form only of the
# exact types the checks take (int or float for numbers, bool for flags: 1 == True would meet a bool's form).
_T = torch.Tensor
_empty_like = torch.empty_like
_NUMBER = (int, float)


def _check_qk(q, k) -> None:
    check_tensor("q", q, dim=3, dtypes=Q_DTYPES)
    check_tensor("k", k, dim=3, dtypes=Q_DTYPES, device=q.device)
    if k.dtype != q.dtype:
        raise type_error("k", f"dtype {str(q.dtype).replace('torch.', '')} (the dtype of q)", k.dtype)
    if k.shape[0] != q.shape[0] or k.shape[2] != q.shape[2]:
        raise value_error(
            "k", f"shape [{q.shape[0]}, num_k_heads, {q.shape[2]}] (nnz and head_dim of q)", shape_str(k.shape)
        )
    for name, x in (("q", q), ("k", k)):
        if x.numel() > 0 and x.stride(-1) != 1:
            raise value_error(name, "a contiguous last dimension (stride 1)", f"stride {x.stride(-1)}")


def _check_rotary_dim(rotary_dim, head_dim: int) -> int:
    if rotary_dim is None:
        rotary_dim = head_dim
    if isinstance(rotary_dim, bool) or not isinstance(rotary_dim, int):
        raise type_error("rotary_dim", "None or an int", type(rotary_dim).__name__)
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_dim:
        raise value_error("rotary_dim", f"an even value in [2, head_dim = {head_dim}]", rotary_dim)
    return rotary_dim


def _check_float(name: str, value, positive: bool = True) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise type_error(name, "a float", type(value).__name__)
    value = float(value)
    if not math.isfinite(value) or (positive and value <= 0):
        raise value_error(name, "a finite value > 0" if positive else "a finite value", value)
    return value


def _check_pos(name: str, x, device, length: int | None) -> torch.Tensor:
    check_tensor(name, x, dim=1, dtypes=_POS_DTYPES, device=device)
    if length is not None and x.shape[0] != length:
        raise value_error(name, f"shape [{length}]", shape_str(x.shape))
    return x


def _pos_from_indptr(indptr: torch.Tensor, offsets: torch.Tensor, nnz: int) -> torch.Tensor:
    """Position of every token from ``indptr``/``offsets``, on the device (no host sync)."""
    tok = torch.arange(nnz, device=indptr.device, dtype=indptr.dtype)
    seg = torch.searchsorted(indptr[1:].contiguous(), tok, right=True)
    seg = seg.clamp_(max=max(offsets.shape[0] - 1, 0))
    return (offsets.to(torch.int64)[seg] + tok.to(torch.int64) - indptr.to(torch.int64)[seg]).contiguous()


def _freq_params(rope_scale, rope_theta, llama31) -> tuple[float, float, float, float]:
    """(log2(1/theta), 1/scale, smooth_a, smooth_b); smooth 0 leaves every frequency scaled."""
    rope_scale = _check_float("rope_scale", rope_scale)
    rope_theta = _check_float("rope_theta", rope_theta)
    smooth_a = smooth_b = 0.0
    if llama31 is not None:
        low, high, old_ctx = llama31
        low = _check_float("low_freq_factor", low)
        high = _check_float("high_freq_factor", high)
        old_ctx = _check_float("old_context_len", old_ctx)
        if high == low:
            raise value_error("high_freq_factor", f"a value different from low_freq_factor = {low}", high)
        smooth_a = old_ctx / (2 * math.pi * high - 2 * math.pi * low)
        smooth_b = -1.0 / (high / low - 1.0)
    return -math.log2(rope_theta), 1.0 / rope_scale, smooth_a, smooth_b


def _torch_rope(q, k, q_out, k_out, pos, rotary_dim, interleave, cache, params) -> None:
    half = rotary_dim // 2
    if cache is not None:
        cs = cache[pos.long()]
        cos, sin = cs[:, :half], cs[:, half:rotary_dim]
    else:
        log2_rcp_theta, rcp_scale, smooth_a, smooth_b = params
        j = torch.arange(half, device=q.device, dtype=torch.float32)
        freq = torch.exp2(log2_rcp_theta * (2.0 * j / rotary_dim))
        smooth = (freq * smooth_a + smooth_b).clamp(0.0, 1.0)
        freq = (1.0 - smooth) * (freq * rcp_scale) + smooth * freq
        ang = pos.float()[:, None] * freq[None, :]
        cos, sin = torch.cos(ang), torch.sin(ang)
    cos, sin = cos[:, None, :], sin[:, None, :]
    for x, o in ((q, q_out), (k, k_out)):
        xr = x[..., :rotary_dim].float()
        if interleave:
            x1, x2 = xr[..., 0::2], xr[..., 1::2]
        else:
            x1, x2 = xr[..., :half], xr[..., half:]
        y1 = x1 * cos - x2 * sin
        y2 = x2 * cos + x1 * sin
        y = torch.stack((y1, y2), dim=-1).flatten(-2) if interleave else torch.cat((y1, y2), dim=-1)
        if o.data_ptr() != x.data_ptr() and rotary_dim < x.shape[-1]:
            o[..., rotary_dim:] = x[..., rotary_dim:]
        o[..., :rotary_dim] = y.to(o.dtype)


def _run(q, k, q_out, k_out, pos, rotary_dim, interleave, cache=None, params=(0.0, 1.0, 0.0, 0.0), form=None) -> None:
    """``form``: the checked call form the launch is kept under (None: the launch's own key)."""
    if not isinstance(interleave, bool):
        raise type_error("interleave", "a bool", type(interleave).__name__)
    if q.shape[0] == 0:
        return
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.rope(q, k, q_out, k_out, pos, rotary_dim, interleave, cache, params)
    if use_triton(q.device):
        launch_rope(q, k, q_out, k_out, pos.contiguous(), rotary_dim, interleave, cache, *params, form=form)
    else:
        _torch_rope(q, k, q_out, k_out, pos, rotary_dim, interleave, cache, params)


def _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, llama31, inplace):
    _check_qk(q, k)
    check_tensor("indptr", indptr, dim=1, dtypes=_POS_DTYPES, device=q.device)
    if indptr.shape[0] < 1:
        raise value_error("indptr", "shape [batch_size + 1]", shape_str(indptr.shape))
    _check_pos("offsets", offsets, q.device, indptr.shape[0] - 1)
    rotary_dim = _check_rotary_dim(rotary_dim, q.shape[2])
    params = _freq_params(rope_scale, rope_theta, llama31)
    pos = _pos_from_indptr(indptr, offsets, q.shape[0])
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _run(q, k, q_out, k_out, pos, rotary_dim, interleave, None, params)
    return None if inplace else (q_out, k_out)


def _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, llama31, inplace):
    form = None
    if (
        type(q) is _T
        and type(k) is _T
        and type(pos_ids) is _T
        and (rotary_dim is None or type(rotary_dim) is int)
        and type(interleave) is bool
        and type(rope_scale) in _NUMBER
        and type(rope_theta) in _NUMBER
        and (llama31 is None or all(type(v) in _NUMBER for v in llama31))
        and not torch.compiler.is_compiling()
    ):
        q_out, k_out = (q, k) if inplace else (_empty_like(q), _empty_like(k))
        form = ("pos_ids", inplace, q.shape[1:], q.stride(), q.dtype, q.device, k.shape[1:], k.stride(), k.dtype,
                k.device, pos_ids.stride(), pos_ids.dtype, pos_ids.device, q_out.stride(), k_out.stride(),
                rotary_dim, interleave, rope_scale, rope_theta, llama31)  # fmt: skip
        bound = _rope_forms.forms.get(form)
        if bound:
            nnz = q.shape[0]
            pos = pos_ids.contiguous()  # (held until launched: a copy where pos_ids is strided)
            pq, pk = q.data_ptr(), k.data_ptr()
            pqo, pko = (pq, pk) if inplace else (q_out.data_ptr(), k_out.data_ptr())
            if (
                k.shape[0] == nnz
                and pos_ids.shape[0] == nnz
                and launch_bound(bound, nnz, pq, pk, pqo, pko, pos.data_ptr(), pq)
            ):
                return None if inplace else (q_out, k_out)
    _check_qk(q, k)
    _check_pos("pos_ids", pos_ids, q.device, q.shape[0])
    rotary_dim = _check_rotary_dim(rotary_dim, q.shape[2])
    params = _freq_params(rope_scale, rope_theta, llama31)
    q_out, k_out = (q, k) if inplace else (torch.empty_like(q), torch.empty_like(k))
    _run(q, k, q_out, k_out, pos_ids, rotary_dim, interleave, None, params, form)
    return None if inplace else (q_out, k_out)


def apply_rope_inplace(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4) -> None:
    """Rotate ragged ``q [nnz, Hq, D]``, ``k [nnz, Hk, D]`` in place; token ``i`` of request ``b`` is at
    position ``offsets[b] + i``."""
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, None, True)


def apply_rope(q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    """Out-of-place ``apply_rope_inplace``: returns ``(q_rope, k_rope)``."""
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, None, False)


def apply_rope_pos_ids_inplace(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4) -> None:
    """Rotate ``q``/``k`` in place, token ``i`` at position ``pos_ids[i]``."""
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, None, True)


def apply_rope_pos_ids(q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=1, rope_theta=1e4):
    """Out-of-place ``apply_rope_pos_ids_inplace``: returns ``(q_rope, k_rope)``."""
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, None, False)


def apply_llama31_rope_inplace(
    q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
    low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
) -> None:  # fmt: skip
    """``apply_rope_inplace`` with Llama 3.1's frequency scaling."""
    llama31 = (low_freq_factor, high_freq_factor, old_context_len)
    _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, llama31, True)


def apply_llama31_rope(
    q, k, indptr, offsets, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
    low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
):  # fmt: skip
    """``apply_rope`` with Llama 3.1's frequency scaling: returns ``(q_rope, k_rope)``."""
    llama31 = (low_freq_factor, high_freq_factor, old_context_len)
    return _ragged(q, k, indptr, offsets, rotary_dim, interleave, rope_scale, rope_theta, llama31, False)


def apply_llama31_rope_pos_ids_inplace(
    q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
    low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
) -> None:  # fmt: skip
    """``apply_rope_pos_ids_inplace`` with Llama 3.1's frequency scaling."""
    llama31 = (low_freq_factor, high_freq_factor, old_context_len)
    _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, llama31, True)


def apply_llama31_rope_pos_ids(
    q, k, pos_ids, rotary_dim=None, interleave=False, rope_scale=8, rope_theta=5e5,
    low_freq_factor=1, high_freq_factor=4, old_context_len=8192,
):  # fmt: skip
    """``apply_rope_pos_ids`` with Llama 3.1's frequency scaling: returns ``(q_rope, k_rope)``."""
    llama31 = (low_freq_factor, high_freq_factor, old_context_len)
    return _pos_ids(q, k, pos_ids, rotary_dim, interleave, rope_scale, rope_theta, llama31, False)


def _cache_views(positions, query, key, head_size, cos_sin_cache, is_neox):
    check_tensor("query", query, dim=2, dtypes=Q_DTYPES)
    check_tensor("key", key, dim=2, dtypes=Q_DTYPES, device=query.device)
    if isinstance(head_size, bool) or not isinstance(head_size, int) or head_size <= 0:
        raise value_error("head_size", "a positive int", repr(head_size))
    for name, x in (("query", query), ("key", key)):
        if x.shape[1] % head_size:
            raise value_error(name, f"a last dimension divisible by head_size = {head_size}", x.shape[1])
    if key.shape[0] != query.shape[0]:
        raise value_error("key", f"{query.shape[0]} rows (the rows of query)", key.shape[0])
    if key.dtype != query.dtype:
        raise type_error("key", f"dtype {str(query.dtype).replace('torch.', '')} (the dtype of query)", key.dtype)
    check_tensor("cos_sin_cache", cos_sin_cache, dim=2, device=query.device)
    if cos_sin_cache.dtype != torch.float32:
        raise ValueError("cos_sin_cache should be float32")
    rotary_dim = cos_sin_cache.shape[1]
    if rotary_dim <= 0 or rotary_dim % 2 or rotary_dim > head_size:
        raise value_error("cos_sin_cache", f"an even number of columns in [2, head_size = {head_size}]", rotary_dim)
    _check_pos("positions", positions, query.device, query.shape[0])
    if not isinstance(is_neox, bool):
        raise type_error("is_neox", "a bool", type(is_neox).__name__)
    nnz = query.shape[0]
    # (head counts given: a view of no tokens cannot infer a -1)
    q = query.view(nnz, query.shape[1] // head_size, head_size)
    k = key.view(nnz, key.shape[1] // head_size, head_size)
    _check_qk(q, k)
    return q, k, cos_sin_cache.contiguous(), rotary_dim


def _heads(x: torch.Tensor, head_size: int) -> torch.Tensor:
    """``x [nnz, heads * head_size]`` (unit last stride) as ``[nnz, heads, head_size]`` with x's own token stride.
    A view would recompute the stride of a single token's dimension (``[1, 576]`` of stride ``(960, 1)`` viewed
    as ``[1, 9, 64]`` strides ``(576, 64, 1)``), while the launch a checked form keeps serves every token count
    with the strides of the call that bound it, which must therefore be those its key holds."""
    return x.as_strided((x.shape[0], x.shape[1] // head_size, head_size), (x.stride(0), head_size, 1))


def _cache_form(positions, query, key, head_size, cos_sin_cache, is_neox, query_out, key_out) -> tuple | None:
    """The checked-form key of a cos/sin-cache call (outputs: the tensors it writes, query and key in place), or None
    for arguments of other types (never a checked form); ``query_out``/``key_out`` stand for their strides."""
    if (
        type(positions) is _T
        and type(query) is _T
        and type(key) is _T
        and type(cos_sin_cache) is _T
        and type(head_size) is int
        and type(is_neox) is bool
    ):
        return ("cos_sin_cache", query.shape[1:], query.stride(), query.dtype, query.device, key.shape[1:],
                key.stride(), key.dtype, key.device, positions.stride(), positions.dtype, positions.device,
                cos_sin_cache.shape, cos_sin_cache.stride(), cos_sin_cache.dtype, cos_sin_cache.device, head_size,
                is_neox, query_out is query, query_out.stride(), key_out.stride())  # fmt: skip
    return None


def _cos_sin_bound(form, positions, query, key, query_out, key_out, cos_sin_cache) -> bool:
    """Launch the bound launch of a checked cos/sin-cache ``form`` on this call's tensors; False, having launched
    nothing, where there is none, the token counts differ or the short path does not apply now."""
    bound = _rope_forms.forms.get(form) if form is not None else None
    if not bound:
        return False
    nnz = query.shape[0]
    if key.shape[0] != nnz or positions.shape[0] != nnz:
        return False
    pos, cache = positions.contiguous(), cos_sin_cache.contiguous()  # (held until launched: copies where strided)
    pq, pk = query.data_ptr(), key.data_ptr()
    pqo, pko = (pq, pk) if query_out is query else (query_out.data_ptr(), key_out.data_ptr())
    return launch_bound(bound, nnz, pq, pk, pqo, pko, pos.data_ptr(), cache.data_ptr())


def _cos_sin_v02(q, k, cos_cache, sin_cache, pos_ids, interleave, inplace):
    """FlashInfer 0.2's form ``(q, k, cos_cache, sin_cache, pos_ids, interleave=False)``: ``q [nnz, Hq, D]``,
    ``k [nnz, Hk, D]``, float32 ``cos_cache`` and ``sin_cache`` ``[max_pos, rot]`` holding one value per rotated
    element (0.7's cache holds one per pair). Element ``i < rot`` of a head becomes
    ``x[i] * cos[p, i] + x'[i] * sin[p, i]``, ``x'`` its partner (``-x[i + rot/2]`` / ``x[i - rot/2]``, or
    ``-x[i + 1]`` / ``x[i - 1]`` interleaved). PyTorch ops on any device: the caches need not repeat a value
    within a pair, which the kernel's per-pair cache assumes. ``pos_ids`` is range-checked (one host read)."""
    _check_qk(q, k)
    for name, c in (("cos_cache", cos_cache), ("sin_cache", sin_cache)):
        check_tensor(name, c, dim=2, device=q.device)
        if c.dtype != torch.float32:
            raise type_error(name, "dtype float32", str(c.dtype).replace("torch.", ""))
    if sin_cache.shape != cos_cache.shape:
        raise value_error(
            "sin_cache", f"the shape of cos_cache {shape_str(cos_cache.shape)}", shape_str(sin_cache.shape)
        )
    rot, head_dim = cos_cache.shape[1], q.shape[2]
    if rot <= 0 or rot % 2 or rot > head_dim:
        raise value_error("cos_cache", f"an even number of columns in [2, head_dim = {head_dim}]", rot)
    _check_pos("pos_ids", pos_ids, q.device, q.shape[0])
    if not isinstance(interleave, bool):
        raise type_error("interleave", "a bool", type(interleave).__name__)
    if pos_ids.numel():
        lo, hi = (int(v) for v in torch.aminmax(pos_ids))
        if lo < 0 or hi >= cos_cache.shape[0]:
            raise value_error(
                "pos_ids", f"positions in [0, {cos_cache.shape[0]}) (the rows of cos_cache)", f"{lo}..{hi}"
            )
    cos = cos_cache[pos_ids.long()][:, None, :]
    sin = sin_cache[pos_ids.long()][:, None, :]
    outs = []
    for x in (q, k):
        xr = x[..., :rot].float()
        if interleave:
            partner = torch.stack((-xr[..., 1::2], xr[..., 0::2]), dim=-1).flatten(-2)
        else:
            partner = torch.cat((-xr[..., rot // 2 :], xr[..., : rot // 2]), dim=-1)
        y = (xr * cos + partner * sin).to(x.dtype)
        o = x if inplace else x.clone()
        o[..., :rot] = y
        outs.append(o)
    return None if inplace else tuple(outs)


def _v02_signature(q, k, cos_cache, sin_cache, pos_ids, interleave=False):
    """FlashInfer 0.2's parameters of ``apply_rope_with_cos_sin_cache*`` (bound, never called)."""


def _accepts_v02_cos_sin(fn):
    """Also take FlashInfer 0.2's form of ``fn``: 0.2's ``(q, k, cos_cache, ...)`` starts with a float tensor,
    0.7's ``(positions, query, ...)`` with an integer one; the signature shown stays 0.7's."""
    import functools
    import inspect

    v02 = inspect.signature(_v02_signature)
    inplace = fn.__name__.endswith("_inplace")

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        first = args[0] if args else kwargs.get("q")
        if isinstance(first, torch.Tensor) and first.is_floating_point():
            bound = v02.bind(*args, **kwargs)
            bound.apply_defaults()
            return _cos_sin_v02(**bound.arguments, inplace=inplace)
        return fn(*args, **kwargs)

    wrapper.__flashinfer_v02_order__ = tuple(v02.parameters)
    return wrapper


@_accepts_v02_cos_sin
def apply_rope_with_cos_sin_cache(positions, query, key, head_size, cos_sin_cache, is_neox=True):
    """Rotate ``query [nnz, Hq * head_size]``, ``key [nnz, Hk * head_size]`` with cosines and sines
    from ``cos_sin_cache[positions]`` (float32 ``[max_pos, rot]``, cosines first); returns new tensors.

    FlashInfer 0.2's form ``(q, k, cos_cache, sin_cache, pos_ids, interleave=False)`` (a float tensor first)
    is accepted too (``_cos_sin_v02``)."""
    form = None
    if type(query) is _T and type(key) is _T and not torch.compiler.is_compiling():
        query_out, key_out = _empty_like(query), _empty_like(key)
        form = _cache_form(positions, query, key, head_size, cos_sin_cache, is_neox, query_out, key_out)
        if _cos_sin_bound(form, positions, query, key, query_out, key_out, cos_sin_cache):
            return query_out, key_out
    q, k, cache, rotary_dim = _cache_views(positions, query, key, head_size, cos_sin_cache, is_neox)
    query_out, key_out = torch.empty_like(query), torch.empty_like(key)
    if form is None:
        qo, ko = query_out.view(q.shape), key_out.view(k.shape)
    else:  # (the launch a checked form keeps: every tensor's own token stride, as _heads says)
        q, k, qo, ko = (_heads(x, head_size) for x in (query, key, query_out, key_out))
    _run(q, k, qo, ko, positions, rotary_dim, not is_neox, cache, form=form)
    return query_out, key_out


@_accepts_v02_cos_sin
def apply_rope_with_cos_sin_cache_inplace(positions, query, key, head_size, cos_sin_cache, is_neox=True) -> None:
    """In-place ``apply_rope_with_cos_sin_cache`` (FlashInfer 0.2's form too)."""
    form = None
    if not torch.compiler.is_compiling():
        form = _cache_form(positions, query, key, head_size, cos_sin_cache, is_neox, query, key)
        if _cos_sin_bound(form, positions, query, key, query, key, cos_sin_cache):
            return
    q, k, cache, rotary_dim = _cache_views(positions, query, key, head_size, cos_sin_cache, is_neox)
    if form is not None:  # (the launch a checked form keeps: query's and key's own token strides, as _heads says)
        q, k = _heads(query, head_size), _heads(key, head_size)
    _run(q, k, q, k, positions, rotary_dim, not is_neox, cache, form=form)
