"""schemathesis over the server's own OpenAPI schema: requests generated to fit it (positive), to break
it (negative), and fitting requests with one field swapped for a hostile value (huge integers,
non-finite floats, lone surrogates, deep nesting: what a schema cannot express and careless clients
send), against a real `tokenmill serve`. No response may be a 5xx, and the server must be healthy with
nothing left running afterwards.

The server runs a tiny random-weight model with the default model's tokenizer and --max-model-len 64,
so any accepted request is short. TOKENMILL_FUZZ_EXAMPLES sets the examples per operation and mode
(CI: 10; `make reliability`: 1000); the run is derandomised, so CI sees the same requests every time.
At CI size the hostile values go into the fields each endpoint's schema declares, plus one it does not (the
rejection of an unknown field is one path whatever the field); TOKENMILL_RELIABILITY_SCALE above 1 (`make
reliability`) puts them into every field of SAMPLING_FIELDS on every endpoint.
"""

from __future__ import annotations

import json
import os

import httpx
import hypothesis.strategies as st
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode

from e2e.server_harness import ServerProcess, metric, wait_for_metrics
from helpers.tiny_models import make_tiny_hf_model

EXAMPLES = int(os.environ.get("TOKENMILL_FUZZ_EXAMPLES", "10"))
EVERY_FIELD = int(os.environ.get("TOKENMILL_RELIABILITY_SCALE", "1")) > 1
HOSTILE_VALUES = [2 ** 64, 2 ** 75, -(2 ** 70), 1e308, float("inf"), float("-inf"), float("nan"), "\ud800",
                  "a\udfffb", {"k": 1}, [[[[[1]]]]], [2 ** 65], {str(2 ** 70): 1.0}, {"49152": 1.0}, 0, -1, None,
                  # a schema no value satisfies ($refs in a cycle), and JSON text nested 20,000 deep (under the 64 KiB
                  # bound on a constraint)
                  {"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a"}}},
                  "[" * 20000 + "]" * 20000]
# A hostile value replaces one of these fields of a minimal valid body of the operation.
SAMPLING_FIELDS = ["max_tokens", "temperature", "top_p", "top_k", "min_p", "n", "seed", "stop", "logit_bias",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens", "logprobs",
                   "top_logprobs", "stop_token_ids", "priority", "guided_choice", "guided_regex", "guided_json",
                   "prompt", "messages", "tokens", "cache_salt", "max_completion_tokens", "response_format",
                   # the Messages and Responses APIs' own
                   "system", "stop_sequences", "tools", "tool_choice", "thinking", "metadata", "input", "instructions",
                   "max_output_tokens", "text", "previous_response_id", "chat_template_kwargs"]


@pytest.fixture(scope="module")
def fuzz_server(tmp_path_factory):
    model = make_tiny_hf_model(tmp_path_factory.mktemp("tiny") / "model")
    proc = ServerProcess(str(model), "--max-model-len", "64", "--num-kv-blocks", "256",
                         log_path=tmp_path_factory.mktemp("fuzz") / "server.log")
    proc.start().wait_ready()
    yield proc
    assert proc.stop() == 0, proc.log()[-3000:]


