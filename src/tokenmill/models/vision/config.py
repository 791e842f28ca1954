"""What a vision-language checkpoint's `config.json` says of its image side, read into plain data (no torch).

Two families lay images into the sequence differently:
- LLaVA (`LlavaForConditionalGeneration`): a vision transformer (CLIP or SigLIP) and a two-layer projector into
  the decoder's width; every image becomes the same number of positions (`LlavaVisionConfig.num_image_tokens`)
  and the decoder's positions stay 1-D.
- Qwen2-VL and Qwen2.5-VL (`Qwen2VLForConditionalGeneration`, `Qwen2_5_VLForConditionalGeneration`): a ViT
  over the image at its own resolution (14-pixel patches, 2x2 of them merged into one position; Qwen2.5-VL's
  with RMSNorm, SwiGLU and attention within windows but in a few blocks), so an image's positions follow its
  size; the decoder's rotary embedding is multimodal (M-RoPE: temporal, height and width positions,
  `ArchConfig.mrope_section`).
Either way the prompt holds a run of `image_token_id` where each image goes, and the image side's output is
the embeddings of those positions (`placeholders` says how many, from the image processor's output).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Union

QWEN_VL_ARCHITECTURES = ("Qwen2VLForConditionalGeneration", "Qwen2_5_VLForConditionalGeneration")
VISION_ARCHITECTURES = ("LlavaForConditionalGeneration", *QWEN_VL_ARCHITECTURES)
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
class LlavaVisionConfig:
    """The image side of a LLaVA model: its `architecture` (the HF class), tower, the tower layers
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

    def placeholders(self, inputs: dict[str, Any]) -> tuple[int, Optional[tuple[int, int, int]]]:
        """(positions, None) of one image whose processor output is `inputs`; ValueError when its pixels are
        not the size the tower takes."""
        size = self.tower.image_size
        shape = tuple(inputs["pixel_values"].shape[-2:])
        if shape != (size, size):
            raise ValueError(f"the model's image processor made {shape} pixels of an image; its vision tower takes "
                             f"{size}x{size}")
        return self.num_image_tokens, None

    @property
    def layers_needed(self) -> int:
        """Tower layers to run: up to the deepest one a feature is taken from."""
        count = self.tower.num_hidden_layers
        return max(index % (count + 1) for index in self.feature_layers)


