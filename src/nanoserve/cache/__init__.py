"""KV tensors only: none (stage 00), slabs (01), flat slots (03), the paged pool (04)."""
