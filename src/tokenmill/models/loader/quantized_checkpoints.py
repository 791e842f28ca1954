"""Checkpoints whose config.json has a `quantization_config`: which scheme reads them, and the weight
stream that turns each packed layer's tensors into one weight as they load.

A scheme (`packed_layers.PackedScheme`: `gptq_awq.GptqAwqLayers`,
`compressed_tensors.CompressedTensorsLayers`, `fp8_checkpoints.Fp8Layers`) names the tensors that form a
packed layer and turns them into either a `QuantizedWeight` (kept packed, run on the native int8/int4
products; only where the format maps exactly onto their layout), an `W8A8Weight` (FP8 layers, kept as
stored) or the float32 weight they dequantise to (with `--quantization none`, and for layers whose layout
does not map). Every other `quant_method` is refused by name.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import torch

from tokenmill.models.loader.compressed_tensors import CompressedTensorsLayers
from tokenmill.models.loader.fp8_checkpoints import Fp8Layers
from tokenmill.models.loader.gptq_awq import GptqAwqLayers
from tokenmill.models.loader.packed_layers import LoadedWeight, PackedScheme

logger = logging.getLogger(__name__)


def quantization_config(folder: str) -> Optional[dict[str, Any]]:
    """The checkpoint's quantization_config (None for a float checkpoint)."""
    config = json.loads((Path(folder) / "config.json").read_text())
    value = config.get("quantization_config")
    return value if isinstance(value, dict) else None


# vLLM's --quantization names that mean "the checkpoint's own method", and the method each one must find:
# the Marlin names pick vLLM's kernel for the same weights, which here run on the one packed product
CHECKPOINT_QUANTIZATIONS = {"awq": "awq", "awq_marlin": "awq", "gptq": "gptq", "gptq_marlin": "gptq",
                            "compressed-tensors": "compressed-tensors", "gguf": "gguf"}


def resolve_quantization(asked: str, checkpoint_method: Optional[str], where: str) -> str:
    """What `--quantization asked` means for a checkpoint whose method is `checkpoint_method` (its
    quantization_config's quant_method, "gguf" for a GGUF file, None for float weights): a name of
    `CHECKPOINT_QUANTIZATIONS` keeps the checkpoint's packed weights ("auto") once it is checked to be that
    method (ValueError naming both otherwise, as vLLM refuses it); any other value is returned as it is."""
    wanted = CHECKPOINT_QUANTIZATIONS.get(asked)
    if wanted is None:
        return asked
    if checkpoint_method != wanted:
        found = f"quantization method {checkpoint_method!r}" if checkpoint_method else "float (unquantised) weights"
        raise ValueError(f"--quantization {asked} expects a {wanted} checkpoint, but {where} has {found}; "
                         f"leave --quantization at auto to serve the checkpoint as it is")
    return "auto"


def packed_scheme(config: dict[str, Any], folder: str, names: set[str]) -> PackedScheme:
    """The scheme that reads a checkpoint with this quantization_config and these tensor `names`;
    ValueError naming one that is not supported."""
    method = str(config.get("quant_method", "")).lower()
    if method in ("gptq", "awq"):
        return GptqAwqLayers(config, folder)
    if method == "compressed-tensors":
        return CompressedTensorsLayers(config, folder, names)
    if method == "fp8":
        return Fp8Layers(config, folder, names)
    raise ValueError(f"{folder}: quantization_config.quant_method {method!r} is not supported (supported: gptq, "
                     f"awq, compressed-tensors, fp8); dequantise the checkpoint or use a GGUF file")


def packed_layer_stream(scheme: PackedScheme, names: set[str],
                        stream: Callable[[set[str]], Iterator[tuple[str, torch.Tensor]]],
                        file_of: Callable[[str], Any]
                        ) -> tuple[set[str], Callable[[bool], Iterator[tuple[str, LoadedWeight]]]]:
    """The tensor names a model sees (each packed layer's parts become `<layer>.weight`) and a stream that
    yields them: other tensors as stored, each packed layer as one weight once all its parts have arrived
    (kept packed when the stream's `keep_packed` is true and the layer maps exactly). A layer whose
    tensors contradict the scheme raises ValueError naming the file (`file_of` a tensor name) and layer."""
    names = {name for name in names if not scheme.unused(name)}
    layers = {scheme.layer_of(name) for name in names} - {None}
    visible = {name for name in names if scheme.layer_of(name) is None} | {f"{layer}.weight" for layer in layers}

    def tensors(keep_packed: bool) -> Iterator[tuple[str, LoadedWeight]]:
        pending: dict[str, dict[str, torch.Tensor]] = {}
        kept: Counter[str] = Counter()

        def one_layer(layer: str) -> tuple[str, LoadedWeight]:
            parts = pending.pop(layer)
            try:
                weight, how = scheme.load(layer, parts, keep_packed)
            except ValueError as error:
                raise ValueError(f"{file_of(f'{layer}.{next(iter(parts))}')}: {error}") from None
            kept[how] += 1
            return f"{layer}.weight", weight

        for name, tensor in stream(names):
            layer = scheme.layer_of(name)
            if layer is None:
                yield name, tensor
                continue
            pending.setdefault(layer, {})[name[len(layer) + 1:]] = tensor
            if scheme.complete(layer, pending[layer], names):
                yield one_layer(layer)
        for layer in list(pending):
            yield one_layer(layer)
        logger.info("quantised layers: %s", ", ".join(f"{count} {how}" for how, count in sorted(kept.items())))

    return visible, tensors
