"""FlashInfer's ``flashinfer.norm``: RMSNorm, Gemma RMSNorm, their fused residual-add forms, LayerNorm.

Arithmetic is float32 whatever the storage dtype, as in FlashInfer: ``out = x * rsqrt(mean(x^2) + eps) * w``
with ``w`` the weight (``weight + 1`` for the Gemma forms). The fused forms first write
``residual += input`` (rounded to the residual's dtype) and normalise the unrounded float32 sum into
``input``. CUDA tensors run the Triton kernel of ``kernels/norm.py``; CPU tensors a PyTorch path (or the
kernel under ``TRITON_INTERPRET=1``).

``enable_pdl``: the kernel is a programmatic dependent launch (sm_90+ GPUs; it waits for the previous
kernel's writes before its first load, so results never change, only launch overlap); None takes
``NormConfig.pdl``.
"""

from __future__ import annotations

import math

import torch

from . import _config, _custom_ops
from ._backend import use_triton
from ._checks import Q_DTYPES, check_tensor, shape_str, type_error, value_error
from .kernels._row_forms import launch_bound
from .kernels.norm import _norm_forms, launch_norm

__all__ = ["fused_add_rmsnorm", "gemma_fused_add_rmsnorm", "gemma_rmsnorm", "layernorm", "rmsnorm"]

_MAX_HIDDEN = 65536

# The checked call forms. What the checks read of a call (the tensors' shapes, strides, dtypes and devices, eps,
# enable_pdl) fixes its launch but for the number of rows, so a call of a form whose checks passed once and whose
# launch was bound (``_norm_forms``, keyed by the form) launches it directly. A form leaves the rows out (the first
# dimension of input): an engine's prefill changes them at every step. What depends on them is compared per call
# (``out.shape == input.shape``, the other operands' shapes likewise) inside the key. Scalars enter the key only of
# the exact types float / bool / None (1 == True: an int would meet a bool's form).
_T = torch.Tensor
_empty_like = torch.empty_like


def _check_input(name: str, x, dims=(2, 3)) -> torch.Tensor:
    check_tensor(name, x, dtypes=Q_DTYPES)
    if x.dim() not in dims:
        raise value_error(name, " or ".join(f"a {d}-D tensor" for d in dims), f"shape {shape_str(x.shape)}")
    if x.shape[-1] == 0 or x.shape[-1] > _MAX_HIDDEN:
        raise value_error(name, f"a hidden size in [1, {_MAX_HIDDEN}]", x.shape[-1])
    if x.numel() > 0 and x.stride(-1) != 1:
        raise value_error(name, "a contiguous last dimension (stride 1)", f"stride {x.stride(-1)}")
    return x


def _check_vector(name: str, w, x: torch.Tensor) -> None:
    check_tensor(name, w, dim=1, dtypes=Q_DTYPES, device=x.device)
    if w.shape[0] != x.shape[-1]:
        raise value_error(name, f"shape [hidden_size] = [{x.shape[-1]}]", shape_str(w.shape))
    if w.stride(0) != 1 and w.shape[0] > 1:
        raise value_error(name, "a contiguous tensor", f"stride {w.stride(0)}")


def _check_eps(eps) -> float:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)):
        raise type_error("eps", "a float", type(eps).__name__)
    eps = float(eps)
    if not 0.0 <= eps < math.inf:
        raise value_error("eps", "a finite value >= 0", eps)
    return eps


def _check_pdl(enable_pdl) -> None:
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise type_error("enable_pdl", "None or a bool", type(enable_pdl).__name__)


def _check_out(out, x: torch.Tensor) -> None:
    check_tensor("out", out, device=x.device)
    if out.shape != x.shape:
        raise value_error("out", f"shape {shape_str(x.shape)} (the shape of input)", shape_str(out.shape))
    if out.dtype != x.dtype:
        raise type_error("out", f"dtype {str(x.dtype).replace('torch.', '')} (the dtype of input)", out.dtype)
    if out.numel() > 0 and out.stride(-1) != 1:
        raise value_error("out", "a contiguous last dimension (stride 1)", f"stride {out.stride(-1)}")


def _torch_rms(x32: torch.Tensor, w: torch.Tensor, eps: float, bias: float) -> torch.Tensor:
    rstd = torch.rsqrt(x32.pow(2).mean(dim=-1, keepdim=True) + eps)
    return x32 * rstd * (w.float() + bias)


