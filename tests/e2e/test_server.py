"""`tokenmill serve` end to end: the real server in a subprocess, driven by the openai client and raw HTTP.

Three servers over one tiny random-weight Llama, each booted once per module when a test first asks for it:
  main     --max-model-len 128 --served-model-name tiny-test   (nearly every test)
  guarded  --api-key ... --max-waiting-requests 0               (401 / 429)
  drain    --max-model-len 4096 --shutdown-timeout 120           (aborts: a 4000-token request runs for tens of s;
                                                                  then SIGTERM, last: the process is gone afterwards)
Only 127.0.0.1 is ever contacted.
"""

from __future__ import annotations

import asyncio
import json
import signal
import threading
import time
import uuid

import httpx
import openai
import pytest
from openai import AsyncOpenAI, OpenAI
from prometheus_client.parser import text_string_to_metric_families

import tokenmill
from e2e.server_harness import ServerProcess, metric, metric_samples, sse_events, wait_for_metrics
from helpers.tiny_models import make_tiny_hf_model

SERVED = "tiny-test"
API_KEY = "sekret-test-key"
MAX_MODEL_LEN = 128
PROMPT = "The quick brown fox jumps over the lazy dog"
MESSAGES = [{"role": "user", "content": "Tell me about foxes."}]
IGNORE_EOS = {"ignore_eos": True}


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=4096))


class Fleet:
    """The module's servers by role, each started the first time a test asks for it (a pass that selects a
    few tests, such as `-m every_level`, boots only the servers they use) and all stopped at the end."""

    def __init__(self, tiny_model: str, logs):
        blocks = ("--num-kv-blocks", "1024")
        self.servers = {
            "main": ServerProcess(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--served-model-name", SERVED,
                                  *blocks, log_path=logs / "main.log"),
            "guarded": ServerProcess(tiny_model, "--max-model-len", str(MAX_MODEL_LEN), "--api-key", API_KEY,
                                     "--max-waiting-requests", "0", *blocks, log_path=logs / "guarded.log"),
            "drain": ServerProcess(tiny_model, "--max-model-len", "4096", "--shutdown-timeout", "120", *blocks,
                                   log_path=logs / "drain.log"),
        }

    def __getitem__(self, role: str) -> ServerProcess:
        server = self.servers[role]
        if server.proc is None:
            server.start()
        return server

    def stop(self) -> None:
        for server in self.servers.values():
            server.terminate()
        for server in self.servers.values():
            server.stop()


@pytest.fixture(scope="module")
def fleet(tiny_model, tmp_path_factory):
    servers = Fleet(tiny_model, tmp_path_factory.mktemp("server-logs"))
    try:
        yield servers
    finally:
        servers.stop()


@pytest.fixture(scope="module")
def main_url(fleet) -> str:
    return fleet["main"].wait_ready().url


@pytest.fixture(scope="module")
def slow_url(fleet) -> str:
    """The drain server, for the aborts of long requests (its 4096-token context) and the name it serves under
    (no --served-model-name); the SIGTERM test, the module's last, stops it after them."""
    return fleet["drain"].wait_ready().url


@pytest.fixture(scope="module")
def guarded_url(fleet) -> str:
    return fleet["guarded"].wait_ready().url


@pytest.fixture(scope="module")
def client(main_url):
    with OpenAI(base_url=f"{main_url}/v1", api_key="unused", max_retries=0, timeout=60) as client:
        yield client


# ---------------------------------------------------------------------------------------- helpers
def post(base: str, path: str, body, **kwargs) -> httpx.Response:
    if isinstance(body, (bytes, str)):
        kwargs.setdefault("headers", {})["content-type"] = "application/json"
        return httpx.post(f"{base}{path}", content=body, timeout=60, **kwargs)
    return httpx.post(f"{base}{path}", json=body, timeout=60, **kwargs)


def token_count(base: str, **body) -> int:
    response = post(base, "/tokenize", body)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["count"] == len(data["tokens"])
    return data["count"]


