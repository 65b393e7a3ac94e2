"""Stage 09 mutants: the shard arithmetic (shard_range, padded_shard_range), the column-, merged-,
QKV- and row-parallel linears and the vocabulary-parallel embedding and head, one learner bug
each."""

from __future__ import annotations

from tests.mutants import maker

mutant = maker(9)


MUTANTS = (
    # ---- the shard arithmetic ----
    mutant(
        "shard_range_floors",
        "shard_range floors instead of rejecting a size that does not "
        "divide: 7 over 2 is 3 + 3 and the 7th item belongs to no rank",
        "shard_range",
        (
            "if total % size:\n"
            '    raise ValueError(f"{total} items do not split evenly over {size} '
            'ranks")',
            "",
        ),
    ),
    mutant(
        "padded_rows_floor",
        "padded_shard_range floors the rows per rank: the last ids of the "
        "vocabulary belong to no rank",
        "padded_shard_range",
        ("-(-total // size)", "total // size"),
    ),
    mutant(
        "padded_start_not_clamped",
        "a rank past the end of a small vocabulary starts past it "
        "(2 over 4: rank 3 gets (3, 2) instead of (2, 2))",
        "padded_shard_range",
        ("min(total, rank * rows)", "rank * rows"),
    ),
    # ---- column-parallel ----
    mutant(
        "column_takes_columns",
        "the column-parallel loader slices the input columns, as a "
        "row-parallel one does, instead of the output rows",
        "ColumnParallelLinear.weight_loader",
        ("loaded[start:end]", "loaded[:, start:end]"),
    ),
    mutant(
        "column_forgets_the_rank",
        "every rank loads rank 0's rows (shard_range(out, 0, size))",
        "ColumnParallelLinear.weight_loader",
        (
            "shard_range(self.output_size, self.tp.rank, self.tp.size)",
            "shard_range(self.output_size, 0, self.tp.size)",
        ),
    ),
    mutant(
        "merged_wrong_half",
        "merged gate/up: each projection is loaded into the other's half (up first, then gate)",
        "MergedColumnParallelLinear.weight_loader",
        ("sum(local[:shard_id])", "sum(local[shard_id + 1 :])"),
    ),
    mutant(
        "merged_split_of_the_total",
        "merged: a projection's rows are this rank's share of the "
        "merged total, not of that projection",
        "MergedColumnParallelLinear.weight_loader",
        (
            "shard_range(self.output_sizes[shard_id], self.tp.rank, self.tp.size)",
            "shard_range(self.output_size, self.tp.rank, self.tp.size)",
        ),
    ),
    mutant(
        "qkv_ignores_gqa",
        "the head split ignores GQA: k and v are sliced at the query heads' "
        "offset (rank * H/size heads), which only works when H_kv == H",
        "QKVParallelLinear.weight_loader",
        (
            'super().weight_loader(param, loaded, "qkv".index(shard_id))',
            'index = "qkv".index(shard_id)\n'
            "local = self.local_sizes()\n"
            "offset = sum(local[:index])\n"
            "start = self.tp.rank * self.num_heads * self.head_dim\n"
            "param.data[offset : offset + local[index]].copy_(\n"
            "    loaded[start : start + local[index]])",
        ),
    ),
    # ---- row-parallel ----
    mutant(
        "row_forgets_the_all_reduce",
        "the row-parallel layer returns its partial sum: each rank "
        "has only its own features' share of the output",
        "RowParallelLinear.forward",
        ("all_reduce(F.linear(x, self.weight), self.tp)", "F.linear(x, self.weight)"),
    ),
    mutant(
        "row_bias_before_the_all_reduce",
        "the bias goes into F.linear on every rank, before the all-reduce: it is added size times",
        "RowParallelLinear.forward",
        (
            "y = all_reduce(F.linear(x, self.weight), self.tp)\n"
            "return y if self.bias is None else y + self.bias",
            "return all_reduce(F.linear(x, self.weight, self.bias), self.tp)",
        ),
    ),
    mutant(
        "row_takes_rows",
        "the row-parallel loader slices output rows, as a column-parallel one "
        "does, instead of input columns",
        "RowParallelLinear.weight_loader",
        ("loaded[:, start:end]", "loaded[start:end]"),
    ),
    # ---- the vocabulary ----
    mutant(
        "embedding_others_ids_not_zeroed",
        "ids of other ranks look up row 0 and are not zeroed before the all-reduce",
        "VocabParallelEmbedding.forward",
        (
            "F.embedding(local_ids, self.weight) * is_mine.unsqueeze(-1).to(self.weight.dtype)",
            "F.embedding(local_ids, self.weight)",
        ),
    ),
    mutant(
        "embedding_claims_the_next_ranks_first_id",
        "off by one: a rank also claims id vocab_end, the next rank's first (<= for <)",
        "VocabParallelEmbedding.forward",
        ("input_ids < self.vocab_end", "input_ids <= self.vocab_end"),
    ),
    mutant(
        "embedding_rows_shifted",
        "off by one in the loader: rank r copies rows vocab_start + 1 .. vocab_end",
        "VocabParallelEmbedding.weight_loader",
        (
            "loaded[self.vocab_start : self.vocab_end]",
            "loaded[self.vocab_start + 1 : self.vocab_end + 1]",
        ),
    ),
    mutant(
        "embedding_forgets_the_all_reduce",
        "the embedding returns only this rank's rows (zeros for every other rank's ids)",
        "VocabParallelEmbedding.forward",
        ("all_reduce(rows, self.tp)", "rows"),
    ),
    mutant(
        "padding_rows_not_zeroed",
        "the loader leaves the padding rows as they were allocated",
        "VocabParallelEmbedding.weight_loader",
        ("param.data[num_real:].zero_()", ""),
    ),
    mutant(
        "logits_keep_the_padding",
        "the gathered logits are not trimmed: V + padding columns, "
        "and a padding logit of 0 can win the argmax",
        "ParallelLMHead.compute_logits",
        ("logits[:, : self.vocab_size]", "logits"),
    ),
    mutant(
        "logits_not_gathered",
        "each rank returns its own slice of the logits: rank 0 sees only "
        "its part of the vocabulary",
        "ParallelLMHead.compute_logits",
        (
            "gather_on_first(F.linear(hidden, self.weight), self.tp)",
            "F.linear(hidden, self.weight)",
        ),
    ),
)
