"""The integrations' costs: FlashAttention's interface against the native API, FlashInfer and SDPA; the custom
op's host cost; transformers' continuous batching with our attention against its default.

Modes (``--mode``, several allowed):

* ``kernels`` (GPU): GPU time of ``flash_attn_varlen_func`` / ``flash_attn_func`` / ``flash_attn_with_kvcache``
  against the same attention through our wrappers' ``run()`` (the target: within 3%), FlashInfer's wrappers
  and SDPA. Each is captured in one CUDA graph over rotated input copies (``back_to_back_ms``), so the figure
  is GPU time; the flash_attn calls hit their plan cache, as the layers of a model step do.
  Writes ``benchmarks/results/<gpu>/flash_attn.json``.
* ``dispatch``: host time of a decode ``run()`` called directly and through the ``wrapper_run`` custom op (what
  compiled code calls), and of ``flash_attn_with_kvcache`` (plan-cache lookup included). Runs on the CPU too.
* ``generate_batch``: tokens/s of transformers' ``generate_batch`` on a SmolLM2-135M-shaped Llama (random
  weights) with our attention implementation against the implementation transformers picks by default.

On a GPU the rows of every mode run go to ``benchmarks/results/<gpu>/flash_attn.json``:

``python benchmarks/bench_flash_attn.py --mode kernels dispatch generate_batch --requests 32 --new-tokens 32``
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "src"))

import _common as bc  # noqa: E402

import flashinfer_triton as fi  # noqa: E402
from flashinfer_triton import _custom_ops  # noqa: E402
from flashinfer_triton.flash_attn import (  # noqa: E402
    flash_attn_func,
    flash_attn_varlen_func,
    flash_attn_with_kvcache,
)

HQ, HKV, D = 32, 8, 128


def _ragged_case(batch, seq, dtype, dev, copies):
    lens = [seq] * batch
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)
    qs = [torch.randn(batch * seq, HQ, D, device=dev, dtype=dtype) for _ in range(copies)]
    ks = [torch.randn(batch * seq, HKV, D, device=dev, dtype=dtype) for _ in range(copies)]
    vs = [torch.randn(batch * seq, HKV, D, device=dev, dtype=dtype) for _ in range(copies)]
    return cu, qs, ks, vs


def kernels_mode(args, rows):
    dev = torch.device("cuda")
    flashinfer = bc.import_flashinfer() if not args.no_flashinfer else None
    ws = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    ws_fi = torch.empty(128 << 20, dtype=torch.uint8, device=dev)
    for batch, seq in ((8, 1024), (2, 4096)):  # causal prefill, equal lengths (so SDPA can run it dense)
        rows.append(_prefill_case(batch, seq, ws, ws_fi, flashinfer))
    for batch, kv_len in ((64, 2048), (16, 8192)):  # decode over a paged cache, page 16
        rows.append(_decode_case(batch, kv_len, ws, ws_fi, flashinfer))
    cols = ["case", "ours_ms", "ours_native_ms", "flash_attn_vs_native", "flashinfer_ms", "sdpa_ms", "ratio"]
    bc.print_table(rows, cols)


def _prefill_case(batch, seq, ws, ws_fi, flashinfer):
    dev, dtype = ws.device, torch.bfloat16
    sdpa = torch.nn.functional.scaled_dot_product_attention
    copies = bc.num_rotations(batch * seq * (HQ + 2 * HKV) * D * 2)
    cu, qs, ks, vs = _ragged_case(batch, seq, dtype, dev, copies)
    native = fi.BatchPrefillWithRaggedKVCacheWrapper(ws)
    native.plan(cu, cu, HQ, HKV, D, causal=True, q_data_type=dtype)
    inputs = list(zip(qs, ks, vs))

    def dense(x, h):
        return x.view(batch, seq, h, D)

    fns = {
        "ours_native": [lambda q=q, k=k, v=v: native.run(q, k, v) for q, k, v in inputs],
        "flash_attn_varlen": [
            lambda q=q, k=k, v=v: flash_attn_varlen_func(q, k, v, cu, cu, seq, seq, causal=True) for q, k, v in inputs
        ],
        "flash_attn_func": [
            lambda q=q, k=k, v=v: flash_attn_func(dense(q, HQ), dense(k, HKV), dense(v, HKV), causal=True)
            for q, k, v in inputs
        ],
        "sdpa": [
            lambda q=q, k=k, v=v: sdpa(
                dense(q, HQ).transpose(1, 2),
                dense(k, HKV).transpose(1, 2),
                dense(v, HKV).transpose(1, 2),
                is_causal=True,
                enable_gqa=True,
            )  # fmt: skip
            for q, k, v in inputs
        ],
    }
    if flashinfer is not None:
        w_fi = flashinfer.BatchPrefillWithRaggedKVCacheWrapper(ws_fi, "NHD")
        w_fi.plan(cu, cu, HQ, HKV, D, causal=True, q_data_type=dtype)
        fns["flashinfer"] = [lambda q=q, k=k, v=v: w_fi.run(q, k, v) for q, k, v in inputs]
    return _row(f"prefill causal {batch}x{seq}", fns)


def _decode_case(batch, kv_len, ws, ws_fi, flashinfer, page=16):
    dev, dtype = ws.device, torch.bfloat16
    indptr, indices, last, num_pages = bc.page_table([kv_len] * batch, page, device=dev)
    copies = bc.num_rotations(num_pages * page * HKV * D * 2 * 2)
    caches = bc.paged_caches(num_pages, page, HKV, D, dtype, dev, count=copies)
    qs = [torch.randn(batch, HQ, D, device=dev, dtype=dtype) for _ in range(copies)]
    table = indices.view(batch, kv_len // page)  # equal lengths: the CSR table is the block table
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
    native = fi.BatchDecodeWithPagedKVCacheWrapper(ws)
    native.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=dtype)
    inputs = list(zip(qs, caches))
    fns = {
        "ours_native": [lambda q=q, c=c: native.run(q, c) for q, c in inputs],
        "flash_attn_with_kvcache": [
            lambda q=q, c=c: flash_attn_with_kvcache(
                q.view(batch, 1, HQ, D), c[0], c[1], cache_seqlens=seqlens, block_table=table
            )
            for q, c in inputs
        ],
    }
    if flashinfer is not None:
        w_fi = flashinfer.BatchDecodeWithPagedKVCacheWrapper(ws_fi, "NHD", use_tensor_cores=True)
        w_fi.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=dtype)
        fns["flashinfer"] = [lambda q=q, c=c: w_fi.run(q, c) for q, c in inputs]
    return _row(f"decode paged {batch}x{kv_len}", fns)


def _row(case, fns):
    """``ours_ms`` is the flash_attn function; ``ratio`` = FlashInfer's time / ours (above 1: ours is faster)."""
    row = {"case": case}
    for name, fn_list in fns.items():
        row[f"{name}_ms"] = bc.back_to_back_ms(fn_list)
    fa_key = next(k for k in row if k.startswith("flash_attn") and k.endswith("_ms"))
    row["ours_ms"] = row["flash_attn_ms"] = row[fa_key]
    row["flash_attn_vs_native"] = row["flash_attn_ms"] / row["ours_native_ms"]
    row.setdefault("flashinfer_ms", None)
    row.setdefault("sdpa_ms", None)  # decode: SDPA has no paged cache
    row["ratio"] = row["flashinfer_ms"] / row["ours_ms"] if row["flashinfer_ms"] else None
    print(row, flush=True)
    return row


