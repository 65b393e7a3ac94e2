"""Where keys and values live: nothing (00), contiguous slabs (01), blocks and pools (02-04)."""
