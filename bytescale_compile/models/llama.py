"""A small, clean LLaMA (RMSNorm, RoPE from position_ids, GQA, SwiGLU) following the model protocol.

The protocol (DESIGN.md) is Hugging Face's causal-LM call: `input_ids [B, T]`, `position_ids [B, T]`
(restarting at every packed sequence), `shift_labels [B, T]` (next-token targets, -100 where there is
none) and `num_items_in_batch` (valid targets in the whole global batch). With `num_items_in_batch` the
loss is a sum divided by it, so every rank's loss is already token-level.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["LlamaConfig", "LlamaForCausalLM", "CausalLMOutput", "tiny", "small"]


@dataclass
class LlamaConfig:
    vocab_size: int = 256
    hidden_size: int = 256
    intermediate_size: int = 688
    num_layers: int = 4
    num_heads: int = 8
    num_kv_heads: int = 4
    rope_theta: float = 10000.0
    rms_eps: float = 1e-6
    repeat_kv: bool = False
    """Expand K/V heads by hand (the repeat-kv pattern) instead of SDPA's `enable_gqa`."""

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"hidden_size {self.hidden_size} is not a multiple of num_heads {self.num_heads}")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class CausalLMOutput(NamedTuple):
    loss: torch.Tensor | None
    logits: torch.Tensor


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class Rotary(nn.Module):
    """RoPE angles computed from position_ids, so packed sequences restart at position 0.

    The frequencies are made in fp32 at every call rather than kept as a buffer: `model.to(bfloat16)` would
    cast a buffer too, and bf16 frequencies put the angle ~14 rad off at position 32,000.
    """

    def __init__(self, head_dim: int, theta: float) -> None:
        super().__init__()
        self.head_dim, self.theta = head_dim, theta

    def forward(self, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        steps = torch.arange(0, self.head_dim, 2, dtype=torch.float32, device=position_ids.device)
        inv_freq = 1.0 / self.theta ** (steps / self.head_dim)
        freqs = position_ids[..., None].float() * inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)[:, None]  # [B, 1, T, D]
        return emb.cos().to(dtype), emb.sin().to(dtype)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.cfg = cfg
        d = cfg.head_dim
        self.q_proj = nn.Linear(cfg.hidden_size, cfg.num_heads * d, bias=False)
        self.k_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.v_proj = nn.Linear(cfg.hidden_size, cfg.num_kv_heads * d, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * d, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        cfg = self.cfg
        q = self.q_proj(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, -1, cfg.head_dim).transpose(1, 2)
        q = q * cos + rotate_half(q) * sin
        k = k * cos + rotate_half(k) * sin
        groups = cfg.num_heads // cfg.num_kv_heads
        if cfg.repeat_kv:
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=1.0 / math.sqrt(cfg.head_dim), enable_gqa=groups > 1 and not cfg.repeat_kv
        )
        return self.o_proj(out.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaForCausalLM(nn.Module):
    tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.k_proj": "colwise",
        "layers.*.self_attn.v_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
        "lm_head": "colwise_gather_output",
    }
    """Megatron's layout in Hugging Face's plan format (`bytescale_compile.tensor_parallel` applies it): heads
    and MLP columns split, the lm_head over the vocabulary (the loss pass fuses it vocabulary-parallel)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.config = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary = Rotary(cfg.head_dim, cfg.rope_theta)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(
        self,
        input_ids: torch.Tensor,
        position_ids: torch.Tensor | None = None,
        shift_labels: torch.Tensor | None = None,
        num_items_in_batch: torch.Tensor | None = None,
    ) -> CausalLMOutput:
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)[None].expand_as(input_ids)
        x = self.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        for layer in self.layers:
            x = layer(x, cos, sin)
        logits = self.lm_head(self.norm(x))
        loss = None
        if shift_labels is not None:
            flat_logits = logits.float().view(-1, logits.shape[-1])
            if num_items_in_batch is None:
                loss = F.cross_entropy(flat_logits, shift_labels.view(-1), ignore_index=-100)
            else:
                loss = F.cross_entropy(flat_logits, shift_labels.view(-1), ignore_index=-100, reduction="sum")
                loss = loss / num_items_in_batch
        return CausalLMOutput(loss, logits)


def tiny() -> LlamaForCausalLM:
    """A model small enough for unit tests."""
    return LlamaForCausalLM(
        LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4, num_kv_heads=2)
    )


def small() -> LlamaForCausalLM:
    """The example model of the demo and benchmarks."""
    return LlamaForCausalLM(LlamaConfig())
