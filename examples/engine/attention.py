"""The attention backend: FlashInfer's wrappers driven the way serving engines drive them.

* One float workspace (128 MiB on GPUs) is shared by every wrapper: the prefill, decode and cascade
  wrappers and the CUDA-graph decode wrappers. Steps run one after another on one stream, so they never
  need it at the same time.
* The prefill and decode wrappers also share one int workspace: the decode wrapper's
  ``_int_workspace_buffer`` is replaced by the prefill wrapper's, as mini-sglang does.
* ``plan()`` runs once per step, before the first layer; ``run()`` is then called by every layer with
  that plan. Page-table index arrays (``indptr``, ``last_page_len``) are planned from host tensors, the
  page indices from device tensors.
* New keys and values go into the paged pool through ``append_paged_kv_cache``; where each token goes
  comes from ``get_seq_lens`` and ``get_batch_indices_positions``, computed once per step.
* Requests that begin with the shared prefix (the chat template's system turn, held once in the pool)
  are attended through a two-level ``MultiLevelCascadeAttentionWrapper``: level 0 is the prefix's pages,
  read once for all the step's queries; level 1 is each request's own pages, causal.
* ``use_tensor_cores`` is set on the decode wrappers when the GQA group is 4 or more (mini-sglang's rule).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from .kv_cache import KVPool

FLOAT_WORKSPACE_BYTES_GPU = 128 * 1024 * 1024
FLOAT_WORKSPACE_BYTES_CPU = 16 * 1024 * 1024


@dataclass
class BatchLayout:
    """What one step attends over, described on the host.

    ``tables[i]`` is request ``i``'s full page list (shared prefix pages first), ``seq_lens[i]`` its KV
    length once this step's tokens are appended, ``extend_lens[i]`` how many tokens it appends now.
    ``shared_pages`` is the prefix's page list when every request of the step begins with it (then the
    step can use the cascade), else None.
    """

    tables: list[list[int]]
    seq_lens: list[int]
    extend_lens: list[int]
    shared_pages: list[int] | None = None

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens)

    @property
    def num_tokens(self) -> int:
        return sum(self.extend_lens)


@dataclass
class StepMeta:
    """Everything the layers need for one step, on the device (built once, used by every layer)."""

    wrapper: object
    kind: str  # "prefill", "decode", "cascade-prefill", "cascade-decode"
    kv_indices: torch.Tensor  # int32, full page tables concatenated
    kv_indptr: torch.Tensor  # int32 [B + 1]
    kv_last_page_len: torch.Tensor  # int32 [B]
    batch_indices: torch.Tensor  # int32 [nnz]: request of each new token
    positions: torch.Tensor  # int32 [nnz]: its position in the request (also its RoPE position)
    extras: dict = field(default_factory=dict)


def _csr(tables: list[list[int]], seq_lens: list[int], page_size: int):
    """(indptr, indices, last_page_len) as int32 CPU tensors."""
    indptr = [0]
    indices: list[int] = []
    last = []
    for pages, n in zip(tables, seq_lens, strict=True):
        used = -(-n // page_size)
        indices.extend(pages[:used])
        indptr.append(len(indices))
        last.append(n - (used - 1) * page_size if used else 0)
    as_i32 = lambda x: torch.tensor(x, dtype=torch.int32)
    return as_i32(indptr), as_i32(indices), as_i32(last)


class AttentionBackend:
    """Owns the workspaces and wrappers; turns a ``BatchLayout`` into a planned ``StepMeta``."""

    def __init__(
        self,
        lib,
        pool: KVPool,
        num_qo_heads: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        use_cascade: bool = True,
        cascade_decode: bool = False,
        backend: str = "fa2",
    ):
        self.lib = lib
        self.pool = pool
        self.device = pool.device
        self.num_qo_heads = num_qo_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.use_cascade = use_cascade
        self.cascade_decode = cascade_decode
        self.use_tensor_cores = num_qo_heads // num_kv_heads >= 4
        nbytes = FLOAT_WORKSPACE_BYTES_GPU if self.device.type == "cuda" else FLOAT_WORKSPACE_BYTES_CPU
        self.float_workspace = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
        self.prefill_wrapper = lib.BatchPrefillWithPagedKVCacheWrapper(
            self.float_workspace, kv_layout="NHD", backend=backend
        )
        self.decode_wrapper = lib.BatchDecodeWithPagedKVCacheWrapper(
            self.float_workspace, kv_layout="NHD", use_tensor_cores=self.use_tensor_cores, backend=backend
        )
        self.int_workspace = self.prefill_wrapper._int_workspace_buffer
        self.decode_wrapper._int_workspace_buffer = self.int_workspace
        self.cascade_wrapper = lib.MultiLevelCascadeAttentionWrapper(2, self.float_workspace, kv_layout="NHD")
        self.plans = 0  # plan() calls, for tests and statistics

    # ------------------------------------------------------------------ planning
    def _append_meta(self, layout: BatchLayout):
        """Device page table of the whole step and where each new token is written."""
        ps = self.pool.page_size
        indptr, indices, last = _csr(layout.tables, layout.seq_lens, ps)
        dev = self.device
        kv_indptr = indptr.to(dev, non_blocking=True)
        kv_indices = indices.to(dev, non_blocking=True)
        kv_last = last.to(dev, non_blocking=True)
        append_indptr = torch.zeros(layout.batch_size + 1, dtype=torch.int32)
        append_indptr[1:] = torch.cumsum(torch.tensor(layout.extend_lens, dtype=torch.int32), 0)
        seq_lens = self.lib.get_seq_lens(kv_indptr, kv_last, ps)
        batch_indices, positions = self.lib.get_batch_indices_positions(
            append_indptr.to(dev, non_blocking=True), seq_lens, layout.num_tokens
        )
        return indptr, indices, last, append_indptr, kv_indptr, kv_indices, kv_last, batch_indices, positions

    def plan(self, layout: BatchLayout, decode: bool) -> StepMeta:
        """Plan one step (prefill when ``decode`` is False) and build its ``StepMeta``."""
        ps = self.pool.page_size
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        (indptr, indices, last, qo_indptr, kv_indptr, kv_indices, kv_last, batch_indices, positions) = (
            self._append_meta(layout)
        )
        cascade = self.use_cascade and layout.shared_pages and (not decode or self.cascade_decode)
        if cascade:
            wrapper, kind = self.cascade_wrapper, "cascade-decode" if decode else "cascade-prefill"
            n_shared = len(layout.shared_pages)
            shared_len = n_shared * ps
            own_tables = [t[n_shared:] for t in layout.tables]
            own_lens = [n - shared_len for n in layout.seq_lens]
            o_indptr, o_indices, o_last = _csr(own_tables, own_lens, ps)
            total_q = layout.num_tokens
            level0 = (
                torch.tensor([0, total_q], dtype=torch.int32),
                torch.tensor([0, n_shared], dtype=torch.int32),
                torch.tensor(layout.shared_pages, dtype=torch.int32).to(self.device),
                torch.tensor([ps], dtype=torch.int32),
            )
            level1 = (qo_indptr, o_indptr, o_indices.to(self.device), o_last)
            wrapper.plan(
                [level0[0], level1[0]],
                [level0[1], level1[1]],
                [level0[2], level1[2]],
                [level0[3], level1[3]],
                hq,
                hkv,
                d,
                ps,
                causal=True,
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
            )
        elif decode:
            wrapper, kind = self.decode_wrapper, "decode"
            wrapper.plan(
                indptr,
                kv_indices,
                last,
                hq,
                hkv,
                d,
                ps,
                pos_encoding_mode="NONE",
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                non_blocking=True,
            )
        else:
            wrapper, kind = self.prefill_wrapper, "prefill"
            wrapper.plan(
                qo_indptr,
                indptr,
                kv_indices,
                last,
                hq,
                hkv,
                d,
                ps,
                causal=True,
                pos_encoding_mode="NONE",
                q_data_type=self.dtype,
                kv_data_type=self.dtype,
                non_blocking=True,
            )
        self.plans += 1
        return StepMeta(wrapper, kind, kv_indices, kv_indptr, kv_last, batch_indices, positions)

    # ------------------------------------------------------------------ per layer
    def append_kv(self, layer: int, k: torch.Tensor, v: torch.Tensor, meta: StepMeta) -> None:
        """Write this step's keys and values ``[nnz, Hkv, D]`` into the pool's pages."""
        self.lib.append_paged_kv_cache(
            k,
            v,
            meta.batch_indices,
            meta.positions,
            self.pool.cache(layer),
            meta.kv_indices,
            meta.kv_indptr,
            meta.kv_last_page_len,
            kv_layout="NHD",
        )

    def forward(self, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: StepMeta):
        """Append ``k, v`` and attend ``q [nnz, Hq, D]`` with the step's plan; returns ``[nnz, Hq, D]``."""
        self.append_kv(layer, k, v, meta)
        return meta.wrapper.run(q, self.pool.attention_cache(layer))
