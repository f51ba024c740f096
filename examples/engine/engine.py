"""The engine: scheduler + paged KV pool + attention backend + Llama forward + sampling."""

from __future__ import annotations

import gc
import importlib
import time
from dataclasses import dataclass, field

import torch

from .attention import AttentionBackend, BatchLayout
from .kv_cache import KVPool
from .llama import LlamaModel
from .sampling import sample
from .scheduler import Request, Scheduler, SharedPrefix


@dataclass
class EngineConfig:
    page_size: int = 16
    num_pages: int | None = None  # default: room for max_batch_size requests of max_seq_len tokens
    max_batch_size: int = 32
    max_prefill_tokens: int = 4096
    max_seq_len: int = 2048
    use_cascade: bool = True  # shared prefix through MultiLevelCascadeAttentionWrapper in prefill
    cascade_decode: bool = False  # also in eager decode steps (else BatchDecode over full page tables)
    cuda_graph: bool = True  # decode steps as CUDA graphs (CUDA devices only)
    graph_batch_sizes: list[int] | None = None
    record_logits: bool = False  # keep every generated token's logits on the request (tests)
    seed: int = 0
    top_k: int = 0
    # After the CUDA graphs are captured, move every object alive then out of the garbage collector's
    # reach (gc.freeze, as SGLang does after its capture): later collections then scan only what the
    # steps allocate, instead of the whole heap of torch/Triton objects.
    gc_freeze: bool = True


@dataclass
class StepStats:
    kind: str  # "prefill" or "decode"
    batch_size: int
    num_tokens: int
    seconds: float
    attention: str  # which wrapper ran it


@dataclass
class Totals:
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_tokens: int = 0
    decode_seconds: float = 0.0
    decode_steps: int = 0
    steps: list[StepStats] = field(default_factory=list)

    def summary(self) -> dict:
        return {
            "prefill_tokens": self.prefill_tokens,
            "prefill_seconds": self.prefill_seconds,
            "prefill_tokens_per_s": self.prefill_tokens / self.prefill_seconds if self.prefill_seconds else 0.0,
            "decode_tokens": self.decode_tokens,
            "decode_steps": self.decode_steps,
            "decode_seconds": self.decode_seconds,
            "decode_tokens_per_s": self.decode_tokens / self.decode_seconds if self.decode_seconds else 0.0,
            "ms_per_decode_step": 1e3 * self.decode_seconds / self.decode_steps if self.decode_steps else 0.0,
        }


def resolve_lib(lib):
    """A FlashInfer-compatible module: the module itself, or its import name."""
    if lib is None:
        lib = "flashinfer_triton"
    if not isinstance(lib, str):
        return lib
    try:
        return importlib.import_module(lib)
    except ImportError as exc:
        raise ValueError(
            f"attention lib: expected an importable FlashInfer-compatible module, got {lib!r} ({exc})"
        ) from exc


