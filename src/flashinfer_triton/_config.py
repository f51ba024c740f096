"""Tuning of the kernel families, in one typed place.

Each family has one frozen dataclass: the tile shapes and launch settings a heuristic of the shapes and the
GPU chooses (no autotuning: Triton's interpreter, which runs the kernels in CI, cannot autotune). A plan
stores the configuration it was built with; tests and benchmarks pass their own configuration to the
implementation's ``plan()`` / launch functions instead of changing module state. The defaults and the
measurements behind them are in the design notes of each operation (``docs/``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class MergeConfig:
    """``merge_state(s)`` and the split-KV reductions (``kernels/merge.py``)."""

    # Streaming cache hints on the value loads (evict_first) and stores (.cs) of the merge_states kernels: the
    # states are read once and the output is read by someone else later. H100 (merge sweep): merge_states
    # 512 x 8 states 22.8 -> 19.8 us; the two-state kernel measured slower with them, so it has none.
    stream_hints: bool = True
    # Up to this many (row, head) pairs the states of a row are merged in parallel (one head per program).
    few_pairs: int = 8192
    # merge_states with 2..fixed_max_k states per row: the fixed-count kernel (every state's load issued before
    # the first use); more states: the online kernel. 0: the online kernel for every count.
    fixed_max_k: int = 16
    # The fixed-count kernel's tile: values per program over all states, values of one state per thread
    # (8 fp16 = one 16-byte load).
    fixed_tile_values: int = 4096
    fixed_values_per_thread: int = 8


MERGE = MergeConfig()


def merge_config() -> MergeConfig:
    """The merge kernels' configuration (one for every GPU measured so far)."""
    return MERGE
