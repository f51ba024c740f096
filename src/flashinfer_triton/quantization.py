"""Bit packing for masks (FlashInfer's ``flashinfer.quantization``)."""

from __future__ import annotations

import torch

from . import _checks as C
from ._backend import kernels_for

__all__ = ["packbits", "segment_packbits"]

_BITORDERS = ("big", "little")


def _impl(device):
    return kernels_for("quantization", device)


def _pack(bits: torch.Tensor, bitorder: str) -> torch.Tensor:
    n = bits.numel()
    padded = torch.zeros((n + 7) // 8 * 8, dtype=torch.uint8, device=bits.device)
    padded[:n] = bits.to(torch.uint8)
    weights = torch.tensor([128, 64, 32, 16, 8, 4, 2, 1], dtype=torch.uint8, device=bits.device)
    if bitorder == "little":
        weights = weights.flip(0)
    return (padded.reshape(-1, 8) * weights).sum(dim=1, dtype=torch.int32).to(torch.uint8)


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """Pack a 1-D bool tensor into bytes, as ``numpy.packbits`` (the last byte zero-padded).

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> fi.packbits(torch.tensor([1, 0, 1, 1, 0, 0, 0, 0, 1], dtype=torch.bool))
    tensor([176, 128], dtype=torch.uint8)
    """
    C.check_tensor("x", x, dim=1)
    C.check_choice("bitorder", bitorder, _BITORDERS)
    impl = _impl(x.device)
    if impl is not None:
        return impl.packbits(x, bitorder)
    return _pack(x != 0, bitorder)


def segment_packbits(x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big"):
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` on its own (each starts a new byte).

    Returns ``(packed, new_indptr)`` with ``new_indptr = cumsum(ceil(len / 8))`` (int32, on x's device);
    ``indptr`` may be int32 or int64.

    Examples
    --------
    >>> import torch, flashinfer_triton as fi
    >>> x = torch.tensor([1, 1, 0, 1, 1, 1, 1, 1, 1, 1], dtype=torch.bool)
    >>> fi.segment_packbits(x, torch.tensor([0, 3, 10], dtype=torch.int32))
    (tensor([192, 254], dtype=torch.uint8), tensor([0, 1, 2], dtype=torch.int32))
    """
    C.check_tensor("x", x, dim=1)
    indptr = C.as_int32_index("indptr", indptr)  # int64 too, as FlashInfer takes it
    C.check_index_tensor("indptr", indptr)
    C.check_choice("bitorder", bitorder, _BITORDERS)
    indptr_h = indptr.to("cpu", torch.int64)
    C.check_indptr_host("indptr", indptr_h)
    if int(indptr_h[-1]) > x.numel():
        raise C.value_error("indptr", f"indptr[-1] <= len(x) = {x.numel()}", int(indptr_h[-1]))
    impl = _impl(x.device)
    if impl is not None:
        return impl.segment_packbits(x, indptr, bitorder, indptr_host=indptr_h)
    lens = indptr_h[1:] - indptr_h[:-1]
    new_indptr = torch.zeros(lens.numel() + 1, dtype=torch.int64)
    new_indptr[1:] = torch.cumsum((lens + 7) // 8, 0)
    bits = x != 0
    pieces = [_pack(bits[int(indptr_h[i]) : int(indptr_h[i + 1])], bitorder) for i in range(lens.numel())]
    packed = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.uint8, device=x.device)
    return packed, new_indptr.to(torch.int32).to(x.device)
