"""OpenTelemetry traces of requests (`serve --otlp-traces-endpoint`, as vLLM spells it).

Each request that ends becomes one span, "llm_request", from its arrival to its end, with three
children — "queue" (arrival to first scheduled), "prefill" (to the first token) and "decode" (to the
end) — and vLLM's gen_ai.* attributes. When the HTTP request carried a W3C `traceparent` header,
the span continues that trace as its child. Spans are exported over OTLP/HTTP (protobuf) in batches
by the SDK's background thread; the engine never waits for the collector.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any, Mapping, Optional

from tokenmill import envs
from tokenmill.outputs import RequestOutput
from tokenmill.sampling_params import SamplingParams

# the trace headers of the HTTP request being served (set by the server for the request's task)
incoming_trace: contextvars.ContextVar[Optional[Mapping[str, str]]] = contextvars.ContextVar(
    "incoming_trace", default=None)
TRACE_HEADERS = ("traceparent", "tracestate")


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of `endpoint`: as given when it has a path, else with /v1/traces."""
    if "://" not in endpoint:
        endpoint = "http://" + endpoint
    scheme, rest = endpoint.split("://", 1)
    return endpoint if "/" in rest.strip("/") else f"{scheme}://{rest.rstrip('/')}/v1/traces"


class RequestTracer:
    """Turns finished requests into spans sent to an OTLP collector."""

    def __init__(self, endpoint: str, model_name: str) -> None:
        protocol = envs.otlp_traces_protocol()
        if protocol != "http/protobuf":
            raise ValueError(f"otlp_traces_endpoint: only the http/protobuf protocol is supported, but "
                             f"OTEL_EXPORTER_OTLP_TRACES_PROTOCOL is {protocol!r}")
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as exc:
            raise ValueError("otlp_traces_endpoint needs the OpenTelemetry SDK and OTLP exporter: "
                             "pip install 'tokenmill[otel]'") from exc
        self.model_name = model_name
        self.url = traces_url(endpoint)
        resource = Resource.create({"service.name": envs.otel_service_name()})
        self._provider = TracerProvider(resource=resource)
        self._provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=self.url)))
        self._tracer = self._provider.get_tracer("tokenmill")
        self._propagator = TraceContextTextMapPropagator()

    def record(self, request_id: str, output: Optional[RequestOutput], params: SamplingParams, prompt_tokens: int,
               completion_tokens: int, parent: Optional[Mapping[str, str]], error: Optional[str] = None) -> None:
        """One span (and its phases) for a request that ended; `output` is its last output, if any."""
        from opentelemetry.trace import SpanKind, Status, StatusCode

        metrics = output.metrics if output is not None else None
        now_monotonic, now_ns = time.monotonic(), time.time_ns()

        def wall(t: Optional[float]) -> Optional[int]:
            return None if t is None else now_ns - int((now_monotonic - t) * 1e9)

        arrival = wall(metrics.arrival_time) if metrics else now_ns
        scheduled = wall(metrics.first_scheduled_time) if metrics else None
        first_token = wall(metrics.first_token_time) if metrics else None
        end = (wall(metrics.finished_time) if metrics else None) or now_ns
        context = self._propagator.extract(parent) if parent else None
        attributes: dict[str, Any] = {
            "gen_ai.request.id": request_id, "gen_ai.response.model": self.model_name,
            "gen_ai.request.temperature": params.temperature, "gen_ai.request.top_p": params.top_p,
            "gen_ai.request.n": params.n, "gen_ai.usage.prompt_tokens": prompt_tokens,
            "gen_ai.usage.completion_tokens": completion_tokens,
            "gen_ai.latency.e2e": (end - arrival) / 1e9,
        }
        if params.max_tokens is not None:
            attributes["gen_ai.request.max_tokens"] = params.max_tokens
        if scheduled is not None:
            attributes["gen_ai.latency.time_in_queue"] = (scheduled - arrival) / 1e9
        if first_token is not None:
            attributes["gen_ai.latency.time_to_first_token"] = (first_token - arrival) / 1e9
            attributes["gen_ai.latency.time_in_model_decode"] = (end - first_token) / 1e9
            if scheduled is not None:
                attributes["gen_ai.latency.time_in_model_prefill"] = (first_token - scheduled) / 1e9
        if metrics is not None and metrics.num_cached_tokens is not None:
            attributes["gen_ai.usage.cached_tokens"] = metrics.num_cached_tokens
        span = self._tracer.start_span("llm_request", context=context, kind=SpanKind.SERVER,
                                       attributes=attributes, start_time=arrival)
        if error is not None:
            span.set_status(Status(StatusCode.ERROR, error))
        from opentelemetry.trace import set_span_in_context
        inside = set_span_in_context(span)
        phases = [("queue", arrival, scheduled or end), ("prefill", scheduled, first_token or end),
                  ("decode", first_token, end)]
        for name, start, stop in phases:
            if start is not None:
                self._tracer.start_span(name, context=inside, start_time=start).end(end_time=max(start, stop))
        span.end(end_time=end)

    def shutdown(self) -> None:
        """Send what is buffered (up to the SDK's timeout) and stop the export thread."""
        self._provider.shutdown()
