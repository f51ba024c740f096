"""The README's quick example runs as written (on the CPU here, on the GPU there)."""

from __future__ import annotations

import pathlib
import re

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
