"""Tiny checkpoints whose hidden-state drafts agree with their targets often but not always: targets whose layers
add little to the residual stream (their o_proj and down_proj scaled down), so the next token is mostly a bigram
function of the current one (argmax of lm_head(norm(embedding))), and an EAGLE-3 head / a DeepSeek-V3 or GLM-4.5
MTP layer wired by hand to compute that same bigram from the token it reads, plus terms that read the hidden states and the
draft's KV cache (so a wrong hidden row or a stale draft KV entry changes the draft's states).

Written without transformers (config.json and safetensors by hand): building a transformers model costs ~2 s of
imports, more than the engines these checkpoints feed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from helpers.tiny_models import SMOLLM2_VOCAB_SIZE, smollm2_tokenizer

HIDDEN = 64
DRAFT_VOCAB_SIZE = SMOLLM2_VOCAB_SIZE * 7 // 8
# what each target layer's o_proj and down_proj are multiplied by (initialised at std 0.02): tuned so that about 5
# tokens in 6 are the bigram's, and all accepted lengths 0..3 occur in a few dozen verification rounds (MLA's
# attention adds less to the residual stream than Llama's at the same scale)
LLAMA_LAYER_SCALE = 0.85
DEEPSEEK_LAYER_SCALE = 2.0
GLM4_MOE_LAYER_SCALE = 1.0
_COMMON = {"vocab_size": SMOLLM2_VOCAB_SIZE, "hidden_size": HIDDEN, "max_position_embeddings": 1024,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": False,
           "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "float32"}


class _Weights:
    """Seeded random tensors at a standard deviation."""

    def __init__(self, seed: int) -> None:
        self.generator = torch.Generator().manual_seed(seed)

    def __call__(self, *shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator) * std


def _save(folder: Path, config: dict[str, Any], tensors: dict[str, torch.Tensor], tokenizer: bool = True) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    save_file({name: t.contiguous() for name, t in tensors.items()}, str(folder / "model.safetensors"),
              metadata={"format": "pt"})
    if tokenizer:
        smollm2_tokenizer().save_pretrained(folder)
    return folder


def _mlp(w: _Weights, prefix: str, width: int, scale: float) -> dict[str, torch.Tensor]:
    return {f"{prefix}.gate_proj.weight": w(width, HIDDEN), f"{prefix}.up_proj.weight": w(width, HIDDEN),
            f"{prefix}.down_proj.weight": w(HIDDEN, width) * scale}


def _bigram_embeddings(w: _Weights) -> dict[str, torch.Tensor]:
    """A random embedding table and a head whose rows are its rows shuffled: lm_head(norm(embedding of t)) peaks at
    the one token whose row is t's embedding (a cosine of 1 against ~0.5 at best for the others), a margin the
    layers' small additions seldom overturn."""
    embeddings = w(SMOLLM2_VOCAB_SIZE, HIDDEN)
    return {"model.embed_tokens.weight": embeddings,
            "lm_head.weight": embeddings[torch.randperm(SMOLLM2_VOCAB_SIZE, generator=w.generator)]}


def write_bigram_llama(folder: Path) -> Path:
    """A 4-layer Llama (an EAGLE-3 head reads three distinct layers: 1, 2, 3) whose layers add little."""
    w, heads, kv_heads, head_dim, width = _Weights(1), 4, 2, 16, 128
    config = {**_COMMON, "architectures": ["LlamaForCausalLM"], "model_type": "llama", "intermediate_size": width,
              "num_hidden_layers": 4, "num_attention_heads": heads, "num_key_value_heads": kv_heads}
    tensors = {**_bigram_embeddings(w), "model.norm.weight": torch.ones(HIDDEN)}
    for layer in range(4):
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": torch.ones(HIDDEN),
                        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                        p + "self_attn.q_proj.weight": w(heads * head_dim, HIDDEN),
                        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.o_proj.weight": w(HIDDEN, heads * head_dim) * LLAMA_LAYER_SCALE,
                        **_mlp(w, p + "mlp", width, LLAMA_LAYER_SCALE)})
    return _save(folder, config, tensors)


