"""``_config.using``: the configuration of a kernel family swapped for a ``with`` block, restored after it (also
after an exception), nesting; bad input refused before anything changes; every family reachable by it."""

from __future__ import annotations

import dataclasses
import pathlib
import re

import pytest
import torch

import flashinfer_triton as fi
from conftest import assert_close
from flashinfer_triton import _config
from flashinfer_triton import reference as R
from flashinfer_triton._config import CascadeConfig, HostPathConfig, SamplingConfig

SRC = pathlib.Path(fi.__file__).parent


def _current():
    return _config.families()


def test_using_swaps_restores_and_nests():
    before = _current()
    outer = CascadeConfig(merge_share=1e9)
    inner = CascadeConfig(fused=False)
    hp = HostPathConfig(graph_page_range="plan", device_index_read=0)
    with _config.using(cascade=outer) as ctx:
        assert isinstance(ctx, _config.using)
        assert _config.CASCADE is outer and _config.HOST_PATH is before["host_path"]
        with _config.using(cascade=inner, host_path=hp):
            assert _config.CASCADE is inner and _config.HOST_PATH is hp
        assert _config.CASCADE is outer and _config.HOST_PATH is before["host_path"]
    assert _current() == before and _config.CASCADE is before["cascade"]


def test_using_restores_after_an_exception_and_is_reusable():
    before = _config.SAMPLING
    cfg = SamplingConfig(chunk_min=256)
    override = _config.using(sampling=cfg)
    with pytest.raises(RuntimeError, match="inside"), override:
        assert _config.SAMPLING is cfg
        raise RuntimeError("inside")
    assert _config.SAMPLING is before
    with override:  # the same object entered again, and nested inside itself
        with override:
            assert _config.SAMPLING is cfg
        assert _config.SAMPLING is cfg
    assert _config.SAMPLING is before


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"cascades": CascadeConfig()}, "unknown configuration family 'cascades'"),
        ({"CASCADE": CascadeConfig()}, "unknown configuration family 'CASCADE'"),
        ({"cascade": HostPathConfig()}, "cascade must be a CascadeConfig, got HostPathConfig"),
        ({"host_path": {"fast_launch": False}}, "host_path must be a HostPathConfig, got dict"),
        ({"merge": None}, "merge must be a MergeConfig, got NoneType"),
    ],
)
def test_using_rejects_bad_families_before_changing_anything(kwargs, match):
    before = _current()
    with pytest.raises(TypeError, match=match):
        _config.using(**{"cascade": CascadeConfig(fused=False), **kwargs})  # a good family beside the bad one
    assert _current() == before


def test_every_family_reachable():
    """Every module-level configuration of ``_config`` is a family of ``using`` (of its own type), and no module
    imports a family's configuration by name (the imported default would not see the swap)."""
    configs = {
        name: type(value)
        for name, value in vars(_config).items()
        if name.isupper() and dataclasses.is_dataclass(value) and not isinstance(value, type)
    }
    current = _config.families()
    assert configs == {family.upper(): type(config) for family, config in current.items()}
    for family, config in current.items():
        new = type(config)()  # each keyword takes its own class; families() reports the swap
        with _config.using(**{family: new}):
            assert _config.families()[family] is new and _config.families()[family] is not config
        assert _config.families()[family] is config
    imports = re.compile(r"from \.+_config import (\([^)]*\)|[^\n]*)")
    offenders = [
        f"{path.relative_to(SRC)}: {m.group(0)}"
        for path in SRC.rglob("*.py")
        for m in imports.finditer(path.read_text())
        if set(re.findall(r"\w+", m.group(1))) & set(configs)
    ]
    assert offenders == []


