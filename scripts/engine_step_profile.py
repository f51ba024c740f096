"""torch.profiler trace of an engine's decode steps, one library at a time (the next step for the engine's
unexplained host time per step, docs/notes-host.md).

    PYTHONPATH=src python3 scripts/engine_step_profile.py --lib flashinfer_triton --batch-size 8 --out $OUT
    PYTHONPATH=/tmp/peers:src python3 scripts/engine_step_profile.py --lib flashinfer ...

SmolLM2's shapes with random weights; warms up (CUDA graphs captured, every variant compiled), then
profiles ``--steps`` decode steps: prints the operators by self CPU time and writes a Chrome trace
(``engine-<lib>-bs<N>.json``) to ``--out``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "..", "benchmarks"))
sys.path.insert(0, os.path.join(HERE, "..", "examples"))

from bench_engine import build_engine, common_prefix, make_prompts  # noqa: E402
from engine.model import random_llama  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--lib", default="flashinfer_triton")
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    model = random_llama(device=device, dtype=dtype, seed=0, init_std=0.05)
    lib = importlib.import_module(args.lib)
    prompts = make_prompts(args.batch_size, model.config.vocab_size)
    eng = build_engine(model, lib, 16, args.batch_size, 512, use_cascade=args.lib == "flashinfer_triton")
    eng.set_shared_prefix(common_prefix(prompts))
    eng.capture_cuda_graphs()
    eng.generate(prompts, max_new_tokens=4)  # warm-up: every variant compiled
    for p in prompts:
        eng.add_request(p, args.steps + 8)
    while eng.scheduler.waiting:  # the prefill steps of the new requests
        eng.step()
    acts = [torch.profiler.ProfilerActivity.CPU]
    if device.type == "cuda":
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts, with_stack=False) as prof:
        for _ in range(args.steps):
            eng.step()
    print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30))
    if args.out:
        os.makedirs(args.out, exist_ok=True)
        path = os.path.join(args.out, f"engine-{args.lib}-bs{args.batch_size}.json")
        prof.export_chrome_trace(path)
        print(f"wrote {path}")
    eng.run()


if __name__ == "__main__":
    main()
