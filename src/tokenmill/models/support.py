"""What each architecture is, as users know it: one `ArchitectureSupport` record per architecture name.

A record holds only what no other code knows (the family's name, an example checkpoint, a small config that
represents it, which model-specific draft it has). What the engine supports for it (weights formats, tensor /
pipeline / expert parallelism, prefix caching, speculation, GPU kernels) is not restated here: support_table.py
asks the code that enforces each of those about the representative config, so README's table cannot drift
from what the engine does. Plain data: no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

# the shape every representative config starts from: small, and divisible by 2 wherever tensor parallelism
# splits (heads, KV heads, widths, vocabulary), so a tensor-parallel refusal there is one of kind, not of size
PROBE_SHAPE: dict[str, Any] = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                               "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 256}


@dataclass(frozen=True)
class ArchitectureSupport:
    """One architecture: its `family` (the models' name), an `example` Hub id, `probe` (config.json settings
    beyond PROBE_SHAPE that make transformers' defaults a valid, representative config of the family), `mtp`
    (its checkpoints carry a multi-token prediction layer that speculative_method 'mtp' drafts with,
    models/mtp.py) and, for a vision-language architecture, `decoder`: the text architecture its decoder runs as
    (None: whichever its text_config names)."""

    family: str
    example: str
    probe: dict[str, Any] = field(default_factory=dict)
    mtp: bool = False
    vision: bool = False
    decoder: Optional[str] = None


ARCHITECTURE_SUPPORT: dict[str, ArchitectureSupport] = {
    "LlamaForCausalLM": ArchitectureSupport("Llama 2/3, SmolLM2", "meta-llama/Llama-3.1-8B-Instruct"),
    "MistralForCausalLM": ArchitectureSupport("Mistral", "mistralai/Mistral-7B-Instruct-v0.3"),
    "Qwen2ForCausalLM": ArchitectureSupport("Qwen2, Qwen2.5", "Qwen/Qwen2.5-7B-Instruct"),
    "Qwen3ForCausalLM": ArchitectureSupport("Qwen3", "Qwen/Qwen3-8B"),
    "Gemma3ForCausalLM": ArchitectureSupport("Gemma 3 (text)", "google/gemma-3-1b-it"),
    "Gemma2ForCausalLM": ArchitectureSupport("Gemma 2", "google/gemma-2-2b-it"),
    "DeepseekV2ForCausalLM": ArchitectureSupport("DeepSeek-V2", "deepseek-ai/DeepSeek-V2-Lite-Chat",
                                                 {"first_k_dense_replace": 1, "num_experts_per_tok": 2}),
    "MixtralForCausalLM": ArchitectureSupport("Mixtral", "mistralai/Mixtral-8x7B-Instruct-v0.1"),
    "Qwen3MoeForCausalLM": ArchitectureSupport("Qwen3-MoE", "Qwen/Qwen3-30B-A3B"),
    "OlmoeForCausalLM": ArchitectureSupport("OLMoE", "allenai/OLMoE-1B-7B-0924-Instruct"),
    "Qwen2MoeForCausalLM": ArchitectureSupport("Qwen2-MoE", "Qwen/Qwen1.5-MoE-A2.7B-Chat"),
    "DeepseekV3ForCausalLM": ArchitectureSupport("DeepSeek-V3", "deepseek-ai/DeepSeek-V3",
                                                 {"first_k_dense_replace": 1}, mtp=True),
    "Glm4MoeForCausalLM": ArchitectureSupport("GLM-4.5", "zai-org/GLM-4.5-Air", mtp=True),
    "SmolLM3ForCausalLM": ArchitectureSupport("SmolLM3", "HuggingFaceTB/SmolLM3-3B"),
    "Phi3ForCausalLM": ArchitectureSupport("Phi-3, Phi-4-mini", "microsoft/Phi-4-mini-instruct"),
    "Olmo2ForCausalLM": ArchitectureSupport("OLMo 2", "allenai/OLMo-2-1124-7B-Instruct"),
    "Olmo3ForCausalLM": ArchitectureSupport("OLMo 3", "allenai/Olmo-3-7B-Instruct"),
    "GptOssForCausalLM": ArchitectureSupport("GPT-OSS", "openai/gpt-oss-20b"),
    "Mamba2ForCausalLM": ArchitectureSupport("Mamba2", "mistralai/Mamba-Codestral-7B-v0.1",
                                             {"num_heads": 8, "head_dim": 16}),
    "GraniteMoeHybridForCausalLM": ArchitectureSupport("Granite 4.0-H", "ibm-granite/granite-4.0-h-tiny"),
    "Llama4ForCausalLM": ArchitectureSupport("Llama 4 (text)", "meta-llama/Llama-4-Scout-17B-16E-Instruct"),
    "Qwen3NextForCausalLM": ArchitectureSupport("Qwen3-Next", "Qwen/Qwen3-Next-80B-A3B-Instruct",
                                                {"head_dim": 16, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
                                                 "linear_key_head_dim": 16, "linear_value_head_dim": 16,
                                                 "num_experts": 4, "num_experts_per_tok": 2,
                                                 "layer_types": ["linear_attention", "full_attention"]}, mtp=True),
    "NemotronHForCausalLM": ArchitectureSupport("Nemotron-H, Nemotron 3 Nano", "nvidia/Nemotron-H-8B-Base-8K",
                                                {"hybrid_override_pattern": "M-*E", "mamba_num_heads": 8,
                                                 "mamba_head_dim": 16, "n_groups": 2, "head_dim": 16,
                                                 "n_routed_experts": 4, "moe_intermediate_size": 32,
                                                 "moe_shared_expert_intermediate_size": 32}),
    "FalconH1ForCausalLM": ArchitectureSupport("Falcon-H1", "tiiuae/Falcon-H1-1.5B-Instruct",
                                               {"mamba_d_ssm": 128, "mamba_n_heads": 8, "mamba_d_head": 16}),
    "LlavaForConditionalGeneration": ArchitectureSupport("LLaVA (CLIP or SigLIP tower)", "llava-hf/llava-1.5-7b-hf",
                                                         vision=True),
    "Qwen2VLForConditionalGeneration": ArchitectureSupport("Qwen2-VL", "Qwen/Qwen2-VL-2B-Instruct", vision=True,
                                                           decoder="Qwen2ForCausalLM"),
    "Qwen2_5_VLForConditionalGeneration": ArchitectureSupport("Qwen2.5-VL", "Qwen/Qwen2.5-VL-3B-Instruct",
                                                              vision=True, decoder="Qwen2ForCausalLM"),
}


def mtp_architectures() -> tuple[str, ...]:
    """The architectures whose multi-token prediction layer speculative_method 'mtp' drafts with."""
    return tuple(name for name, support in ARCHITECTURE_SUPPORT.items() if support.mtp)
