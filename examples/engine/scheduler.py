"""Requests and continuous batching.

Each step is either a prefill of newly admitted requests or one decode step of every running request
(prefill first, as mini-sglang schedules). Requests can be added at any time; they join at the next
step that has room for them (batch size, prefill token budget, pages), and leave the batch as soon as
they finish, giving their pages back.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from .kv_cache import KVPool


@dataclass
class SharedPrefix:
    """Tokens whose KV is held once in the pool (page-aligned) and shared by the requests that begin
    with them."""

    tokens: list[int]
    pages: list[int]


@dataclass
class Request:
    rid: int
    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    stop_ids: frozenset[int] = frozenset()
    output: list[int] = field(default_factory=list)
    shared_pages: list[int] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)  # the request's own pages, after the shared ones
    kv_len: int = 0  # tokens whose keys/values are in the pool
    reserved: int = 0  # pages reserved for it and not yet taken
    finished: bool = False
    finish_reason: str | None = None
    logits: list | None = None  # per generated token, when the engine records them

    @property
    def table(self) -> list[int]:
        return self.shared_pages + self.pages

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.output


class Scheduler:
    def __init__(self, pool: KVPool, max_batch_size: int, max_prefill_tokens: int):
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size: expected >= 1, got {max_batch_size}")
        self.pool = pool
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.prefix: SharedPrefix | None = None

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _shared_pages_for(self, prompt: list[int]) -> list[int]:
        p = self.prefix
        if p is None or not p.pages or len(prompt) <= len(p.tokens):
            return []
        return list(p.pages) if prompt[: len(p.tokens)] == p.tokens else []

    def admit(self) -> list[Request]:
        """Move waiting requests into the batch while batch size, token budget and pages allow."""
        admitted: list[Request] = []
        tokens = 0
        ps = self.pool.page_size
        while self.waiting and len(self.running) + len(admitted) < self.max_batch_size:
            req = self.waiting[0]
            shared = self._shared_pages_for(req.prompt)
            extend = len(req.prompt) - len(shared) * ps
            if admitted and tokens + extend > self.max_prefill_tokens:
                break
            need = self.pool.pages_for(len(req.prompt) + req.max_new_tokens) - len(shared)
            if not self.pool.allocator.reserve(need):
                if not admitted and not self.running:
                    raise RuntimeError(
                        f"request {req.rid}: needs {need} pages, the pool has "
                        f"{self.pool.allocator.num_free} free; raise num_pages"
                    )
                break
            self.waiting.popleft()
            req.shared_pages = shared
            req.kv_len = len(shared) * ps
            req.reserved = need
            admitted.append(req)
            tokens += extend
        return admitted

    def grow(self, req: Request, new_kv_len: int) -> None:
        """Take pages from the request's reservation so that ``new_kv_len`` tokens fit."""
        need = self.pool.pages_for(new_kv_len) - len(req.shared_pages) - len(req.pages)
        if need > 0:
            if need > req.reserved:
                raise RuntimeError(f"request {req.rid}: grew past its reservation")
            req.pages.extend(self.pool.allocator.alloc(need))
            req.reserved -= need

    def release(self, req: Request) -> None:
        """Give a finished request's pages and leftover reservation back."""
        self.pool.allocator.free(req.pages)
        self.pool.allocator.unreserve(req.reserved)
        req.pages, req.reserved = [], 0
        if req in self.running:
            self.running.remove(req)
