"""The OpenAI Responses API (/v1/responses) through `tokenmill serve`, driven by the official openai client:
the same conversation gives the same tokens as /v1/chat/completions, streamed events parse in the SDK,
tool calls go round trips (by replayed items and by previous_response_id), structured output holds its
schema, stored responses can be read and deleted, and client mistakes are 400s naming the problem."""

from __future__ import annotations

import json

import httpx
import jsonschema
import openai
import pytest
from openai import OpenAI

from e2e.server_harness import ServerProcess, metric, metric_samples, wait_for_metrics
from helpers.tiny_models import make_tiny_hf_model

INSTRUCTIONS = "You answer briefly."
QUESTION = "What is the weather like in Paris?"
WEATHER_PARAMETERS = {"type": "object", "additionalProperties": False, "required": ["city", "unit"],
                      "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 20},
                                     "unit": {"enum": ["celsius", "fahrenheit"]}}}
WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city.",
           "parameters": WEATHER_PARAMETERS, "strict": True}
FORCED = {"type": "function", "name": "get_weather"}
PERSON = {"type": "object", "additionalProperties": False, "required": ["name", "age"],
          "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                         "age": {"type": "integer", "minimum": 0, "maximum": 120}}}
TEXT_EVENTS = ["response.output_item.added", "response.content_part.added", "response.output_text.done",
               "response.content_part.done", "response.output_item.done"]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model", max_position_embeddings=2048))
    server = ServerProcess(model, "--max-model-len", "2048", "--num-kv-blocks", "256", "--served-model-name", "tiny",
                           log_path=tmp_path_factory.mktemp("logs") / "responses.log")
    with server.running():
        yield OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0), server.url


