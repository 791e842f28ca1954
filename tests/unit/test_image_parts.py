"""Image parts in the request bodies of chat, Responses and Messages: they parse, the translations carry them
into chat `image_url` parts, and a text-only model refuses them with a 400 before any work is done for the
request (server/chat_images.py)."""

from __future__ import annotations

import asyncio
import base64
import io
from types import SimpleNamespace

import pytest
from PIL import Image
from pydantic import ValidationError

from tokenmill.multimodal.inputs import ImageFeature
from tokenmill.multimodal.media import MediaPolicy
from tokenmill.server.chat_images import (
    check_conversation_images, conversation_images, load_conversation_images)
from tokenmill.server.messages_protocol import MessagesRequest
from tokenmill.server.protocol import ChatCompletionRequest, ChatMessage
from tokenmill.server.response_store import ResponseStore
from tokenmill.server.responses_protocol import ResponsesRequest
from tokenmill.server.serving_chat import ChatHandler
from tokenmill.server.serving_common import APIError
from tokenmill.server.serving_messages import MessagesHandler
from tokenmill.server.serving_responses import ResponsesHandler, chat_messages

REFUSAL = ("the model 'tiny' takes no images: it is a text-only model (serve a vision-language model for image "
           "inputs)")


def png_url(colour: tuple[int, int, int] = (200, 10, 10), size: tuple[int, int] = (3, 2)) -> str:
    buffer = io.BytesIO()
    Image.new("RGB", size, colour).save(buffer, "PNG")
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()


PNG = png_url()
PNG_DATA = PNG.split(",", 1)[1]


def image_part(url: str = PNG, **extra: str) -> dict:
    return {"type": "image_url", "image_url": {"url": url, **extra}}


def chat_body(*messages: dict, **fields) -> ChatCompletionRequest:
    return ChatCompletionRequest(model="tiny", messages=list(messages), **fields)


def looking(count: int = 1) -> dict:
    return {"role": "user", "content": [{"type": "text", "text": "What is this?"}] + [image_part()] * count}


def test_chat_image_parts_parse_and_text_keeps_working():
    body = chat_body({"role": "system", "content": "Be brief."},
                     {"role": "user", "content": [{"type": "text", "text": "Look: "}, image_part(detail="low"),
                                                  {"type": "text", "text": " and "},
                                                  image_part("https://example.com/b.png", detail="high")]})
    system, user = body.messages
    assert user.text() == "Look:  and " and system.text() == "Be brief." and system.image_urls() == []
    assert user.image_urls() == [PNG, "https://example.com/b.png"]
    assert user.content[1].image_url.detail == "low"
    assert ChatMessage(role="user", content=[{"type": "text", "text": "hi"}]).text() == "hi"
    assert [(at.where, at.url) for at in conversation_images(body.messages)] == [
        ("messages.1.content.1", PNG), ("messages.1.content.3", "https://example.com/b.png")]


