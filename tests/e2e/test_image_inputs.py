"""Image inputs through `tokenmill serve` with a text-only model, driven by the official openai and anthropic
SDKs: every API takes its image shape, and the model refuses it with a 400 in that API's error shape, saying
it takes no images; more images than --limit-mm-per-prompt are refused first."""

from __future__ import annotations

import base64
import io

import anthropic
import httpx
import openai
import pytest
from PIL import Image

from e2e.server_harness import ServerProcess
from helpers.tiny_models import make_tiny_hf_model

NO_IMAGES = "the model 'tiny' takes no images: it is a text-only model"


def png_base64() -> str:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 3), (10, 200, 30)).save(buffer, "PNG")
    return base64.b64encode(buffer.getvalue()).decode()


PNG = png_base64()
PNG_URL = f"data:image/png;base64,{PNG}"


def looking(count: int = 1) -> list[dict]:
    return [{"role": "user", "content": [{"type": "text", "text": "What is this?"}]
             + [{"type": "image_url", "image_url": {"url": PNG_URL, "detail": "low"}}] * count}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model"))
    proc = ServerProcess(model, "--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", "tiny",
                         "--limit-mm-per-prompt", "2", log_path=tmp_path_factory.mktemp("logs") / "images.log")
    with proc.running():
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def test_chat_refuses_images_in_openais_shape(server, client):
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(model="tiny", messages=looking(), max_tokens=2)
    assert NO_IMAGES in refused.value.body["message"] and refused.value.body["param"] == "messages"
    assert refused.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError, match="takes no images"):
        client.chat.completions.create(model="tiny", messages=looking(), max_tokens=2, stream=True)
    with pytest.raises(openai.BadRequestError, match=r"3 images in one prompt; this server takes at most 2 "
                                                     r"\(--limit-mm-per-prompt\)"):
        client.chat.completions.create(model="tiny", messages=looking(3), max_tokens=2)
    for path in ("/tokenize", "/v1/chat/completions/render"):
        response = httpx.post(f"{server.url}{path}", json={"model": "tiny", "messages": looking()}, timeout=60)
        assert response.status_code == 400 and NO_IMAGES in response.json()["error"]["message"], response.text
    text_parts = [{"role": "user", "content": [{"type": "text", "text": "Hello"}]}]
    assert client.chat.completions.create(model="tiny", messages=text_parts, max_tokens=2).choices


def test_responses_refuse_input_images_naming_input(client):
    content = [{"type": "input_text", "text": "What is this?"},
               {"type": "input_image", "image_url": PNG_URL, "detail": "auto"}]
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", input=[{"role": "user", "content": content}], max_output_tokens=2)
    assert NO_IMAGES in refused.value.body["message"] and refused.value.body["param"] == "input"


def test_messages_refuse_image_blocks_in_anthropics_shape(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    content = [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": PNG}},
               {"type": "text", "text": "What is this?"}]
    with pytest.raises(anthropic.BadRequestError) as refused:
        claude.messages.create(model="tiny", max_tokens=2, messages=[{"role": "user", "content": content}])
    assert refused.value.body["type"] == "error"
    assert refused.value.body["error"]["type"] == "invalid_request_error"
    assert NO_IMAGES in refused.value.body["error"]["message"]
    with pytest.raises(anthropic.BadRequestError, match="takes no images"):
        claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": content}])
