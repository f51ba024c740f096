"""Elementwise math shared by the attention kernels, written without libdevice.

``tanh``: the soft cap's tanh, through ``exp2`` (or the hardware approximation, compiled for NVIDIA).

``cos_sin``: accurate float32 cosine and sine for RoPE angles (``position x frequency``, up to ~1e6
radians). libdevice's ``cos``/``sin`` (and ``tl.cos``/``tl.sin``, which lower to them) are accurate too,
but linking and optimising them tripled the compile time of a RoPE kernel variant (decode: 1.7 s ->
4.7-5.2 s for sm_90, measured offline), which is a serving engine's first call of that variant.

Method: ``angle = q * pi/2 + t`` with ``q = round(angle * 2/pi)`` and ``pi/2`` split into four float32
parts (Cody-Waite), the first three with at most 7 significant bits, so each ``q * part`` is exact in
float32 for ``|q| < 2^17`` (``|angle|`` up to ~2e5) even without a fused multiply-add (Triton's
interpreter has none); compiled, the FMAs make the products exact for any angle. ``|t| <= pi/4``; then
degree-9 (sine) / degree-12 (cosine) polynomials of ``t`` (Taylor coefficients, truncation error below
1e-9 there), and the quadrant ``q mod 4`` picks and signs them. Largest error against float64 on random
angles (numpy emulation): 8.6e-8 up to 1e6 with FMAs, the same up to 1.9e5 without (float32 libm: 7e-8).
"""

from __future__ import annotations

import triton
import triton.language as tl

# pi/2 = 1.5625 + 0.0081787109375 + 0.00011730194091796875 + 3.1391647326017846e-07 (the first three with
# <= 7 significant bits, the last the float32 rest); 2/pi = 0.6366197723675814. Literals in the kernel, not
# global constexprs: Triton compares every global a kernel used on each of its launches (host time).


@triton.jit
def cos_sin(angle):
    """(cos(angle), sin(angle)) in float32, elementwise."""
    q = tl.floor(angle * 0.6366197723675814 + 0.5)
    t = tl.fma(q, -1.5625, angle)
    t = tl.fma(q, -0.0081787109375, t)
    t = tl.fma(q, -0.00011730194091796875, t)
    t = tl.fma(q, -3.1391647326017846e-07, t)
    t2 = t * t
    s = t + t * t2 * (
        -0.16666666641626524 + t2 * (0.008333329385889463 + t2 * (-0.00019839334836096632 + t2 * 2.718311493989822e-06))
    )
    c = 1.0 + t2 * (
        -0.5
        + t2
        * (
            0.041666666666666664
            + t2 * (-0.001388888888887411 + t2 * (2.4801587289476729e-05 + t2 * -2.7557314351390663e-07))
        )
    )
    quad = q.to(tl.int32) & 3
    sin_v = tl.where(quad == 0, s, tl.where(quad == 1, c, tl.where(quad == 2, -s, -c)))
    cos_v = tl.where(quad == 0, c, tl.where(quad == 1, -s, tl.where(quad == 2, -c, s)))
    return cos_v, sin_v


@triton.jit
def tanh(x, APPROX: tl.constexpr = False):
    """tanh(x) in float32, elementwise (the logits soft cap ``cap * tanh(s / cap)``).

    Default: ``1 - 2 / (2^(2x log2 e) + 1)``, written with ``exp2`` so the interpreter (no libdevice) runs the same
    code; it saturates to exactly +-1 (``2^x`` reaches inf or 0, never NaN). ``APPROX``: one ``tanh.approx.f32``
    (NVIDIA, sm_75+; relative error about 2^-11, the instruction FlashInfer's soft cap uses), one MUFU operation
    where the default takes two (``ex2`` and the reciprocal): the Gluon Hopper kernels, whose softmax is bound by
    that unit, use it; compiled for NVIDIA only (no interpreter path). Gluon kernels call this ``@triton.jit``
    helper as they call the merge helpers: a callee is compiled in its caller's dialect."""
    if APPROX:
        return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32, is_pure=True, pack=1)
    else:
        e = tl.exp2(x * 2.8853900817779268)  # 2 log2(e)
        return 1.0 - 2.0 / (e + 1.0)


# The merge of attention states (output v_k, base-2 lse s_k): m = max_k s_k, w_k = 2^(s_k - m),
# v = sum_k w_k v_k / sum_k w_k, s = m + log2(sum_k w_k). Every merge of the library, the merge kernels and the
# merges fused into the attention kernels, goes through these three helpers, so an empty state (s = -inf)
# weighs nothing and a row of empty states gives v = 0, s = -inf (never NaN) in every one of them.


@triton.jit
def max_finite(m):
    """The states' maximum lse with -inf (no state with a key) replaced by 0: ``exp2(s - m)`` is then 0, not NaN."""
    return tl.where(m == float("-inf"), 0.0, m)


@triton.jit
def weighted(v, w):
    """``w * v`` with weightless entries (w == 0: an empty state) selected away, never multiplied in: an empty
    state's values may be garbage, NaN included."""
    return tl.where(w > 0, w * v, 0.0)


@triton.jit
def finish_state(acc, den, m, ROW_VECTORS: tl.constexpr = True):
    """(acc / den, m + log2(den)) for ``acc [rows, D]`` and ``den, m [rows]`` (``ROW_VECTORS``) or ``[rows, 1]``
    (the lse is then ``[rows, 1]`` too); rows with den == 0 give (0, -inf). One reciprocal per row, then a
    multiply per value. Layout-free (no new tensor): Gluon kernels call it too."""
    has = den > 0
    safe = tl.where(has, den, 1.0)
    if ROW_VECTORS:
        inv = (1.0 / safe)[:, None]
    else:
        inv = 1.0 / safe
    return acc * inv, tl.where(has, m + tl.log2(safe), float("-inf"))
