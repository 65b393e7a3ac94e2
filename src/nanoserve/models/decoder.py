"""The decoder: one module for the Llama, Qwen2 and Qwen3 families.

Introduced in stage 00. Tokens arrive packed along one axis (no batch dimension, no padding), with
their positions; attention is delegated to a backend object passed into `forward`, which is where
every later stage changes how keys and values are stored. Projections are `layers/linear.py`'s
sharded layers (stage 09): q/k/v are one `qkv_proj` and gate/up one `gate_up_proj`, so
`build.STACKED_PARAMS` maps Hugging Face's names onto them; at tensor_parallel_size 1 nothing
is sharded or exchanged.
"""

import torch
import torch.nn.functional as F
from torch import nn

from nanoserve.layers.activation import silu_mul
from nanoserve.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from nanoserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from nanoserve.layers.norm import RMSNorm
from nanoserve.layers.rotary import RotaryEmbedding, apply_rotary
from nanoserve.layers.tensor_parallel import ONE_RANK, TensorParallel
from nanoserve.models.config import ModelConfig


class Attention(nn.Module):
    """q/k/v projection, optional q/k norm (Qwen3), RoPE, the backend, output projection.

    With tensor parallelism each rank runs this for its own heads (and stores their K/V); the
    output projection's all-reduce sums the heads' contributions.
    """

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.layer_id = layer_id
        self.head_dim = config.head_dim
        self.scale = self.head_dim**-0.5
        hidden = config.hidden_size
        self.qkv_proj = QKVParallelLinear(
            hidden,
            self.head_dim,
            config.num_attention_heads,
            config.num_key_value_heads,
            config.attention_bias,
            tp,
        )
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_heads, self.qkv_proj.num_kv_heads
        self.o_proj = RowParallelLinear(config.num_attention_heads * self.head_dim, hidden, tp=tp)
        if config.qk_norm:
            self.q_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.head_dim, config.rms_norm_eps)
        self.qk_norm = config.qk_norm

    def forward(self, x: torch.Tensor, rope: tuple, attn, metadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        q, k, v = self.qkv_proj(x).split(self.qkv_proj.local_sizes(), dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)  # this rank's heads
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        q, k = self.norm_and_rotate(q, k, *rope)
        out = attn.forward(self.layer_id, q, k, v, self.scale, metadata)  # (T, H, D)
        return self.o_proj(out.reshape(num_tokens, -1))

    def norm_and_rotate(self, q: torch.Tensor, k: torch.Tensor, cos, sin):
        """Qwen3 normalizes each head of q and k; then RoPE rotates both. On a GPU,
        layers/compiled.py runs the lot as one compiled kernel."""
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rotary(q, k, cos, sin)


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), gate and up as one matmul; `swiglu` is its oracle.

    Each rank holds a slice of the intermediate features; down's all-reduce sums them.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        hidden, intermediate = config.hidden_size, config.intermediate_size
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [intermediate] * 2, tp=tp)
        self.down_proj = RowParallelLinear(intermediate, hidden, tp=tp)
        self.act = silu_mul  # layers/compiled.py may swap in a fused version on a GPU

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(self.act(gate, up))


def swiglu(x: torch.Tensor, gate_w: torch.Tensor, up_w: torch.Tensor, down_w: torch.Tensor):
    """down(silu(gate(x)) * up(x)) with weights (I, hidden), (I, hidden), (hidden, I)."""
    return F.linear(F.silu(F.linear(x, gate_w)) * F.linear(x, up_w), down_w)


class DecoderLayer(nn.Module):
    """Pre-norm block: x + attn(norm(x)), then x + mlp(norm(x)).

    The last add is left to whoever comes next: a layer returns (x, the MLP's output) and the
    next layer adds the two just before its own first norm, so that on a GPU the add and the
    norm run as one kernel (`RMSNorm.add_then_norm`, compiled by layers/compiled.py). The sums
    are the same ones, in the same order."""

    def __init__(self, config: ModelConfig, layer_id: int, tp: TensorParallel):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_id, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, tp)

    def forward(self, x: torch.Tensor, delta: torch.Tensor, rope: tuple, attn, metadata):
        """x: the residual stream; delta: the layer before's MLP output, not yet added to it."""
        x, h = self.input_layernorm.add_then_norm(x, delta)
        attended = self.self_attn(h, rope, attn, metadata)
        x, h = self.post_attention_layernorm.add_then_norm(x, attended)
        return x, self.mlp(h)


class DecoderModel(nn.Module):
    """Embedding, the layer stack, the final norm (Hugging Face's `model.` prefix)."""

    def __init__(self, config: ModelConfig, tp: TensorParallel):
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(config.vocab_size, config.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(config, i, tp) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.rope_scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, metadata,
                num_layers: int | None = None):  # fmt: skip
        x = self.embed_tokens(input_ids)  # (T, hidden)
        delta = torch.zeros_like(x)  # nothing to add before the first layer
        rope = self.rotary.cos_sin(positions, x.dtype)  # (T, head_dim) each, shared by all layers
        for layer in self.layers[:num_layers]:  # stage 12's draft runs the first layers only
            x, delta = layer(x, delta, rope, attn, metadata)
        return self.norm.add_then_norm(x, delta)[1]


class CausalLM(nn.Module):
    """The decoder plus its language-model head.

    `attn` is the attention backend (kernels/backend.py's `AttentionBackend`): every layer calls
    `attn.forward(layer_id, q (T, H, D), k (T, H_kv, D), v (T, H_kv, D), scale, metadata)`
    -> (T, H, D). It may store k and v (that is the KV cache); it must not change q, k or v.
    `metadata` (an `AttentionMetadata`) is passed through untouched, explicitly, never global.
    """

    def __init__(self, config: ModelConfig, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.config, self.tp = config, tp
        self.model = DecoderModel(config, tp)
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, tp)
        self.tie_weights()

    def tie_weights(self) -> None:
        """With tied embeddings the head *is* the embedding matrix (one tensor, two uses)."""
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the weights."""
        return self.lm_head.weight.dtype

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, attn, metadata,
                num_layers: int | None = None):  # fmt: skip
        """Final hidden states for every packed token, (T, hidden); num_layers: the first layers
        only, then the final norm (stage 12's self-speculative draft)."""
        return self.model(input_ids, positions, attn, metadata, num_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Logits over the vocabulary for the given hidden states, (N, vocab); None on a
        tensor-parallel rank other than 0 (rank 0 gathers them and samples)."""
        return self.lm_head.compute_logits(hidden)
