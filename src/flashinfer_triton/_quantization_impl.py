"""Device implementations of the bit-packing helpers (Triton kernels in ``kernels/packbits.py``).

The public module (``quantization.py``) validates the arguments and calls these functions when the tensors are
on CUDA, or on the CPU under ``TRITON_INTERPRET=1``. One program per block of output bytes. Nothing here
synchronizes with the host, with one exception documented on ``segment_packbits`` (an output size that only the
device knows).
"""

from __future__ import annotations

import torch
import triton

from . import _config
from .kernels._segments import segment_steps
from .kernels.packbits import _packbits_kernel, _segment_packbits_kernel

__all__ = ["packbits", "segment_packbits"]


def _flat_input(x: torch.Tensor) -> torch.Tensor:
    """``x`` flattened with unit stride (the kernels read it so); bool becomes its uint8 view (no copy when
    already contiguous: ``reshape`` alone keeps a 1-D view's stride)."""
    x = x.reshape(-1).contiguous()
    if x.dtype == torch.bool:
        x = x.view(torch.uint8)
    return x


def packbits(x: torch.Tensor, bitorder: str = "big") -> torch.Tensor:
    """``numpy.packbits(x, bitorder=...)`` of a flat tensor (nonzero = 1): uint8 ``[ceil(n / 8)]``."""
    x = _flat_input(x)
    n = x.numel()
    num_bytes = (n + 7) // 8
    out = torch.empty(num_bytes, dtype=torch.uint8, device=x.device)
    if num_bytes == 0:
        return out
    block = _config.QUANTIZATION.pack_block
    grid = (triton.cdiv(num_bytes, block),)
    _packbits_kernel[grid](x, out, n, num_bytes, BLOCK=block, BIG=bitorder == "big", num_warps=4)
    return out


def segment_packbits(
    x: torch.Tensor, indptr: torch.Tensor, bitorder: str = "big", indptr_host: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pack each segment ``x[indptr[i]:indptr[i+1]]`` on its own; returns ``(packed, new_indptr)``.

    ``new_indptr = [0, cumsum(ceil(len_i / 8))]``, int32 on ``x``'s device (the public layer's
    contract; FlashInfer puts it on ``indptr``'s device, the same one whenever the two agree).
    The output must be allocated with its exact size ``new_indptr[-1]``. With a host copy of the offsets
    (``indptr`` itself on the CPU, or ``indptr_host``: the copy the caller already read for its checks) it
    is computed there and nothing is read from the device: both indptrs go over in one host-to-device
    copy. Only a device ``indptr`` without ``indptr_host`` costs one device-to-host read of that number,
    as in FlashInfer.
    """
    x = _flat_input(x)
    batch_size = indptr.shape[0] - 1
    host = indptr_host if indptr_host is not None else (indptr if indptr.device.type == "cpu" else None)
    if host is not None:
        host = host.to(torch.int64)
        both = torch.zeros(2 * (batch_size + 1), dtype=torch.int64)
        both[: batch_size + 1] = host
        if batch_size > 0:
            torch.cumsum((host[1:] - host[:-1] + 7) // 8, dim=0, out=both[batch_size + 2 :])
        num_bytes = int(both[-1])
        both = both.to(device=x.device, dtype=torch.int32)
        indptr_dev, new_indptr = both[: batch_size + 1], both[batch_size + 1 :]
    else:
        seg_lens = (indptr[1:] - indptr[:-1]).to(torch.int64)
        new_indptr = torch.zeros(batch_size + 1, dtype=torch.int64, device=indptr.device)
        if batch_size > 0:
            torch.cumsum((seg_lens + 7) // 8, dim=0, out=new_indptr[1:])
        num_bytes = int(new_indptr[-1])  # the one device-to-host read
        new_indptr = new_indptr.to(device=x.device, dtype=torch.int32)
        indptr_dev = indptr.to(x.device)
    out = torch.empty(num_bytes, dtype=torch.uint8, device=x.device)
    if num_bytes == 0:
        return out, new_indptr
    grid = (triton.cdiv(num_bytes, _config.QUANTIZATION.pack_block),)
    _segment_packbits_kernel[grid](
        x,
        indptr_dev,
        new_indptr,
        out,
        batch_size,
        num_bytes,
        segment_steps(batch_size),
        BLOCK=_config.QUANTIZATION.pack_block,
        BIG=bitorder == "big",
        num_warps=4,
    )
    return out, new_indptr
