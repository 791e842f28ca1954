"""The images of a chat conversation: counted, and refused for a text-only model, before any work is done
for the request; loaded and checked, off the event loop, for a model that reads them.

Every API's images arrive here as chat `image_url` parts: Responses' input_image parts and Messages' image
blocks are translated into them (serving_responses.chat_messages, serving_messages._conversation).
"""

from __future__ import annotations

import asyncio
from typing import NamedTuple

from tokenmill.multimodal.media import ImageInput, MediaPolicy, check_count, load_image
from tokenmill.server.protocol import ChatMessage, ImagePart
from tokenmill.server.serving_common import APIError


class ImageAt(NamedTuple):
    """An image part's URL, and where in the request it is ('messages.1.content.0')."""

    where: str
    url: str


def conversation_images(messages: list[ChatMessage]) -> list[ImageAt]:
    """The image parts of `messages`, in order."""
    found = []
    for index, message in enumerate(messages):
        if isinstance(message.content, list):
            found += [ImageAt(f"messages.{index}.content.{part}", item.image_url.url)
                      for part, item in enumerate(message.content) if isinstance(item, ImagePart)]
    return found


def check_conversation_images(messages: list[ChatMessage], policy: MediaPolicy, model_name: str,
                              accepts_images: bool) -> int:
    """How many images `messages` hold; APIError 400 when they are more than the policy takes, or any when
    the model is text-only (`accepts_images` false). Reads no image."""
    count = sum(len(message.image_urls()) for message in messages)
    try:
        check_count(count, policy)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    if count and not accepts_images:
        raise APIError(400, f"the model '{model_name}' takes no images: it is a text-only model (serve a "
                            "vision-language model for image inputs)", param="messages")
    return count


async def load_conversation_images(messages: list[ChatMessage], policy: MediaPolicy) -> list[ImageInput]:
    """The images of `messages`, in order, each read and decoded in a worker thread (one at a time, so a
    request holds at most one thread); APIError 400 naming the part ('messages.2.content.1: ...') of the
    first that the policy refuses or that is not a valid image, or when they are too many."""
    images = conversation_images(messages)
    try:
        check_count(len(images), policy)
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from None
    loaded = []
    for image in images:
        try:
            loaded.append(await asyncio.to_thread(load_image, image.url, policy))
        except ValueError as exc:
            raise APIError(400, f"'{image.where}': {exc}", param="messages") from None
    return loaded
