"""Gated activations ``act(x[..., :H]) * x[..., H:]`` for SiLU, exact (erf) GELU and tanh GELU.

A program handles a tile of ``ROWS`` rows by ``BLOCK`` columns: it loads the gate half and the up half
once, computes in float32 and stores once, so the kernel moves exactly ``3 * H`` elements per row. Rows
are addressed by stride, so a non-contiguous leading layout costs nothing. The tile is chosen to divide
the width where it can (``EVEN``: no masks); small calls take one row a program and few elements a thread
(many programs for few rows), large ones several rows a program and 16-byte accesses several times a
thread (more bytes in flight a thread, fewer programs): ``ActivationConfig.layout``.
The divisions are the fast (approximate, 2 ulp) float32 ones: the result is rounded to the storage
dtype, and the IEEE division's slow path would lengthen a kernel that lasts a few microseconds.
"""

import triton
import triton.language as tl

from .. import _config
from .._launch import FastKernel
from ._row_forms import BoundForms

ACTIVATIONS = {"silu": 0, "gelu": 1, "gelu_tanh": 2}


@triton.jit(do_not_specialize=["rows"])
def _act_and_mul_kernel(
    x_ptr,
    out_ptr,
    rows,
    hidden,
    sx,
    so,
    ACT: tl.constexpr,
    EVEN: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK: tl.constexpr,
    PDL: tl.constexpr,
):
    """``ROWS`` rows by ``BLOCK`` columns of ``act(gate) * up``."""
    offs_r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    offs_c = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    x_ptrs = x_ptr + offs_r.to(tl.int64)[:, None] * sx + offs_c[None, :]  # [ROWS, BLOCK]
    o_ptrs = out_ptr + offs_r.to(tl.int64)[:, None] * so + offs_c[None, :]  # [ROWS, BLOCK]
    if PDL:
        tl.extra.cuda.gdc_wait()
    if EVEN:
        b_g = tl.load(x_ptrs).to(tl.float32)
        b_u = tl.load(x_ptrs + hidden).to(tl.float32)
    else:
        mask = (offs_r[:, None] < rows) & (offs_c[None, :] < hidden)
        b_g = tl.load(x_ptrs, mask=mask, other=0.0).to(tl.float32)
        b_u = tl.load(x_ptrs + hidden, mask=mask, other=0.0).to(tl.float32)
    if ACT == 0:
        b_a = tl.fdiv(b_g, 1.0 + tl.exp(-b_g))
    elif ACT == 1:
        b_a = 0.5 * b_g * (1.0 + tl.math.erf(b_g * 0.7071067811865476))
    else:
        # tanh(y) = 1 - 2 / (exp(2y) + 1): exact at both tails, no libdevice tanh needed.
        b_y = 0.7978845608028654 * (b_g + 0.044715 * b_g * b_g * b_g)
        b_a = 0.5 * b_g * (2.0 - tl.fdiv(2.0, tl.exp(2.0 * b_y) + 1.0))
    b_out = (b_a * b_u).to(out_ptr.dtype.element_ty)
    if EVEN:
        tl.store(o_ptrs, b_out)
    else:
        tl.store(o_ptrs, b_out, mask=mask)
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()


# The leading arguments a bound launch takes per call: the two tensors and the row count (``rows`` is not
# specialised, so one compiled kernel serves every count of a layout).
_act_forms = BoundForms(FastKernel(_act_and_mul_kernel), 3, "activation")


def form_key(form, layout: tuple) -> tuple:
    """The key a checked call form's launch is kept under: the form and the layout its row count takes
    (``ActivationConfig.layout``: a tile or warp count another configuration gives is another launch)."""
    return (*form, layout)


def launch_act_and_mul(x2d, out2d, act: str, pdl: bool = False, cfg=None, form=None) -> None:
    """``x2d``: ``[rows, 2H]``, ``out2d``: ``[rows, H]``, both with a contiguous last dimension. ``pdl``: launched
    as a programmatic dependent launch (sm_90+ compiled kernels only). The tile is ``cfg.layout(rows, H)``. ``form``:
    the caller's key of this call form, which must fix every argument here but the tensors' addresses and the number
    of rows (the public functions' checked forms, ``_row_forms``); the launch is kept under it with the layout the
    row count gives (``form_key``). None: the key of the arguments themselves."""
    cfg = cfg or _config.ACTIVATION
    rows, hidden = out2d.shape
    if rows == 0 or hidden == 0:
        return
    layout = cfg.layout(rows, hidden)
    tile_rows, block, even, warps = layout
    grid = (_config.cdiv(rows, tile_rows), _config.cdiv(hidden, block))
    sx, so = x2d.stride(0), out2d.stride(0)
    args = (x2d, out2d, rows, hidden, sx, so, ACTIVATIONS[act], even, tile_rows, block, bool(pdl))
    opts = {"num_warps": warps, "launch_pdl": True} if pdl else {"num_warps": warps}
    if rows >= 1 << 31:  # an int64 row count compiles another kernel, which no form binds
        _act_forms.fast.run(*args, grid=grid, warmup=False, **opts)
        return
    form = (grid[1], args[3:], x2d.dtype, out2d.dtype, warps) if form is None else form_key(form, layout)
    _act_forms.launch(form, args, grid, **opts)
