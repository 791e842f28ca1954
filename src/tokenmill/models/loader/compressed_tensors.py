"""compressed-tensors checkpoints (`quant_method: compressed-tensors`, what llm-compressor writes), read
as they are written.

The config's `config_groups` each give a weight scheme (`weights`: type int or float, num_bits, strategy
tensor / channel / group / block, symmetric, group_size, actorder) and the layers it `targets`
("Linear", a layer name, or "re:" and a regex matched from the name's start); `ignore` lists layers left
as floats; a group's `format` (or the config's) says how its tensors are stored:

- **pack-quantized** (W4A16, W8A16): `weight_packed` int32 [out, in * bits / 32], each 32 values of a row
  packed densely from bit 0 (for 4 and 8 bits: 32 / bits values per word, low bits first), stored as the
  signed value plus 2^(bits - 1); `weight_shape` [out, in]; `weight_scale` [out, in / group_size] (or
  [out, 1], [1]); asymmetric schemes add `weight_zero_point`, packed the same way along the output rows;
  `weight_g_idx` [in] with group activation order. w = (v - zp) * s, v and zp signed.
- **int-quantized / naive-quantized** (W8A8): `weight` int8 [out, in], `weight_scale`, optional
  `weight_zero_point` (int8). **float-quantized** (FP8): `weight` float8_e4m3fn [out, in], `weight_scale`
  per tensor, channel, group or block. w = v * s.

Kept packed, int8 W8A8 layers (int-quantized / naive-quantized int8 weights per channel or tensor,
symmetric, with int8 `input_activations`: llm-compressor's W8A8 preset) become int8 `W8A8Weight`s
(kernels/w8a8.py: the int8 values and float32 scales as stored), multiplied with activations quantised to
int8 per token on int8 tensor cores where the products run on the device (layers/w8a8_linear.py), and as
the packed int8 weights below on the CPU's products. Other kept int layers become int4 (4 bits) or int8
(8 bits) `QuantizedWeight`s: u = v + 2^(bits - 1),
and per 32 inputs scale = s and offset = -s (zp + 2^(bits - 1)) of their group. With half-precision
scales (llm-compressor saves the model's bf16/fp16) that is exact: s u and s (zp + 2^(bits - 1)) need at
most 11 + 9 bits, so s u + offset = (v - zp) s in float32. Float32 scales are rounded once more (s u + offset
is within a float32 rounding of (v - zp) s).
Groups must come in runs of 32 inputs, after sorting the inputs by group where `weight_g_idx` shuffles
them (activation order, kept as the weight's `input_order`, as for GPTQ). FP8 weights (float-quantized, or
naive-quantized with float8 values) are kept as `W8A8Weight`s (kernels/w8a8.py: e4m3 values and their scales
as stored; per tensor, channel, group or block of 32, 64 or 128 columns) and multiplied W8A8
(layers/w8a8_linear.py); with `--quantization none`, or scales per other widths, they are dequantised to their
float values (e4m3 times the scale, exact in float32). The checkpoint's activation scheme is not applied as
written: FP8 and int8 W8A8 products quantise activations dynamically per token (FP8: per token and block
for block weights), which for a static `input_scale` (one per tensor) is finer; the packed int products
quantise their input to int8 per 32 values, a float product keeps it in `--dtype`. Sparsity (2:4), transforms (Hadamard rotations) and the
FP4/MX formats are refused by name.

A `kv_cache_scheme`'s per-tensor KV-cache scales (attention's `k_scale`, `v_scale`) are read and dropped
(logged once): a one-byte KV cache (`--kv-cache-dtype int8/fp8`, attention/kv_quant.py, on every attention
backend) calculates a scale for each token and head as it writes the row, from the row's own max |x|, which
is never larger than the tensor's: a row is never clipped and never quantised more coarsely than with the
checkpoint's scale. Whether the cache holds one-byte rows is `--kv-cache-dtype`'s choice alone.
"""

from __future__ import annotations

import logging
import re
from typing import Any, Optional

import torch

