"""Multimodal RoPE positions (Qwen2-VL's M-RoPE) of a step's tokens, from each request's images (no torch).

A text token's three components are equal: its index in the sequence plus the shift that the images before it
left. An image's positions start where the text left off, at its first placeholder's index plus that shift,
and run over its (t, h, w) grid: component c of the placeholder at grid index (ti, hi, wi) is the start plus
ti, hi or wi. An image of L placeholders spans max(h, w) positions, so the text after it is shifted by
max(h, w) - L (transformers' get_rope_index for images).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.worker.request_state import BatchItem


def mrope_positions(batch: list[BatchItem], positions: np.ndarray) -> np.ndarray:
    """The step's positions: [T] (`positions` shifted past each request's images) when no token of the step is
    an image placeholder, else [3, T] (int64)."""
    rows = np.tile(positions, (3, 1))
    offset, images_in_step = 0, False
    for item in batch:
        if item.images:
            images_in_step |= place_images(rows[:, offset:offset + item.num_tokens], item.start, item.images)
        offset += item.num_tokens
    return rows if images_in_step else rows[0].copy()


def place_images(rows: np.ndarray, start: int, images: Sequence[ImageFeature]) -> bool:
    """Turn `rows` [3, n] (each the token indices start .. start+n-1) into the M-RoPE positions of those
    tokens, in place; whether any of them is an image placeholder."""
    end = start + rows.shape[1]
    shift, touched = 0, False
    for image in images:
        t, h, w = image.grid
        first, last = max(start, image.offset), min(end, image.end)
        if first < last:
            index = np.arange(first, last) - image.offset
            base = image.offset + shift
            rows[0, first - start:last - start] = base + index // (h * w)
            rows[1, first - start:last - start] = base + (index // w) % h
            rows[2, first - start:last - start] = base + index % w
            touched = True
        step = max(h, w) - image.length
        shift += step
        if image.end < end:
            rows[:, max(image.end, start) - start:] += step
    return touched
