"""The verify step's sampling: the target's distributions at every proposal, the acceptance test
and the token drawn after it, for the whole batch at once on the device.

Introduced in stage 12, given to its learner (who writes the rule itself, rejection.py). A row
b with k_b proposals owns k_b + 1 logits rows (cu_seqlens_q): row i scores the token at
position L_b + i, where L_b is the sequence's length before its proposals. Randomness is stage
11's counter hash, keyed by (seed, position) and a stream, so a seeded request gets the same
tokens whatever its batch:

    accept proposal i   u = hash(seed ^ ACCEPT, L + i)        kept when u * q <= p
    draw after a run    key hash(seed, L + a), the key stage 11 uses for that position:
    of a kept           n-gram (q one-hot): stage 11's draw with the rejected guess masked
                        draft: Gumbel-max over log(residual), or log(p) after a full run

p(d) comes from a logsumexp per row and one gather: no (B, K+1, V) softmax is built.

Greedy batches (every row temperature 0) take a shortcut with the same result: argmax only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.device_sampler import (
    SamplingTensors,
    filter_mask,
    gumbel_argmax,
    row_keys,
    sample,
    uniforms,
)
from nanoserve.rejection import num_accepted, residual

ACCEPT_STREAM = 0x5EC0_ACCE  # xor-ed into a seed: the acceptance test's own random stream
DRAFT_STREAM = 0x5EC0_D4AF  # the draft model's proposals


class Rule(NamedTuple):
    """The two functions of the rejection rule (rejection.py, or a learner's)."""

    num_accepted: Callable = num_accepted
    residual: Callable = residual


RULE = Rule()  # rejection.py's


class Verdict(NamedTuple):
    """Per row: how many proposals were kept, and the token drawn after them."""

    num_accepted: torch.Tensor  # (B,) int64
    token_ids: torch.Tensor  # (B,) int64: a replacement (after a rejection) or a bonus token


def probabilities(logits: torch.Tensor, tensors: SamplingTensors) -> torch.Tensor:
    """(N, V) float32: the distribution each row samples from (temperature, top-k, top-p);
    a greedy row (temperature 0) is one-hot at its argmax. The draft proposer's q."""
    greedy = tensors.temperature == 0
    scaled = logits.float() / torch.where(greedy, 1.0, tensors.temperature)[:, None]
    if tensors.filters:
        scaled = scaled.masked_fill(~filter_mask(scaled, tensors.top_k, tensors.top_p), -torch.inf)
    probs = torch.softmax(scaled, dim=-1)
    one_hot = torch.zeros_like(probs).scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, probs)


