"""Argument validation: one place, one message style.

Messages name the argument, say what was expected and what came, and never print tensor contents:
``"kv_indptr: expected shape [batch_size + 1] = [8], got [7]"``.
"""

from __future__ import annotations

import math

import torch

KV_LAYOUTS = ("NHD", "HND")
POS_ENCODING_MODES = ("NONE", "ROPE_LLAMA", "ALIBI")
Q_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
INDEX_DTYPE = torch.int32
# FlashInfer 0.7.2's attention kernels take multiples of 16 up to 256 and then 512 (its tests run 64, 128, 256 and
# 512; the prefill kernel's output tiling rejects 272-496). The Triton kernels here take every multiple of 16 up
# to 512: a head dim that is not a power of two is a masked slice of the next power-of-two tile.
MAX_HEAD_DIM = 512

_DTYPE_NAMES = {
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "float8_e4m3fn": getattr(torch, "float8_e4m3fn", None),
    "fp8_e4m3": getattr(torch, "float8_e4m3fn", None),
    "e4m3": getattr(torch, "float8_e4m3fn", None),
    "float8_e5m2": getattr(torch, "float8_e5m2", None),
    "fp8_e5m2": getattr(torch, "float8_e5m2", None),
    "e5m2": getattr(torch, "float8_e5m2", None),
}


def shape_str(shape) -> str:
    return "[" + ", ".join(str(int(s)) for s in shape) + "]"


def value_error(name: str, expected: str, got) -> ValueError:
    return ValueError(f"{name}: expected {expected}, got {got}")


def type_error(name: str, expected: str, got) -> TypeError:
    return TypeError(f"{name}: expected {expected}, got {got}")


def parse_dtype(name: str, value, default: torch.dtype | None = None) -> torch.dtype | None:
    """A torch dtype from a dtype or its name ("float16", "bfloat16", "fp8_e4m3", ...)."""
    if value is None:
        return default
    if isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        dtype = _DTYPE_NAMES.get(value.lower().replace("torch.", ""))
        if dtype is not None:
            return dtype
    raise type_error(name, "a torch dtype or one of 'float16', 'bfloat16', 'float8_e4m3fn', 'float8_e5m2'", repr(value))


def check_tensor(name: str, x, *, dim: int | None = None, dtypes=None, device=None) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise type_error(name, "a torch.Tensor", type(x).__name__)
    if dim is not None and x.dim() != dim:
        raise value_error(name, f"a {dim}-D tensor", f"shape {shape_str(x.shape)}")
    if dtypes is not None and x.dtype not in dtypes:
        names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
        raise type_error(name, f"dtype in ({names})", str(x.dtype).replace("torch.", ""))
    if device is not None and x.device != torch.device(device):
        raise value_error(name, f"a tensor on {device}", f"one on {x.device}")
    return x


def check_shape(name: str, x: torch.Tensor, expected: tuple, what: str | None = None) -> None:
    if tuple(x.shape) != tuple(expected):
        label = f"shape {what} = {shape_str(expected)}" if what else f"shape {shape_str(expected)}"
        raise value_error(name, label, shape_str(x.shape))


def check_last_dim_contiguous(name: str, x: torch.Tensor) -> None:
    if x.numel() > 0 and x.stride(-1) != 1:
        raise value_error(name, "a contiguous last dimension (stride 1)", f"stride {x.stride(-1)}")


def check_choice(name: str, value, choices) -> None:
    try:
        ok = value in choices
    except (TypeError, ValueError, RuntimeError):  # (an array compares elementwise: its truth value raises)
        ok = False
    if not ok:
        raise value_error(name, "one of " + ", ".join(repr(c) for c in choices), repr(value))


def reject_unknown(where: str, kwargs: dict) -> None:
    """Keyword arguments no signature here names: ``enable_pdl`` (a launch hint, no effect on results) is
    accepted; anything else is a mistake worth naming, never silently dropped."""
    unknown = sorted(set(kwargs) - {"enable_pdl"})
    if unknown:
        raise TypeError(f"{where}() got unexpected keyword argument(s): {', '.join(unknown)}")