BASE_BODIES = {"/v1/completions": {"prompt": "hi", "max_tokens": 4},
               "/v1/chat/completions": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
               "/tokenize": {"prompt": "hi"}, "/detokenize": {"tokens": [1, 2]},
               "/v1/messages": {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
               "/v1/messages/count_tokens": {"messages": [{"role": "user", "content": "hi"}]},
               "/v1/responses": {"input": "hi", "max_output_tokens": 4}}
NEEDS_MODEL = {"/v1/messages", "/v1/messages/count_tokens"}  # Anthropic's bodies must name the model


def well_shaped_error(path: str, response: httpx.Response) -> bool:
    """Whether a 4xx answer is in the error shape of its API: Anthropic's under /v1/messages, OpenAI's elsewhere."""
    try:
        body = response.json()
    except ValueError:
        return False
    if path.startswith("/v1/messages"):
        return body.get("type") == "error" and isinstance(body.get("error", {}).get("message"), str)
    return isinstance(body.get("error"), dict) and isinstance(body["error"].get("message"), str)


def hostile_fields(url: str, path: str) -> list[str]:
    """The SAMPLING_FIELDS that get hostile values on `path`: all of them with EVERY_FIELD, else those its request
    body's schema declares and the first one it does not."""
    if EVERY_FIELD:
        return SAMPLING_FIELDS
    schema = httpx.get(f"{url}/openapi.json", timeout=10).json()
    ref = schema["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
    declared = schema["components"]["schemas"][ref.rsplit("/", 1)[1]]["properties"]
    known = [field for field in SAMPLING_FIELDS if field in declared]
    unknown = [field for field in SAMPLING_FIELDS if field not in declared]
    assert known, f"{path} declares none of SAMPLING_FIELDS: the schema lookup is broken"
    return known + unknown[:1]


def operations(url: str):
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    return [result.ok() for result in schema.get_all_operations()]


def test_no_generated_request_gets_a_server_error(fuzz_server):
    url = fuzz_server.url
    model = httpx.get(f"{url}/v1/models", timeout=10).json()["data"][0]["id"]
    failures: list[str] = []
    checked = 0
    generated = operations(url)
    for operation in generated:
        strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                             operation.as_strategy(GenerationMode.NEGATIVE))

        @settings(max_examples=2 * EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(item=strategy)
        def exercise(item) -> None:
            nonlocal checked
            if isinstance(item.body, dict):
                item.body.pop("model", None)  # a random model name is a 404 before anything else is read
                if operation.path in NEEDS_MODEL:
                    item.body["model"] = model
            response = item.call(base_url=url, timeout=60)
            checked += 1
            if response.status_code >= 500:
                failures.append(f"{operation.label} -> {response.status_code}: {response.text[:200]}\n"
                                f"  body: {str(item.body)[:300]}")
            elif response.status_code >= 400 and not well_shaped_error(operation.path, response):
                failures.append(f"{operation.label} -> {response.status_code} not in its API's error shape: "
                                f"{response.text[:200]}")

        exercise()
    print(f"\nfuzz: {checked} requests over {len(generated)} operations, {len(failures)} server errors")
    assert not failures, "\n".join(failures[:10])
    assert httpx.get(f"{url}/health", timeout=10).status_code == 200
    wait_for_metrics(url, lambda s: metric(s, "tokenmill:num_requests_running") == 0
                     and metric(s, "tokenmill:kv_cache_usage_perc") == 0, timeout=60)


def test_no_hostile_field_value_gets_a_server_error(fuzz_server):
    """Every field x every hostile value, one at a time, on a minimal valid body of each endpoint (the fields: see
    hostile_fields). The full product, not pairwise: which value breaks which field's handling is the point."""
    failures: list[str] = []
    model = httpx.get(f"{fuzz_server.url}/v1/models", timeout=10).json()["data"][0]["id"]
    sent = 0
    with httpx.Client(base_url=fuzz_server.url, timeout=60) as client:
        for path, base in BASE_BODIES.items():
            base = {**base, "model": model} if path in NEEDS_MODEL else base
            for field in hostile_fields(fuzz_server.url, path):
                for value in HOSTILE_VALUES:
                    # raw JSON text: Infinity / NaN literals and \ud800 escapes, as a careless client writes them
                    body = json.dumps({**base, field: value})
                    sent += 1
                    try:
                        response = client.post(path, content=body, headers={"content-type": "application/json"})
                    except httpx.TransportError as exc:
                        failures.append(f"{path} {field}={value!r} -> connection lost: {exc!r}")
                        continue
                    if response.status_code >= 500:
                        failures.append(f"{path} {field}={value!r} -> {response.status_code}: {response.text[:150]}")
                    elif response.status_code >= 400 and not well_shaped_error(path, response):
                        failures.append(f"{path} {field}={value!r} -> {response.status_code} not in its API's error "
                                        f"shape: {response.text[:150]}")
    print(f"\nhostile values: {sent} requests, "
          f"{len(failures)} server errors")
    assert not failures, "\n".join(failures[:20])
    assert httpx.get(f"{fuzz_server.url}/health", timeout=10).status_code == 200
