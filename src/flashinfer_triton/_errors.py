"""Device-side errors: bad indices that kernels found where checking them on the host would cost a sync.

A kernel that meets an index outside the tensor it addresses (a block-table entry past the cache, a length past the
block table, a slot past the cache, an appended token's batch index, position or page out of range) reads and
writes nothing out of bounds, skips that work (its results are NaN or unwritten) and records the first such error
of the device in a small int32 tensor, ``[code, item, value, 0]``, with an atomic compare-and-swap (later errors
keep the first).

Reading the record:

* :func:`check_errors` reads it now (a sync when a checking kernel has run on a GPU), clears it and raises a
  :class:`RuntimeError` describing it.
* The wrappers' ``plan()`` never waits for the device. Each time it runs after a checking kernel was launched
  (:func:`error_flag` marks the device), it enqueues a copy of the record into a pinned host buffer and an event
  behind it; a later ``plan()`` that finds the event complete reads the copy and raises a pending error (and
  clears the record). A record on the CPU (the interpreter) is read at once. While a CUDA graph is being captured
  nothing is enqueued or read.
"""

from __future__ import annotations

import threading

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
    6: ("an append_paged_kv_cache batch_indices entry outside [0, batch_size)", "token", "batch index"),
    7: (
        "an append_paged_kv_cache positions entry outside its request's pages (kv_indptr) or past kv_indices",
        "token",
        "position",
    ),  # fmt: skip
    8: ("an append_paged_kv_cache kv_indices entry outside the cache [0, num_pages)", "token", "page"),
}
_FLAGS: dict = {}  # device -> int32 [4]
_DIRTY: set = set()  # devices whose record a kernel may have written since plan() last enqueued its read
_READS: dict = {}  # device -> (pinned int32 [4] host copy, CUDA event after the copy): reads in flight
_PINNED: dict = {}  # device -> the pinned host buffer its reads land in


def lasting_zeros(n: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled tensor the library keeps for the life of the process (an error record, a stand-in pointer),
    allocated outside any CUDA-graph memory pool.

    Under ``torch.compile(mode="reduce-overhead")`` the warm-up and recorded runs of a compiled function route
    every allocation of the calling thread into the graph's pool (whatever the stream), and a tensor kept from there
    outlives the graph's outputs: Inductor then refuses the pool. The allocation is therefore made by a short-lived
    thread of its own, whose allocations the pool does not take. While the current stream is being captured the
    allocation stays on it (a capture may not wait for other work), so it comes from that graph's pool and lives as
    long as the tensor."""
    if device.type != "cuda" or torch.cuda.is_current_stream_capturing():
        return torch.zeros(n, dtype=dtype, device=device)
    index = device.index if device.index is not None else torch.cuda.current_device()
    got: list = []

    def make() -> None:
        try:
            with torch.cuda.device(index):
                t = torch.zeros(n, dtype=dtype, device=torch.device("cuda", index))
                torch.cuda.current_stream(index).synchronize()  # filled before any stream of the caller reads it
            got.append(t)
        except BaseException as e:  # raised again in the caller's thread
            got.append(e)

    worker = threading.Thread(target=make, name="flashinfer_triton-lasting-alloc", daemon=True)
    worker.start()
    worker.join()
    if not got:
        raise RuntimeError(f"flashinfer_triton: allocating a lasting [{n}] {dtype} tensor on {device} failed")
    if isinstance(got[0], BaseException):
        raise got[0]
    return got[0]


def error_flag(device: torch.device) -> torch.Tensor:
    """The device's error record (int32 ``[4]``, zero while no error is pending), created on first use. Called by
    every launch of a checking kernel: it marks the device for the next ``plan()``'s read."""
    t = _FLAGS.get(device)
    if t is None:
        t = _FLAGS[device] = lasting_zeros(4, torch.int32, device)
    _DIRTY.add(device)
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
    on every device a checking kernel has run on), and clear it. A host sync when a record exists on a GPU."""
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
        _READS.pop(dev, None)  # this read covers whatever an enqueued one would have seen
        _DIRTY.discard(dev)
        rec = t.tolist()
        if rec[0] != 0:
            t.zero_()
            raise RuntimeError(_describe(rec))


def raise_pending() -> None:
    """The wrappers' ``plan()``: raise an error whose asynchronous read has completed, and enqueue a read of every
    record a kernel may have written since. Never waits for the device; free while no checking kernel has run."""
    if not _DIRTY and not _READS:
        return
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        return
    for dev, (host, event) in list(_READS.items()):
        if event.query():
            del _READS[dev]
            if int(host[0]) != 0:
                rec = host.tolist()
                _FLAGS[dev].zero_()  # stream-ordered: behind every kernel launched so far
                raise RuntimeError(_describe(rec))
    for dev in list(_DIRTY):
        if dev in _READS:  # a read in flight: the next one is enqueued once it has been seen
            continue
        _DIRTY.discard(dev)
        t = _FLAGS[dev]
        if dev.type != "cuda":  # host memory: reading it costs nothing
            rec = t.tolist()
            if rec[0] != 0:
                t.zero_()
                raise RuntimeError(_describe(rec))
            continue
        host = _PINNED.get(dev)
        if host is None:
            host = _PINNED[dev] = torch.zeros(4, dtype=torch.int32, pin_memory=True)
        with torch.cuda.device(dev):
            host.copy_(t, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        _READS[dev] = (host, event)
