"""Adapters that plug the library into frameworks: :mod:`.transformers` (an attention implementation for
transformers models, continuous batching included). ``torch.compile`` support lives in the library itself (its
entry points are torch custom ops) and FlashAttention's interface in :mod:`flashinfer_triton.flash_attn`."""
