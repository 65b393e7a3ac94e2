"""The draft proposer (self-speculation): the target's own first layers, its final norm and its
head, run k times to guess k tokens; no second model, no download, no cache of its own.

Introduced in stage 12, given to its learner. Layer i's K/V depends only on the tokens and
positions below layer i, so for the same tokens the draft's first layers write exactly the K/V
the target would: the draft reads and writes the target's own pages. The verify step then
writes every layer at those positions again, and a rejected position is overwritten by the next
step that reaches it. Each guess is drawn from the draft's distribution q (the request's own
temperature, top-k and top-p), which the acceptance test needs: it returns q for every guess.

    draft step j (j = 0 .. k-1):  feed the newest token at position len - 1 (t, then d_1, ...)
                                  through layers 0 .. n-1, norm, head -> q_j -> d_{j+1}
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from nanoserve.device_sampler import row_keys
from nanoserve.engine.device_batch import to_device_ints
from nanoserve.engine.input_packer import pack_rows
from nanoserve.engine.overlap_runner import OverlapRunner, needs_filter
from nanoserve.speculative_sampler import DRAFT_STREAM, draw, probabilities
from nanoserve.types import Sequence, StepRow


class DraftProposer:
    """Guesses by the runner's model cut to its first num_layers layers."""

    def __init__(self, runner: OverlapRunner, num_layers: int):
        self.runner, self.num_layers = runner, num_layers

    @torch.inference_mode()
    def propose(
        self, seqs: list[Sequence], budgets: list[int], admit: Callable[[Sequence, int], bool]
    ) -> torch.Tensor | None:
        """Draft up to budgets[b] tokens for each sequence, offering each through admit; returns
        q (B, K, V) float32, the distribution each guess was drawn from (zeros past a row's
        guesses), or None when nobody may propose."""
        k, runner = max(budgets, default=0), self.runner
        if k == 0:
            return None
        q = torch.zeros(len(seqs), k, runner.model.config.vocab_size, device=runner.device)
        active = [b for b, budget in enumerate(budgets) if budget > 0]
        for j in range(k):
            if not active:
                break
            rows = [StepRow([seqs[b].token_ids[-1]], len(seqs[b]) - 1, seqs[b].block_table)
                    for b in active]  # fmt: skip
            inputs = pack_rows(rows, runner.packer.block_size, runner.device, is_prefill=False)
            hidden = runner.model(inputs.input_ids, inputs.positions, runner.attention,
                                  inputs.metadata, num_layers=self.num_layers)  # fmt: skip
            logits = runner.model.compute_logits(hidden)
            assert logits is not None, "the draft runs on one rank"
            state_rows = to_device_ints([runner.state.row_of(seqs[b]) for b in active],
                                        runner.device)  # fmt: skip
            positions = inputs.positions + 1  # each guess's position
            filters = any(needs_filter(seqs[b]) for b in active)
            tensors = runner.state.sampling(state_rows, positions, filters)
            probs = probabilities(logits, tensors)
            guesses = draw(probs, row_keys(tensors.seeds ^ DRAFT_STREAM, positions)).tolist()
            q[torch.tensor(active, device=runner.device), j] = probs
            active = [b for b, token_id in zip(active, guesses)
                      if admit(seqs[b], token_id) and budgets[b] > j + 1]  # fmt: skip
        return q
