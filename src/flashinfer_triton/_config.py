"""Tuning of the kernel families, in one typed place.

Each family has one frozen dataclass: the tile shapes and launch settings a heuristic of the shapes and the
GPU chooses (no autotuning: Triton's interpreter, which runs the kernels in CI, cannot autotune). A plan
stores the configuration it was built with; tests and benchmarks pass their own configuration to the
implementation's ``plan()`` / launch functions, or, where the public API reads a family's configuration itself,
swap it for the duration of a ``with using(family=config):`` block instead of assigning module state. The
defaults and the measurements behind them are in the design notes of each operation (``docs/``).

Every module reads a family's configuration as ``_config.FAMILY`` when it needs it (never ``from ._config import
FAMILY``, which would keep the default), so that ``using`` reaches it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from . import _env

_SMS: dict = {}
_CAPABILITY: dict = {}


def _index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of ``device``; 4 off CUDA (the interpreter: small, so that tests see splits)."""
    if device.type != "cuda":
        return 4
    key = _index(device)
    n = _SMS.get(key)
    if n is None:
        n = _SMS[key] = torch.cuda.get_device_properties(key).multi_processor_count
    return n


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for ints (``triton.cdiv`` costs microseconds per host call)."""
    return -(-a // b)


def next_pow2(n: int) -> int:
    """The next power of two >= n (1 for n <= 1), as ``triton.next_power_of_2`` but cheap on the host."""
    return 1 << (int(n) - 1).bit_length() if n > 1 else 1


def capability(device: torch.device) -> tuple[int, int]:
    """The CUDA compute capability of ``device`` ((0, 0) off CUDA), looked up once per device."""
    if device.type != "cuda":
        return (0, 0)
    key = _index(device)
    c = _CAPABILITY.get(key)
    if c is None:
        c = _CAPABILITY[key] = tuple(torch.cuda.get_device_capability(key))
    return c


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


@dataclass(frozen=True)
class PrefillConfig:
    """The Triton prefill kernel (``kernels/prefill.py``): tile shape, launch parameters and the plan's rules.

    ``_prefill_impl.choose_config`` picks the tile from the variant and the batch's largest query tile; the
    other fields keep their defaults there and exist so that tests and benchmarks can pass other values."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool | None = None  # None: tensor descriptors for ragged fp16/bf16 K/V on Hopper+ when they pay
    # The softmax exponent as one FMA per score (qk * qk_scale - m, the row maximum taken on the unscaled scores;
    # needs qk_scale > 0 and no soft cap / ALiBi). None: on except for 128x128 tiles. H100, same process: 64-row
    # tiles and 128x64 gain 1.5-3.6% (4k causal 0.330 -> 0.320 ms, D64 0.209 -> 0.203, paged 1.231 -> 1.193);
    # 128x128 w8 does not (8k/16k GQA causal 1-2% slower).
    fold_scale: bool | None = None
    # Hopper: the plan is for the Gluon kernel (kernels/prefill_sm90.py) when run()'s tensors qualify; otherwise
    # the Triton kernel runs it with the fields above.
    gluon: bool = False
    # Split KV: at most this many pieces per query tile (past that the merge costs more than the parallelism
    # brings; H100, 16 queries x 32768 keys 32/8: 8 pieces 0.0785 ms, 9 0.0765, 12 0.0769, 16 0.0806, 24 0.0912);
    # split_pieces > 0 forces the count (benchmarks).
    split_max_pieces: int = 12
    split_pieces: int = 0
    # Split KV only when the unsplit kernel would outlast the host time of the launch the split adds. Eager calls
    # of a few tiles are host-bound (back to back, a call's wall time is its host time while the kernel is
    # shorter), and a split adds the merge launch (~6 us of host time on the H100 machine's host: single prefill
    # 128 x 1024 causal 32/8 took 27.2 us split, against FlashInfer's one launch at 28.1). The unsplit grid's
    # time is about its longest tile's (one wave: the split only ever applies below one program per SM): the
    # tile's matrix work at ~3.4 TFLOP/s per SM (H100: 4 x 256 over 1024 causal, two waves of 128-row tiles of up
    # to 1024 keys, 40 us), or, for tiles of few rows, its K/V bytes at ~100 GB/s per SM. 80 MFLOP (~24 us, a
    # 128-row tile of 1221 keys at D128) or 1 MB (~10 us) is where the unsplit kernel's time nears the split
    # call's host time; a tile under both runs whole. Interpreter tiles use 0 (tests see splits at small sizes).
    split_min_tile_flops: float = 80e6
    split_min_tile_bytes: float = 1e6
    # Eager launches under this much matrix work (~100 us of kernel) take tensor descriptors only for K/V seen
    # before: encoding two descriptors costs 20-30 us of host time (128 queries x 1024 keys: 117 us per run()
    # with them, 45 without; the kernel 16.0 vs 18.6 us).
    tma_eager_min_flops: float = 40e9
    # sm_90+: the separate partial merge is a programmatic dependent launch of the attention launch.
    merge_pdl: bool = True

    def __post_init__(self):
        # Thresholds compared with >=: a NaN would silently turn the rule off, a negative one make it always hold.
        for name in ("split_min_tile_flops", "split_min_tile_bytes", "tma_eager_min_flops"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ValueError(f"PrefillConfig.{name}: expected a number >= 0, got {v!r}")


@dataclass(frozen=True)
class GluonPrefillConfig:
    """Which prefill plans take the Gluon kernel (``kernels/prefill_sm90.py``) on Hopper, and its launch."""

    enabled: bool = True
    # A request's query tile must fill the 128-row tile (rows = tokens x group).
    min_rows: int = 128
    # Head dims it takes (it supports 64, 128 and 256).
    head_dims: tuple[int, ...] = (64, 128, 256)
    # D64 runs three consumer warpgroups (192-row tiles, see consumers()) for GQA groups of at least this, and the
    # Triton kernel below it. H100, same process as FlashInfer fa3, TFLOP/s: 16384 32/8 causal (group 4) three
    # consumers 462, two 431, the Triton kernel 391, fa3 478; 4096 32/32 causal (group 1) the Triton kernel 332,
    # three consumers 312, two 326, fa3 342.
    d64_min_group: int = 2
    # GQA groups it takes (the kernel runs any of 1-16). The group's heads are packed head-major into the 128 rows
    # in runs of TILE_T tokens (see tile_tokens()). With TILE_T a multiple of 8 (a head's TMA copy must start on a
    # shared-memory swizzle atom), groups that do not divide 128 leave rows idle (3: 40 tokens = 120 rows, 5: 24 =
    # 120, 6: 16 = 96, 7: 16 = 112). H100, 4096 causal bf16 D128, those runs, TFLOP/s Gluon / Triton kernel: g3
    # 503 / 430, g5 497 / 421, g7 481 / 416, g6 425 / 426 (a quarter of its rows idle), so group 6 (timed only at
    # 16 tokens) and the unmeasured 9-15 stay on the Triton kernel.
    groups: tuple[int, ...] = (1, 2, 3, 4, 5, 7, 8, 16)
    # Paged K/V: one TMA copy per page of a 128-key tile (page size 1 would take 128 copies: the Triton kernel).
    page_sizes: tuple[int, ...] = (8, 16, 32, 64)
    # Registers per consumer warpgroup (the loader warp takes 24; the kernel is launched at maxnreg 168 over its
    # 12 warps, so the consumers get the rest); pages under 16 keys leave the loader 40 and the consumers 232.
    consumer_regs: int = 240
    # K/V ring depth: the consumers hold two tiles (scores of one, P @ V of the previous), so 2 buffers leave no
    # prefetch; 3 at D128 fill the 227 KB of shared memory (with the 32 KB query tile), 4 at D64.
    stages_d64: int = 4
    stages_d128: int = 3
    # D256: the 64 KB query tile leaves room for 2 stages of 64-key K and V tiles (32 KB each); its consumers
    # hold a 64 x 256 float32 accumulator (128 registers a thread). H100, 4096 16/16 causal bf16: 64-key tiles,
    # 2 stages 510 TFLOP/s; 32-key tiles, 4 stages 393; the Triton kernel 338.
    stages_d256: int = 2
    # The plan's tile (its block_n is the kernel's key tile); run() falls back to the Triton kernel with these
    # fields when the tensors do not fit the Gluon kernel's descriptors (at D256 with one stage: a 128 x 256
    # query tile and two 64-key K/V stages would not leave the Triton kernel its scratch in shared memory; 192-row
    # tiles: 256 rows, the smallest power of two that holds them).
    tile: PrefillConfig = PrefillConfig(128, 128, 8, 3, gluon=True)
    tile_d256: PrefillConfig = PrefillConfig(128, 64, 8, 1, gluon=True)
    tile_rows192: PrefillConfig = PrefillConfig(256, 128, 8, 2, gluon=True)
    # Batches of several requests (ragged K/V, D128, eager, unsplit, no custom mask) with at least this many units
    # (work item x KV head) per SM run on a persistent grid of one program per SM, on a static schedule the plan
    # computes (``_prefill_impl._persist_lists``, ``kernels/prefill_sm90_persist.py``), as FlashInfer's fa3 runs
    # batches: one-shot CTAs of ~10 KV tiles each pay their launch, pipeline fill and epilogue every time (ragged 64
    # x 100-4000 32/8: 262 CTAs an SM). H100, six ragged mixes: +0.2 to +15.8 % over the one-shot grid, geomean
    # +9.8 % (docs/prefill.md, "Persistent ragged schedule"). 0: every such plan; -1: none.
    persist_min_units_per_sm: int = 8
    # A single causal request at D128 or D256 runs on the persistent grid (its units dealt by LPT over estimated cost,
    # ``_prefill_impl._persist_single``) when it has at least one unit (work item x KV head) per SM and at most this
    # many: few waves of units of unequal length, where the one-shot grid dispatches each KV head's longest items
    # after the previous head's shortest and pays each CTA's set-up. H100, six 4096-token causal rows (D128 32/32,
    # D256 16/16, groups 5 and 7): +2.8 to +15.2 % over the one-shot grid, geomean +9.6 %; past it (8192 32/8:
    # 15.5 units an SM; 16384: 31) the persistent grid measured -1.1 to -1.9 % (docs/prefill.md, "Persistent
    # ragged schedule"). 0: never.
    persist_single_max_units_per_sm: int = 12

    def __post_init__(self):
        if type(self.d64_min_group) is not int or self.d64_min_group < 1:
            raise ValueError(f"GluonPrefillConfig: d64_min_group must be an int >= 1, got {self.d64_min_group!r}")
        if type(self.persist_min_units_per_sm) is not int or self.persist_min_units_per_sm < -1:
            got = self.persist_min_units_per_sm
            raise ValueError(f"GluonPrefillConfig: persist_min_units_per_sm must be an int >= -1, got {got!r}")
        if type(self.persist_single_max_units_per_sm) is not int or self.persist_single_max_units_per_sm < 0:
            got = self.persist_single_max_units_per_sm
            raise ValueError(f"GluonPrefillConfig: persist_single_max_units_per_sm must be an int >= 0, got {got!r}")

    def stages(self, head_dim: int) -> int:
        return self.stages_d64 if head_dim <= 64 else self.stages_d128 if head_dim <= 128 else self.stages_d256

    def consumers(self, head_dim: int) -> int:
        """Consumer warpgroups of the kernel (64 query rows each) at this head dim: three at D64 (a 192-row tile,
        FlashAttention-3's D64 tile: each K/V tile serves 1.5 times the rows of a 128-row tile, and 16 warps at
        128 registers leave the consumers 160), two above (their accumulators need 240 registers). run() launches
        three only where the plan's tile holds more than 128 rows: group 16 at D64 rounds to 8 tokens, 128 rows."""
        return 3 if head_dim <= 64 else 2

    def tile_for(self, head_dim: int) -> PrefillConfig:
        if head_dim > 128:
            return self.tile_d256
        return self.tile_rows192 if self.consumers(head_dim) == 3 else self.tile

    def tile_tokens(self, group: int, head_dim: int = 128, ragged: bool = False) -> int:
        """Query tokens of a tile of 64 x consumers rows (128 or 192): rows // group, rounded down to a multiple of
        8 when that is not a power of two, so that each head's rows are one or more TMA copies landing on the
        8-row swizzle atom. ``ragged`` (ragged K/V) with two consumers: rows // group exactly (groups 3, 5, 6, 7:
        42, 25, 21, 18 tokens, 125-126 rows busy instead of 120, 120, 96, 112); such runs are off the atom, so the
        consumers load their own query rows by pointer loads (``kernels/prefill_sm90.py``'s ``_load_q_rows``).
        H100, 4096 causal bf16 D128 beside FlashInfer's fa3 in one process, runs rounded to 8 / exact: group 7
        (28/4) 485 / 505 TFLOP/s, group 5 (40/8) 484 / 493 (docs/prefill.md). Paged K/V and the three-consumer
        D64 kernel keep the copies (not timed by rows)."""
        t = 64 * self.consumers(head_dim) // group
        if t & (t - 1) == 0 or (ragged and self.consumers(head_dim) == 2):
            return t
        return t // 8 * 8


GLUON_PREFILL = GluonPrefillConfig(enabled=_env.GLUON)


@dataclass(frozen=True)
class GluonDecodeConfig:
    """Which decode plans take the Gluon kernel (``kernels/decode_sm90.py``: TMA copies of whole pages into a ring
    of shared memory, one loader warp, one consumer warpgroup, the split merge fused) on Hopper, and its launch."""

    # "split": eager plans that split the KV; eager plans left whole with B x Hkv between 1 and the split rule's
    # split_min_waves programs per SM (its split_waves of one program per SM already spread them: H100, 64 x 4096
    # 28/4, 256 programs, the Triton kernel 202 us against FlashInfer's 197); eager plans at the head dims of
    # all_plans_head_dims; every CUDA-graph plan (the captured kernel serves later re-plans, split or not). "all":
    # every plan it covers; "none": never. "split" because batches that fill the GPU measured even with the Triton
    # kernel at D128 (H100, back to back: 128 x 2048 360.9 vs 362.0 us, 64 x 4096 32/32 1419.0 vs 1412.8) while
    # split rows gain (1 x 32768 32/8: 51.7 vs 55.0 us); "all" lets tests run it on every batch, "none" is
    # FLASHINFER_TRITON_GLUON=0.
    plans: str = "split"
    block_n: int = 64  # keys per ring buffer (whole pages)
    stages: int = 3  # ring depth: 3 x 2 x 16 KB at D128, two programs per SM
    loader_regs: int = 32
    # 8 warps (4 + the loader, padded) x 128 registers: two programs per SM; the consumer then sets 232.
    maxnreg: int = 128
    page_sizes: tuple[int, ...] = (8, 16, 32, 64)
    # Split plans for the Gluon kernel aim at one program per SM (2 for the Triton kernel). H100, back to back:
    # 1 x 32768 32/8 51.7 us at 1 vs 54.1 at 2 (Triton kernel 55.0), 16 x 8192 184.6 vs 187.4 (Triton 184.9).
    split_waves: float = 1.0
    # Head dims it takes. Over 128 the consumer's 64 x 256 float32 accumulator and its 64 x 256 query operand need
    # more than 128 registers a thread for one wgmma (ptxas asks for 158), so D256 launches at maxnreg_d256: one
    # program per SM, with a ring of stages_d256 x block_n_d256 keys (4 x 32 keys: 128 KB, no spills; 64-key
    # tiles spill 96 B). H100, bf16 16/16 D256, us, FlashInfer's best 719 / 1425: 16 x 8192 (256 programs) 717 at
    # 4 x 32 keys, 726 at 6 x 32, 750 at 3 x 64, 725 split into 512 programs; the Triton kernel 779 (2 pieces a
    # request), 725 with 64-key tiles over 2 stages. 64 x 4096: 1419 at 4 x 32 keys, 1437 at 6 x 32, 1466 at
    # 3 x 64; the Triton kernel 1524.
    head_dims: tuple[int, ...] = (64, 128, 256)
    all_plans_head_dims: tuple[int, ...] = (256,)
    block_n_d256: int = 32
    stages_d256: int = 4
    maxnreg_d256: int = 168

    def tile(self, head_dim: int) -> tuple[int, int, int]:
        """(keys per ring buffer, ring depth, launch register cap) at ``head_dim``."""
        if head_dim > 128:
            return self.block_n_d256, self.stages_d256, self.maxnreg_d256
        return self.block_n, self.stages, self.maxnreg


GLUON_DECODE = GluonDecodeConfig(plans="split" if _env.GLUON else "none")


@dataclass(frozen=True)
class DecodeConfig:
    """The Triton decode kernel (``kernels/decode.py``): tiles, launch and the planner's split and merge rules.

    ``_decode_impl.choose_config`` picks the tiles from the shapes; the other fields keep their defaults there and
    exist so that tests and benchmarks can pass other values."""

    block_n: int
    block_m: int
    block_d: int
    use_dot: bool
    num_warps: int
    num_stages: int
    # Split rule: no split when B * Hkv programs already cover split_min_waves x SMs; otherwise chunks of the
    # total visible keys over split_target_waves x SMs programs (at least min_chunk keys, whole key tiles).
    split_min_waves: float = 2.0
    split_target_waves: float = 2.0
    min_chunk: int = 256
    # A split request's chunks are evened out (8192 keys in chunks of 3976 left a last one of 240; evened, three
    # of 2752: 16 x 8192 211.7 -> 197 us); fixed_split_size keeps exact chunks.
    # Split requests are merged inside the decode launch (the last chunk to finish merges; a separate merge
    # launch left run()'s host time inside the step: 1 x 32768 164 us eager against 68 replayed). The merge
    # loads merge_block_k states per step (unrolled), at most merge_max_k and at most merge_tile float32 values
    # (states x heads x D) in flight in the merging program.
    merge_tile: int = 8192
    merge_max_k: int = 16
    # Key tiles wholly inside a work item's range without key masks, then one masked tail tile (used without
    # RoPE, with 16-bit KV and head_dim 64 or 128; else every tile masked). H100, graph replays: 1 x 32768 +1.2%
    # (fp16) / +1.4% (bf16), every other row of the decode table within +-0.3%.
    whole_tiles: bool = True
    # Register cap of the whole-tile launch (0: none): uncapped, whole tiles take 156 registers at 32/8 D128 (3
    # programs per SM instead of 4) and measured 2-15% slower on unsplit batches; capped at 128, no spills.
    maxnreg: int = 128
    gluon: GluonDecodeConfig = GluonDecodeConfig(plans="none")


@dataclass(frozen=True)
class VllmDecodeConfig:
    """The vLLM-layout decode kernel (``kernels/vllm_decode.py``); ``_vllm_impl.default_config`` picks the tiles from
    the head dim and the query dtype, the other fields keep their defaults there."""

    block_n: int = 64  # keys per tile (rounded up to the block size: full tiles load whole blocks)
    num_warps: int = 4
    num_stages: int = 3
    maxnreg: int | None = 128  # register cap (None: the compiler's choice)
    # v1 may cut long sequences into chunks merged in the launch when the batch alone leaves the GPU idle: the CSR
    # decode planner's rule, no split once num_seqs x Hkv programs cover split_min_waves waves of SMs, else chunks
    # aimed at split_target_waves waves, at least min_chunk keys.
    split_v1: bool = True
    split_min_waves: float = 2.0
    split_target_waves: float = 2.0
    min_chunk: int = 256
    # The fused merges (v1's chunks, v2's partitions) load up to merge_max_k states per step (unrolled) and at most
    # merge_tile float32 values (states x heads x D) in flight in the merging program.
    merge_tile: int = 8192
    merge_max_k: int = 16


@dataclass(frozen=True)
class CascadeConfig:
    """The fused cascade plan (``cascade.py``): every level in one prefill launch plus one merge launch."""

    # The longest KV piece is about 1 / (split_waves x SMs) of the batch's KV work (at least 4 KV tiles), so a long
    # shared level is cut and the short per-request levels are not (``bench_cascade.py --variants`` times several
    # values; H100 figures in docs/cascade.md) ...
    split_waves: float = 4
    # ... unless the partial states' merge traffic would pass this share of the K/V bytes the tiles read.
    merge_share: float = 0.15
    # The fused tile is chosen as for this many query rows (smaller tiles waste less on one-query levels, larger
    # ones reread the shared prefix less often). None: as for the batch's largest query tile.
    tile_rows: int | None = None
    # False: every plan takes the per-level path (one prefill per level merged in place, as CUDA-graph plans do), so
    # that benchmarks can time it beside the fused plan on the same batch.
    fused: bool = True


CASCADE = CascadeConfig()


@dataclass(frozen=True)
class PageConfig:
    """The page-table kernels (``kernels/page.py``)."""

    append_tile: int = 2048  # elements one append program moves per tensor (K or V): 8 heads x 128 dims
    index_block: int = 1024  # entries per program of the index kernels (batch indices / positions, seq lens)


PAGE = PageConfig()


@dataclass(frozen=True)
class QuantizationConfig:
    """The bit-packing kernels of ``packbits`` / ``segment_packbits`` (``kernels/packbits.py``)."""

    pack_block: int = 256  # output bytes per program


QUANTIZATION = QuantizationConfig()


@dataclass(frozen=True)
class HostPathConfig:
    """How the decode wrapper's re-plan reads a page table that lives on the device."""

    # CUDA-graph re-plans with the page indices on the device (an engine's step): "lazy" leaves their range
    # unreduced while no eager run() reads it (a graph replay never does): an eager run() after such a plan
    # reduces them then and waits for that read (the first run() only), and the plans after it reduce at plan()
    # again. "plan": every plan() queues the reduction (a min/max kernel, a copy and an event).
    graph_page_range: str = "lazy"
    # Eager re-plans with indptr / last_page_len on the device: page-index tensors of at most this many entries are
    # read back in the same device-to-host copy as the lengths (one cat, no min/max kernel) and their range checked
    # on the host; longer ones (and all with 0) are reduced on the device (aminmax) into that copy.
    device_index_read: int = 1 << 14
    # Launch through the compiled kernel directly once a call form has run (``_launch.FastKernel``), on the Triton
    # releases that path is tested with; off: Triton's own launcher everywhere. The interpreter has no compiled
    # kernels: always off there.
    fast_launch: bool = _env.FAST_LAUNCH and not _env.INTERPRET


HOST_PATH = HostPathConfig()


@dataclass(frozen=True, eq=False)
class SamplingConfig:
    """How the sampling kernels split a row into chunks and size the candidate search, and how top-p alone runs its
    rejection rounds. The chunk and search defaults are the best of an H100 sweep beside FlashInfer 0.7.2
    (docs/ops.md): probabilities softmax(3 * randn) at top-p 0.9 / top-k 50, vocabularies 49152 and 128256, batch
    1, 32 and 256. The rejection rounds' counts (``topp_proposals``, ``topp_rounds``) come from a float64 model of
    the rounds, the batch from which three proposals run (``topp_three_proposals_min_batch``) from an H100 A/B at
    batch 48-256; their launch shapes from an H100 sweep of the same rows (peaked and flat).

    Compared by identity (``eq=False``): every launch plan's key holds the configuration object itself, which
    hashes at C speed; two equal configurations only build their plans twice."""

    chunk_min: int = 2048  # chunk length at least (tests pass 256 to see many chunks on small rows)
    # Chunk length at most, every row-split pass (filtered chunks are one tile, held in registers whole). 4096 was
    # the best of 1024-16384: softmax at batch 256 (8192+: V=49152 63.5 us, 4096: 60.6), top-p (8192: V=128256
    # B=256 261.8 us, 4096: 232.4), top-k (more, shorter programs hide more load latency).
    chunk_max: int = 4096
    max_chunks: int = 128  # chunks per row at most (the finish holds one partial per chunk in registers)
    # Candidate slots per row, shared by its chunks. 8192: the band of a flat row (softmax of 2 * randn, about 4400
    # elements at top-p 0.9) fits, V=128256 B=32 117.7 us where 4096 slots overflowed to 1388; peaked rows (bands
    # of tens to a thousand) lost 0-2 us when the finish read the whole slot region; it reads the filled slots
    # only. A band over the slots takes the second level.
    cand_slots: int = 8192
    pivots: int = 16  # pivots of the counting pass for top-k alone (a binade apart)
    # With top-p (at most 256): fine pivots keep wide nuclei's bands within the slots. 128 (4 a binade) gained 5%
    # at batch 256 and lost 15-20% at batch 1 and 32.
    pivots_p: int = 256
    # Binades below the max that the top-p grid spans (pivots_p // binades_p a binade): a row whose threshold lies
    # further down takes the exact row-wise search, and the elements below the grid bound the mass only loosely
    # (16 binades at 8 a binade: top-p V=128256 B=256 1402 us, against 222 at 4 a binade over 32). Tests shorten it.
    binades_p: int = 32
    # [candidates, 8 pivots] cells a search pass of the finish holds in registers: up to search_cells // 8
    # candidates are searched there, more from L2 (16384 at 16 warps: top-p B=32 +15%, top-k B=1 3.5x slower).
    search_cells: int = 8192
    # Tile of the finish's exact fallback (the row-wise search over the whole row, rarely taken): its [tile, 8]
    # pivot cells set the finish's registers. 1024 at 8 warps compiles to 128 registers a thread on sm_90, two
    # programs an SM; 2048 took 238, one program an SM, so batch 256 ran the finish in two waves.
    finish_block: int = 1024
    # Launch the row-split kernels as programmatic dependent launches (sm_90+; what softmax's enable_pdl=None does
    # too): each waits for the previous kernel before touching memory, so only the launches overlap. H100: top-p
    # batch 1 V=128256 39.8 -> 33.5 us, V=49152 31.9 -> 26.6; top-k batch 1 25.2 -> 20.4; batch 256 3-7% faster.
    pdl: bool = True
    # Top-p alone draws by rejection rounds, one program a row (kernels/sampling.py, _topp_reject_kernel; the
    # algorithm in docs/ops.md). Proposals a round: 2 makes a second round rare (at top-p 0.9 about 2% of rows
    # against 14% with FlashInfer's 1, in a float64 model), and a batch waits for its slowest row; each proposal
    # adds two pivot sums (3 instructions an element) to the pass over the row that every round makes anyway.
    # This is the count below topp_three_proposals_min_batch rows.
    topp_proposals: int = 2
    # From this many rows on (0: never), three proposals a round (topp_proposals_at). A call waits for its slowest
    # row, and at top-p 0.9 a batch meets a row that needs a second round in 63% of calls at 96 rows with two
    # proposals, in 9% with three (float64 model); the third costs two more pivot sums an element and a sampling
    # pass to the last of three targets (3/4 of a row against 2/3). H100 against two, kernel medians: batch 96
    # V=49152 32.3 us against 39.6, batch 128 34.3 against 43.6 (V=128256 68.7 against 88.3), batch 256 1.09-1.18x
    # faster; at 48 and 64 rows, where the second round is rarer, three lose (0.87-0.91x); hence 80.
    topp_three_proposals_min_batch: int = 80
    # Rounds before the exact threshold takes over inside the same program (a row-wise search: slow but bounded).
    # At top-p >= 0.9 rows take 1-2 rounds, at 0.05-0.3 at most 6 in a float64 model; a row takes
    # topp_rounds * (proposals a round) + 1 uniforms, so more rounds cost only generator draws.
    topp_rounds: int = 16
    # Warps and tile rows (a tile is [rows, warps * 128]: 4 consecutive floats a thread, 16-byte loads) at a batch
    # of at least one row an SM: 8 warps of [4, 1024], capped at 128 registers a thread so that two programs share
    # an SM (sm_90: float32 rows compile to 128 with no stack under the cap). H100, batch 256: V=128256 122.7 us
    # (16 warps 125.4, [2, 1024] 134.4, [8, 1024] 133.4, 4 warps 137-165), V=49152 60.1 (next best 61.4).
    topp_warps: int = 8
    topp_tile_rows: int = 4
    # Below one row an SM, one program has an SM to itself: 32 warps of [1, 4096]. The sampling pass stops at the
    # tile where the running sum crosses the targets, so a short tile reads less past the sample; more threads keep
    # the loads in flight. H100, batch 1 / 32: V=49152 22.9 / 25.6 us, V=128256 38.6 / 45.7, the same on flat rows
    # (16 warps of [8, 2048]: 37-38 / 40, 50 / 55; 16 warps of [4, 2048] 25-39 / 26-46, unsteady between runs).
    topp_warps_small_batch: int = 32
    topp_tile_rows_small_batch: int = 1
    # The pass over the whole row: >= 2 stages its tiles through that many shared-memory buffers with cp.async
    # (Triton's loop pipeliner: tiles in flight without registers); 0 keeps the next tile's loads in registers
    # (one tile ahead). The sampling pass exits early, a loop the pipeliner leaves alone: it always prefetches one
    # tile in registers.
    topp_stages: int = 3
    # Round 0 split over several programs a row (kernels/sampling.py, topp_split_chunk): at most this many rows
    # (0: never), each in chunks of at least topp_split_chunk entries (a power of two), every row's chunks fitting one
    # wave (at most SMs // batch a row, at least two). The chunk passes run tiles of [topp_split_tile_rows,
    # topp_split_warps * 128], pipelined through topp_stages buffers; the later rounds keep the shape above.
    # H100, split / one program a row, us (peaked rows; flat alike): batch 1 V=49152 16.3 / 22.0, V=128256
    # 16.5 / 38.1; batch 4 16.6 / 24.1, 18.4 / 42.4; batch 16 24.0 / 25.1, 39.0 / 44.1; at batch 32 and 64 the
    # split lost on some rows (V=49152: 38.6 / 35.9 at 32, 56.8 / 26.9 at 64), so it stops at 16.
    topp_split_max_batch: int = 16
    topp_split_chunk: int = 4096
    topp_split_warps: int = 8
    topp_split_tile_rows: int = 4
    # Softmax of rows that fit one program's registers: one program a row holds it whole (pieces of 16 entries a
    # thread, at most three: 48 float32 values a thread, 64 registers at 32 warps, compiled for sm_90 without
    # spills), so the row is read once and written once, against two reads and a write on the row-split path
    # (kernels/sampling.py, softmax_rows_shape). Rows of at most softmax_rows_max_vocab entries (0: never; at most
    # 49152, three pieces at 32 warps) at batches of at least softmax_rows_min_batch: below, the row-split path's
    # many programs a row keep more SMs busy (H100 over 49152 entries, rows / row-split: batch 256 45.8 / 59.7 us,
    # 64 18.7 / 19.0, 32 15.3 / 13.6, 1 12.0 / 7.7).
    softmax_rows_max_vocab: int = 49152
    softmax_rows_min_batch: int = 64
    # Softmax of rows longer than the registers' path takes, at batches of at least softmax_rowpass_min_batch (0:
    # never): persistent programs of 32 warps, softmax_rowpass_programs_per_sm an SM, a row at a time in two passes,
    # the write pass backwards with evict-first loads and stores and no cp.async stages (cp.async carries no eviction
    # hint), so that about as many rows are in flight as L2 holds and the second read of a row hits L2. H100 against
    # the row-split path over 128256 entries: 74.1 against 77.3 us at batch 128, 141.6 against 146.9 at 256 (bf16:
    # 98.0 against 112.7), but 42.1 against 22.7 at batch 32 and 39.0 against 8.2 at batch 1 (too few programs to
    # fill the SMs), hence 128, the smallest batch measured to win.
    softmax_rowpass_min_batch: int = 128
    softmax_rowpass_programs_per_sm: int = 1
    # The pivot pass of top-p's rejection rounds reads the row's prefix that the sampling pass just read first, most
    # recent tile first, then the rest, at batches of at least topp_pivot_recent_first_min_batch (below: the whole row
    # in index order). With two programs an SM and more, the prefixes of all rows together pass the size of an H100's
    # L2 (256 rows x 49152 x 4 B = 50 MB), and reading the oldest tile first evicts the ones read next. H100, in order
    # against most recent first: 4-5% faster at batch 256 over 49152 and 128256 entries (peaked and flat rows alike);
    # at 128 between -7.6% and +3.9% by row, at 64 -0.6% to +2%, at 32 2-3% slower; hence 256. The order is a runtime
    # select on the grid's size in one compiled kernel, so both orders cost one compile.
    topp_pivot_recent_first_min_batch: int = 256

    def __post_init__(self):
        # The pivot grids are tl.arange ranges (powers of two); with top-p the grid spans binades_p binades at
        # pivots_p // binades_p a binade, and the band pass holds a row's [chunks, pivots] counts in registers up
        # to 256. The other sizes are tile widths: powers of two as well (a chunk is one tile of a warp per 1024
        # elements: 32768 is the 32 warps a program may have).
        top = min(32, self.pivots_p) if type(self.pivots_p) is int else 32  # (at least a pivot a binade)
        for name, lo, hi in (("pivots", 2, 256), ("pivots_p", 32, 256), ("binades_p", 1, top),
                             ("cand_slots", 16, 65536), ("search_cells", 64, 65536), ("finish_block", 64, 4096),
                             ("chunk_min", 16, 32768), ("chunk_max", 16, 16384)):  # fmt: skip
            v = getattr(self, name)
            if type(v) is not int or v < lo or v > hi or v & (v - 1):
                raise ValueError(f"SamplingConfig.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        # (the chunk count divides the row: 0 would fail at the first call; pdl picks the launch kind, so a
        # non-bool such as "off" would be taken as True)
        if type(self.max_chunks) is not int or self.max_chunks < 1:
            raise ValueError(f"SamplingConfig.max_chunks: expected an int >= 1, got {self.max_chunks!r}")
        if type(self.pdl) is not bool:
            raise TypeError(f"SamplingConfig.pdl: expected a bool, got {type(self.pdl).__name__}")
        # (top-p alone: one or two proposals a round below the three-proposal rule's batch, the kernels holding up to
        # three; the round count sizes the uniforms,
        # 0 leaving the exact fallback alone; warps and tile rows are tl.arange extents, powers of two; stages are
        # the pipeliner's buffers, 1 being no buffering at all)
        if type(self.topp_proposals) is not int or self.topp_proposals not in (1, 2):
            raise ValueError(f"SamplingConfig.topp_proposals: expected 1 or 2, got {self.topp_proposals!r}")
        if type(self.topp_three_proposals_min_batch) is not int or self.topp_three_proposals_min_batch < 0:
            v = self.topp_three_proposals_min_batch
            raise ValueError(
                f"SamplingConfig.topp_three_proposals_min_batch: expected an int >= 0 (0: never), got {v!r}"
            )
        if type(self.topp_rounds) is not int or not 0 <= self.topp_rounds <= 64:
            raise ValueError(f"SamplingConfig.topp_rounds: expected an int in [0, 64], got {self.topp_rounds!r}")
        for name, lo, hi in (("topp_warps", 1, 32), ("topp_warps_small_batch", 1, 32), ("topp_tile_rows", 1, 16),
                             ("topp_tile_rows_small_batch", 1, 16)):  # fmt: skip
            v = getattr(self, name)
            if type(v) is not int or v < lo or v > hi or v & (v - 1):
                raise ValueError(f"SamplingConfig.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        if type(self.topp_stages) is not int or self.topp_stages not in (0, 2, 3, 4):
            raise ValueError(f"SamplingConfig.topp_stages: expected 0, 2, 3 or 4, got {self.topp_stages!r}")
        # (the split chunk is a tl.arange extent's multiple and the tile a power of two; 128 entries is one warp's
        # tile, the smallest)
        if type(self.topp_split_max_batch) is not int or not 0 <= self.topp_split_max_batch <= 4096:
            raise ValueError(
                f"SamplingConfig.topp_split_max_batch: expected an int in [0, 4096], got {self.topp_split_max_batch!r}"
            )
        for name, lo, hi in (("topp_split_chunk", 128, 1 << 20), ("topp_split_warps", 1, 32),
                             ("topp_split_tile_rows", 1, 16)):  # fmt: skip
            v = getattr(self, name)
            if type(v) is not int or v < lo or v > hi or v & (v - 1):
                raise ValueError(f"SamplingConfig.{name}: expected a power of two in [{lo}, {hi}], got {v!r}")
        # (three pieces of 16 entries a thread at 32 warps, the most a program holds in 64 registers a thread)
        if type(self.softmax_rows_max_vocab) is not int or not 0 <= self.softmax_rows_max_vocab <= 49152:
            v = self.softmax_rows_max_vocab
            raise ValueError(f"SamplingConfig.softmax_rows_max_vocab: expected an int in [0, 49152], got {v!r}")
        if type(self.softmax_rows_min_batch) is not int or self.softmax_rows_min_batch < 1:
            raise ValueError(
                f"SamplingConfig.softmax_rows_min_batch: expected an int >= 1, got {self.softmax_rows_min_batch!r}"
            )
        if type(self.softmax_rowpass_min_batch) is not int or self.softmax_rowpass_min_batch < 0:
            v = self.softmax_rowpass_min_batch
            raise ValueError(f"SamplingConfig.softmax_rowpass_min_batch: expected an int >= 0, got {v!r}")
        if type(self.softmax_rowpass_programs_per_sm) is not int or not 1 <= self.softmax_rowpass_programs_per_sm <= 4:
            raise ValueError(
                "SamplingConfig.softmax_rowpass_programs_per_sm: expected an int in [1, 4], got "
                f"{self.softmax_rowpass_programs_per_sm!r}"
            )
        if type(self.topp_pivot_recent_first_min_batch) is not int or self.topp_pivot_recent_first_min_batch < 1:
            v = self.topp_pivot_recent_first_min_batch
            raise ValueError(f"SamplingConfig.topp_pivot_recent_first_min_batch: expected an int >= 1, got {v!r}")

    def topp_proposals_at(self, batch: int) -> int:
        """Proposals a round of top-p alone's rejection rounds for ``batch`` output rows: three from
        ``topp_three_proposals_min_batch`` rows on, else ``topp_proposals``. The kernels and the PyTorch path both
        take it, so a row's uniforms (``topp_rounds`` times it, plus one) mean the same draws on either."""
        m = self.topp_three_proposals_min_batch
        return 3 if 0 < m <= batch else self.topp_proposals


SAMPLING = SamplingConfig()


def pdl_launch(enable_pdl: bool | None, device: torch.device, default: bool) -> bool:
    """Whether a launch on ``device`` is a programmatic dependent launch: ``enable_pdl`` (None: ``default``), for
    compiled kernels on sm_90+ only (older GPUs and the interpreter launch plainly: the results are the same)."""
    want = default if enable_pdl is None else enable_pdl
    return bool(want) and device.type == "cuda" and not _env.INTERPRET and capability(device)[0] >= 9


def _pow2_warps(block: int, per_thread: int, lo: int, hi: int) -> int:
    """Warps for a ``block``-element tile at ``per_thread`` elements a thread, a power of two in [lo, hi]."""
    w = max(1, block // (32 * per_thread))
    return max(lo, min(hi, 1 << (w.bit_length() - 1)))


@dataclass(frozen=True)
class NormConfig:
    """The row-normalisation kernel (``kernels/norm.py``): one program per row, the whole row in registers."""

    # Elements a thread holds (8 bf16 / fp16 make one 16-byte load); the warps of a row are the tile over 32 x this,
    # between min_warps and max_warps (16: 8 warps for a 4096-wide row, 2 for 576).
    per_thread: int = 16
    min_warps: int = 1
    max_warps: int = 16
    # What ``enable_pdl=None`` does: launch as a programmatic dependent launch (sm_90+), FlashInfer's default. The
    # kernel waits for the previous kernel's writes before its first load; only its launch overlaps that kernel's
    # end (in do_bench, where an event separates the two, H100 times were the same within noise).
    pdl: bool = True

    def warps(self, block: int) -> int:
        return _pow2_warps(block, self.per_thread, self.min_warps, self.max_warps)


NORM = NormConfig()


@dataclass(frozen=True)
class ActivationConfig:
    """The gated-activation kernel (``kernels/activation.py``): a program covers a tile of rows by columns,
    ``layout(rows, width)``: one row of ``block`` columns for small calls, several rows for large ones."""

    # The column tile is the largest power of two dividing the width (unmasked), between block_min and block_max; a
    # width without such a divisor takes a masked tile of its next power of two (at most block_max).
    block_max: int = 1024
    block_min: int = 256
    # Small calls (rows x width below large_min_elements): one row a program, per_thread elements a thread per
    # operand (4 bf16: one 8-byte load): a 512-wide tile takes 4 warps, a 1024-wide one 8. H100 (benchmarks' bench,
    # best of 3, us) against 2048-wide tiles of 8 a thread (the previous tiles), SmolLM2 (intermediate 1536:
    # 512-wide tiles) at 1 / 32 / 256 tokens: SiLU 4.35 / 4.70 / 5.57 against 4.58 / 4.86 / 5.63, GELU 4.38 / 4.93 /
    # 5.63 against 4.74 / 5.41 / 5.89; Llama-3 (14336): SiLU 4.51 / 5.79 / 13.28 against 4.54 / 5.92 / 13.02, GELU
    # 4.58 / 6.02 / 13.31 against 5.22 / 6.24 / 13.12. At 16 elements a thread (2048-wide tiles at most, on a
    # quarter of the warps) 11 of the 12 rows were slower still.
    per_thread: int = 4
    max_warps: int = 8
    # Large calls (rows x width from large_min_elements on: prefill, and wide MLPs from 32 tokens): a program covers
    # large_tile elements, as large_tile / block rows of the column tile, large_per_thread elements a thread per
    # operand (8 bf16: one 16-byte load). The small layout there runs many short programs of one 8-byte access a
    # thread (24576 programs of 128 threads for 8192 x 1536), too few bytes in flight an SM to stream at full
    # bandwidth. H100, FlashInfer's time / ours in a CUDA graph of 50 back-to-back calls (bf16; fp16 alike), small
    # layout -> this one: SmolLM2's 1536-wide MLP at 256 / 2048 / 8192 / 16384 tokens SiLU 0.72 / 0.43 / 0.81 / 0.84
    # -> 1.07 / 1.13 / 1.00 / 0.98, GELU 0.89 / 0.62 / 0.87 / 0.86 -> 1.08 / 0.95 / 1.04 / 1.01; Llama-3's 14336 at
    # 256 tokens SiLU 0.78 -> 1.13, from 2048 tokens on both 0.98-1.04 (bandwidth-bound). Below 2^18
    # elements (1 and 32 tokens of 1536) the one-row programs stay ahead (SiLU 0.94-1.09 against 0.87-1.02). Tiles
    # of 4096 elements at 8 a thread (16 warps) came within 1-3% of these; 16 a thread lost 2-25% (fewer
    # programs, each with more serial work).
    large_min_elements: int = 1 << 18
    large_tile: int = 2048
    large_per_thread: int = 8
    large_max_warps: int = 8
    pdl: bool = True  # what ``enable_pdl=None`` does (sm_90+), as NormConfig.pdl

    def tile(self, width: int) -> tuple[int, bool]:
        """(columns per program, whether they divide ``width``)."""
        b = self.block_max
        while b >= self.block_min:
            if width % b == 0:
                return b, True
            b //= 2
        b = min(1 << max(0, (width - 1).bit_length()), self.block_max)
        return b, width % b == 0

    def warps(self, block: int) -> int:
        """Warps of a one-row tile of ``block`` columns (the small layout)."""
        return _pow2_warps(block, self.per_thread, 1, self.max_warps)

    def layout(self, rows: int, width: int) -> tuple[int, int, bool, int]:
        """(rows per program, columns per program, whether both divide the call's, warps) of a ``rows x width``
        call: the small layout below ``large_min_elements``, else the large one (at most ``rows`` rounded up to a
        power of two rows a program)."""
        block, even = self.tile(width)
        if rows * width < self.large_min_elements:
            return 1, block, even, self.warps(block)
        tile_rows = min(max(1, self.large_tile // block), 1 << max(0, (rows - 1).bit_length()))
        warps = _pow2_warps(tile_rows * block, self.large_per_thread, 1, self.large_max_warps)
        return tile_rows, block, even and rows % tile_rows == 0, warps


ACTIVATION = ActivationConfig()


@dataclass(frozen=True)
class RopeConfig:
    """The rotary-embedding kernel (``kernels/rope.py``): a program rotates a tile of heads of one token."""

    # Rotated pairs per program at most (heads x rotary_dim / 2); a token's query and key heads share the tiles, and
    # a thread holds per_thread pairs: SmolLM2's 9 + 3 heads of 64 are one program of 4 warps per token, Llama-3's
    # 32 + 8 heads of 128 five programs of 8 heads. H100 (do_bench, us), 256 tokens: 4.48 (SmolLM2) and 6.43
    # (Llama-3) against 5.12 and 7.17 at 1024 pairs and 8 a thread.
    tile_pairs: int = 512
    per_thread: int = 4
    max_warps: int = 8

    def warps(self, pairs: int) -> int:
        return _pow2_warps(pairs, self.per_thread, 1, self.max_warps)


ROPE = RopeConfig()


@dataclass(frozen=True)
class DistributedConfig:
    """How the context-parallel combine (``distributed.py``) picks its collective for ``combine="auto"``."""

    # All-gather the packed states while the gathered tensor (world_size copies of [rows, heads, D + 1] float32)
    # stays under this size: below it one collective's latency beats the two or three of the reduce-scatter path;
    # above it the reduce-scatter moves world_size times fewer bytes.
    allgather_max_bytes: int = 4 << 20


DISTRIBUTED = DistributedConfig()


# using()'s keywords: family -> (the module attribute holding its configuration, the configuration's type)
_FAMILIES: dict[str, tuple[str, type]] = {
    "merge": ("MERGE", MergeConfig),
    "gluon_prefill": ("GLUON_PREFILL", GluonPrefillConfig),
    "gluon_decode": ("GLUON_DECODE", GluonDecodeConfig),
    "cascade": ("CASCADE", CascadeConfig),
    "page": ("PAGE", PageConfig),
    "quantization": ("QUANTIZATION", QuantizationConfig),
    "host_path": ("HOST_PATH", HostPathConfig),
    "sampling": ("SAMPLING", SamplingConfig),
    "norm": ("NORM", NormConfig),
    "activation": ("ACTIVATION", ActivationConfig),
    "rope": ("ROPE", RopeConfig),
    "distributed": ("DISTRIBUTED", DistributedConfig),
}


def families() -> dict[str, object]:
    """The configuration in effect for each family, keyed by ``using``'s keyword (``{"merge": MergeConfig(...),
    ...}``): the defaults, or what an enclosing ``using`` block swapped in. A new dict on each call; every family
    is a frozen dataclass of its own class, which is the type ``using`` requires for it."""
    g = globals()
    return {family: g[attr] for family, (attr, _) in _FAMILIES.items()}


class using:  # lower case: used as ``with _config.using(cascade=...):``
    """Swap the configuration of one or more kernel families for the duration of a ``with`` block: one keyword
    per family (``merge``, ``gluon_prefill``, ``gluon_decode``, ``cascade``, ``page``, ``quantization``,
    ``host_path``, ``sampling``, ``norm``, ``activation``, ``rope``, ``distributed``), each an instance of that
    family's configuration class. Blocks nest; leaving one (also by an exception) restores what was in effect
    when it was entered.

    What ``plan()`` reads from a family (the cascade split, the Gluon kernel choice, how a re-plan reads a device
    page table) stays with that plan: a wrapper planned inside the block keeps it after the block, one planned
    before keeps its own, and so does the launch a plan bound at its first ``run()``. What a call reads (sampling,
    norm, the launch path of a call not bound yet, ...) follows the block. The per-call-form host caches
    (``host_caches()``: plans and bound launches of the functions without a plan step) are cleared on entering
    and on leaving, so that no call form built under one configuration serves a call under another. The swap is
    process-wide, not per-thread: for tests and benchmarks, not for changing a serving process's tuning while it
    runs.

    Raises TypeError, before changing anything, for an unknown family or a value of another type."""

    __slots__ = ("_new", "_saved")

    def __init__(self, **configs):
        new = {}
        for family, config in configs.items():
            entry = _FAMILIES.get(family)
            if entry is None:
                raise TypeError(f"using(): unknown configuration family {family!r}; families: {', '.join(_FAMILIES)}")
            attr, cls = entry
            if not isinstance(config, cls):
                raise TypeError(f"using(): {family} must be a {cls.__name__}, got {type(config).__name__}")
            new[attr] = config
        self._new = new
        self._saved: list[dict] = []

    def __enter__(self) -> using:
        g = globals()
        self._saved.append({attr: g[attr] for attr in self._new})
        _forget_call_forms()
        g.update(self._new)
        return self

    def __exit__(self, *exc) -> None:
        globals().update(self._saved.pop())
        _forget_call_forms()


def _forget_call_forms() -> None:
    from ._caches import clear_host_caches

    clear_host_caches()