def assert_openai_error(response: httpx.Response, status: int, mentions: str | None = None) -> dict:
    """The OpenAI error shape, the status, no traceback, and `mentions` in the message or param."""
    assert response.status_code == status, (response.status_code, response.text)
    assert response.headers["content-type"].startswith("application/json")
    assert "Traceback" not in response.text and 'File "' not in response.text
    body = response.json()
    assert set(body) == {"error"}, body
    error = body["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    if mentions is not None:
        assert mentions in error["message"] or error["param"] == mentions, error
    return error


def raw_stream(base: str, path: str, body: dict, **kwargs) -> list[str]:
    """POST a streamed request; return the SSE payloads (checked framing, text/event-stream)."""
    with httpx.stream("POST", f"{base}{path}", json={**body, "stream": True}, timeout=60, **kwargs) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        return sse_events(response.iter_lines())


def chunk_text(kind: str, choice) -> str:
    return (choice.text if kind == "completions" else choice.delta.content) or ""


def create(client: OpenAI, kind: str, **kwargs):
    if kind == "completions":
        return client.completions.create(model=SERVED, prompt=PROMPT, **kwargs)
    return client.chat.completions.create(model=SERVED, messages=MESSAGES, **kwargs)


def full_text(kind: str, choice) -> str:
    return choice.text if kind == "completions" else choice.message.content


# ---------------------------------------------------------------------------------------- info endpoints
def test_models_health_version(main_url, slow_url, client, tiny_model):
    assert httpx.get(f"{main_url}/health").status_code == 200
    version = httpx.get(f"{main_url}/version")
    assert version.status_code == 200 and version.json() == {"version": tokenmill.__version__}

    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED]
    raw = httpx.get(f"{main_url}/v1/models").json()
    assert raw["object"] == "list" and raw["data"][0]["object"] == "model"
    assert raw["data"][0]["max_model_len"] == MAX_MODEL_LEN
    # without --served-model-name the model argument is the name
    assert [m["id"] for m in httpx.get(f"{slow_url}/v1/models").json()["data"]] == [tiny_model]
    # the served name replaces the path: asking for the path is an unknown model
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=tiny_model, prompt=PROMPT, max_tokens=2)


# ---------------------------------------------------------------------------------------- generation
@pytest.mark.every_level
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_non_streamed_response_shape(client, kind):
    response = create(client, kind, max_tokens=6, temperature=0, extra_body=IGNORE_EOS)
    assert response.model == SERVED
    assert response.object == ("text_completion" if kind == "completions" else "chat.completion")
    assert len(response.choices) == 1
    choice = response.choices[0]
    assert choice.index == 0 and choice.finish_reason == "length"
    assert full_text(kind, choice)
    if kind == "chat":
        assert choice.message.role == "assistant"
    assert response.usage.completion_tokens == 6
    assert response.usage.total_tokens == response.usage.prompt_tokens + 6


@pytest.mark.every_level
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_greedy_stream_equals_non_streamed(client, kind):
    whole = create(client, kind, max_tokens=12, temperature=0)
    chunks = list(create(client, kind, max_tokens=12, temperature=0, stream=True))
    choices = [c for chunk in chunks for c in chunk.choices]
    assert choices and all(c.index == 0 for c in choices)
    if kind == "chat":
        assert chunks[0].choices[0].delta.role == "assistant"
        assert all(c.delta.role in (None, "assistant") for c in choices)
        assert all(c.delta.role is None for c in choices[1:])
    text = "".join(chunk_text(kind, c) for c in choices)
    assert text and text == full_text(kind, whole.choices[0])
    # only the last chunk carries the finish reason
    assert [c.finish_reason for c in choices[:-1]] == [None] * (len(choices) - 1)
    assert choices[-1].finish_reason == whole.choices[0].finish_reason is not None


