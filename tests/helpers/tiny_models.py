"""Tiny random-weight HF checkpoints (Llama, Qwen2, Qwen3, Mistral, Gemma 3, Gemma 2, SmolLM3, OLMo 2/3, Phi-3,
DeepSeek-V2, Mixtral, Qwen3-MoE, OLMoE, Qwen2-MoE, DeepSeek-V3, GLM-4.5, GPT-OSS, Llama 4 text, Mamba2, Granite 4.0-H,
Nemotron-H, Falcon-H1, Qwen3-Next, LLaVA) with the SmolLM2 tokenizer."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import torch

from tokenmill.models.loader.resolve import resolve_model_path
from tokenmill.models.loader.tokenizer import load_gguf_tokenizer

SMOLLM2_VOCAB_SIZE = 49152
LLAMA3_ROPE_SCALING = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}

_BASE_CONFIG: dict[str, Any] = {
    "vocab_size": SMOLLM2_VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 1024,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 2,
}
_ARCH_CONFIG: dict[str, dict[str, Any]] = {
    "llama": {},
    "mistral": {"sliding_window": 512},
    "qwen2": {},
    "qwen3": {"head_dim": 32},  # != hidden / heads, as in real Qwen3 models
    # mixtures of experts: 8 experts of width 32, 2 per token. Mixtral renormalises the top 2; Qwen3-MoE
    # here too (norm_topk_prob), with a dense middle layer (mlp_only_layers); OLMoE does not renormalise
    # and norms q and k over the whole projections. initializer_range 0.1: routing far from uniform and
    # experts whose outputs matter (a wrong normalisation moves the logits by ~1, not ~0.05)
    "mixtral": {"num_local_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "initializer_range": 0.1},
    "qwen3_moe": {"num_hidden_layers": 3, "head_dim": 32, "num_experts": 8, "num_experts_per_tok": 2,
                  "moe_intermediate_size": 32, "norm_topk_prob": True, "mlp_only_layers": [1],
                  "initializer_range": 0.1},
    "olmoe": {"num_experts": 8, "num_experts_per_tok": 2, "intermediate_size": 32, "initializer_range": 0.1},
    # Qwen2-MoE: layer 0 dense (mlp_only_layers), layer 1 sparse with its sigmoid-gated shared expert (width 48)
    "qwen2_moe": {"num_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                  "shared_expert_intermediate_size": 48, "mlp_only_layers": [0], "initializer_range": 0.1},
    # 5 sliding layers then a global one, a window shorter than the test prompts; head_dim and the
    # attention scalar differ from hidden / heads as in the real models
    "gemma3_text": {"num_hidden_layers": 6, "head_dim": 32, "query_pre_attn_scalar": 24, "sliding_window": 16,
                    "rope_theta": 1_000_000.0, "rope_local_base_freq": 10_000.0, "final_logit_softcapping": 30.0},
    # Gemma 2: sliding layers alternating with full ones, a window shorter than the test prompts; head_dim 64
    # (the AVX-512 attention tiles take it) and an attention scalar other than head_dim; score caps low enough
    # to bite (random scores of ~10 against a cap of 5) and a final logit cap
    "gemma2": {"num_hidden_layers": 4, "head_dim": 64, "query_pre_attn_scalar": 48, "sliding_window": 16,
               "attn_logit_softcapping": 5.0, "final_logit_softcapping": 10.0, "initializer_range": 0.2},
    # SmolLM3: layer 1 of 2 without RoPE (every 2nd layer: no_rope_layer_interval), untied embeddings to differ
    "smollm3": {"no_rope_layer_interval": 2, "tie_word_embeddings": False},
    # OLMo 2: norms after attention and MLP only, q/k norms over the whole projections (4 x 16 and 2 x 16)
    "olmo2": {},
    # OLMo 3: also 3 sliding layers (window 16, shorter than the test prompts) to 1 full, YaRN on the full
    # layer's RoPE only
    "olmo3": {"num_hidden_layers": 4, "sliding_window": 16,
              "rope_parameters": {"full_attention": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 10000.0,
                                                     "original_max_position_embeddings": 32},
                                  "sliding_attention": {"rope_type": "default", "rope_theta": 5000.0}}},
    # Phi-3: fused qkv_proj and gate_up_proj tensors, LongRoPE whose max_position_embeddings is its original
    # context: the short factors, unstretched (factor 1)
    "phi3": {"original_max_position_embeddings": 1024,
             "rope_scaling": {"type": "longrope", "short_factor": [1.0 + i / 4 for i in range(8)],
                              "long_factor": [4.0 + i for i in range(8)]}},
    # multi-head latent attention: a latent (kv_lora_rank 32) narrower than the heads' keys and values
    # (4 x (16 + 8) and 4 x 16), RoPE on 8 dims, queries straight from q_proj (q_lora_rank=24 for the
    # low-rank path); every layer dense (first_k_dense_replace = layers: override it for MoE layers);
    # initializer_range 0.2 so attention is far from uniform
    "deepseek_v2": {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": None, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 2, "n_routed_experts": 4,
                    "num_experts_per_tok": 2, "moe_intermediate_size": 32, "n_shared_experts": 1,
                    "initializer_range": 0.2},
    # DeepSeek-V3: DeepSeek-V2's attention sizes with q_lora_rank 24; layer 0 dense, layer 1 sparse: 8 experts in
    # 4 groups, the best 2 groups kept, top 2 renormalised and scaled by 2.5 (the defaults), one shared
    # expert; its correction bias drawn by `make_tiny_hf_model`; one MTP layer (the default
    # num_nextn_predict_layers) whose tensors `make_tiny_hf_model` adds
    "deepseek_v3": {"num_key_value_heads": 4, "kv_lora_rank": 32, "q_lora_rank": 24, "qk_nope_head_dim": 16,
                    "qk_rope_head_dim": 8, "v_head_dim": 16, "first_k_dense_replace": 1, "n_routed_experts": 8,
                    "n_group": 4, "topk_group": 2, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                    "n_shared_experts": 1, "initializer_range": 0.1},
    # GLM-4.5: heads of 32 (4 x 32 != hidden 64, as in the real models) turning 16 dims (partial_rotary_factor
    # 0.5, the default), q/k norm, q/k/v bias; layer 0 dense, layer 1 sparse: 8 experts in one group (as
    # GLM-4.5), top 2 renormalised and scaled by 2.5, one shared expert; its correction bias and an MTP layer
    # added by `make_tiny_hf_model`
    # GPT-OSS: a sliding layer (window 16, shorter than the test prompts) then a full one, head_dim 64 (the AVX-512
    # attention tiles take it), 8 biased experts of width 32, 2 per token; YaRN with a fractional ramp
    # (truncate False) inside the head's frequencies; a SwiGLU limit low enough to clamp (gates of ~1)
    "gpt_oss": {"head_dim": 64, "sliding_window": 16, "max_position_embeddings": 256, "num_local_experts": 8,
                "num_experts_per_tok": 2,
                "intermediate_size": 32, "swiglu_limit": 0.6, "initializer_range": 0.1,
                "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                    "truncate": False, "original_max_position_embeddings": 64,
                                    "rope_theta": 150_000.0}},
    # Mamba2: 8 heads of 16 (expand 2 x hidden 64), 2 groups of B/C of state 16; chunks of 8 so a prompt's
    # prefill scan crosses chunk boundaries
    "mamba2": {"num_heads": 8, "head_dim": 16, "state_size": 16, "n_groups": 2, "expand": 2, "conv_kernel": 4,
               "chunk_size": 8, "initializer_range": 0.1},
    # Granite 4.0-H: Mamba2 layers around an attention layer (one attention group beside two state groups), 4
    # experts of width 32 plus a shared expert of 48; the mixers as tiny Mamba2's (8 heads of 16, 2 groups of state
    # 16, scan chunks of 8); every multiplier away from 1 (and the attention scale from head_dim ** -0.5) so a
    # dropped one changes the logits
    "granitemoehybrid": {"num_hidden_layers": 3, "layer_types": ["mamba", "attention", "mamba"],
                         "intermediate_size": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
                         "shared_intermediate_size": 48, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
                         "mamba_d_state": 16, "mamba_chunk_size": 8, "position_embedding_type": "rope",
                         "embedding_multiplier": 12.0, "residual_multiplier": 0.22, "attention_multiplier": 0.2,
                         "logits_scaling": 6.0, "initializer_range": 0.1},
    # Llama 4's text model: layer 0 RoPE with chunked local attention (chunks of 8, shorter than the test prompts
    # and generations) and a dense MLP (width intermediate_size_mlp), layer 1 NoPE with full attention, the query
    # temperature (floor_scale 4: it changes every 4 positions) and 4 experts (top 1, sigmoid-scaled inputs) plus
    # a shared one; head_dim 64 (the AVX-512 attention tiles take it)
    "llama4_text": {"head_dim": 64, "no_rope_layers": [1, 0], "attention_chunk_size": 8, "floor_scale": 4,
                    "attn_scale": 0.5, "interleave_moe_layer_step": 2, "num_local_experts": 4, "num_experts_per_tok": 1,
                    "intermediate_size": 32, "intermediate_size_mlp": 128, "initializer_range": 0.1},
    # Qwen3-Next: Gated DeltaNet layers around a gated attention layer (one attention group beside two state
    # groups); the DeltaNet's 2 key heads of 16 serve 4 value heads of 16 (each key head two); attention heads of 32
    # with partial RoPE (a quarter: 8 dims); 4 experts of width 32 (top 2) plus the gated shared expert of 48 on
    # layers 0 and 1, layer 2 dense (mlp_only_layers). Its zero-centred norms get random weights (make_tiny_hf_model)
    "qwen3_next": {"num_hidden_layers": 3, "layer_types": ["linear_attention", "full_attention", "linear_attention"],
                   "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                   "linear_value_head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "shared_expert_intermediate_size": 48, "mlp_only_layers": [2], "initializer_range": 0.1},
    # Nemotron-H: blocks M - * E M (layers "M-", "*E", "M": two state groups beside a NoPE attention group, a layer
    # with no MLP block), the mixers as tiny Mamba2's (8 heads of 16, 2 groups of state 16, scan chunks of 8); the
    # experts block 8 relu² experts of width 32 in 2 groups (the best 1 kept), 2 per token, scaled by 2.5, plus a
    # shared one of 48
    "nemotron_h": {"layers_block_type": ["linear_attention", "mlp", "full_attention", "moe", "linear_attention"],
                   "head_dim": 16, "mamba_num_heads": 8, "mamba_head_dim": 16, "n_groups": 2, "ssm_state_size": 16,
                   "chunk_size": 8, "n_routed_experts": 8, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
                   "moe_shared_expert_intermediate_size": 48, "n_group": 2, "topk_group": 1,
                   "routed_scaling_factor": 2.5, "initializer_range": 0.1},
    # Falcon-H1: 1 layer (2 decoder layers: two pipeline stages split it between its halves; the Triton
    # interpreter's attention costs per layer), a Mamba2 mixer (8 heads of 16, 2 groups of state 16, scan chunks of
    # 8, the grouped RMSNorm before the gate) beside attention; every multiplier away from 1 and each of the five
    # in_proj parts its own, so a dropped or misplaced one changes the logits
    "falcon_h1": {"num_hidden_layers": 1, "mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16, "mamba_n_groups": 2,
                  "mamba_d_state": 16, "mamba_chunk_size": 8, "mamba_rms_norm": True, "mamba_norm_before_gate": True,
                  "embedding_multiplier": 3.0, "lm_head_multiplier": 0.6, "key_multiplier": 0.7,
                  "attention_in_multiplier": 1.3, "attention_out_multiplier": 0.8, "ssm_in_multiplier": 1.2,
                  "ssm_out_multiplier": 0.9, "ssm_multipliers": [0.9, 1.1, 0.8, 1.25, 1.5],
                  "mlp_multipliers": [1.3, 0.7], "initializer_range": 0.1},
    "glm4_moe": {"head_dim": 32, "use_qk_norm": True, "attention_bias": True, "first_k_dense_replace": 1,
                 "n_routed_experts": 8, "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2,
                 "moe_intermediate_size": 32, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
                 "initializer_range": 0.1},
}


@functools.lru_cache(maxsize=1)
def smollm2_tokenizer():
    """The SmolLM2 tokenizer, converted from the packaged GGUF through tokenmill's cache."""
    return load_gguf_tokenizer(resolve_model_path(None))


