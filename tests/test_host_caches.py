"""``host_caches()`` / ``clear_host_caches()``: the host-side caches of per-call-form state, read through their
public summary. CPU tensors (the PyTorch path keeps its single-request plans and flash-attn wrappers too); the
bound launches of ``single_forms``, ``merge_state`` and ``sampling`` are checked with stand-in launches in
``test_launch.py`` and ``test_sampling.py``; of the kernel paths' caches, ``tensor_descriptors`` in ``test_launch.py``,
``gluon_geometries`` in ``test_decode_sm90.py`` and ``vllm_settings`` in ``test_vllm.py``."""

from __future__ import annotations

import pytest
import torch

import flashinfer_triton as fi
from conftest import assert_close
from flashinfer_triton import reference as R
from flashinfer_triton.flash_attn import flash_attn_varlen_func

NAMES = ("single_plans", "single_forms", "merge_state", "merge_states", "sampling", "flash_attn", "append_forms",
         "tensor_descriptors", "gluon_geometries", "vllm_settings", "tma_inputs", "row_forms")  # fmt: skip


@pytest.fixture
def empty_caches():
    """Every host cache empty for the test, and emptied again after it."""
    fi.clear_host_caches()
    yield
    fi.clear_host_caches()


def test_summary_names_every_cache_read_only(empty_caches):
    caches = fi.host_caches()
    assert tuple(caches) == NAMES and all(entries == () for entries in caches.values())
    with pytest.raises(TypeError):
        caches["sampling"] = ()


def test_single_plans_reported_kept_and_cleared(empty_caches):
    """A single prefill of the same lengths and options keeps one plan (same plan id); a decode adds its own;
    a bad cache name clears nothing; clearing one cache makes the next call plan again."""
    gen = torch.Generator().manual_seed(11)
    k, v = (torch.randn(40, 2, 64, generator=gen).half() for _ in range(2))

    def prefill():
        q = torch.randn(5, 4, 64, generator=gen).half()
        o = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
        assert_close(o, R.single_prefill_with_kv_cache(q.float(), k.float(), v.float(), causal=True))
        return fi.host_caches()["single_plans"]

    (first,) = prefill()
    (again,) = prefill()
    assert first.op == "single_prefill_with_kv_cache" and first.shapes == ((5, 4, 64), (40, 2, 64))
    assert first.dtypes == (torch.float16, torch.float16) and first.device == torch.device("cpu")
    assert first.layout is None and not first.bound and type(first.plan_id) is int and again == first
    qd = torch.randn(4, 64, generator=gen).half()
    o = fi.single_decode_with_kv_cache(qd, k, v)
    assert_close(o, R.single_decode_with_kv_cache(qd.float(), k.float(), v.float(), "NHD"))
    plans = fi.host_caches()["single_plans"]
    assert [(f.op, f.shapes[0]) for f in plans] == [(first.op, (5, 4, 64)), ("single_decode_with_kv_cache", (1, 4, 64))]
    for bad in (("single_plans", "no_such_cache"), (3,)):
        with pytest.raises(ValueError, match="names"):
            fi.clear_host_caches(*bad)
    fi.clear_host_caches("sampling", "merge_state")
    assert fi.host_caches()["single_plans"] == plans
    fi.clear_host_caches("single_plans")
    assert fi.host_caches()["single_plans"] == ()
    (replanned,) = prefill()
    assert replanned.plan_id != first.plan_id


def test_flash_attn_plans_reported(empty_caches):
    gen = torch.Generator().manual_seed(12)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q = torch.randn(8, 4, 32, generator=gen).half()
    k, v = (torch.randn(8, 2, 32, generator=gen).half() for _ in range(2))
    out = flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    for a, b in ((0, 3), (3, 8)):
        want, _ = R.attention(q[a:b].float(), k[a:b].float(), v[a:b].float(), causal=True)
        assert_close(out[a:b], want)
    (entry,) = fi.host_caches()["flash_attn"]
    assert entry.op == "flash_attn:ragged" and entry.dtypes == (torch.float16, torch.float16)
    assert entry.device == torch.device("cpu") and type(entry.plan_id) is int
    flash_attn_varlen_func(q, k, v, cu, cu, 5, 5, causal=True)
    assert fi.host_caches()["flash_attn"] == (entry,)
    fi.clear_host_caches("flash_attn")
    assert fi.host_caches()["flash_attn"] == ()


def test_tma_inputs_reported(empty_caches, monkeypatch):
    """An eager prefill launch under the work threshold records its K/V (pointer loads this time); a later launch
    over the same K/V finds them (descriptors then); the record names their shape and dtype."""
    from types import SimpleNamespace

    from flashinfer_triton import _prefill_impl

    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)  # (a CPU-only torch has none)
    cfg, small = _prefill_impl.PrefillConfig(32, 16, 4, 1), SimpleNamespace(work_flops=0.0)
    k, v = torch.empty(40, 2, 64, dtype=torch.float16), torch.empty(40, 2, 64, dtype=torch.float16)
    assert not _prefill_impl._tma_pays(cfg, small, k, v) and _prefill_impl._tma_pays(cfg, small, k, v)
    (entry,) = fi.host_caches()["tma_inputs"]
    assert entry.op == "prefill:tma" and entry.shapes == ((40, 2, 64),) and entry.dtypes == (torch.float16,)
    fi.clear_host_caches("tma_inputs")
    assert not _prefill_impl._tma_pays(cfg, small, k, v)  # forgotten: pointer loads again


def test_row_kernel_forms_reported_and_cleared(empty_caches, monkeypatch):
    """The norm, activation and rope launches bound per call form (``kernels/_row_forms.BoundForms``) are listed,
    cleared by name, and cleared on entering a configuration block: none serves a call under another configuration.
    The kernel's launch and binding are stand-ins (no GPU)."""
    import dataclasses

    from flashinfer_triton import _config
    from flashinfer_triton.kernels import _row_forms as rows
    from flashinfer_triton.kernels import norm as knorm

    class Fast:
        def run(self, *args, grid, warmup, **opts):
            return "compiled"

    monkeypatch.setattr(knorm._norm_forms, "fast", Fast())
    monkeypatch.setattr(rows, "bind", lambda fast, kernel, args, grid, n_lead: lambda *ptrs: True)
    monkeypatch.setattr(rows, "hooks_set", lambda: False)
    x = torch.randn(3, 64).half()
    w = torch.randn(64).half()
    on = dataclasses.replace(_config.HOST_PATH, fast_launch=True)
    with _config.using(host_path=on):
        knorm.launch_norm(x, None, w, None, torch.empty_like(x), 1e-6, 0.0, layernorm=False)
        (entry,) = fi.host_caches()["row_forms"]
        assert entry.op == "norm" and entry.bound and set(entry.dtypes) == {torch.float16}
        fi.clear_host_caches("row_forms")
        assert fi.host_caches()["row_forms"] == ()
        knorm.launch_norm(x, None, w, None, torch.empty_like(x), 1e-6, 0.0, layernorm=False)
        assert len(fi.host_caches()["row_forms"]) == 1
        with _config.using(norm=_config.NormConfig()):
            assert fi.host_caches()["row_forms"] == ()