def write_agreeing_eagle3_head(folder: Path, target: Path) -> Path:
    """An EAGLE-3 head for `write_bigram_llama`'s target that mostly proposes the target's bigram.

    Its layer has two attention heads of width 64 over x = concat(norm(embedding), hidden_norm(hidden)) (128 wide).
    Head 0's queries and keys read the embedding half only, q = 4 k: a position's score with itself, 4 |x|^2 / 8 =
    32, beats any other's by ~20 (|x| = 8 after the norm; RoPE rotates but keeps lengths), so it returns its own
    value, norm(embedding) - hidden_norm(hidden), which o_proj copies out. The residual adds the hidden state back:
    the output is norm(embedding) + hidden - hidden_norm(hidden), and hidden - hidden_norm(hidden) is small for
    hidden states of RMS near 1, as both the chained states and fc's (std 3 over taps of RMS ~0.02) are. With
    lm_head the target's rows, that gives the target's bigram of the token read, at target-fed and chained
    positions alike. Head 1 attends over the whole prefix with random weights (the draft's KV cache matters), and
    the hidden states' deviation from RMS 1 goes into every state (the rows matter). The draft vocabulary is 7/8
    of the target's, in a shuffled order (d2t): the target's bigram lies outside it for 1 token in 8, whose
    proposals are then wrong."""
    from safetensors.torch import load_file

    w, width = _Weights(2), 128
    config = {**_COMMON, "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
              "intermediate_size": width, "num_hidden_layers": 1, "num_attention_heads": 2,
              "num_key_value_heads": 2, "head_dim": HIDDEN, "draft_vocab_size": DRAFT_VOCAB_SIZE,
              "target_hidden_size": HIDDEN, "eagle_aux_hidden_state_layer_ids": [1, 2, 3]}
    eye, zero = torch.eye(HIDDEN), torch.zeros(HIDDEN, HIDDEN)
    embedding_half = torch.cat([eye, zero], dim=1)  # [64, 128]: reads the normed embedding only
    lm_head = load_file(str(target / "model.safetensors"))["lm_head.weight"]
    order = torch.randperm(SMOLLM2_VOCAB_SIZE, generator=w.generator)[:DRAFT_VOCAB_SIZE]  # draft id -> target id
    p = "midlayer."
    tensors = {p + "input_layernorm.weight": torch.ones(HIDDEN), p + "hidden_norm.weight": torch.ones(HIDDEN),
               p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
               p + "self_attn.q_proj.weight": torch.cat([4 * embedding_half, w(HIDDEN, 2 * HIDDEN, std=0.05)]),
               p + "self_attn.k_proj.weight": torch.cat([embedding_half, w(HIDDEN, 2 * HIDDEN, std=0.05)]),
               p + "self_attn.v_proj.weight": torch.cat([torch.cat([eye, -eye], dim=1),
                                                         w(HIDDEN, 2 * HIDDEN, std=0.1)]),
               p + "self_attn.o_proj.weight": torch.cat([eye, w(HIDDEN, HIDDEN, std=0.02)], dim=1),
               **_mlp(w, p + "mlp", width, 1.0),
               "fc.weight": w(HIDDEN, 3 * HIDDEN, std=3.0), "norm.weight": torch.ones(HIDDEN),
               "lm_head.weight": lm_head[order], "d2t": order - torch.arange(DRAFT_VOCAB_SIZE),
               "t2d": torch.zeros(SMOLLM2_VOCAB_SIZE, dtype=torch.bool).index_fill(0, order, True)}
    return _save(folder, config, tensors, tokenizer=False)


def write_bigram_deepseek_v3(folder: Path) -> Path:
    """A 2-layer DeepSeek-V3 (MLA; layer 0 dense, layer 1 routed experts) whose layers add little, with an MTP layer
    (model.layers.2.*) that mostly proposes its bigram: eh_proj passes enorm(embedding) through and adds a small
    random map of hnorm(hidden); its own decoder layer (MLA over the draft's KV cache, experts) adds little."""
    w = _Weights(3)
    heads, latent, q_rank, nope, rope, v_dim, experts, expert_width = 4, 32, 24, 16, 8, 16, 8, 32
    config = {**_COMMON, "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": heads,
              "num_key_value_heads": heads, "kv_lora_rank": latent, "q_lora_rank": q_rank, "qk_nope_head_dim": nope,
              "qk_rope_head_dim": rope, "v_head_dim": v_dim, "first_k_dense_replace": 1, "n_routed_experts": experts,
              "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "moe_intermediate_size": expert_width,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
              "num_nextn_predict_layers": 1, "rope_interleave": True}
    tensors = {**_bigram_embeddings(w), "model.norm.weight": torch.ones(HIDDEN)}
    for layer in range(3):  # layer 2: the MTP layer's decoder block
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": torch.ones(HIDDEN),
                        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                        p + "self_attn.q_a_proj.weight": w(q_rank, HIDDEN),
                        p + "self_attn.q_a_layernorm.weight": torch.ones(q_rank),
                        p + "self_attn.q_b_proj.weight": w(heads * (nope + rope), q_rank),
                        p + "self_attn.kv_a_proj_with_mqa.weight": w(latent + rope, HIDDEN),
                        p + "self_attn.kv_a_layernorm.weight": torch.ones(latent),
                        p + "self_attn.kv_b_proj.weight": w(heads * (nope + v_dim), latent),
                        p + "self_attn.o_proj.weight": w(HIDDEN, heads * v_dim) * DEEPSEEK_LAYER_SCALE})
        if layer == 0:
            tensors.update(_mlp(w, p + "mlp", 128, DEEPSEEK_LAYER_SCALE))
            continue
        tensors.update(_noaux_tc_experts(w, p, experts, expert_width, DEEPSEEK_LAYER_SCALE))
    tensors.update(_agreeing_mtp_projection(w, "model.layers.2."))
    return _save(folder, config, tensors)