def test_using_clears_call_form_caches_on_entry_and_exit():
    """A single-request plan kept before the block does not serve calls inside it, nor one kept inside the
    block calls after it (either may have been built under another configuration)."""
    gen = torch.Generator().manual_seed(3)
    k, v = (torch.randn(24, 2, 32, generator=gen).half() for _ in range(2))

    def call():
        q = torch.randn(3, 4, 32, generator=gen).half()
        o = fi.single_prefill_with_kv_cache(q, k, v, causal=True)
        assert_close(o, R.single_prefill_with_kv_cache(q.float(), k.float(), v.float(), causal=True))
        return fi.host_caches()["single_plans"]

    fi.clear_host_caches()
    try:
        (outside,) = call()
        with _config.using(host_path=dataclasses.replace(_config.HOST_PATH, device_index_read=0)):
            assert fi.host_caches()["single_plans"] == ()
            (inside,) = call()
            assert inside.plan_id != outside.plan_id
        assert fi.host_caches()["single_plans"] == ()
        (after,) = call()
        assert after.plan_id not in (inside.plan_id, outside.plan_id)
    finally:
        fi.clear_host_caches()


@pytest.mark.parametrize(
    "fields,exc",
    [(dict(max_chunks=0), ValueError), (dict(max_chunks=-4), ValueError), (dict(max_chunks=8.0), ValueError),
     (dict(pdl="off"), TypeError), (dict(pdl=1), TypeError), (dict(pdl=None), TypeError),
     (dict(chunk_min=65536), ValueError)],
)  # fmt: skip
def test_sampling_config_rejects_bad_chunk_count_and_pdl(fields, exc):
    """The chunk count divides a row (0 would fail inside the first call), ``pdl`` picks the launch kind (a string
    such as "off" would be taken as on) and a chunk is one tile of a warp per 1024 elements (65536 would launch 64
    warps, past the 32 a program may have): all refused by name when the configuration is made."""
    with pytest.raises(exc, match=next(iter(fields))):
        SamplingConfig(**fields)
    assert SamplingConfig(max_chunks=3, pdl=False, chunk_min=32768).pdl is False


@pytest.mark.parametrize(
    "fields",
    [dict(topp_proposals=0), dict(topp_proposals=3), dict(topp_proposals=2.0), dict(topp_proposals=True),
     dict(topp_rounds=-1), dict(topp_rounds=65), dict(topp_rounds=16.0), dict(topp_warps=0), dict(topp_warps=6),
     dict(topp_warps=64), dict(topp_warps_small_batch=12), dict(topp_tile_rows=3), dict(topp_tile_rows=32),
     dict(topp_tile_rows_small_batch=0), dict(topp_tile_rows_small_batch="8"), dict(topp_stages=1),
     dict(topp_stages=5), dict(topp_stages=None), dict(topp_three_proposals_min_batch=-1),
     dict(topp_three_proposals_min_batch=80.0), dict(topp_three_proposals_min_batch=True),
     dict(topp_three_proposals_min_batch=None)],
)  # fmt: skip
def test_sampling_config_rejects_topp_rounds_the_kernel_cannot_run(fields):
    """Top-p alone's rejection rounds: one or two proposals a round below the three-proposal rule's batch (an int,
    0 turning the rule off; three is the rule's alone); the round count sizes each row's uniforms (0: the exact
    fallback alone); warps and tile rows are tile extents, powers of two; stages are the pipeliner's shared-memory
    buffers (0: none, registers only). Anything else is refused by name when the configuration is made, not failed
    to compile or miscounted at the first call."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingConfig(**fields)
    ok = SamplingConfig(topp_proposals=1, topp_rounds=0, topp_warps=4, topp_warps_small_batch=32, topp_tile_rows=1,
                        topp_tile_rows_small_batch=16, topp_stages=0)  # fmt: skip
    assert (ok.topp_proposals, ok.topp_rounds, ok.topp_stages) == (1, 0, 0)
    assert SamplingConfig(topp_rounds=64, topp_stages=4).topp_rounds == 64
    assert SamplingConfig(topp_three_proposals_min_batch=0).topp_proposals_at(4096) == 2
    assert SamplingConfig(topp_three_proposals_min_batch=1).topp_proposals_at(1) == 3


@pytest.mark.parametrize(
    "fields",
    [dict(topp_split_max_batch=-1), dict(topp_split_max_batch=4097), dict(topp_split_max_batch=8.0),
     dict(topp_split_max_batch=True), dict(topp_split_chunk=64), dict(topp_split_chunk=3000),
     dict(topp_split_chunk=1 << 21), dict(topp_split_warps=0), dict(topp_split_warps=12), dict(topp_split_warps=64),
     dict(topp_split_tile_rows=3), dict(topp_split_tile_rows=32), dict(topp_split_tile_rows="4")],
)  # fmt: skip
def test_sampling_config_rejects_topp_split_shapes_the_kernels_cannot_run(fields):
    """Top-p alone's split round 0: a batch bound (0: never split), a chunk length and a tile that are powers of two
    (whole tiles a chunk, tl.arange extents). Anything else is refused by name when the configuration is made."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingConfig(**fields)
    ok = SamplingConfig(topp_split_max_batch=0, topp_split_chunk=128, topp_split_warps=32, topp_split_tile_rows=16)
    assert (ok.topp_split_max_batch, ok.topp_split_chunk) == (0, 128)
    assert SamplingConfig(topp_split_max_batch=4096, topp_split_chunk=1 << 20).topp_split_chunk == 1 << 20


