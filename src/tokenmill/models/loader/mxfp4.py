"""MXFP4 checkpoints (`quantization_config.quant_method: mxfp4`, how GPT-OSS ships its experts), dequantised to
floats as they load.

A quantised tensor `X` is stored as two: `X_blocks` uint8 [..., rows, groups, 16], each byte two e2m1 (FP4)
values of a group of 32 along the last dimension (the low nibble first), and `X_scales` uint8 [..., rows, groups],
one e8m0 exponent per group: value = e2m1 * 2^(scale - 127). For GPT-OSS's experts the rows are the output
features (`gate_up_proj_blocks` [E, 2 * inter, hidden / 32, 16]), while the float checkpoint's `gate_up_proj` is
[E, hidden, 2 * inter]: the dequantised tensor is handed on transposed (the last two dimensions), under the float
name, so the model reads either checkpoint alike. transformers' integrations/mxfp4.py is the reference.
"""

from __future__ import annotations

from typing import Any, Callable, Iterator

import torch

# e2m1: sign, two exponent bits, one mantissa bit; code -> value
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_BLOCKS, _SCALES = "_blocks", "_scales"


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 [..., rows, groups * 32] of MXFP4 `blocks` uint8 [..., rows, groups, 16] and `scales` uint8
    [..., rows, groups] (module docstring); ValueError when their shapes do not pair."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if blocks.dim() < 2 or blocks.shape[-1] != 16 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not pair: blocks "
                         "are [..., groups, 16] bytes, scales [..., groups]")
    table = torch.tensor(E2M1_VALUES, dtype=torch.float32)
    low, high = table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]
    values = torch.stack((low, high), dim=-1).flatten(-2)  # [..., groups, 32], low nibble first
    values = torch.ldexp(values, scales.to(torch.int32).unsqueeze(-1) - 127)
    return values.flatten(-2)


def mxfp4_names(names: set[str]) -> set[str]:
    """The tensor names a model sees: each `X_blocks` / `X_scales` pair becomes `X`."""
    return {name[:-len(_BLOCKS)] if name.endswith(_BLOCKS) else name for name in names
            if not name.endswith(_SCALES)}


def dequantized_mxfp4_stream(stream: Callable[[set[str]], Iterator[tuple[str, Any]]], names: set[str]
                             ) -> Callable[[bool], Iterator[tuple[str, Any]]]:
    """A weight stream over `names` (the stored ones) that yields every `X_blocks` / `X_scales` pair, once both
    have arrived, as float32 `X` with its last two dimensions swapped (module docstring), and the other tensors as
    they are. A pair missing its partner raises ValueError naming it."""
    def weights(keep_quantized: bool = False) -> Iterator[tuple[str, Any]]:
        waiting: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in stream(names):
            suffix = _BLOCKS if name.endswith(_BLOCKS) else _SCALES if name.endswith(_SCALES) else None
            if suffix is None:
                yield name, tensor
                continue
            base = name[:-len(suffix)]
            parts = waiting.setdefault(base, {})
            parts[suffix] = tensor
            if len(parts) == 2:
                del waiting[base]
                yield base, dequantize_mxfp4(parts[_BLOCKS], parts[_SCALES]).transpose(-1, -2)
        if waiting:
            base, parts = next(iter(waiting.items()))
            missing = _SCALES if _BLOCKS in parts else _BLOCKS
            raise ValueError(f"MXFP4 tensor {base!r} has no {base + missing!r}")
    return weights