@pytest.mark.parametrize("kind,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_raw_sse_ends_with_done_and_usage_chunk(main_url, kind, path):
    body = {"max_tokens": 5, "temperature": 0, "ignore_eos": True, "stream_options": {"include_usage": True}}
    if kind == "completions":
        body["prompt"] = PROMPT
        prompt_tokens = token_count(main_url, prompt=PROMPT)
    else:
        body["messages"] = MESSAGES
        prompt_tokens = token_count(main_url, messages=MESSAGES)
    events = raw_stream(main_url, path, body)
    assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
    payloads = [json.loads(e) for e in events[:-1]]
    usage_chunk = payloads[-1]
    assert usage_chunk["choices"] == []
    details = usage_chunk["usage"].pop("prompt_tokens_details")
    assert usage_chunk["usage"] == {"prompt_tokens": prompt_tokens, "completion_tokens": 5,
                                    "total_tokens": prompt_tokens + 5}
    assert 0 <= details["cached_tokens"] < prompt_tokens and details["cached_tokens"] % 16 == 0  # whole blocks
    content = payloads[:-1]
    assert content and all(p["choices"] and p.get("usage") is None for p in content)
    reasons = [c["finish_reason"] for p in content for c in p["choices"]]
    assert reasons[-1] == "length" and set(reasons[:-1]) <= {None}
    assert len({p["id"] for p in payloads}) == 1


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_n3_seeded_stream_keeps_choices_apart(client, kind):
    params = dict(n=3, seed=1234, temperature=1.0, max_tokens=8, extra_body=IGNORE_EOS)
    whole = create(client, kind, **params)
    expected = {c.index: full_text(kind, c) for c in whole.choices}
    assert set(expected) == {0, 1, 2}
    assert len(set(expected.values())) == 3, "the three samples should differ, else mixing is undetectable"

    streamed: dict[int, list[str]] = {0: [], 1: [], 2: []}
    roles: dict[int, str] = {}
    finished: dict[int, str] = {}
    for chunk in create(client, kind, stream=True, **params):
        indices = [c.index for c in chunk.choices]
        assert len(indices) == len(set(indices)), "a choice appears twice in one chunk"
        for choice in chunk.choices:
            assert choice.index in streamed
            assert choice.index not in finished, "content after the choice's finish_reason"
            if kind == "chat" and choice.delta.role:
                roles[choice.index] = choice.delta.role
            streamed[choice.index].append(chunk_text(kind, choice))
            if choice.finish_reason is not None:
                finished[choice.index] = choice.finish_reason
    assert finished == {0: "length", 1: "length", 2: "length"}
    if kind == "chat":
        assert roles == {0: "assistant", 1: "assistant", 2: "assistant"}
    assert {i: "".join(parts) for i, parts in streamed.items()} == expected


# ---------------------------------------------------------------------------------------- logprobs
def test_completion_logprobs_shape(client):
    response = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                         extra_body=IGNORE_EOS)
    choice = response.choices[0]
    lp = choice.logprobs
    n = response.usage.completion_tokens
    assert n == 6
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == n
    assert "".join(lp.tokens) == choice.text
    assert lp.text_offset[0] == 0
    for i in range(1, n):
        assert lp.text_offset[i] == lp.text_offset[i - 1] + len(lp.tokens[i - 1])
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert 1 <= len(top) <= 2
        assert logprob <= 0 and all(v <= 0 for v in top.values())
        assert top[token] == pytest.approx(logprob)
        assert logprob == pytest.approx(max(top.values())), "the greedy token is the most likely one"

    # streamed: the same tokens and logprobs, and offsets into the whole text
    stream = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=6, temperature=0, logprobs=2,
                                       extra_body=IGNORE_EOS, stream=True)
    tokens, logprobs, offsets = [], [], []
    for chunk in stream:
        for c in chunk.choices:
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                logprobs += c.logprobs.token_logprobs
                offsets += c.logprobs.text_offset
    assert tokens == lp.tokens
    assert logprobs == pytest.approx(lp.token_logprobs)
    assert offsets == lp.text_offset


def test_chat_logprobs_with_top_logprobs(client):
    response = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=6, temperature=0,
                                              logprobs=True, top_logprobs=2, extra_body=IGNORE_EOS)
    choice = response.choices[0]
    content = choice.logprobs.content
    assert len(content) == response.usage.completion_tokens == 6
    assert "".join(entry.token for entry in content) == choice.message.content
    for entry in content:
        assert entry.bytes == list(entry.token.encode())
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert entry.top_logprobs[0].token == entry.token, "the greedy token is the most likely one"
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)


def test_chat_logprobs_without_top_logprobs(client):
    response = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=4, temperature=0,
                                              logprobs=True, extra_body=IGNORE_EOS)
    content = response.choices[0].logprobs.content
    assert len(content) == 4
    assert all(entry.logprob <= 0 and entry.top_logprobs == [] for entry in content)


# ---------------------------------------------------------------------------------------- stop strings
def _tokens_and_text(main_url: str, kind: str) -> tuple[list[str], str, dict]:
    base = {"max_tokens": 16, "temperature": 0, "ignore_eos": True}
    if kind == "completions":
        body = {**base, "prompt": PROMPT}
        data = post(main_url, "/v1/completions", {**body, "logprobs": 0}).json()
        return data["choices"][0]["logprobs"]["tokens"], data["choices"][0]["text"], body
    body = {**base, "messages": MESSAGES}
    data = post(main_url, "/v1/chat/completions", {**body, "logprobs": True}).json()
    choice = data["choices"][0]
    return [e["token"] for e in choice["logprobs"]["content"]], choice["message"]["content"], body


