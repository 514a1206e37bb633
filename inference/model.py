"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention reads and writes a paged KV pool.

Weights arrive as a dict in Hugging Face naming (see `inference.loader`); q/k/v and gate/up are
fused here so that a step runs two matmuls per block instead of five.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference.attention import BACKENDS, AttentionBatch


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rope_theta: float
    rms_eps: float
    max_position: int
    tie_embeddings: bool

    def to_dict(self) -> dict:
        return dict(self.__dict__)


class Llama:
    def __init__(self, config: ModelConfig, weights: dict[str, torch.Tensor], dtype=torch.float32,
                 device="cpu", attention_backend: str = "sdpa"):
        self.config = config
        self.attention_backend = attention_backend
        self._attend = BACKENDS[attention_backend]
        self.dtype = dtype
        self.device = torch.device(device)
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}
        c = config
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = self.embed if c.tie_embeddings else w["lm_head.weight"]
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                dict(
                    attn_norm=w[p + "input_layernorm.weight"],
                    qkv=torch.cat([w[p + f"self_attn.{n}_proj.weight"] for n in "qkv"]).contiguous(),
                    o=w[p + "self_attn.o_proj.weight"],
                    mlp_norm=w[p + "post_attention_layernorm.weight"],
                    gate_up=torch.cat([w[p + "mlp.gate_proj.weight"], w[p + "mlp.up_proj.weight"]]).contiguous(),
                    down=w[p + "mlp.down_proj.weight"],
                )
            )
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(c.max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=self.device, dtype=dtype)
        self.sin = angles.sin().to(device=self.device, dtype=dtype)

    def _rms(self, x, weight):  # fused; same math as x * rsqrt(mean(x^2) + eps) * weight
        return F.rms_norm(x, (x.shape[-1],), weight, self.config.rms_eps)

    def _rope(self, x, cos, sin):  # x: [T, heads, head_dim]; rotate-half form on un-permuted weights
        half = x.shape[-1] // 2
        rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
        return x * cos + rotated * sin

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, batch: AttentionBatch, kv) -> torch.Tensor:
        """Runs the flat token batch; writes its K/V into `kv` and returns final hidden states [T, hidden]."""
        c = self.config
        num_q = c.num_heads * c.head_dim
        num_kv = c.num_kv_heads * c.head_dim
        x = F.embedding(input_ids, self.embed)
        cos = self.cos[positions].unsqueeze(1)
        sin = self.sin[positions].unsqueeze(1)
        for layer_idx, layer in enumerate(self.layers):
            h = self._rms(x, layer["attn_norm"])
            qkv = F.linear(h, layer["qkv"])
            # q and k are adjacent in the fused projection: one RoPE call rotates both
            qk = self._rope(qkv[:, : num_q + num_kv].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
            q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            v = qkv[:, num_q + num_kv :].view(-1, c.num_kv_heads, c.head_dim)
            kv.write(layer_idx, batch.slot_pages, batch.slot_offsets, k, v)
            attn = self._attend(q, k, v, kv, layer_idx, batch)
            x = x + F.linear(attn.reshape(-1, num_q), layer["o"])
            h = self._rms(x, layer["mlp_norm"])
            gate, up = F.linear(h, layer["gate_up"]).chunk(2, dim=-1)
            x = x + F.linear(F.silu(gate) * up, layer["down"])
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(self._rms(hidden, self.norm), self.lm_head).float()
