"""Row normalisations: RMSNorm (plain, Gemma ``weight + 1``, fused residual add) and LayerNorm.

One program normalises one row: the whole row (``BLOCK >= hidden``) is loaded once into registers,
reduced in float32, scaled and stored, so every element is read and written exactly once. A row is
addressed as ``(r // n1) * s0 + (r % n1) * s1`` so that 2-D ``[tokens, hidden]`` and 3-D
``[tokens, heads, hidden]`` inputs with any leading strides share one kernel.
"""

import triton
import triton.language as tl


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
    eps,
    weight_bias,
    HAS_RESIDUAL: tl.constexpr,
    LAYERNORM: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    i0 = row // n1
    i1 = row % n1
    offs = tl.arange(0, BLOCK)
    mask = offs < hidden
    x = tl.load(x_ptr + i0 * sx0 + i1 * sx1 + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r_row = res_ptr + i0 * sr0 + i1 * sr1 + offs
        x += tl.load(r_row, mask=mask, other=0.0).to(tl.float32)
        tl.store(r_row, x.to(res_ptr.dtype.element_ty), mask=mask)
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32) + weight_bias
    if LAYERNORM:
        mean = tl.sum(x, axis=0) / hidden
        xc = tl.where(mask, x - mean, 0.0)
        rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=0) / hidden + eps)
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        y = xc * rstd * w + b
    else:
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / hidden + eps)
        y = x * rstd * w
    tl.store(out_ptr + i0 * so0 + i1 * so1 + offs, y.to(out_ptr.dtype.element_ty), mask=mask)


def launch_norm(x, residual, weight, bias, out, eps: float, weight_bias: float, layernorm: bool) -> None:
    """``x``, ``residual``, ``out``: 2-D or 3-D views with a contiguous last dimension, same shape."""
    hidden = x.shape[-1]
    if x.dim() == 2:
        rows, n1 = x.shape[0], 1
        sx = (x.stride(0), 0)
        so = (out.stride(0), 0)
        sr = (residual.stride(0), 0) if residual is not None else (0, 0)
    else:
        rows, n1 = x.shape[0] * x.shape[1], x.shape[1]
        sx = (x.stride(0), x.stride(1))
        so = (out.stride(0), out.stride(1))
        sr = (residual.stride(0), residual.stride(1)) if residual is not None else (0, 0)
    if rows == 0:
        return
    block = triton.next_power_of_2(hidden)
    num_warps = min(max(block // 512, 1), 16)
    _norm_kernel[(rows,)](
        x,
        residual if residual is not None else x,
        weight,
        bias if bias is not None else weight,
        out,
        n1,
        sx[0],
        sx[1],
        sr[0],
        sr[1],
        so[0],
        so[1],
        hidden,
        float(eps),
        float(weight_bias),
        HAS_RESIDUAL=residual is not None,
        LAYERNORM=layernorm,
        BLOCK=block,
        num_warps=num_warps,
    )
