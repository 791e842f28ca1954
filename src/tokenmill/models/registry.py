"""Which model class implements which architecture name."""

from __future__ import annotations

from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.models.arch import ArchConfig
from tokenmill.models.decoder import DecoderForCausalLM
from tokenmill.models.vision.config import Qwen2VLVisionConfig, VisionConfig
from tokenmill.parallel.group import PipelineStage, TPGroup

# every architecture runs as the one decoder; what differs is data in its ArchConfig (hf_config.py and
# gguf_file.py translate each architecture's settings)
_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": DecoderForCausalLM,
    "MistralForCausalLM": DecoderForCausalLM,
    "Qwen2ForCausalLM": DecoderForCausalLM,
    "Qwen3ForCausalLM": DecoderForCausalLM,
    "Gemma3ForCausalLM": DecoderForCausalLM,
    "Gemma2ForCausalLM": DecoderForCausalLM,  # attention scores soft-capped (AttentionLayer.logit_softcap)
    "DeepseekV2ForCausalLM": DecoderForCausalLM,  # multi-head latent attention (models/mla_attention.py)
    "MixtralForCausalLM": DecoderForCausalLM,  # mixtures of experts (layers/moe.py)
    "Qwen3MoeForCausalLM": DecoderForCausalLM,
    "OlmoeForCausalLM": DecoderForCausalLM,
    "Qwen2MoeForCausalLM": DecoderForCausalLM,  # a sigmoid-gated shared expert
    "DeepseekV3ForCausalLM": DecoderForCausalLM,  # MLA and sigmoid grouped routing with a correction bias
    "Glm4MoeForCausalLM": DecoderForCausalLM,  # DeepSeek-V3's routing, partial RoPE
    "SmolLM3ForCausalLM": DecoderForCausalLM,  # NoPE layers (LayerSpec.rope)
    "Phi3ForCausalLM": DecoderForCausalLM,  # fused checkpoint tensors split at load (loader/fused_tensors.py)
    "Olmo2ForCausalLM": DecoderForCausalLM,  # norms after the blocks only (ArchConfig.post_norms)
    "Olmo3ForCausalLM": DecoderForCausalLM,
    "GptOssForCausalLM": DecoderForCausalLM,  # attention sinks, biased experts (layers/gpt_oss_experts.py)
    "Mamba2ForCausalLM": DecoderForCausalLM,  # Mamba2 mixers over recurrent states (models/mamba2.py)
    # Granite 4.0-H: Mamba2 and attention layers, each with its MLP (models/granite_hybrid.py)
    "GraniteMoeHybridForCausalLM": DecoderForCausalLM,
    # chunked local attention (AttentionLayer.attention_chunk), experts scaling their inputs (loader/llama4_tensors.py)
    "Llama4ForCausalLM": DecoderForCausalLM,
    # Gated DeltaNet (linear attention over recurrent states) and gated attention layers (models/qwen3_next.py)
    "Qwen3NextForCausalLM": DecoderForCausalLM,
    # Nemotron-H: Mamba2, NoPE attention and relu² MLP blocks, grouped into layers (models/nemotron_h.py)
    "NemotronHForCausalLM": DecoderForCausalLM,
    # Falcon-H1: a Mamba2 mixer and attention side by side in every layer, run as two layers (models/falcon_h1.py)
    "FalconH1ForCausalLM": DecoderForCausalLM,
}


def supported_architectures() -> list[str]:
    """Architecture names tokenmill can run."""
    return sorted(_MODELS)


def build_model(arch: ArchConfig, backend: AttentionBackend, max_positions: int,
                tp: TPGroup = TPGroup.single(), stage: PipelineStage = PipelineStage()) -> nn.Module:
    """Instantiate (uninitialised) the model for `arch`, holding rank `tp.rank`'s shard; unknown
    architectures raise ValueError, and so does a tensor-parallel size that does not divide the model."""
    klass = _MODELS.get(arch.architecture)
    if klass is None:
        raise ValueError(f"unsupported architecture {arch.architecture!r}; supported: "
                         f"{', '.join(supported_architectures())}")
    model = klass(arch, backend, max_positions, tp, stage)
    if arch.vision is not None and stage.is_first:  # the images' embeddings enter at the first stage
        model.vision = build_vision(arch.vision)
        model.vision.requires_grad_(False)
    return model


def build_vision(config: VisionConfig) -> nn.Module:
    """The image side of a vision-language model (models/vision/), uninitialised."""
    if isinstance(config, Qwen2VLVisionConfig):
        from tokenmill.models.vision.qwen2_vl import Qwen2VLVision
        return Qwen2VLVision(config)
    from tokenmill.models.vision.llava import LlavaVision
    return LlavaVision(config)
