"""How many bytes the KV cache may take, and what one token of it costs.

Introduced in stage 01 (slabs), reused from stage 03 (blocks). It reads the model's config and the
device, never the model object: the GPU warm-up that measures a prefill's peak is the model
runner's, and its result comes in as a number. The budget is returned, never written into config.
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


def kv_budget_bytes(config: EngineConfig, device: torch.device, warmup_peak_bytes: int = 0) -> int:
    """Bytes the cache may use: the CPU option, or on a GPU what a warm-up leaves free.

    On CUDA (as nano-vLLM does): the engine may use `gpu_memory_utilization` of the card; from
    that, subtract what is in use now (weights, other processes) and what the largest prefill
    needs on top of it (warmup_peak_bytes, the warm-up's peak over its starting point).
    """
    if device.type != "cuda":
        return config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * config.gpu_memory_utilization - used - warmup_peak_bytes))


def units_in_budget(
    budget_bytes: int, bytes_per_token: int, tokens_per_unit: int, unit: str
) -> int:
    """How many units (slabs, blocks) of tokens_per_unit tokens the budget holds, >= 1."""
    unit_bytes = tokens_per_unit * bytes_per_token
    fits = budget_bytes // unit_bytes
    if fits < 1:
        raise ValueError(
            f"one {unit} of {tokens_per_unit} tokens needs {unit_bytes} bytes, more than the KV "
            "budget; lower max_model_len or block_size, or raise kv_cache_bytes"
        )
    return fits