@pytest.mark.parametrize("kind,path", [("completions", "/v1/completions"), ("chat", "/v1/chat/completions")])
def test_stop_string_spanning_tokens(main_url, kind, path):
    tokens, text, body = _tokens_and_text(main_url, kind)
    assert "".join(tokens) == text
    # a 4-character stop string: the last 2 characters of token j-1 and the first 2 of token j
    for j in range(1, len(tokens)):
        boundary = len("".join(tokens[:j]))
        stop = text[boundary - 2:boundary + 2]
        if len(tokens[j - 1]) >= 2 and len(tokens[j]) >= 2 and text.find(stop) == boundary - 2 \
                and "\ufffd" not in stop:
            break
    else:
        pytest.fail(f"no stop string candidate in {tokens}")
    expected = text[:boundary - 2]

    whole = post(main_url, path, {**body, "stop": [stop]}).json()
    choice = whole["choices"][0]
    got = choice["text"] if kind == "completions" else choice["message"]["content"]
    assert got == expected and stop not in got
    assert choice["finish_reason"] == "stop" and choice["stop_reason"] == stop
    assert whole["usage"]["completion_tokens"] == j + 1, "generation stops at the token completing the stop"

    events = raw_stream(main_url, path, {**body, "stop": stop})
    assert events[-1] == "[DONE]"
    streamed, reasons = "", []
    for event in events[:-1]:
        for c in json.loads(event)["choices"]:
            streamed += (c["text"] if kind == "completions" else c["delta"].get("content")) or ""
            assert stop not in streamed, "the stop string was streamed"
            reasons.append(c["finish_reason"])
    assert streamed == expected
    assert reasons[-1] == "stop"


# ---------------------------------------------------------------------------------------- usage, prompts
def test_cached_tokens_report_what_the_prefix_cache_supplied(main_url, client):
    prompt = f"{uuid.uuid4().hex} " + "a fresh prompt that fills several whole blocks of the cache " * 4
    count = token_count(main_url, prompt=prompt)
    first = client.completions.create(model=SERVED, prompt=prompt, max_tokens=3, extra_body=IGNORE_EOS)
    again = client.completions.create(model=SERVED, prompt=prompt, max_tokens=3, extra_body=IGNORE_EOS)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    # every whole block but the one holding the last prompt token, which is always computed
    assert again.usage.prompt_tokens_details.cached_tokens == (count - 1) // 16 * 16 > 0
    streamed = client.completions.create(model=SERVED, prompt=prompt, max_tokens=3, stream=True,
                                         stream_options={"include_usage": True}, extra_body=IGNORE_EOS)
    usage = [chunk.usage for chunk in streamed if chunk.usage is not None]
    assert usage[-1].prompt_tokens_details.cached_tokens == (count - 1) // 16 * 16
    messages = [{"role": "user", "content": prompt}]
    client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, extra_body=IGNORE_EOS)
    chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=2, extra_body=IGNORE_EOS)
    assert chat.usage.prompt_tokens_details.cached_tokens >= 16


def test_usage_counts_match_tokenize(main_url, client):
    count = token_count(main_url, prompt=PROMPT)
    response = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=7, extra_body=IGNORE_EOS)
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (count, 7)
    assert response.choices[0].finish_reason == "length"

    chat_count = token_count(main_url, messages=MESSAGES)
    chat = client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=7, extra_body=IGNORE_EOS)
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (chat_count, 7)
    assert chat_count > token_count(main_url, prompt=MESSAGES[0]["content"])  # the template adds tokens

    n2 = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, n=2, extra_body=IGNORE_EOS)
    assert (n2.usage.prompt_tokens, n2.usage.completion_tokens) == (count, 6)


