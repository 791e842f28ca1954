"""Element-wise functions whose result for an element does not depend on the tensor's size.

PyTorch's CPU loops compute a contiguous tensor's elements in vector chunks and its last few (fewer than a chunk)
with the scalar function, and for sigmoid, silu and softplus the two differ in the last bit on AVX2 (measured on
an AMD EPYC: up to a few elements in a hundred calls): an element's bits then depended on where it sat in the
step's tensor, so on the batch and the chunking. `elementwise` pads the flattened tensor to whole chunks, so every
element takes the vector path.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

# a multiple of every CPU vector loop's chunk (2 vectors of 16 floats at AVX-512, of 8 at AVX2)
_CHUNK = 64


def elementwise(function: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """`function(x)` (an element-wise function) computed so that each element's bits are the same whatever x's size
    and whatever else it holds."""
    flat = x.reshape(-1)
    pad = (-flat.numel()) % _CHUNK
    if x.device.type != "cpu" or not pad:
        return function(x.contiguous()) if x.device.type == "cpu" else function(x)
    return function(F.pad(flat, (0, pad)))[:flat.numel()].view(x.shape)
