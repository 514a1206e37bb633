"""A Llama-family decoder (RMSNorm, RoPE, GQA, SwiGLU) whose attention reads and writes a paged KV pool.

Weights arrive as a dict in Hugging Face naming (see `inference.loader`); q/k/v and gate/up are
fused here so that a step runs two matmuls per block instead of five. On the CPU in fp32 the
projection weights are prepacked once for oneDNN's inner product, which beats the default BLAS
path on the small-M (decode batch) shapes (measured: bench.profile; `KVSERVE_CPU_GEMM=blas` turns
it off).
"""
import logging
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from inference import native
from inference.attention import BACKENDS, AttentionBatch
from inference.precision import CodedWeight, gemm_for
from inference.settings import env_choice

log = logging.getLogger(__name__)


def gemm_wanted() -> str:
    """KVSERVE_CPU_GEMM: auto (unset), onednn or blas."""
    return env_choice("KVSERVE_CPU_GEMM", "auto", ("auto", "onednn", "blas"))


def choose_gemm(device: torch.device, dtype) -> str:
    wanted = gemm_wanted()
    usable = device.type == "cpu" and dtype == torch.float32 and torch.backends.mkldnn.is_available()
    if wanted == "onednn" and not usable:
        raise ValueError("KVSERVE_CPU_GEMM=onednn needs a CPU fp32 model and a torch built with oneDNN")
    return "onednn" if usable and wanted != "blas" else "blas"


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
                 device="cpu", attention_backend: str = "sdpa", precision: str = "fp32", groups=None):
        """`precision` (inference.precision): how the linear weights are stored and multiplied; embeddings,
        norms, RoPE, the residual stream and the logits stay in `dtype` in every mode. `groups`: HF name ->
        GroupQuant, the file's 4-bit blocks (inference.loader.gguf_group_weights), which int4w and w4a8 multiply,
        or Group8Quant, its Q8_0 blocks (gguf_group8_weights: w4a8's lm_head)."""
        self.config = config
        self.attention_backend = attention_backend
        self._attend = BACKENDS[attention_backend]
        self.dtype = dtype
        self.device = torch.device(device)
        self.gemm = choose_gemm(self.device, dtype)
        if precision != "fp32" and dtype != torch.float32:
            raise ValueError(f"precision {precision} needs an fp32 model, not {dtype}")
        self.precision = precision
        gemm = gemm_for(precision, self.device, self.gemm)
        self.kernel = gemm.kernel
        self._linear = gemm.linear
        # RMSNorm in one native pass on the CPU, writing the matmul's input dtype (bf16 modes skip a cast)
        self._fused_norm = self.device.type == "cpu" and dtype == torch.float32 and native.fused_available()
        self._norm_bf16 = gemm.activations == torch.bfloat16
        # SiLU(gate) * up in one native pass outside fp32 (HF's numbers are torch's silu, bit for bit); layer.cpp's
        # w4a8 steps take the same op, so both paths stay equal
        self._fused_silu = self._fused_norm and gemm.mode != "fp32"
        groups = groups or {}
        w = {k: v.to(device=self.device, dtype=dtype) for k, v in weights.items()}

        def pack(*names):  # one weight, or several fused along their output rows
            fused = torch.cat([w[n] for n in names]).contiguous() if len(names) > 1 else w[names[0]]
            parts = [groups[n] for n in names if n in groups]
            if gemm.pack_group and len(parts) == len(names) and len({type(p) for p in parts}) == 1:
                return gemm.pack_group(fused, type(parts[0]).cat(parts))
            return gemm.pack(fused)

        c = config
        self.embed = w["model.embed_tokens.weight"]
        self.lm_head = pack("model.embed_tokens.weight" if c.tie_embeddings else "lm_head.weight")
        self.norm = w["model.norm.weight"]
        self.layers = []
        for i in range(c.num_layers):
            p = f"model.layers.{i}."
            self.layers.append(
                dict(
                    attn_norm=w[p + "input_layernorm.weight"],
                    qkv=pack(*(p + f"self_attn.{n}_proj.weight" for n in "qkv")),
                    o=pack(p + "self_attn.o_proj.weight"),
                    mlp_norm=w[p + "post_attention_layernorm.weight"],
                    gate_up=pack(p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"),
                    down=pack(p + "mlp.down_proj.weight"),
                )
            )
        # a decode step's layers in one native call (w4a8 at its codes' rows): Python's ~20 calls a layer
        # otherwise outweigh one row's matmuls (tests/inference/test_native_layer.py: the same numbers)
        native_layers = [self._native_layer_weights(layer) for layer in self.layers] \
            if precision == "w4a8" and self._fused_norm and attention_backend == "native" else [None]
        self._native_layers = None if None in native_layers else [t for layer in native_layers for t in layer]
        self._native_rows = min((self.layers[0][n].max_rows for n in ("qkv", "o", "gate_up", "down")), default=0) \
            if self._native_layers else 0  # every layer has the same shapes: the first one's rows stand for all
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64) / c.head_dim))
        angles = torch.outer(torch.arange(c.max_position, dtype=torch.float64), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.cos = angles.cos().to(device=self.device, dtype=dtype)
        self.sin = angles.sin().to(device=self.device, dtype=dtype)

    @staticmethod
    def _native_layer_weights(layer: dict) -> list[torch.Tensor] | None:
        """attn_norm, qkv, o, mlp_norm, gate_up, down as layer.cpp's 14 tensors; None unless every projection
        is a CodedWeight (a weight the file holds in no block format stays on the Python path)."""
        coded = [layer[n] for n in ("qkv", "o", "gate_up", "down")]
        if not all(isinstance(w, CodedWeight) for w in coded):
            return None
        empty = torch.empty(0)
        parts = [[w.codes, w.scale, empty if w.mins is None else w.mins] for w in coded]
        return [layer["attn_norm"], *parts[0], *parts[1], layer["mlp_norm"], *parts[2], *parts[3]]

    def _native_step(self, rows: int, batch: AttentionBatch) -> bool:
        """Whether this step runs layer.cpp: every row reads the pool (no fresh prompt) and no more rows than the
        codes take. (w4a8 needs an fp32 model, so the pool is an fp32, bf16 or int8 one rope_store writes; it
        checks.)"""
        return self._native_layers is not None and not batch.fresh and batch.paged is not None \
            and rows <= self._native_rows

    def _rms(self, x, weight):  # same math as x * rsqrt(mean(x^2) + eps) * weight; feeds a matmul
        if self._fused_norm and x.is_contiguous():
            return native.rms_norm(x, weight, self.config.rms_eps, self._norm_bf16)
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
        inter = c.intermediate_size
        x = F.embedding(input_ids, self.embed)
        cos2, sin2 = self.cos[positions], self.sin[positions]  # [T, head_dim]
        cos, sin = cos2.unsqueeze(1), sin2.unsqueeze(1)
        if self._native_step(x.shape[0], batch):
            scale, eps = 1.0 / math.sqrt(c.head_dim), c.rms_eps
            native.decode_layers(x, self._native_layers, cos2, sin2, kv.data, batch.slot_pages, batch.slot_offsets,
                                 batch.paged, scale, c.num_heads, c.num_kv_heads, eps)
            return x
        fused_rope = self._fused_norm and kv.data.dtype in (torch.float32, torch.bfloat16, torch.int8) and \
            kv.data.is_contiguous()
        for layer_idx, layer in enumerate(self.layers):
            h = self._rms(x, layer["attn_norm"])
            qkv = self._linear(h, layer["qkv"])
            v = qkv[:, num_q + num_kv :].view(-1, c.num_kv_heads, c.head_dim)
            if fused_rope and qkv.is_contiguous():  # one native pass: RoPE on q|k, rotated k and v into the pool
                qk = native.rope_store(qkv, cos2, sin2, kv.data, layer_idx, batch.slot_pages, batch.slot_offsets,
                                       c.num_heads, c.num_kv_heads)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
            else:  # q and k are adjacent in the fused projection: one RoPE call rotates both
                qk = self._rope(qkv[:, : num_q + num_kv].view(-1, c.num_heads + c.num_kv_heads, c.head_dim), cos, sin)
                q, k = qk[:, : c.num_heads], qk[:, c.num_heads :]
                kv.write(layer_idx, batch.slot_pages, batch.slot_offsets, k, v)
            attn = self._attend(q, k, v, kv, layer_idx, batch)
            x.add_(self._linear(attn.reshape(-1, num_q), layer["o"]))  # in place: no new [T, hidden] a layer
            h = self._rms(x, layer["mlp_norm"])
            gate_up = self._linear(h, layer["gate_up"])  # slices, not chunk(): a third of its dispatch at one row
            act = native.silu_mul(gate_up) if self._fused_silu and gate_up.is_contiguous() else \
                F.silu(gate_up[:, :inter]).mul_(gate_up[:, inter:])
            x.add_(self._linear(act, layer["down"]))
        return x

    @torch.inference_mode()
    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self._linear(self._rms(hidden, self.norm), self.lm_head).float()
