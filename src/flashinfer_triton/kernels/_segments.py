"""Which segment of a CSR array an offset falls in, searched on the device.

A CSR ``indptr`` (``indptr[0] = 0``, non-decreasing) cuts ``[0, indptr[-1])`` into segments. Each offset finds
its segment by a branch-free binary search (the largest ``s`` with ``indptr[s] <= offset``), so one launch covers
every offset whatever the spread of segment lengths: the page kernels map appended tokens to their requests with
it, the bit-packing kernels output bytes to their segments.
"""

import triton
import triton.language as tl


@triton.jit
def segment_of(indptr_ptr, offs, num_segments, num_steps):
    """Largest ``s`` in ``[0, num_segments)`` with ``indptr[s] <= offs`` (``indptr[0] <= offs`` assumed)."""
    lo = tl.zeros_like(offs)
    size = num_segments
    # Each step halves the candidate range [lo, lo + size); indptr[mid] is always in bounds.
    for _ in range(num_steps):
        half = size // 2
        mid = lo + half
        b_start = tl.load(indptr_ptr + mid).to(tl.int64)
        lo = tl.where(b_start <= offs, mid, lo)
        size = size - half
    return lo


def segment_steps(num_segments: int) -> int:
    """The ``num_steps`` that ``segment_of`` needs to shrink ``num_segments`` candidates to one (host side)."""
    return max(int(num_segments - 1).bit_length(), 0) + 1
