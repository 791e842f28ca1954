"""A vision-language model's prompts with images: each image preprocessed by the model's own HF image processor
and its placeholder token expanded to the run of positions its embeddings fill."""

from __future__ import annotations

from typing import Any, Sequence, Union

from PIL import Image

from tokenmill.models.vision.config import VisionConfig
from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.media import ImageInput, image_input

ImageLike = Union[ImageInput, Image.Image]


class ImageProcessing:
    """Turns (prompt token ids, images) into the engine's prompt and `ImageFeature`s. The prompt names where
    each image goes with one `image_token_id` per image (as the model's chat template writes it); each
    becomes as many of them as the image has positions (`VisionConfig.placeholders`). Thread-safe: the HF
    processor keeps no state between calls."""

    def __init__(self, folder: str, vision: VisionConfig) -> None:
        import transformers

        verbosity = transformers.logging.get_verbosity()
        transformers.logging.set_verbosity_error()  # its note that torchvision is absent (the Pil class runs)
        try:
            self.processor = transformers.AutoImageProcessor.from_pretrained(folder)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{folder}: the vision-language model's image processor cannot be loaded: {exc}") from exc
        finally:
            transformers.logging.set_verbosity(verbosity)
        self.vision = vision

    @property
    def image_token_id(self) -> int:
        """The token that marks an image's place in a prompt."""
        return self.vision.image_token_id

    def prepare(self, prompt_token_ids: Sequence[int], images: Sequence[ImageLike]
                ) -> tuple[list[int], tuple[ImageFeature, ...]]:
        """The prompt with each image's placeholder expanded, and the images' features in prompt order;
        ValueError when the prompt's placeholders and the images do not pair up."""
        marker = self.image_token_id
        places = [i for i, token in enumerate(prompt_token_ids) if token == marker]
        if len(places) != len(images):
            raise ValueError(f"the prompt has {len(places)} image placeholder(s) (token {marker}) but "
                             f"{len(images)} image(s) came with it: write one placeholder per image")
        ids: list[int] = []
        features = []
        previous = 0
        for place, image in zip(places, images):
            decoded = image if isinstance(image, ImageInput) else image_input(image)
            inputs = self.pixels(decoded)
            length, grid = self.vision.placeholders(inputs)
            ids.extend(prompt_token_ids[previous:place])
            features.append(ImageFeature(len(ids), length, decoded.content_hash, inputs, grid))
            ids.extend([marker] * length)
            previous = place + 1
        ids.extend(prompt_token_ids[previous:])
        return ids, tuple(features)

    def check_prepared(self, prompt_token_ids: Sequence[int], features: Sequence[ImageFeature]
                       ) -> tuple[ImageFeature, ...]:
        """`features` as `prepare` made them with `prompt_token_ids`: in order, each over a run of placeholder
        tokens, and every placeholder covered; ValueError otherwise."""
        marker, covered = self.image_token_id, 0
        for feature in features:
            run = prompt_token_ids[feature.offset:feature.end]
            if feature.offset < covered or len(run) != feature.length or any(token != marker for token in run):
                raise ValueError(f"image features do not match the prompt: expected a run of placeholder tokens "
                                 f"{marker} for each, in order")
            covered = feature.end
        if sum(f.length for f in features) != sum(1 for token in prompt_token_ids if token == marker):
            raise ValueError("the prompt has image placeholders that no image fills")
        return tuple(features)

    def pixels(self, image: ImageInput) -> dict[str, Any]:
        """The image processor's tensors for one image (its batch dimension dropped; a dynamic-resolution
        processor's patches [patches, values] and their grid (t, h, w))."""
        out = self.processor(images=[image.image], return_tensors="pt")
        if "image_grid_thw" in out:  # dynamic resolution: the image's patches, and their grid
            return {"pixel_values": out["pixel_values"], "image_grid_thw": out["image_grid_thw"][0]}
        return {"pixel_values": out["pixel_values"][0]}