@pytest.mark.parametrize("message, says", [
    ({"role": "user", "content": [image_part(detail="medium")]}, "detail"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": PNG}]}, "image_url"),
    ({"role": "user", "content": [{"type": "image_url", "image_url": {"url": PNG, "size": 3}}]}, "size"),
    ({"role": "user", "content": [{"type": "input_image", "image_url": PNG}]}, "input_image"),
    ({"role": "assistant", "content": [image_part()]}, "user and tool messages only, not in assistant"),
    ({"role": "system", "content": [image_part()]}, "not in system"),
])
def test_bad_image_parts_are_refused_naming_the_problem(message, says):
    with pytest.raises(ValidationError, match=says):
        chat_body(message)


def test_responses_input_images_parse_and_translate_into_chat_parts():
    body = ResponsesRequest(model="tiny", input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Compare "},
                                     {"type": "input_image", "image_url": PNG, "detail": "auto"},
                                     {"type": "input_image", "image_url": "https://example.com/b.png"}]},
        {"type": "function_call", "call_id": "c1", "name": "snap", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1",
         "output": [{"type": "input_image", "image_url": PNG}]},
        {"role": "user", "content": [{"type": "input_text", "text": "plain"}]}])
    messages = chat_messages(body.input)
    assert messages[0] == {"role": "user", "content": [
        {"type": "text", "text": "Compare "}, {"type": "image_url", "image_url": {"url": PNG, "detail": "auto"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}]}
    assert messages[2] == {"role": "tool", "tool_call_id": "c1",
                           "content": [{"type": "image_url", "image_url": {"url": PNG}}]}
    assert messages[3] == {"role": "user", "content": "plain"}  # text-only content stays a string
    chat = ResponsesHandler.chat_request(body, messages)
    assert [m.image_urls() for m in chat.messages] == [[PNG, "https://example.com/b.png"], [], [PNG], []]
    assert chat.messages[0].text() == "Compare "


@pytest.mark.parametrize("part, says", [
    ({"type": "input_image", "file_id": "file-1"}, "file_id is not supported"),
    ({"type": "input_image"}, "needs an image_url"),
    ({"type": "input_image", "image_url": PNG, "detail": "medium"}, "detail"),
    ({"type": "input_file", "file_id": "file-1"}, "file inputs (input_file) are not supported"),
    ({"type": "input_audio", "input_audio": {}}, "audio inputs (input_audio) are not supported"),
])
def test_responses_refuse_what_they_cannot_read(part, says):
    with pytest.raises(ValidationError, match=rf"'input\.0\.content\.0.*{says.replace('(', '.').replace(')', '.')}"):
        ResponsesRequest(model="tiny", input=[{"role": "user", "content": [part]}])


def test_messages_image_blocks_parse_and_translate_into_chat_parts():
    body = MessagesRequest(model="tiny", max_tokens=5, messages=[
        {"role": "user", "content": [
            {"type": "text", "text": "What is in "},
            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_DATA}},
            {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"},
             "cache_control": {"type": "ephemeral"}}]},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "snap", "input": {}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "t1", "content": [
                {"type": "text", "text": "here"},
                {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG_DATA}}]},
            {"type": "text", "text": "And this?"}]}])
    chat = MessagesHandler(None, {}).chat_request(body)
    user, assistant, tool, follow_up = chat.messages
    assert user.model_dump(exclude_none=True)["content"] == [
        {"type": "text", "text": "What is in "}, {"type": "image_url", "image_url": {"url": PNG}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}}]
    assert user.image_urls() == [PNG, "https://example.com/b.png"]
    assert tool.role == "tool" and tool.text() == "here" and tool.image_urls() == [PNG]
    assert follow_up.content == "And this?" and assistant.tool_calls[0].function.name == "snap"


@pytest.mark.parametrize("block, says", [
    ({"type": "image", "source": {"type": "base64", "media_type": "image/svg+xml", "data": "PHN2Zy8+"}},
     "media_type"),
    ({"type": "image", "source": {"type": "file", "file_id": "f"}}, "file"),
    ({"type": "image"}, "source"),
])
def test_messages_image_blocks_are_checked(block, says):
    with pytest.raises(ValidationError, match=says):
        MessagesRequest(model="tiny", max_tokens=5, messages=[{"role": "user", "content": [block]}])


