"""An attention implementation for transformers (5.x) models, backed by this library's kernels.

::

    from flashinfer_triton.integrations import transformers as fit
    fit.register()                                   # registers "flashinfer_triton" (the default name)
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation="flashinfer_triton")
    model.generate(...)                               # dense / padded batches
    model.generate_batch(inputs, generation_config)   # continuous batching on transformers' paged cache

The name contains "flash", so transformers treats it as a FlashAttention-style implementation: its masks
are the 2-D padding masks (or None), and continuous batching passes packed sequences (``cu_seq_lens_q/k``)
with its paged cache in the keyword arguments. The function then

* continuous batching: writes the new keys and values with ``cache.update`` (transformers' own paged cache,
  which returns each sequence's keys packed) and runs :func:`flash_attn_varlen_func` (our batch prefill over
  ragged K/V); when transformers hands a block table instead (its decode fast path), the new tokens are
  appended into the paged cache and attended by :func:`flash_attn_with_kvcache` (our paged decode);
* ``generate`` with padding: unpads with the mask and runs the varlen function; without: :func:`flash_attn_func`.

The default name has no "2" or "3" after "flash": transformers would otherwise try to load a FlashAttention 2/3
kernel of that name for its decode fast path.
"""

from __future__ import annotations

import inspect
import weakref

import torch

from ..flash_attn import flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache

DEFAULT_NAME = "flashinfer_triton"

__all__ = ["DEFAULT_NAME", "attention_forward", "register"]


def _window(sliding_window, causal: bool):
    if sliding_window is None or sliding_window <= 0:
        return (-1, -1)
    return (sliding_window - 1, 0 if causal else sliding_window - 1)


def _check_no_sinks(module, s_aux) -> None:
    if s_aux is not None or getattr(module, "sinks", None) is not None:
        raise ValueError("s_aux: attention sinks are not supported by the flashinfer_triton attention implementation")


def attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    is_causal: bool | None = None,
    s_aux: torch.Tensor | None = None,
    cache=None,
    **kwargs,
):
    """transformers' attention-function contract: ``query [B, H, S, D]``, ``key, value [B, Hkv, Sk, D]``;
    returns ``(out [B, S, H, D], None)``."""
    _check_no_sinks(module, s_aux)
    if query.is_cuda and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            "flashinfer_triton attention cannot be captured in a CUDA graph (each step plans on the host): "
            "pass continuous_batching_config=ContinuousBatchingConfig(use_cuda_graph=False) to generate_batch"
        )
    if cache is not None:  # continuous batching: transformers' paged cache, written here
        key, value = _cache_update(cache, module, key, value, kwargs)
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    opts = dict(softmax_scale=scaling, causal=causal, window_size=_window(sliding_window, causal),
                softcap=softcap or 0.0)  # fmt: skip
    batch = query.shape[0]
    q = query.transpose(1, 2)  # [B, S, H, D]
    k = key.transpose(1, 2)
    v = value.transpose(1, 2)
    cu_q, cu_k = kwargs.get("cu_seq_lens_q"), kwargs.get("cu_seq_lens_k")
    max_q = kwargs.get("max_length_q", kwargs.get("max_seqlen_q"))
    max_k = kwargs.get("max_length_k", kwargs.get("max_seqlen_k"))
    if isinstance(cu_k, dict):  # per layer type (transformers before 5.23 leaves the choice to the function)
        layer_type = "sliding_attention" if getattr(module, "sliding_window", None) else "full_attention"
        cu_k, max_k = cu_k[layer_type], max_k[layer_type]
    block_table, k_cache, v_cache = kwargs.get("block_table"), kwargs.get("k_cache"), kwargs.get("v_cache")
    if block_table is not None and k_cache is not None and v_cache is not None and cu_k is not None:
        # decode fast path: one new token per sequence, lengths before the append from the packed lengths
        n = k.shape[0] * k.shape[1]
        cache_seqlens = (cu_k[1 : n + 1] - cu_k[:n] - 1).to(torch.int32)
        out = flash_attn_with_kvcache(
            q.reshape(n, 1, *q.shape[2:]), k_cache, v_cache,
            k.reshape(n, 1, *k.shape[2:]), v.reshape(n, 1, *v.shape[2:]),
            cache_seqlens=cache_seqlens, block_table=block_table.to(torch.int32), **opts,
        )  # fmt: skip
        return out.view(batch, -1, *out.shape[-2:]), None
    if attention_mask is not None:  # padded batch (2-D mask, True = token): unpad, varlen, pad
        if attention_mask.dim() != 2:
            raise ValueError(
                f"attention_mask: expected the 2-D padding mask of a flash implementation, got {attention_mask.dim()}-D"
            )
        return _padded(q, k, v, attention_mask, opts), None
    if cu_q is not None and cu_k is not None:  # packed sequences
        out = flash_attn_varlen_func(
            q.reshape(-1, *q.shape[2:]), k.reshape(-1, *k.shape[2:]), v.reshape(-1, *v.shape[2:]),
            cu_q.to(torch.int32), cu_k.to(torch.int32), max_q, max_k, **opts,
        )  # fmt: skip
        return out.view(batch, -1, *out.shape[-2:]), None
    return flash_attn_func(q, k, v, **opts), None