@pytest.fixture(scope="module")
def stopping(served):
    """A greedy answer to QUESTION that ends by itself, at a stop string from the middle of its longer
    version: (the extra_body that asks for it, its text)."""
    client, _ = served
    longer = client.responses.create(model="tiny", input=QUESTION, temperature=0, max_output_tokens=6,
                                     extra_body={"ignore_eos": True}).output_text
    stop = longer[len(longer) // 2:][:2]
    expected = longer[:longer.index(stop)]
    assert expected, longer
    return {"stop": [stop]}, expected


def test_plain_text_is_the_chat_completion_of_the_same_conversation(served, stopping):
    client, url = served
    response = client.responses.create(model="tiny", input=QUESTION, instructions=INSTRUCTIONS, max_output_tokens=8,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert response.id.startswith("resp_") and response.object == "response" and response.model == "tiny"
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.instructions == INSTRUCTIONS and response.max_output_tokens == 8 and response.error is None
    (message,) = response.output
    assert message.type == "message" and message.role == "assistant" and message.id.startswith("msg_")
    assert response.output_text and message.content[0].text == response.output_text

    messages = [{"role": "system", "content": INSTRUCTIONS}, {"role": "user", "content": QUESTION}]
    prompt_tokens = httpx.post(f"{url}/tokenize", json={"model": "tiny", "messages": messages}).json()["count"]
    usage = response.usage
    assert usage.input_tokens == prompt_tokens and usage.output_tokens == 8
    assert usage.total_tokens == prompt_tokens + 8 and usage.output_tokens_details.reasoning_tokens == 0
    chat = client.chat.completions.create(model="tiny", messages=messages, max_tokens=8, temperature=0,
                                          extra_body={"ignore_eos": True})
    assert chat.choices[0].message.content == response.output_text
    assert (chat.usage.prompt_tokens, chat.usage.completion_tokens) == (usage.input_tokens, usage.output_tokens)

    stops, expected = stopping
    finished = client.responses.create(model="tiny", input=QUESTION, temperature=0, extra_body=stops)
    assert finished.status == "completed" and finished.incomplete_details is None
    assert finished.output[0].status == "completed" and finished.output_text == expected


def test_streamed_events_parse_and_add_up_to_the_whole_response(served, stopping):
    client, _ = served
    stops, expected = stopping
    whole = client.responses.create(model="tiny", input=QUESTION, temperature=0, extra_body=stops)
    events = list(client.responses.create(model="tiny", input=QUESTION, temperature=0, stream=True, extra_body=stops))
    types = [event.type for event in events]
    deltas = [event.delta for event in events if event.type == "response.output_text.delta"]
    assert deltas and types == ["response.created", "response.in_progress", *TEXT_EVENTS[:2],
                                *["response.output_text.delta"] * len(deltas), *TEXT_EVENTS[2:], "response.completed"]
    assert [event.sequence_number for event in events] == list(range(len(events)))
    final = events[-1].response
    assert "".join(deltas) == final.output_text == whole.output_text == expected
    assert events[0].response.status == "in_progress" and final.status == "completed"
    assert final.usage.input_tokens == whole.usage.input_tokens
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert final.output[0].id == events[2].item.id == events[-2].item.id

    with client.responses.stream(model="tiny", input=QUESTION, temperature=0, extra_body=stops) as stream:
        helped = stream.get_final_response()
    assert helped.output_text == whole.output_text and helped.status == "completed"

    cut = list(client.responses.create(model="tiny", input=QUESTION, max_output_tokens=3, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True}))
    assert cut[-1].type == "response.incomplete" and cut[-1].response.usage.output_tokens == 3
    assert cut[-1].response.incomplete_details.reason == "max_output_tokens"
    assert cut[-2].type == "response.output_item.done" and cut[-2].item.status == "incomplete"


def test_a_tool_round_trip_by_items_and_by_previous_response_id(served):
    client, _ = served
    first = client.responses.create(model="tiny", input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
                                    max_output_tokens=80, temperature=1.0, extra_body={"seed": 1})
    assert first.status == "completed"
    (call,) = first.output
    assert call.type == "function_call" and call.name == "get_weather" and call.status == "completed"
    assert call.call_id.startswith("call_") and call.id.startswith("fc_")
    jsonschema.validate(json.loads(call.arguments), WEATHER_PARAMETERS)
    assert first.tools[0].name == "get_weather" and first.tool_choice.name == "get_weather"

    answer = {"type": "function_call_output", "call_id": call.call_id, "output": "sunny"}
    settings = dict(model="tiny", tools=[WEATHER], max_output_tokens=6, temperature=0, extra_body={"ignore_eos": True})
    replayed = client.responses.create(input=[{"role": "user", "content": QUESTION}, *first.output, answer], **settings)
    continued = client.responses.create(previous_response_id=first.id, input=[answer], **settings)
    assert [item.type for item in replayed.output] == ["message"] and replayed.output_text
    assert continued.output_text == replayed.output_text and continued.previous_response_id == first.id
    assert continued.usage.input_tokens == replayed.usage.input_tokens > first.usage.input_tokens

    events = list(client.responses.create(model="tiny", input=QUESTION, tools=[WEATHER], tool_choice=FORCED,
                                          max_output_tokens=80, temperature=1.0, stream=True, extra_body={"seed": 1}))
    types = [event.type for event in events]
    assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
    assert types[-3:] == ["response.function_call_arguments.done", "response.output_item.done", "response.completed"]
    assert set(types[3:-3]) == {"response.function_call_arguments.delta"}
    arguments = "".join(event.delta for event in events if event.type == "response.function_call_arguments.delta")
    (streamed_call,) = events[-1].response.output
    assert streamed_call.arguments == arguments == events[-3].arguments
    jsonschema.validate(json.loads(arguments), WEATHER_PARAMETERS)
    assert client.responses.retrieve(events[-1].response.id).output[0].arguments == arguments  # streamed, stored


def test_json_schema_output_holds_its_schema(served):
    client, _ = served
    text = {"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}}
    finished = 0
    for seed in range(4):
        response = client.responses.create(model="tiny", input="Describe a person.", text=text, max_output_tokens=60,
                                           temperature=1.0, extra_body={"seed": seed})
        if response.status == "completed":
            jsonschema.validate(json.loads(response.output_text), PERSON)
            finished += 1
    assert finished >= 2
    assert response.text.format.type == "json_schema" and response.text.format.name == "person"


def test_stored_responses_are_read_deleted_and_forgotten(served):
    client, url = served
    kept = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, metadata={"case": "store"})
    read = client.responses.retrieve(kept.id)
    assert read.id == kept.id and read.output_text == kept.output_text and read.metadata == {"case": "store"}
    client.responses.delete(kept.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(kept.id)
    assert httpx.delete(f"{url}/v1/responses/{kept.id}").status_code == 404
    with pytest.raises(openai.BadRequestError) as refused:
        client.responses.create(model="tiny", previous_response_id=kept.id, input="And now?", max_output_tokens=2)
    assert refused.value.body["param"] == "previous_response_id" and "not stored here" in refused.value.body["message"]

    unkept = client.responses.create(model="tiny", input=QUESTION, max_output_tokens=2, store=False)
    assert unkept.store is False
    missing = httpx.get(f"{url}/v1/responses/{unkept.id}")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found_error"


@pytest.mark.parametrize("fields, param, mentions", [
    ({"temperatur": 0}, "temperatur", "not supported"),
    ({"tools": [{"type": "web_search"}]}, "tools", "'web_search' are not supported"),
    ({"truncation": "auto"}, "truncation", "truncation 'auto' is not supported"),
    ({"tool_choice": {"type": "file_search"}}, "tool_choice", "'file_search' is not supported"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice", "not among the tools"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "https://example.com/a.png"}]}]},
     "input", "'tiny' takes no images"),
    ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "file-1"}]}]},
     "input", "file inputs (input_file) are not supported"),
    ({"previous_response_id": "resp_missing"}, "previous_response_id", "not stored here"),
    ({"metadata": {str(i): "x" for i in range(17)}}, "metadata", "at most 16"),
])
def test_client_mistakes_are_400s_naming_the_problem(served, fields, param, mentions):
    _, url = served
    response = httpx.post(f"{url}/v1/responses", json={"model": "tiny", "input": QUESTION, "max_output_tokens": 2,
                                                       **fields}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param and mentions in error["message"]


def test_a_client_that_goes_away_aborts_its_stream(served):
    _, url = served
    aborted = lambda samples: metric(samples, "tokenmill:request_success_total", finish_reason="abort")
    before = aborted(metric_samples(url))
    body = {"model": "tiny", "input": QUESTION, "max_output_tokens": 1900, "stream": True, "ignore_eos": True}
    with httpx.Client(timeout=60) as http:
        with http.stream("POST", f"{url}/v1/responses", json=body) as response:
            lines = response.iter_lines()  # not a for/break: closing this iterator drops the connection
            while "response.output_text.delta" not in next(lines):
                pass
            assert metric(metric_samples(url), "tokenmill:num_requests_running") == 1
    wait_for_metrics(url, lambda samples: metric(samples, "tokenmill:num_requests_running") == 0
                     and aborted(samples) == before + 1, timeout=10)


def test_a_conversation_goes_on_after_the_server_is_killed(tmp_path):
    """kill -9 of a server with --state-dir, a restart on the same folder: the next turn continuing the stored
    response answers as the killed server would have (every stored response is committed when it is answered)."""
    import os
    import signal

    model = str(make_tiny_hf_model(tmp_path / "model"))
    args = (model, "--max-model-len", "512", "--num-kv-blocks", "64", "--served-model-name", "tiny",
            "--state-dir", str(tmp_path / "state"))
    turn = dict(model="tiny", temperature=0, max_output_tokens=6, extra_body={"ignore_eos": True})
    first = ServerProcess(*args, log_path=tmp_path / "first.log").start().wait_ready()
    try:
        client = OpenAI(base_url=f"{first.url}/v1", api_key="none", max_retries=0)
        opened = client.responses.create(input=QUESTION, **turn)
        expected = client.responses.create(input="And tomorrow?", previous_response_id=opened.id, store=False, **turn)
        os.kill(first.proc.pid, signal.SIGKILL)
        assert first.proc.wait(timeout=60) == -signal.SIGKILL
    finally:
        first.stop()
    second = ServerProcess(*args, log_path=tmp_path / "second.log").start().wait_ready()
    with second.running():
        client = OpenAI(base_url=f"{second.url}/v1", api_key="none", max_retries=0)
        assert client.responses.retrieve(opened.id).output_text == opened.output_text
        again = client.responses.create(input="And tomorrow?", previous_response_id=opened.id, **turn)
        assert again.output_text == expected.output_text and again.usage.input_tokens == expected.usage.input_tokens
