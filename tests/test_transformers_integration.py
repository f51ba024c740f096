"""The transformers attention implementation: greedy tokens of a SmolLM2-135M-shaped Llama through our kernels equal
transformers' own, for ``generate`` (padded batch, against "sdpa") and ``generate_batch`` (continuous batching on
transformers' paged cache, against "paged|eager"); the hub-kernel route; and the block-table (decode fast path)
branch against a reference.

The model has SmolLM2-135M's shapes (fewer layers) and seeded random weights, so the tests need no download and run
on the GPU machine as on the CPU. Its weights are drawn wider than SmolLM2's initializer (``init_std``): with the
default, a random model repeats its last token whatever attention returns, and the comparison would prove little.

Greedy tokens are compared until the first near-tie. Where both runs give logits (``generate``), every step's
logits must agree within ``LOGIT_TOL``; a token may then differ only where the reference's logits of the two tokens
are within ``2 * LOGIT_TOL`` (the most two within-tolerance logit vectors can disagree on their order), and the
sequences are compared no further. Continuous batching returns no logits: at a differing token the reference's
logits are computed by one forward pass over the reference's prefix and the same bound applies."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import pytest
import torch

from conftest import DEVICE, assert_close

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples"))

transformers = pytest.importorskip("transformers")

from flashinfer_triton.integrations import transformers as fit  # noqa: E402
from helpers import block_table  # noqa: E402

PROMPT_LENS = (9, 4, 13)  # different lengths: generate pads (the varlen path), continuous batching packs
NEW_TOKENS = 8
LAYERS = 4
PAD = 2  # SmolLM2's pad token
# float32 on both devices, so that near-ties are rare. On the GPU the kernels' float32 dots run in TF32 (10-bit
# mantissa): the logits (std ~1.2 for these weights) then move by ~1e-3; on the CPU the backend is exact to ~1e-5.
LOGIT_TOL = 2e-2 if DEVICE.type == "cuda" else 1e-3


@pytest.fixture(scope="module")
def model():
    from engine.model import random_llama

    m = random_llama(DEVICE, torch.float32, seed=0, init_std=0.05, num_hidden_layers=LAYERS)
    m.generation_config.eos_token_id = None  # never stop early: every step is compared
    return m


@pytest.fixture(scope="module")
def prompts():
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in PROMPT_LENS]


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


def _generate(model, prompts, impl):
    """Left-padded ``generate``: (new tokens per sequence, logits ``[B, NEW_TOKENS, vocab]`` float32 on the host)."""
    model.set_attn_implementation(impl)
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), PAD, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, p in enumerate(prompts):
        ids[r, width - len(p) :] = torch.tensor(p)
        mask[r, width - len(p) :] = 1
    with torch.no_grad():
        out = model.generate(
            input_ids=ids.to(DEVICE), attention_mask=mask.to(DEVICE), max_new_tokens=NEW_TOKENS, do_sample=False,
            pad_token_id=PAD, output_logits=True, return_dict_in_generate=True,
        )  # fmt: skip
    return out.sequences[:, width:].tolist(), torch.stack(out.logits, 1).float().cpu()


def _cb_config():
    """A small paged cache (transformers sizes it from free memory otherwise: seconds of CPU time to fill), and
    no CUDA graphs: continuous batching captures them by default for "flash" names, and our plans cannot be."""
    from transformers import ContinuousBatchingConfig

    return ContinuousBatchingConfig(num_blocks=8, max_batch_tokens=64, use_cuda_graph=False)


def _generate_batch(model, prompts, impl):
    from transformers import GenerationConfig

    model.set_attn_implementation(impl)
    config = GenerationConfig(max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=-1, pad_token_id=PAD)
    res = model.generate_batch(
        inputs=prompts, generation_config=config, progress_bar=False, continuous_batching_config=_cb_config()
    )
    by_index = sorted(res.values(), key=lambda r: int(r.request_id.split("_")[-1]))
    return [list(r.generated_tokens) for r in by_index]


def _reference_logits(model, tokens):
    """sdpa's logits for the token after ``tokens``."""
    model.set_attn_implementation("sdpa")
    with torch.no_grad():
        return model(torch.tensor([tokens], device=DEVICE)).logits[0, -1].float().cpu()


