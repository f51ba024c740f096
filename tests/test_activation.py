"""``flashinfer_triton.activation`` against a float64 reference (paths as in ``test_norm``)."""

from __future__ import annotations

import math

import pytest
import torch

from conftest import HAS_CUDA, INTERPRET, assert_close, poison
from flashinfer_triton import activation

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
SMALL = [(1, 64), (3, 200), (2, 1536)]
LARGE = [(1, 1536), (32, 1536), (256, 1536), (512, 1536), (1, 14336), (32, 14336), (256, 14336)]
OPS = ["silu", "gelu", "gelu_tanh"]


def _paths():
    return [
        pytest.param("torch", SMALL, id="torch"),
        pytest.param("kernel", SMALL, id="kernel", marks=pytest.mark.interpret),
        pytest.param("gpu", LARGE, id="gpu", marks=pytest.mark.gpu),
    ]


def _device(path: str) -> str:
    if path == "torch":
        if INTERPRET:
            pytest.skip("CPU tensors run the interpreter kernel under TRITON_INTERPRET=1")
        return "cpu"
    return "cuda" if HAS_CUDA else "cpu"


def ref(x: torch.Tensor, op: str) -> torch.Tensor:
    x = x.double()
    h = x.shape[-1] // 2
    g, u = x[..., :h], x[..., h:]
    if op == "silu":
        a = g / (1 + torch.exp(-g))
    elif op == "gelu":
        a = 0.5 * g * (1 + torch.erf(g / math.sqrt(2)))
    else:
        a = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3)))
    return a * u


@pytest.mark.parametrize("path,shapes", _paths())
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul(path, shapes, dtype, op):
    dev = _device(path)
    fn = getattr(activation, f"{op}_and_mul")
    for b, h in shapes:
        x = (torch.randn(b, 2 * h, device=dev) * 3).to(dtype)
        out = poison(torch.empty(b, h, device=dev, dtype=dtype))
        assert fn(x, out=out) is out
        assert_close(out, ref(x, op), name=f"{op} {b}x{h}")
        assert_close(fn(x), ref(x, op), name=f"{op} {b}x{h} (new out)")


@pytest.mark.parametrize("path,shapes", _paths())
def test_act_and_mul_3d_and_strided(path, shapes):
    """Leading dimensions are flattened; a non-contiguous ``out`` is written through."""
    dev = _device(path)
    x = torch.randn(2, 3, 2 * 96, device=dev, dtype=torch.bfloat16)
    assert_close(activation.silu_and_mul(x), ref(x, "silu"), name="3-D silu")
    big = poison(torch.empty(2, 3, 200, device=dev, dtype=torch.bfloat16))
    out = big[..., 10:106]
    activation.gelu_tanh_and_mul(x, out=out)
    assert_close(out, ref(x, "gelu_tanh"), name="strided out")
    assert torch.isnan(big[..., :10].float()).all() and torch.isnan(big[..., 106:].float()).all()


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_forms_across_token_counts(op):
    """An engine's calls: the gate/up rows a view of wider rows, one token first (whose view's row stride a reshape
    would recompute), then more: each call of a kept call form (``_row_forms``, bound launches) matches the
    reference, with and without ``out``."""
    fn = getattr(activation, f"{op}_and_mul")
    for b in (1, 37, 1, 256, 5):
        x = (torch.randn(b, 2 * 1536 + 64, device="cuda") * 3).to(torch.bfloat16)[:, : 2 * 1536]
        assert_close(fn(x), ref(x, op), name=f"{op} b={b}")
        out = poison(torch.empty(b, 1536, device="cuda", dtype=torch.bfloat16))
        assert fn(x, out=out) is out
        assert_close(out, ref(x, op), name=f"{op} b={b} out")


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_column_tiles(op):
    """Several programs per row: tiles that divide the width (unmasked) and tiles with a masked tail."""
    from flashinfer_triton._config import ActivationConfig
    from flashinfer_triton.kernels.activation import launch_act_and_mul

    dev = "cuda" if HAS_CUDA else "cpu"
    for h, cfg, tile in (
        (96, ActivationConfig(block_max=64, block_min=32), (32, True)),  # 3 unmasked tiles a row
        (200, ActivationConfig(block_max=64), (64, False)),  # 4 tiles, the last one masked
    ):
        assert cfg.tile(h) == tile
        x = (torch.randn(3, 2 * h, device=dev) * 3).to(torch.bfloat16)
        out = poison(torch.empty(3, h, device=dev, dtype=torch.bfloat16))
        launch_act_and_mul(x, out, op, cfg=cfg)
        assert_close(out, ref(x, op), name=f"{op} 3x{h} tile {cfg.tile(h)}")


