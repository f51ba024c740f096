"""The Llama forward pass over a flat batch of tokens.

Weights are taken from a loaded transformers ``LlamaForCausalLM`` (the projections of each layer are
concatenated once: QKV into one matrix, gate and up into another). The arithmetic follows
transformers' Llama step by step (RMSNorm in float32, rotate-half RoPE with the model's own inverse
frequencies, SiLU-gated MLP), so that in float32 the engine's greedy tokens equal ``generate()``'s.
Attention is the one thing done elsewhere: ``backend.forward`` appends the new keys/values into the
paged pool and runs the library's planned wrapper.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class LayerWeights:
    input_norm: torch.Tensor
    qkv: torch.Tensor  # [(Hq + 2 Hkv) * D, hidden]
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    post_norm: torch.Tensor
    gate_up: torch.Tensor  # [2 * intermediate, hidden]
    down: torch.Tensor


class LlamaModel:
    """Weights and shapes of a Llama model, and its forward pass."""

    def __init__(self, hf_model, max_positions: int | None = None):
        cfg = hf_model.config
        self.config = cfg
        self.num_layers = cfg.num_hidden_layers
        self.hidden_size = cfg.hidden_size
        self.num_qo_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.vocab_size = cfg.vocab_size
        inner = hf_model.model
        self.embed = inner.embed_tokens.weight
        self.dtype = self.embed.dtype
        self.device = self.embed.device
        self.final_norm = inner.norm.weight
        self.lm_head = hf_model.lm_head.weight
        self.layers = []
        with torch.no_grad():
            for layer in inner.layers:
                att, mlp = layer.self_attn, layer.mlp
                bias = None
                if att.q_proj.bias is not None:
                    bias = torch.cat([att.q_proj.bias, att.k_proj.bias, att.v_proj.bias])
                self.layers.append(
                    LayerWeights(
                        input_norm=layer.input_layernorm.weight,
                        qkv=torch.cat([att.q_proj.weight, att.k_proj.weight, att.v_proj.weight]),
                        qkv_bias=bias,
                        o=att.o_proj.weight,
                        post_norm=layer.post_attention_layernorm.weight,
                        gate_up=torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight]),
                        down=mlp.down_proj.weight,
                    )
                )
            # RoPE table from the model's own rotary module (covers rope scaling variants such as llama3).
            rotary = inner.rotary_emb
            self.max_positions = max_positions or cfg.max_position_embeddings
            inv_freq = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
            scaling = float(getattr(rotary, "attention_scaling", 1.0))
            pos = torch.arange(self.max_positions, device=self.device, dtype=torch.float32)
            freqs = pos[:, None] * inv_freq[None, :]
            emb = torch.cat([freqs, freqs], dim=-1)
            self.cos = (emb.cos() * scaling).to(self.dtype)
            self.sin = (emb.sin() * scaling).to(self.dtype)

    # ------------------------------------------------------------------ pieces
    def _rms_norm(self, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.to(torch.float32)
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return w * x.to(dtype)

    @staticmethod
    def _rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return x * cos + self._rotate_half(x) * sin

    # ------------------------------------------------------------------ forward
    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        backend,
        meta,
        logits_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Logits ``[rows, vocab]`` (float32) for ``input_ids [nnz]`` at ``positions [nnz]``.

        ``logits_rows`` picks the rows whose logits are wanted (the last token of each request in a
        prefill); None means every row.
        """
        n = input_ids.shape[0]
        hq, hkv, d = self.num_qo_heads, self.num_kv_heads, self.head_dim
        pos = positions.long()
        cos = self.cos[pos][:, None, :]  # [nnz, 1, D]
        sin = self.sin[pos][:, None, :]
        h = F.embedding(input_ids, self.embed)
        for i, lw in enumerate(self.layers):
            x = self._rms_norm(h, lw.input_norm)
            qkv = F.linear(x, lw.qkv, lw.qkv_bias)
            q = qkv[:, : hq * d].view(n, hq, d)
            k = qkv[:, hq * d : (hq + hkv) * d].view(n, hkv, d)
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d)
            q = self._rope(q, cos, sin)
            k = self._rope(k, cos, sin)
            o = backend.forward(i, q, k, v, meta)
            h = h + F.linear(o.reshape(n, hq * d), lw.o)
            x = self._rms_norm(h, lw.post_norm)
            gate, up = F.linear(x, lw.gate_up).chunk(2, dim=-1)
            h = h + F.linear(F.silu(gate) * up, lw.down)
        if logits_rows is not None:
            h = h[logits_rows]
        h = self._rms_norm(h, self.final_norm)
        return F.linear(h, self.lm_head).float()
