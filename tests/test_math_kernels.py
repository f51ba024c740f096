"""``kernels/_math.cos_sin`` (RoPE's cosine and sine without libdevice) against float64, in the kernel."""

from __future__ import annotations

import math

import pytest
import torch
import triton
import triton.language as tl

from conftest import DEVICE
from flashinfer_triton._backend import use_triton
from flashinfer_triton.kernels._math import cos_sin

needs_triton = pytest.mark.skipif(not use_triton(DEVICE), reason="needs CUDA or TRITON_INTERPRET=1")


@triton.jit
def _cos_sin_kernel(x_ptr, c_ptr, s_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    c, s = cos_sin(tl.load(x_ptr + offs, mask=mask, other=0.0))
    tl.store(c_ptr + offs, c, mask=mask)
    tl.store(s_ptr + offs, s, mask=mask)


@pytest.mark.interpret
@needs_triton
@pytest.mark.parametrize("limit", [4.0, 1e3, 1.9e5])
def test_cos_sin_matches_float64(limit):
    gen = torch.Generator().manual_seed(int(limit))
    n = 4096
    x = (torch.rand(n, generator=gen, dtype=torch.float64) * 2 - 1) * limit
    # every quadrant boundary region and exact multiples of pi/2 near the ends of the range
    k = torch.arange(-8, 8, dtype=torch.float64)
    edges = torch.cat([k * math.pi / 2, k * math.pi / 2 + 1e-4, (limit // (math.pi / 2)) * math.pi / 2 - k])
    x = torch.cat([x, edges]).to(torch.float32)
    c = torch.full_like(x, float("nan"))
    s = torch.full_like(x, float("nan"))
    xd, cd, sd = x.to(DEVICE), c.to(DEVICE), s.to(DEVICE)
    _cos_sin_kernel[(triton.cdiv(x.numel(), 1024),)](xd, cd, sd, x.numel(), BLOCK=1024)
    want = x.double()
    err_c = (cd.cpu().double() - torch.cos(want)).abs().max().item()
    err_s = (sd.cpu().double() - torch.sin(want)).abs().max().item()
    # float32 libm is within ~7e-8 of float64 here; allow 2e-7 (a wrong quadrant or reduction is O(1))
    assert err_c < 2e-7 and err_s < 2e-7, (err_c, err_s)
