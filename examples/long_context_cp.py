"""A long-context request served with its KV cache split over the ranks of a process group.

    torchrun --nproc_per_node 2 examples/long_context_cp.py                 # GPUs, NCCL
    torchrun --nproc_per_node 2 examples/long_context_cp.py --cpu --tokens 1024  # CPU, gloo

The model is the engine's Llama forward pass (``examples/engine``) with SmolLM2-135M's shapes and random
weights (fewer layers by default). Everything but attention is per token, so each rank runs the model on
its own tokens only:

* prefill: rank ``r`` holds the zig-zag chunks ``r`` and ``2W - 1 - r`` of the prompt; every layer's attention
  is ``RingPrefillWrapper`` (keys and values travel around the ring), and each rank keeps the keys and
  values of its own tokens as its share of the paged KV cache;
* decode: every rank runs the new token; its keys and values go to the rank holding the fewest tokens,
  and every layer's attention is ``ContextParallelDecodeWrapper`` over the ranks' shares.

Rank 0 then runs the same request on one device with the single-GPU API (causal prefill, then decode over
the whole cache) and checks that the logits agree and the greedy tokens are the same.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

from engine.llama import LlamaModel  # noqa: E402
from engine.model import random_llama  # noqa: E402

# Imported here, before main() creates the process group, not on first use in random_llama(): transformers'
# modeling code imports torch.distributed.checkpoint, and that import while a process group exists keeps the
# default group alive after destroy_process_group(). Its gloo worker threads then outlive Python's shutdown,
# and one still releasing a finished collective's tensors needs the GIL there, which aborts the process
# ("terminate called without an active exception").
from transformers import LlamaForCausalLM  # noqa: E402, F401

import flashinfer_triton as fi  # noqa: E402
from flashinfer_triton import distributed as cp  # noqa: E402

PAGE = 16


class RingThenShardedDecode:
    """Attention for ``LlamaModel.forward``: ring prefill, then decode over the ranks' cache shares."""

    def __init__(self, model, capacity, device, group=None):
        self.hq, self.hkv, self.d = model.num_qo_heads, model.num_kv_heads, model.head_dim
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        pages = -(-capacity // PAGE)
        # this rank's share of every layer's cache, K and V [layers, pages, PAGE, Hkv, D], filled in order
        shape = (model.num_layers, pages, PAGE, self.hkv, self.d)
        self.k_cache = torch.zeros(shape, dtype=model.dtype, device=device)
        self.v_cache = torch.zeros(shape, dtype=model.dtype, device=device)
        self.local_len = 0
        self.ws = torch.empty(64 << 20, dtype=torch.uint8, device=device)
        self.ring = cp.RingPrefillWrapper(self.ws, group)
        self.decode = cp.ContextParallelDecodeWrapper(self.ws, "NHD", group)
        self.mode = None
        self.device = device

    def plan_prefill(self, prompt_len):
        self.ring.plan([prompt_len], self.hq, self.hkv, self.d, causal=True, q_data_type=self.k_cache.dtype)
        self.mode = "prefill"

    def plan_decode(self, owner, total_len):
        """The new token goes to rank ``owner``; every rank then plans over its share."""
        if self.rank == owner:
            self.local_len += 1
        n = self.local_len
        pages = -(-n // PAGE)
        i32 = dict(dtype=torch.int32, device=self.device)
        self.decode.plan(
            torch.tensor([0, pages], **i32), torch.arange(pages, **i32),
            torch.tensor([n - (pages - 1) * PAGE if pages else 0], **i32),
            self.hq, self.hkv, self.d, PAGE, q_data_type=self.k_cache.dtype, seq_lens=[total_len],
        )  # fmt: skip
        self.owner = owner
        self.mode = "decode"

    def _store(self, layer, k, v, start):
        """Rows ``start ..`` of this rank's share (pages are filled in order, so rows are contiguous)."""
        self.k_cache[layer].view(-1, self.hkv, self.d)[start : start + k.shape[0]] = k
        self.v_cache[layer].view(-1, self.hkv, self.d)[start : start + k.shape[0]] = v

    def forward(self, layer, q, k, v, meta):
        if self.mode == "prefill":
            self._store(layer, k, v, 0)
            self.local_len = k.shape[0]
            return self.ring.run(q, k, v)
        if self.rank == self.owner:
            self._store(layer, k, v, self.local_len - 1)
        return self.decode.run(q, (self.k_cache[layer], self.v_cache[layer]))


class OneDevice:
    """The same request on one device with the single-GPU API: causal prefill, then decode over all keys."""

    def __init__(self, model):
        self.k = [None] * model.num_layers
        self.v = [None] * model.num_layers
        self.mode = "prefill"

    def forward(self, layer, q, k, v, meta):
        if self.mode == "prefill":
            self.k[layer], self.v[layer] = k, v
            return fi.single_prefill_with_kv_cache(q, k, v, causal=True)
        self.k[layer] = torch.cat([self.k[layer], k])
        self.v[layer] = torch.cat([self.v[layer], v])
        return fi.single_decode_with_kv_cache(q[0], self.k[layer], self.v[layer])[None]


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cpu", action="store_true", help="CPU tensors and gloo")
    ap.add_argument("--tokens", type=int, default=32768, help="prompt length")
    ap.add_argument("--new-tokens", type=int, default=8)
    ap.add_argument("--layers", type=int, default=4)
    args = ap.parse_args()
    if args.cpu:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
        dtype = torch.float32
    else:
        local = int(os.environ.get("LOCAL_RANK", "0"))
        torch.cuda.set_device(local)
        dist.init_process_group("nccl", device_id=torch.device("cuda", local))
        device = torch.device("cuda", local)
        dtype = torch.float16
    ok = serve(args.tokens, args.new_tokens, args.layers, device, dtype)
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


def serve(prompt_len: int, new_tokens: int, layers: int, device, dtype) -> bool:
    """The request on the default process group (initialized by the caller), then on one device (rank 0);
    every rank returns whether the two agree."""
    world, rank = dist.get_world_size(), dist.get_rank()
    total = prompt_len + new_tokens
    hf = random_llama(device, dtype, seed=0, num_hidden_layers=layers, max_position_embeddings=total)
    model = LlamaModel(hf, max_positions=total)
    gen = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, model.vocab_size, (prompt_len,), generator=gen).to(device)

    # ---- context parallel: prefill on the zig-zag shards, then decode over the ranks' shares
    backend = RingThenShardedDecode(model, total, device)
    idx = cp.zigzag_indices([prompt_len], world, rank).to(device)
    backend.plan_prefill(prompt_len)
    holds_last = bool((idx == prompt_len - 1).any())
    last_row = (idx == prompt_len - 1).nonzero().reshape(-1)
    logits = model.forward(prompt[idx], idx, backend, None, logits_rows=last_row if holds_last else idx[:0])
    # the rank holding the prompt's last token shares its logits with the others
    first = torch.zeros(1, model.vocab_size, dtype=torch.float32, device=device)
    if holds_last:
        first.copy_(logits)
    dist.all_reduce(first)
    cp_logits, tokens = [first], [int(first.argmax())]
    shares = torch.zeros(world, dtype=torch.int64)
    shares[rank] = backend.local_len
    shares = shares.to(device)
    dist.all_reduce(shares)
    shares = shares.cpu()
    for step in range(new_tokens - 1):
        pos = prompt_len + step
        owner = int(shares.argmin())
        shares[owner] += 1
        backend.plan_decode(owner, pos + 1)
        tok = torch.tensor([tokens[-1]], device=device)
        out = model.forward(tok, torch.tensor([pos], device=device), backend, None)
        cp_logits.append(out)
        tokens.append(int(out.argmax()))

    # ---- the same request on one device
    if rank == 0:
        ref = OneDevice(model)
        out = model.forward(prompt, torch.arange(prompt_len, device=device), ref, None,
                            logits_rows=torch.tensor([prompt_len - 1], device=device))  # fmt: skip
        ref_logits, ref_tokens = [out], [int(out.argmax())]
        ref.mode = "decode"
        # fed the tokens the context-parallel run chose, so that every step compares the same inputs
        for step in range(new_tokens - 1):
            pos = prompt_len + step
            out = model.forward(torch.tensor([tokens[step]], device=device), torch.tensor([pos], device=device),
                                ref, None)  # fmt: skip
            ref_logits.append(out)
            ref_tokens.append(int(out.argmax()))
        diff = max(float((a - b).abs().max()) for a, b in zip(cp_logits, ref_logits, strict=True))
        scale = max(float(b.abs().max()) for b in ref_logits)
        tol = 1e-3 if dtype == torch.float32 else 2e-2
        # a greedy choice may differ only where the two best logits are closer than the logits' difference
        pairs = zip(tokens, ref_tokens, ref_logits, strict=True)
        same_choice = all(a == b or float(r[0, b] - r[0, a]) <= 2 * diff for a, b, r in pairs)
        print(f"{world} ranks, prompt {prompt_len} tokens, KV shares {shares.tolist()} tokens")
        print(f"tokens  context parallel {tokens}")
        print(f"tokens  one device       {ref_tokens}")
        print(f"max |logit difference| {diff:.3g} (logits up to {scale:.3g})")
        ok = same_choice and diff <= tol * max(1.0, scale)
        print("OK: the same as on one device" if ok else "MISMATCH")
        status = torch.tensor([0 if ok else 1], device=device)
    else:
        status = torch.zeros(1, dtype=torch.int64, device=device)
    dist.broadcast(status, 0)
    return int(status) == 0


if __name__ == "__main__":
    main()
