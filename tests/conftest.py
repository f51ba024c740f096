"""Shared test fixtures: the device, NaN poisoning, tolerances, and a comparison that shows the worst element."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")
HAS_CUDA = torch.cuda.is_available()
# The one test device: CUDA when present, else the CPU (where kernels run in the interpreter under
# TRITON_INTERPRET=1). Tests take it as the ``device`` fixture, or import it for module-level parameters.
DEVICE = torch.device("cuda" if HAS_CUDA else "cpu")

# Absolute/relative tolerances against the float32 reference, by the dtype of the output.
TOLERANCES = {
    torch.float32: (2e-4, 2e-4),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
LSE_TOL = (2e-3, 2e-3)


def pytest_collection_modifyitems(config, items):
    for item in items:
        if "gpu" in item.keywords and not HAS_CUDA:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA device (runs on the GPU machine)"))
        elif "interpret" in item.keywords and not (HAS_CUDA or INTERPRET):
            item.add_marker(pytest.mark.skip(reason="Triton kernels need CUDA or TRITON_INTERPRET=1"))


@pytest.fixture
def device() -> torch.device:
    """``DEVICE``: CUDA when present, else the CPU (where kernels run in the interpreter under TRITON_INTERPRET=1)."""
    return DEVICE


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def poison(x: torch.Tensor) -> torch.Tensor:
    """Fill with NaN so that any element a kernel forgets to write fails the comparison."""
    if x.is_floating_point():
        x.fill_(float("nan"))
    return x


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol=None, rtol=None, name="output"):
    """allclose with NaN never passing, -inf matched exactly, and the worst element reported."""
    if atol is None or rtol is None:
        atol, rtol = TOLERANCES.get(actual.dtype, TOLERANCES[torch.float16])
    a = actual.detach().float().cpu()
    e = expected.detach().float().cpu()
    assert a.shape == e.shape, f"{name}: shape {tuple(a.shape)} != expected {tuple(e.shape)}"
    assert not torch.isnan(a).any(), f"{name}: NaN at {torch.isnan(a).nonzero()[0].tolist()} (unwritten or NaN math)"
    # a NaN in the reference would make the worst-element search below pick it and pass every other element
    assert not torch.isnan(e).any(), f"{name}: the expected value has NaN at {torch.isnan(e).nonzero()[0].tolist()}"
    inf_e = torch.isinf(e)
    if inf_e.any() or torch.isinf(a).any():
        mismatch = inf_e != torch.isinf(a)
        mismatch |= inf_e & (torch.sign(a) != torch.sign(e))
        if mismatch.any():
            idx = mismatch.nonzero()[0].tolist()
            raise AssertionError(f"{name}: inf mismatch at {idx}: got {a[tuple(idx)]}, expected {e[tuple(idx)]}")
        a = torch.where(inf_e, torch.zeros_like(a), a)
        e = torch.where(inf_e, torch.zeros_like(e), e)
    err = (a - e).abs() - rtol * e.abs()
    worst = int(err.reshape(-1).argmax()) if err.numel() else 0
    if err.numel() and float(err.reshape(-1)[worst]) > atol:
        idx = list(torch.unravel_index(torch.tensor(worst), a.shape)) if a.dim() else []
        idx = [int(i) for i in idx]
        raise AssertionError(
            f"{name}: max error beyond atol={atol}, rtol={rtol} at {idx}: got {a.reshape(-1)[worst]:.6g}, "
            f"expected {e.reshape(-1)[worst]:.6g} (|diff| = {abs(a.reshape(-1)[worst] - e.reshape(-1)[worst]):.3g})"
        )


def assert_close_named(name: str, actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float = 0.0):
    """``assert_close`` with the name first and explicit tolerances (the kernel tests' order)."""
    assert_close(actual, expected, atol, rtol, name=name)