def reject_run_extras(**given) -> None:
    """run() parameters of FlashInfer 0.7 for kernels this library does not have: an error when set."""
    for name, value in given.items():
        if value is not None and value is not False:
            raise NotImplementedError(f"{name}: not supported by flashinfer_triton (got a value; pass None)")


def check_kv_layout(kv_layout) -> str:
    check_choice("kv_layout", kv_layout, KV_LAYOUTS)
    return kv_layout


def check_pos_encoding_mode(mode) -> str:
    check_choice("pos_encoding_mode", mode, POS_ENCODING_MODES)
    return mode


def check_positive_int(name: str, value) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise value_error(name, "a positive int", repr(value))
    return value


def check_heads(num_qo_heads, num_kv_heads) -> None:
    check_positive_int("num_qo_heads", num_qo_heads)
    check_positive_int("num_kv_heads", num_kv_heads)
    if num_qo_heads % num_kv_heads != 0:
        raise value_error("num_qo_heads", f"a multiple of num_kv_heads ({num_kv_heads})", f"{num_qo_heads}")


def check_head_dim(head_dim, name: str = "head_dim") -> int:
    check_positive_int(name, head_dim)
    if head_dim % 16 != 0 or head_dim > MAX_HEAD_DIM:
        raise value_error(name, f"a multiple of 16 up to {MAX_HEAD_DIM}", head_dim)
    return head_dim


def check_window_left(window_left) -> int:
    if window_left is None:
        return -1
    if isinstance(window_left, bool) or not isinstance(window_left, int) or window_left < -1:
        raise value_error("window_left", "-1 (no window) or an int >= 0", repr(window_left))
    return window_left


def check_soft_cap(logits_soft_cap) -> float:
    if logits_soft_cap is None:
        return 0.0
    value = float(logits_soft_cap)
    if not math.isfinite(value) or value < 0:
        raise value_error("logits_soft_cap", "None, 0 or a positive number", repr(logits_soft_cap))
    return value


def _as_float(name: str, value) -> float:
    """float(value), or a TypeError naming the argument."""
    try:
        return float(value)
    except (TypeError, ValueError, RuntimeError):
        raise type_error(name, "a number", repr(value)) from None


def resolve_sm_scale(sm_scale, head_dim: int) -> float:
    if sm_scale is None:
        return 1.0 / math.sqrt(head_dim)
    value = _as_float("sm_scale", sm_scale)
    if not math.isfinite(value):
        raise value_error("sm_scale", "a finite number", repr(sm_scale))
    return value


def resolve_rope(rope_scale, rope_theta) -> tuple[float, float]:
    scale = 1.0 if rope_scale is None else _as_float("rope_scale", rope_scale)
    theta = 1e4 if rope_theta is None else _as_float("rope_theta", rope_theta)
    if not (math.isfinite(scale) and scale > 0):
        raise value_error("rope_scale", "a positive number", repr(rope_scale))
    if not (math.isfinite(theta) and theta > 0):
        raise value_error("rope_theta", "a positive number", repr(rope_theta))
    return scale, theta


def resolve_scale(name: str, value) -> float:
    """fp8 scales: None (1.0), a Python number, or a one-element tensor (read once, on the host)."""
    if value is None:
        return 1.0
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise value_error(name, "a number or a one-element tensor", f"shape {shape_str(value.shape)}")
        value = value.item()
    value = _as_float(name, value)
    if not math.isfinite(value):
        raise value_error(name, "a finite number", repr(value))
    return value


def check_q_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    if dtype not in Q_DTYPES:
        raise type_error(name, "float16 or bfloat16 (float32 for testing)", str(dtype).replace("torch.", ""))
    return dtype


def check_kv_dtype(name: str, kv_dtype: torch.dtype, q_dtype: torch.dtype) -> torch.dtype:
    if kv_dtype != q_dtype and kv_dtype not in FP8_DTYPES:
        raise type_error(
            name,
            f"the query dtype ({str(q_dtype).replace('torch.', '')}) or float8_e4m3fn/float8_e5m2",
            str(kv_dtype).replace("torch.", ""),
        )
    return kv_dtype