def _rmsnorm(input, weight, eps, out, enable_pdl, bias: float):
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        # (the op checks its tensors and eps itself; out and enable_pdl here, as eager calls do)
        _check_pdl(enable_pdl)
        if out is not None:
            _check_input("input", input)
            _check_out(out, input)
        return _custom_ops.rmsnorm(input, weight, eps, out, bias, enable_pdl)
    form = None
    if (
        type(input) is _T
        and isinstance(weight, _T)
        and type(eps) is float
        and (enable_pdl is None or type(enable_pdl) is bool)
        and (out is None or type(out) is _T)
    ):
        shape = input.shape
        form = ("rmsnorm", bias, shape[1:], input.stride(), input.dtype, input.device, weight.shape,
                weight.stride(), weight.dtype, weight.device, eps, enable_pdl)  # fmt: skip
        if out is None:
            # (allocated first: its strides, which empty_like derives from input's, are part of the form)
            o = _empty_like(input)
            form += (o.stride(),)
        else:
            o = out
            form += (out.shape == shape, out.stride(), out.dtype, out.device)
        bound = _norm_forms.forms.get(form)
        if bound:
            px, pw, po = input.data_ptr(), weight.data_ptr(), o.data_ptr()
            if launch_bound(bound, input.numel() // shape[-1], px, px, pw, pw, po):
                return o
    _check_input("input", input)
    _check_vector("weight", weight, input)
    eps = _check_eps(eps)
    _check_pdl(enable_pdl)
    if out is None:
        out = torch.empty_like(input)
    else:
        _check_out(out, input)
    if use_triton(input.device):
        pdl = _config.pdl_launch(enable_pdl, input.device, _config.NORM.pdl)
        launch_norm(input, None, weight, None, out, eps, bias, layernorm=False, pdl=pdl, form=form)
    else:
        out.copy_(_torch_rms(input.float(), weight, eps, bias))
    return out


def rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """``out = input / RMS(input) * weight`` over the last dimension; input 2-D ``[batch, hidden]`` or
    3-D ``[batch, heads, hidden]``. Writes ``out`` when given, returns it."""
    return _rmsnorm(input, weight, eps, out, enable_pdl, 0.0)


def gemma_rmsnorm(
    input: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    out: torch.Tensor | None = None,
    enable_pdl: bool | None = None,
) -> torch.Tensor:
    """Gemma's RMSNorm: ``out = input / RMS(input) * (weight + 1)``."""
    return _rmsnorm(input, weight, eps, out, enable_pdl, 1.0)


def _fused_add(input, residual, weight, eps, enable_pdl, bias: float) -> None:
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        _check_pdl(enable_pdl)
        return _custom_ops.fused_add_rmsnorm(input, residual, weight, eps, bias, enable_pdl)
    form = None
    if (
        type(input) is _T
        and type(residual) is _T
        and isinstance(weight, _T)
        and type(eps) is float
        and (enable_pdl is None or type(enable_pdl) is bool)
    ):
        shape = input.shape
        form = ("fused_add_rmsnorm", bias, shape[1:], input.stride(), input.dtype, input.device,
                residual.shape == shape, residual.stride(), residual.dtype, residual.device, weight.shape,
                weight.stride(), weight.dtype, weight.device, eps, enable_pdl)  # fmt: skip
        bound = _norm_forms.forms.get(form)
        if bound:
            px, pr, pw = input.data_ptr(), residual.data_ptr(), weight.data_ptr()
            if launch_bound(bound, shape[0], px, pr, pw, pw, px):
                return
    _check_input("input", input, dims=(2,))
    _check_input("residual", residual, dims=(2,))
    if residual.shape != input.shape:
        raise value_error("residual", f"shape {shape_str(input.shape)} (the shape of input)", shape_str(residual.shape))
    if residual.device != input.device:
        raise value_error("residual", f"a tensor on {input.device} (the device of input)", f"one on {residual.device}")
    _check_vector("weight", weight, input)
    eps = _check_eps(eps)
    _check_pdl(enable_pdl)
    if use_triton(input.device):
        pdl = _config.pdl_launch(enable_pdl, input.device, _config.NORM.pdl)
        launch_norm(input, residual, weight, None, input, eps, bias, layernorm=False, pdl=pdl, form=form)
    else:
        x32 = input.float() + residual.float()
        residual.copy_(x32)
        input.copy_(_torch_rms(x32, weight, eps, bias))


def fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * weight``."""
    _fused_add(input, residual, weight, eps, enable_pdl, 0.0)


def gemma_fused_add_rmsnorm(
    input: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    enable_pdl: bool | None = None,
) -> None:
    """In place: ``residual += input``, then ``input = residual / RMS(residual) * (weight + 1)``."""
    _fused_add(input, residual, weight, eps, enable_pdl, 1.0)


def layernorm(input: torch.Tensor, gemma: torch.Tensor, beta: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """``(input - mean) / sqrt(var + eps) * gemma + beta`` over the last dimension of a 2-D input.

    FlashInfer's CUDA kernel takes bfloat16 input and float32 ``gemma``/``beta``; here any of float16,
    bfloat16, float32 is accepted for each. The output has the input's dtype."""
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.layernorm(input, gemma, beta, eps)
    form = None
    if type(input) is _T and isinstance(gemma, _T) and isinstance(beta, _T) and type(eps) is float:
        out = _empty_like(input)
        form = ("layernorm", input.shape[1:], input.stride(), input.dtype, input.device, gemma.shape, gemma.stride(),
                gemma.dtype, gemma.device, beta.shape, beta.stride(), beta.dtype, beta.device, eps,
                out.stride())  # fmt: skip
        bound = _norm_forms.forms.get(form)
        if bound:
            px = input.data_ptr()
            if launch_bound(bound, input.shape[0], px, px, gemma.data_ptr(), beta.data_ptr(), out.data_ptr()):
                return out
    _check_input("input", input, dims=(2,))
    _check_vector("gemma", gemma, input)
    _check_vector("beta", beta, input)
    eps = _check_eps(eps)
    out = torch.empty_like(input)
    if use_triton(input.device):
        launch_norm(input, None, gemma, beta, out, eps, 0.0, layernorm=True, form=form)
    else:
        x32 = input.float()
        mean = x32.mean(dim=-1, keepdim=True)
        var = (x32 - mean).pow(2).mean(dim=-1, keepdim=True)
        out.copy_((x32 - mean) * torch.rsqrt(var + eps) * gemma.float() + beta.float())
    return out