@dataclass(frozen=True)
class Qwen2VLVisionConfig:
    """The image side of a Qwen2-VL or Qwen2.5-VL model: patches of `patch_size` pixels over
    `temporal_patch_size` frames (an image is its frame repeated), `depth` ViT blocks with 2-D rotary
    embeddings, and a merger of `spatial_merge_size` x `spatial_merge_size` patches into one position of the
    decoder's width. Qwen2.5-VL (`gated`): RMSNorm and a SwiGLU MLP of `intermediate_size` in the blocks, and
    attention within windows of `window_size` pixels except in `fullatt_block_indexes`."""

    architecture: str
    depth: int
    embed_dim: int
    num_heads: int
    mlp_ratio: float
    hidden_act: str
    in_channels: int
    patch_size: int
    spatial_merge_size: int
    temporal_patch_size: int
    text_hidden_size: int
    image_token_id: int
    gated: bool = False
    intermediate_size: int = 0  # the MLP's width (0: embed_dim x mlp_ratio)
    window_size: int = 0  # 0: every block attends over the whole image
    fullatt_block_indexes: tuple[int, ...] = ()

    @property
    def mlp_width(self) -> int:
        """The blocks' MLP width."""
        return self.intermediate_size or int(self.embed_dim * self.mlp_ratio)

    def placeholders(self, inputs: dict[str, Any]) -> tuple[int, Optional[tuple[int, int, int]]]:
        """(positions, their (t, h, w) grid) of one image whose processor output is `inputs` (pixel_values of
        its patches, image_grid_thw its patch grid)."""
        t, h, w = (int(v) for v in inputs["image_grid_thw"].tolist())
        merge = self.spatial_merge_size
        if h % merge or w % merge or inputs["pixel_values"].shape[0] != t * h * w:
            raise ValueError(f"the model's image processor made a {t}x{h}x{w} patch grid that does not match its "
                             f"pixels or the merge size {merge}")
        return t * (h // merge) * (w // merge), (t, h // merge, w // merge)


VisionConfig = Union[LlavaVisionConfig, Qwen2VLVisionConfig]


def vision_config_from_hf(config: dict[str, Any], text_hidden_size: int) -> VisionConfig:
    """The image side's config of a vision-language `config.json` (whose `architectures` name one of
    VISION_ARCHITECTURES); ValueError naming what is not supported."""
    architecture = next(a for a in config.get("architectures") or () if a in VISION_ARCHITECTURES)
    if architecture in QWEN_VL_ARCHITECTURES:
        return _qwen2_vl(config, architecture, text_hidden_size)
    return _llava(config, architecture, text_hidden_size)


def _token(config: dict[str, Any], architecture: str) -> int:
    token = config.get("image_token_id", config.get("image_token_index"))
    if token is None:
        raise ValueError(f"{architecture} config.json names no image_token_id")
    return int(token)


def _qwen2_vl(config: dict[str, Any], architecture: str, text_hidden_size: int) -> Qwen2VLVisionConfig:
    vision = config.get("vision_config") or {}
    gated = architecture == "Qwen2_5_VLForConditionalGeneration"
    act = vision.get("hidden_act", "silu" if gated else "quick_gelu")
    if act not in (*_ACTIVATIONS, "silu"):
        raise ValueError(f"unsupported activation {act!r} in {architecture}; supported: {', '.join(_ACTIVATIONS)}, silu")
    output = vision.get("out_hidden_size" if gated else "hidden_size", text_hidden_size)
    if output != text_hidden_size:
        raise ValueError(f"{architecture}: the vision merger's output ({output}) is not the decoder's width "
                         f"({text_hidden_size})")
    return Qwen2VLVisionConfig(architecture=architecture, depth=vision.get("depth", 32),
                               embed_dim=vision.get("hidden_size" if gated else "embed_dim", 1280),
                               num_heads=vision.get("num_heads", 16), mlp_ratio=float(vision.get("mlp_ratio", 4)),
                               hidden_act=act, in_channels=vision.get("in_channels", vision.get("in_chans", 3)),
                               patch_size=vision.get("patch_size", 14),
                               spatial_merge_size=vision.get("spatial_merge_size", 2),
                               temporal_patch_size=vision.get("temporal_patch_size", 2),
                               text_hidden_size=text_hidden_size, image_token_id=_token(config, architecture),
                               gated=gated, intermediate_size=vision.get("intermediate_size", 3420) if gated else 0,
                               window_size=vision.get("window_size", 112) if gated else 0,
                               fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes", (7, 15, 23, 31))
                                                           if gated else ()))


def _llava(config: dict[str, Any], architecture: str, text_hidden_size: int) -> LlavaVisionConfig:
    vision = config.get("vision_config") or {}
    kind = vision.get("model_type", "clip_vision_model")
    if kind not in TOWERS:
        raise ValueError(f"unsupported vision tower {kind!r} in {architecture}; supported: {', '.join(TOWERS)}")
    clip = kind == "clip_vision_model"
    tower = TowerConfig(kind=kind, hidden_size=vision.get("hidden_size", 768),
                        intermediate_size=vision.get("intermediate_size", 3072),
                        num_hidden_layers=vision.get("num_hidden_layers", 12),
                        num_attention_heads=vision.get("num_attention_heads", 12),
                        image_size=vision.get("image_size", 224), patch_size=vision.get("patch_size", 32 if clip else 16),
                        num_channels=vision.get("num_channels", 3),
                        layer_norm_eps=float(vision.get("layer_norm_eps", 1e-5 if clip else 1e-6)),
                        hidden_act=vision.get("hidden_act", "quick_gelu" if clip else "gelu_pytorch_tanh"))
    layers = config.get("vision_feature_layer", -2)
    strategy = config.get("vision_feature_select_strategy", "default")
    if strategy not in ("default", "full"):
        raise ValueError(f"unsupported vision_feature_select_strategy {strategy!r}; supported: default, full")
    for act in (tower.hidden_act, config.get("projector_hidden_act", "gelu")):
        if act not in _ACTIVATIONS:
            raise ValueError(f"unsupported activation {act!r} in {architecture}; supported: {', '.join(_ACTIVATIONS)}")
    return LlavaVisionConfig(architecture=architecture, tower=tower,
                             feature_layers=tuple(layers) if isinstance(layers, list) else (int(layers),),
                             select_strategy=strategy, projector_act=config.get("projector_hidden_act", "gelu"),
                             projector_bias=bool(config.get("multimodal_projector_bias", True)),
                             text_hidden_size=text_hidden_size, image_token_id=_token(config, architecture))
