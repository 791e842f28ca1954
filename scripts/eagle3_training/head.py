"""The EAGLE-3 head as it trains (dense attention over whole sequences, float32), and its checkpoint in the layout
vLLM and SpecForge write and tokenmill's models/eagle3.py reads: config.json (architectures
LlamaForCausalLMEagle3, draft_vocab_size, target_hidden_size, eagle_aux_hidden_state_layer_ids) and
model.safetensors (midlayer.*, fc, norm, lm_head over the draft vocabulary, d2t = target id - draft id, t2d =
which target ids the draft vocabulary holds). The head reads the target's embedding table (no embed_tokens).

Its arithmetic is models/eagle3.py's: x = concat(input_layernorm(embedding), hidden_norm(hidden)) into one Llama
layer whose residual is the hidden state; logits = lm_head(norm(output)); the output is the next chained
position's hidden state."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn
from torch.nn import functional as F


@dataclass(frozen=True)
class HeadShape:
    """The head's sizes (the target's layer shape by default) and what it reads of the target."""

    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int  # the target's
    draft_vocab: int
    target_hidden: int
    layers: tuple[int, int, int]  # the target layers whose entering residual stream is tapped
    rope_theta: float
    rms_eps: float
    max_positions: int


class RMSNorm(nn.Module):
    """Llama's RMSNorm (float32 here)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's (neox-style) rotary embedding of x [..., T, head_dim] by cos/sin [T, head_dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


class TrainableEagle3Head(nn.Module):
    """The head's parameters under their checkpoint names (midlayer.*, fc, norm, lm_head) and its training-time
    test: `unrolled(embed_next, hidden, steps)` runs the head `steps` times over whole sequences as it runs when
    serving, each step fed its own outputs of the step before."""

    def __init__(self, shape: HeadShape, draft_to_target: torch.Tensor) -> None:
        super().__init__()
        h, s = shape.hidden, shape
        self.shape = s
        self.fc = nn.Linear(3 * s.target_hidden, h, bias=False)
        self.midlayer = nn.Module()
        layer = self.midlayer
        layer.input_layernorm, layer.hidden_norm = RMSNorm(h, s.rms_eps), RMSNorm(h, s.rms_eps)
        layer.post_attention_layernorm = RMSNorm(h, s.rms_eps)
        layer.self_attn = nn.Module()
        attn = layer.self_attn
        attn.q_proj = nn.Linear(2 * h, s.heads * s.head_dim, bias=False)
        attn.k_proj = nn.Linear(2 * h, s.kv_heads * s.head_dim, bias=False)
        attn.v_proj = nn.Linear(2 * h, s.kv_heads * s.head_dim, bias=False)
        attn.o_proj = nn.Linear(s.heads * s.head_dim, h, bias=False)
        layer.mlp = nn.Module()
        layer.mlp.gate_proj = nn.Linear(h, s.intermediate, bias=False)
        layer.mlp.up_proj = nn.Linear(h, s.intermediate, bias=False)
        layer.mlp.down_proj = nn.Linear(s.intermediate, h, bias=False)
        self.norm = RMSNorm(h, s.rms_eps)
        self.lm_head = nn.Linear(h, s.draft_vocab, bias=False)
        self.register_buffer("draft_to_target", draft_to_target.long(), persistent=False)
        inv_freq = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, dtype=torch.float32) / s.head_dim))
        angles = torch.outer(torch.arange(s.max_positions, dtype=torch.float32), inv_freq)
        angles = torch.cat([angles, angles], dim=-1)
        self.register_buffer("cos", angles.cos(), persistent=False)
        self.register_buffer("sin", angles.sin(), persistent=False)

    def _qkv(self, embeds: torch.Tensor, hidden: torch.Tensor, first: int):
        """q [B, heads, T, d], k and v [B, heads, T, d] (kv heads repeated) of rows at positions first.., and the
        residual (the hidden state)."""
        layer, s = self.midlayer, self.shape
        x = torch.cat([layer.input_layernorm(embeds), layer.hidden_norm(hidden)], dim=-1)
        b, t, _ = x.shape
        q = layer.self_attn.q_proj(x).view(b, t, s.heads, s.head_dim).transpose(1, 2)
        k = layer.self_attn.k_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        v = layer.self_attn.v_proj(x).view(b, t, s.kv_heads, s.head_dim).transpose(1, 2)
        cos, sin = self.cos[first:first + t], self.sin[first:first + t]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        groups = s.heads // s.kv_heads
        return q, k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)

    def _finish(self, attended: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """The layer after attention: o_proj, the residual (the hidden state), the MLP -> the output states."""
        layer = self.midlayer
        b, _, t, _ = attended.shape
        residual = hidden + layer.self_attn.o_proj(attended.transpose(1, 2).reshape(b, t, -1))
        normed = layer.post_attention_layernorm(residual)
        mlp = layer.mlp
        return mlp.down_proj(F.silu(mlp.gate_proj(normed)) * mlp.up_proj(normed)) + residual

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """States [..., hidden] -> logits over the draft vocabulary [..., draft vocab]."""
        return self.lm_head(self.norm(states))

    def unrolled(self, embeds: torch.Tensor, taps: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """The head's output states of each step, [B, N, hidden] each, for rows i = 0..N-1 of B sequences.

        Step 0 is the head's pass over the target-fed positions: row i is draft position i, fed the embedding of
        token i + 1 (embeds[:, 0]) and fc(taps[:, i]). Step s > 0 is the s-th chained proposal after the same
        row: draft position i + s, fed token i + 1 + s (embeds[:, s]) and the step before's output at row i; its
        query attends to step 0's keys at rows <= i and to its own chain's keys at row i (steps 1..s), as the
        draft's KV cache holds them when it serves (SpecForge's training-time test)."""
        hidden = self.fc(taps)
        q, k0, v0 = self._qkv(embeds[:, 0], hidden, 0)
        n = taps.shape[1]
        causal = torch.ones(n, n, dtype=torch.bool, device=taps.device).tril()
        outputs = [self._finish(F.scaled_dot_product_attention(q, k0, v0, attn_mask=causal), hidden)]
        chain_k, chain_v = [], []
        scale = self.shape.head_dim ** -0.5
        for step in range(1, steps):
            hidden = outputs[-1]
            q, k, v = self._qkv(embeds[:, step], hidden, step)
            chain_k.append(k)
            chain_v.append(v)
            scores = torch.matmul(q, k0.transpose(-1, -2)) * scale
            scores = scores.masked_fill(~causal, float("-inf"))
            diagonal = torch.stack([(q * ck).sum(-1) for ck in chain_k], dim=-1) * scale  # [B, H, N, s]
            weights = torch.softmax(torch.cat([scores, diagonal], dim=-1), dim=-1)
            attended = torch.matmul(weights[..., :n], v0) + sum(
                weights[..., n + j:n + j + 1] * cv for j, cv in enumerate(chain_v))
            outputs.append(self._finish(attended, hidden))
        return outputs

    def save(self, folder: Path) -> Path:
        """Write config.json and model.safetensors (vLLM's / SpecForge's layout) into `folder`."""
        from safetensors.torch import save_file

        s = self.shape
        folder.mkdir(parents=True, exist_ok=True)
        config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
                  "hidden_size": s.hidden, "intermediate_size": s.intermediate, "num_attention_heads": s.heads,
                  "num_key_value_heads": s.kv_heads, "head_dim": s.head_dim, "vocab_size": s.vocab,
                  "draft_vocab_size": s.draft_vocab, "target_hidden_size": s.target_hidden,
                  "eagle_aux_hidden_state_layer_ids": list(s.layers), "rope_theta": s.rope_theta,
                  "rms_norm_eps": s.rms_eps, "max_position_embeddings": s.max_positions, "hidden_act": "silu",
                  "tie_word_embeddings": False, "attention_bias": False, "torch_dtype": "float32",
                  "eagle_config": {"use_aux_hidden_state": True,
                                   "eagle_aux_hidden_state_layer_ids": list(s.layers)}}
        tensors = {name: p.detach().float().contiguous() for name, p in self.named_parameters()}
        d2t = self.draft_to_target.cpu()
        tensors["d2t"] = d2t - torch.arange(s.draft_vocab)
        t2d = torch.zeros(s.vocab, dtype=torch.bool)
        t2d[d2t] = True
        tensors["t2d"] = t2d
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
        return folder
