"""Which model class implements which architecture name."""

from __future__ import annotations

from torch import nn

from tokenmill.attention.base import AttentionBackend
from tokenmill.models.arch import ArchConfig
from tokenmill.models.llama import LlamaForCausalLM
from tokenmill.parallel.group import PipelineStage, TPGroup

_MODELS: dict[str, type[nn.Module]] = {
    "LlamaForCausalLM": LlamaForCausalLM,
    "MistralForCausalLM": LlamaForCausalLM,
    "Qwen2ForCausalLM": LlamaForCausalLM,
    "Qwen3ForCausalLM": LlamaForCausalLM,
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
    return klass(arch, backend, max_positions, tp, stage)
