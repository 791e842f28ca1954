"""`serve --otlp-traces-endpoint`: each request reaches an OTLP collector as one span with its queue,
prefill and decode phases, continuing the trace of the caller's traceparent header."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
import uvicorn
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from e2e.server_harness import ServerProcess, free_port
from helpers.tiny_models import make_tiny_hf_model
from tokenmill.engine.tracing import traces_url

TRACE_ID, PARENT_ID = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"


class Collector:
    """An OTLP/HTTP traces receiver keeping every span it is sent."""

    def __init__(self) -> None:
        self.spans: list = []

        async def export(request: Request) -> Response:
            message = ExportTraceServiceRequest()
            message.ParseFromString(await request.body())
            for resource in message.resource_spans:
                for scope in resource.scope_spans:
                    self.spans.extend(scope.spans)
            return Response(b"", media_type="application/x-protobuf")

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(Starlette(routes=[Route("/v1/traces", export,
                                                                             methods=["POST"])]),
                                                    port=self.port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()

    def wait_for(self, count: int, timeout: float = 20.0) -> list:
        deadline = time.monotonic() + timeout
        while sum(s.name == "llm_request" for s in self.spans) < count:
            assert time.monotonic() < deadline, f"only {len(self.spans)} spans arrived"
            time.sleep(0.1)
        return self.spans


def attributes(span) -> dict:
    return {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in span.attributes}


@pytest.fixture(scope="module")
def traced(tmp_path_factory):
    collector = Collector()
    model = str(make_tiny_hf_model(tmp_path_factory.mktemp("tiny"), arch="llama"))
    server = ServerProcess(model, "--otlp-traces-endpoint", f"http://127.0.0.1:{collector.port}",
                           "--num-kv-blocks", "128", log_path=tmp_path_factory.mktemp("traced") / "server.log",
                           env={"OTEL_BSP_SCHEDULE_DELAY": "50"}).start()
    try:
        yield server.wait_ready(), collector
    finally:
        server.stop()
        collector.server.should_exit = True


def test_a_request_is_one_span_in_the_callers_trace_with_its_phases(traced):
    server, collector = traced
    answer = httpx.post(f"{server.url}/v1/completions", timeout=60,
                        headers={"traceparent": f"00-{TRACE_ID}-{PARENT_ID}-01"},
                        json={"prompt": "The lighthouse keeper", "max_tokens": 6, "ignore_eos": True})
    assert answer.status_code == 200
    untraced = httpx.post(f"{server.url}/v1/chat/completions", timeout=60, json={
        "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True})
    assert untraced.status_code == 200
    spans = collector.wait_for(2)
    (request,) = [s for s in spans if s.name == "llm_request" and s.trace_id.hex() == TRACE_ID]
    assert request.parent_span_id.hex() == PARENT_ID and request.kind == request.SPAN_KIND_SERVER
    values = attributes(request)
    usage = answer.json()["usage"]
    assert values["gen_ai.request.id"] == answer.json()["id"] + "-0"  # the engine request of prompt 0
    assert values["gen_ai.usage.prompt_tokens"] == usage["prompt_tokens"]
    assert values["gen_ai.usage.completion_tokens"] == usage["completion_tokens"] == 6
    assert values["gen_ai.request.max_tokens"] == 6
    assert 0 < values["gen_ai.latency.time_to_first_token"] <= values["gen_ai.latency.e2e"]
    phases = {s.name: s for s in spans if s.parent_span_id == request.span_id}
    assert set(phases) == {"queue", "prefill", "decode"}
    queue, prefill, decode = phases["queue"], phases["prefill"], phases["decode"]
    assert request.start_time_unix_nano == queue.start_time_unix_nano
    assert queue.end_time_unix_nano <= prefill.start_time_unix_nano <= prefill.end_time_unix_nano
    assert prefill.end_time_unix_nano <= decode.start_time_unix_nano <= decode.end_time_unix_nano
    assert decode.end_time_unix_nano == request.end_time_unix_nano
    (other,) = [s for s in spans if s.name == "llm_request" and s.trace_id.hex() != TRACE_ID]
    assert other.parent_span_id == b""  # no traceparent: a trace of its own
    assert attributes(other)["gen_ai.usage.completion_tokens"] == 3


def test_traces_url_adds_the_otlp_path_only_when_missing():
    assert traces_url("http://collector:4318") == "http://collector:4318/v1/traces"
    assert traces_url("collector:4318/") == "http://collector:4318/v1/traces"
    assert traces_url("https://x.example/otlp/v1/traces") == "https://x.example/otlp/v1/traces"