def check_index_tensor(name: str, x, *, length: int | None = None, what: str | None = None) -> torch.Tensor:
    """A 1-D int32 index tensor (on any device)."""
    check_tensor(name, x, dim=1)
    if x.dtype != INDEX_DTYPE:
        raise type_error(name, "dtype int32", str(x.dtype).replace("torch.", ""))
    if length is not None and x.shape[0] != length:
        expected = f"shape {what} = [{length}]" if what else f"shape [{length}]"
        raise value_error(name, expected, shape_str(x.shape))
    return x


def check_indptr_host(name: str, indptr: torch.Tensor) -> None:
    """indptr (host int64 copy): starts at 0 and never decreases."""
    if indptr.numel() < 1:
        raise value_error(name, "at least one element", "an empty tensor")
    if int(indptr[0]) != 0:
        raise value_error(name, "indptr[0] == 0", f"indptr[0] == {int(indptr[0])}")
    if indptr.numel() > 1 and bool((indptr[1:] < indptr[:-1]).any()):
        raise value_error(name, "a non-decreasing sequence", "a decreasing step")


def check_same_device(device, **tensors) -> None:
    for name, x in tensors.items():
        if x is not None and x.device != device:
            raise value_error(name, f"a tensor on {device} (the device of q)", f"one on {x.device}")


# ----------------------------------------------------------------------------- API generations
# FlashInfer 0.2 and 0.7 put different parameters at the same positions (0.7 inserted head_dim_vo,
# o_data_type, scale_q/scale_k/scale_v, ...). A positional call is bound to 0.7's order unless its values fit
# 0.2's order and not 0.7's, judged by each value's type against the kind of argument each name takes.
_TENSOR_ARGS = frozenset(
    [
        "custom_mask",
        "packed_custom_mask",
        "block_tables",
        "seq_lens",
        "seq_lens_q",
        "prefix_len_ptr",
        "token_pos_in_items_ptr",
        "max_item_len_ptr",
        "v_indptr",
        "o_indptr",
        "sinks",
        "kv_cache_sf",
        "batch_indices",
        "positions",
    ]
)
_INT_ARGS = frozenset(
    [
        "head_dim",
        "head_dim_qk",
        "head_dim_vo",
        "page_size",
        "window_left",
        "window_right",
        "fixed_split_size",
        "q_len_per_req",
        "max_token_per_sequence",
        "max_sequence_kv",
        "uniform_q_len",
        "token_pos_in_items_len",
    ]
)
_BOOL_ARGS = frozenset(
    [
        "causal",
        "use_fp16_qk_reduction",
        "allow_fp16_qk_reduction",
        "non_blocking",
        "disable_split_kv",
        "return_lse",
        "is_causal",
    ]
)
_FLOAT_ARGS = frozenset(["sm_scale", "logits_soft_cap", "rope_scale", "rope_theta", "k_scale", "v_scale", "q_scale"])
_STR_ARGS = frozenset(["pos_encoding_mode", "kv_layout", "backend"])
_DTYPE_ARGS = frozenset(["q_data_type", "kv_data_type", "o_data_type", "data_type", "o_dtype"])
_SCALE_TENSOR_ARGS = frozenset(["scale_q", "scale_k", "scale_v"])


def _fits(name: str, value) -> bool:
    """Whether ``value`` is of the kind parameter ``name`` takes (None fits every optional parameter)."""
    if value is None:
        return True
    if name == "custom_mask":  # a bool mask, as FlashInfer requires (a float tensor is a 0.7 scale)
        return isinstance(value, torch.Tensor) and value.dtype == torch.bool
    if name in _TENSOR_ARGS:
        return isinstance(value, torch.Tensor)
    if name in _SCALE_TENSOR_ARGS:  # per-head fp8 scales: float tensors or numbers
        if isinstance(value, torch.Tensor):
            return value.is_floating_point()
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _INT_ARGS:
        return isinstance(value, int) and not isinstance(value, bool)
    if name in _BOOL_ARGS:
        return isinstance(value, bool)
    if name in _FLOAT_ARGS:
        if isinstance(value, torch.Tensor):
            return value.is_floating_point()
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if name in _STR_ARGS:
        return isinstance(value, str)
    if name in _DTYPE_ARGS:
        if name in ("o_data_type", "o_dtype") and value in FP8_DTYPES:
            return False  # outputs are never fp8: an fp8 dtype there is 0.2's data_type
        if isinstance(value, str):
            return value.lower().replace("torch.", "") in _DTYPE_NAMES
        return isinstance(value, torch.dtype)
    return True


