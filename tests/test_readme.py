"""The README: its quick example runs as written (on the CPU here, on the GPU there), its first commands are
the two make targets, and its performance tables are those the results JSON gives."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import re

import pytest
import torch

import flashinfer_triton as fi
from flashinfer_triton import reference as R


def test_readme_quick_example_runs_and_is_right():
    text = (pathlib.Path(__file__).resolve().parents[1] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    assert blocks, "README has no python example"
    scope: dict = {}
    exec(compile(blocks[0], "README.md", "exec"), scope)
    o, lse = scope["o"], scope["lse"]
    eo, es = R.batch_decode_with_paged_kv_cache(
        scope["q"], scope["kv_cache"], scope["kv_indptr"], scope["kv_indices"], scope["kv_last_page_len"]
    )
    assert torch.allclose(o.float().cpu(), eo.cpu(), atol=2e-3, rtol=2e-3)
    assert torch.allclose(lse.cpu(), es.cpu(), atol=2e-3, rtol=2e-3)
    assert fi.BatchDecodeWithPagedKVCacheWrapper is scope["flashinfer"].BatchDecodeWithPagedKVCacheWrapper


# ----------------------------------------------------------------------------- install commands, perf tables

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _run_all():
    spec = importlib.util.spec_from_file_location("run_all", ROOT / "benchmarks" / "run_all.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_readme_first_commands_are_make_demo_and_make_test():
    text = (ROOT / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", text, re.S).group(1).splitlines()
    assert [line.split()[:2] for line in first[:2]] == [["make", "demo"], ["make", "test"]]


def test_readme_perf_tables_equal_what_the_json_gives():
    run_all = _run_all()
    text = (ROOT / "README.md").read_text()
    assert run_all.current_block(text) == run_all.render_tables(), "run: python3 benchmarks/run_all.py --tables-only"


def test_perf_tables_carry_the_json_numbers(tmp_path):
    """A changed result changes the README's table: the tables are computed, not copied."""
    run_all = _run_all()
    gpu = tmp_path / "results" / "Some-GPU"
    gpu.mkdir(parents=True)
    doc = json.loads(next((ROOT / "benchmarks" / "results").glob("*/decode.json")).read_text())
    doc["rows"] = doc["rows"][:1]
    doc["rows"][0].update(case="7x777 32/8", ours_ms=0.25, flashinfer_ms=0.5, ours_tbps=1.234)
    (gpu / "decode.json").write_text(json.dumps(doc))
    block = run_all.render_tables(str(tmp_path / "results"))
    assert "| 7x777 32/8 | 1.23 | " in block and "| 2.000 |" in block
    assert "Some-GPU" in block and "`python3 benchmarks/bench_decode.py" in block
    assert "Not measured yet: prefill, cascade, vllm, host" in block


def test_tables_only_rewrites_a_stale_readme_block(tmp_path):
    run_all = _run_all()
    readme = tmp_path / "README.md"
    readme.write_text(f"intro\n\n{run_all.BEGIN}\n| stale | 1 |\n{run_all.END}\n\nafter\n")
    assert run_all.main(["--check", "--readme", str(readme)]) == 1
    assert run_all.main(["--tables-only", "--readme", str(readme)]) == 0
    text = readme.read_text()
    assert "stale" not in text and text.startswith("intro\n") and text.endswith("\nafter\n")
    assert run_all.current_block(text) == run_all.render_tables()
    assert run_all.main(["--check", "--readme", str(readme)]) == 0
    readme.write_text("no markers\n")
    with pytest.raises(ValueError, match="perf:begin"):
        run_all.main(["--tables-only", "--readme", str(readme)])


def test_ops_flash_attn_and_distributed_tables(tmp_path):
    """bench_ops rows get one line per operation; flash_attn's kernel rows a table and its host-time row a line;
    distributed's rows one line per case across the GPU counts. A caption says what the JSON does not record
    (no date, no FlashInfer version) instead of inventing it."""
    run_all = _run_all()
    gpu = tmp_path / "Some-GPU"
    gpu.mkdir()
    ops = [
        {"op": "rmsnorm", "case": f"T={t}", "ours_us": us, "flashinfer_us": 5.0, "ratio": 5.0 / us}
        for t, us in ((1, 4.0), (32, 5.0), (256, 10.0))
    ]
    (gpu / "ops.json").write_text(json.dumps({"op": "ops", "date": "2026-01-02", "rows": ops}))
    fa = [
        {"case": "varlen 4x1024", "flash_attn_ms": 0.5, "ours_native_ms": 0.49, "flashinfer_ms": 0.6, "sdpa_ms": None,
         "ratio": 1.2},
        {"case": "host time, decode 8x64 on cuda", "direct_us": 11.0, "custom_op_us": 21.5,
         "flash_attn_with_kvcache_us": 30.25},
    ]  # fmt: skip
    meta = {"modes": ["kernels", "dispatch"], "heads": [16, 4], "head_dim": 64, "dtype": "bfloat16"}
    (gpu / "flash_attn.json").write_text(
        json.dumps({"op": "flash_attn", "date": "2026-01-02", "meta": meta, "rows": fa})
    )
    dist = [
        {"kind": "decode", "case": "2x8k", "ngpus": 1, "ms": 2.0, "speedup": 1.0},
        {"kind": "decode", "case": "2x8k", "ngpus": 2, "ms": 1.25, "speedup": 1.6, "comm_share": 0.125},
        {"kind": "prefill-causal", "case": "64k", "ngpus": 2, "ms": 120.4, "speedup": 1.9, "comm_share": 0.01},
    ]
    (gpu / "distributed.json").write_text(json.dumps({"op": "distributed", "nccl": "9.9.9", "rows": dist}))
    block = run_all.render_tables(str(tmp_path))
    assert "| `rmsnorm` | 3 | 4.0-10.0 | 0.50-1.25 | 1.00 |" in block
    assert "| varlen 4x1024 | 0.500 | 0.490 | 0.600 | - | 1.20 |" in block and "16/4 heads, D64, bfloat16" in block
    assert "- Host time, decode 8x64 on cuda: `run()` 11.0 us," in block and "custom op 21.5 us" in block
    assert "2026-01-02 · FlashInfer version not recorded · `python3 benchmarks/bench_flash_attn.py" in block
    assert "--mode kernels dispatch`</sub>" in block
    assert "| operation | case | 1 GPU ms | 2 GPUs ms | speedup | comm. share at 2 |" in block
    assert "| decode | 2x8k | 2.000 | 1.250 | 1.60x | 0.125 |" in block
    assert "| causal ring prefill | 64k | - | 120 | 1.90x | 0.010 |" in block
    caption = block[block.index("| causal ring prefill") :]
    assert "date not recorded · NCCL 9.9.9 · `torchrun" in caption and "FlashInfer" not in caption
