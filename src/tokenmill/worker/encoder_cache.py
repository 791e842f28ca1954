"""Images' embeddings in the runner: computed by the model's vision encoder when a chunk first needs them,
kept by content hash so that the rest of a chunked image and the same image in other requests reuse them,
and laid into the step's input rows; prompts given as embeddings are laid in the same way."""

from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Optional

import torch

from tokenmill.multimodal.inputs import ImageFeature, overlapping
from tokenmill.worker.request_state import BatchItem


class EncoderCache:
    """Embeddings [length, hidden] by image content hash, least recently used dropped first once they hold more
    than `capacity` positions. An entry a step uses is never dropped in that step.

    Invariant: an image's embeddings depend on its pixels only (each image is encoded alone, in a batch of
    one), so a hit gives the very values a fresh encoding would."""

    def __init__(self, vision: Any, device: torch.device, capacity: int) -> None:
        self.vision, self.device, self.capacity = vision, device, capacity
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self._held = 0
        self.images_encoded = 0  # totals since start, for the metrics
        self.encode_seconds = 0.0

    def embeddings(self, image: ImageFeature) -> torch.Tensor:
        """The image's embeddings, encoded now unless cached; a prompt given as embeddings brings its own
        (engine/prompt_embeds.py: its `inputs` are the tensor), not cached here."""
        if isinstance(image.inputs, torch.Tensor):
            return image.inputs.to(self.device)
        found = self._entries.get(image.content_hash)
        if found is not None:
            self._entries.move_to_end(image.content_hash)
            return found
        started = time.perf_counter()
        inputs = {name: value.to(self.device) for name, value in image.inputs.items()}
        embeds = self.vision.encode(inputs)
        if embeds.shape[0] != image.length:
            raise ValueError(f"the vision encoder gave {embeds.shape[0]} embeddings for an image with "
                             f"{image.length} placeholder tokens")
        self.encode_seconds += time.perf_counter() - started
        self.images_encoded += 1
        self._entries[image.content_hash] = embeds
        self._held += image.length
        return embeds

    def step_rows(self, batch: list[BatchItem]
                  ) -> tuple[Optional[tuple[torch.Tensor, torch.Tensor]], dict[str, Exception]]:
        """(rows of the flat batch, their embeddings) for every placeholder position the step computes (None
        when it computes none), and the requests whose image the encoder failed on, with why: their rows keep
        their placeholder tokens' embeddings, and the caller fails them; the others are unaffected."""
        rows, parts = [], []
        used: set[str] = set()
        failures: dict[str, Exception] = {}
        query_start = 0
        for item in batch:
            end = item.start + item.num_tokens
            for image in overlapping(item.images, item.start, end):
                first, last = max(image.offset, item.start), min(image.end, end)
                try:
                    embeds = self.embeddings(image)
                except Exception as exc:  # this image's own failure (its inputs, memory): its request ends
                    failures[item.request_id] = exc
                    continue
                parts.append(embeds[first - image.offset:last - image.offset])
                rows.append(torch.arange(query_start + first - item.start, query_start + last - item.start))
                used.add(image.content_hash)
            query_start += item.num_tokens
        self._evict(used)
        if not parts:
            return None, failures
        return (torch.cat(rows).to(self.device), torch.cat(parts)), failures

    def _evict(self, keep: set[str]) -> None:
        for digest in list(self._entries):
            if self._held <= self.capacity:
                return
            if digest not in keep:
                self._held -= self._entries.pop(digest).shape[0]
