"""The data-parallel front against fake replicas: retries before the first byte, 429 fallback, routing."""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from tokenmill.balancer.app import PromptReader, build_balancer_app
from tokenmill.balancer.policy import Balancer, Replica


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class FakeReplica:
    """A replica that answers /health and /v1/completions with `status` (counting the completions)."""

    def __init__(self, name: str, status: int = 200) -> None:
        self.name, self.status, self.calls = name, status, 0

        async def health(request):
            return Response(status_code=200)

        async def completions(request):
            self.calls += 1
            return JSONResponse({"served_by": self.name}, self.status)

        app = Starlette(routes=[Route("/health", health), Route("/v1/completions", completions, methods=["POST"])])
        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, port=self.port, log_level="error"))
        threading.Thread(target=self.server.run, daemon=True).start()
        while not self.server.started:
            time.sleep(0.01)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


class DroppingReplica:
    """A replica that is healthy but drops every generation request's connection before answering."""

    def __init__(self) -> None:
        self.listener = socket.socket()
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(16)
        self.url = f"http://127.0.0.1:{self.listener.getsockname()[1]}"
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            connection, _ = self.listener.accept()
            with connection:
                request = connection.recv(65536)
                if request.startswith(b"GET /health"):
                    connection.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n")


class Proc:
    """A replica process that is running (the watcher asks)."""

    def __init__(self, rank: int, url: str) -> None:
        self.rank, self.url, self.exited = rank, url, None
        self.ever_healthy = False


@pytest.fixture
def front():
    """Start a front over the replicas given (healthy from the start); yield its URL and balancer."""
    running = []

    def start(urls: list[str]):
        replicas = [Replica(rank, url, healthy=True) for rank, url in enumerate(urls)]
        balancer = Balancer(replicas, None, 4, None)
        app = build_balancer_app(balancer, [Proc(r.rank, r.url) for r in replicas], PromptReader(None, None),
                                 1 << 20, lambda: None)
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, port=port, log_level="error"))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.01)
        running.append(server)
        return f"http://127.0.0.1:{port}", balancer

    yield start
    for server in running:
        server.should_exit = True


def test_a_replica_that_fails_before_answering_is_marked_down_and_another_answers(front):
    live = FakeReplica("live")
    url, balancer = front([DroppingReplica().url, live.url])
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert answer.status_code == 200 and answer.json() == {"served_by": "live"}
    assert not balancer.replicas[0].healthy and balancer.replicas[0].in_flight == 0
    metrics = httpx.get(f"{url}/metrics", timeout=10).text
    assert 'tokenmill_dp_requests_retried_total{engine="0"} 1.0' in metrics


def test_a_busy_replica_hands_the_request_to_the_next_and_429_only_when_all_are_busy(front):
    busy, free = FakeReplica("busy", 429), FakeReplica("free")
    url, _ = front([busy.url, free.url])
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10).json() == {"served_by": "free"}
    assert busy.calls == 1
    both_busy = FakeReplica("b1", 429), FakeReplica("b2", 429)
    url, _ = front([r.url for r in both_busy])
    assert httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10).status_code == 429


def test_a_body_the_front_cannot_parse_goes_to_a_replica_which_answers_for_it(front):
    """Not JSON, or JSON nested past the parser's recursion (50,000 deep): routed without a prompt, never a 500
    of the front's own."""
    live = FakeReplica("live")
    url, _ = front([live.url])
    for body in (b"{not json", b'{"prompt": ' + b"[" * 50000 + b"]" * 50000 + b"}"):
        answer = httpx.post(f"{url}/v1/completions", content=body, headers={"content-type": "application/json"},
                            timeout=10)
        assert answer.status_code == 200 and answer.json() == {"served_by": "live"}
    assert live.calls == 2


def test_no_replica_up_is_a_503_in_the_openai_error_shape(front):
    url, balancer = front([f"http://127.0.0.1:{free_port()}"])
    answer = httpx.post(f"{url}/v1/completions", json={"prompt": "hi"}, timeout=10)
    assert answer.status_code == 503 and answer.json()["error"]["type"] == "server_error"
    assert httpx.get(f"{url}/health", timeout=10).status_code == 503


def test_load_decides_without_a_prefix_index():
    replicas = [Replica(0, "a", healthy=True), Replica(1, "b", healthy=True)]
    balancer = Balancer(replicas, None, 4, None)
    first = balancer.choose(list(range(20)), 100)
    second = balancer.choose(list(range(20)), 100)
    assert (first.replica.rank, second.replica.rank) == (0, 1)  # the second goes where less is outstanding
    balancer.done(first)
    assert balancer.choose([1, 2, 3], 10).replica.rank == 0
    assert balancer.choose([1], 1, exclude=frozenset({0, 1})) is None


def test_response_homes_remember_which_replica_made_a_response():
    from tokenmill.balancer.response_homes import ResponseHomes

    homes = ResponseHomes(max_entries=2)
    homes.note_answer(b'{"id": "resp_0a", "object": "response"}', 1)
    homes.note_stream(b'event: response.created\ndata: {"type":"response.created","sequence_number":0,'
                      b'"response":{"id":"resp_0b","object":"response"}}\n\n', 0)
    homes.note_answer(b'{"error": {"message": "no"}}', 1)  # an error names no response
    homes.note_answer(b"not json", 1)
    assert homes.home("POST", "/v1/responses", {"previous_response_id": "resp_0a", "input": "x"}) == 1
    assert homes.home("GET", "/v1/responses/resp_0b", None) == 0
    assert homes.home("DELETE", "/v1/responses/resp_0a", None) == 1
    assert homes.home("POST", "/v1/responses", {"input": "x"}) is None
    assert homes.home("POST", "/v1/chat/completions", {"previous_response_id": "resp_0a"}) is None
    homes.note("resp_0c", 0)  # the oldest is forgotten past max_entries
    assert homes.home("GET", "/v1/responses/resp_0a", None) is None


def test_replicas_get_list_flags_as_one_argument_a_value():
    from tokenmill.balancer.replicas import flag_args
    from tokenmill.config import ServerConfig

    args = flag_args(ServerConfig(lora_modules=["a=/x", "b=/y"], max_tools=7))
    assert args[args.index("--lora-modules"):][:3] == ["--lora-modules", "a=/x", "b=/y"]
    assert args[args.index("--max-tools") + 1] == "7"
