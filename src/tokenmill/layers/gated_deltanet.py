"""Qwen3-Next's Gated DeltaNet token mixer (transformers' Qwen3NextGatedDeltaNet) over per-request recurrent states.

As layers/mamba2_mixer.py's mixer, each request of a step is computed alone from its own state (a
`RecurrentState` page, or a hybrid's `PagedState` in attention pool blocks), so its output does not depend on
what else runs (batch invariance): the conv continues from the state's last conv_kernel - 1 inputs, the gated
delta rule (layers/gated_delta_rule.py) from its [value heads, key_head_dim, value_head_dim] matrices, and both
are written back; a chunk that starts its sequence (`fresh`) starts from zeros.

Checkpoint layout: in_proj_qkvz's rows come grouped per key head (q, k, then that head's value heads' v and z),
in_proj_ba's per key head (b then a); `deltanet_projection_rows` reorders them, as they load, into one block
each ([q | k | v | z] and [b | a]), so the forward splits them without a reshape per key head.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
import torch.nn.functional as F
from torch import nn

from tokenmill.layers.gated_delta_rule import gated_delta_rule
from tokenmill.layers.invariant_ops import elementwise
from tokenmill.layers.linear import ColumnParallelLinear, RowParallelLinear
from tokenmill.layers.mamba2_mixer import StateChunk, advance_request


def l2_normalized(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(sum(x^2) + eps) over the last dimension (transformers' and fla's l2norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def deltanet_projection_rows(name: str, tensor: torch.Tensor, config: Any) -> torch.Tensor:
    """A checkpoint's in_proj_qkvz or in_proj_ba weight (`name` ends with which) with its rows reordered from
    per-key-head groups ([q_h, k_h, v_h, z_h] and [b_h, a_h] for each key head h) into blocks ([q | k | v | z],
    [b | a]), each block in head order. ValueError for a tensor of another shape."""
    heads, per = config.num_key_heads, config.num_value_heads // config.num_key_heads
    if name.endswith("in_proj_qkvz.weight"):
        widths = [config.key_head_dim, config.key_head_dim, per * config.value_head_dim, per * config.value_head_dim]
    else:
        widths = [per, per]
    if not isinstance(tensor, torch.Tensor) or tensor.dim() != 2 or tensor.shape[0] != heads * sum(widths):
        shape = tuple(tensor.shape) if isinstance(tensor, torch.Tensor) else type(tensor).__name__
        raise ValueError(f"checkpoint tensor {name!r} has shape {shape}, but the config's Gated DeltaNet needs "
                         f"a float matrix of {heads * sum(widths)} rows")
    grouped = tensor.reshape(heads, sum(widths), tensor.shape[1]).split(widths, dim=1)
    return torch.cat([part.reshape(-1, tensor.shape[1]) for part in grouped], dim=0)


class GatedDeltaNet(nn.Module):
    """Qwen3-Next's linear attention for a flattened batch of requests' chunks; tensor names as the checkpoint's
    (in_proj_qkvz, in_proj_ba, conv1d, dt_bias, A_log, norm, out_proj). `config`: a GatedDeltaNetConfig."""

    def __init__(self, hidden_size: int, config: Any) -> None:
        super().__init__()
        self.config = config
        c = config
        if c.num_value_heads % c.num_key_heads:
            raise ValueError(f"linear_num_value_heads ({c.num_value_heads}) must be a multiple of "
                             f"linear_num_key_heads ({c.num_key_heads})")
        self.in_proj_qkvz = ColumnParallelLinear(hidden_size, 2 * c.key_dim + 2 * c.value_dim)
        self.in_proj_ba = ColumnParallelLinear(hidden_size, 2 * c.num_value_heads)
        self.conv1d = nn.Conv1d(c.conv_dim, c.conv_dim, c.conv_kernel, groups=c.conv_dim, bias=False)
        self.conv1d.requires_grad_(False)
        self.dt_bias = nn.Parameter(torch.empty(c.num_value_heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(c.num_value_heads), requires_grad=False)
        self.norm = nn.Module()  # the gated RMSNorm's weight (per value head's channels), under the checkpoint's name
        self.norm.weight = nn.Parameter(torch.empty(c.value_head_dim), requires_grad=False)
        self.out_proj = RowParallelLinear(c.value_dim, hidden_size)
        self.by_token = False  # batch invariance: every token runs as a one-token step would (advance_request)

    def use_kernel(self, packed: bool, native: bool, batch_invariant: bool) -> None:
        """The model's kernel choice (models/decoder.py): under batch invariance a prompt runs token by token."""
        self.by_token = batch_invariant

    def forward(self, hidden: torch.Tensor, state: Any, chunks: Sequence[StateChunk]) -> torch.Tensor:
        """hidden [T, hidden] (the step's chunks, in `chunks` order) -> [T, hidden]; each request's conv window and
        delta-rule state are read from and written back to `state` (RecurrentState or PagedState)."""
        c = self.config
        qkv, z = self.in_proj_qkvz(hidden).split([c.conv_dim, c.value_dim], dim=-1)
        ba = self.in_proj_ba(hidden)
        out = torch.empty(hidden.shape[0], c.num_value_heads, c.value_head_dim, dtype=torch.float32,
                          device=hidden.device)
        for chunk in chunks:  # one request at a time: its arithmetic is its own (batch invariance)
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            qkv_rows, ba_rows = qkv[rows], ba[rows]
            out[rows] = advance_request(state, chunk, lambda start, stop, earlier, matrices: self._advance(
                qkv_rows[start:stop], ba_rows[start:stop], earlier, matrices), self.by_token)
        return self.out_proj(self._gated_norm(out, z).reshape(hidden.shape[0], c.value_dim))

    def _advance(self, qkv: torch.Tensor, ba: torch.Tensor, earlier: torch.Tensor, matrices: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Rows of one request from its conv window `earlier` and delta-rule state: the gates, the conv, then the rule
        -> (out [T, value heads, Dv], the new conv window, the new state). (The element-wise gates too are computed
        on these rows alone: a vectorised loop's last elements may take another code path, so a row's bits must not
        depend on where it sits in the step.)"""
        c = self.config
        b, a = ba.split([c.num_value_heads, c.num_value_heads], dim=-1)
        beta = torch.sigmoid(b).float()  # (in the compute dtype, as transformers)
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias.float())  # log decay, <= 0
        weight = self.conv1d.weight
        window = torch.cat([earlier, qkv.to(earlier.dtype)], dim=0)  # [K - 1 + T, conv_dim]
        conv = F.silu(F.conv1d(window.t().unsqueeze(0).to(weight.dtype), weight, None, groups=c.conv_dim)[0].t())
        q, k, v = conv.float().split([c.key_dim, c.key_dim, c.value_dim], dim=-1)
        T, per = q.shape[0], c.num_value_heads // c.num_key_heads
        # each key head serves `per` consecutive value heads
        q = l2_normalized(q.reshape(T, c.num_key_heads, c.key_head_dim)).repeat_interleave(per, dim=1)
        k = l2_normalized(k.reshape(T, c.num_key_heads, c.key_head_dim)).repeat_interleave(per, dim=1)
        out, matrices = gated_delta_rule(q * c.key_head_dim ** -0.5, k, v.reshape(T, c.num_value_heads, -1), g, beta,
                                         matrices.float())
        return out, window[-(c.conv_kernel - 1):], matrices

    def _gated_norm(self, out: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per value head: RMSNorm of the output (float32, then the compute dtype, times the weight) times
        silu(z) (transformers' Qwen3NextRMSNormGated: the norm before the gate), in z's dtype."""
        dtype = z.dtype
        out = out.to(dtype).float()  # (transformers' rule returns the compute dtype)
        normed = out * torch.rsqrt(out.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        normed = self.norm.weight * normed.to(dtype)
        gate = elementwise(F.silu, z.float().reshape(normed.shape))
        return (normed * gate).to(dtype)