def dispatch_mode(args, rows):
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    batch, kv_len, page = (32, 1024, 16) if dev.type == "cuda" else (2, 32, 16)
    lens = [kv_len] * batch
    indptr, indices, last, num_pages = bc.page_table(lens, page, device=dev)
    k, v = bc.paged_caches(num_pages, page, HKV, D, dtype, dev)[0]
    q = torch.randn(batch, HQ, D, device=dev, dtype=dtype)
    w = fi.BatchDecodeWithPagedKVCacheWrapper(torch.empty(32 << 20, dtype=torch.uint8, device=dev))
    w.plan(indptr, indices, last, HQ, HKV, D, page, q_data_type=dtype)
    key = _custom_ops.handle(w)
    op = torch.ops.flashinfer_triton.wrapper_run
    table = indices.view(batch, kv_len // page)  # equal lengths: the CSR table is the block table
    seqlens = torch.full((batch,), kv_len, dtype=torch.int32, device=dev)
    sync = torch.cuda.synchronize if dev.type == "cuda" else None
    iters = 200 if dev.type == "cuda" else 20
    out = {
        "direct_us": bc.host_time_us(lambda: w.run(q, (k, v)), iters=iters),
        "custom_op_us": bc.host_time_us(lambda: op(key, q, [k, v], "pair", None, None, None, None, False), iters=iters),
        "flash_attn_with_kvcache_us": bc.host_time_us(
            lambda: flash_attn_with_kvcache(q.view(batch, 1, HQ, D), k, v, cache_seqlens=seqlens, block_table=table),
            iters=iters,
        ),
    }
    if sync:
        sync()
    out["op_minus_direct_us"] = out["custom_op_us"] - out["direct_us"]
    out["case"] = f"host time, decode {batch}x{kv_len} on {dev.type}"
    print(out, flush=True)
    rows.append(out)


def generate_batch_mode(args, rows):
    """tokens/s of ``generate_batch`` with our implementation against the one transformers picks for the model by
    default (FlashAttention when installed, else sdpa) with its default continuous-batching settings. The model has
    SmolLM2-135M's shapes and random weights (no download on the GPU machine): tokens/s does not depend on the
    weights' values, and ``eos_token_id=-1`` makes every request generate all its tokens."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "examples"))
    from engine.model import random_llama

    from flashinfer_triton.integrations import transformers as fit

    cuda = torch.cuda.is_available()
    name = fit.register()
    model = random_llama("cuda" if cuda else "cpu", torch.bfloat16 if cuda else torch.float32, seed=0)
    default = model.config._attn_implementation
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(100, 40000, (int(n),), generator=gen).tolist()
               for n in torch.randint(64, 512, (args.requests,), generator=gen)]  # fmt: skip
    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
    row = {"case": f"generate_batch {args.requests} requests x {args.new_tokens} tokens, prompts 64-511",
           "model": "SmolLM2-135M shapes, random weights", "dtype": str(model.dtype).replace("torch.", ""),
           "default_attn": default}  # fmt: skip
    # our plans cannot be captured: CUDA graphs off for our implementation (transformers' default for sdpa too)
    runs = {"default": (default, None), "ours": (name, ContinuousBatchingConfig(use_cuda_graph=False))}
    for key, (impl, cb_config) in runs.items():
        try:
            row[f"{key}_tokens_per_s"] = _tokens_per_s(model, impl, prompts, config, cb_config)
        except Exception as exc:  # report and go on: the other implementation still gives a number
            row[f"{key}_tokens_per_s"] = None
            row[f"{key}_error"] = f"{type(exc).__name__}: {exc}"[:300]
    ours, base = row["ours_tokens_per_s"], row["default_tokens_per_s"]
    row["ratio"] = ours / base if ours and base else None  # above 1: ours generates faster
    print(row, flush=True)
    rows.append(row)


def _tokens_per_s(model, impl, prompts, config, cb_config):
    model.set_attn_implementation(impl)
    kw = {"continuous_batching_config": cb_config} if cb_config is not None else {}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    model.generate_batch(inputs=prompts[:4], generation_config=config, progress_bar=False, **kw)  # compiles
    sync()
    t0 = time.perf_counter()
    res = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False, **kw)
    sync()
    seconds = time.perf_counter() - t0
    tokens = sum(len(r.generated_tokens) for r in res.values())
    if tokens != len(prompts) * config.max_new_tokens:
        raise RuntimeError(f"generate_batch returned {tokens} tokens, expected {len(prompts) * config.max_new_tokens}")
    return tokens / seconds


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", nargs="+", default=["kernels"], choices=["kernels", "dispatch", "generate_batch"])
    p.add_argument("--no-flashinfer", action="store_true")
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args()
    rows = []
    if "kernels" in args.mode:
        kernels_mode(args, rows)
    if "dispatch" in args.mode:
        dispatch_mode(args, rows)
    if "generate_batch" in args.mode:
        generate_batch_mode(args, rows)
    if torch.cuda.is_available():
        timing = "kernels: back_to_back_ms (CUDA graph, rotated inputs); dispatch: host us per call"
        meta = dict(modes=args.mode, heads=(HQ, HKV), head_dim=D, dtype="bfloat16", timing=timing)
        print(f"wrote {bc.write_json('flash_attn', rows, meta=meta)}")


if __name__ == "__main__":
    main()
