"""A vision-language model through `tokenmill serve` (issue 44), driven by the official openai and anthropic SDKs:
an image sent as a data URL gets the answer the offline engine gives for the same prompt and image, through
chat (whole and streamed), Responses and Messages; usage counts the image's positions; bad images are 400s
in the OpenAI error shape and the server keeps serving everyone else."""

from __future__ import annotations

import base64
import json
import concurrent.futures
import io
import struct
import zlib

import anthropic
import httpx
import numpy as np
import openai
import pytest
from PIL import Image

from e2e.server_harness import ServerProcess, metric, metric_samples
from helpers.tiny_models import make_tiny_llava

QUESTION = "What is this?"
IMAGE_TOKENS = 16


def picture(seed: int = 0, width: int = 40, height: int = 50) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def png_bytes(image: Image.Image) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, "PNG")
    return buffer.getvalue()


def data_url(data: bytes, media_type: str = "image/png") -> str:
    return f"data:{media_type};base64,{base64.b64encode(data).decode()}"


def png_header(width: int, height: int) -> bytes:
    """A PNG that is only its signature, IHDR and IEND: it claims the size and holds no pixels."""
    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)) + \
        chunk(b"IEND", b"")


def looking(*urls: str) -> list[dict]:
    return [{"role": "user", "content": [*({"type": "image_url", "image_url": {"url": u}} for u in urls),
                                         {"type": "text", "text": QUESTION}]}]


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return str(make_tiny_llava(tmp_path_factory.mktemp("llava") / "model", "clip"))


@pytest.fixture(scope="module")
def offline(model):
    """The offline engine's greedy answers (text, prompt length) for the chat prompt of one image."""
    from tokenmill import LLM, SamplingParams

    llm = LLM(model, max_model_len=512)
    prompt = "USER: <image>\n" + QUESTION + " ASSISTANT:"

    def answer(image: Image.Image) -> tuple[str, int]:
        out = llm.generate({"prompt": prompt, "multi_modal_data": {"image": image}},
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
        return out.outputs[0].text, len(out.prompt_token_ids)
    return answer


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    proc = ServerProcess(model, "--max-model-len", "512", "--served-model-name", "tiny-llava",
                         "--limit-mm-per-prompt", "4", "--num-kv-blocks", "256", log_path=tmp_path_factory.mktemp("logs") / "vlm.log")
    with proc.running():
        yield proc


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0)


def chat(client, messages, **extra):
    return client.chat.completions.create(model="tiny-llava", messages=messages, max_tokens=8, temperature=0,
                                          **extra)


