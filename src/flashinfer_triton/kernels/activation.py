"""Gated activations ``act(x[..., :H]) * x[..., H:]`` for SiLU, exact (erf) GELU and tanh GELU.

A program handles ``BLOCK`` columns of one row: it loads the gate half and the up half once, computes
in float32 and stores once, so the kernel moves exactly ``3 * H`` elements per row. Rows are
addressed by stride, so a non-contiguous leading layout costs nothing. The tile is chosen to divide
the width where it can (``EVEN``: no masks), with one 16-byte load per operand and thread.
The divisions are the fast (approximate, 2 ulp) float32 ones: the result is rounded to the storage
dtype, and the IEEE division's slow path would lengthen a kernel that lasts a few microseconds.
"""

import triton
import triton.language as tl

from .. import _config
from .._launch import FastKernel
from ._row_forms import BoundForms

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit
def _act_and_mul_kernel(
    x_ptr, out_ptr, hidden, sx, so, ACT: tl.constexpr, EVEN: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x_row = x_ptr + row * sx
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EVEN:
        g = tl.load(x_row + offs).to(tl.float32)
        u = tl.load(x_row + hidden + offs).to(tl.float32)
    else:
        mask = offs < hidden
        g = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(x_row + hidden + offs, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        a = tl.fdiv(g, 1.0 + tl.exp(-g))
    elif ACT == 1:
        a = 0.5 * g * (1.0 + tl.math.erf(g * 0.7071067811865476))
    else:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both tails, no libdevice tanh needed.
        y = 0.7978845608028654 * (g + 0.044715 * g * g * g)
        a = 0.5 * g * (2.0 - tl.fdiv(2.0, tl.exp(2.0 * y) + 1.0))
    y_out = (a * u).to(out_ptr.dtype.element_ty)
    o_ptrs = out_ptr + row * so + offs
    if EVEN:
        tl.store(o_ptrs, y_out)
    else:
        tl.store(o_ptrs, y_out, mask=offs < hidden)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


_act_forms = BoundForms(FastKernel(_act_and_mul_kernel), 2, "activation")


def launch_act_and_mul(x2d, out2d, act: str, pdl: bool = False, cfg=None) -> None:
    """``x2d``: ``[rows, 2H]``, ``out2d``: ``[rows, H]``, both with a contiguous last dimension. ``pdl``: launched
    as a programmatic dependent launch (sm_90+ compiled kernels only)."""
    cfg = cfg or _config.ACTIVATION
    rows, hidden = out2d.shape
    if rows == 0 or hidden == 0:
        return
    block, even = cfg.tile(hidden)
    grid = (rows, triton.cdiv(hidden, block))
    args = (x2d, out2d, hidden, x2d.stride(0), out2d.stride(0), ACTIVATIONS[act], even, block, bool(pdl))
    warps = cfg.warps(block)
    key = (grid, args[2:], x2d.dtype, out2d.dtype, warps)
    if pdl:
        _act_forms.launch(key, args, grid, num_warps=warps, launch_pdl=True)
    else:
        _act_forms.launch(key, args, grid, num_warps=warps)
