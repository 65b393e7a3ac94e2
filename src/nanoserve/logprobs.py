"""Log-probabilities of sampled tokens: what `SamplingParams.logprobs` asks for, per token.

Introduced with `SamplingParams.logprobs` (after stage 11). As vLLM does, it reports the model's
raw distribution, log_softmax(logits), before temperature, top-k and top-p: a token's logprob is
what the model thinks of it, whatever the request did to draw it. Both samplers use it: stage 00's
on the host after `Sampler`, stage 11's on the device beside `device_sampler.sample` (the tensors
travel to the host with the tokens). It samples nothing and runs only for rows that ask.

    logits (B, V) -> log_softmax -> the sampled token's logprob and rank (B,), top-k (B, K)
"""

from __future__ import annotations

from typing import NamedTuple

import torch


class TokenLogprobs(NamedTuple):
    """One sampled token: its log-probability, its rank (1 = the most likely) and the top ones."""

    logprob: float
    rank: int
    top: dict[int, float]  # the top-`logprobs` token ids -> their logprobs, most likely first


class LogprobTensors(NamedTuple):
    """One step's logprobs for the rows that sampled, on one device (K = the most any row asks)."""

    chosen: torch.Tensor  # (B,) the sampled token's logprob
    rank: torch.Tensor  # (B,) int64: 1 + how many tokens are strictly more likely
    top_values: torch.Tensor  # (B, K) descending
    top_ids: torch.Tensor  # (B, K) int64


def logprob_tensors(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> LogprobTensors:
    """log_softmax of logits (B, V) in float32 or better, at token_ids (B,) and its top k."""
    logprobs = logits.log_softmax(-1, dtype=torch.promote_types(logits.dtype, torch.float32))
    chosen = logprobs.gather(1, token_ids.long()[:, None])  # (B, 1)
    rank = (logprobs > chosen).sum(-1) + 1
    top = logprobs.topk(k, dim=-1)
    return LogprobTensors(chosen[:, 0], rank, top.values, top.indices)


def to_token_logprobs(tensors: LogprobTensors, num_top: list[int]) -> list[TokenLogprobs]:
    """Host records, one per row; row i keeps its own num_top[i] of the top K."""
    values, ids = tensors.top_values.tolist(), tensors.top_ids.tolist()
    return [
        TokenLogprobs(chosen, rank, dict(zip(ids[i][:k], values[i][:k])))
        for i, (chosen, rank, k) in enumerate(
            zip(tensors.chosen.tolist(), tensors.rank.tolist(), num_top)
        )
    ]


def completion_index(seq) -> int:
    """Where in seq's completion the token it samples now goes (a token owed counts)."""
    return len(seq) - seq.num_prompt_tokens


class PendingLogprobs(NamedTuple):
    """One step's logprobs for the sequences that asked, before they are stored on them."""

    seqs: list  # the Sequences that asked (types.Sequence sits above this module)
    indices: list[int]  # where in each completion its sampled token goes
    tensors: LogprobTensors  # one row per seq; on the host once `record` may run

    def record(self) -> None:
        """Store each sequence's entry at its token's index (idempotent: a dict, by index)."""
        num_top = [seq.params.logprobs for seq in self.seqs]
        entries = to_token_logprobs(self.tensors, num_top)
        for seq, index, entry in zip(self.seqs, self.indices, entries):
            seq.logprobs[index] = entry


def pending_logprobs(
    seqs: list, logits: torch.Tensor, token_ids: torch.Tensor | list[int]
) -> PendingLogprobs | None:
    """The logprobs of the rows whose request asks, computed where logits are; None (and no
    work on the device) when none asks. seqs, logits (B, V) and token_ids (B,) share rows."""
    rows = [i for i, seq in enumerate(seqs) if seq.params.logprobs is not None]
    if not rows:
        return None
    token_ids = torch.as_tensor(token_ids, device=logits.device)
    if len(rows) < len(seqs):
        picked = torch.tensor(rows, device=logits.device)
        logits, token_ids = logits[picked], token_ids[picked]
    asking = [seqs[i] for i in rows]
    k = max(seq.params.logprobs for seq in asking)
    tensors = logprob_tensors(logits, token_ids, k)
    return PendingLogprobs(asking, [completion_index(seq) for seq in asking], tensors)
