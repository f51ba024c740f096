"""Bit packing of boolean masks, equal to ``numpy.packbits`` (whole array or segment by segment).

Output byte ``j`` of a segment starting at element ``start`` holds elements ``start + 8j + k`` for
``k = 0..7`` (elements past the segment's end count as 0): bit ``7 - k`` of the byte for
``bitorder="big"``, bit ``k`` for ``"little"``. Any nonzero input element is a 1.
One program packs ``BLOCK`` output bytes from a ``[BLOCK, 8]`` tile of input elements.
"""

import triton
import triton.language as tl

from ._segments import segment_of


@triton.jit
def _pack_tile(x_ptr, offs_elem, mask_elem, BIG: tl.constexpr):
    """Pack a ``[BLOCK, 8]`` tile of element offsets into ``BLOCK`` bytes (int32 values 0..255)."""
    offs_bit = tl.arange(0, 8)
    b_x = tl.load(x_ptr + offs_elem, mask=mask_elem, other=0)  # [BLOCK, 8]
    bits = (b_x != 0).to(tl.int32)
    if BIG:
        shift = 7 - offs_bit
    else:
        shift = offs_bit
    return tl.sum(bits << shift[None, :], axis=1)  # [BLOCK]


@triton.jit
def _packbits_kernel(x_ptr, out_ptr, n, num_bytes, BLOCK: tl.constexpr, BIG: tl.constexpr):
    """Pack ``BLOCK`` consecutive output bytes of one flat array."""
    offs_byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    offs_elem = offs_byte[:, None] * 8 + tl.arange(0, 8)[None, :]  # [BLOCK, 8]
    byte = _pack_tile(x_ptr, offs_elem, offs_elem < n, BIG)
    tl.store(out_ptr + offs_byte, byte.to(tl.uint8), mask=offs_byte < num_bytes)


@triton.jit
def _segment_packbits_kernel(
    x_ptr,
    indptr_ptr,
    new_indptr_ptr,
    out_ptr,
    num_segments,
    num_bytes,
    num_steps,
    BLOCK: tl.constexpr,
    BIG: tl.constexpr,
):
    """Pack ``BLOCK`` consecutive output bytes; each byte finds its segment in ``new_indptr``."""
    offs_byte = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask_byte = offs_byte < num_bytes
    seg = segment_of(new_indptr_ptr, offs_byte, num_segments, num_steps)
    byte_start = tl.load(new_indptr_ptr + seg).to(tl.int64)
    elem_start = tl.load(indptr_ptr + seg).to(tl.int64)
    elem_end = tl.load(indptr_ptr + seg + 1).to(tl.int64)
    offs_elem = (elem_start + (offs_byte - byte_start) * 8)[:, None] + tl.arange(0, 8)[None, :]  # [BLOCK, 8]
    mask_elem = (offs_elem < elem_end[:, None]) & mask_byte[:, None]
    byte = _pack_tile(x_ptr, offs_elem, mask_elem, BIG)
    tl.store(out_ptr + offs_byte, byte.to(tl.uint8), mask=mask_byte)
