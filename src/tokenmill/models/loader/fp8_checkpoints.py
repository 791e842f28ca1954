"""Checkpoints of `quantization_config.quant_method: fp8` (transformers' FP8 and fine-grained FP8
formats, vLLM's `--quantization fp8` serialisation): what Qwen3-FP8 and DeepSeek-V3 ship.

The config gives `fmt` ("e4m3"), `activation_scheme` ("dynamic", or "static" with an `input_scale` per
layer) and optionally `weight_block_size` [rows, cols]; `modules_to_not_convert` / `ignored_layers` name
layers saved as floats (a layer is read as FP8 exactly when the checkpoint holds its scale). An FP8
layer is `weight` float8_e4m3fn [out, in] and, with blocks, `weight_scale_inv` float32 [ceil(out / rows),
ceil(in / cols)] (despite its name the multiplier: w = weight * weight_scale_inv, as DeepSeek's
weight_dequant computes it), else `weight_scale` (one value per tensor, or one per output channel).

Kept (the default), a layer becomes an `W8A8Weight` (kernels/w8a8.py) multiplied W8A8 with activations
quantised dynamically per token, per token and block with block weights (DeepSeek's recipe); a static
`input_scale` is not applied (per token is finer). With `--quantization none` it is dequantised to float32.
"""

from __future__ import annotations

import logging
from typing import Any, Optional

import torch

from tokenmill.kernels import w8a8
from tokenmill.models.loader.packed_layers import LayerParts, LoadedWeight, kv_cache_scale

logger = logging.getLogger(__name__)

_SCALES = ("weight_scale_inv", "weight_scale")
_PARTS = ("weight",) + _SCALES + ("input_scale",)


class Fp8Layers:
    """How one `quant_method: fp8` checkpoint's layers are read (quantized_checkpoints.PackedScheme).
    ValueError at construction names a config this engine does not read; at load, a layer whose tensors
    contradict it."""

    def __init__(self, config: dict[str, Any], folder: str, names: set[str]) -> None:
        self.where = f"{folder}: quantization_config.quant_method 'fp8'"
        fmt = str(config.get("fmt", "e4m3")).lower()
        if fmt != "e4m3":
            raise ValueError(f"{self.where}: fmt {fmt!r} is not supported (supported: e4m3)")
        scheme = str(config.get("activation_scheme", "dynamic")).lower()
        if scheme not in ("dynamic", "static"):
            raise ValueError(f"{self.where}: activation_scheme {scheme!r} is not supported (supported: dynamic, "
                             "static)")
        block = config.get("weight_block_size")
        if block is not None and (not isinstance(block, (list, tuple)) or len(block) != 2
                                  or not all(isinstance(v, int) and v > 0 for v in block)):
            raise ValueError(f"{self.where}: weight_block_size must be two positive integers, got {block!r}")
        self.block: Optional[tuple[int, int]] = None if block is None else (block[0], block[1])
        if self.block is not None and self.block[1] not in w8a8.BLOCK_WIDTHS:
            raise ValueError(f"{self.where}: weight_block_size {list(self.block)} is not supported (the FP8 "
                             f"products take blocks of {', '.join(map(str, w8a8.BLOCK_WIDTHS))} columns)")
        self.scale_name = "weight_scale_inv" if self.block is not None else "weight_scale"
        self.tensors = LayerParts(_PARTS, {name.rpartition(".")[0] for name in names
                                           if name.endswith(tuple(f".{s}" for s in _SCALES))})
        if any(name.endswith(".input_scale") for name in names):
            logger.info("the checkpoint's static activation scales (input_scale) are not applied: FP8 products "
                        "quantise activations per token")

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of a tensor of an FP8 layer, else None."""
        return self.tensors.layer_of(name)

    @staticmethod
    def unused(name: str) -> bool:
        """The KV-cache scales (attention's k_scale and v_scale): the KV cache keeps --kv-cache-dtype."""
        return kv_cache_scale(name)

    def complete(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> bool:
        """Whether every part of `layer` in the checkpoint has arrived."""
        return self.tensors.complete(layer, parts, names)

    def load(self, layer: str, parts: dict[str, torch.Tensor], keep_packed: bool) -> tuple[LoadedWeight, str]:
        """The layer as an `W8A8Weight` (`keep_packed`), else its float32 weight [out, in]."""
        where = f"FP8 layer {layer}"
        if "weight" not in parts:
            raise ValueError(f"{where}: the layer has no weight tensor")
        if self.scale_name not in parts:
            other = next(iter(set(_SCALES) & set(parts)))
            raise ValueError(f"{where}: the layer has {other} but no {self.scale_name} (the config "
                             f"{'gives' if self.block else 'gives no'} weight_block_size)")
        weight = w8a8.from_checkpoint(parts["weight"], parts[self.scale_name], self.block, where)
        if keep_packed:
            return weight, "fp8 kept"
        return weight.dequantize(), "fp8 dequantised to floats"