def _cache_update(cache, module, key, value, kwargs):
    """Write the new keys and values into transformers' paged cache; returns every sequence's keys and values
    packed, ``[1, Hkv, total_k, D]``. transformers 5.23 fills the keyword arguments (block table path included)
    in ``update``; earlier 5.x releases take the read/write indices and return ``[total_k, Hkv, D]``."""
    if "kwargs" in inspect.signature(cache.update).parameters:
        return cache.update(key_states=key, value_states=value, layer_idx=module.layer_idx, kwargs=kwargs)
    if kwargs.get("block_table") is not None:
        raise ValueError(
            "block_table: the decode fast path of this transformers version is not supported (a name with '2' or "
            "'3' after 'flash' turns it on); register under the default name"
        )
    k, v = cache.update(
        key_states=key, value_states=value, layer_idx=module.layer_idx,
        read_index=kwargs["read_index"], write_index=kwargs["write_index"],
    )  # fmt: skip
    return k.transpose(0, 1).unsqueeze(0), v.transpose(0, 1).unsqueeze(0)


_UNPAD: list = [None]  # the last mask's unpadding: (weakref to the mask, its version, seq_q, seq_k, result)


def _unpad_indices(mask: torch.Tensor, seq_q: int, seq_k: int):
    """Row indices and ``cu_seqlens`` of the valid tokens. Every layer of a model step passes the same mask:
    worked out once per step, and the same ``cu_seqlens`` tensors let the layers share one plan."""
    try:
        version = mask._version
    except RuntimeError:  # an inference tensor: no version counter, no reuse
        version = None
    memo = _UNPAD[0]
    if memo is not None and version is not None and memo[0]() is mask and memo[1:4] == (version, seq_q, seq_k):
        return memo[4]
    kv_valid = mask[:, -seq_k:].bool()
    q_valid = kv_valid[:, -seq_q:]
    zero = torch.zeros(1, dtype=torch.int32, device=mask.device)
    result = (
        kv_valid.reshape(-1).nonzero().squeeze(1),
        q_valid.reshape(-1).nonzero().squeeze(1),
        torch.cat([zero, kv_valid.sum(1).cumsum(0).to(torch.int32)]),
        torch.cat([zero, q_valid.sum(1).cumsum(0).to(torch.int32)]),
    )
    if version is not None:
        _UNPAD[0] = (weakref.ref(mask), version, seq_q, seq_k, result)
    return result


def _padded(q, k, v, mask, opts):
    """Left- or right-padded rows: each row's valid tokens are contiguous; queries are the last ``S`` positions."""
    batch, seq_q, heads, dim = q.shape
    seq_k = k.shape[1]
    k_idx, q_idx, cu_k, cu_q = _unpad_indices(mask, seq_q, seq_k)
    out = flash_attn_varlen_func(
        q.reshape(batch * seq_q, heads, dim)[q_idx], k.reshape(batch * seq_k, *k.shape[2:])[k_idx],
        v.reshape(batch * seq_k, *v.shape[2:])[k_idx], cu_q, cu_k, seq_q, seq_k, **opts,
    )  # fmt: skip
    full = torch.zeros(batch * seq_q, heads, dim, dtype=out.dtype, device=out.device)
    full[q_idx] = out
    return full.view(batch, seq_q, heads, dim)


_REGISTERED: set = set()


def register(name: str = DEFAULT_NAME) -> str:
    """Register the attention function and its mask function (transformers' FlashAttention mask: the 2-D
    padding mask, or None) under ``name``, which must contain "flash". Returns ``name``.

    transformers also loads "the flash functions" of every implementation whose name contains "flash" (it checks
    them when the model is set up, and its continuous batching may call them): for ``name`` its loader is
    taught to return this library's :mod:`flashinfer_triton.flash_attn` functions."""
    if "flash" not in name:
        raise ValueError(f"name: expected a name containing 'flash' (continuous batching requires it), got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, flash_attention_mask

    # "paged|" + name: the name continuous batching uses before transformers 5.23 (5.23 strips the prefix)
    for key in (name, f"paged|{name}"):
        AttentionInterface.register(key, attention_forward)
        AttentionMaskInterface.register(key, flash_attention_mask)
        _REGISTERED.add(key)
    _teach_flash_loader()
    return name


def _teach_flash_loader() -> None:
    """Wrap transformers' flash-function loader once: our names resolve to our functions, others as before."""
    from transformers import modeling_flash_attention_utils as mfa

    loader = getattr(mfa, "_lazy_imports", None)
    if loader is None or getattr(loader, "_flashinfer_triton", False):
        return

    def _lazy_imports(implementation, *args, **kwargs):
        if implementation in _REGISTERED:
            pad, unpad = getattr(mfa, "_pad_input", None), getattr(mfa, "_unpad_input", None)
            return flash_attn_func, flash_attn_varlen_func, flash_attn_with_kvcache, pad, unpad
        return loader(implementation, *args, **kwargs)

    _lazy_imports._flashinfer_triton = True
    mfa._lazy_imports = _lazy_imports
