"""Tensor building blocks of the decoder: norm, rotary embedding, MLP activation, and (stage 09)
the sharded linears, embedding and head, their shard arithmetic, weight loaders and collectives."""
