"""Self-attention over the paged KV cache (GQA, optional q/k norm, per-layer RoPE base, scale, window and attention
chunk, Llama 4's q/k L2 norm and NoPE query temperature, Qwen3-Next's output gate), and the step's rotary embeddings
shared by the layers."""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend, AttentionLayer
from tokenmill.layers.invariant_ops import elementwise
from tokenmill.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenmill.layers.norm import RMSNorm, unit_rms_norm
from tokenmill.layers.rotary import RotaryEmbedding, StepRotaryEmbedding, apply_rotary
from tokenmill.models.arch import ArchConfig, LayerSpec, RopeScaling
from tokenmill.parallel.group import TPGroup


class SelfAttention(nn.Module):
    """Self-attention with fused QKV, optional q/k RMSNorm (per head, or over the whole projections as
    OLMoE's), RoPE and paged KV."""

    def __init__(self, arch: ArchConfig, spec: LayerSpec, backend: AttentionBackend, tp: TPGroup) -> None:
        super().__init__()
        self.head_dim = arch.head_dim
        self.qkv_proj = QKVParallelLinear(arch.hidden_size, arch.head_dim, arch.num_attention_heads,
                                          arch.num_key_value_heads, bias=arch.attention_bias, tp=tp)
        self.num_heads, self.num_kv_heads = self.qkv_proj.num_local_heads, self.qkv_proj.num_local_kv_heads
        self.o_proj = RowParallelLinear(arch.num_attention_heads * arch.head_dim, arch.hidden_size,
                                        bias=arch.attention_out_bias, tp=tp)
        # Qwen3-Next: a gate per query head's output, sigmoid(gate(x)) (its checkpoint's q_proj holds these rows
        # too, split off as it loads: models/qwen3_next.py); this rank's heads, as qkv_proj's
        self.output_gate = (ColumnParallelLinear(arch.hidden_size, arch.num_attention_heads * arch.head_dim,
                                                 bias=arch.attention_bias, tp=tp)
                            if arch.attention_output_gate else None)
        offset = arch.norm_weight_offset
        self.qk_norm_per_head = arch.qk_norm_per_head
        q_width, k_width = arch.head_dim, arch.head_dim
        if arch.qk_norm and not arch.qk_norm_per_head:
            if tp.size > 1:  # the norm's mean would span every rank's heads
                raise ValueError(f"{arch.architecture}: a q/k norm over the whole projections does not support "
                                 f"tensor parallelism (tensor_parallel_size {tp.size})")
            q_width, k_width = arch.num_attention_heads * arch.head_dim, arch.num_key_value_heads * arch.head_dim
        self.q_norm = RMSNorm(q_width, arch.rms_norm_eps, offset) if arch.qk_norm else None
        self.k_norm = RMSNorm(k_width, arch.rms_norm_eps, offset) if arch.qk_norm else None
        scale = arch.attention_scale if arch.attention_scale is not None else arch.head_dim ** -0.5
        # GPT-OSS's attention sinks, this rank's heads; float32 whatever the model's dtype (the kernels read them
        # as float32). Invariant: the model is never cast after construction, so the Parameter the
        # AttentionLayer holds is the one the checkpoint loads into and that moves with the model.
        self.tp_rank, self.tp_size = tp.rank, tp.size
        self.sinks = (nn.Parameter(torch.empty(self.num_heads, dtype=torch.float32), requires_grad=False)
                      if arch.attention_sinks else None)
        self.attention = AttentionLayer(scale, spec.sliding_window, arch.attn_logit_softcap, self.sinks,
                                        spec.attention_chunk)
        self.rope_key = rope_key(arch, spec)
        self.rotary_dim = arch.rotary_dim or arch.head_dim
        self.rotates = spec.rope  # False: a NoPE layer (SmolLM3, Llama 4)
        # Llama 4: q and k scaled to unit RMS after RoPE, on its RoPE layers only (transformers' Llama4TextL2Norm)
        self.l2_norm_eps = arch.rms_norm_eps if arch.qk_l2_norm and spec.rope else None
        # Llama 4's temperature tuning (floor_scale, attn_scale), on its NoPE layers only
        self.query_temperature = arch.nope_query_temperature if not spec.rope else None
        self.backend = backend

    def forward(self, rope: "RopeInputs", hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]."""
        qkv = self.qkv_proj(hidden).view(hidden.shape[0], -1, self.head_dim)  # heads: q..., k..., v...
        q_and_k, v = qkv.split([self.num_heads + self.num_kv_heads, self.num_kv_heads], dim=1)
        if self.q_norm is not None:
            q, k = q_and_k.split([self.num_heads, self.num_kv_heads], dim=1)
            if not self.qk_norm_per_head:  # normed as [T, heads * head_dim] rows
                q = self.q_norm(q.reshape(q.shape[0], -1)).view(q.shape)
                k = self.k_norm(k.reshape(k.shape[0], -1)).view(k.shape)
            else:
                q, k = self.q_norm(q), self.k_norm(k)
            q_and_k = torch.cat((q, k), dim=1)
        if self.rotates:
            q_and_k = self.rotate(rope, q_and_k)
        if self.l2_norm_eps is not None:
            q_and_k = unit_rms_norm(q_and_k, self.l2_norm_eps)
        q, k = q_and_k.split([self.num_heads, self.num_kv_heads], dim=1)
        if self.query_temperature is not None:
            q = self.tempered(q, rope.positions)
        out = self.backend.forward(q, k, v, kv_cache, attn_metadata, self.attention)
        out = out.reshape(out.shape[0], -1)
        if self.output_gate is not None:  # in the compute dtype, as transformers gates it
            out = out * elementwise(torch.sigmoid, self.output_gate(hidden))
        return self.o_proj(out)


    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The attention's own tensor, GPT-OSS's `sinks` [num_attention_heads]: this rank's heads of it."""
        if param is not self.sinks:
            raise ValueError("SelfAttention loads only its attention sinks itself")
        heads = self.num_heads
        if loaded.dim() != 1 or loaded.shape[0] != heads * self.tp_size:
            raise ValueError(f"the checkpoint's attention sinks have shape {tuple(loaded.shape)}, not one per "
                             "query head")
        param.data.copy_(loaded.narrow(0, self.tp_rank * heads, heads).to(torch.float32))

    def tempered(self, q: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Llama 4's attention temperature tuning of a NoPE layer's q [T, heads, head_dim]: the row at position p
        times 1 + attn_scale * log(1 + floor((p + 1) / floor_scale)), in float32 and rounded back, as transformers
        computes it (a query's scale is a function of its position alone)."""
        floor_scale, attn_scale = self.query_temperature
        scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
        return (q * scales[:, None, None]).to(q.dtype)

    def rotate(self, rope: "RopeInputs", q_and_k: torch.Tensor) -> torch.Tensor:
        """RoPE on q and k [T, heads, head_dim]: on the whole heads, or with partial rotary (GLM) on the first
        rotary_dim dims of each, the rest passed through (the tables are rotary_dim wide)."""
        if self.rotary_dim == self.head_dim:
            return rope.apply(self.rope_key, q_and_k)
        # a contiguous copy: the native and Triton kernels rotate whole, contiguous heads in place
        turned = rope.apply(self.rope_key, q_and_k[..., :self.rotary_dim].contiguous())
        return torch.cat((turned, q_and_k[..., self.rotary_dim:]), dim=-1)


RopeKey = tuple[float, Optional[RopeScaling]]


def rope_key(arch: ArchConfig, spec: LayerSpec) -> RopeKey:
    """Which rotary table a layer uses: its base, and the model's scaling except on the local (sliding)
    layers of a model with a local base (Gemma 3 scales only its global layers)."""
    local = arch.rope_local_theta is not None and spec.sliding_window is not None
    return spec.rope_theta, None if local else arch.rope_scaling


class RotaryTables(nn.Module):
    """The model's rotary embeddings, one per distinct (base, scaling) among its layers."""

    def __init__(self, arch: ArchConfig, head_dim: int, max_positions: int) -> None:
        super().__init__()
        keys = dict.fromkeys(rope_key(arch, arch.layer_spec(i)) for i in range(arch.num_hidden_layers))
        self.tables: dict[RopeKey, RotaryEmbedding] = {
            key: RotaryEmbedding(head_dim, max_positions, key[0], key[1]) for key in keys}

    def set_frequency_divisors(self, divisors: torch.Tensor) -> None:
        """GGUF's rope_freqs: divide the inverse frequencies of the scaled tables."""
        for (_, scaling), table in self.tables.items():
            if scaling is not None:
                table.set_frequency_divisors(divisors)

    def to_device(self, device: torch.device) -> None:
        """Move every table to `device`."""
        for table in self.tables.values():
            table.to_device(device)

    def for_step(self, positions: torch.Tensor, section: tuple[int, ...]) -> "StepTables":
        """Tables of this step's M-RoPE rows, one per token, for its 3-D `positions` [3, T]."""
        return StepTables({key: StepRotaryEmbedding(table, positions, section) for key, table in self.tables.items()})


class StepTables:
    """One step's rotary tables, keyed as `RotaryTables.tables` (RopeInputs reads either)."""

    def __init__(self, tables: dict) -> None:
        self.tables = tables


class RopeInputs:
    """This step's rotary embeddings: per table, cos/sin looked up once for all layers (PyTorch path),
    or positions for the native kernel, which reads the float32 tables itself and rotates in place."""

    def __init__(self, rotary: RotaryTables, positions: torch.Tensor, dtype: torch.dtype, kernels: Any) -> None:
        self.rotary, self.positions, self.kernels = rotary, positions, kernels
        self.cos_sin: dict[RopeKey, tuple[torch.Tensor, torch.Tensor]] = {}
        if kernels is None:
            self.cos_sin = {key: table.cos_sin(positions, dtype) for key, table in rotary.tables.items()}

    def apply(self, key: RopeKey, x: torch.Tensor) -> torch.Tensor:
        """Rotate x [T, heads, width] (width: the table's) by table `key`; the kernel path rotates x itself
        and returns it."""
        if self.kernels is None:
            return apply_rotary(x, *self.cos_sin[key])
        table = self.rotary.tables[key]
        self.kernels.rope(x, self.positions, table.cos, table.sin)
        return x