def make_tiny_hf_model(
    dir: str | Path,
    arch: str = "llama",
    sharded: bool = False,
    dtype: torch.dtype = torch.float32,
    **config_overrides: Any,
) -> Path:
    """Save a tiny random model of `arch` (llama, mistral, qwen2, qwen3, gemma3_text, gemma2, smollm3, olmo2,
    olmo3, phi3, deepseek_v2, mixtral, qwen3_moe, olmoe, qwen2_moe, deepseek_v3, glm4_moe, gpt_oss, llama4_text,
    mamba2, granitemoehybrid, nemotron_h, falcon_h1, qwen3_next) and its tokenizer
    in `dir`.

    `config_overrides` go to the transformers config class (e.g. `tie_word_embeddings=True`,
    `rope_parameters=LLAMA3_ROPE_SCALING`); `sharded=True` writes several safetensors files and
    `model.safetensors.index.json`; `dtype` is the stored dtype. Weights are seeded, so repeated
    calls agree. Routers with an `e_score_correction_bias` (sigmoid routing) get a random one (transformers
    initialises it to zero, which would hide a router that ignores it); models with multi-token prediction
    layers (num_nextn_predict_layers) get one's tensors as the real checkpoints store them (unsharded only).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    path = Path(dir)
    config = AutoConfig.for_model(arch, **{**_BASE_CONFIG, **_ARCH_CONFIG[arch], **config_overrides})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # about the spread of the sigmoid scores
                buffer.copy_(torch.randn(buffer.shape) * 0.1)
        for name, param in model.named_parameters():
            # GPT-OSS: its sinks about as large as the scores (HF's init, std 0.1, would barely move the softmax)
            # and random biases where HF initialises them to zero (a dropped bias would go unnoticed)
            if name.endswith(".sinks"):
                param.copy_(torch.randn(param.shape))
            elif arch == "gpt_oss" and "bias" in name and not param.any():
                param.copy_(torch.randn(param.shape) * 0.1)
            # Qwen3-Next: its norms scale by 1 + weight, which transformers initialises to 0 (a dropped weight, or a
            # dropped 1, would go unnoticed or be all that shows); the gated norm's weight (plain) away from 1 too
            elif arch == "qwen3_next" and name.endswith("norm.weight"):
                param.copy_(param + torch.randn(param.shape) * 0.2)
    model.save_pretrained(path, max_shard_size="1MB" if sharded else "10GB")
    if getattr(config, "num_nextn_predict_layers", 0) and not sharded:
        _add_mtp_layer(path / "model.safetensors", config.num_hidden_layers)
    smollm2_tokenizer().save_pretrained(path)
    return path


def _add_mtp_layer(file: Path, num_layers: int) -> None:
    """Add a multi-token prediction layer's tensors to `file` as DeepSeek-V3 / GLM-4.5 store them: layer
    `num_layers` (one past the decoder's), a copy of the last layer plus its projection and norms."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(file)
    last, mtp = f"model.layers.{num_layers - 1}.", f"model.layers.{num_layers}."
    extra = {mtp + name[len(last):]: t.clone() for name, t in tensors.items() if name.startswith(last)}
    hidden = tensors["model.norm.weight"].shape[0]
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        extra[mtp + name] = torch.ones(hidden)
    extra[mtp + "eh_proj.weight"] = torch.randn(hidden, 2 * hidden) * 0.02
    save_file({**tensors, **extra}, file, metadata={"format": "pt"})


QWEN3_TEMPLATE = Path(__file__).parent.parent / "data" / "qwen3_chat_template.jinja"  # Qwen3's own, verbatim


def make_tiny_reasoning_model(dir: str | Path) -> Path:
    """A tiny random Qwen3 that reasons as Qwen3 does, in its words: Qwen3's chat template (tools,
    <tool_call>, enable_thinking) and the SmolLM2 tokenizer with `<think>` and `</think>` added as tokens
    (ids 49152 and 49153, not special: they stay in the text, as in Qwen3's tokenizer)."""
    path = make_tiny_hf_model(dir, "qwen3", vocab_size=SMOLLM2_VOCAB_SIZE + 8)
    tokenizer = smollm2_tokenizer().__class__.from_pretrained(path)
    tokenizer.add_tokens(["<think>", "</think>"])
    tokenizer.chat_template = QWEN3_TEMPLATE.read_text()
    tokenizer.save_pretrained(path)
    return path


# llava-hf's template (llava-1.5-7b-hf), without its {% generation %} tags, and taking string contents too:
# "USER: <image>\nWhat is this? ASSISTANT:"
LLAVA_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] != 'system' %}{{ message['role'].upper() + ': ' }}{% endif %}"
    "{% if message['content'] is string %}{{ message['content'] + ' ' }}"
    "{% else %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'image') %}{{ '<image>\n' }}{% endfor %}"
    "{% for content in message['content'] | selectattr('type', 'equalto', 'text') %}{{ content['text'] + ' ' }}"
    "{% endfor %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ 'ASSISTANT:' }}{% endif %}"
)


