"""How many bytes the KV cache may take, and what one token of it costs.

Introduced in stage 01 (slabs), reused from stage 04 (blocks). The byte budget is measured here
and returned; nothing writes it back into the config.
"""

from __future__ import annotations

import torch

from nanoserve.config import EngineConfig
from nanoserve.models.config import ModelConfig

DEFAULT_CPU_KV_BYTES = 1 << 30  # 1 GiB: enough for tens of thousands of SmolLM2 tokens


def kv_bytes_per_token(model_config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V of one token across all layers: 2 * L * H_kv * D * itemsize."""
    per_layer = model_config.num_key_value_heads * model_config.head_dim
    return 2 * model_config.num_hidden_layers * per_layer * dtype.itemsize


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes the cache may use: the CPU option, or a share of the GPU's free memory."""
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        headroom = total * (1 - config.gpu_memory_utilization)  # kept for activations
        return max(0, int(free - headroom))
    return config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