def test_an_image_gets_the_offline_engines_answer_through_every_api(server, client, offline):
    image = picture()
    expected, prompt_tokens = offline(image)
    assert prompt_tokens > IMAGE_TOKENS
    url = data_url(png_bytes(image))
    whole = chat(client, looking(url))
    assert whole.choices[0].message.content == expected
    assert whole.usage.prompt_tokens == prompt_tokens  # the image's 16 positions included
    streamed = "".join(c.choices[0].delta.content or "" for c in chat(client, looking(url), stream=True) if c.choices)
    assert streamed == expected
    response = client.responses.create(model="tiny-llava", max_output_tokens=8, temperature=0,
                                       input=[{"role": "user", "content": [
                                           {"type": "input_image", "image_url": url},
                                           {"type": "input_text", "text": QUESTION}]}])
    assert response.output_text == expected
    claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                         "data": base64.b64encode(png_bytes(image)).decode()}}
    message = claude.messages.create(model="tiny-llava", max_tokens=8, extra_body={"temperature": 0},
                                     messages=[{"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}])
    assert message.content[0].text == expected
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == prompt_tokens
    counted = claude.messages.count_tokens(model="tiny-llava", messages=[
        {"role": "user", "content": [block, {"type": "text", "text": QUESTION}]}])
    assert counted.input_tokens == prompt_tokens
    tokens = httpx.post(f"{server.url}/tokenize", json={"model": "tiny-llava", "messages": looking(url)}, timeout=60)
    assert tokens.json()["count"] == prompt_tokens
    other = picture(1)
    assert chat(client, looking(data_url(png_bytes(other)))).choices[0].message.content == offline(other)[0]


BAD_IMAGES = [
    (data_url(png_bytes(picture())[:-60]), "truncated or corrupt"),
    (data_url(png_header(20000, 20000)), "too large"),
    (data_url(b'<svg xmlns="http://www.w3.org/2000/svg" width="10" height="10"/>', "image/svg+xml"),
     "SVG"),
    ("https://example.com/cat.png", "fetch"),
]


@pytest.mark.parametrize("url, says", BAD_IMAGES, ids=["truncated", "20000x20000", "svg", "url-fetching-off"])
def test_a_bad_image_is_a_400_in_openais_shape_and_others_are_served(client, offline, url, says):
    expected, _ = offline(picture())
    good = data_url(png_bytes(picture()))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        others = [pool.submit(chat, client, looking(good)) for _ in range(2)]
        with pytest.raises(openai.BadRequestError) as refused:
            chat(client, looking(good, url))
        assert [o.result().choices[0].message.content for o in others] == [expected, expected]
    body = refused.value.body
    assert body["type"] == "invalid_request_error" and body["param"] == "messages"
    assert says.lower() in body["message"].lower(), body["message"]
    assert "messages.0.content.1" in body["message"]  # which part


def test_too_many_images_and_placeholder_text_are_refused(client, offline):
    good = data_url(png_bytes(picture()))
    with pytest.raises(openai.BadRequestError, match=r"50 images in one prompt; this server takes at most 4"):
        chat(client, looking(*[good] * 50))
    # text that spells the image token stays text: it never becomes a placeholder without an image
    typed = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": good}},
                                          {"type": "text", "text": "What is <image> this?"}]}]
    assert chat(client, typed).choices[0].message.content
    assert chat(client, looking(good)).choices[0].message.content == offline(picture())[0]


def test_encoder_work_is_in_the_metrics_and_the_live_stream(server, client):
    before = metric(metric_samples(server.url), "tokenmill:encoder_images_total")
    chat(client, looking(data_url(png_bytes(picture(7)))))  # an image no earlier test sent: encoded now
    samples = metric_samples(server.url)
    assert metric(samples, "tokenmill:encoder_images_total") == before + 1
    assert metric(samples, "tokenmill:encoder_seconds_total") > 0
    with httpx.stream("GET", f"{server.url}/v1/engine/stream", timeout=60) as stream:
        line = next(line for line in stream.iter_lines() if line.startswith("data:"))
    encoder = json.loads(line[len("data:"):])["encoder"]
    assert encoder["images_total"] == before + 1 and encoder["seconds_total"] > 0


def test_qwen2_vl_images_of_different_sizes_through_the_openai_sdk(tmp_path):
    """The second family (dynamic resolution, M-RoPE): two images of different sizes in one turn get the offline
    engine's answer, and usage counts each image's own number of positions."""
    from helpers.tiny_models import make_tiny_qwen2_vl
    from tokenmill import LLM, SamplingParams

    model = str(make_tiny_qwen2_vl(tmp_path / "model"))
    images = [picture(3, 40, 50), picture(4, 130, 90)]
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Compare"},
                                             {"type": "image"}, {"type": "text", "text": " these."}]}]
    llm = LLM(model, max_model_len=512)
    text = llm.apply_chat_template(messages)
    offline = llm.generate({"prompt": text, "multi_modal_data": {"image": images}},
                           SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)[0]
    del llm
    proc = ServerProcess(model, "--max-model-len", "512", "--served-model-name", "tiny-llava",
                         "--num-kv-blocks", "256", log_path=tmp_path / "qwen2_vl.log")
    with proc.running():
        client = openai.OpenAI(base_url=f"{proc.url}/v1", api_key="none", max_retries=0)
        urls = [data_url(png_bytes(image)) for image in images]
        content = [{"type": "image_url", "image_url": {"url": urls[0]}}, {"type": "text", "text": "Compare"},
                   {"type": "image_url", "image_url": {"url": urls[1]}}, {"type": "text", "text": " these."}]
        answer = chat(client, [{"role": "user", "content": content}])
    assert answer.choices[0].message.content == offline.outputs[0].text
    assert answer.usage.prompt_tokens == len(offline.prompt_token_ids)