REAL_PROCESSORS = Path(__file__).resolve().parents[1] / "data" / "processors"


def real_image_processor(name: str, klass: Any) -> Any:
    """The image processor of a real model's preprocessor_config.json (tests/data/processors/NAME.json, as
    the model's Hub repository has it), as `klass` (the Pil variant: torchvision is not installed)."""
    settings = json.loads((REAL_PROCESSORS / f"{name}.json").read_text())
    for key in ("image_processor_type", "processor_class"):
        settings.pop(key)
    return klass(**settings)


def make_tiny_llava(dir: str | Path, tower: str = "clip", real_processor: bool = False) -> Path:
    """Save a tiny random LLaVA (LlavaForConditionalGeneration) and its LlavaProcessor in `dir`, as
    transformers' `save_pretrained` writes them: a Llama text model (the sizes of `make_tiny_hf_model`),
    a 2-layer vision tower of 32x32 images in 8x8 patches and a 2-layer GELU projector. `tower` "clip":
    CLIP (quick_gelu), features of the second-to-last layer without CLS ("default"), CLIP's image processor
    (shortest edge 32, centre crop 32x32); "siglip": SigLIP, the last layer's features, all of them ("full"),
    SigLIP's processor (resized to 32x32). 16 image tokens per image either way. `real_processor` (CLIP only):
    llava-1.5-7b-hf's own processor config (336x336, 14-pixel patches: 576 image tokens) and a tower of that
    size. The SmolLM2 tokenizer with `<image>` added as a special token (the model's image_token_id) and
    llava-hf's chat template. Seeded."""
    import copy

    from transformers import (CLIPImageProcessorPil, CLIPVisionConfig, LlamaConfig, LlavaConfig,
                              LlavaForConditionalGeneration, LlavaProcessor, SiglipImageProcessorPil,
                              SiglipVisionConfig)

    path = Path(dir)
    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.add_tokens(["<image>"], special_tokens=True)
    tokenizer.chat_template = LLAVA_CHAT_TEMPLATE  # the processor's too: both write chat_template.jinja
    image_token_id = tokenizer.convert_tokens_to_ids("<image>")
    tower_config = {"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
                    "image_size": 336 if real_processor else 32, "patch_size": 14 if real_processor else 8}
    if tower == "clip":
        vision_config = CLIPVisionConfig(**tower_config, hidden_act="quick_gelu")
        image_processor = (real_image_processor("llava-1.5-7b-hf", CLIPImageProcessorPil) if real_processor else
                           CLIPImageProcessorPil(size={"shortest_edge": 32}, crop_size={"height": 32, "width": 32}))
        feature_layer, strategy, additional_tokens = -2, "default", 1
    elif tower == "siglip":
        vision_config = SiglipVisionConfig(**tower_config)
        image_processor = SiglipImageProcessorPil(size={"height": 32, "width": 32})
        feature_layer, strategy, additional_tokens = -1, "full", 0
    else:
        raise ValueError(f"unknown vision tower {tower!r}")
    text_config = LlamaConfig(**{**_BASE_CONFIG, "vocab_size": len(tokenizer), "max_position_embeddings": 2048,
                                 "rms_norm_eps": 1e-5, "tie_word_embeddings": False})
    config = LlavaConfig(vision_config=vision_config, text_config=text_config, image_token_index=image_token_id,
                         image_seq_length=576 if real_processor else 16, projector_hidden_act="gelu", vision_feature_layer=feature_layer,
                         vision_feature_select_strategy=strategy, multimodal_projector_bias=True,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    model = LlavaForConditionalGeneration(config).to(torch.float32)
    model.save_pretrained(path)
    processor = LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                               patch_size=tower_config["patch_size"],
                               vision_feature_select_strategy=strategy, chat_template=LLAVA_CHAT_TEMPLATE,
                               image_token="<image>", num_additional_image_tokens=additional_tokens)
    processor.save_pretrained(path)
    return path