def bind_generations(prefix: int, v02: tuple, *, method: bool = True):
    """Decorator: accept FlashInfer 0.2's positional order after the first ``prefix`` positionals.

    The decorated function's own signature is 0.7's order (``prefix`` counts the positionals after ``self``
    for a method); ``v02`` lists 0.2's parameter names from position ``prefix`` on. A positional tail whose values
    all fit 0.2's names while some do not fit 0.7's is rebound by keyword to 0.2's names; otherwise 0.7 wins
    (where the types cannot tell the two apart, 0.7's order is the rule).
    """
    import functools
    import inspect

    def deco(fn):
        params = [
            p.name
            for p in inspect.signature(fn).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
        names = tuple(params[1:] if method else params)
        tail07 = names[prefix:]

        @functools.wraps(fn)
        def wrapper(*args, **kwargs):
            lead = 1 if method else 0
            tail = args[lead + prefix :]
            if tail and len(tail) <= len(v02):
                fits07 = len(tail) <= len(tail07) and all(_fits(n, v) for n, v in zip(tail07, tail))
                fits02 = all(_fits(n, v) for n, v in zip(v02, tail))
                if fits02 and not fits07:
                    for n, v in zip(v02, tail):
                        if n in kwargs:
                            raise TypeError(f"{fn.__qualname__}() got multiple values for argument '{n}'")
                        kwargs[n] = v
                    args = args[: lead + prefix]
            return fn(*args, **kwargs)

        wrapper.__flashinfer_v02_order__ = tuple(names[:prefix]) + tuple(v02)
        return wrapper

    return deco


def run_positionals_v02(where: str, args: tuple, names: tuple, given: tuple) -> tuple:
    """The values of ``names`` after binding ``run()``'s positional ``args`` the way FlashInfer 0.2 did.

    0.2's ``run()`` took its scales and ``return_lse`` positionally; 0.7 keeps that slot (``*args``) for
    arguments of custom JIT kernels, which this library has none of. Values of 0.2's kinds are bound to 0.2's
    names; anything else is refused, naming ``*args``. ``given`` holds the keyword values (None / False when
    not passed): a name given both ways is an error, as in a plain Python call.
    """
    if len(args) > len(names) or not all(_fits(n, v) for n, v in zip(names, args)):
        raise NotImplementedError(
            f"{where}: *args: positional arguments after the inputs are arguments of custom JIT kernels, "
            f"which flashinfer_triton does not have; pass {', '.join(names)} by keyword"
        )
    out = list(given)
    for i, (n, v) in enumerate(zip(names, args)):
        if given[i] is not None and given[i] is not False:
            raise TypeError(f"{where}() got multiple values for argument '{n}'")
        out[i] = v
    return tuple(out)


def as_int32_index(name: str, x):
    """An int32 index tensor of unit stride, from one that FlashInfer also takes as int64 or as a strided view
    (None passes through): the kernels read index arrays at unit stride, where FlashInfer's plan() copies them.

    int64 tensors are narrowed once, on their device, after checking that every entry fits int32 (a host read
    of their extremes, done where the caller reads the page table anyway: plan() and the page functions).
    """
    if x is None or not isinstance(x, torch.Tensor):
        return x
    if x.dtype != torch.int64:
        return x if x.is_contiguous() else x.contiguous()
    if x.numel() > 0:
        lo, hi = (int(v) for v in torch.aminmax(x))
        if lo < -(2**31) or hi >= 2**31:
            raise value_error(name, "entries that fit int32", "an entry outside the int32 range")
    return x.to(torch.int32, memory_format=torch.contiguous_format)
