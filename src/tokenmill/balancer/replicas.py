"""The engine processes of `serve --data-parallel-size N`: each a whole `tokenmill serve` on a private port."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from typing import Any, Optional

from tokenmill import envs
from tokenmill.balancer.kv_index import EventSource
from tokenmill.config import EngineConfig, ServerConfig
from tokenmill.kv_events_config import KVEventsConfig

# server options a replica takes from the balancer's own, and those that belong to the front only
_FRONT_ONLY = {"host", "port", "data_parallel_size", "api_key", "api_key_file"}


def flag_args(section: Any) -> list[str]:
    """Command-line flags that rebuild config dataclass `section` (fields left at their default omitted)."""
    args: list[str] = []
    for f in dataclasses.fields(section):
        value = getattr(section, f.name)
        if value == f.default or f.name in _FRONT_ONLY:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            args.append(flag if value else "--no-" + flag[2:])
        elif isinstance(value, (list, tuple)):  # an nargs="+" flag: one argument a value
            args += [flag, *(str(item) for item in value)]
        else:
            args += [flag, str(value)]
    return args


@dataclass
class ReplicaProcess:
    """One replica: its rank, port, the events it publishes, and its process once started."""

    rank: int
    port: int
    command: list[str]
    env: dict[str, str]
    events: Optional[EventSource]
    proc: Optional[subprocess.Popen] = None
    ever_healthy: bool = False  # a replica that never came up is not restarted: its start itself fails
    restarts: int = 0
    restart_at: Optional[float] = None  # when a replica that died is started again (time.monotonic())

    @property
    def url(self) -> str:
        """Where it serves."""
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        """Launch the process; it writes to the front's own output, and is sent SIGTERM if the front dies."""
        self.proc = subprocess.Popen(self.command, stdin=subprocess.DEVNULL, env=self.env,
                                     preexec_fn=_terminate_with_parent if sys.platform == "linux" else None)

    @property
    def exited(self) -> Optional[int]:
        """Its exit code once it has ended, else None."""
        return None if self.proc is None else self.proc.poll()

    def stop(self, timeout: float) -> None:
        """SIGTERM (the replica's graceful shutdown), then SIGKILL after `timeout` seconds."""
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _terminate_with_parent() -> None:
    """In the child before exec: ask Linux for SIGTERM when the front dies, so no replica outlives it."""
    import ctypes
    import signal
    ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def plan_replicas(engine: EngineConfig, server: ServerConfig, ports: list[int], api_key: Optional[str],
                  workdir: Optional[str] = None) -> list[ReplicaProcess]:
    """The replicas' commands: the same model and engine options, rank r on ports[r], KV events on
    (the user's --kv-events-config offset by rank, else private ipc sockets the balancer reads), the
    host's cores shared out between them unless OMP_NUM_THREADS says otherwise."""
    workdir = workdir or tempfile.mkdtemp(prefix="tokenmill-dp-")
    size = server.data_parallel_size
    events = KVEventsConfig.parse(engine.cache.kv_events_config)
    if not events.active and engine.cache.prefix_caching:
        events = KVEventsConfig(enable_kv_cache_events=True, endpoint=f"ipc://{workdir}/kv-events",
                                replay_endpoint=f"ipc://{workdir}/kv-replay")
    threads = envs.omp_num_threads() or str(max(1, (os.cpu_count() or 1) // size))
    env = envs.environment_with(OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1")
    if api_key:
        env["TOKENMILL_API_KEY"] = api_key
    replicas = []
    for rank in range(size):
        cache = dataclasses.replace(engine.cache, kv_events_config=_json(events) if events.active else None)
        parallel = dataclasses.replace(engine.parallel, data_parallel_rank=rank)
        command = [sys.executable, "-m", "tokenmill.cli.main", "serve", "--host", "127.0.0.1", "--port",
                   str(ports[rank])]
        for section in (engine.model, cache, engine.scheduler, engine.speculative, parallel, server):
            command += flag_args(section)
        source = None
        if events.active:
            mine = events.for_rank(rank)
            source = EventSource(_reachable(mine.endpoint),
                                 _reachable(mine.replay_endpoint) if mine.replay_endpoint else None, mine.topic)
        replicas.append(ReplicaProcess(rank, ports[rank], command, env, source))
    return replicas


def _json(config: KVEventsConfig) -> str:
    import json
    return json.dumps(dataclasses.asdict(config))


def _reachable(endpoint: str) -> str:
    """A bound address as a local subscriber connects to it (tcp://*:P -> tcp://127.0.0.1:P)."""
    if endpoint.startswith("tcp://*:"):
        return "tcp://127.0.0.1:" + endpoint.rsplit(":", 1)[1]
    return endpoint