# Qwen2-VL's chat template, its image parts only (no video, no tools): each image part is
# <|vision_start|><|image_pad|><|vision_end|> where the part is
QWEN2_VL_CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
QWEN2_VL_TOKENS = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>"]


def make_tiny_qwen2_vl(dir: str | Path, real_processor: bool = False, version: str = "2") -> Path:
    """Save a tiny random Qwen2-VL (Qwen2VLForConditionalGeneration) in `dir`, as transformers' `save_pretrained`
    writes it: a Qwen2 decoder 64 wide with multimodal RoPE (mrope_section [2, 3, 3] of its 8 frequencies per
    head), a 2-block vision tower 32 wide over 14-pixel patches merged 2x2, and Qwen2-VL's image processor
    (the Pil one: torchvision is not installed) bounded to 784-12544 pixels, so an image becomes 1 to 16
    positions by its size; `real_processor`: Qwen2-VL-2B-Instruct's own processor config (up to 12.8M pixels).
    `version` "2.5": Qwen2.5-VL (Qwen2_5_VLForConditionalGeneration): its tower's RMSNorm and SwiGLU, attention
    within windows of 56 pixels (2x2 merge units) in block 0 and over the whole image in block 1.
    The SmolLM2 tokenizer with Qwen2-VL's vision tokens added as special tokens, and Qwen2-VL's chat template
    for image parts. Seeded."""
    import copy

    from transformers import (Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration, Qwen2VLConfig,
                              Qwen2VLForConditionalGeneration, Qwen2VLImageProcessorPil)

    path = Path(dir)
    tokenizer = copy.deepcopy(smollm2_tokenizer())
    tokenizer.add_tokens(QWEN2_VL_TOKENS, special_tokens=True)
    tokenizer.chat_template = QWEN2_VL_CHAT_TEMPLATE
    ids = dict(zip(QWEN2_VL_TOKENS, tokenizer.convert_tokens_to_ids(QWEN2_VL_TOKENS)))
    text = {**_BASE_CONFIG, "vocab_size": len(tokenizer), "max_position_embeddings": 2048, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_parameters": {"rope_type": "default", "rope_theta": 1000000.0, "mrope_section": [2, 3, 3]}}
    vision = {"depth": 2, "embed_dim": 32, "hidden_size": text["hidden_size"], "num_heads": 2, "mlp_ratio": 2,
              "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
    config_class, model_class = Qwen2VLConfig, Qwen2VLForConditionalGeneration
    if version == "2.5":
        vision = {"depth": 2, "hidden_size": 32, "intermediate_size": 48, "out_hidden_size": text["hidden_size"],
                  "num_heads": 2, "window_size": 56, "fullatt_block_indexes": [1], "patch_size": 14,
                  "spatial_merge_size": 2, "temporal_patch_size": 2, "in_channels": 3}
        config_class, model_class = Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
    config = config_class(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                           video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                           vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(0)
    model_class(config).to(torch.float32).save_pretrained(path)
    tokenizer.save_pretrained(path)
    processor = (real_image_processor("qwen2-vl-2b-instruct", Qwen2VLImageProcessorPil) if real_processor else
                 Qwen2VLImageProcessorPil(min_pixels=784, max_pixels=12544))
    processor.save_pretrained(path)
    return path


def make_tiny_embedding_model(dir: str | Path, arch: str = "bert", pooling: str = "mean", normalize: bool = True,
                              **config_overrides: Any) -> Path:
    """Save a tiny random sentence-transformers model in `dir`, written by sentence-transformers itself:
    a BERT encoder (all-MiniLM-L6-v2's tokenizer) or a decoder of `arch` (the SmolLM2 tokenizer), then
    Pooling (`pooling`: mean, cls or lasttoken) and, with `normalize`, Normalize. Seeded."""
    from sentence_transformers import SentenceTransformer
    try:
        from sentence_transformers.sentence_transformer import modules as models
    except ImportError:  # sentence-transformers < 6
        from sentence_transformers import models
    from transformers import AutoConfig, AutoModel

    path = Path(dir)
    network = path / "network"
    if arch == "bert":
        config = AutoConfig.for_model("bert", vocab_size=30522, hidden_size=64, intermediate_size=128,
                                      num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=128,
                                      **config_overrides)
        tokenizer_source = resolve_model_path("all-minilm-l6-v2")
    else:
        config = AutoConfig.for_model(arch, **{**_BASE_CONFIG, **_ARCH_CONFIG[arch], **config_overrides})
        tokenizer_source = None
    torch.manual_seed(0)
    AutoModel.from_config(config, dtype=torch.float32).save_pretrained(network)
    if tokenizer_source is None:  # without its chat template: sentence-transformers 6 would wrap texts in it
        import copy
        tokenizer = copy.deepcopy(smollm2_tokenizer())
        tokenizer.chat_template = None
        tokenizer.save_pretrained(network)
    else:
        from transformers import AutoTokenizer
        AutoTokenizer.from_pretrained(tokenizer_source).save_pretrained(network)
    transformer = models.Transformer(str(network))
    modules = [transformer, models.Pooling(config.hidden_size, pooling_mode=pooling)]
    if normalize:
        modules.append(models.Normalize())
    SentenceTransformer(modules=modules, device="cpu").save(str(path))
    return path


def make_random_lora(base: str | Path, dir: str | Path, rank: int, targets: list[str], seed: int,
                     std: float = 0.3) -> Path:
    """Save a PEFT LoRA adapter of `base` (a tiny HF model folder) in `dir`: rank `rank` on `targets`,
    lora_alpha 2 x rank, A and B drawn from N(0, std) (seeded), strong enough to change greedy output."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    adapted = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets,
                                               lora_dropout=0.0, init_lora_weights=False))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * std)
    adapted.save_pretrained(str(dir))
    return Path(dir)