def test_prompt_variants_and_echo(main_url):
    other = "Once upon a time"
    ids = post(main_url, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    other_ids = post(main_url, "/tokenize", {"prompt": other}).json()["tokens"]

    def complete(prompt, **extra) -> dict:
        response = post(main_url, "/v1/completions",
                        {"prompt": prompt, "max_tokens": 5, "temperature": 0, "ignore_eos": True, **extra})
        assert response.status_code == 200, response.text
        return response.json()

    def texts(data: dict) -> list[str]:
        assert [c["index"] for c in data["choices"]] == list(range(len(data["choices"])))
        return [c["text"] for c in data["choices"]]

    first, second = texts(complete(PROMPT))[0], texts(complete(other))[0]
    assert first != second
    both = complete([PROMPT, other])
    assert texts(both) == [first, second]
    assert both["usage"]["prompt_tokens"] == len(ids) + len(other_ids)
    assert both["usage"]["completion_tokens"] == 10
    assert texts(complete(ids)) == [first]
    assert texts(complete([ids, other_ids])) == [first, second]

    assert texts(complete(PROMPT, echo=True)) == [PROMPT + first]
    assert texts(complete(ids, echo=True)) == [PROMPT + first]
    echoed = "".join(json.loads(e)["choices"][0]["text"] for e in raw_stream(
        main_url, "/v1/completions",
        {"prompt": PROMPT, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "echo": True})[:-1])
    assert echoed == PROMPT + first


def test_tokenize_detokenize_round_trip(main_url):
    text = "Hello, world! tokenmill streams tokens."
    data = post(main_url, "/tokenize", {"prompt": text}).json()
    assert data["count"] == len(data["tokens"]) > 0 and data["max_model_len"] == MAX_MODEL_LEN
    assert all(isinstance(t, int) for t in data["tokens"])
    assert post(main_url, "/detokenize", {"tokens": data["tokens"]}).json() == {"prompt": text}

    chat = post(main_url, "/tokenize", {"messages": MESSAGES}).json()
    rendered = post(main_url, "/detokenize", {"tokens": chat["tokens"]}).json()["prompt"]
    assert MESSAGES[0]["content"] in rendered
    without_prompt = post(main_url, "/tokenize", {"messages": MESSAGES, "add_generation_prompt": False}).json()
    assert without_prompt["count"] < chat["count"]

    assert_openai_error(post(main_url, "/detokenize", {"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(post(main_url, "/tokenize", {}), 400)


def test_render_gives_the_prompt_ids_a_request_would_run_as_vllm_does(main_url):
    text = "Hello, world! tokenmill streams tokens."
    tokens = post(main_url, "/tokenize", {"prompt": text}).json()["tokens"]
    answer = post(main_url, "/v1/completions/render", {"prompt": text, "max_tokens": 5})
    assert answer.status_code == 200, answer.text
    (rendered,) = answer.json()
    assert rendered["token_ids"] == tokens and rendered["sampling_params"]["max_tokens"] == 5
    assert rendered["request_id"].startswith("cmpl-")
    both = post(main_url, "/v1/completions/render", {"prompt": [text, text]}).json()
    assert [r["token_ids"] for r in both] == [tokens, tokens]
    assert post(main_url, "/v1/completions/render", {"prompt": [5, 6, 7]}).json()[0]["token_ids"] == [5, 6, 7]
    chat = post(main_url, "/v1/chat/completions/render", {"messages": MESSAGES}).json()
    assert chat["token_ids"] == post(main_url, "/tokenize", {"messages": MESSAGES}).json()["tokens"]
    assert_openai_error(post(main_url, "/v1/chat/completions/render", {"messages": []}), 400, "messages")


def test_the_fields_routers_add_are_accepted_where_they_change_nothing(main_url):
    # what sglang-router and vllm-router add to every request they forward
    added = {"no_stop_trim": False, "skip_special_tokens": True, "return_hidden_states": False}
    chat_added = {**added, "continue_final_message": False, "separate_reasoning": True,
                  "stream_reasoning": True, "include_reasoning": True}
    assert post(main_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2, **added}).status_code == 200
    assert post(main_url, "/v1/chat/completions", {"messages": MESSAGES, "max_tokens": 2,
                                                   **chat_added}).status_code == 200
    assert_openai_error(post(main_url, "/v1/completions", {"prompt": "hi", "no_stop_trim": True}), 400,
                        "no_stop_trim")
    assert_openai_error(post(main_url, "/v1/chat/completions", {"messages": MESSAGES,
                                                                "continue_final_message": True}), 400,
                        "continue_final_message")


# ---------------------------------------------------------------------------------------- errors
_CHAT = {"messages": MESSAGES, "max_tokens": 2}
_CMPL = {"prompt": PROMPT, "max_tokens": 2}
ERROR_CASES = [
    ("/v1/completions", b'{"prompt": "hi", ', 400, None),
    ("/v1/chat/completions", b"not json at all", 400, None),
    ("/v1/completions", {**_CMPL, "temperature": -1}, 400, "temperature"),
    ("/v1/completions", {**_CMPL, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/completions", {**_CMPL, "top_p": 2}, 400, "top_p"),
    ("/v1/completions", {**_CMPL, "temperature": -1, "stream": True}, 400, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "temperature": -1}, 400, "temperature"),
    ("/v1/chat/completions", {**_CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ("/v1/chat/completions", {**_CHAT, "top_p": 2, "stream": True}, 400, "top_p"),
    ("/v1/chat/completions", {**_CHAT, "functions": [{"name": "f"}]}, 400, "functions"),  # the pre-tools field
    ("/v1/completions", {**_CMPL, "suffix": "!"}, 400, "suffix"),
    ("/v1/completions", {**_CMPL, "best_of": 2}, 400, "best_of"),
    ("/v1/completions", {**_CMPL, "model": "no-such-model"}, 404, "model"),
    ("/v1/chat/completions", {**_CHAT, "model": "no-such-model", "stream": True}, 404, "model"),
    ("/v1/completions", {"max_tokens": 2}, 400, "prompt"),
    ("/v1/chat/completions", {**_CHAT, "messages": []}, 400, "messages"),
    ("/v1/completions", {**_CMPL, "max_tokens": 500}, 400, str(MAX_MODEL_LEN)),
]


def test_errors_are_openai_shaped_and_server_keeps_serving(main_url, client):
    for path, body, status, mentions in ERROR_CASES:
        try:
            assert_openai_error(post(main_url, path, body), status, mentions)
        except AssertionError as exc:
            raise AssertionError(f"{path} {body!r}: {exc}") from None
    assert_openai_error(httpx.get(f"{main_url}/v1/no-such-endpoint"), 404)

    # the official client maps them to its exception types
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=2, temperature=-1)
    assert bad.value.status_code == 400 and "temperature" in str(bad.value)
    with pytest.raises(openai.NotFoundError):
        client.chat.completions.create(model="no-such-model", messages=MESSAGES, max_tokens=2)

    # and after all that, good requests still work
    ok = client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS)
    assert ok.usage.completion_tokens == 3
    assert list(client.chat.completions.create(model=SERVED, messages=MESSAGES, max_tokens=3, stream=True))


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_prompt_longer_than_context_names_both_numbers(main_url, kind):
    long_text = "hello " * 200
    if kind == "completions":
        count = token_count(main_url, prompt=long_text)
        response = post(main_url, "/v1/completions", {"prompt": long_text, "max_tokens": 1})
    else:
        messages = [{"role": "user", "content": long_text}]
        count = token_count(main_url, messages=messages)
        response = post(main_url, "/v1/chat/completions", {"messages": messages, "max_tokens": 1})
    assert count > MAX_MODEL_LEN
    error = assert_openai_error(response, 400)
    assert str(count) in error["message"] and str(MAX_MODEL_LEN) in error["message"], error


# ---------------------------------------------------------------------------------------- auth and 429
def test_api_key_required(guarded_url):
    good = {"Authorization": f"Bearer {API_KEY}"}
    wrong = {"Authorization": "Bearer not-the-key"}
    requests = [("GET", "/v1/models", None), ("POST", "/v1/completions", _CMPL),
                ("POST", "/v1/chat/completions", _CHAT), ("POST", "/tokenize", {"prompt": "hi"}),
                ("POST", "/detokenize", {"tokens": [1]}), ("GET", "/docs", None), ("GET", "/openapi.json", None),
                ("GET", "/version", None)]
    for method, path, body in requests:
        for headers in ({}, wrong, {"Authorization": API_KEY}):
            response = httpx.request(method, f"{guarded_url}{path}", json=body, headers=headers, timeout=30)
            assert_openai_error(response, 401)
    assert httpx.get(f"{guarded_url}/v1/models", headers=good).status_code == 200
    assert httpx.post(f"{guarded_url}/tokenize", json={"prompt": "hi"}, headers=good).status_code == 200
    assert httpx.get(f"{guarded_url}/health").status_code == 200
    assert httpx.get(f"{guarded_url}/metrics").status_code == 200  # scraped without a key, as vLLM serves it

    with pytest.raises(openai.AuthenticationError):
        OpenAI(base_url=f"{guarded_url}/v1", api_key="not-the-key", max_retries=0).models.list()
    models = OpenAI(base_url=f"{guarded_url}/v1", api_key=API_KEY, max_retries=0).models.list()
    assert len(models.data) == 1


def test_full_waiting_queue_answers_429_with_retry_after(guarded_url, tiny_model):
    good = {"Authorization": f"Bearer {API_KEY}"}
    for path, body in [("/v1/completions", _CMPL), ("/v1/chat/completions", _CHAT),
                       ("/v1/completions", {**_CMPL, "stream": True})]:
        response = httpx.post(f"{guarded_url}{path}", json=body, headers=good, timeout=30)
        assert_openai_error(response, 429)
        assert int(response.headers["retry-after"]) >= 1
    with pytest.raises(openai.RateLimitError):
        OpenAI(base_url=f"{guarded_url}/v1", api_key=API_KEY, max_retries=0).completions.create(
            model=tiny_model, prompt="hi", max_tokens=2)


# ---------------------------------------------------------------------------------------- metrics
HISTOGRAMS = ["time_to_first_token_seconds", "inter_token_latency_seconds", "e2e_request_latency_seconds",
              "request_queue_time_seconds"]
COUNTERS = ["prompt_tokens", "generation_tokens", "num_preemptions", "request_success", "prefix_cache_queries",
            "prefix_cache_hits", "prefix_cache_evictions"]
GAUGES = ["num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_hit_rate"]


def test_metrics_families_and_counters(main_url, client):
    def types() -> dict[str, str]:
        text = httpx.get(f"{main_url}/metrics").text
        return {f.name: f.type for f in text_string_to_metric_families(text)}

    found = types()
    for names, kind in ((HISTOGRAMS, "histogram"), (COUNTERS, "counter"), (GAUGES, "gauge")):
        for name in names:
            assert found.get(f"tokenmill:{name}") == kind, (name, found.get(f"tokenmill:{name}"))

    prompt_tokens, max_tokens = token_count(main_url, prompt=PROMPT), 5
    before = metric_samples(main_url)
    client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=max_tokens, extra_body=IGNORE_EOS)
    after = metric_samples(main_url)

    def grew(name: str, **labels) -> float:
        return metric(after, name, **labels) - metric(before, name, **labels)

    assert grew("tokenmill:prompt_tokens_total") == prompt_tokens
    assert grew("tokenmill:prefix_cache_queries_total") == prompt_tokens
    assert 0 <= metric(after, "tokenmill:prefix_cache_hit_rate") <= 1
    assert grew("tokenmill:generation_tokens_total") == max_tokens
    assert grew("tokenmill:request_success_total", finish_reason="length") == 1
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds"):
        assert grew(f"tokenmill:{name}_count") == 1, name
        assert grew(f"tokenmill:{name}_sum") >= 0, name
    assert grew("tokenmill:inter_token_latency_seconds_count") == max_tokens - 1
    assert metric(after, "tokenmill:num_requests_running") == 0
    assert metric(after, "tokenmill:num_requests_waiting") == 0
    assert metric(after, "tokenmill:kv_cache_usage_perc") == 0
    assert metric(after, "tokenmill:num_preemptions_total") >= 0


def test_vllm_metric_names_are_published_as_aliases_for_the_routers(main_url, client):
    """Routers built for vLLM read its names (and its `finished_reason` label): the same values."""
    client.completions.create(model=SERVED, prompt=PROMPT, max_tokens=3, extra_body=IGNORE_EOS)
    samples = metric_samples(main_url)
    for name in ("num_requests_running", "num_requests_waiting", "kv_cache_usage_perc", "prefix_cache_queries_total",
                 "prefix_cache_hits_total", "num_preemptions_total", "prompt_tokens_total", "generation_tokens_total",
                 "time_to_first_token_seconds_count", "inter_token_latency_seconds_sum",
                 "e2e_request_latency_seconds_bucket", "request_queue_time_seconds_count"):
        ours = {labels: value for (sample, labels), value in samples.items() if sample == f"tokenmill:{name}"}
        theirs = {labels: value for (sample, labels), value in samples.items() if sample == f"vllm:{name}"}
        assert ours and ours == theirs, name
    assert metric(samples, "vllm:gpu_cache_usage_perc") == metric(samples, "tokenmill:kv_cache_usage_perc")
    assert metric(samples, "vllm:request_success_total", finished_reason="length") == \
        metric(samples, "tokenmill:request_success_total", finish_reason="length") > 0


# ---------------------------------------------------------------------------------------- concurrency
def test_fifty_concurrent_streams(main_url):
    max_tokens = 6

    async def via_openai(client: AsyncOpenAI, i: int) -> tuple[str, int]:
        extra = dict(max_tokens=max_tokens, stream=True, stream_options={"include_usage": True},
                     extra_body=IGNORE_EOS)
        if i % 2:
            stream = await client.chat.completions.create(model=SERVED, messages=[
                {"role": "user", "content": f"Story number {i}"}], **extra)
        else:
            stream = await client.completions.create(model=SERVED, prompt=f"Story number {i}", **extra)
        reason, used = None, None
        async for chunk in stream:
            for c in chunk.choices:
                assert reason is None
                reason = c.finish_reason or reason
            if chunk.usage is not None:
                used = chunk.usage.completion_tokens
        return reason, used

    async def via_httpx(http: httpx.AsyncClient, i: int) -> tuple[str, int]:
        path, body = ("/v1/completions", {"prompt": f"Poem {i}"}) if i % 2 else \
            ("/v1/chat/completions", {"messages": [{"role": "user", "content": f"Poem {i}"}]})
        body.update(max_tokens=max_tokens, stream=True, ignore_eos=True, stream_options={"include_usage": True})
        async with http.stream("POST", f"{main_url}{path}", json=body) as response:
            assert response.status_code == 200
            events = sse_events([line async for line in response.aiter_lines()])
        assert events[-1] == "[DONE]" and events.count("[DONE]") == 1
        payloads = [json.loads(e) for e in events[:-1]]
        reasons = [c["finish_reason"] for p in payloads for c in p["choices"]]
        assert set(reasons[:-1]) <= {None}
        return reasons[-1], payloads[-1]["usage"]["completion_tokens"]

    async def run() -> list:
        client = AsyncOpenAI(base_url=f"{main_url}/v1", api_key="unused", max_retries=0, timeout=120)
        async with httpx.AsyncClient(timeout=120) as http:
            jobs = [via_openai(client, i) for i in range(30)] + [via_httpx(http, i) for i in range(20)]
            results = await asyncio.gather(*jobs)
        await client.close()
        return results

    results = asyncio.run(run())
    assert len(results) == 50
    assert all(reason == "length" for reason, _ in results), results
    assert [used for _, used in results] == [max_tokens] * 50
    wait_for_metrics(main_url, lambda s: metric(s, "tokenmill:num_requests_running") == 0
                     and metric(s, "tokenmill:kv_cache_usage_perc") == 0, timeout=10)


# ---------------------------------------------------------------------------------------- aborts
LONG = {"prompt": PROMPT, "max_tokens": 4000, "ignore_eos": True}  # tens of seconds if never aborted


def _aborts(samples) -> float:
    return metric(samples, "tokenmill:request_success_total", finish_reason="abort")


def _idle_and_one_more_abort(before: float):
    return lambda s: (metric(s, "tokenmill:num_requests_running") == 0
                      and metric(s, "tokenmill:kv_cache_usage_perc") == 0 and _aborts(s) == before + 1)


def test_stream_disconnect_aborts_and_frees_every_block(slow_url):
    aborts_before = _aborts(metric_samples(slow_url))
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{slow_url}/v1/completions", json={**LONG, "stream": True}) as response:
            assert response.status_code == 200
            lines = response.iter_lines()  # not a for/break: closing this iterator drops the connection
            events = 0
            while events < 3:
                events += next(lines).startswith("data: ")
            time.sleep(0.3)  # the client is slow, not gone: the request keeps running
            during = metric_samples(slow_url)
            assert metric(during, "tokenmill:num_requests_running") == 1
            assert metric(during, "tokenmill:kv_cache_usage_perc") > 0
    started = time.monotonic()
    wait_for_metrics(slow_url, _idle_and_one_more_abort(aborts_before), timeout=10)
    assert time.monotonic() - started < 10
    assert post(slow_url, "/v1/completions", {"prompt": "hi", "max_tokens": 2}).status_code == 200


def test_non_streamed_client_timeout_aborts(slow_url, tiny_model):
    aborts_before = _aborts(metric_samples(slow_url))
    impatient = OpenAI(base_url=f"{slow_url}/v1", api_key="unused", max_retries=0, timeout=1.5)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(model=tiny_model, prompt=PROMPT, max_tokens=4000, extra_body=IGNORE_EOS)
    wait_for_metrics(slow_url, _idle_and_one_more_abort(aborts_before), timeout=10)


# ---------------------------------------------------------------------------------------- SIGTERM
def test_sigterm_finishes_in_flight_request_then_exits_0(fleet):
    server: ServerProcess = fleet["drain"].wait_ready()
    max_tokens = 600
    result: dict = {}

    def in_flight() -> None:
        try:
            # bounds far above the seconds this takes alone: CI shares the machine
            result["response"] = httpx.post(f"{server.url}/v1/completions", timeout=180, json={
                "prompt": PROMPT, "max_tokens": max_tokens, "ignore_eos": True})
        except Exception as exc:  # reported by the assertions below
            result["error"] = exc

    thread = threading.Thread(target=in_flight, daemon=True)
    thread.start()
    wait_for_metrics(server.url, lambda s: metric(s, "tokenmill:num_requests_running") == 1, timeout=10)
    sent = time.monotonic()
    server.proc.send_signal(signal.SIGTERM)

    refused_while_draining = None
    while time.monotonic() - sent < 5:
        try:
            httpx.get(f"{server.url}/health", timeout=1)
        except httpx.ConnectError:
            refused_while_draining = thread.is_alive()
            break
        except httpx.TransportError:
            pass
        time.sleep(0.05)
    assert refused_while_draining is not None, "new connections still accepted 5 s after SIGTERM"
    assert refused_while_draining, "the in-flight request ended before the listener closed (too fast to test)"

    thread.join(timeout=150)
    assert not thread.is_alive()
    assert "error" not in result, result.get("error")
    response = result["response"]
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["choices"][0]["finish_reason"] == "length"
    assert data["usage"]["completion_tokens"] == max_tokens
    assert server.proc.wait(timeout=150) == 0
    assert time.monotonic() - sent < 120, "not down within --shutdown-timeout"
