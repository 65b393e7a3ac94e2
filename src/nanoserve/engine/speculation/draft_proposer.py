"""The draft proposer: a small model run k times to guess k tokens, each drawn from its q.

Introduced in stage 12, given to its learner. Two drafts:
- Self-speculation (the default): the target's own first layers, its final norm and its head;
  no second model, no download, no cache of its own. Layer i's K/V depends only on the tokens
  and positions below layer i, so for the same tokens the draft's first layers write exactly the
  K/V the target would: the draft reads and writes the target's own pages, and the verify step
  writes every layer at those positions again.
- A separate model of the same vocabulary (`speculative_model`): a pool of its own, as many
  blocks as the target's and read through the target's block tables, so the same block ids need
  no second manager. It stores K/V only for what it was fed, so its first step feeds every token
  it lacks (the whole prompt the first time, after a rollback or a preemption what it lost).

Each guess is drawn from the draft's distribution q (the request's own temperature, top-k and
top-p), which the acceptance test needs: it returns q for every guess.

    draft step 0:      feed what the draft lacks, up to the newest token (self-spec: t alone)
    draft step j > 0:  feed d_j at position len - 1 -> q_j -> d_{j+1}
"""

from __future__ import annotations

import weakref
from typing import Any, NamedTuple

import torch

from nanoserve.engine.runner.device_batch import to_device_ints
from nanoserve.engine.runner.input_packer import pack_rows
from nanoserve.engine.runner.launched import needs_filter
from nanoserve.engine.runner.overlap_runner import OverlapRunner
from nanoserve.models.decoder import CausalLM
from nanoserve.samplers.device_sampler import row_keys
from nanoserve.samplers.speculative_sampler import DRAFT_STREAM, draw, probabilities
from nanoserve.types import Sequence, StepRow


class Draft(NamedTuple):
    """The model a draft runs, the attention over its pages, and how many of its layers."""

    model: CausalLM
    attention: Any  # an AttentionBackend over the pages the draft's K/V lives in
    num_layers: int | None = None  # None: all of them


class DraftProposer:
    """Guesses by a draft model: the runner's own, cut to its first layers (self-speculation),
    or a separate one of the same vocabulary with a pool of its own, indexed by the target's
    block tables (the same block ids, so no second manager)."""

    def __init__(self, runner: OverlapRunner, draft: Draft, shares_pages: bool):
        # it runs inside the runner (its device batch, packer and model), which builds it
        self.runner, self.draft = runner, draft
        # a draft with pages of its own stores K/V only for what it was fed: per sequence, how
        # many leading tokens it holds, and the preemption count they belong to
        self.shares_pages = shares_pages
        self.stored: weakref.WeakKeyDictionary[Sequence, tuple[int, int]] = (
            weakref.WeakKeyDictionary()
        )

    def start(self, seq: Sequence) -> int:
        """Where the draft's first step must start feeding seq: its newest token when the draft
        shares the target's pages, else the first token whose draft K/V is not stored."""
        if self.shares_pages:
            return seq.num_cached_tokens
        preemptions, stored = self.stored.get(seq, (seq.num_preemptions, 0))
        if preemptions != seq.num_preemptions:  # its blocks were dropped and retaken
            stored = 0
        return min(stored, seq.num_cached_tokens)  # a rollback drops what it rejected

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], budgets: tuple[int, ...]
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Draft up to budgets[b] tokens for each sequence (its blocks already have room for
        them); returns the guesses and q (B, K, V) float32, the distribution each guess was
        drawn from (zeros past a row's guesses), or None when nobody may propose."""
        k, runner = max(budgets, default=0), self.runner
        guesses: list[list[int]] = [[] for _ in seqs]
        if k == 0:
            return guesses, None
        q = torch.zeros(len(seqs), k, runner.model.config.vocab_size, device=runner.device)
        active = [b for b, budget in enumerate(budgets) if budget > 0]
        for j in range(k):
            if not active:
                break
            # the first step feeds everything the draft lacks (one token when it shares pages),
            # the next ones the guess just made; each row's logits at its last token
            rows = [self.row(seqs[b], guesses[b], first=j == 0) for b in active]
            probs, (seeds, positions) = self.step(rows, [seqs[b] for b in active])
            drawn = draw(probs, row_keys(seeds ^ DRAFT_STREAM, positions)).tolist()
            q[torch.tensor(active, device=runner.device), j] = probs
            for b, token_id in zip(active, drawn):  # fed up to the newest; the guess is not
                self.stored[seqs[b]] = (seqs[b].num_preemptions, len(seqs[b]) + len(guesses[b]))
                guesses[b].append(token_id)
            active = [b for b in active if budgets[b] > j + 1]
        return guesses, q

    def row(self, seq: Sequence, guessed: list[int], first: bool) -> StepRow:
        """What the draft feeds seq in this step (its guesses so far follow its tokens)."""
        tokens = seq.token_ids + guessed
        start = self.start(seq) if first else len(tokens) - 1
        return StepRow(tokens[start:], start, seq.block_table)

    def step(self, rows: list[StepRow], seqs: list[Sequence]):
        """One draft forward over rows: each row's q (the request's own sampling), and the
        (seeds, positions) its guess is keyed by."""
        runner, draft = self.runner, self.draft
        inputs = pack_rows(rows, runner.packer.block_size, runner.device, is_prefill=True)
        hidden = draft.model(inputs.input_ids, inputs.positions, draft.attention,
                             inputs.metadata, num_layers=draft.num_layers)  # fmt: skip
        last = inputs.metadata.cu_seqlens_q[1:].long() - 1
        logits = draft.model.compute_logits(hidden[last])
        assert logits is not None, "the draft runs on one rank"
        state_rows = to_device_ints([runner.state.row_of(seq) for seq in seqs], runner.device)
        positions = inputs.positions[last] + 1  # each guess's position
        tensors = runner.state.sampling(state_rows, positions, any(map(needs_filter, seqs)))
        return probabilities(logits, tensors), (tensors.seeds, positions)
