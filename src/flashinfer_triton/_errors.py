"""Device-side errors: bad indices that kernels found where checking them on the host would cost a sync.

A kernel that meets an index outside the tensor it addresses (a block-table entry past the cache, a length past the
block table, a slot past the cache) reads and writes nothing out of bounds, skips that work (its results are NaN or
unwritten) and records the first such error of the device in a small int32 tensor, ``[code, item, value, 0]``,
with an atomic compare-and-swap (later errors keep the first). :func:`check_errors` reads it (a sync), clears it and
raises a :class:`RuntimeError` describing it; the wrappers' ``plan()`` does the same for a pending error (only on a
device where such a kernel has run, and not while a CUDA graph is being captured).
"""

from __future__ import annotations

import torch

__all__ = ["check_errors"]

# code -> (what was wrong, the name of the item, the name of the value)
_CODES = {
    1: ("a block_tables entry outside the cache [0, num_blocks)", "sequence", "entry"),
    2: ("a seq_lens entry outside [0, block_tables.shape[1] * block_size]", "sequence", "seq_len"),
    3: (
        "a seq_lens entry beyond max_seq_len (paged_attention_v2 covers ceil(max_seq_len / 512) partitions)",
        "sequence",
        "seq_len",
    ),  # fmt: skip
    4: ("a slot_mapping entry outside the cache [0, num_blocks * block_size)", "token", "slot"),
    5: ("a block_mapping entry outside the cache [0, num_blocks)", "pair", "block"),
}
_FLAGS: dict = {}  # device -> int32 [4]


def error_flag(device: torch.device) -> torch.Tensor:
    """The device's error record (int32 ``[4]``, zero while no error is pending), created on first use."""
    t = _FLAGS.get(device)
    if t is None:
        t = _FLAGS[device] = torch.zeros(4, dtype=torch.int32, device=device)
    return t


def _describe(rec) -> str:
    code, item, value = int(rec[0]), int(rec[1]), int(rec[2])
    what, item_name, value_name = _CODES.get(code, (f"error code {code}", "item", "value"))
    return (
        f"flashinfer_triton: a kernel found {what} ({item_name} {item}, {value_name} {value}); the affected work was "
        "skipped (its outputs are NaN or unwritten) and nothing was read or written outside the tensors"
    )


def check_errors(device=None) -> None:
    """Raise a RuntimeError describing the first device-side error recorded since the last check (on ``device``, or
    on every device a checking kernel has run on), and clear it. A host sync when a record exists."""
    if device is None:
        devices = list(_FLAGS)
    else:
        dev = torch.device(device)
        if dev.type == "cuda" and dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        devices = [dev]
    for dev in devices:
        t = _FLAGS.get(dev)
        if t is None:
            continue
        rec = t.tolist()
        if rec[0] != 0:
            t.zero_()
            raise RuntimeError(_describe(rec))


def raise_pending() -> None:
    """``check_errors()`` for the wrappers' ``plan()``: free when no checking kernel has run, skipped while a CUDA
    graph is being captured (reading the record would sync inside the capture)."""
    if not _FLAGS:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    check_errors()
