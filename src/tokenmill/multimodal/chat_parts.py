"""The images of an offline chat conversation (`LLM.chat`), taken out of its messages in order (no torch).

A message's content list may hold, as vLLM's `LLM.chat` takes them, `{"type": "image_url", "image_url": {"url":
...}}` parts (data URLs; files and the web only as the media policy allows), `{"type": "image_pil",
"image_pil": <PIL.Image>}` parts and transformers' `{"type": "image", "image": <PIL.Image>}`. Each becomes
`{"type": "image"}` for the chat template, which writes the model's placeholder where it was.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from tokenmill.multimodal.media import ImageInput, MediaPolicy, check_count, image_input, load_image


def messages_and_images(messages: list[dict[str, Any]], policy: MediaPolicy
                        ) -> tuple[list[dict[str, Any]], list[ImageInput]]:
    """The messages as the chat template takes them, and their images in order; ValueError naming the part
    ('messages[1].content[0]: ...') that is not an image the policy lets through."""
    rendered, images = [], []
    for index, message in enumerate(messages):
        content = message.get("content")
        if not isinstance(content, list):
            rendered.append(message)
            continue
        parts = []
        for number, part in enumerate(content):
            image = _image_of(part, policy, f"messages[{index}].content[{number}]")
            if image is None:
                parts.append(part)
            else:
                images.append(image)
                parts.append({"type": "image"})
        rendered.append({**message, "content": parts})
    check_count(len(images), policy)
    return rendered, images


def _image_of(part: Any, policy: MediaPolicy, where: str) -> ImageInput | None:
    kind = part.get("type") if isinstance(part, dict) else None
    try:
        if kind == "image_url":
            url = part.get("image_url")
            return load_image(url.get("url") if isinstance(url, dict) else url, policy)
        if kind == "image_pil" or (kind == "image" and isinstance(part.get("image"), Image.Image)):
            return image_input(part.get("image_pil", part.get("image")))
    except (ValueError, TypeError, AttributeError) as exc:
        raise ValueError(f"{where}: {exc}") from None
    return None
