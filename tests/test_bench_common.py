"""The benchmarks' shared builders (benchmarks/_common.py): page tables and caches mean what they say."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest
import torch

from flashinfer_triton import reference as R
from flashinfer_triton.testing import ragged_lens

ROOT = pathlib.Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def common():
    spec = importlib.util.spec_from_file_location("bench_common", ROOT / "benchmarks" / "_common.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("page_size", [1, 5, 16])
def test_page_table_lengths_and_pages(common, page_size):
    kv_lens = [5, 16, 0, 33, 1]
    indptr, indices, last, num_pages = common.page_table(kv_lens, page_size, spare_pages=3, seed=7)
    assert indptr.dtype == indices.dtype == last.dtype == torch.int32
    assert R.get_seq_lens(indptr, last, page_size).tolist() == kv_lens
    assert num_pages == indptr[-1].item() + 3
    assert len(set(indices.tolist())) == indices.numel() and int(indices.max()) < num_pages
    again = common.page_table(kv_lens, page_size, spare_pages=3, seed=7)
    assert torch.equal(again[1], indices)  # reproducible from the seed


def test_paged_caches_shapes_and_rotation(common):
    caches = common.paged_caches(6, 4, 2, 8, torch.bfloat16, "cpu", count=3)
    assert len(caches) == 3 and all(k.shape == v.shape == (6, 4, 2, 8) for k, v in caches)
    assert all(k.dtype == torch.bfloat16 for k, _ in caches)
    assert not torch.equal(caches[0][0], caches[1][0])  # distinct copies to rotate past L2
    assert common.num_rotations(10 * common.L2_BYTES) == 2 and common.num_rotations(1) == 8


@pytest.fixture(scope="module")
def bench_prefill():
    spec = importlib.util.spec_from_file_location("bench_prefill", ROOT / "benchmarks" / "bench_prefill.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("qo,kv", [(7, 7), (3, 11), (11, 11), (1, 9)])
@pytest.mark.parametrize("causal,window_left", [(True, -1), (False, -1), (True, 0), (True, 4), (False, 3)])
def test_prefill_bench_counts_the_visible_pairs(bench_prefill, qo, kv, causal, window_left):
    """The FLOP count's pairs equal the keys the reference's mask keeps (bottom-right causal, window)."""
    i = torch.arange(qo)[:, None] + (kv - qo)
    j = torch.arange(kv)[None, :]
    keep = torch.ones(qo, kv, dtype=torch.bool)
    if causal:
        keep &= j <= i
    if window_left >= 0:
        keep &= j >= i - window_left
    assert bench_prefill._pairs(qo, kv, causal, window_left) == int(keep.sum())


def test_prefill_bench_cases(bench_prefill):
    names = [c.name for c in bench_prefill.CASES]
    assert len(set(names)) == len(names)
    ragged = [c for c in bench_prefill.CASES if c.kind == "ragged"]
    assert ragged and all(len(c.lens) == c.batch and 100 <= min(c.lens) <= max(c.lens) <= 4000 for c in ragged)
    assert ragged_lens(64, 100, 4000) == ragged[0].lens  # a fixed seed: the same batch every run
    fp8 = [c for c in bench_prefill.CASES if c.kv_type != c.dtype]
    assert fp8 and not any(bench_prefill.fa3_offered(c) for c in fp8)
    assert [c.name for c in bench_prefill.select_cases("D64,D256 causal bf16")] == [
        n for n in names if "D64" in n or "D256 causal bf16" in n
    ]


@pytest.mark.parametrize("form,layout,page_size", [("5d", "NHD", 4), ("tuple", "HND", 4), ("3d", "NHD", 1)])
def test_make_paged_nan_unused(common, form, layout, page_size):
    """``nan_unused``: NaN exactly in the slots no request owns; the dense copies stay finite."""
    kv_lens = [5, 8, 0, 3]
    cache, indptr, indices, last, ks, vs = common.make_paged(
        kv_lens, page_size, 2, 8, torch.float32, "cpu", layout=layout, form=form, spare_pages=2, nan_unused=True
    )
    kc = cache[:, 0] if form == "5d" else cache[0]
    if layout == "HND":
        kc = kc.transpose(1, 2)
    if form == "3d":
        kc = kc[:, None]
    owned = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(kv_lens):
        for j in range(n):
            owned[int(indices[int(indptr[b]) + j // page_size]), j % page_size] = True
    nan = torch.isnan(kc).any(-1).any(-1)
    assert torch.equal(nan, ~owned)
    assert all(torch.isfinite(k).all() and torch.isfinite(v).all() for k, v in zip(ks, vs, strict=True))


@pytest.mark.parametrize("fill", [None, -7])
def test_block_table_rows(common, fill):
    """Row b starts with request b's blocks, all distinct; the rest is ``fill`` or more distinct blocks."""
    from flashinfer_triton.testing import block_table

    kv_lens, bs = [9, 0, 4, 17], 4
    table, num_blocks = block_table(kv_lens, bs, max_blocks=6, spare_blocks=2, fill=fill, seed=5)
    assert table.shape == (4, 6) and table.dtype == torch.int32
    owned = [table[b, : -(-n // bs)].tolist() for b, n in enumerate(kv_lens)]
    flat = sum(owned, [])
    assert len(set(flat)) == len(flat) and all(0 <= x < num_blocks for x in flat)
    if fill is None:
        assert num_blocks == 4 * 6 + 2 and len(set(table.flatten().tolist())) == 24
    else:
        assert num_blocks == len(flat) + 2
        assert all(x == fill for b, n in enumerate(kv_lens) for x in table[b, -(-n // bs) :].tolist())
    with pytest.raises(ValueError, match="max_blocks"):
        block_table(kv_lens, bs, max_blocks=2)


def test_prefill_prebuild_calls_each_variant_with_its_backend(bench_prefill, monkeypatch, tmp_path):
    """--fi-build-only makes one FlashInfer call per variant, each with that variant's backend name."""
    seen = []

    def fake_fn(fi, case, inp, backend):
        seen.append((case.kind, backend))
        return lambda: None

    monkeypatch.setattr(bench_prefill, "flashinfer_fn", fake_fn)
    monkeypatch.setattr(bench_prefill, "make_inputs", lambda case: {})
    monkeypatch.setattr(bench_prefill.C, "import_flashinfer", lambda: object())
    monkeypatch.setattr(bench_prefill.torch.cuda, "synchronize", lambda: None)
    done = tmp_path / "done"
    bench_prefill.fi_build_only(str(done), True, None)
    assert done.read_text().startswith("done")
    variants = bench_prefill.fi_variants(True)
    assert len(seen) == len(variants) and {b for _, b in seen} == {"fa2", "fa3"}


class FakeFlashInfer:
    """Stands in for FlashInfer: each call records the JIT module FlashInfer 0.7.2 would build for it (its API,
    decode kind, dtypes and head dim; batch, heads and page size are runtime arguments there) and returns random
    data of the query's shape."""

    __name__ = "flashinfer"

    def __init__(self):
        self.modules = []

    def __getattr__(self, api):
        if api.startswith("__"):
            raise AttributeError(api)
        if api.endswith("Wrapper"):
            return lambda *args, **kw: _FakeWrapper(self, api, kw.get("use_tensor_cores", False))

        def call(*args, **kw):
            first = args[0]
            if first.dim() >= 2:  # an attention, merge or append call: its dtype and head dim
                self.modules.append((api, str(first.dtype), first.shape[-1]))
            return first.clone(), first.clone()

        return call


class _FakeWrapper:
    def __init__(self, fi, api, tc):
        self.fi, self.api, self.tc = fi, api, tc

    def plan(self, *args, **kw):
        head_dim = args[5] if "Decode" in self.api else args[6]
        dtypes = (str(kw.get("q_data_type", torch.float16)), str(kw.get("kv_data_type", kw.get("q_data_type"))))
        self.fi.modules.append((self.api, self.tc, head_dim, *dtypes))

    def plan_info(self):
        from types import SimpleNamespace

        return SimpleNamespace(fused=None)

    def run(self, q, *args, **kw):
        self.fi.modules.append((self.api + ".run", str(q.dtype)))
        return torch.randn(q.shape).to(q.dtype)


def _load_bench(name):
    spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _done(path):
    text = path.read_text()
    assert text.startswith("done in ") and text.rstrip().endswith(" 0 failed"), text
    return text


def test_decode_prebuild_builds_the_modules_the_table_uses(monkeypatch, tmp_path):
    """bench_decode --fi-build-only calls FlashInfer once per module, and requests exactly the modules (decode and
    tensor-core decode per dtype and head dim) that the timed table requests."""
    from types import SimpleNamespace

    bd = _load_bench("bench_decode")
    build = bd.build

    def small(case, device, seed=0):
        return build(bd.DecodeCase(*case)._replace(batch=2, kv_len=9), "cpu")

    monkeypatch.setattr(bd, "build", small)
    monkeypatch.setattr(bd, "time_ours", lambda case, data, ws: (1.0, torch.randn(data["q"].shape)))
    monkeypatch.setattr(bd.C, "bench", lambda fn, **kw: (fn(), 1.0)[1])
    timed = FakeFlashInfer()
    args = SimpleNamespace(cases=None, graph=False, sweep=False, sweep_cases=None, out=str(tmp_path))
    rows = bd.decode_table(args, timed, torch.device("cpu"), {})
    assert all("fi_ms" in r and "fi_tc_ms" in r for r in rows)

    built = FakeFlashInfer()
    monkeypatch.setattr(bd.C, "import_flashinfer", lambda: built)
    bd.fi_build_only(str(tmp_path / "done"), bd.CASES, device="cpu")
    _done(tmp_path / "done")
    assert set(built.modules) == set(timed.modules)
    plans = [m for m in built.modules if not m[0].endswith(".run")]
    assert len(plans) == len(set(plans)) == len(bd.fi_variants(bd.CASES)) == 6  # fp16/bf16 D128, bf16 D256; tc or not
    assert {(m[1], m[2]) for m in plans} == {(tc, d) for tc in (False, True) for d in (128, 256)}


def test_cascade_prebuild_builds_the_modules_the_run_uses(monkeypatch, tmp_path):
    """bench_cascade --fi-build-only: the cascade wrapper and both decodes at the rows' head dim and dtype, as the
    timed shared-prefix rows request them, and each merge function the merge rows call."""
    bc = _load_bench("bench_cascade")
    inputs = bc.shared_prefix_inputs

    def small(case, **kw):
        return inputs(case._replace(batch=2, shared=32, unique=5), device="cpu")

    monkeypatch.setattr(bc, "shared_prefix_inputs", small)
    empty = torch.empty
    monkeypatch.setattr(torch, "empty", lambda *a, device=None, **kw: empty(*a, **kw))  # its workspaces: on the CPU
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    for name in ("time_eager", "host_time_us"):
        monkeypatch.setattr(bc, name, lambda fn: (fn(), 1.0)[1])
    monkeypatch.setattr(bc, "time_graph", lambda fns: 1.0)
    monkeypatch.setattr(bc, "flashinfer_triton", FakeFlashInfer())  # ours out of the way: only FlashInfer's calls
    timed = FakeFlashInfer()
    rows = []
    bc.bench_cascade(timed, rows, context=False)
    assert len(rows) == 3 * len(bc.CASCADE_CASES)

    built = FakeFlashInfer()
    monkeypatch.setattr(bc, "load_flashinfer", lambda: built)
    bc.fi_build_only(str(tmp_path / "done"), device="cpu")
    _done(tmp_path / "done")
    merges = {("merge_states", "torch.float16", 128), ("merge_state_in_place", "torch.float16", 128)}
    assert {m for m in built.modules if m[0].startswith("merge")} == merges
    assert {m for m in built.modules if not m[0].startswith("merge")} == set(timed.modules)
    assert len(bc.fi_variants()) == 5 and len(bc.fi_variants(merge=False)) == 3 and not bc.fi_variants(False, False)


def test_host_prebuild_builds_the_modules_the_cases_use(monkeypatch, tmp_path):
    """bench_host --fi-build-only: one case per module key, together requesting every module the timed cases do
    (a key too coarse would leave one out: the 30-layer SmolLM2 steps are the only head dim 64)."""
    bh = _load_bench("bench_host")
    monkeypatch.setattr(bh, "kv_cache", lambda n, hkv, d, device, gen: torch.randn(1, 2, bh.PAGE, hkv, d).to(bh.DTYPE))
    monkeypatch.setattr(bh, "per_call_us", lambda fn, iters, device, warmup=10: (fn(), 1.0)[1])
    timed = FakeFlashInfer()
    assert len(bh.measure(timed, torch.device("cpu"), 1)) == len(bh.cases(None, "cpu", torch.Generator()))

    built = FakeFlashInfer()
    monkeypatch.setattr(bh.C, "import_flashinfer", lambda: built)
    bh.fi_build_only(str(tmp_path / "done"), torch.device("cpu"))
    _done(tmp_path / "done")
    assert set(built.modules) == set(timed.modules)
    variants = bh.fi_variants()
    assert len({k for k, _ in variants}) == len(variants) == 9
    # --only: the first selected case of each key (D128 decode and prefill now come from the Llama steps)
    assert len(bh.fi_variants("30-layer")) == 4 and len(bh.fi_variants("30-layer decode|merge")) == 3


_FAKE_BENCH = """
import os, sys, time
folder = os.path.dirname(os.path.abspath(__file__))
open(os.path.join(folder, "{op}.started"), "w").close()
t0 = time.time()  # every build-only process runs at once: each waits here until all have started
while not all(os.path.exists(os.path.join(folder, o + ".started")) for o in {ops!r}) and time.time() - t0 < 60:
    time.sleep(0.05)
assert sys.argv[1] == "--x" and sys.argv[2].endswith("-only"), sys.argv  # the run's arguments, then the mode
print("('{op}', 128): built in 1s")
print("('{op}', 256): FAILED RuntimeError: no kernel")
if sys.argv[2].startswith("--fi-"):
    with open(sys.argv[3], "w") as f:
        f.write("done in 1s: 1 built, 1 failed\\n")
"""
_FAKE_MODES = {"a": '"--fi-build-only"', "b": '"--prebuild-only"', "c": '"--timed-only"'}


def test_run_all_prebuild_runs_every_build_only_mode_at_once(monkeypatch, tmp_path, capsys):
    """run_all --prebuild starts each benchmark's build-only mode (with its run's arguments) in its own process,
    all at once, waits, and sums up each one's variant lines; a benchmark with no such mode is not run."""
    ra = _load_bench("run_all")
    for op, mode in _FAKE_MODES.items():
        code = _FAKE_BENCH.format(op=op, ops=["a", "b"]) + f"# takes {mode}\n"
        (tmp_path / f"bench_{op}.py").write_text(code)
    monkeypatch.setattr(ra, "HERE", str(tmp_path))
    monkeypatch.setattr(ra, "BENCHMARKS", [(op, f"bench_{op}.py", ["--x"]) for op in _FAKE_MODES])
    status = ra.prebuild(None, 120.0, str(tmp_path / "logs"))
    assert status == {"a": 0, "b": 0}
    assert not (tmp_path / "c.started").exists()
    out = capsys.readouterr().out
    assert "[prebuild] a: exit 0, 1 built, 1 failed; done in 1s: 1 built, 1 failed" in out
    assert "[prebuild] b: exit 0, 1 built, 1 failed" in out and "FAILED RuntimeError: no kernel" in out
    assert ra.main(["--prebuild", "--only", "b", "--prebuild-timeout", "120"]) == 0


def test_run_all_builds_flashinfer_before_timing(monkeypatch):
    """A run with FlashInfer builds its modules first; --no-flashinfer and --no-prebuild skip the builds."""
    ra = _load_bench("run_all")
    calls = []
    monkeypatch.setattr(ra, "prebuild", lambda only, timeout: calls.append(("prebuild", only)) or {})
    monkeypatch.setattr(ra, "run_benchmarks", lambda only, no_fi, timeout, out: calls.append(("run", only)) or {})
    monkeypatch.setattr(ra, "update_readme", lambda *a, **kw: True)
    assert ra.main(["--only", "decode,host"]) == 0
    assert calls == [("prebuild", {"decode", "host"}), ("run", {"decode", "host"})]
    for flag in ("--no-flashinfer", "--no-prebuild"):
        calls.clear()
        assert ra.main([flag]) == 0 and calls == [("run", None)]


@pytest.mark.gpu
def test_bench_keeps_host_time_out(common):
    """A call that spends 300 us on the host before a short kernel: do_bench's events time the host's wait,
    ``bench`` times the kernel (a copy of 4 MB, a few us)."""
    import time

    import triton.testing

    src = torch.randn(1 << 20, device="cuda")
    dst = torch.empty_like(src)

    def slow_host_call():
        t_end = time.perf_counter() + 300e-6
        while time.perf_counter() < t_end:
            pass
        dst.copy_(src)

    ours = common.bench(slow_host_call, warmup=5, rep=40)
    plain = triton.testing.do_bench(slow_host_call, warmup=5, rep=40, return_mode="median")
    kernel = common.bench(lambda: dst.copy_(src), warmup=5, rep=40)
    assert plain > 0.15, plain  # (the method's blind spot is real on this machine)
    assert ours < kernel + 0.03, (ours, kernel)
    assert torch.equal(dst, src)
