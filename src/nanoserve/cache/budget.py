"""How many bytes the KV cache may take, and what one token of it costs.

Introduced in stage 01 (slabs), reused from stage 03 (blocks). The byte budget is measured here
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


def kv_budget_bytes(config: EngineConfig, model) -> int:
    """Bytes the cache may use: the CPU option, or on a GPU what a warm-up leaves free.

    On CUDA (as nano-vLLM does): the engine may use `gpu_memory_utilization` of the card; from
    that, subtract what is in use now (weights, other processes) and what the largest prefill
    needs on top of it (the warm-up's peak over its starting point).
    """
    device = next(model.parameters()).device
    if device.type != "cuda":
        return config.kv_cache_bytes or DEFAULT_CPU_KV_BYTES
    peak_over_current = warmup_peak_bytes(config, model, device)
    free, total = torch.cuda.mem_get_info(device)
    used = total - free
    return max(0, int(total * config.gpu_memory_utilization - used - peak_over_current))


@torch.inference_mode()
def warmup_peak_bytes(config: EngineConfig, model, device: torch.device) -> int:
    """Memory one full prefill batch takes beyond what is allocated now (no cache involved)."""
    from nanoserve.kernels.attention import NoCacheAttention  # the plainest backend

    seq_len = config.max_model_len
    num_seqs = max(1, min(config.max_num_seqs, config.max_num_batched_tokens // seq_len))
    ids = torch.zeros(num_seqs * seq_len, dtype=torch.long, device=device)
    positions = torch.arange(seq_len, device=device).repeat(num_seqs)
    cu_seqlens = [i * seq_len for i in range(num_seqs + 1)]
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    current = torch.cuda.memory_allocated(device)
    hidden = model(ids, positions, NoCacheAttention(cu_seqlens))
    model.compute_logits(hidden[torch.tensor(cu_seqlens[1:], device=device) - 1])
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device)
    del hidden
    torch.cuda.empty_cache()
    return peak - current
