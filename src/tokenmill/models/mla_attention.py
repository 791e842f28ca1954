"""Multi-head latent attention (DeepSeek-V2) over the paged KV cache, run as multi-query attention on the latent.

DeepSeek-V2 compresses each token into one latent c = kv_a_layernorm(first r values of kv_a_proj_with_mqa(x))
(r = kv_lora_rank) and one RoPE key k_pe (qk_rope_head_dim wide) that all heads share. Head h's key is
[W_UK_h c, k_pe] and its value W_UV_h c, W_UK_h [nope, r] and W_UV_h [v, r] being head h's rows of
kv_b_proj. Because

    q_h . k_h(t) = (W_UK_h^T q_nope_h) . c_t + q_pe_h . k_pe_t
    sum_t p_t W_UV_h c_t = W_UV_h (sum_t p_t c_t),

W_UK is absorbed into the query and W_UV applied after attention ("absorbed" MLA): every head attends
over the one key [c_t, k_pe_t] of width r + rope with that same vector as its value, and the first r
values of its output are the attended latent. The paged backends run this unchanged as multi-query
attention (1 KV head, head_dim r + rope); no per-head K or V is ever materialised.

Cache (per layer): a key-only cache [1, blocks, 1, block_size, r + rope] holding [c, k_pe] once; the
backends read the values from that same plane (KVCacheSpec.planes). That is heads * (nope + rope + v) /
(r + rope) times smaller than full K/V: 8.9x for DeepSeek-V2-Lite (16 heads), 71x for DeepSeek-V2 (128).

RoPE: Hugging Face rotates interleaved pairs (x[2i], x[2i+1]) of q_pe and k_pe; the projections' RoPE
rows are de-interleaved as they load (evens then odds), which turns that rotation into the rotate-half
one tokenmill's tables (and native kernel) apply. q and k are permuted alike, so their dot product, the
only place they meet, is unchanged. The softmax scale is (qk_nope + qk_rope) ** -0.5 (times yarn's
mscale squared), given by the loader as `ArchConfig.attention_scale`.

Tensor parallelism is refused (heads are not sharded); pipeline parallelism needs nothing of its own
but is untested. The released DeepSeek-V2 checkpoints' YaRN RoPE comes through the shared rotary tables
(layers/rotary.py).
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from tokenmill.attention.base import AttentionBackend, AttentionLayer
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear, default_weight_loader
from tokenmill.layers.linear_kernels import LinearKernel, make_kernel
from tokenmill.layers.norm import RMSNorm
from tokenmill.models.arch import ArchConfig, LayerSpec
from tokenmill.models.attention_block import RopeInputs, rope_key
from tokenmill.parallel.group import TPGroup

# Hugging Face's DeepseekV2RMSNorm default: q_a_layernorm and kv_a_layernorm do not take rms_norm_eps
_LATENT_NORM_EPS = 1e-6


def _check_shape(what: str, because: str, loaded: Any, expected: torch.Size) -> None:
    """ValueError naming the tensor, its shape and the config values that predicted another one."""
    if tuple(loaded.shape) != tuple(expected):
        raise ValueError(f"checkpoint tensor {what} has shape {tuple(loaded.shape)}, but config.json says {because}, "
                         f"which means shape {tuple(expected)}: the config contradicts the weights")


def deinterleaved(rope_dim: int) -> torch.Tensor:
    """Row order taking interleaved RoPE pairs (x0, x1), (x2, x3), ... to the rotate-half layout
    (x0, x2, ..., x1, x3, ...)."""
    return torch.cat((torch.arange(0, rope_dim, 2), torch.arange(1, rope_dim, 2)))


class CheckedLinear(ColumnParallelLinear):
    """A replicated projection whose checkpoint tensor must have exactly the shape the config implies
    (`because` names the config values, for the error), its rows taken in `row_order` (None: as stored)."""

    def __init__(self, in_features: int, out_features: int, bias: bool, what: str, because: str,
                 row_order: Optional[torch.Tensor] = None) -> None:
        super().__init__(in_features, out_features, bias)
        self.what, self.because, self.row_order = what, because, row_order

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        """Check the shape, reorder the rows, then load as a column-parallel layer at one rank does."""
        _check_shape(self.what + (".weight" if param.dim() == 2 else ".bias"), self.because, loaded, param.shape)
        if self.row_order is not None:
            if not isinstance(loaded, torch.Tensor):
                raise ValueError(f"{self.what}: quantised checkpoint tensors are not supported for MLA projections")
            loaded = loaded.index_select(0, self.row_order.to(loaded.device))
        super().weight_loader(param, loaded, shard_id)


class CheckedNorm(RMSNorm):
    """RMSNorm of a latent (q_a_layernorm, kv_a_layernorm) whose width must match the config's rank."""

    def __init__(self, size: int, what: str, because: str) -> None:
        super().__init__(size, _LATENT_NORM_EPS)
        self.what, self.because = what, because

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard: Any = None) -> None:
        """Check the width, then load."""
        _check_shape(self.what + ".weight", self.because, loaded, param.shape)
        super().weight_loader(param, loaded, shard)


