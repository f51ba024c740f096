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


def test_ops_and_generic_tables(tmp_path):
    """bench_ops rows get one line per operation; other {case, ours_*, flashinfer_*, ratio} rows a generic table;
    rows without a ratio none."""
    run_all = _run_all()
    gpu = tmp_path / "Some-GPU"
    gpu.mkdir()
    ops = [
        {"op": "rmsnorm", "case": f"T={t}", "ours_us": us, "flashinfer_us": 5.0, "ratio": 5.0 / us}
        for t, us in ((1, 4.0), (32, 5.0), (256, 10.0))
    ]
    (gpu / "ops.json").write_text(json.dumps({"op": "ops", "date": "2026-01-02", "rows": ops}))
    fa = [{"case": "varlen 4x1024", "ours_ms": 0.5, "flashinfer_ms": 0.6, "ratio": 1.2}]
    (gpu / "flash_attn.json").write_text(json.dumps({"op": "flash_attn", "date": "2026-01-02", "rows": fa}))
    (gpu / "distributed.json").write_text(json.dumps({"op": "distributed", "rows": [{"case": "x", "ms": 1.0}]}))
    block = run_all.render_tables(str(tmp_path))
    assert "| `rmsnorm` | 3 | 4.0-10.0 | 0.50-1.25 | 1.00 |" in block
    assert "| varlen 4x1024 | 0.500 | 0.600 | 1.20 |" in block and "(time per call, ms)" in block
    assert "distributed" not in block
