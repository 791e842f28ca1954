"""LLaVA's image side: a CLIP/SigLIP tower, the features of chosen layers, a two-layer projector into the
decoder's width (HF's LlavaForConditionalGeneration.get_image_features)."""

from __future__ import annotations

from typing import Any, Iterable

import torch
from torch import nn

from tokenmill.models.vision.config import LlavaVisionConfig
from tokenmill.models.named_weights import load_named_weights
from tokenmill.models.vision.vit import VisionTower, activation

# checkpoint prefixes of the image side, as transformers 5 saves them and as llava-hf's older files name them
_PREFIXES = (("model.vision_tower.", "tower."), ("vision_tower.", "tower."),
             ("model.multi_modal_projector.", "projector."), ("multi_modal_projector.", "projector."))
# the tower's parts LLaVA never reads: its last norm and SigLIP's pooling head
_UNUSED = ("vision_model.post_layernorm.", "vision_model.head.")


def vision_tensor_name(name: str) -> str | None:
    """The image side's own name of checkpoint tensor `name` ('tower.…' or 'projector.…'), None for a
    decoder tensor."""
    for prefix, ours in _PREFIXES:
        if name.startswith(prefix):
            rest = name[len(prefix):]
            if ours == "tower." and not rest.startswith("vision_model."):  # transformers 5 drops that level
                rest = "vision_model." + rest
            return ours + rest
    return None


class _Projector(nn.Module):
    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        width = config.tower.hidden_size * len(config.feature_layers)
        self.act = config.projector_act
        self.linear_1 = nn.Linear(width, config.text_hidden_size, bias=config.projector_bias)
        self.linear_2 = nn.Linear(config.text_hidden_size, config.text_hidden_size, bias=config.projector_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(activation(self.act, self.linear_1(x)))


class LlavaVision(nn.Module):
    """Pixels of one image -> its `config.num_image_tokens` embeddings in the decoder's width."""

    def __init__(self, config: LlavaVisionConfig) -> None:
        super().__init__()
        self.config = config
        self.tower = VisionTower(config.tower, config.layers_needed)
        self.projector = _Projector(config)

    @torch.inference_mode()
    def encode(self, inputs: dict[str, Any]) -> torch.Tensor:
        """`inputs["pixel_values"]` [channels, H, W] (the image processor's output for one image) ->
        embeddings [num_image_tokens, text hidden]."""
        states = self.tower.hidden_states(inputs["pixel_values"])
        depth = self.config.tower.num_hidden_layers + 1  # the indices count the layers not run, too
        picked = [states[index % depth] for index in self.config.feature_layers]
        if self.config.select_strategy == "default" and self.config.tower.class_token:
            picked = [state[1:] for state in picked]
        return self.projector(torch.cat(picked, dim=-1))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Load tensors named as `vision_tensor_name` names them, but those the tower never reads (its last norm,
        SigLIP's pooling head, layers past the deepest feature)."""
        kept_layers = self.config.layers_needed

        def unused(name: str) -> bool:
            inner = name.split(".", 1)[1]
            return inner.startswith(_UNUSED) or _layer_index(inner) >= kept_layers

        load_named_weights(self, weights, self.config.architecture, "vision.", unused)


def _layer_index(name: str) -> int:
    """The encoder layer a tower tensor belongs to (-1 for the others)."""
    marker = "encoder.layers."
    if not name.startswith("vision_model." + marker):
        return -1
    return int(name[len("vision_model." + marker):].split(".", 1)[0])
