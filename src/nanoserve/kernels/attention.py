"""Reference attention in plain torch: causal, grouped-query, one sequence at a time.

Introduced in stage 00. Every cache layout (none, contiguous slabs, paged blocks) ends up calling
`attend` with one sequence's queries and its whole key/value history, so the arithmetic is the
same at every stage and their tokens can be compared exactly. It is slow and does no tiling.
"""

import torch

from nanoserve.layers.norm import reduction_dtype


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention of the last Tq positions of a sequence over all Tk of its positions.

    q (Tq, H, D), k and v (Tk, H_kv, D) with Tq <= Tk: query i sits at position Tk - Tq + i and
    sees keys 0 ..= Tk - Tq + i. Returns (Tq, H, D).
    """
    num_q, num_heads, _ = q.shape
    num_k, num_kv_heads, _ = k.shape
    group = num_heads // num_kv_heads  # grouped-query attention: H/H_kv query heads per kv head
    k = k.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, Tk, D)
    v = v.repeat_interleave(group, dim=1).transpose(0, 1)  # (H, Tk, D)
    scores = torch.matmul(q.transpose(0, 1), k.transpose(1, 2)) * scale  # (H, Tq, Tk)
    if num_q > 1:
        q_pos = torch.arange(num_k - num_q, num_k, device=q.device)[:, None]
        k_pos = torch.arange(num_k, device=q.device)[None, :]
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=reduction_dtype(q.dtype)).to(q.dtype)
    return torch.matmul(probs, v).transpose(0, 1)  # (Tq, H, D)


class NoCacheAttention:
    """Stage 00's backend: packed sequences attend only to themselves; nothing is stored.

    `cu_seqlens` (num_seqs + 1,) marks where each sequence starts in the packed token axis:
    sequences of 3 and 2 tokens give [0, 3, 5].
    """

    def __init__(self, cu_seqlens: list[int]):
        self.cu_seqlens = cu_seqlens

    def forward(self, layer_id: int, q, k, v, scale: float) -> torch.Tensor:
        """Attention output for every packed token, (T, H, D)."""
        bounds = zip(self.cu_seqlens[:-1], self.cu_seqlens[1:])
        return torch.cat([attend(q[s:e], k[s:e], v[s:e], scale) for s, e in bounds])