from tokenmill.kernels import w8a8
from tokenmill.kernels.quantized import BLOCK
from tokenmill.models.loader.packed_layers import (LayerParts, LoadedWeight, kv_cache_scale, packed_when_in_runs,
                                                   unpack_cols, unpack_rows)

logger = logging.getLogger(__name__)

_PARTS = ("weight_packed", "weight_shape", "weight_scale", "weight_zero_point", "weight_g_idx", "input_scale",
          "input_zero_point", "weight")
_UNUSED = ("input_scale", "input_zero_point")  # activation scales: see the module's docstring
_INT_FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
_FLOAT_FORMATS = ("float-quantized", "naive-quantized")  # naive-quantized holds float8 values as they are
_FORMATS = _INT_FORMATS + ("float-quantized",)
_STRATEGIES = ("tensor", "channel", "group", "block")


class CompressedTensorsLayers:
    """How one compressed-tensors checkpoint's layers are read (quantized_checkpoints.PackedScheme). A layer
    is packed when the checkpoint holds its `weight_scale`. ValueError at construction names a scheme this
    engine does not read; at load, a layer whose tensors contradict its scheme."""

    def __init__(self, config: dict[str, Any], folder: str, names: set[str]) -> None:
        self.where = f"{folder}: compressed-tensors"
        for key in ("sparsity_config", "transform_config"):
            if config.get(key):
                raise ValueError(f"{self.where} with a {key} ({_brief(config[key])}) is not supported: sparse "
                                 f"and transformed (rotated) weights are not read")
        self.ignore = list(config.get("ignore") or [])
        self.groups: list[tuple[str, list[str], dict[str, Any], str]] = []
        self.activations: dict[str, Optional[dict[str, Any]]] = {}  # each group's input_activations
        for group_name, group in (config.get("config_groups") or {}).items():
            weights = group.get("weights")
            if not weights:
                continue
            fmt = group.get("format") or config.get("format")
            self._check_scheme(group_name, weights, fmt)
            self.groups.append((group_name, list(group.get("targets") or []), weights, fmt))
            self.activations[group_name] = group.get("input_activations")
        if not self.groups:
            raise ValueError(f"{self.where} has no config group with a weight scheme")
        self.tensors = LayerParts(_PARTS, {name.rpartition(".")[0] for name in names if name.endswith(".weight_scale")})
        if any(self.unused(name) for name in names):
            logger.info("the checkpoint's KV-cache scales (k_scale, v_scale) are not used: a one-byte KV cache "
                        "(--kv-cache-dtype int8/fp8) calculates a finer scale for every token and head as it "
                        "writes it, and the cache keeps --kv-cache-dtype")
        self._unused_logged = False
        self._activations_logged = False

    def _check_scheme(self, group_name: str, weights: dict[str, Any], fmt: Optional[str]) -> None:
        where = f"{self.where} config group {group_name!r}"
        kind, bits, strategy = weights.get("type"), weights.get("num_bits"), weights.get("strategy")
        if fmt not in _FORMATS:
            raise ValueError(f"{where}: format {fmt!r} is not supported (supported: {', '.join(_FORMATS)})")
        if not ((kind == "int" and fmt in _INT_FORMATS) or (kind == "float" and fmt in _FLOAT_FORMATS)):
            raise ValueError(f"{where}: weights of type {kind!r} in format {fmt!r} are not supported")
        allowed = (4, 8) if fmt == "pack-quantized" else (8,)
        if bits not in allowed:
            raise ValueError(f"{where}: {bits}-bit {kind} weights in format {fmt!r} are not supported "
                             f"(supported: {' and '.join(map(str, allowed))} bits)")
        strategies = _STRATEGIES if kind == "float" else _STRATEGIES[:3]
        if strategy not in strategies:
            raise ValueError(f"{where}: {kind} weights with strategy {strategy!r} are not supported "
                             f"(supported: {', '.join(strategies)})")
        if weights.get("dynamic") not in (False, None):
            raise ValueError(f"{where}: dynamic weight scales ({weights.get('dynamic')!r}) are not supported")

    def layer_of(self, name: str) -> Optional[str]:
        """The layer prefix of a tensor of a packed layer, else None."""
        return self.tensors.layer_of(name)

    @staticmethod
    def unused(name: str) -> bool:
        """The KV-cache scales of a `kv_cache_scheme` (attention's k_scale and v_scale)."""
        return kv_cache_scale(name)

    def complete(self, layer: str, parts: dict[str, torch.Tensor], names: set[str]) -> bool:
        """Whether every part of `layer` in the checkpoint has arrived."""
        return self.tensors.complete(layer, parts, names)

    def scheme_of(self, layer: str) -> tuple[str, dict[str, Any], str]:
        """(config group name, weight scheme, format) of `layer`; ValueError when the config leaves it
        out or ignores it although the checkpoint holds it packed."""
        if any(_matches(layer, target) for target in self.ignore):
            raise ValueError(f"compressed-tensors: layer {layer} is in the config's ignore list but the checkpoint "
                             f"holds it quantised (it has {layer}.weight_scale)")
        for group_name, targets, weights, fmt in self.groups:
            if any(target == "Linear" or _matches(layer, target) for target in targets):
                return group_name, weights, fmt
        raise ValueError(f"compressed-tensors: no config group targets layer {layer}, which the checkpoint holds "
                         f"quantised (it has {layer}.weight_scale)")

    def load(self, layer: str, parts: dict[str, torch.Tensor], keep_packed: bool) -> tuple[LoadedWeight, str]:
        """The layer kept packed (`keep_packed`, int schemes whose groups come in runs of 32 inputs), else
        its float32 weight [out, in]."""
        group_name, weights, fmt = self.scheme_of(layer)
        where = f"compressed-tensors layer {layer} (config group {group_name!r}, {fmt})"
        if not self._unused_logged and any(part in parts for part in _UNUSED):
            self._unused_logged = True
            logger.info("the checkpoint's activation scales (input_scale) are not applied: FP8 and int8 W8A8 "
                        "products quantise activations per token, packed int products to int8 per 32 values, "
                        "float products keep them in --dtype")
        bits = weights["num_bits"]
        if weights["type"] == "float":
            return self._float8(layer, parts, weights, where, keep_packed)
        if keep_packed and self._int8_w8a8(group_name, weights, fmt, parts):
            return self._int8_weight(layer, group_name, parts, weights, where), "int8 W8A8 kept"
        values, signed_zero = self._integers(parts, weights, fmt, where)
        out, cols = values.shape
        scale, groups = self._scales_by_input(parts, weights, out, cols, where)
        grid_zero = 1 << (bits - 1)
        zero = (signed_zero if signed_zero is not None else torch.zeros(scale.shape, dtype=torch.int32)) + grid_zero
        if zero.numel() == 1:
            zero = zero.reshape(1, 1).expand(scale.shape)
        if zero.shape != scale.shape:
            raise ValueError(f"{where}: {layer}.weight_zero_point unpacks to {list(zero.shape)}, its scales are "
                             f"{list(scale.shape)}")
        u = values + grid_zero  # [out, in], 0 .. 2^bits - 1
        packed = packed_when_in_runs(u, zero, scale, groups, bits) if keep_packed else None
        if packed is not None:
            return packed, f"{packed.format} packed"
        weight = (u - zero[:, groups]).float() * scale[:, groups]
        return weight, "int dequantised" if not keep_packed else f"int dequantised (groups not in runs of {BLOCK})"

    @staticmethod
    def _float8(layer: str, parts: dict[str, torch.Tensor], weights: dict[str, Any], where: str,
                keep_packed: bool) -> tuple[LoadedWeight, str]:
        """An FP8 layer kept as an `W8A8Weight` (`keep_packed`, scales per tensor, channel, or 32/64/128
        columns), else its float32 weight [out, in]."""
        values = _part(parts, "weight", where)
        if values.dtype != torch.float8_e4m3fn:
            raise ValueError(f"{where}: {layer}.weight is {values.dtype}, the scheme stores float8_e4m3fn")
        out, cols = values.shape
        raw = _part(parts, "weight_scale", where)
        scale = _expanded_scale(raw.float(), weights, out, cols, where)  # checks the shape against the strategy
        block = _fp8_block(weights)
        if keep_packed and (block is None or block[1] in w8a8.BLOCK_WIDTHS):
            return w8a8.from_checkpoint(values, raw, block, where), "fp8 kept"
        how = "fp8 dequantised to floats" if not keep_packed else f"fp8 dequantised (scales per {block[1]} columns)"
        return values.float() * scale, how

    def _int8_w8a8(self, group_name: str, weights: dict[str, Any], fmt: str, parts: dict[str, torch.Tensor]
                   ) -> bool:
        """Whether a layer of this scheme is kept as an int8 `W8A8Weight`: int8 values stored as they are,
        per channel or tensor, with int8 input activations, no non-zero zero point (asymmetric weights stay
        packed int8 `QuantizedWeight`s, which hold zero points exactly), whole 32-column blocks (so the CPU's
        packed int8 form holds it exactly)."""
        activations = self.activations.get(group_name) or {}
        weight = parts.get("weight")
        zero = parts.get("weight_zero_point")
        return (fmt in ("int-quantized", "naive-quantized") and weights["num_bits"] == 8
                and weights["strategy"] in ("channel", "tensor") and activations.get("type") == "int"
                and activations.get("num_bits") == 8 and weight is not None and weight.dim() == 2
                and weight.shape[1] % BLOCK == 0 and (zero is None or not bool(zero.ne(0).any())))

    def _int8_weight(self, layer: str, group_name: str, parts: dict[str, torch.Tensor], weights: dict[str, Any],
                     where: str) -> w8a8.W8A8Weight:
        """The layer as an int8 `W8A8Weight` (all-zero zero points dropped: they change nothing)."""
        activations = self.activations[group_name]
        if not self._activations_logged and (activations.get("strategy") != "token" or not activations.get("dynamic")
                                             or activations.get("symmetric") is False):
            self._activations_logged = True
            logger.info("int8 W8A8 activations are quantised dynamically per token, symmetric (the checkpoint's "
                        "scheme: %s per %s, %s)", "dynamic" if activations.get("dynamic") else "static",
                        activations.get("strategy"),
                        "asymmetric" if activations.get("symmetric") is False else "symmetric")
        values = _part(parts, "weight", where)
        if values.dtype != torch.int8:
            raise ValueError(f"{where}: {layer}.weight is {values.dtype}, the scheme stores int8")
        raw = _part(parts, "weight_scale", where)
        _expanded_scale(raw.float(), weights, values.shape[0], values.shape[1], where)  # checks the shape
        return w8a8.from_checkpoint(values, raw, None, where, parts.get("weight_zero_point"))

    def _integers(self, parts: dict[str, torch.Tensor], weights: dict[str, Any], fmt: str, where: str
                  ) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The signed integer weight [out, in] (int32) and the signed zero points (None: symmetric)."""
        bits = weights["num_bits"]
        zero = parts.get("weight_zero_point")
        if fmt != "pack-quantized":
            values = _part(parts, "weight", where)
            if values.dtype != torch.int8:
                raise ValueError(f"{where}: its weight is {values.dtype}, the scheme stores int8")
            return values.to(torch.int32), None if zero is None else zero.to(torch.int32)
        packed, shape = _part(parts, "weight_packed", where), _part(parts, "weight_shape", where)
        if packed.dtype != torch.int32 or shape.numel() != 2:
            raise ValueError(f"{where}: weight_packed must be int32 and weight_shape two numbers; got "
                             f"{packed.dtype} {list(packed.shape)} and {shape.tolist()}")
        out, cols = (int(v) for v in shape.tolist())
        if packed.shape[0] != out or packed.shape[1] != -(-cols * bits // 32):
            raise ValueError(f"{where}: weight_packed is {list(packed.shape)}, but weight_shape {[out, cols]} at "
                             f"{bits} bits packs to {[out, -(-cols * bits // 32)]}")
        values = unpack_cols(packed, bits)[:, :cols] - (1 << (bits - 1))
        if zero is not None and zero.dtype == torch.int32:  # packed along the output rows
            zero = unpack_rows(zero, bits)[:out] - (1 << (bits - 1))
        return values, None if zero is None else zero.to(torch.int32)

    @staticmethod
    def _scales_by_input(parts: dict[str, torch.Tensor], weights: dict[str, Any], out: int, cols: int,
                         where: str) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 scales [out, groups] and each input's group [in], checked against the strategy."""
        scale = _part(parts, "weight_scale", where).float()
        strategy = weights["strategy"]
        if strategy == "tensor":
            if scale.numel() != 1:
                raise ValueError(f"{where}: a per-tensor weight_scale must hold one value, it is {list(scale.shape)}")
            return scale.reshape(1, 1).expand(out, 1), torch.zeros(cols, dtype=torch.long)
        if strategy == "channel":
            expected = [out, 1]
        else:
            size = weights.get("group_size")
            if not isinstance(size, int) or size < 1 or cols % size:
                raise ValueError(f"{where}: group_size {size!r} does not divide the {cols} input features")
            expected = [out, cols // size]
        if list(scale.shape) != expected:
            raise ValueError(f"{where}: weight_scale is {list(scale.shape)}; the {strategy} strategy over a "
                             f"[{out}, {cols}] weight needs {expected}")
        if strategy == "channel":
            return scale, torch.zeros(cols, dtype=torch.long)
        g_idx = parts.get("weight_g_idx")
        if g_idx is None:
            return scale, torch.arange(cols) // weights["group_size"]
        g_idx = g_idx.long()
        if g_idx.numel() != cols or int(g_idx.min()) < 0 or int(g_idx.max()) >= expected[1]:
            raise ValueError(f"{where}: weight_g_idx must give each of the {cols} inputs a group below "
                             f"{expected[1]}")
        return scale, g_idx


def _expanded_scale(scale: torch.Tensor, weights: dict[str, Any], out: int, cols: int, where: str) -> torch.Tensor:
    """The scale of every weight [out, in] (or [1, 1] for one per tensor), from any strategy's scales."""
    strategy = weights["strategy"]
    if strategy == "tensor" and scale.numel() == 1:
        return scale.reshape(1, 1)
    if strategy == "channel" and list(scale.shape) == [out, 1]:
        return scale
    if strategy == "group":
        size = weights.get("group_size")
        if isinstance(size, int) and size > 0 and list(scale.shape) == [out, -(-cols // size)]:
            return scale.repeat_interleave(size, 1)[:, :cols]
    if strategy == "block":
        rows, width = weights.get("block_structure") or (None, None)
        if isinstance(rows, int) and isinstance(width, int) and list(scale.shape) == [-(-out // rows),
                                                                                     -(-cols // width)]:
            return scale.repeat_interleave(rows, 0)[:out].repeat_interleave(width, 1)[:, :cols]
    raise ValueError(f"{where}: weight_scale is {list(scale.shape)}, which the {strategy} strategy over a "
                     f"[{out}, {cols}] weight does not give")


def _fp8_block(weights: dict[str, Any]) -> Optional[tuple[int, int]]:
    """(rows, columns) per scale of an FP8 scheme's group or block strategy, None for tensor and channel
    (whose scale shapes `_expanded_scale` has checked)."""
    if weights["strategy"] == "group":
        return 1, weights["group_size"]
    if weights["strategy"] == "block":
        rows, cols = weights["block_structure"]
        return rows, cols
    return None


def _part(parts: dict[str, torch.Tensor], name: str, where: str) -> torch.Tensor:
    if name not in parts:
        raise ValueError(f"{where}: the layer has no {name} tensor")
    return parts[name]


def _matches(layer: str, target: str) -> bool:
    """compressed-tensors' name matching: "re:" and a regex matched from the start, else the exact name
    (here also without the checkpoint's leading "model.")."""
    if target.startswith("re:"):
        return re.match(target[3:], layer) is not None
    return target in (layer, layer.removeprefix("model."))


def _brief(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 120 else text[:117] + "..."
