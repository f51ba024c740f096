"""Row normalisations: RMSNorm (plain, Gemma ``weight + 1``, fused residual add) and LayerNorm.

One program normalises one row: the whole row (``BLOCK >= hidden``) is loaded once into registers,
reduced in float32, scaled and stored, so every element is read and written exactly once. 2-D
``[tokens, hidden]`` rows are addressed as ``r * s0``; 3-D ``[tokens, heads, hidden]`` rows as
``(r // n1) * s0 + (r % n1) * s1``, so views with any leading strides share one kernel.

These launches last a few microseconds, most of it memory latency: every load (input, residual,
weight) is issued before the first store, so a row costs one round trip to memory rather than one per
operand (a load issued after the residual's store could not be moved above it, the pointers may alias).
A row that fills the tile exactly (``EVEN``) takes unmasked loads and stores; the mean takes a multiply
by ``1 / hidden`` and the scale the approximate ``rsqrt`` (relative error ~1e-7), not IEEE division and
square root, whose slow paths would lie between the reduction and the stores.
"""

import triton
import triton.language as tl

from .. import _config
from .._launch import FastKernel
from ._row_forms import BoundForms


@triton.jit
def _norm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    n1,
    sx0,
    sx1,
    sr0,
    sr1,
    so0,
    so1,
    hidden,
    inv_hidden,
    eps,
    weight_bias,
    HAS_RESIDUAL: tl.constexpr,
    LAYERNORM: tl.constexpr,
    HEADS: tl.constexpr,
    EVEN: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    row = tl.program_id(0)
    if HEADS:
        i0 = (row // n1).to(tl.int64)
        i1 = (row % n1).to(tl.int64)
        x_off = i0 * sx0 + i1 * sx1
        r_off = i0 * sr0 + i1 * sr1
        o_off = i0 * so0 + i1 * so1
    else:
        r64 = row.to(tl.int64)
        x_off = r64 * sx0
        r_off = r64 * sr0
        o_off = r64 * so0
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    if PDL:
        tl.extra.cuda.gdc_wait()
    r_row = res_ptr + r_off + offs
    if EVEN:
        x = tl.load(x_ptr + x_off + offs).to(tl.float32)
        w = tl.load(w_ptr + offs).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_row).to(tl.float32)
        if LAYERNORM:
            b = tl.load(b_ptr + offs).to(tl.float32)
    else:
        x = tl.load(x_ptr + x_off + offs, mask=mask, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:
            x += tl.load(r_row, mask=mask, other=0.0).to(tl.float32)
        if LAYERNORM:
            b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        if EVEN:
            tl.store(r_row, x.to(res_ptr.dtype.element_ty))
        else:
            tl.store(r_row, x.to(res_ptr.dtype.element_ty), mask=mask)
    w = w + weight_bias
    if LAYERNORM:
        mean = tl.sum(x, axis=0) * inv_hidden
        if EVEN:
            xc = x - mean
        else:
            xc = tl.where(mask, x - mean, 0.0)
        rstd = tl.math.rsqrt(tl.sum(xc * xc, axis=0) * inv_hidden + eps)
        y = xc * rstd * w + b
    else:
        rstd = tl.math.rsqrt(tl.sum(x * x, axis=0) * inv_hidden + eps)
        y = x * rstd * w
    o_row = out_ptr + o_off + offs
    if EVEN:
        tl.store(o_row, y.to(out_ptr.dtype.element_ty))
    else:
        tl.store(o_row, y.to(out_ptr.dtype.element_ty), mask=mask)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


_norm_forms = BoundForms(FastKernel(_norm_kernel), 5, "norm")


def launch_norm(
    x,
    residual,
    weight,
    bias,
    out,
    eps: float,
    weight_bias: float,
    layernorm: bool,
    pdl: bool = False,
    cfg=None,
    form=None,
) -> None:
    """``x``, ``residual``, ``out``: 2-D or 3-D views with a contiguous last dimension, same shape.
    ``pdl``: launched as a programmatic dependent launch (sm_90+ compiled kernels only). ``form``: the caller's key
    of this call form, which must fix every argument here but the tensors' addresses and the number of rows (the
    public functions' checked forms, ``_row_forms``); None: the key of the arguments themselves."""
    cfg = cfg or _config.NORM
    hidden = x.shape[-1]
    if x.dim() == 2:
        rows, n1, heads = x.shape[0], 1, False
        sx = (x.stride(0), 0)
        so = (out.stride(0), 0)
        sr = (residual.stride(0), 0) if residual is not None else (0, 0)
    else:
        rows, n1, heads = x.shape[0] * x.shape[1], x.shape[1], True
        sx = (x.stride(0), x.stride(1))
        so = (out.stride(0), out.stride(1))
        sr = (residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)
    if rows == 0:
        return
    block = _config.next_pow2(hidden)
    res = residual if residual is not None else x
    bias_t = bias if bias is not None else weight
    args = (
        x,
        res,
        weight,
        bias_t,
        out,
        n1,
        sx[0],
        sx[1],
        sr[0],
        sr[1],
        so[0],
        so[1],
        hidden,
        1.0 / hidden,
        float(eps),
        float(weight_bias),
        residual is not None,  # HAS_RESIDUAL
        bool(layernorm),  # LAYERNORM
        heads,  # HEADS
        block == hidden,  # EVEN
        block,  # BLOCK
        bool(pdl),  # PDL
    )
    warps = cfg.warps(block)
    if form is None:
        form = (args[5:], x.dtype, res.dtype, weight.dtype, bias_t.dtype, out.dtype, warps)
    if pdl:
        _norm_forms.launch(form, args, (rows,), num_warps=warps, launch_pdl=True)
    else:
        _norm_forms.launch(form, args, (rows,), num_warps=warps)
