"""Decode steps captured as CUDA graphs.

As mini-sglang does with FlashInfer: one ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper`` per captured
batch size, all built over the same fixed-address page-table buffers (``indptr``, ``indices``,
``last_page_len``). Before each replay the wrapper of the chosen size is planned again with the real
page tables (``plan()`` copies them into those buffers), and the step's token ids and positions are
copied into the graph's static inputs. A batch smaller than a captured size is padded with rows that
attend one slot of page 0, which the allocator never hands out.
"""

from __future__ import annotations

import time

import torch

from .attention import AttentionBackend, StepMeta, _csr
from .llama import LlamaModel


class DecodeGraphRunner:
    def __init__(self, model: LlamaModel, backend: AttentionBackend, batch_sizes: list[int]):
        if backend.device.type != "cuda":
            raise RuntimeError("DecodeGraphRunner: CUDA graphs need a CUDA device")
        self.model = model
        self.backend = backend
        self.batch_sizes = sorted(set(batch_sizes))
        lib, dev, pool = backend.lib, backend.device, backend.pool
        max_bs = self.batch_sizes[-1]
        self.max_batch_size = max_bs
        self.input_ids = torch.zeros(max_bs, dtype=torch.long, device=dev)
        self.positions = torch.zeros(max_bs, dtype=torch.int32, device=dev)
        self.batch_indices = torch.arange(max_bs, dtype=torch.int32, device=dev)
        self.indptr = torch.arange(max_bs + 1, dtype=torch.int32, device=dev)
        self.indices = torch.zeros(pool.num_pages, dtype=torch.int32, device=dev)
        self.last_page_len = torch.ones(max_bs, dtype=torch.int32, device=dev)
        self.wrappers: dict[int, object] = {}
        # host seconds spent per phase of run() (tables -> buffers, the library's plan(), graph launch)
        self.host_seconds = {"tables": 0.0, "plan": 0.0, "launch": 0.0, "steps": 0}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        mempool = torch.cuda.graph_pool_handle()
        for bs in reversed(self.batch_sizes):
            wrapper = lib.CUDAGraphBatchDecodeWithPagedKVCacheWrapper(
                backend.float_workspace,
                indptr_buffer=self.indptr[: bs + 1],
                indices_buffer=self.indices,
                last_page_len_buffer=self.last_page_len[:bs],
                kv_layout="NHD",
                use_tensor_cores=backend.use_tensor_cores,
            )
            self.wrappers[bs] = wrapper
            meta = self._prepare(bs, [[0]] * bs, [1] * bs, [0] * bs)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                for _ in range(2):
                    self._forward(bs, meta)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=mempool):
                self.outputs[bs] = self._forward(bs, meta)
            self.graphs[bs] = graph
        torch.cuda.synchronize()

    def _forward(self, bs: int, meta: StepMeta) -> torch.Tensor:
        return self.model.forward(self.input_ids[:bs], self.positions[:bs], self.backend, meta)

    def _prepare(self, bs: int, tables, seq_lens, tokens) -> StepMeta:
        """Fill the static inputs and re-plan the wrapper of size ``bs``."""
        b = self.backend
        t0 = time.perf_counter()
        indptr, indices, last = _csr(tables, seq_lens, b.pool.page_size)
        n = len(indices)
        self.indices[:n].copy_(indices, non_blocking=True)
        self.indptr[: bs + 1].copy_(indptr, non_blocking=True)
        self.last_page_len[:bs].copy_(last, non_blocking=True)
        self.input_ids[:bs].copy_(torch.tensor(tokens, dtype=torch.long), non_blocking=True)
        self.positions[:bs].copy_(torch.tensor(seq_lens, dtype=torch.int32) - 1, non_blocking=True)
        wrapper = self.wrappers[bs]
        t1 = time.perf_counter()
        wrapper.plan(
            indptr,
            self.indices[:n],
            last,
            b.num_qo_heads,
            b.num_kv_heads,
            b.head_dim,
            b.pool.page_size,
            pos_encoding_mode="NONE",
            q_data_type=b.dtype,
            kv_data_type=b.dtype,
            non_blocking=True,
        )
        b.plans += 1
        h = self.host_seconds
        h["tables"] += t1 - t0
        h["plan"] += time.perf_counter() - t1
        return StepMeta(
            wrapper,
            "graph-decode",
            self.indices,
            self.indptr[: bs + 1],
            self.last_page_len[:bs],
            self.batch_indices[:bs],
            self.positions[:bs],
        )

    def can_run(self, n: int) -> bool:
        return n <= self.max_batch_size

    def run(self, tables: list[list[int]], seq_lens: list[int], tokens: list[int]) -> torch.Tensor:
        """Logits ``[n, vocab]`` of one decode step; ``seq_lens`` count the token being decoded."""
        n = len(tables)
        bs = next(s for s in self.batch_sizes if s >= n)
        pad = bs - n
        self._prepare(bs, tables + [[0]] * pad, seq_lens + [1] * pad, tokens + [0] * pad)
        t0 = time.perf_counter()
        self.graphs[bs].replay()
        self.host_seconds["launch"] += time.perf_counter() - t0
        self.host_seconds["steps"] += 1
        return self.outputs[bs][:n]
