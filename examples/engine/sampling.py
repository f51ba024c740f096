"""Greedy and temperature sampling over a batch of logits."""

from __future__ import annotations

import torch


def sample(
    logits: torch.Tensor,
    temperatures: list[float],
    generator: torch.Generator | None = None,
    top_k: int = 0,
) -> torch.Tensor:
    """Next token of each row of ``logits [B, vocab]`` (int64 ``[B]``, on the logits' device).

    Rows with temperature 0 take the argmax (greedy); the others draw from
    ``softmax(logits / temperature)``, restricted to the ``top_k`` largest logits when ``top_k > 0``.
    """
    if logits.dim() != 2 or logits.shape[0] != len(temperatures):
        raise ValueError(f"logits: expected shape [{len(temperatures)}, vocab], got {list(logits.shape)}")
    greedy = logits.argmax(dim=-1)
    if all(t <= 0 for t in temperatures):
        return greedy
    temps = torch.tensor([t if t > 0 else 1.0 for t in temperatures], device=logits.device)
    scaled = logits.float() / temps[:, None]
    if top_k > 0:
        kth = scaled.topk(min(top_k, scaled.shape[-1]), dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    drawn = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    is_greedy = torch.tensor([t <= 0 for t in temperatures], device=logits.device)
    return torch.where(is_greedy, greedy, drawn)