def _noaux_tc_experts(w: _Weights, prefix: str, experts: int, width: int, scale: float) -> dict[str, torch.Tensor]:
    """A sigmoid-routed MoE layer's tensors (DeepSeek-V3 / GLM-4.5): router, correction bias, one shared expert."""
    tensors = {prefix + "mlp.gate.weight": w(experts, HIDDEN, std=0.1),
               prefix + "mlp.gate.e_score_correction_bias": w(experts, std=0.1),
               **_mlp(w, prefix + "mlp.shared_experts", width, scale)}
    for expert in range(experts):
        tensors.update(_mlp(w, f"{prefix}mlp.experts.{expert}", width, scale))
    return tensors


def _agreeing_mtp_projection(w: _Weights, prefix: str) -> dict[str, torch.Tensor]:
    """An MTP layer's tensors outside its decoder block: eh_proj passes enorm(embedding) through and adds a small
    random map of hnorm(hidden); unit norms; shared_head.head absent (the model's lm_head serves)."""
    return {prefix + "enorm.weight": torch.ones(HIDDEN), prefix + "hnorm.weight": torch.ones(HIDDEN),
            prefix + "shared_head.norm.weight": torch.ones(HIDDEN),
            prefix + "eh_proj.weight": torch.cat([torch.eye(HIDDEN), w(HIDDEN, HIDDEN, std=0.03)], dim=1)}


def write_bigram_glm4_moe(folder: Path) -> Path:
    """A 2-layer GLM-4.5 (GQA with q/k/v bias, q/k norm and RoPE on half of each head; layer 0 dense, layer 1 eight
    experts in one group) whose layers add little, with an MTP layer (model.layers.2.*, of layer 1's MoE kind, as
    vLLM's Glm4MoeMTP builds it) that mostly proposes its bigram, wired as `write_bigram_deepseek_v3`'s; its
    shared_head.head a copy of lm_head, as GLM-4.5's checkpoints store one."""
    w = _Weights(8)  # (a seed under which every request of the test proposes, some after a preemption)
    heads, kv_heads, head_dim, experts, expert_width = 4, 2, 32, 8, 32
    config = {**_COMMON, "architectures": ["Glm4MoeForCausalLM"], "model_type": "glm4_moe",
              "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": heads,
              "num_key_value_heads": kv_heads, "head_dim": head_dim, "partial_rotary_factor": 0.5,
              "use_qk_norm": True, "attention_bias": True, "first_k_dense_replace": 1, "n_routed_experts": experts,
              "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2, "moe_intermediate_size": expert_width,
              "n_shared_experts": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
              "num_nextn_predict_layers": 1}
    tensors = {**_bigram_embeddings(w), "model.norm.weight": torch.ones(HIDDEN)}
    for layer in range(3):  # layer 2: the MTP layer's decoder block
        p = f"model.layers.{layer}."
        tensors.update({p + "input_layernorm.weight": torch.ones(HIDDEN),
                        p + "post_attention_layernorm.weight": torch.ones(HIDDEN),
                        p + "self_attn.q_proj.weight": w(heads * head_dim, HIDDEN),
                        p + "self_attn.q_proj.bias": w(heads * head_dim),
                        p + "self_attn.k_proj.weight": w(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.k_proj.bias": w(kv_heads * head_dim),
                        p + "self_attn.v_proj.weight": w(kv_heads * head_dim, HIDDEN),
                        p + "self_attn.v_proj.bias": w(kv_heads * head_dim),
                        p + "self_attn.q_norm.weight": torch.ones(head_dim),
                        p + "self_attn.k_norm.weight": torch.ones(head_dim),
                        p + "self_attn.o_proj.weight": w(HIDDEN, heads * head_dim) * GLM4_MOE_LAYER_SCALE})
        if layer == 0:
            tensors.update(_mlp(w, p + "mlp", 128, GLM4_MOE_LAYER_SCALE))
        else:
            tensors.update(_noaux_tc_experts(w, p, experts, expert_width, GLM4_MOE_LAYER_SCALE))
    tensors.update(_agreeing_mtp_projection(w, "model.layers.2."))
    tensors["model.layers.2.shared_head.head.weight"] = tensors["lm_head.weight"].clone()
    return _save(folder, config, tensors)