def test_layout_small_and_large():
    """The defaults: one row a program below ``large_min_elements`` (SmolLM2 at 1 and 32 tokens, Llama-3 at 1),
    tiles of several rows with 8 elements a thread from there (prefill, wide MLPs)."""
    from flashinfer_triton._config import ActivationConfig

    cfg = ActivationConfig()
    assert cfg.layout(32, 1536) == (1, 512, True, 4)
    assert cfg.layout(1, 14336) == (1, 1024, True, 8)
    assert cfg.layout(256, 1536) == (4, 512, True, 8)
    assert cfg.layout(32, 14336) == (2, 1024, True, 8)
    assert cfg.layout(8192, 1536) == (4, 512, True, 8)
    assert cfg.layout(8193, 1536) == (4, 512, False, 8)
    # at most the call's rows (rounded up to a power of two) a program
    assert ActivationConfig(large_min_elements=0).layout(3, 1536) == (4, 512, False, 8)
    assert ActivationConfig(large_min_elements=0).layout(1, 1536) == (1, 512, True, 2)


@pytest.mark.interpret
@pytest.mark.parametrize("op", OPS)
def test_act_and_mul_row_tiles(op):
    """Tiles of several rows (the large layout): rows that fill the last tile, rows that do not, masked columns."""
    from flashinfer_triton._config import ActivationConfig
    from flashinfer_triton.kernels.activation import launch_act_and_mul

    dev = "cuda" if HAS_CUDA else "cpu"
    for rows, h, cfg, layout in (
        (8, 96, ActivationConfig(block_max=32, large_min_elements=0, large_tile=128), (4, 32, True, 1)),
        (7, 96, ActivationConfig(block_max=32, large_min_elements=0, large_tile=128), (4, 32, False, 1)),
        (5, 200, ActivationConfig(block_max=64, large_min_elements=0, large_tile=256), (4, 64, False, 1)),
        (6, 64, ActivationConfig(block_max=64, large_min_elements=300, large_tile=256), (4, 64, False, 1)),
    ):
        assert cfg.layout(rows, h) == layout
        x = (torch.randn(rows, 2 * h, device=dev) * 3).to(torch.bfloat16)
        out = poison(torch.empty(rows, h, device=dev, dtype=torch.bfloat16))
        launch_act_and_mul(x, out, op, cfg=cfg)
        assert_close(out, ref(x, op), name=f"{op} {rows}x{h} layout {layout}")


@pytest.mark.gpu
@pytest.mark.parametrize("op", OPS)
def test_enable_pdl(op):
    """``enable_pdl=True`` (a programmatic dependent launch on sm_90+) gives the same results."""
    fn = getattr(activation, f"{op}_and_mul")
    for b, h in ((1, 14336), (32, 1536)):
        x = (torch.randn(b, 2 * h, device="cuda") * 3).to(torch.bfloat16)
        out = poison(torch.empty(b, h, device="cuda", dtype=torch.bfloat16))
        fn(x, out=out, enable_pdl=True)
        assert_close(out, ref(x, op), name=f"{op} pdl {b}x{h}")


def test_errors():
    x = torch.randn(4, 64)
    with pytest.raises(ValueError, match="input"):
        activation.silu_and_mul(torch.randn(4, 63))
    with pytest.raises(ValueError, match="out"):
        activation.silu_and_mul(x, out=torch.empty(4, 64))
    with pytest.raises(TypeError, match="out"):
        activation.gelu_and_mul(x, out=torch.empty(4, 32, dtype=torch.float16))
    with pytest.raises(TypeError, match="input"):
        activation.gelu_tanh_and_mul(x.long())
    with pytest.raises(TypeError, match="enable_pdl"):
        activation.silu_and_mul(x, enable_pdl=1)


def test_compiled_calls_check_and_pass_what_eager_does():
    """Inside compiled code (the custom op) ``out`` and ``enable_pdl`` are refused as eagerly (Dynamo reports the
    error it traced), and ``enable_pdl`` reaches the launch instead of being dropped for the configuration's default."""
    x = torch.randn(4, 64)
    torch._dynamo.reset()
    f = torch.compile(lambda x, o: activation.silu_and_mul(x, out=o), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="out: expected dtype float32"):
        f(x, torch.empty(4, 32, dtype=torch.float16))
    torch._dynamo.reset()
    with pytest.raises(Exception, match=r"out: expected shape \[4, 32\]"):
        f(x, torch.empty(4, 16))
    torch._dynamo.reset()
    g = torch.compile(lambda x: activation.gelu_and_mul(x, enable_pdl="yes"), backend="eager", fullgraph=True)
    with pytest.raises(Exception, match="enable_pdl: expected None or a bool"):
        g(x)
    assert "enable_pdl" in str(torch.ops.flashinfer_triton.act_and_mul.default._schema)
    torch._dynamo.reset()
    out = poison(torch.empty(4, 32))
    torch.compile(lambda x, o: activation.silu_and_mul(x, out=o, enable_pdl=True), backend="eager", fullgraph=True)(
        x, out
    )
    assert_close(out, torch.nn.functional.silu(x[:, :32].double()) * x[:, 32:].double(), name="compiled silu_and_mul")