@pytest.mark.parametrize("field", ["split_min_tile_flops", "split_min_tile_bytes", "tma_eager_min_flops"])
@pytest.mark.parametrize("bad", [float("nan"), -1.0, "1e6", True], ids=["nan", "negative", "str", "bool"])
def test_prefill_config_rejects_thresholds_a_comparison_would_misread(field, bad):
    from flashinfer_triton._config import PrefillConfig

    with pytest.raises(ValueError, match=f"PrefillConfig.{field}"):
        PrefillConfig(128, 128, 8, 3, **{field: bad})
    assert getattr(PrefillConfig(128, 128, 8, 3, **{field: 0.0}), field) == 0.0


@pytest.mark.parametrize(
    "fields",
    [dict(softmax_rows_max_vocab=-1), dict(softmax_rows_max_vocab=49153), dict(softmax_rows_max_vocab=4096.0),
     dict(softmax_rows_min_batch=0), dict(softmax_rows_min_batch="64"), dict(softmax_rowpass_min_batch=-1),
     dict(softmax_rowpass_min_batch=1.5), dict(softmax_rowpass_programs_per_sm=0),
     dict(softmax_rowpass_programs_per_sm=5), dict(topp_pivot_recent_first_min_batch=0),
     dict(topp_pivot_recent_first_min_batch=True), dict(topp_pivot_recent_first_min_batch=128.0)],
)  # fmt: skip
def test_sampling_config_rejects_softmax_and_pivot_rules_the_kernels_cannot_run(fields):
    """Softmax with rows in registers holds at most three pieces of 16 entries a thread at 32 warps (49152 entries: 0
    turns it off), from a batch of at least 1; the row pass is off at 0 and runs 1-4 programs an SM; top-p's pivot
    pass reads most recent first from a batch of at least 1. Anything else is refused by name when the configuration
    is made."""
    with pytest.raises(ValueError, match=next(iter(fields))):
        SamplingConfig(**fields)
    ok = SamplingConfig(softmax_rows_max_vocab=0, softmax_rows_min_batch=1, softmax_rowpass_min_batch=0,
                        softmax_rowpass_programs_per_sm=4, topp_pivot_recent_first_min_batch=1)  # fmt: skip
    assert (ok.softmax_rows_max_vocab, ok.softmax_rowpass_programs_per_sm, ok.topp_pivot_recent_first_min_batch) == (
        0, 4, 1)  # fmt: skip
    d = SamplingConfig()  # (the rules' measured defaults)
    assert (d.softmax_rows_max_vocab, d.softmax_rows_min_batch) == (49152, 64)
    assert (d.softmax_rowpass_min_batch, d.softmax_rowpass_programs_per_sm, d.topp_pivot_recent_first_min_batch) == (
        128, 1, 256)  # fmt: skip
