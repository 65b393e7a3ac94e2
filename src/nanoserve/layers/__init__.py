"""Tensor building blocks of the decoder: norm, rotary embedding, MLP activation."""
