"""The verify step's sampling: the target's distributions at every proposal, the acceptance test
and the token drawn after it, for the whole batch at once on the device.

Introduced in stage 12, given to its learner (who writes the rule itself, samplers/rejection.py).
A row
b with k_b proposals owns k_b + 1 logits rows (cu_seqlens_q): row i scores the token at
position L_b + i, where L_b is the sequence's length before its proposals. Randomness is stage
11's counter hash, keyed by (seed, position) and a stream, so a seeded request gets the same
tokens whatever its batch:

    sure guesses (n-gram, q one-hot): draw the target's own token at every position with stage
        11's key hash(seed, L + i); keep guess i while it equals that draw; emit the draw after
        the kept run. That is the rule (see _verify_sure), and the tokens are stage 11's.
    drawn guesses (draft, q given): u = hash(seed ^ ACCEPT, L + i), guess i kept when
        u * q <= p; after the kept run, Gumbel-max over log(residual), or log(p) after a full
        run, keyed hash(seed, L + a). p(d) comes from a logsumexp per row and one gather.

A greedy batch of sure guesses takes a shortcut with the same result: argmax only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch

from nanoserve.samplers.device_sampler import (
    SamplingTensors,
    filter_mask,
    gumbel_argmax,
    row_keys,
    sample,
    uniforms,
)
from nanoserve.samplers.rejection import num_accepted, residual

ACCEPT_STREAM = 0x5EC0_ACCE  # xor-ed into a seed: the acceptance test's own random stream
DRAFT_STREAM = 0x5EC0_D4AF  # the draft model's proposals


class Rule(NamedTuple):
    """The two functions of the rejection rule (samplers/rejection.py, or a learner's)."""

    num_accepted: Callable = num_accepted
    residual: Callable = residual


RULE = Rule()  # samplers/rejection.py's


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
    return softmax_or_one_hot(scaled, greedy)


def softmax_or_one_hot(scores: torch.Tensor, greedy: torch.Tensor) -> torch.Tensor:
    """(N, V): softmax of each row's scores (already scaled and cut), or, for a greedy row,
    one-hot at its argmax."""
    one_hot = torch.zeros_like(scores).scatter_(1, scores.argmax(dim=-1, keepdim=True), 1.0)
    return torch.where(greedy[:, None], one_hot, torch.softmax(scores, dim=-1))


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
    greedy: bool | None = None,
) -> Verdict:
    """Judge every row's proposals against the target's logits (T, V) of one verify step.

    draft_ids (B, K) padded; num_draft (B,); draft_probs (B, K, V) the proposer's
    distributions, or None for a proposer sure of each guess (n-gram: q = one-hot);
    tensors.positions (B,) = L_b, the position of each row's first proposal. greedy: whether
    every row is greedy, when the caller knows (None: asked of the device, which waits).
    """
    k = draft_ids.shape[1]
    steps = torch.arange(k + 1, device=logits.device)
    rows = cu_seqlens_q[:-1, None].long() + torch.minimum(steps, num_draft[:, None])  # (B, K+1)
    picked = logits[rows.reshape(-1)]  # (B * (K + 1), V): row i of b scores position L_b + i
    if draft_probs is None:
        return _verify_sure(picked, draft_ids, num_draft, tensors, rule.num_accepted, greedy)
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
    q_of_draft = draft_probs.gather(2, guesses)[..., 0]
    positions = tensors.positions[:, None] + steps[None, :k]
    uniforms_ = accept_uniforms(tensors.seeds, positions)
    accepted = rule.num_accepted(p_of_draft, q_of_draft, uniforms_, num_draft)
    batch = torch.arange(b, device=logits.device)
    scores = scaled.view(b, k + 1, -1)[batch, accepted]  # (B, V): the row after the kept run
    p_next = softmax_or_one_hot(scores, greedy_rows)
    q_next = draft_probs[batch, accepted.clamp(max=max(k - 1, 0))]
    rejected = accepted < num_draft
    target = torch.where(rejected[:, None], rule.residual(p_next, q_next), p_next)
    return Verdict(accepted, draw(target, row_keys(tensors.seeds, tensors.positions + accepted)))


def _verify_sure(
    picked: torch.Tensor,
    draft_ids: torch.Tensor,
    num_draft: torch.Tensor,
    tensors: SamplingTensors,
    num_accepted: Callable,
    greedy: bool | None = None,
) -> Verdict:
    """Every guess certain (q one-hot, the n-gram proposer): draw the target's own token at each
    position, with stage 11's key, and keep guess i while it equals that draw.

    That is the rule: a guess d is kept with probability P(draw = d) = p(d) = min(1, p(d) / q(d));
    after a rejection the draw is some x != d, with probability p(x) / (1 - p(d)): the residual
    norm(max(0, p - q)). And every emitted token is the very token stage 11 draws at that
    position: a seeded request gives stage 11's tokens, whatever was guessed.
    """
    b, k = draft_ids.shape
    if greedy is None:
        greedy = bool((tensors.temperature == 0).all())
    if greedy:  # each draw is the argmax (no noise)
        drawn = picked.argmax(dim=-1)
    else:
        steps = torch.arange(k + 1, device=picked.device)
        per_row = SamplingTensors(
            tensors.temperature.repeat_interleave(k + 1),
            tensors.top_k.repeat_interleave(k + 1),
            tensors.top_p.repeat_interleave(k + 1),
            tensors.seeds.repeat_interleave(k + 1),
            (tensors.positions[:, None] + steps).reshape(-1),  # the position each row samples
            tensors.filters,
        )
        drawn = sample(picked, per_row)
    drawn = drawn.view(b, k + 1)
    agree = (draft_ids == drawn[:, :k]).float()  # p(d) of a draw that is certain once made
    sure = torch.ones_like(agree)
    accepted = num_accepted(agree, sure, sure / 2, num_draft)
    return Verdict(accepted, drawn.gather(1, accepted[:, None])[:, 0])
