"""Images as the engine carries them inside a request (no torch): where each one's placeholder tokens lie in
the prompt, what identifies its content, and the model's processed inputs for it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional, Sequence


@dataclass(frozen=True)
class ImageFeature:
    """One image of a prompt. Its embeddings replace prompt tokens offset .. offset+length-1 (all of them
    its placeholder token). `content_hash` identifies its pixels (multimodal/media.py's pixel hash): the
    prefix cache keys the blocks that hold its positions by it, and the encoder cache keeps its embeddings
    under it. `inputs` are the image processor's tensors for it, which the vision encoder reads (opaque
    here: the scheduler and KV manager never look inside)."""

    offset: int
    length: int
    content_hash: str
    inputs: Any = field(compare=False, repr=False)
    grid: Optional[tuple[int, int, int]] = None  # M-RoPE models: its positions' (t, h, w) grid, row-major

    @property
    def end(self) -> int:
        """One past its last placeholder position."""
        return self.offset + self.length


def overlapping(features: Sequence[ImageFeature], start: int, end: int) -> list[ImageFeature]:
    """The images with a placeholder position in [start, end)."""
    return [f for f in features if f.offset < end and start < f.end]


def image_keys(features: Sequence[ImageFeature], start: int, end: int) -> tuple[str, ...]:
    """The content hashes of the images whose placeholders lie (partly) in tokens [start, end), in prompt
    order: what a block covering those tokens adds to its key, so that the same tokens with another image
    never share its KV."""
    return tuple(f.content_hash for f in overlapping(features, start, end))
