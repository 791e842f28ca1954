"""What a vision-language checkpoint's `config.json` says of its image side, read into plain data (no torch).

A LLaVA-style model (`LlavaForConditionalGeneration`) is a vision transformer (CLIP or SigLIP), a two-layer
projector into the decoder's width, and a decoder whose prompt holds `num_image_tokens` copies of
`image_token_id` where each image goes; the embeddings of those positions are the projector's output.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

VISION_ARCHITECTURES = ("LlavaForConditionalGeneration",)
TOWERS = ("clip_vision_model", "siglip_vision_model")
_ACTIVATIONS = ("quick_gelu", "gelu", "gelu_pytorch_tanh", "gelu_new")


@dataclass(frozen=True)
class TowerConfig:
    """A ViT: `kind` is the HF model_type (clip_vision_model: a class token, a bias-free patch convolution and
    a norm before the layers; siglip_vision_model: none of those)."""

    kind: str
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    image_size: int
    patch_size: int
    num_channels: int
    layer_norm_eps: float
    hidden_act: str

    @property
    def class_token(self) -> bool:
        """Whether a class embedding comes before the patches (CLIP)."""
        return self.kind == "clip_vision_model"

    @property
    def num_positions(self) -> int:
        """Patches per image, plus the class token where there is one."""
        return (self.image_size // self.patch_size) ** 2 + int(self.class_token)


@dataclass(frozen=True)
class VisionConfig:
    """The image side of a vision-language model: its `architecture` (the HF class), tower, the tower layers
    whose outputs feed the projector (`feature_layers`, Python indices into [embeddings, layer 1, ...]) and
    whether the class token is dropped (`select_strategy` "default") or kept ("full"), the projector and the
    decoder token that marks an image's positions."""

    architecture: str
    tower: TowerConfig
    feature_layers: tuple[int, ...]
    select_strategy: str
    projector_act: str
    projector_bias: bool
    text_hidden_size: int
    image_token_id: int

    @property
    def num_image_tokens(self) -> int:
        """Placeholder tokens (and embeddings) of one image."""
        return self.tower.num_positions - int(self.tower.class_token and self.select_strategy == "default")

    @property
    def layers_needed(self) -> int:
        """Tower layers to run: up to the deepest one a feature is taken from."""
        count = self.tower.num_hidden_layers
        return max(index % (count + 1) for index in self.feature_layers)


def vision_config_from_hf(config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The `VisionConfig` of a vision-language `config.json` (whose `architectures` name one of
    VISION_ARCHITECTURES); ValueError naming what is not supported."""
    architecture = next(a for a in config.get("architectures") or () if a in VISION_ARCHITECTURES)
    vision = config.get("vision_config") or {}
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in TOWERS:
        raise ValueError(f"unsupported vision tower {kind!r} in {architecture}; supported: {', '.join(TOWERS)}")
    tower = TowerConfig(kind=kind, hidden_size=vision.get("hidden_size", 768),
                        intermediate_size=vision.get("intermediate_size", 3072),
                        num_hidden_layers=vision.get("num_hidden_layers", 12),
                        num_attention_heads=vision.get("num_attention_heads", 12),
                        image_size=vision.get("image_size", 224), patch_size=vision.get("patch_size", 32 if kind == "clip_vision_model" else 16),
                        num_channels=vision.get("num_channels", 3),
                        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5 if kind == "clip_vision_model" else 1e-6)),
                        hidden_act=vision.get("hidden_act", "quick_gelu" if kind == "clip_vision_model"
                                              else "gelu_pytorch_tanh"))
    layers = config.get("vision_feature_layer", -2)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: default, full")
    for act in (tower.hidden_act, config.get("projector_hidden_act", "gelu")):
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} in {architecture}; supported: {', '.join(_ACTIVATIONS)}")
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        raise ValueError(f"{architecture} config.json names no image_token_id")
    return VisionConfig(architecture=architecture, tower=tower,
                        feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
                        select_strategy=strategy, projector_act=config.get("projector_hidden_act", "gelu"),
                        projector_bias=bool(config.get("multimodal_projector_bias", True)),
                        text_hidden_size=text_hidden_size, image_token_id=int(token))
