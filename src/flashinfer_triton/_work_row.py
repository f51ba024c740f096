"""The prefill work list's row: one definition for the plans that write it (``_prefill_impl.plan``, the fused
cascade plan in ``cascade``) and the kernels that read it (``kernels/prefill.py``, ``kernels/prefill_sm90.py``,
``kernels/prefill_sm90_persist.py``).

A row is one work item (a query tile, or a piece of its KV range) as ``WORK_FIELDS`` int32:

0 request, 1 first token, 2 KV start, 3 KV end, 4 partial row (-1: the item writes the output), 5 partial stride
(the tile's pieces), 6 (unused, 0), 7 the tile's first partial row, then, from ``REQ_AT``, its request's scalars:
8 first query row (``qo_indptr[b]``), 9 queries (``qo_indptr[b + 1] - qo_indptr[b]``), 10 keys (``kv_lens[b]``),
11 first K/V row, or first page-table entry when paged (``kv_indptr[b]``).

The request's scalars ride in the row so that a program's first loads (its row) give everything its first TMA
copies need: reading them from the batch's index arrays instead put one more dependent global-memory round trip
(row, then ``qo_indptr[b]``) ahead of every program's first data load.
"""

WORK_FIELDS = 12
REQ_AT = 8