def test_messages_refuse_documents_and_images_in_assistant_turns():
    handler = MessagesHandler(None, {})
    document = {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"}}
    image = {"type": "image", "source": {"type": "url", "url": "https://example.com/b.png"}}
    for role, block, says in (("user", document, "document blocks are not supported by this server"),
                              ("assistant", image, "image blocks are taken in user turns and tool results only")):
        body = MessagesRequest(model="tiny", max_tokens=5, messages=[{"role": role, "content": [block]}])
        with pytest.raises(APIError, match=says) as refused:
            handler.chat_request(body)
        assert refused.value.status == 400 and refused.value.param == "messages"


def test_a_text_only_model_refuses_images_and_counts_them_first():
    policy = MediaPolicy()
    assert check_conversation_images(chat_body(looking(0)).messages, policy, "tiny", False) == 0
    with pytest.raises(APIError) as refused:
        check_conversation_images(chat_body(looking()).messages, policy, "tiny", False)
    assert (refused.value.status, refused.value.message, refused.value.param) == (400, REFUSAL, "messages")
    with pytest.raises(APIError, match=r"9 images in one prompt; this server takes at most 8 \(--limit-mm-per-prompt\)"):
        check_conversation_images(chat_body(looking(9)).messages, policy, "tiny", False)
    assert check_conversation_images(chat_body(looking(8)).messages, policy, "tiny", True) == 8


class _FakeEngine:
    """Just enough engine for ChatHandler.start: whether the model reads images, and a record of what ran."""

    def __init__(self, accepts_images: bool) -> None:
        self.info = SimpleNamespace(accepts_images=accepts_images)
        self.reserved, self.released, self.generated = 0, 0, []

    def reserve(self, n: int) -> SimpleNamespace:
        self.reserved += 1
        return SimpleNamespace(release=self._release)

    def _release(self) -> None:
        self.released += 1

    def prepare_images(self, token_ids, images):
        """Features that carry each decoded image's size, over no placeholders (the prompt is fixed)."""
        return token_ids, tuple(ImageFeature(0, 0, image.content_hash, {"size": (image.width, image.height)})
                                for image in images)

    def generate(self, request_id, token_ids, params, prompt, priority, images=()):
        self.generated.append(token_ids)
        return iter(())


class _Handler(ChatHandler):
    """A ChatHandler whose prompt is fixed (no tokenizer), once the image check passes."""

    def prompt(self, messages, add_generation_prompt=True, tools=None, template_kwargs=None):
        self.check_images(messages)
        return "prompt", [1, 2, 3]


def test_chat_start_refuses_images_before_admission_on_a_text_only_model():
    engine = _FakeEngine(accepts_images=False)
    handler = _Handler(engine, "tiny", None)
    for body in (chat_body(looking()), chat_body(looking(), use_beam_search=True, n=1)):
        with pytest.raises(APIError) as refused:
            asyncio.run(handler.complete(body))
        assert (refused.value.status, refused.value.message) == (400, REFUSAL)
    with pytest.raises(APIError, match="takes no images"):
        ChatHandler(engine, "tiny", "{{ messages }}").prompt(chat_body(looking()).messages)
    assert engine.reserved == 0
    asyncio.run(handler.start(chat_body(looking(0))))  # text only: admitted as before
    assert engine.reserved == engine.released + 1 == 1


def test_responses_keep_their_param_names_for_the_refusal():
    handler = ResponsesHandler(_Handler(_FakeEngine(accepts_images=False), "tiny", None), ResponseStore(4))
    body = ResponsesRequest(model="tiny", input=[{"role": "user", "content": [
        {"type": "input_image", "image_url": PNG}]}])
    with pytest.raises(APIError) as refused:
        asyncio.run(handler.complete(body))
    assert (refused.value.message, refused.value.param) == (REFUSAL, "input")


def test_a_model_that_reads_images_gets_them_loaded_under_its_ticket():
    engine = _FakeEngine(accepts_images=True)
    handler = _Handler(engine, "tiny", None)
    run = asyncio.run(handler.start(chat_body(looking(2))))
    assert [image.inputs["size"] for image in run.images] == [(3, 2), (3, 2)]
    assert engine.reserved == 1 and engine.released == 0 and engine.generated == [[1, 2, 3]]
    broken = chat_body({"role": "user", "content": "hi"},
                       {"role": "user", "content": [image_part(), image_part("data:image/png;base64,aGk=")]})
    with pytest.raises(APIError, match=r"^'messages\.1\.content\.1': the image data is text") as refused:
        asyncio.run(handler.start(broken))
    assert refused.value.status == 400 and refused.value.param == "messages"
    assert engine.reserved == 2 and engine.released == 1  # the failed request's ticket was given back


def test_loading_a_conversation_names_the_part_that_fails():
    messages = chat_body(looking(1), {"role": "user", "content": [image_part(png_url((1, 2, 3), (5, 5)))]}).messages
    loaded = asyncio.run(load_conversation_images(messages, MediaPolicy()))
    assert [image.image.getpixel((0, 0)) for image in loaded] == [(200, 10, 10), (1, 2, 3)]
    far = chat_body({"role": "user", "content": [image_part("http://example.com/a.png")]}).messages
    with pytest.raises(APIError, match=r"'messages\.0\.content\.0': this server does not fetch images over http"):
        asyncio.run(load_conversation_images(far, MediaPolicy()))
    with pytest.raises(APIError, match="3 images in one prompt; this server takes at most 2"):
        asyncio.run(load_conversation_images(chat_body(looking(3)).messages,
                                             MediaPolicy(limit_images_per_prompt=2)))
