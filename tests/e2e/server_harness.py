"""Run the real `tokenmill serve` as a subprocess on 127.0.0.1 and talk to it.

`ServerProcess.start()` returns at once (so several servers can boot in parallel); `wait_ready()`
blocks until GET /health answers 200. `stop()` always ends the process (SIGTERM, then SIGKILL).
"""

from __future__ import annotations

import contextlib
import functools
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterator, Optional

import httpx
from prometheus_client.parser import text_string_to_metric_families

HOST = "127.0.0.1"


@functools.cache
def local_http() -> httpx.Client:
    """One client for the polls of local servers. `httpx.get()` builds a client per call, and with it a TLS
    context (the CA bundle parsed: ~50 ms of CPU) even for an http:// URL: a poll every 0.1 s spent a third of a
    core on that while the server it waited for was starting on the same two cores."""
    return httpx.Client(timeout=10.0)


def free_port() -> int:
    """An ephemeral port nobody listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


class ServerProcess:
    """One `tokenmill serve MODEL ARGS...` subprocess bound to 127.0.0.1 on a free port."""

    def __init__(self, model: Optional[str], *args: str, log_path: Path, env: Optional[dict[str, str]] = None):
        self.model, self.args, self.log_path = model, list(args), Path(log_path)
        self.env = env
        self.port = 0
        self.proc: Optional[subprocess.Popen] = None
        self._log: Any = None

    @property
    def url(self) -> str:
        return f"http://{HOST}:{self.port}"

    def command(self) -> list[str]:
        model = [self.model] if self.model else []
        return [sys.executable, "-m", "tokenmill.cli.main", "serve", *model, "--host", HOST,
                "--port", str(self.port), *self.args]

    def start(self, port: Optional[int] = None) -> "ServerProcess":
        """Launch on `port` (a restart on the same address), else on a free one."""
        self.port = port or free_port()
        self._log = open(self.log_path, "ab")
        env = {**os.environ, "PYTHONUNBUFFERED": "1", **(self.env or {})}
        self.proc = subprocess.Popen(self.command(), stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env)
        return self

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    @contextlib.contextmanager
    def running(self) -> Iterator["ServerProcess"]:
        """Start, wait until ready and, however the block ends, stop (SIGTERM first)."""
        self.start()
        try:
            yield self.wait_ready()
        finally:
            self.terminate()
            self.stop()

    def wait_ready(self, timeout: float = 180.0) -> "ServerProcess":
        """Block until /health is 200; restart once on a lost port race; raise with the log otherwise."""
        assert self.proc is not None, "start() first"
        deadline = time.monotonic() + timeout
        retried = False
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if not retried and "address already in use" in self.log().lower():
                    retried = True
                    self._close_log()
                    self.start()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()[-4000:]}")
            try:
                if local_http().get(f"{self.url}/health", timeout=2.0).status_code == 200:
                    return self
            except httpx.TransportError:
                pass
            time.sleep(0.1)
        self.stop()
        raise TimeoutError(f"server not healthy after {timeout}s:\n{self.log()[-4000:]}")

    def terminate(self) -> None:
        """Send SIGTERM without waiting (stop() then waits), so several servers stop in parallel."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)

    def stop(self, timeout: float = 15.0) -> Optional[int]:
        """End the process (SIGTERM, then SIGKILL) and return its exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self._close_log()
        return self.proc.returncode

    def _close_log(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


# ---------------------------------------------------------------------------------------- helpers
def metric_samples(base_url: str, headers: Optional[dict[str, str]] = None) -> dict[tuple, float]:
    """GET /metrics as {(sample name, frozenset of labels without model_name): value}."""
    response = local_http().get(f"{base_url}/metrics", headers=headers, timeout=10.0)
    response.raise_for_status()
    samples = {}
    for family in text_string_to_metric_families(response.text):
        for sample in family.samples:
            labels = frozenset((k, v) for k, v in sample.labels.items() if k != "model_name")
            samples[(sample.name, labels)] = sample.value
    return samples


def metric(samples: dict[tuple, float], name: str, **labels: str) -> float:
    """One sample's value (0 when absent, as Prometheus treats a never-incremented labelled counter)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def wait_for_metrics(base_url: str, predicate, timeout: float = 10.0) -> dict[tuple, float]:
    """Poll /metrics until `predicate(samples)` holds; return the samples (raise on timeout)."""
    deadline = time.monotonic() + timeout
    samples = metric_samples(base_url)
    while not predicate(samples):
        if time.monotonic() > deadline:
            interesting = {k: v for k, v in samples.items()
                           if "running" in k[0] or "kv_cache" in k[0] or "success" in k[0] or "waiting" in k[0]}
            raise AssertionError(f"metrics condition not met within {timeout}s: {interesting}")
        time.sleep(0.1)
        samples = metric_samples(base_url)
    return samples


def sse_events(lines) -> list[str]:
    """The `data:` payloads of a raw SSE body given as an iterable of lines; checks the framing."""
    events, pending = [], None
    for line in lines:
        if line == "":
            if pending is not None:
                events.append(pending)
                pending = None
            continue
        assert line.startswith("data: "), f"not an SSE data line: {line!r}"
        assert pending is None, "one data line per event expected"
        pending = line[len("data: "):]
    assert pending is None, "the stream ended in the middle of an event"
    return events
