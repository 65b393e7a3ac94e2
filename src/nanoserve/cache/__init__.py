"""Where keys and values live, as tensors only: nothing (00), slabs (01), flat slots (03), the pool (04)."""