class Engine:
    """Continuous-batching generation over a paged KV cache, attention through ``lib``.

    ``hf_model`` is a loaded transformers Llama model (its weights are used in place);
    ``lib`` a module with FlashInfer's API (default ``flashinfer_triton``).
    """

    def __init__(self, hf_model, lib=None, config: EngineConfig | None = None, eos_token_ids=()):
        self.config = cfg = config or EngineConfig()
        self.lib = resolve_lib(lib)
        self.model = LlamaModel(hf_model, max_positions=cfg.max_seq_len)
        m = self.model
        self.device = m.device
        self.dtype = m.dtype
        num_pages = cfg.num_pages or (cfg.max_batch_size * -(-cfg.max_seq_len // cfg.page_size) + 2)
        self.pool = KVPool(m.num_layers, num_pages, cfg.page_size, m.num_kv_heads, m.head_dim, m.dtype, m.device)
        self.backend = AttentionBackend(
            self.lib,
            self.pool,
            m.num_qo_heads,
            m.num_kv_heads,
            m.head_dim,
            m.dtype,
            use_cascade=cfg.use_cascade,
            cascade_decode=cfg.cascade_decode,
        )
        self.scheduler = Scheduler(self.pool, cfg.max_batch_size, cfg.max_prefill_tokens)
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids if t is not None)
        self.generator = torch.Generator(device=self.device)
        self.generator.manual_seed(cfg.seed)
        self.totals = Totals()
        self.graph_runner = None
        self._next_rid = 0

    # ------------------------------------------------------------------ setup
    def capture_cuda_graphs(self) -> None:
        """Capture decode graphs (no-op off CUDA or when disabled)."""
        if not (self.config.cuda_graph and self.device.type == "cuda") or self.graph_runner is not None:
            return
        from .cuda_graph import DecodeGraphRunner

        sizes = self.config.graph_batch_sizes
        if sizes is None:
            sizes = [b for b in (1, 2, 4, 8, 16, 24, 32, 48, 64) if b <= self.config.max_batch_size]
        self.graph_runner = DecodeGraphRunner(self.model, self.backend, sizes)
        if self.config.gc_freeze:
            gc.collect()
            gc.freeze()

    def set_shared_prefix(self, tokens: list[int]) -> int:
        """Hold ``tokens``' KV once in the pool (their page-aligned part); returns how many are shared.

        Requests whose prompt begins with these tokens (and goes on past them) reuse those pages and
        attend them through the cascade's first level.
        """
        if self.scheduler.prefix is not None:
            raise RuntimeError("set_shared_prefix: a prefix is already set")
        ps = self.pool.page_size
        n = (len(tokens) // ps) * ps
        if n == 0:
            return 0
        tokens = list(tokens[:n])
        alloc = self.pool.allocator
        if not alloc.reserve(n // ps):
            raise RuntimeError("set_shared_prefix: the pool has too few free pages")
        pages = alloc.alloc(n // ps)
        layout = BatchLayout(tables=[pages], seq_lens=[n], extend_lens=[n])
        meta = self.backend.plan(layout, decode=False)
        ids = torch.tensor(tokens, dtype=torch.long, device=self.device)
        rows = torch.tensor([n - 1], device=self.device)
        self.model.forward(ids, meta.positions, self.backend, meta, logits_rows=rows)
        self.scheduler.prefix = SharedPrefix(tokens=tokens, pages=pages)
        return n

    # ------------------------------------------------------------------ requests
    def add_request(self, prompt: list[int], max_new_tokens: int = 32, temperature: float = 0.0) -> Request:
        if not prompt:
            raise ValueError("prompt: expected at least one token, got none")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens: expected >= 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.config.max_seq_len:
            raise ValueError(
                f"prompt: {len(prompt)} tokens + max_new_tokens {max_new_tokens} exceed "
                f"max_seq_len {self.config.max_seq_len}"
            )
        req = Request(
            rid=self._next_rid,
            prompt=[int(t) for t in prompt],
            max_new_tokens=max_new_tokens,
            temperature=float(temperature),
            stop_ids=self.eos_token_ids,
            logits=[] if self.config.record_logits else None,
        )
        self._next_rid += 1
        self.scheduler.add(req)
        return req

    @property
    def has_work(self) -> bool:
        return self.scheduler.has_work

    # ------------------------------------------------------------------ steps
    def _finish_tokens(self, reqs: list[Request], logits: torch.Tensor) -> list[Request]:
        temps = [r.temperature for r in reqs]
        next_tokens = sample(logits, temps, self.generator, self.config.top_k).tolist()
        done = []
        for i, (req, tok) in enumerate(zip(reqs, next_tokens, strict=True)):
            req.output.append(int(tok))
            if req.logits is not None:
                req.logits.append(logits[i].detach().float().cpu())
            if tok in req.stop_ids:
                req.finished, req.finish_reason = True, "stop"
            elif len(req.output) >= req.max_new_tokens:
                req.finished, req.finish_reason = True, "length"
            if req.finished:
                done.append(req)
        return done

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def step(self) -> list[Request]:
        """Run one step (a prefill of newly admitted requests, else a decode of the running ones);
        returns the requests that finished in it."""
        sched = self.scheduler
        self._sync()
        t0 = time.perf_counter()
        new = sched.admit()
        if new:
            kind, reqs = "prefill", new
            extend = [len(r.prompt) - r.kv_len for r in reqs]
            ids = [t for r in reqs for t in r.prompt[r.kv_len :]]
        elif sched.running:
            kind, reqs = "decode", list(sched.running)
            extend = [1] * len(reqs)
            ids = [r.output[-1] for r in reqs]
        else:
            return []
        seq_lens = [r.kv_len + e for r, e in zip(reqs, extend, strict=True)]
        for r, n in zip(reqs, seq_lens, strict=True):
            sched.grow(r, n)
        tables = [r.table for r in reqs]
        shared = reqs[0].shared_pages
        all_share = bool(shared) and all(r.shared_pages == shared for r in reqs)
        if kind == "decode" and self.graph_runner is not None and self.graph_runner.can_run(len(reqs)):
            logits = self.graph_runner.run(tables, seq_lens, ids)
            attention = "cuda-graph-decode"
        else:
            layout = BatchLayout(tables, seq_lens, extend, shared if all_share else None)
            meta = self.backend.plan(layout, decode=kind == "decode")
            input_ids = torch.tensor(ids, dtype=torch.long).to(self.device, non_blocking=True)
            rows = None
            if kind == "prefill":
                rows = torch.cumsum(torch.tensor(extend), 0).sub_(1).to(self.device, non_blocking=True)
            logits = self.model.forward(input_ids, meta.positions, self.backend, meta, logits_rows=rows)
            attention = meta.kind
        for r, n in zip(reqs, seq_lens, strict=True):
            r.kv_len = n
        done = self._finish_tokens(reqs, logits)
        if kind == "prefill":
            sched.running.extend(reqs)
        for r in done:
            sched.release(r)
        self._sync()
        dt = time.perf_counter() - t0
        stats = StepStats(kind, len(reqs), sum(extend), dt, attention)
        self.totals.steps.append(stats)
        if kind == "prefill":
            self.totals.prefill_tokens += stats.num_tokens
            self.totals.prefill_seconds += dt
        else:
            self.totals.decode_tokens += stats.num_tokens
            self.totals.decode_seconds += dt
            self.totals.decode_steps += 1
        return done

    def run(self, on_step=None) -> None:
        """Step until every request has finished; ``on_step(engine, finished)`` after each step."""
        while self.has_work:
            done = self.step()
            if on_step is not None:
                on_step(self, done)

    def generate(
        self, prompts: list[list[int]], max_new_tokens: int = 32, temperature: float = 0.0, on_step=None
    ) -> list[list[int]]:
        """Generated token ids of each prompt (continuous batching over all of them)."""
        reqs = [self.add_request(p, max_new_tokens, temperature) for p in prompts]
        self.run(on_step)
        return [r.output for r in reqs]
