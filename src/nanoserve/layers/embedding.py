"""The token embedding and the language-model head, each split over the vocabulary.

Introduced in stage 09. Rank r holds the rows of ceil(V / size) token ids, the last rank's tail
padded with zero rows, so any vocabulary size splits (49,152 and 151,936 divide; a tiny test
vocabulary of 515 does not). The embedding looks up the ids it owns and all-reduces; the head
computes its slice of the logits and gathers them on rank 0, the rank that samples.

    V = 5, size 2         rank 0 rows: ids 0 1 2       rank 1 rows: ids 3 4 + one zero row
    embed ids [4, 0]   -> rank 0: [0,   e0]  rank 1: [e4, 0]   -> all_reduce: [e4, e0]
    logits             -> rank 0: [l0 l1 l2] rank 1: [l3 l4 0] -> gather on 0, drop padding
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.shards import padded_shard_range
from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel, all_reduce, gather_on_first
from nanoserve.layers.weight_loader import check_shape


class VocabParallelEmbedding(nn.Module):
    """Embedding rows of this rank's token ids; the other ranks' ids contribute zeros."""

    def __init__(self, vocab_size: int, hidden_size: int, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.tp = tp
        self.vocab_size, self.hidden_size = vocab_size, hidden_size
        self.vocab_start, self.vocab_end, rows = padded_shard_range(vocab_size, tp.rank, tp.size)
        self.weight = nn.Parameter(torch.empty(rows, hidden_size))
        nn.init.normal_(self.weight)  # nn.Embedding's init (on meta: free)

    def weight_loader(self, param: nn.Parameter, loaded) -> None:
        """Copy rows vocab_start..vocab_end-1 of the whole (V, hidden) table; zero the padding."""
        check_shape(loaded, (self.vocab_size, self.hidden_size))
        num_real = self.vocab_end - self.vocab_start
        param.data[:num_real].copy_(loaded[self.vocab_start : self.vocab_end])
        param.data[num_real:].zero_()

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        """(T,) ids -> (T, hidden) embeddings, whole on every rank."""
        if self.tp.size == 1:
            return F.embedding(input_ids, self.weight)
        is_mine = (input_ids >= self.vocab_start) & (input_ids < self.vocab_end)
        local_ids = torch.where(is_mine, input_ids - self.vocab_start, 0)
        rows = F.embedding(local_ids, self.weight) * is_mine.unsqueeze(-1).to(self.weight.dtype)
        return all_reduce(rows, self.tp)


class ParallelLMHead(VocabParallelEmbedding):
    """The output projection over this rank's vocabulary slice; logits meet on rank 0."""

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """(N, hidden) -> (N, V) logits on rank 0; None on the other ranks."""
        logits = gather_on_first(F.linear(hidden, self.weight), self.tp)
        return None if logits is None else logits[:, : self.vocab_size]

    # None on ranks other than 0, unlike the embedding's forward: hence the ignore.
    def forward(self, hidden: torch.Tensor) -> torch.Tensor | None:  # type: ignore[override]
        return self.compute_logits(hidden)
