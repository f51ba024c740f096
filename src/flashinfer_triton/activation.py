"""FlashInfer's ``flashinfer.activation``: fused gated activations of MLP blocks.

``silu_and_mul(x) = silu(x[..., :H]) * x[..., H:]``; ``gelu_and_mul`` uses the exact erf GELU and
``gelu_tanh_and_mul`` the tanh approximation. Computed in float32, stored in the input's dtype.
CUDA tensors run ``kernels/activation.py``; CPU tensors a PyTorch path (or the kernel under
``TRITON_INTERPRET=1``). ``enable_pdl``: the kernel is a programmatic dependent launch (sm_90+ GPUs; it
waits for the previous kernel's writes before its first load, so results never change); None takes
``ActivationConfig.pdl``.
"""

from __future__ import annotations

import math

import torch

from . import _config, _custom_ops
from ._backend import use_triton
from ._checks import Q_DTYPES, check_tensor, shape_str, type_error, value_error
from .kernels._row_forms import launch_bound
from .kernels.activation import _act_forms, form_key, launch_act_and_mul

__all__ = ["gelu_and_mul", "gelu_tanh_and_mul", "silu_and_mul"]

# The checked call forms (as in ``norm``): a 2-D input's form (its width, strides, dtype and device, out's, and
# enable_pdl, of type None or bool only) fixes the checks and the launch but for the number of rows, so a form
# whose checks passed once and whose launch was bound (``_act_forms``, keyed by the form) launches directly.
# Other inputs take the checks at every call (the kernel then runs on a 2-D view or copy of them).
_T = torch.Tensor


def _torch_act(g: torch.Tensor, act: str) -> torch.Tensor:
    if act == "silu":
        return g * torch.sigmoid(g)
    if act == "gelu":
        return 0.5 * g * (1.0 + torch.erf(g * (1.0 / math.sqrt(2.0))))
    return 0.5 * g * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (g + 0.044715 * g.pow(3))))


def _check_args(input, out, enable_pdl) -> tuple:
    """The checks of every call, compiled ones included; the output's shape."""
    check_tensor("input", input, dtypes=Q_DTYPES)
    if input.dim() < 1:
        raise value_error("input", "a tensor of shape [..., 2 * hidden_size]", f"shape {shape_str(input.shape)}")
    if input.shape[-1] % 2 != 0:
        raise value_error("input", "an even last dimension (2 * hidden_size)", input.shape[-1])
    if enable_pdl is not None and not isinstance(enable_pdl, bool):
        raise type_error("enable_pdl", "None or a bool", type(enable_pdl).__name__)
    out_shape = tuple(input.shape[:-1]) + (input.shape[-1] // 2,)
    if out is not None:
        check_tensor("out", out, device=input.device)
        if tuple(out.shape) != out_shape:
            raise value_error("out", f"shape {shape_str(out_shape)}", shape_str(out.shape))
        if out.dtype != input.dtype:
            raise type_error("out", f"dtype {str(input.dtype).replace('torch.', '')} (the dtype of input)", out.dtype)
    return out_shape


def _act_and_mul(input, out, enable_pdl, act: str) -> torch.Tensor:
    form = None
    if (
        not torch.compiler.is_compiling()
        and type(input) is _T
        and input.dim() == 2
        and (enable_pdl is None or type(enable_pdl) is bool)
    ):
        rows, width = input.shape
        if out is None:
            form = (act, width, input.stride(), input.dtype, input.device, enable_pdl)
        elif type(out) is _T:
            form = (act, width, input.stride(), input.dtype, input.device, enable_pdl,
                    out.shape == (rows, width // 2), out.stride(), out.dtype, out.device)  # fmt: skip
        if form is not None:
            # (the launch is kept per layout of the form: the tile rows, evenness and warps the row count gives)
            layout = _config.ACTIVATION.layout(rows, width // 2)
            bound = _act_forms.forms.get(form_key(form, layout))
            if bound and rows < 1 << 31:
                o = input.new_empty((rows, width // 2)) if out is None else out
                g0 = (rows + layout[0] - 1) // layout[0]
                if launch_bound(bound, g0, input.data_ptr(), o.data_ptr(), tail=(rows,)):
                    return o
    out_shape = _check_args(input, out, enable_pdl)
    if torch.compiler.is_compiling():  # the custom op: Dynamo does not trace the launch path
        return _custom_ops.act_and_mul(input, out, act, enable_pdl)
    hidden = out_shape[-1]
    if out is None:
        out = torch.empty(out_shape, dtype=input.dtype, device=input.device)
    if out.numel() == 0:
        return out
    if use_triton(input.device):
        pdl = _config.pdl_launch(enable_pdl, input.device, _config.ACTIVATION.pdl)
        if form is not None and input.stride(-1) == 1 and out.stride(-1) == 1:
            # a checked form: the kernel runs on input and out themselves (a reshape would recompute the row stride
            # of a single row, and the form's launch keeps the call's strides for every row count)
            launch_act_and_mul(input, out, act, pdl=pdl, form=form)
            return out
        x2d = input.reshape(-1, 2 * hidden)
        if x2d.stride(-1) != 1:
            x2d = x2d.contiguous()
        try:
            o2d = out.view(-1, hidden)
        except RuntimeError:
            o2d = None
        if o2d is not None and o2d.stride(-1) == 1:
            launch_act_and_mul(x2d, o2d, act, pdl=pdl)
        else:
            tmp = torch.empty((x2d.shape[0], hidden), dtype=out.dtype, device=out.device)
            launch_act_and_mul(x2d, tmp, act, pdl=pdl)
            out.copy_(tmp.view(out_shape))
    else:
        x32 = input.float()
        out.copy_(_torch_act(x32[..., :hidden], act) * x32[..., hidden:])
    return out


def silu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    """``silu(input[..., :H]) * input[..., H:]`` for input ``[..., 2H]``; writes ``out`` when given."""
    return _act_and_mul(input, out, enable_pdl, "silu")


def gelu_and_mul(input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None) -> torch.Tensor:
    """``gelu(input[..., :H]) * input[..., H:]`` with the exact (erf) GELU."""
    return _act_and_mul(input, out, enable_pdl, "gelu")


def gelu_tanh_and_mul(
    input: torch.Tensor, out: torch.Tensor | None = None, enable_pdl: bool | None = None
) -> torch.Tensor:
    """``gelu_tanh(input[..., :H]) * input[..., H:]`` with the tanh approximation of GELU."""
    return _act_and_mul(input, out, enable_pdl, "gelu_tanh")