def _assert_greedy_match(model, prompts, got, want, got_logits=None, want_logits=None):
    """Tokens equal up to the first near-tie (see the module's docstring); returns how many were compared."""
    compared = 0
    for r, (g, w) in enumerate(zip(got, want, strict=True)):
        assert len(g) == len(w) == NEW_TOKENS, f"sequence {r}: {len(g)} tokens, reference {len(w)}"
        for t in range(NEW_TOKENS):
            if got_logits is not None:
                assert_close(got_logits[r, t], want_logits[r, t], atol=LOGIT_TOL, rtol=0, name=f"logits {r}, {t}")
            if g[t] != w[t]:
                ref = want_logits[r, t] if want_logits is not None else _reference_logits(model, prompts[r] + w[:t])
                margin = (ref[w[t]] - ref[g[t]]).item()
                assert margin <= 2 * LOGIT_TOL, (
                    f"sequence {r}, step {t}: token {g[t]} where the reference picks {w[t]}, whose logit is higher "
                    f"by {margin:.3g} (not a near-tie)"
                )
                break
            compared += 1
    # a seed whose near-ties cut every sequence short would make the test prove nothing
    assert compared >= len(want) * NEW_TOKENS // 2, f"only {compared} tokens compared before near-ties"
    return compared


@pytest.fixture(scope="module")
def sdpa_reference(model, prompts):
    return _generate(model, prompts, "sdpa")


def test_generate_and_generate_batch_match_transformers(model, prompts, sdpa_reference, calls):
    name = fit.register()
    assert "flash" in name
    try:
        got, got_logits = _generate(model, prompts, name)
        assert calls["varlen"] > 0  # the prompts have different lengths: the padded path
        want, want_logits = sdpa_reference
        _assert_greedy_match(model, prompts, got, want, got_logits, want_logits)
        want_cb = _generate_batch(model, prompts, "paged|eager")
        before = calls["varlen"]
        got_cb = _generate_batch(model, prompts, name)
        assert calls["varlen"] > before
        _assert_greedy_match(model, prompts, got_cb, want_cb)
    finally:
        model.set_attn_implementation("sdpa")


def test_logits_depend_on_attention(model, prompts, sdpa_reference, monkeypatch):
    """The comparison above can fail: attention that is slightly wrong (a 10% larger softmax scale) moves these
    logits by far more than ``LOGIT_TOL``."""
    real = fit.flash_attn_varlen_func

    def wrong_scale(q, *a, softmax_scale=None, **kw):
        return real(q, *a, softmax_scale=1.1 * (softmax_scale or q.shape[-1] ** -0.5), **kw)

    monkeypatch.setattr(fit, "flash_attn_varlen_func", wrong_scale)
    try:
        _, logits = _generate(model, prompts, fit.register())
    finally:
        model.set_attn_implementation("sdpa")
    assert (logits[:, 0] - sdpa_reference[1][:, 0]).abs().max() > 10 * LOGIT_TOL


def test_hub_kernel_route_loads_the_flash_attn_module(model, prompts, sdpa_reference, monkeypatch):
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
    # transformers calls the module's functions, not ours through fit: count the module's varlen calls
    real = fa.flash_attn_varlen_func
    count = [0]

    @functools.wraps(real)  # transformers reads the signature to pick the keyword arguments it passes
    def counted(*a, **kw):
        count[0] += 1
        return real(*a, **kw)

    monkeypatch.setattr(fa, "flash_attn_varlen_func", counted)
    try:
        got, got_logits = _generate(model, prompts, "local/flashinfer_triton")
    finally:
        model.set_attn_implementation("sdpa")
    assert asked == ["local/flashinfer_triton"]
    assert count[0] > 0
    want, want_logits = sdpa_reference
    _assert_greedy_match(model, prompts, got, want, got_logits, want_logits)


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
    table, _ = block_table([4 * page] * b, page, spare_blocks=12 - b * 4, seed=None)
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