class LatentUpProjection(nn.Module):
    """kv_b_proj [heads * (nope + v), r], used absorbed: head h's rows are W_UK_h (nope rows) then W_UV_h
    (v rows). `absorb` maps q_nope into the latent space (q_nope_h W_UK_h), `expand` the attended latent
    back out (W_UV_h o_h). Per-head products: torch batched matmuls, or after `use_kernel(batch_invariant=True)`
    with native kernels, one batch-invariant kernel per head and direction (a row's result does not depend
    on how many rows share the step, as for every other projection)."""

    def __init__(self, num_heads: int, nope: int, v: int, rank: int, because: str) -> None:
        super().__init__()
        self.num_heads, self.nope, self.v, self.rank = num_heads, nope, v, rank
        self.because = because
        self.weight = nn.Parameter(torch.empty(num_heads * (nope + v), rank), requires_grad=False)
        self.head_kernels: Optional[list[tuple[LinearKernel, LinearKernel]]] = None  # (absorb, expand) per head

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: object = None) -> None:
        """Check the shape against the config, then copy."""
        _check_shape("self_attn.kv_b_proj.weight", self.because, loaded, param.shape)
        default_weight_loader(param, loaded)

    def _split(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Views W_UK [heads, nope, r] and W_UV [heads, v, r] of the loaded weight."""
        w = self.weight.view(self.num_heads, self.nope + self.v, self.rank)
        return w[:, :self.nope], w[:, self.nope:]

    def use_kernel(self, packed: bool, native: Any = None, batch_invariant: bool = True) -> None:
        """After loading: batch-invariant per-head kernels where the native ones are there (the float weight
        is then dropped: the kernels keep their copies); else stay with torch's batched matmul."""
        if not (batch_invariant and native is not None):
            return
        uk, uv = self._split()
        self.head_kernels = [(make_kernel(uk[h].t().contiguous(), None, packed, native, True),
                              make_kernel(uv[h].contiguous(), None, packed, native, True))
                             for h in range(self.num_heads)]
        self.weight = None

    def absorb(self, q_nope: torch.Tensor) -> torch.Tensor:
        """q_nope [T, heads, nope] -> the query's latent part [T, heads, r]."""
        if self.head_kernels is not None:
            return torch.stack([absorb(q_nope[:, h]) for h, (absorb, _) in enumerate(self.head_kernels)], dim=1)
        uk, _ = self._split()
        return torch.bmm(q_nope.transpose(0, 1), uk).transpose(0, 1)

    def expand(self, latent_out: torch.Tensor) -> torch.Tensor:
        """Attended latents [T, heads, r] -> values [T, heads * v], heads in checkpoint order (o_proj's input)."""
        if self.head_kernels is not None:
            return torch.cat([expand(latent_out[:, h]) for h, (_, expand) in enumerate(self.head_kernels)], dim=1)
        _, uv = self._split()
        out = torch.bmm(latent_out.transpose(0, 1), uv.transpose(1, 2))  # [heads, T, v]
        return out.transpose(0, 1).reshape(latent_out.shape[0], -1)


class MLAAttention(nn.Module):
    """DeepSeek-V2 attention (see the module docstring): queries from q_proj, or q_a_proj -> q_a_layernorm ->
    q_b_proj when `q_lora_rank` is set; keys and values from the cached latent [c, k_pe]."""

    def __init__(self, arch: ArchConfig, spec: LayerSpec, backend: AttentionBackend, tp: TPGroup) -> None:
        super().__init__()
        if tp.size > 1:
            raise ValueError(f"MLA models run at tensor_parallel_size 1 (asked for {tp.size}): "
                             "attention heads are not sharded")
        mla = arch.mla
        assert mla is not None
        heads, hidden = arch.num_attention_heads, arch.hidden_size
        self.num_heads, self.rank, self.nope, self.rope_dim = heads, mla.kv_lora_rank, mla.qk_nope_head_dim, \
            mla.qk_rope_head_dim
        qk = mla.qk_nope_head_dim + mla.qk_rope_head_dim
        heads_terms = (f"num_attention_heads {heads} x (qk_nope_head_dim {mla.qk_nope_head_dim} + "
                       f"qk_rope_head_dim {mla.qk_rope_head_dim})")
        # query rows: every head's nope part, then every head's RoPE part de-interleaved, so both are
        # [T, heads, dim] views with contiguous heads (what the native RoPE kernel rotates in place)
        rope_rows = deinterleaved(mla.qk_rope_head_dim)
        q_order = torch.cat([torch.cat([h * qk + torch.arange(mla.qk_nope_head_dim) for h in range(heads)]),
                             torch.cat([h * qk + mla.qk_nope_head_dim + rope_rows for h in range(heads)])])
        self.q_proj = self.q_a_proj = self.q_a_layernorm = self.q_b_proj = None
        if mla.q_lora_rank is None:
            self.q_proj = CheckedLinear(hidden, heads * qk, False, "self_attn.q_proj", heads_terms, q_order)
        else:
            lora = f"q_lora_rank {mla.q_lora_rank}"
            self.q_a_proj = CheckedLinear(hidden, mla.q_lora_rank, arch.attention_bias, "self_attn.q_a_proj", lora)
            self.q_a_layernorm = CheckedNorm(mla.q_lora_rank, "self_attn.q_a_layernorm", lora)
            self.q_b_proj = CheckedLinear(mla.q_lora_rank, heads * qk, False, "self_attn.q_b_proj",
                                          f"{heads_terms} and {lora}", q_order)
        kv_terms = f"kv_lora_rank {mla.kv_lora_rank} + qk_rope_head_dim {mla.qk_rope_head_dim}"
        self.kv_a_proj_with_mqa = CheckedLinear(
            hidden, mla.kv_lora_rank + mla.qk_rope_head_dim, arch.attention_bias, "self_attn.kv_a_proj_with_mqa",
            kv_terms, torch.cat((torch.arange(mla.kv_lora_rank), mla.kv_lora_rank + rope_rows)))
        self.kv_a_layernorm = CheckedNorm(mla.kv_lora_rank, "self_attn.kv_a_layernorm",
                                          f"kv_lora_rank {mla.kv_lora_rank}")
        self.kv_b_proj = LatentUpProjection(
            heads, mla.qk_nope_head_dim, mla.v_head_dim, mla.kv_lora_rank,
            f"num_attention_heads {heads} x (qk_nope_head_dim {mla.qk_nope_head_dim} + v_head_dim "
            f"{mla.v_head_dim}) and kv_lora_rank {mla.kv_lora_rank}")
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias=arch.attention_out_bias)
        scale = arch.attention_scale if arch.attention_scale is not None else qk ** -0.5
        self.attention = AttentionLayer(scale, spec.sliding_window)
        self.rope_key = rope_key(arch, spec)
        self.backend = backend

    def forward(self, rope: RopeInputs, hidden: torch.Tensor, kv_cache: torch.Tensor,
                attn_metadata: Any) -> torch.Tensor:
        """hidden: [T, hidden] -> [T, hidden]; writes the tokens' [c, k_pe] into the cache."""
        tokens, heads, rank = hidden.shape[0], self.num_heads, self.rank
        if self.q_proj is not None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        # invariant (load-time row order): q = [heads x nope | heads x rope], each rope part rotate-half ordered
        q_nope = q[:, :heads * self.nope].view(tokens, heads, self.nope)
        q_pe = rope.apply(self.rope_key, q[:, heads * self.nope:].view(tokens, heads, self.rope_dim))
        kv = self.kv_a_proj_with_mqa(hidden)  # [T, r + rope]: the latent before its norm, then k_pe
        k_pe = rope.apply(self.rope_key, kv[:, rank:].view(tokens, 1, self.rope_dim))
        latent = torch.cat((self.kv_a_layernorm(kv[:, :rank]), k_pe.view(tokens, self.rope_dim)), dim=-1)
        latent = latent.view(tokens, 1, rank + self.rope_dim)  # the one "KV head"
        query = torch.cat((self.kv_b_proj.absorb(q_nope), q_pe), dim=-1)  # [T, heads, r + rope]
        # value = key = [c, k_pe]: the output's first r values per head are sum_t p_t c_t
        out = self.backend.forward(query, latent, latent, kv_cache, attn_metadata, self.attention)
        return self.o_proj(self.kv_b_proj.expand(out[..., :rank]))
