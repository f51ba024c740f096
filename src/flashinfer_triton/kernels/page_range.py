"""The range (smallest and largest entry) of device page indices, written into pinned host memory by one launch.

An eager plan() over page indices on the device must not wait for the device, yet run() must refuse an index
outside the cache before any kernel reads it. The plan therefore queues this reduction and reads its result at the
first run(). One launch replaces torch's min/max kernel, the device-to-host copy of its result and the event after
it (four torch / CUDA runtime calls of ~5-15 us of host time each): each program reduces ``BLOCK * ITERS`` entries
into a device accumulator ``acc [lo, hi, count, 0]`` with atomics, and the last program to finish writes the range
to ``out`` (pinned host memory, which the device addresses directly) and resets the accumulator for the next plan.

Each of the two 8-byte words of ``out`` holds the plan's sequence number in its high half and the value (int32) in
its low half, so the host knows, word by word and without an event, whether this plan's values have landed.
"""

from __future__ import annotations

import triton
import triton.language as tl


# ``n`` and ``seq`` change with every plan (with the indices' address): not specialized, so one bound launch serves
# every plan of a wrapper.
@triton.jit(do_not_specialize=["n", "seq"])
def _page_range_kernel(idx_ptr, n, seq, acc_ptr, out_ptr, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    lo = tl.full([BLOCK], 2147483647, tl.int32)
    hi = tl.full([BLOCK], -2147483647 - 1, tl.int32)
    base = pid.to(tl.int64) * (BLOCK * ITERS)
    for i in range(ITERS):
        o = base + i * BLOCK + offs
        m = o < n
        x = tl.load(idx_ptr + o, mask=m, other=0)
        lo = tl.minimum(lo, tl.where(m, x, 2147483647))
        hi = tl.maximum(hi, tl.where(m, x, -2147483647 - 1))
    tl.atomic_min(acc_ptr, tl.min(lo, axis=0))
    tl.atomic_max(acc_ptr + 1, tl.max(hi, axis=0))
    done = tl.atomic_add(acc_ptr + 2, 1)  # (acq_rel: every program's min / max is visible to the last one)
    if done == tl.num_programs(0) - 1:
        r_lo = tl.atomic_xchg(acc_ptr, 2147483647)
        r_hi = tl.atomic_xchg(acc_ptr + 1, -2147483647 - 1)
        tl.atomic_xchg(acc_ptr + 2, 0)
        tag = seq.to(tl.int64) << 32
        tl.store(out_ptr, tag | (r_lo.to(tl.int64) & 0xFFFFFFFF))
        tl.store(out_ptr + 1, tag | (r_hi.to(tl.int64) & 0xFFFFFFFF))