def draw(probs: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """(N,) int64: one token per row from probs, by Gumbel-max keyed by keys (no zero is drawn)."""
    return gumbel_argmax(probs.log(), torch.ones(len(probs), device=probs.device), keys)


def accept_uniforms(seeds: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """(B, K) uniforms in (0, 1) for the acceptance test at positions (B, K)."""
    keys = row_keys((seeds ^ ACCEPT_STREAM)[:, None].expand_as(positions).reshape(-1),
                    positions.reshape(-1))  # fmt: skip
    return uniforms(keys, 1).view(positions.shape)


def verify(
    logits: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    draft_ids: torch.Tensor,
    num_draft: torch.Tensor,
    draft_probs: torch.Tensor | None,
    tensors: SamplingTensors,
    rule: Rule = RULE,
) -> Verdict:
    """Judge every row's proposals against the target's logits (T, V) of one verify step.

    draft_ids (B, K) padded; num_draft (B,); draft_probs (B, K, V) the proposer's
    distributions, or None for a proposer sure of each guess (n-gram: q = one-hot);
    tensors.positions (B,) = L_b, the position of each row's first proposal.
    """
    k = draft_ids.shape[1]
    steps = torch.arange(k + 1, device=logits.device)
    rows = cu_seqlens_q[:-1, None].long() + torch.minimum(steps, num_draft[:, None])  # (B, K+1)
    picked = logits[rows.reshape(-1)]  # (B * (K + 1), V): row i of b scores position L_b + i
    greedy = bool((tensors.temperature == 0).all())  # a host decision costs one sync per step
    if greedy and draft_probs is None:
        argmax = picked.argmax(dim=-1).view(-1, k + 1)
        return _verify_greedy(argmax, draft_ids, num_draft, rule.num_accepted)
    b, greedy_rows = len(draft_ids), tensors.temperature == 0
    temperature = torch.where(greedy_rows, 1.0, tensors.temperature).repeat_interleave(k + 1)
    scaled = picked.float() / temperature[:, None]  # (B * (K + 1), V)
    if tensors.filters:  # each row's top-k / top-p cut, before anything is judged
        keep = filter_mask(
            scaled, tensors.top_k.repeat_interleave(k + 1), tensors.top_p.repeat_interleave(k + 1)
        )
        scaled = scaled.masked_fill_(~keep, -torch.inf)
    guesses = draft_ids.clamp(min=0)[..., None]  # padding (-1) reads token 0; never kept
    # p(d) = exp(score(d) - logsumexp(scores)): the target's probability of each guess, without
    # a (B, K+1, V) softmax; a greedy row's p is one-hot at its argmax
    lse = torch.logsumexp(scaled, dim=-1).view(b, k + 1)[:, :k]
    p_of_draft = (scaled.view(b, k + 1, -1)[:, :k].gather(2, guesses)[..., 0] - lse).exp()
    is_argmax = draft_ids == picked.argmax(dim=-1).view(b, k + 1)[:, :k]
    p_of_draft = torch.where(greedy_rows[:, None], is_argmax.float(), p_of_draft)
    q_of_draft = torch.ones_like(p_of_draft) if draft_probs is None else (
        draft_probs.gather(2, guesses)[..., 0])  # fmt: skip
    positions = tensors.positions[:, None] + steps[None, :k]
    accepted = rule.num_accepted(p_of_draft, q_of_draft, accept_uniforms(tensors.seeds, positions),
                                 num_draft)  # fmt: skip
    batch = torch.arange(b, device=logits.device)
    scores = scaled.view(b, k + 1, -1)[batch, accepted]  # (B, V): the row after the kept run
    rejected = accepted < num_draft
    after = tensors._replace(positions=tensors.positions + accepted, filters=False)
    if draft_probs is None:  # q is one-hot at the rejected guess: the residual is p without it,
        # so draw as stage 11 does from the scores with that one token masked
        column = draft_ids[batch, accepted.clamp(max=max(k - 1, 0))].clamp(min=0)
        scores[batch, column] = torch.where(rejected, -torch.inf, scores[batch, column])
        return Verdict(
            accepted, sample(scores, after._replace(temperature=1.0 - 1.0 * greedy_rows))
        )
    p_next = torch.softmax(scores, dim=-1)
    one_hot = torch.zeros_like(p_next).scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
    p_next = torch.where(greedy_rows[:, None], one_hot, p_next)
    q_next = draft_probs[batch, accepted.clamp(max=max(k - 1, 0))]
    target = torch.where(rejected[:, None], rule.residual(p_next, q_next), p_next)
    return Verdict(accepted, draw(target, row_keys(after.seeds, after.positions)))


def _verify_greedy(argmax: torch.Tensor, draft_ids: torch.Tensor, num_draft: torch.Tensor,
                   num_accepted: Callable) -> Verdict:  # fmt: skip
    """Every row greedy and every guess certain: p(d_i) is 1 when d_i is the argmax, else 0."""
    k = draft_ids.shape[1]
    p_of_draft = (draft_ids == argmax[:, :k]).float()
    sure = torch.ones_like(p_of_draft)
    accepted = num_accepted(p_of_draft, sure, sure / 2, num_draft)
    return Verdict(accepted, argmax.gather(1, accepted[:, None])[:, 0])
