"""Speculative sampling's rule: how many proposals to keep, and what to draw after a rejection.

Introduced in stage 12; its learner writes both functions. A proposer suggested d_1 .. d_k, each
drawn from its own distribution q (an n-gram proposer is sure of its guess: q(d_i) = 1). The
target computed its distribution p at every position in one forward. Keep d_i with probability
min(1, p(d_i) / q(d_i)); at the first rejection draw the replacement from

    norm(max(0, p - q))        (the mass p has and q does not)

and stop. Then every token kept or drawn is distributed exactly as if the target alone had
sampled it (Leviathan et al. 2023, Chen et al. 2023): a wrong guess costs time, never quality.
Greedy is the case p = one-hot(argmax): a proposal is kept iff it is the target's argmax.
"""

from __future__ import annotations

import torch


def num_accepted(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    uniforms: torch.Tensor,
    num_draft: torch.Tensor,
) -> torch.Tensor:
    """(B,) int64: how many leading proposals of each row are kept.

    target_probs (B, K): p_i(d_i), the target's probability of proposal i; draft_probs (B, K):
    q_i(d_i), the proposer's; uniforms (B, K) in (0, 1); num_draft (B,): row b proposed
    num_draft[b] tokens (columns past it are padding and never kept). Proposal i is kept when
    u_i * q_i(d_i) <= p_i(d_i) (u < p / q without a division: q may be 0 nowhere it proposed,
    but p may be 0) and every proposal before it was kept.
    """
    columns = torch.arange(uniforms.shape[1], device=uniforms.device)
    kept = (uniforms * draft_probs <= target_probs) & (columns < num_draft[:, None])
    return kept.long().cumprod(dim=1).sum(dim=1)  # the run of Trues from the left


def residual(target: torch.Tensor, draft: torch.Tensor) -> torch.Tensor:
    """(B, V): norm(max(0, p - q)) per row, the distribution to draw from after a rejection.

    A rejection happens only where p(d) < q(d), so p != q there and the row's mass is > 0.
    """
    mass = (target - draft).clamp_(min=0)
    return mass / mass.sum(dim=-1, keepdim=True)
